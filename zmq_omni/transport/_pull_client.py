"""Pull mode, receiving half: FETCH requests over pooled DEALERs, every wait bounded.

The FETCH/FETCH_REPLY exchange is described in :mod:`zmq_omni.transport._pull_protocol`.

Threads: any application thread calls :meth:`PullClient.fetch`; each fetch
checks a DEALER out of the pool (under ``_lock``), uses it alone, and checks
it back in, so no socket is ever used by two threads at once. ``_idle``,
``_busy``, ``_verdicts`` and ``_closed`` are guarded by ``_lock``. A
:class:`FetchChannel` (``zmq_omni.aio``'s pull-mode gets) owns its own DEALER
in the caller's context and is used by one thread, the caller's event loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import (
    ClosedResourceError,
    DecodeError,
    MessageTooLargeError,
    ShmError,
    TransportTimeoutError,
    from_zmq_error,
)
from ..metrics import Counters
from ..wire import brief
from ._envelope import Kind, check_types, pack, unpack
from ._security import Curve
from ._shm import ShmReceive
from ._sockets import close_socket, make_socket

__all__ = ["FetchChannel", "PullClient"]

log = logging.getLogger("zmq_omni.transport")

_POLL_SLICE_S = 0.1  # a waiting fetch re-checks close() this often
#: The longest a threaded fetch asks the server to park one ask; it asks again when the park ends.
ASK_PARK_S = 2.0
#: An ask unanswered this long past its park is taken as lost (the server's socket was bound anew).
SILENT_S = 1.0
#: An ask answered "absent" at once (the server parks no more now) is asked again after this.
REASK_S = 0.05
# Servers come from put metadata: over weeks, restarted servers on fresh ports name new endpoints.
# Idle sockets and shared-memory verdicts are kept for this many endpoints (least recently used go)...
MAX_SERVERS = 64
# ...and at most this many idle sockets per endpoint (more fetches than that at once close theirs after).
MAX_IDLE_PER_SERVER = 16


class PullClient:
    """The receiving half of pull mode: FETCH over pooled DEALERs, every wait bounded."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        hwm: int,
        max_message_bytes: int,
        decode: Callable[[list[Any]], Any],
        counters: Counters,
        curve: Curve | None = None,
        shm: ShmReceive | None = None,
    ) -> None:
        self._ctx = ctx
        self._curve = curve
        self._shm = shm
        # Per server endpoint: the last probe it named and whether we read it (our fast-path verdict).
        # At most MAX_SERVERS, in the order first learned (the oldest is forgotten: its next fetch takes frames).
        self._verdicts: dict[str, tuple[Any, bool]] = {}
        self._hwm = hwm
        self._max_message = max_message_bytes
        self._decode = decode
        self._counters = counters
        self._lock = threading.Condition()
        self._idle: dict[str, list[Any]] = {}  # least recently used endpoint first; at most MAX_SERVERS
        self._busy: set[Any] = set()
        self._ids = itertools.count(1)
        self._closed = False

    def fetch(
        self,
        endpoint: str,
        from_stage: str,
        to_stage: str,
        key: str,
        *,
        wait_s: float,
        deadline: float,
        server_key: bytes | None = None,
    ) -> tuple[Any, int] | None:
        """Ask ``endpoint`` for the payload; ``(obj, nbytes)``, or None when the server has none.

        With ``wait_s`` 0 it asks once, and the reply is awaited until ``deadline``
        (``time.monotonic()``). With ``wait_s > 0`` it keeps asking until ``deadline``:
        each ask is parked by the server (a long poll) at most :data:`ASK_PARK_S`; one
        answered "absent" at once (the server parked no more) is asked again after
        :data:`REASK_S`; one unanswered :data:`SILENT_S` past its park is taken as lost
        (the server's socket was bound anew) and asked again. It returns None when the
        server answered "absent" and less than :data:`REASK_S` is left, or when the deadline
        passes after the server answered.

        Raises:
            TransportTimeoutError: no reply by ``deadline`` (the server is gone or slow).
            ClosedResourceError: the client was closed.
            DecodeError, MessageTooLargeError: the reply is malformed or too big.
        """
        sock = self._checkout(endpoint, server_key)
        asks: dict[int, float] = {}  # req_id -> until when it is parked at most (an "absent" before: not parked)
        heard = reusable = False
        try:
            next_ask: float | None = time.monotonic()
            while True:
                now = time.monotonic()
                remaining = deadline - now
                if self._closed:
                    raise ClosedResourceError("connector closed", endpoint=endpoint)
                if remaining <= 0:
                    if heard:
                        return None  # the server answers; the key is just not there yet
                    raise TransportTimeoutError(f"no reply to fetch of {key!r}", endpoint=endpoint)
                if next_ask is not None and now >= next_ask:
                    park = min(remaining * 0.8, ASK_PARK_S) if wait_s > 0 else 0.0
                    asks[self._ask(sock, endpoint, from_stage, to_stage, key, park)] = now + park
                    next_ask = now + park + SILENT_S if wait_s > 0 else None
                slice_s = min(remaining, _POLL_SLICE_S, max(0.0, next_ask - now) if next_ask is not None else 1.0)
                if not sock.poll(int(slice_s * 1000) + 1, zmq.POLLIN):
                    continue
                answered, got = self._answer(endpoint, sock.recv_multipart(copy=False))
                parked_until = asks.pop(answered, None)
                if parked_until is None:
                    continue  # a late answer to an earlier request on this socket
                heard = reusable = True
                if isinstance(got, BaseException):
                    raise got
                if got is not None or wait_s <= 0:
                    result: tuple[Any, int] | None = got
                    return result
                if asks:
                    continue  # an ask taken as lost was answered after all: the newer one is out
                now = time.monotonic()
                if deadline - now < REASK_S:
                    return None  # too little time left for another ask to be worth it
                # Answered at once when the server parks no more: ask again a little later, not in a tight loop.
                next_ask = now + REASK_S if parked_until - now > REASK_S else now
        finally:
            # An ask still out may be answered later (a payload, once its key is put): the socket goes with it.
            self._checkin(endpoint, sock, reusable and not asks)

    def _ask(self, sock: Any, endpoint: str, from_stage: str, to_stage: str, key: str, park: float) -> int:
        req_id = next(self._ids)
        # The shm flag also tells the server we take its probe in the reply (older clients do not).
        try:
            sock.send(self.fetch_request(req_id, from_stage, to_stage, key, park, endpoint), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise from_zmq_error(exc, endpoint=endpoint, op="fetch") from exc
        return req_id

    def _answer(self, endpoint: str, frames: list[Any]) -> tuple[int, Any]:
        """``(req_id, result)`` of a FETCH_REPLY; the result is ``(obj, nbytes)``, None, or the error it makes.

        Raises:
            DecodeError: the reply is not a FETCH_REPLY (no request id can be trusted).
        """
        kind, header, payload = unpack(frames[0].buffer)
        if kind is not Kind.FETCH_REPLY:
            raise DecodeError(f"unexpected {kind.name} reply")
        check_types(header[:2], (int, bool), "FETCH_REPLY")
        try:
            if len(header) > 2:
                self._learn_probe(endpoint, header[2])
            if not header[1]:
                return header[0], None
            if len(header) > 3:
                if len(frames) != 1 or payload.nbytes:
                    raise DecodeError("a shared-memory FETCH_REPLY carries frames")
                return header[0], self._open_shm(endpoint, header[3])
            size = payload.nbytes + sum(f.buffer.nbytes for f in frames[1:])
            if size > self._max_message:
                raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
            return header[0], (self._decode([payload, *frames[1:]]), size)
        except (DecodeError, MessageTooLargeError, ShmError) as exc:
            return header[0], exc

    def open_channel(self, ctx: zmq.Context[Any], endpoint: str, server_key: bytes | None = None) -> FetchChannel:
        """A DEALER to ``endpoint`` in ``ctx`` for FETCHes answered on an event loop (see :class:`FetchChannel`).

        ``ctx`` belongs to the caller, so closing the connector never closes a
        socket under the caller's loop; the caller closes the channel.
        """
        sock = make_socket(ctx, zmq.DEALER, hwm=self._hwm, max_message_bytes=self._max_message)
        if self._curve is not None and server_key is not None:
            self._curve.make_client(sock, server_key)
        sock.connect(endpoint)
        return FetchChannel(self, endpoint, sock)

    def fetch_request(
        self, req_id: int, from_stage: str, to_stage: str, key: str, wait_s: float, endpoint: str
    ) -> bytes:
        """The FETCH message for ``req_id`` (with the shared-memory flag this client would send)."""
        request: tuple[Any, ...] = (req_id, from_stage, to_stage, key, int(wait_s * 1000))
        if self._shm is not None:
            verdict = self._verdicts.get(endpoint)
            request += (verdict is not None and verdict[1],)
        return pack(Kind.FETCH, request)

    def shm_verdicts(self) -> dict[str, bool]:
        """Per server endpoint heard from: whether we read its shared memory (its large replies come as handles)."""
        return {endpoint: verdict for endpoint, (_, verdict) in dict(self._verdicts).items()}

    def _learn_probe(self, endpoint: str, probe: Any) -> None:
        """Check (once per probe) whether we read the server's shared memory; later FETCHes say so."""
        if self._shm is None or probe is None:
            return
        known = self._verdicts.get(endpoint)
        if known is not None and known[0] == probe:
            return
        verdict = self._shm.probe(probe)  # DecodeError when malformed
        verdicts = self._verdicts
        verdicts.pop(endpoint, None)
        verdicts[endpoint] = (probe, verdict)
        while len(verdicts) > MAX_SERVERS:
            del verdicts[next(iter(verdicts))]
        log.info("pull server %s: we %s its shared memory", endpoint, "read" if verdict else "cannot read")

    def _open_shm(self, endpoint: str, loc: Any) -> tuple[Any, int]:
        """Lease the slot a FETCH_REPLY from ``endpoint`` names (in that server's own memory) and decode views of it."""
        if self._shm is None or type(loc) is not bytes:
            raise DecodeError(f"unexpected shared-memory handle {brief(loc)} in a FETCH_REPLY")
        known = self._verdicts.get(endpoint)
        size = ShmReceive.size(loc, None if known is None or not known[1] else known[0])
        if size > self._max_message:
            raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
        views = self._shm.open(loc)
        if views is None:
            raise ShmError("the payload's shared-memory slot was reclaimed before it could be opened")
        return self._decode(views), size

    def _checkout(self, endpoint: str, server_key: bytes | None) -> Any:
        with self._lock:
            if self._closed:
                raise ClosedResourceError("connector closed", endpoint=endpoint)
            idle = self._idle.get(endpoint)
            sock = idle.pop() if idle else None
            if sock is None:
                sock = make_socket(self._ctx, zmq.DEALER, hwm=self._hwm, max_message_bytes=self._max_message)
                if self._curve is not None and server_key is not None:
                    self._curve.make_client(sock, server_key)
                sock.connect(endpoint)
            self._busy.add(sock)
            return sock

    def _checkin(self, endpoint: str, sock: Any, reusable: bool) -> None:
        doomed = [sock]
        with self._lock:
            self._busy.discard(sock)
            self._lock.notify_all()
            # After a timeout the socket may still receive the old answer: replace it (Lazy Pirate).
            if reusable and not self._closed:
                idle = self._idle.pop(endpoint, [])
                self._idle[endpoint] = idle  # most recently used last
                if len(idle) < MAX_IDLE_PER_SERVER:
                    idle.append(sock)
                    doomed = []
                while len(self._idle) > MAX_SERVERS:
                    doomed.extend(self._idle.pop(next(iter(self._idle))))
        for old in doomed:
            close_socket(old)

    def idle_sockets(self) -> dict[str, int]:
        """Idle pooled sockets per server endpoint (bounded: ``MAX_SERVERS`` x ``MAX_IDLE_PER_SERVER``)."""
        with self._lock:
            return {endpoint: len(socks) for endpoint, socks in self._idle.items()}

    def close(self) -> None:
        """Close idle sockets; wait (one poll slice or so) for busy fetches to give theirs back."""
        with self._lock:
            self._closed = True
            idle = [sock for socks in self._idle.values() for sock in socks]
            self._idle.clear()
            self._lock.wait_for(lambda: not self._busy, timeout=4 * _POLL_SLICE_S)
        for sock in idle:
            close_socket(sock)


class FetchChannel:
    """FETCHes in flight on one DEALER, answered in any order: pull-mode gets waited for on an event loop.

    One thread uses a channel (the event loop's). It registers :meth:`fileno`
    with its loop and calls :meth:`replies` when that is readable, and once
    after each :meth:`send`: ZeroMQ's descriptor only signals changes
    (edge-triggered), so a reply that came in before the loop looked would
    otherwise go unnoticed.
    """

    def __init__(self, client: PullClient, endpoint: str, sock: Any) -> None:
        self._client = client
        self.endpoint = endpoint
        self._sock = sock

    def fileno(self) -> int:
        """ZeroMQ's descriptor of the socket."""
        return int(self._sock.getsockopt(zmq.FD))

    def send(self, from_stage: str, to_stage: str, key: str, wait_s: float) -> int:
        """Send a FETCH the server parks up to ``wait_s``; its request id.

        Raises:
            TransportError: ZeroMQ refused it (its queue is full, or the socket is closed).
        """
        req_id = next(self._client._ids)
        message = self._client.fetch_request(req_id, from_stage, to_stage, key, wait_s, self.endpoint)
        try:
            self._sock.send(message, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise from_zmq_error(exc, endpoint=self.endpoint, op="fetch") from exc
        return req_id

    def replies(self) -> list[tuple[int, Any]]:
        """Every reply waiting, never blocking: ``(req_id, result)`` with the result as in ``PullClient._answer``.

        A malformed reply is counted (``rejected_frames``) and skipped.
        """
        out: list[tuple[int, Any]] = []
        sock = self._sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                out.append(self._client._answer(self.endpoint, frames))
            except DecodeError as exc:
                self._client._counters.add("rejected_frames")
                log.debug("rejected a reply from %s: %s", self.endpoint, exc)
        return out

    def close(self) -> None:
        """Close the socket (linger 0: parked FETCHes are simply never answered here)."""
        close_socket(self._sock)
