"""Push mode, sending half: a bounded window of unconsumed puts, batching, resends and deadlines.

The socket layout and the delivery protocol are described in :mod:`zmq_omni.transport._push_protocol`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zmq

from ..errors import (
    ClosedResourceError,
    DecodeError,
    DeliveryError,
    TransportTimeoutError,
    format_seconds,
    from_zmq_error,
)
from ..metrics import Counters
from ._endpoints import EndpointMap
from ._envelope import Kind, check_ranges, check_types, pack, unpack
from ._loop import IoLoop
from ._push_protocol import _MAX_DRAIN, FailureCallback
from ._security import Curve
from ._shm import ShmSend
from ._signal import NotifyingCondition, WouldBlock
from ._sockets import close_socket, make_socket

__all__ = ["PushSender"]

log = logging.getLogger("zmq_omni.transport")

_REPLY_TYPES = (str, int, list, list)
_VERDICT_TYPES = (type(None), bool)
_BATCH_OVERHEAD = 512  # bytes of a BATCH frame beyond its entries' costs (preamble, sid, low, to_stage)
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
        # A beat found a put thread holding the data socket: that thread sends the PING when it lets go,
        # so a stream of puts can neither starve the heartbeat nor delay the first shm verdict.
        self.ping_owed = False
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
        self._cv = NotifyingCondition(self._lock)
        self._peers: dict[str, _Peer] = {}
        self._count = 0
        self._bytes = 0
        self._puts = 0
        self._bytes_sent = 0
        self._batches_sent = 0
        self._delivery_waiters = 0  # threads in wait_delivered(): arrivals wake them
        self._closed = False
        loop.every(heartbeat_s, self._heartbeat)
        loop.every(min(0.05, heartbeat_s), self._expire)
        loop.on_stop(self._close_sockets)

    # -- put threads ----------------------------------------------------------------
    def on_window_change(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` (from any thread, with the window lock held) whenever room may have freed."""
        self._cv.listener = listener

    def send(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        frames: list[Any],
        nbytes: int,
        loc: bytes | None = None,
        *,
        block: bool = True,
    ) -> None:
        """Admit one put into the window and hand it to ZeroMQ, waiting at most ``put_timeout_s``.

        With ``loc`` (a packed slot handle) the payload lies in shared memory and
        ``frames`` is ignored; the caller discards the slot if this raises.

        A small put (one frame of fewer than ``batch_item_bytes``) is sent at once
        when nothing is in progress; one that arrives while a send is in progress
        or queued waits in the peer's outbox and rides in the next BATCH (sent by
        a full outbox's put or by the I/O thread's next turn). Either way it is in
        the window when this returns, so its deadline covers it.

        With ``block=False`` a full window, or ZeroMQ's queue at its high-water
        mark for a put that does not ride in a batch, raises :class:`WouldBlock`
        at once (nothing kept); room is signalled through :meth:`on_window_change`
        (window room, and arrivals that drained ZeroMQ's queue).

        Raises:
            TransportTimeoutError: no window room or ZeroMQ queue room in time.
            ClosedResourceError: the sender was closed.
            ConfigError: ``to_stage`` has no endpoint.
            WouldBlock: ``block=False`` and the window (or ZeroMQ's queue) is full.
        """
        now = time.monotonic()
        deadline = now + self._put_timeout
        with self._lock:
            peer = self._peers.get(to_stage) or self._peer(to_stage)
            if self._count and (self._count >= self._max_count or self._bytes + nbytes > self._max_bytes):
                if not block and not self._closed:
                    raise WouldBlock
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
            self._send_direct(peer, out, deadline, block)

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

    def _send_direct(self, peer: _Peer, out: _Out, deadline: float, block: bool = True) -> None:
        try:
            self._send_data(peer, out, deadline, block)
        except BaseException:
            with self._lock:
                self._puts -= 1
                self._bytes_sent -= out.nbytes
                if peer.retained.pop(out.seq, None) is not None:
                    peer.unarrived.pop(out.seq, None)
                    self._count -= 1
                    self._bytes -= out.nbytes
                    peer.advance_low()
                    if isinstance(sys.exc_info()[1], WouldBlock):
                        # Threads only: telling the refused caller "room" would have it retry at once, in a loop.
                        threading.Condition.notify_all(self._cv)
                    else:
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

    def _send_data(self, peer: _Peer, out: _Out, deadline: float, block: bool = True) -> None:
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
                    if not block:
                        raise WouldBlock from exc  # withdrawn from the window by _send_direct
                    # At the high-water mark: wait for room in short slices so close() is never held up.
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed:
                        raise (
                            ClosedResourceError("connector closed", endpoint=peer.endpoint)
                            if self._closed
                            else TransportTimeoutError(
                                f"ZeroMQ send queue full for {format_seconds(self._put_timeout)}",
                                endpoint=peer.endpoint,
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
            # On an error the I/O thread retries it (the put already returned; its deadline still runs).
            self._send_batches(peer, outs)
        finally:
            self._release(peer)

    def _send_batches(self, peer: _Peer, taken: list[_Out] | None) -> bool:
        """Send ``taken``, or with None drain the whole outbox in batches (caller holds ``data_lock``).

        True when it all went; False when closed or a send failed (the peer is then marked
        ``blocked`` and what was not sent stays queued for a retry).
        """
        try:
            if self._closed:
                return False
            sock = peer.data_sock or self._open_data(peer)
            if taken is not None:
                self._send_or_requeue(sock, peer, taken)
            else:
                while peer.outbox:
                    with self._lock:
                        outs = self._take(peer)
                    self._send_or_requeue(sock, peer, outs)
            peer.retry_s = _RETRY_MIN_S
            return True
        except zmq.ZMQError as exc:
            with self._lock:
                peer.blocked = True
            if not isinstance(exc, zmq.Again):
                log.warning("sending a batch to %s failed: %s", peer.endpoint, exc)
            return False

    def _release(self, peer: _Peer) -> None:
        """Let go of ``data_lock`` (after a PING a beat left owed); make sure queued puts get a flush."""
        if peer.ping_owed and peer.data_sock is not None and not self._closed:
            self._send_ping(peer, peer.data_sock)
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
        try:
            streaming = self._send_batches(peer, None)
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

    def wait_delivered(self, timeout_s: float) -> bool:
        """Wait until every put so far is safe without this sender; True when none is left.

        Safe: arrived at its receiver, and for a put in shared memory also
        consumed (closing unlinks our slots, so a handle not yet opened dies).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._delivery_waiters += 1
            try:
                while not self._closed and self._undelivered():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining)
                return not self._undelivered()
            finally:
                self._delivery_waiters -= 1

    def _undelivered(self) -> int:
        return sum(
            len(peer.unarrived) + sum(1 for out in peer.retained.values() if out.loc is not None)
            for peer in self._peers.values()
        )

    def close(self) -> None:
        """Fail waiting and future puts, and report every put whose arrival was never confirmed.

        A put that arrived but was not consumed yet is not reported: the receiver
        holds it (only a receiver crash before its ``get`` could lose it now, since
        no sender is left to resend it), unless it lies in our shared memory, which
        closing unlinks. Sockets close on the loop thread.
        """
        lost: list[tuple[_Peer, _Out]] = []
        with self._lock:
            self._closed = True
            for peer in self._peers.values():
                # A put whose own thread is still handing it to ZeroMQ fails there and reports itself.
                gone = [
                    out
                    for out in peer.retained.values()
                    if (out.seq in peer.unarrived or out.loc is not None) and (out.sent_ping is not None or out.queued)
                ]
                for out in gone:
                    out.queued = False
                    peer.unarrived.pop(out.seq, None)
                    del peer.retained[out.seq]
                    self._count -= 1
                    self._bytes -= out.nbytes
                    lost.append((peer, out))
            self._cv.notify_all()
        self._report_lost(lost, lambda peer: f"connector closed before stage {peer.to_stage!r} confirmed delivery")

    def _report_lost(self, lost: list[tuple[_Peer, _Out]], why: Callable[[_Peer], str]) -> None:
        """Free the slots of puts given up on and report each one as a DeliveryError (no lock held)."""
        self._discard(out for _, out in lost)
        for peer, out in lost:
            self._counters.add("delivery_failures")
            reason = why(peer)
            self._on_failure(
                "put",
                out.from_stage,
                peer.to_stage,
                out.key,
                reason,
                DeliveryError(reason, key=out.key, endpoint=peer.endpoint),
            )

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
                if arrived and self._cv.listener is not None:
                    # Arrivals drained ZeroMQ's queue: a non-blocking put refused at the high-water mark may go now.
                    self._cv.listener()
                if self._delivery_waiters:
                    self._cv.notify_all()
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

    @contextlib.contextmanager
    def _idle_data_socket(self, peer: _Peer) -> Iterator[Any]:
        """The I/O thread's turn at ``peer``'s data socket: None when a put thread holds it or we are closed.

        Never waits: a put thread may be blocked at the high-water mark, and the next beat or pong retries.
        """
        if not peer.data_lock.acquire(blocking=False):
            yield None
            return
        try:
            yield None if self._closed else (peer.data_sock or self._open_data(peer))
        finally:
            peer.data_lock.release()

    def _resend(self, peer: _Peer, outs: list[_Out]) -> None:
        with self._idle_data_socket(peer) as sock:
            if sock is None:
                return
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
        with self._idle_data_socket(peer) as sock:
            if sock is None:
                # A put thread holds the socket: it pings as it lets go (see _release).
                peer.ping_owed = not self._closed
                return
            self._send_ping(peer, sock)

    def _send_ping(self, peer: _Peer, sock: Any) -> None:
        """Send a PING (with our probe) on the data socket; the caller holds ``data_lock``."""
        header: tuple[Any, ...] = (self.sid, peer.ping_no + 1, peer.low)
        if self._probe is not None:
            header += (self._probe,)
        try:
            sock.send(pack(Kind.PING, header), zmq.NOBLOCK)
            peer.ping_no += 1
            peer.ping_owed = False
        except zmq.ZMQError:  # queue full while the receiver is away: the next beat tries again
            pass

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
        self._report_lost(
            failed,
            lambda peer: (
                f"delivery to stage {peer.to_stage!r} not confirmed within {format_seconds(self._delivery_timeout)} "
                f"(receiver {'never answered' if peer.incarnation is None else 'gone or not acknowledging'})"
            ),
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
