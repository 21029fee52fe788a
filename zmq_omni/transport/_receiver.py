"""Push mode, receiving half: a bound ROUTER feeding a keyed mailbox, driven by one owner.

:class:`PushReceiver` assembles three parts:

* :class:`~zmq_omni.transport._receive_protocol.ReceiveProtocol`: what each
  message means and what each sender must hear (no I/O);
* :class:`~zmq_omni.transport._receive_socket.ReceiveSocket`: the ROUTER and
  what its driver does with it (read, store, settle, flush, close);
* :class:`~zmq_omni.transport._mailbox.Mailbox`: the items waiting for gets.

**The driver alone touches the socket.** The driver (the endpoint's I/O thread,
or the event loop of an async connector) reads the ROUTER, its CURVE monitor and
its descriptor, sends every acknowledgement and closes it, from bind to close;
:class:`ReceiveSocket` asserts it where the socket is used. A get never touches
the socket: it takes from the mailbox, or waits in the mailbox until
an arrival, a close or its deadline (:meth:`PushReceiver.take`).

Synchronization, all of it:

=========================  ===================================================  ==========================
what                       guards / means                                       who takes or writes it
=========================  ===================================================  ==========================
the driver's thread        the ROUTER, its monitor and descriptor, everything   the driver's handlers and
                           of ``ReceiveSocket`` and ``ReceiveProtocol``         timers write it; one read
                           (``flush_due`` too), ``_shut``, ``_timer``           off it: ``stats()`` reads
                                                                                ``protocol.batches`` (an
                                                                                int, a hint) on any thread
``Mailbox.lock``           items, tombstones, consumptions handed over,         any thread (a get, the
                           counters, ``closed`` (the seal), the waiting gets    driver, a cleanup, close)
``Mailbox.flush_pending``  a flush is due, so a take need not wake the driver   the driver alone sets it
                           (read under ``Mailbox.lock``; ``handover`` clears    (no lock: one writer, a
                           it under that lock)                                  bool); cleared at handover
=========================  ===================================================  ==========================

Clocks: acknowledgements wait ``ack_delay_s`` (default 20 ms) to be batched (a
lone message stream pays one REPLY per delay rather than one per put; a sender
that needs its acks sooner pings, which is answered at once; acks due within a
quarter of the delay go out on an arrival's turn instead, and their timer is
cancelled: see :meth:`PushReceiver._flush_early`); senders not heard
from for ``source_ttl_s`` and items nobody took for ``unclaimed_ttl_s`` expire on
periodic timers. Everything else is a wake-up: the descriptor, an arrival in the
mailbox, the seal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..metrics import Counters
from ._envelope import DEFAULT_MAX_KEY_BYTES
from ._loop import Driver, Timer
from ._mailbox import Mailbox
from ._receive_protocol import DEFAULT_ACK_DELAY_S, Slot
from ._receive_socket import ReceiveSocket
from ._security import Curve
from ._shm import ShmReceive
from ._tombstones import Tombstones

__all__ = ["DEFAULT_ACK_DELAY_S", "PushReceiver"]

log = logging.getLogger("zmq_omni.transport")

# Acknowledgements due within this share of ack_delay_s go out on an arrival's turn, after its store:
# a paced stream's flush timer, set at the previous arrival, would otherwise wake the driver again
# just after this one, while the consumer works on it.
_EARLY_SHARE = 0.25


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
    ) -> None:
        self._loop = loop
        self.incarnation = incarnation
        self._counters = counters
        self._source_ttl = source_ttl_s
        self._unclaimed_ttl = unclaimed_ttl_s
        self._ack_delay = ack_delay_s
        self._timer: Timer | None = None  # the flush timer armed (driver's)
        self._mailbox = Mailbox(
            tombstone_ttl_s=tombstone_ttl_s,
            max_tombstones=max_tombstones,
            on_left=self._left_mailbox,
            shm=shm,
            decode=decode,
            counters=counters,
        )
        self._shut = False  # the socket is closed (driver's)
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
            ack_delay_s=ack_delay_s,
            counters=counters,
            health=health,
            curve=curve,
            shm=shm,
        )
        self.endpoint = self._rs.endpoint
        self._rs.watch(self._drive)
        loop.every(max(1.0, source_ttl_s / 10), self._expire_sources)
        loop.every(min(1.0, unclaimed_ttl_s / 4, tombstone_ttl_s / 4), self._expire_unclaimed)
        loop.on_stop(self._shutdown)
        if loop.started:  # built on a running driver: what arrived before the reader was added is read now
            loop.call_soon(self._drive)

    @property
    def on_arrivals(self) -> Callable[[list[Slot]], None] | None:
        """Called by the driver with the addresses of each drain's arrivals, once they are in the mailbox."""
        return self._mailbox.on_arrivals

    @on_arrivals.setter
    def on_arrivals(self, hook: Callable[[list[Slot]], None] | None) -> None:
        self._mailbox.on_arrivals = hook

    @property
    def mailbox(self) -> Mailbox:
        """The mailbox gets take from (a shared stage endpoint's service lends from it too)."""
        return self._mailbox

    # -- gets (any thread) ------------------------------------------------------------------
    def take(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        deadline: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[Any, int] | None:
        """Remove and return ``(obj, nbytes)`` for the key, or None.

        Without ``deadline`` it never waits; with one it waits on the mailbox until the item
        arrives, ``time.monotonic() >= deadline``, the mailbox is sealed, or ``stop()`` holds
        (checked at each wake-up: whoever makes it true calls :meth:`wake_gets`).

        Raises:
            RuntimeError: a wait on the thread that drives this receiver (it would wait for itself).
            ShmError: the item's shared-memory payload expired or was withdrawn (the item is gone).
            DecodeError: the shared-memory payload is not a valid encoding.
        """
        slot = (from_stage, to_stage, key)
        if deadline is None:
            item = self._mailbox.pop(slot)
        else:
            if self._loop.in_loop():
                raise RuntimeError("a blocking get on the thread that drives the connector would wait for itself")
            item = self._mailbox.take(slot, deadline, stop)
        return None if item is None else self._mailbox.result(item)

    def wake_gets(self) -> None:
        """Wake every waiting get and ``wait_for_change`` so that each checks its ``stop`` (a connector closed)."""
        self._mailbox.wake_waiters()

    # -- the driver -------------------------------------------------------------------------
    def _drive(self) -> None:
        """Read what is queued (the descriptor's handler); a flood's rest on the driver's next turn."""
        if self._shut:
            return
        if not self._rs.settle():
            self._loop.call_soon(self._drive)
        else:
            self._flush_early()
        self._time_flush()

    def _flush_early(self) -> None:
        """Send the acknowledgements due soon now, the arrivals stored, rather than on a wake of their own."""
        protocol, now = self._rs.protocol, time.monotonic()
        due = protocol.flush_due
        if due is None or due - now > self._ack_delay * _EARLY_SHARE:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # What was just stored will be taken: that consumption is owed by the next flush, timed now, so a
        # take (even one racing this flush) finds a flush due and wakes no driver.
        self._rs.flush(still_pending=True)
        protocol.left_mailbox(now)
        if not self._rs.settle():  # (the sends may have hidden new arrivals from the descriptor)
            self._loop.call_soon(self._drive)

    def _left_mailbox(self, heavy: bool) -> None:
        """Something left the mailbox (it calls this under its lock, from any thread): only schedule."""
        self._loop.call_soon(self._on_left_heavy if heavy else self._on_left)

    def _on_left(self) -> None:
        if not self._shut:
            self._rs.protocol.left_mailbox(time.monotonic())
            self._time_flush()

    def _on_left_heavy(self) -> None:
        if not self._shut:
            self._rs.hand_over()  # the protocol decides on the bytes taken: at once, by ACK_BYTES
            self._flush_due()

    def _time_flush(self) -> None:
        """Have :meth:`_flush_due` run when the protocol says the acknowledgements are due (driver's)."""
        due = self._rs.protocol.flush_due
        if due is not None:
            # Every flush hands over what left the mailbox first: a get need not wake the driver till then.
            self._mailbox.flush_pending = True
            if self._timer is None or due < self._timer.due:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self._loop.call_later(max(0.0, due - time.monotonic()), self._flush_due)

    def _flush_due(self) -> None:
        """Send the acknowledgements that are due (and read what the sends may have hidden from the descriptor)."""
        self._timer = None
        if self._shut:
            return
        protocol, now = self._rs.protocol, time.monotonic()
        due = protocol.schedule(now)
        if due is not None and due <= now and not self._rs.settle():  # (it flushes first)
            self._loop.call_soon(self._drive)
        self._time_flush()

    def _expire_sources(self) -> None:
        if not self._shut:
            self._rs.protocol.expire_sources(time.monotonic() - self._source_ttl)

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

    def bury_all(self, tombs: Tombstones) -> int:
        """Take over ``tombs``, the cleanups made here before the bind (firm ones stay firm); how many items dropped.

        Each keeps its own lapse time; the items already in that they cover are dropped as by :meth:`forget`.
        """
        return self._mailbox.bury_all(tombs)

    def stats(self) -> dict[str, Any]:
        """The mailbox's counters (see :meth:`Mailbox.stats`) and the BATCH messages taken in."""
        return {**self._mailbox.stats(), "batches_received": self._rs.protocol.batches}

    def generation(self) -> int:
        """A counter bumped whenever items arrive in the mailbox (for :meth:`wait_for_change`)."""
        return self._mailbox.generation

    def wait_for_change(self, generation: int, timeout: float, stop: Callable[[], bool] | None = None) -> int:
        """Wait until the generation changes from ``generation``, at most ``timeout``, or ``stop()``; the generation."""
        return self._mailbox.wait_for_change(generation, timeout, stop)

    def close(self) -> None:
        """Seal the mailbox (no take succeeds after it, every waiting get wakes); the driver closes the socket."""
        self._mailbox.close()

    def _shutdown(self) -> None:
        """The driver's last word, as it stops: seal, last acknowledgements, then the socket."""
        self._mailbox.close()
        if self._shut:
            return
        self._shut = True
        self._rs.unwatch()
        self._rs.close()

    def __repr__(self) -> str:
        return f"<PushReceiver {self.endpoint}{' closed' if self._shut else ''}>"
