"""Push mode: confirmed delivery from senders (DEALER) to a receiver's ROUTER.

Socket layout, per (sender connector, receiving stage):

* a **data** DEALER (identity ``d<sid>``) carries DATA and PING messages. Any
  put thread may send on it, one at a time under the peer's ``data_lock``;
  nothing is ever received on it;
* a **control** DEALER (identity ``c<sid>``), owned by the I/O thread, receives
  the receiver's REPLY messages (acknowledgements and pongs);
* the receiver binds one ROUTER, owned by its I/O thread.

Why DEALER/ROUTER rather than PUSH/PULL plus a separate ack channel: the
receiver can answer on the same endpoint it binds (senders need no endpoint
of their own), a DEALER blocks at its high-water mark exactly like PUSH, and
the ROUTER learns who sent what. Why a second DEALER: the I/O thread must
poll for acknowledgements while put threads send, and a ZeroMQ socket may not
be polled and sent on concurrently.

Delivery protocol (seq numbers are per sender and receiving stage):

1. The receiver acknowledges **arrival** (cumulative, batched per drain of its
   socket) and **consumption** (when ``get`` takes the item, or a re-put or
   ``cleanup`` drops it). Arrival stops the delivery deadline; consumption
   frees the sender's copy.
2. Every ``heartbeat_s`` the sender sends PING ``n`` on the data DEALER, behind
   the data it already sent. The receiver flushes its acks and answers with a
   pong naming ``n`` and its incarnation id. ZeroMQ keeps per-connection
   order, so a message sent before ping ``n`` and still unacknowledged when
   pong ``n`` arrives was lost on a broken connection: it is resent.
3. A new incarnation id means a new receiver process/connector: everything
   not yet consumed is sent again; the new receiver de-duplicates by
   ``(sid, seq)``. The only duplicates an application can see are items the
   old receiver handed to ``get`` whose consumption ack was lost with it.
4. A receiver silent for ``peer_timeout_s`` is presumed gone: what it held
   unconsumed becomes undelivered again, with a fresh delivery deadline.
5. Undelivered past its deadline: the put is reported as failed (a
   :class:`~zmq_omni.errors.DeliveryError`), forgotten, and the data DEALER is
   recreated so ZeroMQ's queue cannot deliver it later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import zmq

from ..errors import (
    ClosedResourceError,
    DecodeError,
    DeliveryError,
    MessageTooLargeError,
    ShmError,
    TransportTimeoutError,
    ZmqOmniError,
    from_zmq_error,
)
from ..metrics import Counters
from ._endpoints import EndpointMap
from ._envelope import Kind, check_ranges, check_types, pack, to_ranges, unpack
from ._loop import IoLoop
from ._router import recv_routed
from ._security import Curve
from ._shm import ShmReceive, ShmSend
from ._sockets import bind, close_socket, make_socket

__all__ = ["FailureCallback", "PushReceiver", "PushSender"]

log = logging.getLogger("zmq_omni.transport")

#: ``(op, from_stage, to_stage, key, reason, error)`` -- how the transport reports a failure for good.
FailureCallback = Callable[[str, str, str, str, str, ZmqOmniError], None]

_MAX_DRAIN = 512  # messages handled per wake-up
_ACK_DELAY_S = 0.005  # acks wait this long to be batched: one REPLY covers hundreds of puts under load
_ACK_BATCH = 1024  # ...or until this many are pending
_MAX_SID = 64
_DATA_TYPES = (str, int, int, str, str, str)
_LOC_TYPES = (type(None), bytes)
_PING_TYPES = (str, int, int)
_REPLY_TYPES = (str, int, list, list)
_VERDICT_TYPES = (type(None), bool)
_BATCH_TYPES = (str, int, str, list)
_BATCH_ENTRY = (int, str, str, bytes)  # seq, from_stage, key, wire frame 0
_BATCH_OVERHEAD = 512  # bytes of a BATCH frame beyond its entries' costs (preamble, sid, low, to_stage)
_MAX_BATCH_ENTRIES = 65536
_SEND_SLICE_S = 0.05  # a blocked send re-checks close() this often
_RETRY_MIN_S = 0.001  # a batch refused at the high-water mark is retried after this, doubling...
_RETRY_MAX_S = 0.05  # ...up to this
# A flush that found puts queued keeps the peer busy this much longer (a stream is on): puts ride in batches
# without waking the I/O thread, and a put flushes the outbox itself once its oldest entry waited this long.
_STREAM_FLUSH_S = 0.0002
# While a stream is on, the I/O thread re-checks the outbox on its next turn rather than after
# _STREAM_FLUSH_S: zmq_poll counts whole milliseconds, so a 200 us timer would hold a queued put
# for up to 1 ms (a p99 latency of ~1.3 ms instead of ~0.5 ms for a put->get round trip).
_STREAM_RECHECK_S = 0.0


class _Out:
    """One put kept by the sender until the receiver consumed it."""

    __slots__ = ("arrived", "deadline", "frames", "from_stage", "key", "loc", "nbytes", "queued", "sent_ping", "seq")

    def __init__(
        self, seq: int, from_stage: str, key: str, frames: list[Any], nbytes: int, deadline: float, loc: bytes | None
    ) -> None:
        self.seq = seq
        self.from_stage = from_stage
        self.key = key
        self.frames = frames  # empty when the payload lies in shared memory (``loc``)
        self.loc = loc
        self.nbytes = nbytes
        self.deadline = deadline
        self.arrived = False
        self.queued = False  # waiting in its peer's outbox for a batch (put already returned)
        self.sent_ping: int | None = None  # the last ping sent before this went out; None = not sent yet


class _Peer:
    """Sender-side state of one receiving stage."""

    def __init__(self, to_stage: str, endpoint: str, server_key: bytes | None) -> None:
        self.to_stage = to_stage
        self.endpoint = endpoint
        self.server_key = server_key
        self.data_lock = threading.Lock()
        self.data_sock: Any = None
        self.ctl_sock: Any = None
        self.ping_no = 0
        self.next_seq = 0
        self.low = 0  # smallest seq still retained (or next_seq): the receiver forgets dedup state below it
        self.retained: dict[int, _Out] = {}
        self.unarrived: dict[int, _Out] = {}
        self.incarnation: str | None = None
        self.old_incarnations: deque[str] = deque(maxlen=16)
        self.last_heard = 0.0
        self.suspect = False
        self.shm: bool | None = None  # the receiver's probe verdict; None = not answered yet
        # Coalescing (all under the sender's _cv): small puts wait here while a send is in progress or queued.
        self.batch_bytes = 0  # largest BATCH frame the receiver said it accepts; 0 = do not batch
        self.outbox: list[_Out] = []
        self.outbox_bytes = 0
        self.outbox_since = 0.0  # when the oldest put in the outbox was queued
        self.busy_until = 0.0  # a small put before this time rides in the next batch instead of going at once
        self.flush_armed = False  # a flush is scheduled on the I/O thread: new small puts ride with it
        self.blocked = False  # the last flush met the high-water mark; the I/O thread retries
        self.retry_s = _RETRY_MIN_S
        self.flush_soon: Callable[[], None] = lambda: None  # the sender's I/O-thread flush of this peer

    def advance_low(self) -> None:
        while self.low < self.next_seq and self.low not in self.retained:
            self.low += 1


class PushSender:
    """The sending half of push mode: a bounded window of unconsumed puts, resends and deadlines."""

    def __init__(
        self,
        loop: IoLoop,
        endpoints: EndpointMap,
        *,
        sid: str,
        put_timeout_s: float,
        delivery_timeout_s: float,
        heartbeat_s: float,
        peer_timeout_s: float,
        max_unacked: int,
        max_unacked_bytes: int,
        hwm: int,
        counters: Counters,
        on_failure: FailureCallback,
        curve: Curve | None = None,
        shm: ShmSend | None = None,
        batch_max_messages: int = 256,
        batch_max_bytes: int = 64 << 10,
        batch_item_bytes: int = 4096,
    ) -> None:
        self._loop = loop
        self._curve = curve
        self._shm = shm
        self._probe = None if shm is None else shm.probe
        self._batch_max_messages = batch_max_messages
        self._batch_max_bytes = batch_max_bytes
        self._batch_item_bytes = batch_item_bytes  # a put of fewer bytes (one frame) may ride in a BATCH
        self._endpoints = endpoints
        self.sid = sid
        self._put_timeout = put_timeout_s
        self._delivery_timeout = delivery_timeout_s
        self._peer_timeout = peer_timeout_s
        self._max_count = max_unacked
        self._max_bytes = max_unacked_bytes
        self._hwm = hwm
        self._counters = counters
        self._on_failure = on_failure
        # A plain Lock under the condition: ``with self._lock`` costs a C call, a Condition's two Python ones.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._peers: dict[str, _Peer] = {}
        self._count = 0
        self._bytes = 0
        self._puts = 0
        self._bytes_sent = 0
        self._batches_sent = 0
        self._closed = False
        loop.every(heartbeat_s, self._heartbeat)
        loop.every(min(0.05, heartbeat_s), self._expire)
        loop.on_stop(self._close_sockets)

    # -- put threads ----------------------------------------------------------------
    def send(
        self, from_stage: str, to_stage: str, key: str, frames: list[Any], nbytes: int, loc: bytes | None = None
    ) -> None:
        """Admit one put into the window and hand it to ZeroMQ, waiting at most ``put_timeout_s``.

        With ``loc`` (a packed slot handle) the payload lies in shared memory and
        ``frames`` is ignored; the caller discards the slot if this raises.

        A small put (one frame of fewer than ``batch_item_bytes``) is sent at once
        when nothing is in progress; one that arrives while a send is in progress
        or queued waits in the peer's outbox and rides in the next BATCH (sent by
        a full outbox's put or by the I/O thread's next turn). Either way it is in
        the window when this returns, so its deadline covers it.

        Raises:
            TransportTimeoutError: no window room or ZeroMQ queue room in time.
            ClosedResourceError: the sender was closed.
            ConfigError: ``to_stage`` has no endpoint.
        """
        now = time.monotonic()
        deadline = now + self._put_timeout
        with self._lock:
            peer = self._peers.get(to_stage) or self._peer(to_stage)
            if self._count and (self._count >= self._max_count or self._bytes + nbytes > self._max_bytes):
                now = self._wait_for_room(peer, nbytes, deadline)
            if self._closed:
                raise ClosedResourceError("connector closed", endpoint=peer.endpoint)
            out = _Out(peer.next_seq, from_stage, key, [] if loc else frames, nbytes, now + self._delivery_timeout, loc)
            seq = peer.next_seq
            peer.next_seq = seq + 1
            peer.retained[seq] = out
            peer.unarrived[seq] = out
            self._count += 1
            self._bytes += nbytes
            self._puts += 1
            self._bytes_sent += nbytes
            if loc is None and len(frames) == 1 and nbytes < self._batch_item_bytes and peer.batch_bytes:
                out.queued = True
                outbox = peer.outbox
                if not outbox:
                    peer.outbox_since = now
                outbox.append(out)
                peer.outbox_bytes += nbytes + len(key) + 16
                batched = True
                if (
                    (
                        (len(outbox) == 1 and now >= peer.busy_until)  # idle: no added latency
                        or len(outbox) >= self._batch_max_messages
                        or peer.outbox_bytes >= peer.batch_bytes
                        or now - peer.outbox_since >= _STREAM_FLUSH_S
                    )
                    and not peer.blocked
                    and peer.data_lock.acquire(False)
                ):
                    outs: list[_Out] | None = self._take(peer)
                    peer.busy_until = now + _STREAM_FLUSH_S
                    wake = False
                else:
                    # It stays queued: make sure the I/O thread flushes it (one wake-up per busy period).
                    outs = None
                    wake = not peer.flush_armed
                    peer.flush_armed = True
            else:
                batched = wake = False
                outs = None
        if outs is not None:
            self._flush(peer, outs)  # releases data_lock
        if wake:
            self._loop.call_soon(peer.flush_soon)
        if not batched:
            self._send_direct(peer, out, deadline)

    def _wait_for_room(self, peer: _Peer, nbytes: int, deadline: float) -> float:
        """Wait (caller holds ``_cv``) until the window admits ``nbytes``; the time then."""
        while (
            not self._closed
            and self._count
            and (self._count >= self._max_count or self._bytes + nbytes > self._max_bytes)
        ):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"send window full ({self._count} puts, {self._bytes} bytes unconsumed)",
                    endpoint=peer.endpoint,
                )
            self._cv.wait(remaining)
        return time.monotonic()

    def _send_direct(self, peer: _Peer, out: _Out, deadline: float) -> None:
        try:
            self._send_data(peer, out, deadline)
        except BaseException:
            with self._lock:
                self._puts -= 1
                self._bytes_sent -= out.nbytes
                if peer.retained.pop(out.seq, None) is not None:
                    peer.unarrived.pop(out.seq, None)
                    self._count -= 1
                    self._bytes -= out.nbytes
                    peer.advance_low()
                    self._cv.notify_all()
            raise

    def _peer(self, to_stage: str) -> _Peer:
        peer = self._peers.get(to_stage)
        if peer is None:
            endpoint = self._endpoints.require(to_stage)
            server_key = None if self._curve is None else self._curve.server_key_for(to_stage)
            peer = self._peers[to_stage] = _Peer(to_stage, endpoint, server_key)
            peer.flush_soon = lambda: self._on_flush(peer)
            self._loop.call_soon(lambda: self._open_ctl(peer))
            if self._probe is not None:
                self._loop.call_soon(lambda: self._ping(peer))  # learn the shm verdict before the first beat
        return peer

    def reads_shm(self, to_stage: str, wait_s: float = 0.0) -> bool:
        """True once ``to_stage``'s receiver proved it reads our shared memory (waits up to ``wait_s``)."""
        if self._probe is None:
            return False
        deadline = time.monotonic() + wait_s
        with self._lock:
            peer = self._peers.get(to_stage) or self._peer(to_stage)
            while peer.shm is None and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            return peer.shm is True

    def _send_data(self, peer: _Peer, out: _Out, deadline: float) -> None:
        """Send a put that cannot ride in a BATCH, after whatever small puts wait before it (their order)."""
        lock = peer.data_lock
        if not lock.acquire(False) and not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransportTimeoutError("another put held the socket past put_timeout_s", endpoint=peer.endpoint)
        try:
            if self._closed:
                raise ClosedResourceError("connector closed", endpoint=peer.endpoint)
            sock = peer.data_sock or self._open_data(peer)
            while True:
                try:
                    while peer.outbox:
                        with self._lock:
                            queued = self._take(peer)
                        self._send_or_requeue(sock, peer, queued)
                    self._transmit(sock, peer, out)
                    return
                except zmq.Again as exc:
                    # At the high-water mark: wait for room in short slices so close() is never held up.
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed:
                        raise (
                            ClosedResourceError("connector closed", endpoint=peer.endpoint)
                            if self._closed
                            else TransportTimeoutError(
                                f"ZeroMQ send queue full for {self._put_timeout}s", endpoint=peer.endpoint
                            )
                        ) from exc
                    sock.poll(int(min(remaining, _SEND_SLICE_S) * 1000) + 1, zmq.POLLOUT)
                except zmq.ZMQError as exc:
                    raise from_zmq_error(exc, endpoint=peer.endpoint, op="send") from exc
        finally:
            self._release(peer)

    def _transmit(self, sock: Any, peer: _Peer, out: _Out) -> None:
        """Send one DATA message without blocking (caller holds ``data_lock``)."""
        header = (self.sid, out.seq, peer.low, out.from_stage, peer.to_stage, out.key, out.loc)
        if out.loc is not None:
            sock.send(pack(Kind.DATA, header), zmq.NOBLOCK)
            out.sent_ping = peer.ping_no
            return
        head = pack(Kind.DATA, header, out.frames[0])
        if len(out.frames) == 1:
            sock.send(head, zmq.NOBLOCK)
        else:
            sock.send_multipart([head, *out.frames[1:]], zmq.NOBLOCK, copy=False)
        out.sent_ping = peer.ping_no

    # -- coalescing small puts -------------------------------------------------------
    def _batch_end(self, peer: _Peer, outs: list[_Out], start: int) -> int:
        """End of the longest run of ``outs`` from ``start`` that fits one BATCH (at least one put)."""
        # Costs bound the packed size from above: 4 bytes per character, 24 for msgpack's type headers.
        budget = peer.batch_bytes - _BATCH_OVERHEAD - 4 * len(peer.to_stage)
        end = min(len(outs), start + self._batch_max_messages)
        size = 0
        i = start
        while i < end:
            out = outs[i]
            size += out.nbytes + 4 * (len(out.key) + len(out.from_stage)) + 24
            if size > budget and i > start:
                break
            i += 1
        return i

    def _take(self, peer: _Peer) -> list[_Out]:
        """Remove the next batch from the outbox, skipping puts dropped meanwhile (caller holds ``_cv``)."""
        outbox = peer.outbox
        end = self._batch_end(peer, outbox, 0) if outbox else 0
        if end == len(outbox):
            peer.outbox = []
            peer.outbox_bytes = 0
            taken = outbox
        else:
            taken = outbox[:end]
            del outbox[:end]
            peer.outbox_bytes = max(0, peer.outbox_bytes - sum(o.nbytes + len(o.key) + 16 for o in taken))
        live = []
        for out in taken:
            if out.queued:
                out.queued = False
                live.append(out)
        return live

    def _transmit_batch(self, sock: Any, peer: _Peer, outs: list[_Out]) -> None:
        """Send ``outs`` as one message (caller holds ``data_lock``): a BATCH, or DATA for a single put."""
        if len(outs) == 1:
            self._transmit(sock, peer, outs[0])
            return
        entries: list[Any] = []
        add = entries.extend
        for out in outs:
            add((out.seq, out.from_stage, out.key, out.frames[0]))
        sock.send(pack(Kind.BATCH, (self.sid, peer.low, peer.to_stage, entries)), zmq.NOBLOCK)
        ping = peer.ping_no
        for out in outs:
            out.sent_ping = ping
        self._batches_sent += 1

    def _send_or_requeue(self, sock: Any, peer: _Peer, outs: list[_Out]) -> None:
        """Transmit a batch taken from the outbox; on any error put it back in front (order) and re-raise."""
        if not outs:
            return
        try:
            self._transmit_batch(sock, peer, outs)
        except BaseException:
            with self._lock:
                live = [o for o in outs if peer.retained.get(o.seq) is o]
                for out in live:
                    out.queued = True
                peer.outbox[:0] = live
                peer.outbox_bytes += sum(o.nbytes + len(o.key) + 16 for o in live)
            raise

    def _flush(self, peer: _Peer, outs: list[_Out]) -> None:
        """Send a batch a put thread took (it holds ``data_lock``, released here); errors leave it queued."""
        try:
            if self._closed:
                return
            sock = peer.data_sock or self._open_data(peer)
            self._send_or_requeue(sock, peer, outs)
            peer.retry_s = _RETRY_MIN_S
        except zmq.ZMQError as exc:
            # The I/O thread retries it (the put already returned; its deadline still runs).
            with self._lock:
                peer.blocked = True
            if not isinstance(exc, zmq.Again):
                log.warning("sending a batch to %s failed: %s", peer.endpoint, exc)
        finally:
            self._release(peer)

    def _release(self, peer: _Peer) -> None:
        """Let go of ``data_lock``; make sure puts queued meanwhile are not left without a flush."""
        peer.data_lock.release()
        if peer.outbox and not peer.flush_armed:
            with self._lock:
                if not peer.outbox or peer.flush_armed:
                    return
                peer.flush_armed = True
            if peer.blocked and self._loop.in_loop():
                self._loop.call_later(peer.retry_s, peer.flush_soon)
                peer.retry_s = min(_RETRY_MAX_S, peer.retry_s * 2)
            else:
                self._loop.call_soon(peer.flush_soon)

    def _on_flush(self, peer: _Peer) -> None:
        """I/O thread: send everything queued for ``peer``.

        A turn that finds nothing queued ends the busy period (the next put goes out at once). One that
        finds puts queued means a stream is on: it sends them and keeps the peer busy for another
        ``_STREAM_FLUSH_S``, so the stream's puts ride in batches without a wake-up per put.
        """
        with self._lock:
            peer.flush_armed = False
            peer.blocked = False
            if not peer.outbox:
                return
        if not peer.data_lock.acquire(False):
            return  # the holder's _release() re-arms this flush
        streaming = False
        try:
            if not self._closed:
                sock = peer.data_sock or self._open_data(peer)
                while peer.outbox:
                    with self._lock:
                        outs = self._take(peer)
                    self._send_or_requeue(sock, peer, outs)
                peer.retry_s = _RETRY_MIN_S
                streaming = True
        except zmq.ZMQError as exc:
            with self._lock:
                peer.blocked = True
            if not isinstance(exc, zmq.Again):
                log.warning("sending a batch to %s failed: %s", peer.endpoint, exc)
        finally:
            self._release(peer)
        if streaming:
            with self._lock:
                peer.busy_until = time.monotonic() + _STREAM_FLUSH_S
                if peer.flush_armed:
                    return
                peer.flush_armed = True
            self._loop.call_later(_STREAM_RECHECK_S, peer.flush_soon)

    def _open_data(self, peer: _Peer) -> Any:
        sock = make_socket(self._loop.ctx, zmq.DEALER, hwm=self._hwm, identity=b"d" + self.sid.encode())
        if self._curve is not None and peer.server_key is not None:
            self._curve.make_client(sock, peer.server_key)
        sock.connect(peer.endpoint)
        peer.data_sock = sock
        return sock

    def forget(self, match: Callable[[str], bool]) -> int:
        """Stop retaining puts whose key matches (the request is finished); return how many."""
        dropped: list[_Out] = []
        with self._lock:
            for peer in self._peers.values():
                for seq in [s for s, out in peer.retained.items() if match(out.key)]:
                    out = peer.retained.pop(seq)
                    out.queued = False  # a batch being built skips it
                    peer.unarrived.pop(seq, None)
                    self._count -= 1
                    self._bytes -= out.nbytes
                    dropped.append(out)
                peer.advance_low()
            if dropped:
                self._cv.notify_all()
        self._discard(dropped)
        return len(dropped)

    def _discard(self, outs: Iterable[_Out]) -> None:
        # A slot still READY was never leased: free it now rather than at its ttl.
        if self._shm is not None:
            for out in outs:
                if out.loc is not None:
                    self._shm.discard(out.loc)

    def stats(self) -> dict[str, Any]:
        """Window occupancy and per-peer state."""
        with self._lock:
            return {
                "puts": self._puts,
                "bytes_sent": self._bytes_sent,
                "batches_sent": self._batches_sent,
                "pending": self._count,
                "pending_bytes": self._bytes,
                "undelivered": sum(len(p.unarrived) for p in self._peers.values()),
                "peers": {
                    p.to_stage: {
                        "endpoint": p.endpoint,
                        "incarnation": p.incarnation,
                        "pending": len(p.retained),
                        "shm": p.shm,
                    }
                    for p in self._peers.values()
                },
            }

    def close(self) -> None:
        """Fail waiting and future puts; sockets close on the loop thread."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()

    # -- I/O thread ---------------------------------------------------------------
    def _open_ctl(self, peer: _Peer) -> None:
        if self._closed or peer.ctl_sock is not None:
            return
        sock = make_socket(self._loop.ctx, zmq.DEALER, hwm=self._hwm, identity=b"c" + self.sid.encode())
        if self._curve is not None and peer.server_key is not None:
            self._curve.make_client(sock, peer.server_key)
        sock.connect(peer.endpoint)
        peer.ctl_sock = sock
        self._loop.add_reader(sock, lambda: self._on_ctl(peer))

    def _on_ctl(self, peer: _Peer) -> None:
        for _ in range(_MAX_DRAIN):
            try:
                frames = peer.ctl_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, header, _ = unpack(frames[0])
                if kind is not Kind.REPLY or len(frames) != 1:
                    raise DecodeError(f"unexpected {kind.name} message on the control socket")
                check_types(header[:4], _REPLY_TYPES, "REPLY")
                verdict = header[4] if len(header) > 4 else None
                if type(verdict) not in _VERDICT_TYPES:
                    raise DecodeError(f"REPLY shm verdict {verdict!r:.40} is not a bool or null")
                batch_bytes = header[5] if len(header) > 5 else 0
                if type(batch_bytes) is not int or batch_bytes < 0:
                    raise DecodeError(f"REPLY batch size {batch_bytes!r:.40} is not a count of bytes")
                limit = 4 * self._max_count + 1024
                arrived, consumed = check_ranges(header[2], limit), check_ranges(header[3], limit)
                self._on_reply(peer, header[0], header[1], arrived, consumed, verdict, batch_bytes)
            except DecodeError as exc:
                self._counters.add("rejected_frames")
                log.warning("rejected a reply from %s: %s", peer.endpoint, exc)

    def _on_reply(
        self,
        peer: _Peer,
        incarnation: str,
        ping: int,
        arrived: list[range],
        consumed: list[range],
        shm: bool | None,
        batch_bytes: int = 0,
    ) -> None:
        """Apply a REPLY: ``arrived`` and ``consumed`` are runs of seqs (walked in place, never expanded)."""
        now = time.monotonic()
        resend: list[_Out] = []
        with self._lock:
            peer.last_heard = now
            peer.suspect = False
            stale = incarnation in peer.old_incarnations
            renewed = False
            if not stale and incarnation != peer.incarnation:
                if peer.incarnation is not None:
                    # A new receiver holds nothing of ours: everything unconsumed goes again.
                    log.info(
                        "receiver %s restarted (%s); resending %d puts", peer.endpoint, incarnation, len(peer.retained)
                    )
                    peer.old_incarnations.append(peer.incarnation)
                    self._unarrive(peer, peer.retained.values(), now)
                    renewed = True
                peer.incarnation = incarnation
                peer.shm = None  # a new receiver may not share our /dev/shm: ask again
                self._cv.notify_all()
            if not stale:
                # Too small a limit leaves no room for two puts: send DATA messages only.
                fits = self._batch_max_messages > 1 and batch_bytes >= 2 * _BATCH_OVERHEAD
                peer.batch_bytes = min(self._batch_max_bytes, batch_bytes) if fits else 0
            if not stale and shm is not None and shm != peer.shm:
                log.info("receiver %s %s our shared memory", peer.endpoint, "reads" if shm else "cannot read")
                peer.shm = shm
                self._cv.notify_all()
            freed = freed_bytes = 0
            retained_pop, unarrived_pop = peer.retained.pop, peer.unarrived.pop
            for run in consumed:  # consumption is final whichever incarnation reports it
                for seq in run:
                    out = retained_pop(seq, None)
                    if out is not None:
                        unarrived_pop(seq, None)
                        freed += 1
                        freed_bytes += out.nbytes
            self._count -= freed
            self._bytes -= freed_bytes
            if not stale:
                for run in arrived:
                    for seq in run:
                        out = unarrived_pop(seq, None)
                        if out is not None:
                            out.arrived = True
                if renewed:
                    resend = [o for o in peer.unarrived.values() if o.sent_ping is not None]
                elif ping >= 0:
                    resend = [o for o in peer.unarrived.values() if o.sent_ping is not None and o.sent_ping < ping]
            if freed:
                peer.advance_low()
                self._cv.notify_all()
        if resend:
            self._resend(peer, resend)

    def _unarrive(self, peer: _Peer, outs: Iterable[_Out], now: float) -> None:
        """Mark puts undelivered again with a fresh deadline (caller holds ``_cv``)."""
        # Re-inserted at the end: ``unarrived`` stays in deadline order (see _expire).
        for out in outs:
            out.arrived = False
            peer.unarrived.pop(out.seq, None)
            peer.unarrived[out.seq] = out
            out.deadline = now + self._delivery_timeout

    def _resend(self, peer: _Peer, outs: list[_Out]) -> None:
        # Never wait for a put thread blocked at the high-water mark: the next pong retries.
        if not peer.data_lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            sock = peer.data_sock or self._open_data(peer)
            small = [o for o in outs if o.seq in peer.unarrived and self._batchable(peer, o)]
            large = [o for o in outs if o.seq in peer.unarrived and not self._batchable(peer, o)]
            sent = 0
            try:
                start = 0
                while start < len(small):
                    end = self._batch_end(peer, small, start)
                    self._transmit_batch(sock, peer, small[start:end])
                    sent += end - start
                    start = end
                for out in large:
                    self._transmit(sock, peer, out)
                    sent += 1
            except zmq.ZMQError:
                pass  # full or gone: the next pong retries what is still unacknowledged
            if sent:
                self._counters.add("resends", sent)
        finally:
            peer.data_lock.release()

    def _batchable(self, peer: _Peer, out: _Out) -> bool:
        return bool(
            peer.batch_bytes and out.loc is None and len(out.frames) == 1 and out.nbytes < self._batch_item_bytes
        )

    def _heartbeat(self) -> None:
        now = time.monotonic()
        with self._lock:
            peers = list(self._peers.values())
            for peer in peers:
                silent = peer.last_heard and now - peer.last_heard > self._peer_timeout
                if silent and not peer.suspect:
                    peer.suspect = True
                    held = [o for o in peer.retained.values() if o.arrived]
                    if held:
                        log.warning(
                            "receiver %s silent for %.1fs; %d delivered puts at risk",
                            peer.endpoint,
                            now - peer.last_heard,
                            len(held),
                        )
                        self._unarrive(peer, held, now)
        for peer in peers:
            self._ping(peer)

    def _ping(self, peer: _Peer) -> None:
        if not peer.data_lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            sock = peer.data_sock or self._open_data(peer)
            header: tuple[Any, ...] = (self.sid, peer.ping_no + 1, peer.low)
            if self._probe is not None:
                header += (self._probe,)
            try:
                sock.send(pack(Kind.PING, header), zmq.NOBLOCK)
                peer.ping_no += 1
            except zmq.ZMQError:  # queue full while the receiver is away: the next beat tries again
                pass
        finally:
            peer.data_lock.release()

    def _expire(self) -> None:
        now = time.monotonic()
        failed: list[tuple[_Peer, _Out]] = []
        with self._lock:
            # Each peer's ``unarrived`` is in deadline order (puts enter at the end with now + the
            # timeout, re-armed ones move to the end), so the expired ones are a prefix: no heap,
            # no per-put bookkeeping.
            for peer in self._peers.values():
                expired = []
                for out in peer.unarrived.values():
                    if out.deadline > now:
                        break
                    # A put whose own thread is still handing it to ZeroMQ reports its own timeout.
                    if out.sent_ping is not None or out.queued:
                        expired.append(out)
                for out in expired:
                    del peer.unarrived[out.seq]
                    del peer.retained[out.seq]
                    out.queued = False  # still in the outbox (never sent): the next batch skips it
                    self._count -= 1
                    self._bytes -= out.nbytes
                    failed.append((peer, out))
            if failed:
                for peer in {p for p, _ in failed}:
                    peer.advance_low()
                self._cv.notify_all()
        for peer in {p for p, _ in failed}:
            self._reset_data_socket(peer)
        self._discard(out for _, out in failed)
        for peer, out in failed:
            self._counters.add("delivery_failures")
            reason = (
                f"delivery to stage {peer.to_stage!r} not confirmed within {self._delivery_timeout}s "
                f"(receiver {'never answered' if peer.incarnation is None else 'gone or not acknowledging'})"
            )
            self._on_failure(
                "put",
                out.from_stage,
                peer.to_stage,
                out.key,
                reason,
                DeliveryError(reason, key=out.key, endpoint=peer.endpoint),
            )

    def _reset_data_socket(self, peer: _Peer) -> None:
        # Drop what ZeroMQ still queues for this peer, so a put reported failed is never delivered later.
        if peer.data_lock.acquire(blocking=False):
            try:
                close_socket(peer.data_sock)
                peer.data_sock = None
            finally:
                peer.data_lock.release()

    def _close_sockets(self) -> None:
        for peer in list(self._peers.values()):
            if peer.ctl_sock is not None:
                self._loop.remove_reader(peer.ctl_sock)
                close_socket(peer.ctl_sock)
            # A put thread notices close() within one send slice and lets go.
            got = peer.data_lock.acquire(timeout=0.5)
            try:
                close_socket(peer.data_sock)
                peer.data_sock = None
            finally:
                if got:
                    peer.data_lock.release()


class _Source:
    """Receiver-side state of one sender: dedup window and acks not yet sent."""

    __slots__ = ("arrived", "consumed", "ctl", "last_heard", "low", "probe", "pruned_low", "reported", "seen", "shm")

    def __init__(self, sid: str, now: float) -> None:
        self.ctl = b"c" + sid.encode()
        self.low = 0
        self.pruned_low = 0
        self.seen: set[int] = set()
        self.arrived: list[int] = []
        self.consumed: list[int] = []
        self.reported: set[int] = set()  # consumed seqs >= low: repeated in every pong until the sender forgets them
        self.last_heard = now
        self.probe: list[Any] | None = None  # the last probe answered
        self.shm: bool | None = None  # its verdict: may this sender send slot handles?


class _Item(NamedTuple):
    """One mailbox entry; a tuple, so the receive hot path builds it with one C call (``_new_item``)."""

    obj: Any
    nbytes: int
    sid: str
    seq: int
    loc: bytes | None  # a slot handle, opened by ``take`` (obj is None until then)


# ``_Item.__new__`` is a Python function; the tuple constructor makes the same object without it.
_new_item = tuple.__new__


class PushReceiver:
    """The receiving half of push mode: a bound ROUTER feeding a keyed mailbox."""

    def __init__(
        self,
        loop: IoLoop,
        bind_endpoint: str,
        *,
        incarnation: str,
        decode: Callable[[list[Any]], Any],
        hwm: int,
        max_message_bytes: int,
        max_frames: int,
        source_ttl_s: float,
        counters: Counters,
        health: Callable[[], dict[str, Any]],
        curve: Curve | None = None,
        shm: ShmReceive | None = None,
    ) -> None:
        self._loop = loop
        self._shm = shm
        self.incarnation = incarnation
        self._decode = decode
        self._max_message = max_message_bytes
        self._max_frames = max_frames
        self._source_ttl = source_ttl_s
        self._counters = counters
        self._health = health
        # A plain Lock under the condition: ``with self._lock`` costs a C call, a Condition's two Python ones.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._box: dict[tuple[str, str, str], _Item] = {}
        self._arrivals: list[tuple[tuple[str, str, str], _Item]] = []  # decoded this drain, stored at its end
        self._generation = 0  # bumped under _cv whenever items arrive (wait_for_change)
        self._batches_received = 0
        self._taken: list[tuple[str, int]] = []  # consumed (sid, seq) waiting for the I/O thread
        self._sources: dict[str, _Source] = {}
        self._dirty: set[str] = set()
        self._pending_acks = 0
        self._now = time.monotonic()
        self._flush_armed = False
        self._gets = 0
        self._bytes_received = 0
        self._closed = False
        self._sock = make_socket(loop.ctx, zmq.ROUTER, hwm=hwm, max_message_bytes=max_message_bytes)
        if curve is not None:
            curve.make_server(self._sock)
        try:
            self.endpoint = bind(self._sock, bind_endpoint)
        except BaseException:
            close_socket(self._sock)
            raise
        loop.add_reader(self._sock, self._on_readable)
        loop.every(max(1.0, source_ttl_s / 10), self._expire_sources)
        loop.on_stop(self._shutdown)

    # -- application threads -------------------------------------------------------
    def take(self, from_stage: str, to_stage: str, key: str) -> tuple[Any, int] | None:
        """Remove and return ``(obj, nbytes)`` for the key, or None (never blocks on I/O).

        Raises:
            ShmError: the item's shared-memory payload expired or was withdrawn (the item is gone).
            DecodeError: the shared-memory payload is not a valid encoding.
        """
        with self._lock:
            item = self._box.pop((from_stage, to_stage, key), None)
            if item is None:
                return None
            self._ack_taken(item)
        return self._open(item)

    def take_by(self, from_stage: str, to_stage: str, key: str, deadline: float) -> tuple[Any, int] | None:
        """Like :meth:`take`, waiting on a condition until ``time.monotonic() >= deadline``."""
        slot = (from_stage, to_stage, key)
        with self._lock:
            while slot not in self._box:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cv.wait(remaining)
            item = self._box.pop(slot)
            self._ack_taken(item)
        return self._open(item)

    def _open(self, item: _Item) -> tuple[Any, int]:
        if item.loc is None:
            return item.obj, item.nbytes
        assert self._shm is not None
        views = self._shm.open(item.loc)
        if views is None:
            self._counters.add("shm_stale")
            raise ShmError("its shared-memory payload expired or its sender withdrew it")
        return self._decode(views), item.nbytes

    def forget(self, match: Callable[[str], bool]) -> int:
        """Drop mailbox items whose key matches (acknowledged as consumed); return how many."""
        with self._lock:
            slots = [slot for slot in self._box if match(slot[2])]
            items = [self._box.pop(slot) for slot in slots]
            for item in items:
                self._ack_taken(item)
        self._discard(items)
        return len(slots)

    def _discard(self, items: Iterable[_Item]) -> None:
        if self._shm is not None:
            for item in items:
                if item.loc is not None:
                    self._shm.discard(item.loc)

    def _ack_taken(self, item: _Item) -> None:
        # Caller holds _cv. Wake the I/O thread once per batch, not once per get.
        self._taken.append((item.sid, item.seq))
        self._gets += 1
        self._bytes_received += item.nbytes
        if len(self._taken) == 1:
            self._loop.call_soon(self._arm_flush)

    def stats(self) -> dict[str, Any]:
        """Gets, bytes taken, items waiting for ``get``, and BATCH messages taken in."""
        with self._lock:
            return {
                "gets": self._gets,
                "bytes_received": self._bytes_received,
                "mailbox": len(self._box),
                "batches_received": self._batches_received,
            }

    def generation(self) -> int:
        """A counter bumped whenever items arrive in the mailbox (for :meth:`wait_for_change`)."""
        return self._generation

    def wait_for_change(self, generation: int, timeout: float) -> int:
        """Wait on the mailbox condition until the generation differs from ``generation``, at most ``timeout``.

        Returns the generation then (equal to ``generation`` after a timeout or close).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._generation == generation and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            return self._generation

    def close(self) -> None:
        """Wake every waiting ``get``; the socket closes on the loop thread after a last ack flush."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()

    # -- I/O thread ---------------------------------------------------------------
    def _on_readable(self) -> None:
        sock, max_frames = self._sock, self._max_frames
        self._now = time.monotonic()
        rejected = 0
        for _ in range(_MAX_DRAIN):
            message = recv_routed(sock, max_frames)
            if message is None:
                break
            self._pending_acks += 1
            identity, frames, ok = message
            try:
                if not ok:
                    raise DecodeError(f"message with more than {max_frames} frames")
                kind, header, payload = unpack(frames[0])
                if kind is Kind.BATCH:
                    rejected += self._on_batch(header, payload, len(frames))
                elif kind is Kind.DATA:
                    check_types(header[:6], _DATA_TYPES, "DATA")
                    if type(header[6]) not in _LOC_TYPES:
                        raise DecodeError(f"DATA location table {header[6]!r:.40} is not a slot handle")
                    self._on_data(header, payload, frames)
                elif kind is Kind.PING:
                    check_types(header[:3], _PING_TYPES, "PING")
                    self._on_ping(header[0], header[1], header[2], header[3] if len(header) > 3 else None)
                elif kind is Kind.HEALTH:
                    self._reply(identity, pack(Kind.HEALTH_REPLY, (self._health(),)))
                else:
                    raise DecodeError(f"unexpected {kind.name} message")
            except (DecodeError, MessageTooLargeError) as exc:
                rejected += 1
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("rejected a message on %s: %s", self.endpoint, exc)
        if rejected:
            self._counters.add("rejected_frames", rejected)
        if self._arrivals:
            self._store_arrivals()
        if self._pending_acks >= _ACK_BATCH:
            self._flush_all()
        else:
            self._arm_flush()

    def _store_arrivals(self) -> None:
        """Put this drain's items in the mailbox: one lock, one notify, for every message and batch."""
        arrivals, self._arrivals = self._arrivals, []
        replaced: list[_Item] = []
        with self._lock:
            box = self._box
            for slot, item in arrivals:
                old = box.get(slot)
                box[slot] = item
                if old is not None:  # a re-put replaces; the replaced one counts as consumed
                    self._taken.append((old.sid, old.seq))
                    replaced.append(old)
            self._generation += 1
            self._cv.notify_all()
        if replaced:
            self._discard(replaced)

    def _on_batch(self, header: list[Any], payload: memoryview, n_frames: int) -> int:
        """Take in the puts of one BATCH, each validated on its own; how many of them were rejected.

        Raises:
            DecodeError: the batch itself is malformed (nothing of it is taken in).
        """
        if n_frames != 1 or payload.nbytes:
            raise DecodeError("a BATCH message must be one frame holding only its header")
        check_types(header, _BATCH_TYPES, "BATCH")
        sid, low, to_stage, entries = header
        count = len(entries)
        if count < 8 or count % 4 or count > 4 * _MAX_BATCH_ENTRIES:
            raise DecodeError(f"BATCH of {count} fields is not 2..{_MAX_BATCH_ENTRIES} puts of 4 fields")
        if tuple(map(type, entries)) != _BATCH_ENTRY * (count // 4):
            raise DecodeError("BATCH entries are not (seq, from_stage, key, wire) of (int, str, str, bytes)")
        source = self._sources.get(sid) or self._source(sid)
        source.last_heard = self._now
        source.low = max(source.low, low)
        self._dirty.add(sid)
        self._pending_acks += count // 4 - 1
        self._batches_received += 1
        seen, arrived, arrivals, decode = source.seen, source.arrived, self._arrivals, self._decode
        floor = source.low
        duplicates = rejected = 0
        it = iter(entries)
        for seq, from_stage, key, wire in zip(it, it, it, it, strict=True):
            if seq < floor or seq in seen:
                duplicates += 1  # already have (or had) it: acknowledge again, keep one copy
                arrived.append(seq)
                continue
            try:
                obj = decode([wire])
            except DecodeError as exc:
                rejected += 1  # not acknowledged: the sender's deadline reports it
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("rejected put %s of a batch on %s: %s", seq, self.endpoint, exc)
                continue
            seen.add(seq)
            arrived.append(seq)
            arrivals.append(((from_stage, to_stage, key), _new_item(_Item, (obj, len(wire), sid, seq, None))))
        if duplicates:
            self._counters.add("duplicates_dropped", duplicates)
        return rejected

    def _source(self, sid: str) -> _Source:
        source = self._sources.get(sid)
        if source is None:
            if not sid or len(sid) > _MAX_SID:
                raise DecodeError(f"sender id of {len(sid)} characters")
            source = self._sources[sid] = _Source(sid, self._now)
        return source

    def _on_data(self, header: list[Any], payload: memoryview, frames: list[Any]) -> None:
        sid, seq, low, from_stage, to_stage, key, loc = header
        if loc is not None:
            self._on_handle(header, loc, payload.nbytes + len(frames) - 1)
            return
        size = payload.nbytes
        if len(frames) > 1:
            size += sum(f.buffer.nbytes for f in frames[1:])
            if size > self._max_message:
                raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
            parts = [payload, *frames[1:]]
        else:
            parts = [payload]
        source = self._sources.get(sid) or self._source(sid)
        source.last_heard = self._now
        source.low = max(source.low, low)
        self._dirty.add(sid)
        if seq < source.low or seq in source.seen:
            # A resend of something we already have (or consumed): acknowledge again, keep one copy.
            self._counters.add("duplicates_dropped")
            source.arrived.append(seq)
            return
        self._store(source, (from_stage, to_stage, key), _new_item(_Item, (self._decode(parts), size, sid, seq, None)))

    def _on_handle(self, header: list[Any], loc: bytes, extra: int) -> None:
        # Checked before any state changes: a handle from a sender we never confirmed is refused.
        sid, seq, low, from_stage, to_stage, key, _ = header
        source = self._sources.get(sid)
        if self._shm is None or source is None or source.shm is not True:
            raise DecodeError("a shared-memory handle from a sender not confirmed on this host")
        if extra:
            raise DecodeError("a shared-memory DATA message must be one frame")
        size = self._shm.size(loc)
        if size > self._max_message:
            raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
        source.last_heard = self._now
        source.low = max(source.low, low)
        self._dirty.add(sid)
        if seq < source.low or seq in source.seen:
            # Never opened twice: the first arrival's item holds the handle.
            self._counters.add("duplicates_dropped")
            source.arrived.append(seq)
            return
        self._store(source, (from_stage, to_stage, key), _Item(None, size, sid, seq, loc))

    def _store(self, source: _Source, slot: tuple[str, str, str], item: _Item) -> None:
        source.seen.add(item.seq)
        source.arrived.append(item.seq)
        self._arrivals.append((slot, item))

    def _on_ping(self, sid: str, ping: int, low: int, probe: Any) -> None:
        source = self._source(sid)
        source.last_heard = self._now
        source.low = max(source.low, low)
        if probe is not None and probe != source.probe:
            source.shm = False if self._shm is None else self._shm.probe(probe)
            source.probe = probe
        if source.low > source.pruned_low:
            source.pruned_low = source.low
            source.seen = {s for s in source.seen if s >= source.low}
            source.reported = {s for s in source.reported if s >= source.low}
        self._flush_taken()
        source.reported.update(source.consumed)
        source.consumed.clear()
        self._reply(
            source.ctl,
            pack(
                Kind.REPLY,
                (
                    self.incarnation,
                    ping,
                    to_ranges(source.arrived),
                    to_ranges(source.reported),
                    source.shm,
                    self._max_message,
                ),
            ),
        )
        source.arrived.clear()

    def _arm_flush(self) -> None:
        if not self._flush_armed:
            self._flush_armed = True
            self._loop.call_later(_ACK_DELAY_S, self._flush_all)

    def _flush_all(self) -> None:
        self._flush_armed = False
        self._pending_acks = 0
        self._flush_taken()
        self._flush_acks()

    def _flush_taken(self) -> None:
        with self._lock:
            taken, self._taken = self._taken, []
        for sid, seq in taken:
            source = self._sources.get(sid)
            if source is not None:
                source.consumed.append(seq)
                self._dirty.add(sid)

    def _flush_acks(self) -> None:
        for sid in self._dirty:
            source = self._sources.get(sid)
            if source is None or not (source.arrived or source.consumed):
                continue
            self._reply(
                source.ctl,
                pack(
                    Kind.REPLY,
                    (
                        self.incarnation,
                        -1,
                        to_ranges(source.arrived),
                        to_ranges(source.consumed),
                        source.shm,
                        self._max_message,
                    ),
                ),
            )
            source.arrived.clear()
            source.reported.update(source.consumed)
            source.consumed.clear()
        self._dirty.clear()

    def _reply(self, identity: bytes, frame: bytes) -> None:
        try:
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            # Unroutable or full: acks are repeated (pongs carry every unconfirmed consumption,
            # and unacknowledged arrivals are resent and acknowledged again), so dropping is safe.
            self._counters.add("acks_dropped")

    def _expire_sources(self) -> None:
        cutoff = time.monotonic() - self._source_ttl
        for sid in [sid for sid, s in self._sources.items() if s.last_heard < cutoff]:
            del self._sources[sid]

    def _shutdown(self) -> None:
        # Last chance to tell senders what was consumed, so a reopened receiver gets no duplicates:
        # repeat every consumption not yet confirmed, since early acks may have found no route.
        self._flush_taken()
        for source in self._sources.values():
            source.reported.update(source.consumed)
            source.consumed.clear()
            if source.reported or source.arrived:
                self._reply(
                    source.ctl,
                    pack(
                        Kind.REPLY,
                        (
                            self.incarnation,
                            -1,
                            to_ranges(source.arrived),
                            to_ranges(source.reported),
                            source.shm,
                            self._max_message,
                        ),
                    ),
                )
        self._loop.remove_reader(self._sock)
        close_socket(self._sock, linger_ms=200)
