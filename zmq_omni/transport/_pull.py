"""Pull mode: the sender keeps each payload and serves it once, on request, from a bound ROUTER.

A receiver sends FETCH ``[req_id, from_stage, to_stage, key, wait_ms]`` from a
DEALER; the server answers FETCH_REPLY ``[req_id, found]`` (followed by the
payload frames when found). With ``wait_ms > 0`` the server parks the request
until the key is put or the wait ends (a long poll), so a receiver waiting
for data costs one round trip, not a polling loop. A payload leaves the store
when it is sent: each put is fetched at most once. Unfetched payloads expire
after ``pull_ttl_s`` and are reported as failed puts.
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
    DeliveryError,
    MessageTooLargeError,
    TransportTimeoutError,
    from_zmq_error,
)
from ..metrics import Counters
from ._envelope import Kind, check_types, pack, unpack
from ._loop import IoLoop
from ._push_protocol import FailureCallback
from ._router import recv_routed
from ._security import Curve
from ._sockets import bind, close_socket, make_socket

__all__ = ["PullClient", "PullServer"]

log = logging.getLogger("zmq_omni.transport")

_POLL_SLICE_S = 0.1  # a waiting fetch re-checks close() this often

Slot = tuple[str, str, str]


class _Stored:
    __slots__ = ("expires", "frames", "nbytes")

    def __init__(self, frames: list[Any], nbytes: int, expires: float) -> None:
        self.frames = frames
        self.nbytes = nbytes
        self.expires = expires


class PullServer:
    """The sending half of pull mode: a bounded store of payloads served from a bound ROUTER."""

    def __init__(
        self,
        loop: IoLoop,
        bind_endpoint: str,
        advertised: str | None,
        *,
        put_timeout_s: float,
        ttl_s: float,
        max_unacked: int,
        max_unacked_bytes: int,
        hwm: int,
        max_frames: int,
        counters: Counters,
        on_failure: FailureCallback,
        health: Callable[[], dict[str, Any]],
        curve: Curve | None = None,
    ) -> None:
        self._loop = loop
        self._put_timeout = put_timeout_s
        self._ttl = ttl_s
        self._max_count = max_unacked
        self._max_bytes = max_unacked_bytes
        self._max_frames = max_frames
        self._counters = counters
        self._on_failure = on_failure
        self._health = health
        self._cv = threading.Condition()
        self._store: dict[Slot, _Stored] = {}
        self._bytes = 0
        self._puts = 0
        self._bytes_sent = 0
        self._waiters: dict[Slot, list[tuple[bytes, int, float]]] = {}
        self._closed = False
        # FETCH requests are tiny; a peer sending more is hostile.
        self._sock = make_socket(loop.ctx, zmq.ROUTER, hwm=hwm, max_message_bytes=1 << 20)
        if curve is not None:
            curve.make_server(self._sock)
        try:
            bound = bind(self._sock, bind_endpoint)
        except BaseException:
            close_socket(self._sock)
            raise
        self.endpoint = advertised or bound
        loop.add_reader(self._sock, self._on_readable)
        loop.every(min(1.0, ttl_s / 4), self._expire)
        loop.on_stop(self._shutdown)

    # -- put threads ----------------------------------------------------------------
    def store(self, from_stage: str, to_stage: str, key: str, frames: list[Any], nbytes: int) -> dict[str, Any]:
        """Keep a payload until fetched; return the metadata a receiver fetches it with.

        Raises:
            TransportTimeoutError: the store stayed full for ``put_timeout_s``.
            ClosedResourceError: the server was closed.
        """
        slot = (from_stage, to_stage, key)
        deadline = time.monotonic() + self._put_timeout
        with self._cv:
            while not self._closed:
                held = self._store.get(slot)
                count = len(self._store) - (held is not None)
                used = self._bytes - (held.nbytes if held else 0)
                if not count or (count < self._max_count and used + nbytes <= self._max_bytes):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeoutError(
                        f"pull store full ({len(self._store)} payloads, {self._bytes} bytes unfetched)",
                        endpoint=self.endpoint,
                    )
                self._cv.wait(remaining)
            if self._closed:
                raise ClosedResourceError("connector closed", endpoint=self.endpoint)
            old = self._store.pop(slot, None)
            if old is not None:  # a re-put of an unfetched key replaces it
                self._bytes -= old.nbytes
            self._store[slot] = _Stored(frames, nbytes, time.monotonic() + self._ttl)
            self._bytes += nbytes
            self._puts += 1
            self._bytes_sent += nbytes
            if slot in self._waiters:
                self._loop.call_soon(lambda: self._serve_waiter(slot))
        return {"endpoint": self.endpoint, "from_stage": from_stage, "to_stage": to_stage, "key": key, "size": nbytes}

    def forget(self, match: Callable[[str], bool]) -> int:
        """Drop stored payloads whose key matches; return how many."""
        with self._cv:
            slots = [slot for slot in self._store if match(slot[2])]
            for slot in slots:
                self._bytes -= self._store.pop(slot).nbytes
            if slots:
                self._cv.notify_all()
        return len(slots)

    def stats(self) -> dict[str, Any]:
        """Store occupancy."""
        with self._cv:
            return {
                "puts": self._puts,
                "bytes_sent": self._bytes_sent,
                "pending": len(self._store),
                "pending_bytes": self._bytes,
                "endpoint": self.endpoint,
            }

    def wait_fetched(self, timeout_s: float) -> bool:
        """Wait until every stored payload was fetched (or dropped); True when none is left."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._store and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            return not self._store

    def close(self) -> None:
        """Fail waiting and future puts; report every payload nobody fetched. The socket closes on the loop thread."""
        with self._cv:
            self._closed = True
            unfetched = list(self._store)
            self._store.clear()
            self._bytes = 0
            self._cv.notify_all()
        for from_stage, to_stage, key in unfetched:
            self._counters.add("delivery_failures")
            reason = f"connector closed before stage {to_stage!r} fetched the payload"
            self._on_failure(
                "put", from_stage, to_stage, key, reason, DeliveryError(reason, key=key, endpoint=self.endpoint)
            )

    # -- I/O thread ---------------------------------------------------------------
    def _on_readable(self) -> None:
        for _ in range(512):
            message = recv_routed(self._sock, self._max_frames)
            if message is None:
                return
            identity, frames, ok = message
            try:
                if not ok or len(frames) != 1:
                    raise DecodeError("a request must be exactly one frame")
                kind, header, _ = unpack(frames[0])
                if kind is Kind.FETCH:
                    check_types(header, (int, str, str, str, int), "FETCH")
                    self._on_fetch(identity, header[0], (header[1], header[2], header[3]), header[4])
                elif kind is Kind.HEALTH:
                    self._reply(identity, [pack(Kind.HEALTH_REPLY, (self._health(),))])
                else:
                    raise DecodeError(f"unexpected {kind.name} message")
            except DecodeError as exc:
                self._counters.add("rejected_frames")
                log.debug("rejected a request on %s: %s", self.endpoint, exc)

    def _on_fetch(self, identity: bytes, req_id: int, slot: Slot, wait_ms: int) -> None:
        with self._cv:
            entry = self._take(slot)
            if entry is None and wait_ms > 0:
                expiry = time.monotonic() + min(wait_ms, 3_600_000) / 1000.0
                self._waiters.setdefault(slot, []).append((identity, req_id, expiry))
                return
        if entry is None:
            self._reply(identity, [pack(Kind.FETCH_REPLY, (req_id, False))])
        else:
            self._deliver(identity, req_id, slot, entry)

    def _take(self, slot: Slot) -> _Stored | None:
        # Caller holds _cv.
        entry = self._store.pop(slot, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._cv.notify_all()
        return entry

    def _serve_waiter(self, slot: Slot) -> None:
        now = time.monotonic()
        with self._cv:
            waiters = [w for w in self._waiters.pop(slot, []) if w[2] > now]
            if not waiters:
                return
            entry = self._take(slot)
            if entry is None:
                self._waiters[slot] = waiters
                return
            identity, req_id, _ = waiters.pop(0)
            if waiters:
                self._waiters[slot] = waiters
        self._deliver(identity, req_id, slot, entry)

    def _deliver(self, identity: bytes, req_id: int, slot: Slot, entry: _Stored) -> None:
        head = pack(Kind.FETCH_REPLY, (req_id, True), entry.frames[0])
        if self._reply(identity, [head, *entry.frames[1:]]):
            self._counters.add("fetched")
            return
        with self._cv:  # the fetcher is gone or full: keep the payload for the next fetch
            if slot not in self._store and not self._closed:
                self._store[slot] = entry
                self._bytes += entry.nbytes

    def _reply(self, identity: bytes, frames: list[Any]) -> bool:
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            self._counters.add("replies_dropped")
            log.debug("reply on %s dropped: %s", self.endpoint, exc)
            return False

    def _expire(self) -> None:
        now = time.monotonic()
        expired: list[Slot] = []
        unanswered: list[tuple[bytes, int]] = []
        with self._cv:
            for slot, entry in list(self._store.items()):
                if entry.expires <= now:
                    self._bytes -= self._store.pop(slot).nbytes
                    expired.append(slot)
            if expired:
                self._cv.notify_all()
            for slot, waiters in list(self._waiters.items()):
                live = [w for w in waiters if w[2] > now]
                unanswered.extend((w[0], w[1]) for w in waiters if w[2] <= now)
                if live:
                    self._waiters[slot] = live
                else:
                    del self._waiters[slot]
        for identity, req_id in unanswered:
            self._reply(identity, [pack(Kind.FETCH_REPLY, (req_id, False))])
        for from_stage, to_stage, key in expired:
            self._counters.add("expired")
            reason = f"not fetched by stage {to_stage!r} within pull_ttl_s={self._ttl}"
            self._on_failure(
                "put", from_stage, to_stage, key, reason, DeliveryError(reason, key=key, endpoint=self.endpoint)
            )

    def _shutdown(self) -> None:
        self._loop.remove_reader(self._sock)
        # A reply handed to ZeroMQ just before close may still be streaming out: give it a bounded moment.
        close_socket(self._sock, linger_ms=500)


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
    ) -> None:
        self._ctx = ctx
        self._curve = curve
        self._hwm = hwm
        self._max_message = max_message_bytes
        self._decode = decode
        self._counters = counters
        self._lock = threading.Condition()
        self._idle: dict[str, list[Any]] = {}
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

        The server parks the request up to ``wait_s``; the reply is awaited until
        ``deadline`` (``time.monotonic()``).

        Raises:
            TransportTimeoutError: no reply by ``deadline`` (the server is gone or slow).
            ClosedResourceError: the client was closed.
            DecodeError, MessageTooLargeError: the reply is malformed or too big.
        """
        sock = self._checkout(endpoint, server_key)
        reusable = False
        try:
            req_id = next(self._ids)
            try:
                sock.send(pack(Kind.FETCH, (req_id, from_stage, to_stage, key, int(wait_s * 1000))), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise from_zmq_error(exc, endpoint=endpoint, op="fetch") from exc
            while True:
                remaining = deadline - time.monotonic()
                if self._closed:
                    raise ClosedResourceError("connector closed", endpoint=endpoint)
                if remaining <= 0:
                    raise TransportTimeoutError(f"no reply to fetch of {key!r}", endpoint=endpoint)
                if not sock.poll(int(min(remaining, _POLL_SLICE_S) * 1000) + 1, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(copy=False)
                kind, header, payload = unpack(frames[0].buffer)
                if kind is not Kind.FETCH_REPLY:
                    raise DecodeError(f"unexpected {kind.name} reply")
                check_types(header, (int, bool), "FETCH_REPLY")
                if header[0] != req_id:
                    continue  # a late answer to an earlier request on this socket
                reusable = True
                if not header[1]:
                    return None
                size = payload.nbytes + sum(f.buffer.nbytes for f in frames[1:])
                if size > self._max_message:
                    raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
                return self._decode([payload, *frames[1:]]), size
        finally:
            self._checkin(endpoint, sock, reusable)

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
        with self._lock:
            self._busy.discard(sock)
            self._lock.notify_all()
            # After a timeout the socket may still receive the old answer: replace it (Lazy Pirate).
            if reusable and not self._closed:
                self._idle.setdefault(endpoint, []).append(sock)
                return
        close_socket(sock)

    def close(self) -> None:
        """Close idle sockets; wait (one poll slice or so) for busy fetches to give theirs back."""
        with self._lock:
            self._closed = True
            idle = [sock for socks in self._idle.values() for sock in socks]
            self._idle.clear()
            self._lock.wait_for(lambda: not self._busy, timeout=4 * _POLL_SLICE_S)
        for sock in idle:
            close_socket(sock)
