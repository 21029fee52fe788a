"""``probe(endpoint)``: ask a running stage for its health (for ``zmq-omni health`` and healthchecks)."""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import (
    AuthenticationError,
    ConfigError,
    DecodeError,
    PeerGoneError,
    TransportError,
    TransportTimeoutError,
    format_seconds,
)
from ._endpoints import check_endpoint
from ._envelope import Kind, pack, unpack
from ._sockets import close_socket, new_context

__all__ = ["probe"]

_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def probe(
    endpoint: str,
    *,
    timeout_s: float = 2.0,
    server_key: str | None = None,
    public_key: str | None = None,
    secret_key: str | None = None,
) -> dict[str, Any]:
    """Send a HEALTH request to the stage bound at ``endpoint`` and return its health dict.

    Works against a push-mode receiver and a pull-mode sender (whichever side binds).
    For a CURVE server pass its public ``server_key`` and the prober's key pair
    (``public_key``, ``secret_key``: a client the server admits); without a pair the
    probe uses a throwaway one, which a server with an allow-list refuses. A
    refused or missing handshake fails at once (no waiting out ``timeout_s``).

    Raises:
        AuthenticationError: the stage requires CURVE and no ``server_key`` was given,
            or it refused our keys (not on its allow-list, or the wrong server key).
        PeerGoneError: nothing accepted the connection within ``timeout_s``.
        TransportTimeoutError: connected, but no answer within ``timeout_s``.
        TransportError: the answer was not a health reply.
        ConfigError: ``endpoint`` is malformed, or a key pair was half given.
    """
    check_endpoint(endpoint, "endpoint")
    if (public_key is None) != (secret_key is None):
        raise ConfigError("a probe's CURVE public_key and secret_key must be given together")
    ctx = new_context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    if server_key is not None:
        if public_key is None or secret_key is None:
            public, secret = zmq.curve_keypair()
        else:
            public, secret = public_key.encode("ascii"), secret_key.encode("ascii")
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | _FAILED)
    try:
        sock.connect(endpoint)
        sock.send(pack(Kind.HEALTH, ()))
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected = False
        while (remaining := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(remaining * 1000) + 1))
            if monitor in ready:
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                connected = True
                if event & _FAILED:
                    raise _refused(event, endpoint, curve=server_key is not None)
            if sock in ready:
                try:
                    kind, header, _ = unpack(sock.recv())
                except DecodeError as exc:
                    raise TransportError(f"not a zmq_omni stage: {exc}", endpoint=endpoint) from exc
                if kind is not Kind.HEALTH_REPLY or not isinstance(header[0], dict):
                    raise TransportError(f"unexpected {kind.name} answer to a health probe", endpoint=endpoint)
                return header[0]
        if not connected:
            raise PeerGoneError(
                f"nothing is listening (no connection within {format_seconds(timeout_s)})", endpoint=endpoint
            )
        raise TransportTimeoutError(
            f"connected but no health answer within {format_seconds(timeout_s)}", endpoint=endpoint
        )
    finally:
        sock.disable_monitor()
        close_socket(monitor)
        close_socket(sock)
        ctx.term()


def _refused(event: int, endpoint: str, *, curve: bool) -> AuthenticationError:
    if not curve:
        what = "the stage requires authentication (CURVE): give the prober's keys (--keys, or a pipeline's keys_dir)"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        what = "the stage refused our CURVE key: it is not on the stage's allowed clients"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        what = "the CURVE handshake failed: the stage does not speak CURVE, or a key is malformed"
    else:
        what = "the stage refused the CURVE handshake: wrong server key for this stage"
    return AuthenticationError(what, endpoint=endpoint)
