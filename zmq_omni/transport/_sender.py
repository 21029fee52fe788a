"""Push mode, sending half: :class:`PushSender`, the put threads' side, and the sender's synchronization.

The socket layout and the delivery protocol are described in
:mod:`~zmq_omni.transport._push_protocol`; what to keep, resend and fail is
decided by :class:`~zmq_omni.transport._send_window.SendWindow`, when small puts
leave together by :class:`~zmq_omni.transport._batching.Outbox`. The sender is
three modules, by who runs the code:

* here, the **put threads**: :meth:`PushSender.send` (admission, window waits,
  and the two ways out: a small put through the peer's outbox, which a lone
  one leaves at once as one DATA and a stream in BATCHes, a large one
  directly) and the rest of the public API;
* :mod:`~zmq_omni.transport._sender_io`, the connector's **I/O thread** (its
  driver, see :class:`~zmq_omni.transport.Driver`; driven by an event loop,
  the loop's thread, which then runs the puts too): control sockets and
  REPLYs, resends, heartbeats and ack requests, expiry, outbox flushes,
  closing the sockets at stop;
* :mod:`~zmq_omni.transport._sender_core`, what both use: the shared state
  (:class:`~zmq_omni.transport._sender_core.SenderCore`) and each receiving
  stage's data socket with its hand-over
  (:class:`~zmq_omni.transport._sender_core.Peer`).

Synchronization, all of it (``core`` is the ``SenderCore``, ``peer`` a ``Peer``):

=========================  ============================================  ==========================================
what                       guards / means                                who takes or writes it, in which order
=========================  ============================================  ==========================================
``core.lock``              the window and every ``PeerWindow`` and       put threads and the I/O thread, for
(+ ``core.cv``)            ``Out`` in it, ``core.peers``, each outbox    sections without I/O (``cv.wait`` apart);
                           (but ``retry_s``), ``close_pending``,         under it a ``data_lock`` is only ever
                           ``closed``, the counters, ``high_since``,     *tried*, never waited for
                           the ack-request state
``peer.data_lock``         the peer's data socket, ``ping_no``,          put threads: tried under ``core.lock`` (an
                           ``box.retry_s``; its holder is the only       outbox due to leave), or waited for up
                           sender on that socket                         to the put's deadline with no lock held
                                                                         (a direct send). The I/O thread: only
                                                                         tried (at stop: waited for 0.5 s, no lock
                                                                         held). A holder may then take
                                                                         ``core.lock``. Released only by
                                                                         ``Peer.release``, under ``core.lock``
``peer.close_pending``     stop found the socket held: the holder        set by the I/O thread, cleared by the
                           closes it as it lets go                       holder in ``Peer.release`` (under lock)
``box.flush_armed``        one flush of the outbox is scheduled on the   set by a put thread or ``Peer.release``;
                           I/O thread                                    cleared by the flush it scheduled (under
                                                                         lock)
``box.blocked``            the last send met the high-water mark: the    set by a data-socket holder, cleared by
                           I/O thread retries, backing off               the I/O thread's flush (under lock)
``core.acks_wanted``       one chain of ack requests runs at a time      set by a put thread, cleared by the chain
                                                                         (under lock)
``core.closed``            set once by :meth:`PushSender.close`, in the  written under lock; read without it as a
                           same section that takes every unconfirmed     hint: a thread that finds it set leaves
                           put from the window                           its put to close(), which reported it
``peer.ctl_sock``,         the control socket; a socket error of the     the I/O thread alone (no lock)
``peer.io_failing``        peer's was logged (later ones at DEBUG)
``core.cv.listener``       called (under lock) where room may have       set by :meth:`PushSender.on_window_change`
                           freed: an event loop's waiters hear it
=========================  ============================================  ==========================================

Lock order: ``data_lock`` before ``core.lock``; the other way round only
without waiting. ``Peer.release`` checks ``close_pending`` and releases under
``core.lock``, where the I/O thread sets it after failing to take
``data_lock``: a pending close is never missed. A PING that finds the data
socket held is skipped: the next beat (or ack request) sends one; so is one
whose socket cannot be made (logged once per peer), without stopping the
beat or the ack requests of the peers after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import ClosedResourceError, TransportTimeoutError, format_seconds, from_zmq_error
from ..metrics import Counters
from ._batching import LONE_GAP_S, STREAM_FLUSH_S
from ._endpoints import EndpointMap
from ._loop import Driver
from ._push_protocol import FailureCallback
from ._security import Curve
from ._send_window import Out, SendWindow
from ._sender_core import Peer, SenderCore, open_data_socket
from ._sender_io import SenderIo
from ._shm import ShmSend
from ._signal import WouldBlock
from ._sockets import close_socket

__all__ = ["PushSender"]

log = logging.getLogger("zmq_omni.transport")

_SEND_SLICE_S = 0.05  # a blocked send re-checks close() this often


class PushSender:
    """The sending half of push mode: a bounded window of unconsumed puts, resends and deadlines."""

    def __init__(
        self,
        loop: Driver,
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
        self.sid = sid
        self._loop = loop
        self._endpoints = endpoints
        self._put_timeout = put_timeout_s
        window = SendWindow(
            max_count=max_unacked,
            max_bytes=max_unacked_bytes,
            delivery_timeout_s=delivery_timeout_s,
            batch_max_bytes=batch_max_bytes,
            batch_max_messages=batch_max_messages,
        )
        self._core = SenderCore(
            loop,
            window,
            sid=sid,
            hwm=hwm,
            counters=counters,
            on_failure=on_failure,
            curve=curve,
            shm=shm,
            batch_max_messages=batch_max_messages,
            batch_item_bytes=batch_item_bytes,
        )
        self._io = SenderIo(
            self._core, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s, delivery_timeout_s=delivery_timeout_s
        )
        self._puts = 0  # core.lock
        self._bytes_sent = 0  # core.lock
        self._lost_at_close = False  # core.lock: close() reported puts it could not confirm

    def on_window_change(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` (from any thread, with the window lock held) whenever room may have freed."""
        self._core.cv.listener = listener

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

        Once admitted, a put is either sent, or taken back and its error raised,
        or (when :meth:`close` runs meanwhile) left to close, which reports it.

        Raises:
            TransportTimeoutError: no window room or ZeroMQ queue room in time.
            ClosedResourceError: the sender was closed before the put was admitted.
            ConfigError: ``to_stage`` has no endpoint.
            WouldBlock: ``block=False`` and the window (or ZeroMQ's queue) is full.
        """
        now = time.monotonic()
        deadline = now + self._put_timeout
        core = self._core
        window = core.window
        with core.lock:
            peer = core.peers.get(to_stage) or self._peer(to_stage)
            if window.full(nbytes):
                self._request_acks(nbytes)
                if not block and not core.closed:
                    raise WouldBlock
                now = self._wait_for_room(peer, nbytes, deadline)
            if core.closed:
                raise ClosedResourceError("connector closed", endpoint=peer.endpoint)
            win = peer.win
            out = window.admit(win, from_stage, key, frames, nbytes, loc, now)
            self._puts += 1
            self._bytes_sent += nbytes
            low = win.low
            outs: list[Out] | None = None
            wake = False
            batched = bool(win.batch_bytes) and core.batchable(out)
            if batched:
                box = peer.box
                if box.add(out, now, core.batch_max_messages, win.batch_bytes) and peer.data_lock.acquire(False):
                    # A lone put (the peer idle) leaves from this thread at once, as one DATA; else a BATCH.
                    outs = peer.take_batch()
                    box.busy_until = now + (STREAM_FLUSH_S if len(outs) > 1 else LONE_GAP_S)
                elif not box.flush_armed:
                    # It stays queued: make sure the I/O thread flushes it (one wake-up per busy period).
                    box.flush_armed = wake = True
        if outs is not None:
            try:  # on an error the I/O thread retries (the put already returned; its deadline still runs)
                peer.send_batches(outs, low)
            finally:
                peer.release()
        if wake:
            self._loop.call_soon(peer.flush_soon)
        if not batched:
            self._send_direct(peer, out, low, deadline, block)

    def _peer(self, to_stage: str) -> Peer:
        """The peer of ``to_stage``, created on first use (caller holds ``core.lock``)."""
        core = self._core
        peer = core.peers.get(to_stage)
        if peer is None:
            endpoint = self._endpoints.require(to_stage)
            server_key = None if core.curve is None else core.curve.server_key_for(to_stage)
            peer = core.peers[to_stage] = Peer(core, core.window.peer(to_stage), endpoint, server_key)
            self._io.add_peer(peer)
        return peer

    def _request_acks(self, nbytes: int) -> None:
        """Have the receivers answer now with what arrived and was consumed (caller holds ``core.lock``).

        ``nbytes``: the size of a put that found the window full (0 for a waiting ``flush()``).
        """
        core = self._core
        if nbytes:
            core.room_wanted = nbytes
        if not core.acks_wanted and not core.closed:
            core.acks_wanted = True
            self._loop.call_soon(self._io.ask_for_acks)

    def _wait_for_room(self, peer: Peer, nbytes: int, deadline: float) -> float:
        """Wait (caller holds ``core.lock``) until the window admits ``nbytes``; the time then."""
        core = self._core
        window = core.window
        while not core.closed and window.full(nbytes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"send window full ({window.count} puts, {window.nbytes} bytes unconsumed)",
                    endpoint=peer.endpoint,
                )
            core.cv.wait(remaining)
        return time.monotonic()

    def _send_direct(self, peer: Peer, out: Out, low: int, deadline: float, block: bool) -> None:
        """Send a put that cannot ride in a BATCH; on failure take it back and raise.

        Unless close() took it first: close reported it, and a put is reported once.
        """
        core = self._core
        try:
            self._send_data(peer, out, low, deadline, block)
        except BaseException as exc:
            with core.lock:
                withdrawn = core.window.withdraw(peer.win, out)
                if withdrawn:
                    self._puts -= 1
                    self._bytes_sent -= out.nbytes
                    if isinstance(exc, WouldBlock):
                        # Threads only: telling the refused caller "room" would have it retry at once, in a loop.
                        threading.Condition.notify_all(core.cv)
                    else:
                        core.cv.notify_all()
            if withdrawn or not isinstance(exc, Exception):
                raise

    def _send_data(self, peer: Peer, out: Out, low: int, deadline: float, block: bool) -> None:
        """Send ``out`` after whatever small puts wait before it (their order), waiting up to ``deadline``."""
        core = self._core
        lock = peer.data_lock
        if not lock.acquire(False) and not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransportTimeoutError("another put held the socket past put_timeout_s", endpoint=peer.endpoint)
        try:
            if core.closed:
                raise ClosedResourceError("connector closed", endpoint=peer.endpoint)
            sock = peer.socket()
            while True:
                try:
                    low = peer.send_queued(sock, low)  # the small puts queued before this one go first
                    peer.transmit(sock, out, low)
                    return
                except zmq.Again as exc:
                    if not block:
                        raise WouldBlock from exc
                    # At the high-water mark: wait for room in short slices so close() is never held up.
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or core.closed:
                        raise (
                            ClosedResourceError("connector closed", endpoint=peer.endpoint)
                            if core.closed
                            else TransportTimeoutError(
                                f"ZeroMQ send queue full for {format_seconds(self._put_timeout)}",
                                endpoint=peer.endpoint,
                            )
                        ) from exc
                    sock.poll(int(min(remaining, _SEND_SLICE_S) * 1000) + 1, zmq.POLLOUT)
                except zmq.ZMQError as exc:
                    raise from_zmq_error(exc, endpoint=peer.endpoint, op="send") from exc
        finally:
            peer.release()

    def meet(self, to_stage: str) -> None:
        """Connect to ``to_stage``'s receiver now, before any put to it, and ask for its shm verdict.

        A put to it later finds the verdict there (see :mod:`~zmq_omni.transport._shm`). A stage
        whose socket cannot be made is not met (no beat pings it); a put to it reports why, as it
        would without this.

        Raises:
            ConfigError: ``to_stage`` has no endpoint, or CURVE is on and names no server key for it.
            TransportError: ZeroMQ could not make or connect the socket to ``to_stage``.
        """
        core = self._core
        with core.lock:
            if to_stage in core.peers or core.closed:
                return
            endpoint = self._endpoints.require(to_stage)
            server_key = None if core.curve is None else core.curve.server_key_for(to_stage)
        # A socket made and closed here, to meet no stage whose socket cannot be made (its beats would
        # only log that). Not kept as the peer's: made before the peer's control socket, which the
        # I/O thread makes, it would connect first to a receiver that binds later, whose answer to
        # our first PING then finds no route back (and the next PING is a beat away). Without our
        # routing id, so that the receiver never holds two routes of that id.
        close_socket(open_data_socket(core, endpoint, server_key, anonymous=True))
        with core.lock:
            if to_stage not in core.peers and not core.closed:
                self._peer(to_stage)

    def reads_shm(self, to_stage: str, wait_s: float = 0.0) -> bool:
        """True once ``to_stage``'s receiver proved it reads our shared memory (waits up to ``wait_s``)."""
        core = self._core
        if core.probe is None:
            return False
        deadline = time.monotonic() + wait_s
        with core.lock:
            peer = core.peers.get(to_stage) or self._peer(to_stage)
            while peer.win.shm is None and not core.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                core.cv.wait(remaining)
            return peer.win.shm is True

    def forget(self, match: Callable[[str], bool]) -> int:
        """Release the puts whose key matches that the receiver holds (the request was cleaned up); how many.

        Puts still on their way are not cancelled (see :meth:`SendWindow.forget`): they are released
        once their arrival is confirmed, or reported failed like any other.
        """
        core = self._core
        with core.lock:
            dropped = core.window.forget(match)
            if dropped:
                core.cv.notify_all()
        core.discard(dropped)
        return len(dropped)

    def stats(self) -> dict[str, Any]:
        """Window occupancy and per-peer state."""
        core = self._core
        with core.lock:
            window = core.window
            return {
                "puts": self._puts,
                "bytes_sent": self._bytes_sent,
                "batches_sent": core.batches_sent,
                "pending": window.count,
                "pending_bytes": window.nbytes,
                "undelivered": sum(len(p.win.unarrived) for p in core.peers.values()),
                "window_full": window.full(1),
                "window_high_s": 0.0 if core.high_since is None else time.monotonic() - core.high_since,
                "peers": {
                    p.to_stage: {
                        "endpoint": p.endpoint,
                        "incarnation": p.win.incarnation,
                        "pending": len(p.win.retained),
                        "puts": p.win.next_seq,
                        "shm": p.win.shm,
                    }
                    for p in core.peers.values()
                },
            }

    def wait_delivered(self, timeout_s: float) -> bool:
        """Wait until every put so far is safe without this sender; True when none is left.

        Safe: arrived at its receiver, and for a put in shared memory also
        consumed (closing unlinks our slots, so a handle not yet opened dies).
        False once :meth:`close` reported puts it could not confirm.
        """
        deadline = time.monotonic() + timeout_s
        core = self._core
        window = core.window
        with core.lock:
            core.delivery_waiters += 1
            try:
                if window.undelivered():
                    self._request_acks(0)
                while not core.closed and window.undelivered():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    core.cv.wait(remaining)
                return not window.undelivered() and not self._lost_at_close
            finally:
                core.delivery_waiters -= 1

    def close(self) -> list[str]:
        """Fail waiting and future puts, and report every put whose arrival was never confirmed.

        That includes a put whose thread is still handing it to ZeroMQ: that
        thread finds the sender closed and leaves its put to this report. A put
        that arrived but was not consumed yet is not reported: the receiver holds
        it (only a receiver crash before its ``get`` could lose it now, since no
        sender is left to resend it), unless it lies in our shared memory, which
        closing unlinks. Sockets close on the loop thread.

        Returns:
            The keys of the puts reported lost.
        """
        core = self._core
        with core.lock:
            core.closed = True
            lost = [(core.peers[win.to_stage], out) for win, out in core.window.close()]
            if lost:
                self._lost_at_close = True
            core.cv.notify_all()
        core.report_lost(lost, lambda peer: f"connector closed before stage {peer.to_stage!r} confirmed delivery")
        return [out.key for _, out in lost]
