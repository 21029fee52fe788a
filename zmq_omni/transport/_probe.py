"""``probe(endpoint)``: ask a running stage for its health (for ``zmq-omni health`` and healthchecks)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from ..errors import DecodeError, PeerGoneError, TransportError, TransportTimeoutError, format_seconds
from ._endpoints import check_endpoint
from ._envelope import Kind, pack, unpack
from ._sockets import close_socket, new_context

__all__ = ["probe"]


def probe(endpoint: str, *, timeout_s: float = 2.0, server_key: str | None = None) -> dict[str, Any]:
    """Send a HEALTH request to the stage bound at ``endpoint`` and return its health dict.

    Works against a push-mode receiver and a pull-mode sender (whichever side binds).
    For a CURVE server pass its public ``server_key``; the probe uses a throwaway
    key pair, so a server with an allow-list refuses it (a timeout).

    Raises:
        PeerGoneError: nothing accepted the connection within ``timeout_s``.
        TransportTimeoutError: connected, but no answer within ``timeout_s``.
        TransportError: the answer was not a health reply.
        ConfigError: ``endpoint`` is malformed.
    """
    check_endpoint(endpoint, "endpoint")
    ctx = new_context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
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
                monitor.recv_multipart()
                connected = True
            if sock in ready:
                try:
                    kind, header, _ = unpack(sock.recv())
                except DecodeError as exc:
                    raise TransportError(f"not a zmq_omni stage: {exc}", endpoint=endpoint) from exc
                if kind is not Kind.HEALTH_REPLY or not isinstance(header[0], dict):
                    raise TransportError(f"unexpected {kind.name} answer to a health probe", endpoint=endpoint)
                return header[0]
        if not connected:
            raise PeerGoneError(f"nothing is listening (no connection within {format_seconds(timeout_s)})",
                                endpoint=endpoint)
        raise TransportTimeoutError(f"connected but no health answer within {format_seconds(timeout_s)}",
                                    endpoint=endpoint)
    finally:
        sock.disable_monitor()
        close_socket(monitor)
        close_socket(sock)
        ctx.term()
