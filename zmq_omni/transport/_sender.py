"""Push mode, sending half: the I/O shell around the send window and the batching policy.

The socket layout and the delivery protocol are described in
:mod:`zmq_omni.transport._push_protocol`; what to keep, resend and fail is
decided by :class:`~zmq_omni.transport._send_window.SendWindow`, when small puts
leave together by :class:`~zmq_omni.transport._batching.Outbox`. This module
only does the I/O they decide on.

Threads and locks:

* **put threads** run :meth:`PushSender.send` (and ``reads_shm``, ``forget``,
  ``stats``, ``wait_delivered``, ``close``);
* the connector's **I/O thread** runs the handlers (``_on_ctl``, ``_on_flush``,
  ``_heartbeat``, ``_expire``, ``_ask_for_acks``, ``_close_sockets``) and owns every
  control socket;
* ``PushSender._lock`` (under the condition ``_cv``) guards the window and every
  object in it, every peer's ``Outbox`` (save ``retry_s``), ``ping_owed``,
  ``close_pending``, the counters and ``_closed``;
* a peer's ``data_lock`` guards its data socket, ``ping_no`` and the outbox's
  ``retry_s``; whoever holds it is the only sender on that socket. It is taken
  without waiting under ``_lock`` (never the other way round), and released only
  in :meth:`PushSender._release`, under ``_lock``, so an owed PING or a pending
  close can never be missed between the holder's check and its release.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from ..errors import (
    DROPPED_ENDED,
    ClosedResourceError,
    DecodeError,
    DeliveryError,
    TransportTimeoutError,
    format_seconds,
    from_zmq_error,
)
from ..metrics import Counters
from ..wire import brief
from ._batching import LONE_GAP_S, RETRY_MAX_S, RETRY_MIN_S, STREAM_FLUSH_S, Outbox, batch_end
from ._endpoints import EndpointMap
from ._envelope import Kind, check_ranges, check_types, pack, unpack
from ._loop import IoLoop
from ._push_protocol import _MAX_DRAIN, DROP_COUNTERS, DROPPED_CANCELLED, FailureCallback
from ._security import Curve
from ._send_window import Out, PeerWindow, SendWindow
from ._shm import ShmSend
from ._signal import NotifyingCondition, WouldBlock
from ._sockets import close_socket, make_socket

__all__ = ["NEARLY_FULL", "PushSender"]

#: A window holding this share of ``max_unacked`` (or of its bytes) is nearly full (``stats()["window_high_s"]``).
NEARLY_FULL = 0.9

log = logging.getLogger("zmq_omni.transport")

_REPLY_TYPES = (str, int, list, list)
_VERDICT_TYPES = (type(None), bool)
_SEND_SLICE_S = 0.05  # a blocked send re-checks close() this often
# Receivers acknowledge lazily (ack_delay_s, 20 ms: no ack traffic beside a lone message). A sender
# that needs acks sooner, its window full or a flush() waiting, pings its receivers, which answer at
# once; and again after 2, 4, 8 ... ms (at most every 100 ms) while the need lasts, since a pong
# may have left just before the consumption that would have freed the window.
_ACK_REQUEST_S = 0.002
_ACK_REQUEST_MAX_S = 0.1
# While a stream is on, the I/O thread re-checks the outbox on its next turn rather than after
# STREAM_FLUSH_S: zmq_poll counts whole milliseconds, so a 200 us timer would hold a queued put
# for up to 1 ms (a p99 latency of ~1.3 ms instead of ~0.5 ms for a put->get round trip).
_STREAM_RECHECK_S = 0.0


class _Peer:
    """The I/O side of one receiving stage; the lock guarding each field is named beside it."""

    def __init__(self, to_stage: str, endpoint: str, server_key: bytes | None) -> None:
        self.to_stage = to_stage
        self.endpoint = endpoint
        self.server_key = server_key
        self.win = PeerWindow(to_stage)  # _lock
        self.box = Outbox()  # _lock (retry_s: data_lock)
        self.data_lock = threading.Lock()
        self.data_sock: Any = None  # data_lock
        self.ping_no = 0  # data_lock
        self.ctl_sock: Any = None  # the I/O thread's
        # _lock. A beat found a put thread holding the data socket: that thread sends the PING when it lets
        # go, so a stream of puts can neither starve the heartbeat nor delay the first shm verdict.
        self.ping_owed = False
        self.close_pending = False  # _lock. Closing found the data socket held: its holder closes it.
        self.flush_soon: Callable[[], None] = lambda: None  # the sender's I/O-thread flush of this peer


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
        self._batch_item_bytes = batch_item_bytes  # a put of fewer bytes (one frame) may ride in a BATCH
        self._endpoints = endpoints
        self.sid = sid
        self._put_timeout = put_timeout_s
        self._delivery_timeout = delivery_timeout_s
        self._peer_timeout = peer_timeout_s
        self._max_count = max_unacked
        self._hwm = hwm
        self._counters = counters
        self._on_failure = on_failure
        # A plain Lock under the condition: ``with self._lock`` costs a C call, a Condition's two Python ones.
        self._lock = threading.Lock()
        self._cv = NotifyingCondition(self._lock)
        self._window = SendWindow(
            max_count=max_unacked,
            max_bytes=max_unacked_bytes,
            delivery_timeout_s=delivery_timeout_s,
            batch_max_bytes=batch_max_bytes,
            batch_max_messages=batch_max_messages,
        )
        self._peers: dict[str, _Peer] = {}  # _lock
        self._puts = 0  # _lock
        self._bytes_sent = 0  # _lock
        self._batches_sent = 0  # _lock
        self._delivery_waiters = 0  # _lock: threads in wait_delivered(); arrivals wake them
        self._high_since: float | None = None  # _lock: since when the window is nearly full (read at each beat)
        self._acks_wanted = False  # _lock: the I/O thread is asking the receivers for acks (_ask_for_acks)
        self._room_wanted = 0  # _lock: the size of the last put that found the window full
        self._closed = False  # _lock (read without it as a hint)
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
        window = self._window
        with self._lock:
            peer = self._peers.get(to_stage) or self._peer(to_stage)
            if window.full(nbytes):
                self._request_acks(nbytes)
                if not block and not self._closed:
                    raise WouldBlock
                now = self._wait_for_room(peer, nbytes, deadline)
            if self._closed:
                raise ClosedResourceError("connector closed", endpoint=peer.endpoint)
            win = peer.win
            out = window.admit(win, from_stage, key, frames, nbytes, loc, now)
            self._puts += 1
            self._bytes_sent += nbytes
            low = win.low
            outs: list[Out] | None = None
            wake = lone = False
            batched = loc is None and len(frames) == 1 and nbytes < self._batch_item_bytes and bool(win.batch_bytes)
            if batched:
                box = peer.box
                if box.idle(now) and peer.data_lock.acquire(False):
                    # One message in flight at a time: it leaves from this thread at once, as one DATA.
                    lone = True
                    box.busy_until = now + LONE_GAP_S
                elif box.add(out, now, self._batch_max_messages, win.batch_bytes) and peer.data_lock.acquire(False):
                    outs = self._take(peer)
                    box.busy_until = now + (STREAM_FLUSH_S if len(outs) > 1 else LONE_GAP_S)
                elif not box.flush_armed:
                    # It stays queued: make sure the I/O thread flushes it (one wake-up per busy period).
                    box.flush_armed = wake = True
        if lone:
            self._send_lone(peer, out, low)  # releases data_lock
        elif outs is not None:
            self._flush(peer, outs, low)  # releases data_lock
        if wake:
            self._loop.call_soon(peer.flush_soon)
        if not batched:
            self._send_direct(peer, out, low, deadline, block)

    def _send_lone(self, peer: _Peer, out: Out, low: int) -> None:
        """Send a small put that found its peer idle (caller holds ``data_lock``, released here).

        On a send error it joins the outbox for the I/O thread's retry, as a batch that met the
        high-water mark does (the put already returned; its deadline still runs).
        """
        try:
            if self._closed:
                return
            self._transmit(peer.data_sock or self._open_data(peer), peer, out, low)
        except zmq.ZMQError as exc:
            with self._lock:
                if peer.win.retained.get(out.seq) is out:
                    peer.box.requeue([out])
                peer.box.blocked = True
            if not isinstance(exc, zmq.Again):
                log.warning("sending to %s failed: %s", peer.endpoint, exc)
        finally:
            self._release(peer)

    def _request_acks(self, nbytes: int) -> None:
        """Have the receivers answer now with what arrived and was consumed (caller holds ``_lock``).

        ``nbytes``: the size of a put that found the window full (0 for a waiting ``flush()``).
        """
        if nbytes:
            self._room_wanted = nbytes
        if not self._acks_wanted and not self._closed:
            self._acks_wanted = True
            self._loop.call_soon(self._ask_for_acks)

    def _ask_for_acks(self, delay: float = _ACK_REQUEST_S) -> None:
        """Ping every receiver, and again after ``delay`` (doubling) while the window stays full or a flush waits."""
        with self._lock:
            window = self._window
            wanted = window.full(self._room_wanted) or (self._delivery_waiters > 0 and window.undelivered() > 0)
            if not wanted or self._closed:
                self._acks_wanted = False
                return
            peers = list(self._peers.values())
        for peer in peers:
            self._ping(peer)
        again = min(2 * delay, _ACK_REQUEST_MAX_S)
        self._loop.call_later(delay, lambda: self._ask_for_acks(again))

    def _wait_for_room(self, peer: _Peer, nbytes: int, deadline: float) -> float:
        """Wait (caller holds ``_cv``) until the window admits ``nbytes``; the time then."""
        window = self._window
        while not self._closed and window.full(nbytes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"send window full ({window.count} puts, {window.nbytes} bytes unconsumed)",
                    endpoint=peer.endpoint,
                )
            self._cv.wait(remaining)
        return time.monotonic()

    def _send_direct(self, peer: _Peer, out: Out, low: int, deadline: float, block: bool = True) -> None:
        try:
            self._send_data(peer, out, low, deadline, block)
        except BaseException:
            with self._lock:
                self._puts -= 1
                self._bytes_sent -= out.nbytes
                if self._window.withdraw(peer.win, out):
                    if isinstance(sys.exc_info()[1], WouldBlock):
                        # Threads only: telling the refused caller "room" would have it retry at once, in a loop.
                        threading.Condition.notify_all(self._cv)
                    else:
                        self._cv.notify_all()
            raise

    def _peer(self, to_stage: str) -> _Peer:
        """The I/O side of ``to_stage``, created on first use (caller holds ``_lock``)."""
        peer = self._peers.get(to_stage)
        if peer is None:
            endpoint = self._endpoints.require(to_stage)
            server_key = None if self._curve is None else self._curve.server_key_for(to_stage)
            peer = self._peers[to_stage] = _Peer(to_stage, endpoint, server_key)
            peer.win = self._window.peer(to_stage)
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
            while peer.win.shm is None and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            return peer.win.shm is True

    def _send_data(self, peer: _Peer, out: Out, low: int, deadline: float, block: bool = True) -> None:
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
                    while True:  # the small puts queued before this one go first (put order)
                        with self._lock:
                            if not peer.box.items:
                                break
                            queued = self._take(peer)
                            low = peer.win.low
                        self._send_or_requeue(sock, peer, queued, low)
                    self._transmit(sock, peer, out, low)
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

    def _transmit(self, sock: Any, peer: _Peer, out: Out, low: int) -> None:
        """Send one DATA message without blocking (caller holds ``data_lock``)."""
        header = (self.sid, out.seq, low, out.from_stage, peer.to_stage, out.key, out.loc)
        if out.loc is not None:
            sock.send(pack(Kind.DATA, header), zmq.NOBLOCK)
        else:
            head = pack(Kind.DATA, header, out.frames[0])
            if len(out.frames) == 1:
                sock.send(head, zmq.NOBLOCK)
            else:
                sock.send_multipart([head, *out.frames[1:]], zmq.NOBLOCK, copy=False)
        ping = peer.ping_no
        with self._lock:
            out.sent_ping = ping

    # -- coalescing small puts -------------------------------------------------------
    def _take(self, peer: _Peer) -> list[Out]:
        """The outbox's next batch (caller holds ``_lock``)."""
        return peer.box.take(peer.win.batch_bytes, peer.to_stage, self._batch_max_messages)

    def _transmit_batch(self, sock: Any, peer: _Peer, outs: list[Out], low: int) -> None:
        """Send ``outs`` as one message (caller holds ``data_lock``): a BATCH, or DATA for a single put."""
        if len(outs) == 1:
            self._transmit(sock, peer, outs[0], low)
            return
        entries: list[Any] = []
        add = entries.extend
        for out in outs:
            add((out.seq, out.from_stage, out.key, out.frames[0]))
        sock.send(pack(Kind.BATCH, (self.sid, low, peer.to_stage, entries)), zmq.NOBLOCK)
        ping = peer.ping_no
        with self._lock:
            self._window.mark_sent(outs, ping)
            self._batches_sent += 1

    def _send_or_requeue(self, sock: Any, peer: _Peer, outs: list[Out], low: int) -> None:
        """Transmit a batch taken from the outbox; on any error put it back in front (order) and re-raise."""
        if not outs:
            return
        try:
            self._transmit_batch(sock, peer, outs, low)
        except BaseException:
            with self._lock:
                peer.box.requeue([o for o in outs if peer.win.retained.get(o.seq) is o])
            raise

    def _flush(self, peer: _Peer, outs: list[Out], low: int) -> None:
        """Send a batch a put thread took (it holds ``data_lock``, released here); errors leave it queued."""
        try:
            # On an error the I/O thread retries it (the put already returned; its deadline still runs).
            self._send_batches(peer, outs, low)
        finally:
            self._release(peer)

    def _send_batches(self, peer: _Peer, taken: list[Out] | None, low: int = 0) -> bool:
        """Send ``taken``, or with None drain the whole outbox in batches (caller holds ``data_lock``).

        True when it all went; False when closed or a send failed (the peer is then marked
        ``blocked`` and what was not sent stays queued for a retry).
        """
        try:
            if self._closed:
                return False
            sock = peer.data_sock or self._open_data(peer)
            if taken is not None:
                self._send_or_requeue(sock, peer, taken, low)
            else:
                while True:
                    with self._lock:
                        if not peer.box.items:
                            break
                        outs = self._take(peer)
                        low = peer.win.low
                    self._send_or_requeue(sock, peer, outs, low)
            peer.box.retry_s = RETRY_MIN_S
            return True
        except zmq.ZMQError as exc:
            with self._lock:
                peer.box.blocked = True
            if not isinstance(exc, zmq.Again):
                log.warning("sending a batch to %s failed: %s", peer.endpoint, exc)
            return False

    def _release(self, peer: _Peer) -> None:
        """Let go of ``data_lock``: first send a PING a beat left owed, or close a socket closing left pending.

        The check and the release happen under ``_lock``, where the I/O thread sets
        ``ping_owed``/``close_pending`` after failing to take ``data_lock``: neither is missed.
        Then make sure queued puts get a flush.
        """
        retry_in: float | None = None
        while True:
            with self._lock:
                # Without a data socket (reset after an expiry) an owed PING waits for the next holder.
                owed = peer.ping_owed and not self._closed and peer.data_sock is not None
                closing = peer.close_pending
                if owed or self._closed:
                    peer.ping_owed = False
                peer.close_pending = False
                if not (owed or closing):
                    box = peer.box
                    arm = bool(box.items) and not box.flush_armed
                    if arm:
                        box.flush_armed = True
                        if box.blocked and self._loop.in_loop():
                            retry_in = box.retry_s
                            box.retry_s = min(RETRY_MAX_S, box.retry_s * 2)
                    peer.data_lock.release()
                    break
                low = peer.win.low
            if closing:
                close_socket(peer.data_sock)
                peer.data_sock = None
            else:
                self._send_ping(peer, peer.data_sock, low)
        if not arm:
            return
        if retry_in is not None:
            self._loop.call_later(retry_in, peer.flush_soon)
        else:
            self._loop.call_soon(peer.flush_soon)

    def _on_flush(self, peer: _Peer) -> None:
        """I/O thread: send everything queued for ``peer``.

        A turn that finds nothing queued ends the busy period (the next put goes out at once). One that
        finds puts queued means a stream is on: it sends them and keeps the peer busy for another
        ``STREAM_FLUSH_S``, so the stream's puts ride in batches without a wake-up per put.
        """
        box = peer.box
        with self._lock:
            box.flush_armed = False
            box.blocked = False
            if not box.items:
                return
        if not peer.data_lock.acquire(False):
            return  # the holder's _release() re-arms this flush
        try:
            streaming = self._send_batches(peer, None)
        finally:
            self._release(peer)
        if streaming:
            with self._lock:
                box.busy_until = time.monotonic() + STREAM_FLUSH_S
                if box.flush_armed:
                    return
                box.flush_armed = True
            self._loop.call_later(_STREAM_RECHECK_S, peer.flush_soon)

    def _open_data(self, peer: _Peer) -> Any:
        """Create ``peer``'s data socket (caller holds ``data_lock``)."""
        sock = make_socket(self._loop.ctx, zmq.DEALER, hwm=self._hwm, identity=b"d" + self.sid.encode())
        if self._curve is not None and peer.server_key is not None:
            self._curve.make_client(sock, peer.server_key)
        sock.connect(peer.endpoint)
        peer.data_sock = sock
        return sock

    def forget(self, match: Callable[[str], bool]) -> int:
        """Release the puts whose key matches that the receiver holds (the request was cleaned up); how many.

        Puts still on their way are not cancelled (see :meth:`SendWindow.forget`): they are released
        once their arrival is confirmed, or reported failed like any other.
        """
        with self._lock:
            dropped = self._window.forget(match)
            if dropped:
                self._cv.notify_all()
        self._discard(dropped)
        return len(dropped)

    def _discard(self, outs: list[Out]) -> None:
        # A slot still READY was never leased: free it now rather than at its ttl.
        if self._shm is not None:
            for out in outs:
                if out.loc is not None:
                    self._shm.discard(out.loc)

    def stats(self) -> dict[str, Any]:
        """Window occupancy and per-peer state."""
        with self._lock:
            window = self._window
            return {
                "puts": self._puts,
                "bytes_sent": self._bytes_sent,
                "batches_sent": self._batches_sent,
                "pending": window.count,
                "pending_bytes": window.nbytes,
                "undelivered": sum(len(p.win.unarrived) for p in self._peers.values()),
                "window_full": window.full(1),
                "window_high_s": 0.0 if self._high_since is None else time.monotonic() - self._high_since,
                "peers": {
                    p.to_stage: {
                        "endpoint": p.endpoint,
                        "incarnation": p.win.incarnation,
                        "pending": len(p.win.retained),
                        "shm": p.win.shm,
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
        window = self._window
        with self._lock:
            self._delivery_waiters += 1
            try:
                if window.undelivered():
                    self._request_acks(0)
                while not self._closed and window.undelivered():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining)
                return not window.undelivered()
            finally:
                self._delivery_waiters -= 1

    def close(self) -> list[str]:
        """Fail waiting and future puts, and report every put whose arrival was never confirmed.

        A put that arrived but was not consumed yet is not reported: the receiver
        holds it (only a receiver crash before its ``get`` could lose it now, since
        no sender is left to resend it), unless it lies in our shared memory, which
        closing unlinks. Sockets close on the loop thread.

        Returns:
            The keys of the puts reported lost.
        """
        with self._lock:
            self._closed = True
            lost = [(self._peers[win.to_stage], out) for win, out in self._window.close()]
            self._cv.notify_all()
        self._report_lost(lost, lambda peer: f"connector closed before stage {peer.to_stage!r} confirmed delivery")
        return [out.key for _, out in lost]

    def _report_lost(self, lost: list[tuple[_Peer, Out]], why: Callable[[_Peer], str]) -> None:
        """Free the slots of puts given up on and report each one as a DeliveryError (no lock held)."""
        self._discard([out for _, out in lost])
        for peer, out in lost:
            self._counters.add("delivery_failures")
            self._fail_puts(peer, [out], why(peer))

    def _report_disposed(self, peer: _Peer, code: int, outs: list[Out]) -> None:
        """Count and report each put the receiver dropped unconsumed as a failed put (no lock held).

        Its request gets a send failure like a delivery timeout: the put returned
        ok, but nothing downstream will ever read it.
        """
        # No slot to discard: the receiver released it as it dropped the item.
        self._counters.add(DROP_COUNTERS[code], len(outs))
        if code == DROPPED_CANCELLED:
            dropped, reason = "cancelled", f"stage {peer.to_stage!r} {DROPPED_ENDED}"
        else:
            dropped = "unclaimed"
            reason = f"stage {peer.to_stage!r} dropped it: unclaimed (no get took it within its unclaimed_ttl_s)"
        self._fail_puts(peer, outs, reason, dropped)

    def _fail_puts(self, peer: _Peer, outs: list[Out], reason: str, dropped: str | None = None) -> None:
        """Report each of ``outs`` to ``peer`` as a failed put with a DeliveryError (no lock held)."""
        for out in outs:
            error = DeliveryError(reason, key=out.key, endpoint=peer.endpoint, dropped=dropped)
            self._on_failure("put", out.from_stage, peer.to_stage, out.key, reason, error)

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
                    raise DecodeError(f"REPLY shm verdict {brief(verdict)} is not a bool or null")
                batch_bytes = header[5] if len(header) > 5 else 0
                if type(batch_bytes) is not int or batch_bytes < 0:
                    raise DecodeError(f"REPLY batch size {brief(batch_bytes)} is not a count of bytes")
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
        """Apply a REPLY to the window, then resend what it says was lost."""
        now = time.monotonic()
        with self._lock:
            win = peer.win
            verdict = win.shm
            result = self._window.apply_reply(win, incarnation, ping, arrived, consumed, shm, batch_bytes, now)
            if result.restarted:
                log.info("receiver %s restarted (%s); resending %d puts", peer.endpoint, incarnation, len(win.retained))
            if win.shm is not None and win.shm != verdict:
                log.info("receiver %s %s our shared memory", peer.endpoint, "reads" if win.shm else "cannot read")
            if result.changed or result.freed or self._delivery_waiters:
                self._cv.notify_all()
            if arrived and self._cv.listener is not None:
                # Arrivals drained ZeroMQ's queue: a non-blocking put refused at the high-water mark may go now.
                self._cv.listener()
        if result.disposed:  # the receiver dropped them unconsumed, and says why: each put failed
            self._report_disposed(peer, ping, result.disposed)
        if result.resend:
            self._resend(peer, result.resend)

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
            self._release(peer)

    def _resend(self, peer: _Peer, outs: list[Out]) -> None:
        with self._idle_data_socket(peer) as sock:
            if sock is None:
                return
            with self._lock:  # what is still unarrived now, and the low mark to send with it
                win = peer.win
                live = [o for o in outs if o.seq in win.unarrived]
                low = win.low
                batch_bytes = win.batch_bytes
            small = [o for o in live if batch_bytes and self._batchable(o)]
            large = [o for o in live if not (batch_bytes and self._batchable(o))]
            sent = 0
            try:
                start = 0
                while start < len(small):
                    end = batch_end(small, start, batch_bytes, peer.to_stage, self._batch_max_messages)
                    self._transmit_batch(sock, peer, small[start:end], low)
                    sent += end - start
                    start = end
                for out in large:
                    self._transmit(sock, peer, out, low)
                    sent += 1
            except zmq.ZMQError:
                pass  # full or gone: the next pong retries what is still unacknowledged
            if sent:
                self._counters.add("resends", sent)

    def _batchable(self, out: Out) -> bool:
        return out.loc is None and len(out.frames) == 1 and out.nbytes < self._batch_item_bytes

    def _heartbeat(self) -> None:
        now = time.monotonic()
        with self._lock:
            window = self._window
            if window.count >= NEARLY_FULL * window.max_count or window.nbytes >= NEARLY_FULL * window.max_bytes:
                if self._high_since is None:
                    self._high_since = now
            else:
                self._high_since = None
            peers = list(self._peers.values())
            for peer in peers:
                at_risk = self._window.note_silence(peer.win, now, self._peer_timeout)
                if at_risk:
                    log.warning(
                        "receiver %s silent for %.1fs; %d delivered puts at risk",
                        peer.endpoint,
                        now - peer.win.last_heard,
                        at_risk,
                    )
        for peer in peers:
            self._ping(peer)

    def _ping(self, peer: _Peer) -> None:
        """Send ``peer`` a PING now, or have the put thread holding its socket send it (I/O thread)."""
        with self._lock:
            if not peer.data_lock.acquire(False):
                # A put thread holds the socket: it pings as it lets go (see _release).
                peer.ping_owed = not self._closed
                return
            low = peer.win.low
        try:
            if not self._closed:
                self._send_ping(peer, peer.data_sock or self._open_data(peer), low)
        finally:
            self._release(peer)

    def _send_ping(self, peer: _Peer, sock: Any, low: int) -> None:
        """Send a PING (with our probe) on the data socket; the caller holds ``data_lock``."""
        header: tuple[Any, ...] = (self.sid, peer.ping_no + 1, low)
        if self._probe is not None:
            header += (self._probe,)
        try:
            sock.send(pack(Kind.PING, header), zmq.NOBLOCK)
            peer.ping_no += 1
        except zmq.ZMQError:  # queue full while the receiver is away: the next beat tries again
            pass

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            failed = [(self._peers[win.to_stage], out) for win, out in self._window.expire(now)]
            if failed:
                self._cv.notify_all()
            # Why, read now: the incarnation is the window's (under this lock).
            answered = {peer.to_stage: peer.win.incarnation is not None for peer, _ in failed}
        for peer in {peer for peer, _ in failed}:
            self._reset_data_socket(peer)
        self._report_lost(
            failed,
            lambda peer: (
                f"delivery to stage {peer.to_stage!r} not confirmed within {format_seconds(self._delivery_timeout)} "
                f"(receiver {'gone or not acknowledging' if answered[peer.to_stage] else 'never answered'})"
            ),
        )

    def _reset_data_socket(self, peer: _Peer) -> None:
        # Drop what ZeroMQ still queues for this peer, so a put reported failed is never delivered later.
        if peer.data_lock.acquire(blocking=False):
            try:
                close_socket(peer.data_sock)
                peer.data_sock = None
            finally:
                self._release(peer)

    def _close_sockets(self) -> None:
        for peer in list(self._peers.values()):
            if peer.ctl_sock is not None:
                self._loop.remove_reader(peer.ctl_sock)
                close_socket(peer.ctl_sock)
            # A put thread notices close() within one send slice and lets go; if one still holds the
            # data socket after this wait, it closes the socket itself as it lets go (see _release).
            if not peer.data_lock.acquire(timeout=0.5):
                with self._lock:
                    if not peer.data_lock.acquire(False):
                        peer.close_pending = True
                        continue
            try:
                close_socket(peer.data_sock)
                peer.data_sock = None
            finally:
                self._release(peer)
