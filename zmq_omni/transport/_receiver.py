"""Push mode, receiving half: a bound ROUTER feeding a keyed mailbox, read by one owner at a time.

:class:`PushReceiver` assembles four parts:

* :class:`~zmq_omni.transport._receive_protocol.ReceiveProtocol`: what each
  message means and what each sender must hear (no I/O);
* :class:`~zmq_omni.transport._receive_socket.ReceiveSocket`: the ROUTER and
  what its holder does with it (read, store, settle, flush, close);
* :class:`~zmq_omni.transport._mailbox.Mailbox`: the items waiting for gets;
* :class:`~zmq_omni.transport._thread_driver.SocketOwner`: who may use the
  socket now, the **driver** (the connector's I/O thread, or the event loop of
  an async connector) or a **getter** (a thread in a blocking get reading for
  itself; never with ``getters_read=False``, the event loop's case).

Synchronization, all of it:

=========================  ===================================================  ==========================
what                       guards / means                                       who takes or writes it
=========================  ===================================================  ==========================
``SocketOwner`` (a lock)   the ROUTER and everything of ``ReceiveSocket``,      the driver in a handler or
                           the ``ReceiveProtocol``, ``_watching``, ``_shut``    timer; a getter (try only,
                                                                                never waited for but by
                                                                                ``_shutdown``)
``SocketOwner.parked``     the driver does not watch the descriptor: getters    written by the driver;
                           read, and the reclaim tick takes the socket back     read by releasing getters
``Mailbox.lock`` (+ cv)    items, tombstones, consumptions handed over,         any thread; may try the
                           ``flush_due``, counters, ``closed``, ``_watchers``   owner under it, never wait
``_close_pending``         ``_shutdown`` could not take the socket: the getter  ``_shutdown``, the releasing
                           holding it closes it as it lets go (mailbox lock)    getter, both under the lock
``_reclaim_armed``         the reclaim tick is scheduled                        the driver's thread only
``_recall`` (an eventfd)   wakes a reading getter: close, or acks now due;      the driver, ``close``
                           closed under the mailbox lock (never written after)
=========================  ===================================================  ==========================

The descriptor the driver watches is ZeroMQ's ``zmq.FD``, never the socket:
polling a descriptor touches no socket, so a getter may take the socket at any
moment without a hand-over from the driver. Whoever releases the socket
leaves nothing queued behind the descriptor's back (see the rule in
:mod:`~zmq_omni.transport._thread_driver`).

Acknowledgements wait ``ack_delay_s`` (default 20 ms) to be batched: a lone
message stream pays one REPLY per delay rather than one per put, and a sender
that needs its acks sooner pings, which is answered at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import from_zmq_error
from ..metrics import Counters
from ._envelope import DEFAULT_MAX_KEY_BYTES
from ._loop import Driver
from ._mailbox import Mailbox
from ._receive_protocol import Item, Slot
from ._receive_socket import _SETTLE_ROUNDS, ReceiveSocket
from ._security import Curve
from ._shm import ShmReceive
from ._thread_driver import Holder, SocketOwner

__all__ = ["DEFAULT_ACK_DELAY_S", "PushReceiver"]

log = logging.getLogger("zmq_omni.transport")

DEFAULT_ACK_DELAY_S = 0.02
# A socket getters read stays theirs (no driver wake-up per get) until none read it this long.
_RECLAIM_S = 0.02


class PushReceiver:
    """The receiving half of push mode (see the module docstring)."""

    def __init__(
        self,
        loop: Driver,
        bind_endpoint: str,
        *,
        incarnation: str,
        decode: Callable[[list[Any]], Any],
        decode_each: Callable[[list[bytes]], list[Any]],
        hwm: int,
        max_message_bytes: int,
        max_frames: int,
        source_ttl_s: float,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
        counters: Counters,
        unclaimed_ttl_s: float = 300.0,
        ack_delay_s: float = DEFAULT_ACK_DELAY_S,
        tombstone_ttl_s: float = 60.0,
        max_tombstones: int = 65536,
        health: Callable[[], dict[str, Any]],
        curve: Curve | None = None,
        shm: ShmReceive | None = None,
        getters_read: bool = True,
    ) -> None:
        self._loop = loop
        self.incarnation = incarnation
        self._counters = counters
        self._source_ttl = source_ttl_s
        self._unclaimed_ttl = unclaimed_ttl_s
        self._reclaim_s = min(ack_delay_s, _RECLAIM_S)
        self._getters_read = getters_read
        self._owner = SocketOwner()
        self._mailbox = Mailbox(
            ack_delay_s=ack_delay_s,
            tombstone_ttl_s=tombstone_ttl_s,
            max_tombstones=max_tombstones,
            on_armed=self._flush_armed,
            shm=shm,
            decode=decode,
            counters=counters,
        )
        self._watchers = 0  # wait_for_change callers (under the mailbox lock)
        self._watching = False  # the driver polls the descriptor (driver's, under the owner)
        self._reclaim_armed = False  # the reclaim tick is scheduled (driver's)
        self._shut = False  # the socket is closed (under the owner)
        self._close_pending = False  # _shutdown left the close to the getter holding the socket (mailbox lock)
        self._recall = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._rs = ReceiveSocket(
                loop,
                bind_endpoint,
                self._mailbox,
                incarnation=incarnation,
                decode=decode,
                decode_each=decode_each,
                hwm=hwm,
                max_message_bytes=max_message_bytes,
                max_frames=max_frames,
                max_key_bytes=max_key_bytes,
                counters=counters,
                health=health,
                curve=curve,
                shm=shm,
            )
        except BaseException:
            os.close(self._recall)
            raise
        self.endpoint = self._rs.endpoint
        self._fd = self._rs.fd
        self._watch()
        loop.every(max(1.0, source_ttl_s / 10), self._expire_sources)
        loop.every(min(1.0, unclaimed_ttl_s / 4, tombstone_ttl_s / 4), self._expire_unclaimed)
        loop.on_stop(self._shutdown)

    @property
    def on_arrivals(self) -> Callable[[list[Slot]], None] | None:
        """Called by the socket's holder with the addresses of each drain's arrivals, once they are in the mailbox."""
        return self._mailbox.on_arrivals

    @on_arrivals.setter
    def on_arrivals(self, hook: Callable[[list[Slot]], None] | None) -> None:
        self._mailbox.on_arrivals = hook
        if hook is not None:
            self._loop.call_soon(self._drive)  # someone waits for arrivals: the driver watches from now on

    # -- gets (any thread) ------------------------------------------------------------------
    def take(self, from_stage: str, to_stage: str, key: str) -> tuple[Any, int] | None:
        """Remove and return ``(obj, nbytes)`` for the key, or None; never waits.

        While getters keep the socket and none reads it now, it first takes in what ZeroMQ holds.

        Raises:
            ShmError: the item's shared-memory payload expired or was withdrawn (the item is gone).
            DecodeError: the shared-memory payload is not a valid encoding.
        """
        slot = (from_stage, to_stage, key)
        item = self._mailbox.pop(slot)
        if item is None and self._owner.parked and self._getters_read and self._owner.try_take(Holder.GETTER):
            try:
                try:
                    self._rs.settle()
                finally:
                    self._release_getter()
            except zmq.ZMQError as exc:
                self._raise_unless_closed(exc)
            item = self._mailbox.pop(slot)
        return None if item is None else self._mailbox.result(item)

    def take_by(self, from_stage: str, to_stage: str, key: str, deadline: float) -> tuple[Any, int] | None:
        """Like :meth:`take`, waiting until ``time.monotonic() >= deadline``.

        It waits on the mailbox's condition, or, when nobody holds the socket, reads it itself.

        Raises:
            RuntimeError: called on the thread that drives this receiver (it would wait for itself).
        """
        if self._loop.in_loop():
            raise RuntimeError("a blocking get on the thread that drives the connector would wait for itself")
        slot = (from_stage, to_stage, key)
        mailbox = self._mailbox
        with mailbox.lock:
            item = mailbox.pop_locked(slot)
            while item is None:
                if mailbox.closed:
                    return None
                if self._getters_read and self._owner.try_take(Holder.GETTER):
                    break  # (a deadline already passed ends the read at once)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                mailbox.wait(remaining)
                item = mailbox.pop_locked(slot)
        if item is None:  # this getter holds the socket
            try:
                try:
                    item = self._read_for(slot, deadline)
                finally:
                    self._release_getter()
            except zmq.ZMQError as exc:
                self._raise_unless_closed(exc)
            if item is None:
                return None
        return mailbox.result(item)

    def _read_for(self, slot: Slot, deadline: float) -> Item | None:
        """Read the socket until ``slot``'s item arrives or ``deadline`` passes (a getter holding the socket)."""
        rs, recall, mailbox = self._rs, self._recall, self._mailbox
        sock = rs.socket
        poll_set = [(sock, zmq.POLLIN), (recall, zmq.POLLIN)]
        while not mailbox.closed:
            now = time.monotonic()
            wait = deadline - now
            if wait <= 0:
                return None
            due = mailbox.flush_due
            if due is not None:
                if due <= now:
                    rs.flush()
                    continue
                wait = min(wait, due - now)
            # Capped: an infinite deadline waits in 60 s slices (close and due acks wake it at once).
            for ready, _ in zmq.zmq_poll(poll_set, int(min(wait, 60.0) * 1000) + 1):
                if ready is sock:
                    rs.read(slot[2])
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(recall)
            item = mailbox.pop(slot)
            if item is not None:
                return item
        return None

    def _release_getter(self) -> None:
        """A getter gives the socket back, leaving nothing behind the driver's back (see the module docstring)."""
        owner, mailbox = self._owner, self._mailbox
        try:
            if not mailbox.closed:
                self._settle_for_driver()
        finally:
            # Released under the mailbox lock: a get that found the socket held counts itself waiting under
            # it, so the check of ``waiting`` below misses none. (_shutdown hands the close over under it too.)
            with mailbox.lock:
                close_here = self._close_pending
                if not close_here:
                    owner.release(Holder.GETTER)
            if close_here:
                try:
                    self._close_owned()
                finally:
                    owner.release(Holder.GETTER)
        if close_here:
            return
        if owner.parked and (self._watchers or mailbox.on_arrivals is not None) and not mailbox.closed:
            self._loop.call_soon(self._drive)  # someone waits for arrivals without reading: the driver reads now
        if mailbox.waiting:
            mailbox.wake_waiters()  # a getter waiting on the condition may read now

    def _settle_for_driver(self) -> None:
        """A leaving getter reads what its spent signal announced and sends the acks due.

        Never raises: the getter already holds its item, so a socket error here is logged and left to
        the driver's next turn, not a reason to fail this get and lose that item.
        """
        try:
            if not self._owner.parked:  # the driver watches the descriptor: a signal this getter spent would be missed
                if not self._rs.settle():
                    self._loop.call_soon(self._drive)
            else:  # the driver's reclaim tick settles it
                due = self._mailbox.flush_due
                if due is not None and due <= time.monotonic():
                    self._rs.flush()
        except zmq.ZMQError:
            log.warning("settling %s as a getter left failed; the driver reads next", self.endpoint, exc_info=True)
            self._loop.call_soon(self._drive)

    def _raise_unless_closed(self, exc: zmq.ZMQError) -> None:
        """A getter's pyzmq error: from a receiver closed meanwhile it ends the get (returns), else raised.

        Raises:
            TransportError: the error came from a receiver still open (translated, never raw pyzmq).
        """
        if not self._mailbox.closed:
            raise from_zmq_error(exc, endpoint=self.endpoint, op="receive") from exc

    # -- the driver -------------------------------------------------------------------------
    def _watch(self) -> None:
        """Poll the descriptor on the driver (driver's thread, holding the socket or before any reader)."""
        if not self._watching:
            self._loop.add_reader(self._fd, self._drive)
            self._watching = True

    def _drive(self) -> None:
        """Read what is queued as the driver: the descriptor's handler, and the way back from parking."""
        owner = self._owner
        owner.parked = True  # first: a getter that releases after our try below fails sees it
        if not owner.try_take(Holder.DRIVER):
            if self._watching:  # a getter reads: stop polling the descriptor rather than spin on it
                self._loop.remove_reader(self._fd)
                self._watching = False
            self._arm_reclaim()
            return
        try:
            if self._shut:
                return
            owner.parked = False
            if not self._watching:
                self._watch()
            # An event loop runs its other callbacks between drains (a flood must not stall it).
            if not self._rs.settle(_SETTLE_ROUNDS if self._getters_read else 1):
                self._loop.call_soon(self._drive)  # a flood: the rest on the driver's next turn
        except BaseException:  # (logged by the driver) the signal may be spent: look again a moment later
            self._loop.call_later(self._reclaim_s, self._drive)
            raise
        finally:
            self._release_driver()

    def _release_driver(self) -> None:
        """The driver gives the socket back; a getter that found it held waits on the mailbox: one may read now.

        Released under the mailbox lock, as a getter releases: a get that found the socket held
        counts itself waiting under that lock, so the check of ``waiting`` misses none.
        """
        mailbox = self._mailbox
        with mailbox.lock:
            self._owner.release(Holder.DRIVER)
            mailbox.wake_waiters_locked()

    def _arm_reclaim(self) -> None:
        if not self._reclaim_armed:
            self._reclaim_armed = True
            self._loop.call_later(self._reclaim_s, self._reclaim)

    def _reclaim(self) -> None:
        """While parked: take the socket back once getters left it idle; meanwhile have their acks sent when due."""
        self._reclaim_armed = False
        owner = self._owner
        if not owner.parked or self._shut:
            return
        if time.monotonic() - owner.last_release >= self._reclaim_s:
            self._drive()  # (parks again, re-arming this, if a getter holds the socket)
            return
        self._flush_due()
        self._arm_reclaim()

    def _flush_armed(self) -> None:
        """An acknowledgement became owed (the mailbox calls this under its lock, from any thread)."""
        if self._loop.in_loop():
            self._schedule_flush()
        else:
            self._loop.call_soon(self._schedule_flush)

    def _schedule_flush(self) -> None:
        due = self._mailbox.flush_due
        if due is not None:
            self._loop.call_later(max(0.0, due - time.monotonic()), self._flush_due)

    def _flush_due(self) -> None:
        """Send the acknowledgements that are due, or have the reading getter send them."""
        due = self._mailbox.flush_due
        if due is None or due > time.monotonic() or self._shut:
            return
        if self._owner.try_take(Holder.DRIVER):
            try:
                if self._watching and not self._rs.settle():  # (it flushes first)
                    self._loop.call_soon(self._drive)
                elif not self._watching:
                    self._rs.flush()
            finally:
                self._release_driver()
        else:  # a getter holds the socket: it flushes when it wakes or leaves; else this, a moment later
            os.eventfd_write(self._recall, 1)
            self._loop.call_later(self._reclaim_s, self._flush_due)

    def _expire_sources(self) -> None:
        if self._owner.try_take(Holder.DRIVER):  # else next time: a getter reads now
            try:
                self._rs.protocol.expire_sources(time.monotonic() - self._source_ttl)
            finally:
                self._release_driver()

    def _expire_unclaimed(self) -> None:
        """Drop items no get took within ``unclaimed_ttl_s`` (their senders hear why) and lapsed tombstones."""
        expired = self._mailbox.expire(time.monotonic(), self._unclaimed_ttl)
        if expired:
            log.warning(
                "%d items on %s were never taken within unclaimed_ttl_s=%ss: dropped",
                expired,
                self.endpoint,
                self._unclaimed_ttl,
            )

    # -- any thread --------------------------------------------------------------------------
    def buries(self, key: str) -> bool:
        """True while a tombstone covers ``key``: a put of it arriving now is dropped."""
        return self._mailbox.buries(key)

    def forget(
        self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None, firm: bool = False
    ) -> int:
        """Drop mailbox items whose key matches (their senders hear why); return how many.

        With ``key`` (``cleanup``, ``abandon_get``) or ``prefix`` (``cleanup_prefix``) it also
        leaves a tombstone: for ``tombstone_ttl_s`` an arrival under it is dropped at once. A get
        of a key under it lifts it unless it is ``firm`` (a cleanup's).
        """
        return self._mailbox.forget(match, key=key, prefix=prefix, firm=firm)

    def stats(self) -> dict[str, Any]:
        """The mailbox's counters (see :meth:`Mailbox.stats`) and the BATCH messages taken in."""
        return {**self._mailbox.stats(), "batches_received": self._rs.protocol.batches}

    def generation(self) -> int:
        """A counter bumped whenever items arrive in the mailbox (for :meth:`wait_for_change`)."""
        return self._mailbox.generation

    def wait_for_change(self, generation: int, timeout: float) -> int:
        """Wait until the generation differs from ``generation``, at most ``timeout``; the generation then."""
        mailbox = self._mailbox
        with mailbox.lock:
            self._watchers += 1
        try:
            if self._owner.parked:
                self._loop.call_soon(self._drive)  # getters keep the socket: the driver reads from now on
            return mailbox.wait_for_change(generation, timeout)
        finally:
            with mailbox.lock:
                self._watchers -= 1

    def watch_soon(self) -> None:
        """Have the driver read the socket again if getters keep it (for a new arrivals hook)."""
        self._loop.call_soon(self._drive)

    def close(self) -> None:
        """Wake every waiting get; the socket closes on the driver after a last acknowledgement."""
        self._mailbox.close()
        with self._mailbox.lock:  # (the descriptor is closed under it: its number is never reused meanwhile)
            if self._recall >= 0:
                os.eventfd_write(self._recall, 1)

    def _shutdown(self) -> None:
        """The driver's last word: acknowledgements, then the socket (on the driver, as it stops)."""
        self.close()
        owner = self._owner
        took = owner.try_take(Holder.DRIVER, timeout=1.0)  # a getter sees the close within one message
        if not took:
            with self._mailbox.lock:  # a getter releases under it: it sees the hand-over, or we take the socket
                took = owner.try_take(Holder.DRIVER)
                self._close_pending = not took
        if not took:
            log.warning("a getter on %s still reads at close: it closes the socket as it leaves", self.endpoint)
            return
        try:
            self._close_owned()
        finally:
            self._release_driver()

    def _close_owned(self) -> None:
        """Last acknowledgements, then close the socket (holds it: the driver, or the getter handed the close)."""
        self._shut = True
        if self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False
        self._rs.close()
        with self._mailbox.lock:
            os.close(self._recall)
            self._recall = -1

    def __repr__(self) -> str:
        return f"<PushReceiver {self.endpoint} holder={self._owner.holder.value}>"
