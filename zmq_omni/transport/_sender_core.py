"""Push mode, sending half: what its put threads and its I/O thread share.

:class:`SenderCore` holds the one lock, the window, the peers, the counters
both sides bump and the failure reports both sides make; :class:`Peer` is one
receiving stage: its window and outbox, and its data socket with the hand-over
between the threads that send on it (``data_lock``, :meth:`Peer.release`).
Nothing here runs by itself: put threads (:mod:`~zmq_omni.transport._sender`)
and the I/O thread (:mod:`~zmq_omni.transport._sender_io`) call it. The table
in :mod:`~zmq_omni.transport._sender` lists every lock and flag and who takes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import DROPPED_ENDED, DeliveryError, TransportError, from_zmq_error
from ..metrics import Counters
from ._batching import RETRY_MAX_S, RETRY_MIN_S, Outbox
from ._envelope import Kind, pack
from ._loop import Driver
from ._push_protocol import DROP_COUNTERS, DROPPED_CANCELLED, FailureCallback
from ._security import Curve
from ._send_window import Out, PeerWindow, SendWindow
from ._shm import ShmSend
from ._signal import NotifyingCondition
from ._sockets import close_socket, make_socket

__all__ = ["Peer", "SenderCore", "open_data_socket"]

log = logging.getLogger("zmq_omni.transport")


class SenderCore:
    """The state of one push sender that both its put threads and its I/O thread use.

    Every mutable field is guarded by :attr:`lock` (``closed`` is also read
    without it, as a hint). Settings are fixed at construction.
    """

    def __init__(
        self,
        loop: Driver,
        window: SendWindow,
        *,
        sid: str,
        hwm: int,
        counters: Counters,
        on_failure: FailureCallback,
        curve: Curve | None,
        shm: ShmSend | None,
        batch_max_messages: int,
        batch_item_bytes: int,
    ) -> None:
        self.loop = loop
        self.window = window
        self.sid = sid
        self.hwm = hwm
        self.counters = counters
        self.on_failure = on_failure
        self.curve = curve
        self.shm = shm
        self.probe = None if shm is None else shm.probe
        self.batch_max_messages = batch_max_messages
        self.batch_item_bytes = batch_item_bytes  # a put of fewer bytes (one frame) may ride in a BATCH
        # A plain Lock under the condition: ``with lock`` costs a C call, a Condition's two Python ones.
        self.lock = threading.Lock()
        self.cv = NotifyingCondition(self.lock)
        self.peers: dict[str, Peer] = {}
        self.closed = False
        self.batches_sent = 0
        self.delivery_waiters = 0  # threads in wait_delivered(); arrivals wake them
        self.acks_wanted = False  # the I/O thread is asking the receivers for acks
        self.room_wanted = 0  # the size of the last put that found the window full
        self.high_since: float | None = None  # since when the window is nearly full (set at each beat)

    def batchable(self, out: Out) -> bool:
        """True when ``out`` may ride in a BATCH: one frame, small, not in shared memory."""
        return out.loc is None and len(out.frames) == 1 and out.nbytes < self.batch_item_bytes

    def report_lost(self, lost: list[tuple[Peer, Out]], why: Callable[[Peer], str]) -> None:
        """Free the slots of puts given up on and report each one as a DeliveryError (no lock held)."""
        self.discard([out for _, out in lost])
        for peer, out in lost:
            self.counters.add("delivery_failures")
            self.fail_puts(peer, [out], why(peer))

    def report_disposed(self, peer: Peer, code: int, outs: list[Out]) -> None:
        """Count and report each put the receiver dropped unconsumed as a failed put (no lock held).

        Its request gets a send failure like a delivery timeout: the put returned
        ok, but nothing downstream will ever read it.
        """
        # No slot to discard: the receiver released it as it dropped the item.
        self.counters.add(DROP_COUNTERS[code], len(outs))
        if code == DROPPED_CANCELLED:
            dropped, reason = "cancelled", f"stage {peer.to_stage!r} {DROPPED_ENDED}"
        else:
            dropped = "unclaimed"
            reason = f"stage {peer.to_stage!r} dropped it: unclaimed (no get took it within its unclaimed_ttl_s)"
        self.fail_puts(peer, outs, reason, dropped)

    def fail_puts(self, peer: Peer, outs: list[Out], reason: str, dropped: str | None = None) -> None:
        """Report each of ``outs`` to ``peer`` as a failed put with a DeliveryError (no lock held)."""
        for out in outs:
            error = DeliveryError(reason, key=out.key, endpoint=peer.endpoint, dropped=dropped)
            self.on_failure("put", out.from_stage, peer.to_stage, out.key, reason, error)

    def discard(self, outs: list[Out]) -> None:
        """Free the shared-memory slots of puts that left the window unread (a slot still READY only)."""
        if self.shm is not None:
            for out in outs:
                if out.loc is not None:
                    self.shm.discard(out.loc)


def open_data_socket(core: SenderCore, endpoint: str, server_key: bytes | None, *, anonymous: bool = False) -> Any:
    """A data socket connected to ``endpoint``; ``anonymous``: without our routing id (a socket only made to be closed).

    Raises:
        TransportError: ZeroMQ could not make the socket (out of sockets or descriptors) or refused
            the endpoint (one it cannot connect to, such as a wildcard port).
    """
    identity = None if anonymous else b"d" + core.sid.encode()
    try:
        sock = make_socket(core.loop.ctx, zmq.DEALER, hwm=core.hwm, identity=identity)
    except zmq.ZMQError as exc:  # (out of sockets or descriptors)
        raise from_zmq_error(exc, endpoint=endpoint, op="send") from exc
    try:
        if core.curve is not None and server_key is not None:
            core.curve.make_client(sock, server_key)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        close_socket(sock)
        raise from_zmq_error(exc, endpoint=endpoint, op="connect") from exc
    return sock


class Peer:
    """One receiving stage: its window, its outbox and its data socket; the guard of each field is beside it.

    The methods that send hold ``data_lock`` (their docstrings say so); only
    :meth:`release` lets go of it.
    """

    def __init__(self, core: SenderCore, win: PeerWindow, endpoint: str, server_key: bytes | None) -> None:
        self.core = core
        self.to_stage = win.to_stage
        self.endpoint = endpoint
        self.server_key = server_key
        self.win = win  # core.lock
        self.box = Outbox()  # core.lock (retry_s: data_lock)
        self.data_lock = threading.Lock()
        self.data_sock: Any = None  # data_lock
        self.ping_no = 0  # data_lock
        self.ctl_sock: Any = None  # the I/O thread's alone
        self.io_failing = False  # the I/O thread's alone: its last socket error was logged (once, not each beat)
        self.close_pending = False  # core.lock. Closing found the data socket held: its holder closes it.
        self.flush_soon: Callable[[], None] = lambda: None  # the I/O thread's flush of this outbox

    # -- the holder of data_lock ------------------------------------------------------------
    def socket(self) -> Any:
        """The data socket, created on first use (caller holds ``data_lock``)."""
        assert self.data_lock.locked()
        sock = self.data_sock
        if sock is None:
            sock = self.data_sock = open_data_socket(self.core, self.endpoint, self.server_key)
        return sock

    def close_socket(self) -> None:
        """Close the data socket, dropping what ZeroMQ still queues (caller holds ``data_lock``)."""
        close_socket(self.data_sock)
        self.data_sock = None

    def transmit(self, sock: Any, out: Out, low: int, incarnation: str | None = None) -> None:
        """Send one DATA message without blocking (caller holds ``data_lock``).

        ``incarnation``: a resend's target receiver incarnation (any other drops it); None on a first send.
        """
        header: tuple[Any, ...] = (self.core.sid, out.seq, low, out.from_stage, self.to_stage, out.key, out.loc)
        if incarnation is not None:
            header += (incarnation,)
        if out.loc is not None:
            sock.send(pack(Kind.DATA, header), zmq.NOBLOCK)
        else:
            head = pack(Kind.DATA, header, out.frames[0])
            if len(out.frames) == 1:
                sock.send(head, zmq.NOBLOCK)
            else:
                sock.send_multipart([head, *out.frames[1:]], zmq.NOBLOCK, copy=False)
        ping = self.ping_no
        with self.core.lock:
            out.sent_ping = ping

    def transmit_batch(self, sock: Any, outs: list[Out], low: int, incarnation: str | None = None) -> None:
        """Send ``outs`` as one message (caller holds ``data_lock``): a BATCH, or DATA for a single put."""
        if len(outs) == 1:
            self.transmit(sock, outs[0], low, incarnation)
            return
        entries: list[Any] = []
        add = entries.extend
        for out in outs:
            add((out.seq, out.from_stage, out.key, out.frames[0]))
        core = self.core
        header: tuple[Any, ...] = (core.sid, low, self.to_stage, entries)
        if incarnation is not None:
            header += (incarnation,)
        sock.send(pack(Kind.BATCH, header), zmq.NOBLOCK)
        ping = self.ping_no
        with core.lock:
            core.window.mark_sent(outs, ping)
            core.batches_sent += 1

    def send_ping(self, sock: Any, low: int) -> None:
        """Send a PING (with our probe) on the data socket (caller holds ``data_lock``)."""
        header: tuple[Any, ...] = (self.core.sid, self.ping_no + 1, low)
        if self.core.probe is not None:
            header += (self.core.probe,)
        try:
            sock.send(pack(Kind.PING, header), zmq.NOBLOCK)
            self.ping_no += 1
        except zmq.ZMQError:  # queue full while the receiver is away: the next beat tries again
            pass

    def take_batch(self) -> list[Out]:
        """The outbox's next batch (caller holds ``core.lock``)."""
        return self.box.take(self.win.batch_bytes, self.to_stage, self.core.batch_max_messages)

    def send_queued(self, sock: Any, low: int) -> int:
        """Send everything in the outbox, in batches (caller holds ``data_lock``); the low mark last sent.

        Raises:
            zmq.ZMQError: a send failed; what was not sent is back in front of the outbox.
        """
        while True:
            with self.core.lock:
                if not self.box.items:
                    return low
                outs = self.take_batch()
                low = self.win.low
            if outs:
                try:
                    self.transmit_batch(sock, outs, low)
                except BaseException:
                    self.requeue(outs)
                    raise

    def requeue(self, taken: list[Out]) -> None:
        """Put back in front of the outbox (their order) the puts taken from it that did not leave (no lock held).

        Those the window no longer holds stay out: close() or expiry reported them.
        """
        with self.core.lock:
            self.box.requeue([o for o in taken if self.win.retained.get(o.seq) is o])

    def send_batches(self, taken: list[Out] | None, low: int = 0) -> bool:
        """Send ``taken`` as one message, or with None the whole outbox (caller holds ``data_lock``).

        True when it all went; False when closed or a send failed (the outbox is then
        ``blocked`` and what was not sent is back in front of it for the I/O thread's retry).
        """
        core = self.core
        if core.closed:
            return False  # close() took every queued put and reported it
        try:
            try:
                sock = self.data_sock or self.socket()  # opened by the first send
                if taken is None:
                    self.send_queued(sock, low)
                elif taken:
                    self.transmit_batch(sock, taken, low)
            except BaseException:
                if taken:
                    self.requeue(taken)
                raise
            self.box.retry_s = RETRY_MIN_S
            return True
        except (zmq.ZMQError, TransportError) as exc:  # TransportError: no socket (out of descriptors)
            with core.lock:
                self.box.blocked = True
            if not isinstance(exc, zmq.Again):
                log.warning("sending a batch to %s failed: %s", self.endpoint, exc)
            return False

    def release(self) -> None:
        """Let go of ``data_lock``: first close the socket if closing left that to us.

        The check and the release happen under ``core.lock``, where the I/O thread sets
        ``close_pending`` after failing to take ``data_lock``: it is never missed.
        Then make sure queued puts get a flush (none once closed: close() took them).
        """
        core = self.core
        retry_in: float | None = None
        while True:
            with core.lock:
                closing = self.close_pending
                self.close_pending = False
                if not closing:
                    box = self.box
                    arm = bool(box.items) and not box.flush_armed and not core.closed
                    if arm:
                        box.flush_armed = True
                        if box.blocked and core.loop.in_loop():
                            retry_in = box.retry_s
                            box.retry_s = min(RETRY_MAX_S, box.retry_s * 2)
                    self.data_lock.release()
                    break
            self.close_socket()
        if not arm:
            return
        if retry_in is not None:
            core.loop.call_later(retry_in, self.flush_soon)
        else:
            core.loop.call_soon(self.flush_soon)
