"""Push mode, receiving half: the keyed mailbox between the receiver's driver and the gets.

One lock (:attr:`Mailbox.lock`) guards everything here, the waiting threads
included: the items by address, the tombstones, the consumptions and
drops not yet handed to the protocol, the counters and the closed flag (when
acknowledgements are due is the protocol's, not the mailbox's). Those are
written under the lock; a read without it is a hint only, and a few are
single reads of that kind: ``closed`` on the driver (``ReceiveSocket.read`` and
``settle``, a rebind's ``_reopen``) and by ``StageClient._swapped``, and
``generation`` by ``PushReceiver.generation()``. The hooks ``on_arrivals`` and
``on_lendable`` are set without it (under the shared endpoint's lock) and read
as one attribute each. The receiver's
driver stores arrivals; any thread takes, waiting (:meth:`Mailbox.take`) until an
arrival, the seal or its deadline wakes it. A waiting thread sleeps on an
eventfd of its own, listed under the mailbox lock; whoever wakes it takes it off
the list and writes it, the driver after letting go of the lock, and then yields
the CPU: the get woken runs before the rest of the driver's turn. An event
loop is woken by :attr:`Mailbox.on_arrivals`, which is called outside the lock
with the addresses that arrived.

**Close seals.** :meth:`Mailbox.close` sets ``closed`` under the lock and wakes
every waiting thread; every take after it returns ``None`` and records nothing,
so the receiver's last acknowledgements, sent after the seal, name every item a
get ever took (an item taken after them would be delivered again by the next
incarnation of the endpoint).

Nothing unclaimed lives forever: an item no get took within ``unclaimed_ttl_s``
is dropped (:meth:`Mailbox.expire`), and :meth:`Mailbox.forget` with a key or a
prefix leaves a :class:`~zmq_omni.transport._tombstones.Tombstones` entry under
which a late arrival is dropped at once. Either way the item is handed over as
dropped, with a code saying why, so its sender hears of it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ShmError
from ..metrics import Counters
from ._push_protocol import DROPPED_CANCELLED, DROPPED_UNCLAIMED
from ._receive_protocol import ACK_BYTES, Item, Slot
from ._shm import ShmReceive
from ._signal import Sleeper, thread_sleeper
from ._tombstones import Tombstones

__all__ = ["Mailbox"]

log = logging.getLogger("zmq_omni.transport")

#: Most puts taken through a previous binder remembered (a binder change resends at most a window's worth).
_ELSEWHERE_MAX = 65536


class Mailbox:
    """Items waiting for ``get``, in arrival order (see the module docstring).

    When acknowledgements go out is the protocol's decision
    (:meth:`~zmq_omni.transport._receive_protocol.ReceiveProtocol.schedule`); the mailbox only tells
    the driver that something left it: ``on_left(False)`` at the first consumption or drop since the
    last :meth:`handover` (none while the driver has a flush due: :attr:`flush_pending`),
    ``on_left(True)`` each time another ``ACK_BYTES`` of payload was taken.

    Args:
        tombstone_ttl_s: how long a buried key or prefix keeps dropping arrivals.
        max_tombstones: most tombstones held.
        on_left: called under the lock (it must only schedule) as said above.
        shm: the shared-memory reader: items holding a slot handle are opened by :meth:`result`,
            and the slot of an item dropped unopened is released.
        decode: an opened slot's views to the object.
        counters: where a slot found gone is counted (``shm_stale``).
    """

    def __init__(
        self,
        *,
        tombstone_ttl_s: float,
        max_tombstones: int,
        on_left: Callable[[bool], None],
        shm: ShmReceive | None = None,
        decode: Callable[[list[Any]], Any] = list,
        counters: Counters | None = None,
    ) -> None:
        self._shm = shm
        self._decode = decode
        self._counters = counters
        self.lock = threading.Lock()
        self._sleepers: list[Sleeper] = []  # those of the threads waiting (a wake takes it off)
        self._box: dict[Slot, Item] = {}  # arrival order: a re-put moves to the end
        self._tombs = Tombstones(tombstone_ttl_s, max_tombstones)
        self._consumed: list[tuple[str, int]] = []  # for the protocol: taken by gets or replaced by re-puts
        self._dropped: list[tuple[str, int, int]] = []  # for the protocol: dropped unconsumed, with a DROPPED_* code
        self._taken_bytes = 0  # taken since the last handover (the protocol's count)
        self._heavy_bytes = 0  # taken since on_left(True) was last called (ACK_BYTES)
        self._told = False  # on_left was called since the last handover (or needed not be: flush_pending)
        #: Set by the driver while an acknowledgement flush is due (it hands over first): what leaves the
        #: mailbox meanwhile is handed over then, so the getter does not wake the driver to say so.
        self.flush_pending = False
        self._on_left = on_left
        self._elsewhere: dict[tuple[str, int], bool] = {}  # puts taken through a previous binder (in order)
        self.generation = 0  # bumped whenever items arrive (wait_for_change)
        self.closed = False
        self._opening = 0  # shared-memory items taken and not yet mapped: a seal waits for them (close)
        self.waiting = 0  # threads waiting (see _wait)
        self.on_arrivals: Callable[[list[Slot]], None] | None = None
        #: A shared stage endpoint's binder: called by the driver with what arrived, to lend it to local clients.
        self.on_lendable: Callable[[list[Slot]], None] | None = None
        self.gets = 0
        self.bytes_taken = 0
        self.drops = {"unclaimed": 0, "late": 0, "cleanup": 0}

    # -- the driver --------------------------------------------------------------------
    def store(self, arrivals: list[tuple[Slot, Item]], now: float) -> None:
        """Put one drain's arrivals in: one lock, one notify (the items they replace or that are buried go).

        The driver has the protocol schedule the acknowledgement of their arrival
        (``ReceiveProtocol.schedule``) once its drain is done.
        """
        gone: list[Item] = []
        sleepers: list[Sleeper] = []
        with self.lock:
            if self._tombs.entries:
                arrivals = self._drop_buried(arrivals, gone, now)
            if self._elsewhere:
                arrivals = self._drop_taken_elsewhere(arrivals)
            box = self._box
            for slot, item in arrivals:
                old = box.pop(slot, None)
                box[slot] = item
                if old is not None:  # a re-put replaces; the replaced one counts as consumed
                    self._consumed.append((old.sid, old.seq))
                    gone.append(old)
            self.generation += 1
            if self._sleepers:  # woken once the lock is let go: a get woken takes its item without waiting for it
                sleepers, self._sleepers = self._sleepers, []
        if arrivals:  # first: a stage client that asked for a key is lent it before a get woken here looks
            for hook in (self.on_arrivals, self.on_lendable):
                if hook is not None:
                    hook([slot for slot, _ in arrivals])
        if sleepers:
            for sleeper in sleepers:
                sleeper.wake()
            # The get woken runs now, and the rest of this turn after it: off the round trip of a lone message.
            os.sched_yield()
        if gone:
            self._discard(gone)

    def _drop_buried(self, arrivals: list[tuple[Slot, Item]], gone: list[Item], now: float) -> list[tuple[Slot, Item]]:
        kept = []
        covers = self._tombs.covers
        for slot, item in arrivals:
            if covers(slot[2], now):  # a drop renews the tombstone: a stream still arriving keeps it
                self._dropped.append((item.sid, item.seq, DROPPED_CANCELLED))
                self.drops["late"] += 1
                gone.append(item)
            else:
                kept.append((slot, item))
        return kept

    def _drop_taken_elsewhere(self, arrivals: list[tuple[Slot, Item]]) -> list[tuple[Slot, Item]]:
        kept = []
        for slot, item in arrivals:
            if self._elsewhere.pop((item.sid, item.seq), None) is None:
                kept.append((slot, item))
            else:  # a resend of a put a get took through the previous binder: consumed, not delivered again
                self._consumed.append((item.sid, item.seq))  # (its slot, if any, was read there: nothing to free)
                self._left()
        return kept

    def consumed_elsewhere(self, pairs: list[tuple[str, int]]) -> None:
        """Puts ``(sid, seq)`` a get took through a previous binder of this endpoint: counted consumed here.

        Their senders may not have heard so before that binder died, and resend them: each is
        counted consumed (its sender hears so) instead of delivered a second time, whether it is
        here already or arrives later. At most ``_ELSEWHERE_MAX`` are remembered (the oldest go).
        """
        taken = 0
        with self.lock:
            for pair in pairs:
                self._elsewhere[pair] = True  # (a value pop can tell from its default)
            while len(self._elsewhere) > _ELSEWHERE_MAX:
                del self._elsewhere[next(iter(self._elsewhere))]
            for slot, item in list(self._box.items()):
                if self._elsewhere.pop((item.sid, item.seq), None) is not None:
                    del self._box[slot]
                    self._consumed.append((item.sid, item.seq))
                    taken += 1
            if taken:
                self._left()

    def _left(self) -> None:
        """Something left the mailbox (holds the lock): tell the driver once until its next handover."""
        if not self._told:
            self._told = True
            if not self.flush_pending:
                self._on_left(False)

    def handover(self, *, still_pending: bool = False) -> tuple[list[tuple[str, int]], list[tuple[str, int, int]], int]:
        """What left since last call: ``(consumed, dropped, bytes taken)``; ``flush_pending`` = ``still_pending``."""
        with self.lock:
            consumed, self._consumed = self._consumed, []
            dropped, self._dropped = self._dropped, []
            nbytes, self._taken_bytes = self._taken_bytes, 0
            self._told, self.flush_pending = False, still_pending  # (still: the driver times a flush again at once)
        return consumed, dropped, nbytes

    # -- any thread -----------------------------------------------------------------------
    def pop(self, slot: Slot) -> Item | None:
        """Take ``slot``'s item (a get asks for it: its tombstones lift, but for the firm ones).

        A shared-memory item's consumption is recorded only by :meth:`result`.
        """
        with self.lock:
            return self.pop_locked(slot)

    def pop_locked(self, slot: Slot) -> Item | None:
        """:meth:`pop` for a caller holding :attr:`lock`; None once the mailbox is sealed (:meth:`close`)."""
        if self.closed:
            return None
        if self._tombs.entries:
            self._tombs.lift(slot[2])
        item = self._box.pop(slot, None)
        if item is not None:
            if item.loc is None:
                self._note_taken(item)
            else:
                self._opening += 1  # its consumption is noted once mapped (result)
        return item

    # -- a shared stage endpoint's binder (its driver) ---------------------------------------
    def lend(self, slot: Slot) -> Item | None:
        """Take ``slot``'s item out for a local client, not counted consumed (:meth:`settle`, :meth:`restore`)."""
        with self.lock:
            if self.closed:
                return None
            if self._tombs.entries:
                self._tombs.lift(slot[2])
            return self._box.pop(slot, None)

    def settle(self, item: Item) -> None:
        """A lent item was taken by the client's get: count it consumed, as a take here does."""
        with self.lock:
            self._note_taken(item)

    def settle_dropped(self, item: Item, code: int) -> None:
        """A lent item was dropped at the client unconsumed (``code``, a ``DROPPED_*`` code): its sender hears so."""
        with self.lock:
            self._dropped.append((item.sid, item.seq, code))
            self._left()

    def restore(self, slot: Slot, item: Item) -> None:
        """A lent item comes back (given back, or its client gone): a get can take it again."""
        with self.lock:
            if self.closed:  # not consumed: its sender resends it to the next binder
                return
            if slot in self._box:  # a newer put replaced it, as in store
                self._consumed.append((item.sid, item.seq))
                self._left()
                return
            self._box[slot] = item
            self.generation += 1
            if self.waiting:
                self._wake_all()
        for hook in (self.on_arrivals, self.on_lendable):
            if hook is not None:
                hook([slot])

    def withdraw(self) -> int:
        """Empty the mailbox counting nothing consumed or dropped, freeing no slot; seal it; how many went.

        A local client whose binder died: the items it held on lease were never counted consumed, so
        their senders resend them to the next binder (a slot freed here would be lost to that resend).
        """
        with self.lock:
            count = len(self._box)
            self._box.clear()
            self.closed = True
            self._wake_all()
        return count

    def _note_taken(self, item: Item) -> None:
        """Record a consumption (holds the lock)."""
        self._consumed.append((item.sid, item.seq))
        self.gets += 1
        self.bytes_taken += item.nbytes
        self._taken_bytes += item.nbytes
        self._heavy_bytes += item.nbytes
        if self._heavy_bytes >= ACK_BYTES:  # (the protocol counts the same bytes and decides: see ReceiveProtocol)
            self._heavy_bytes = 0
            self._told = True
            self._on_left(True)
        else:
            self._left()

    def take(self, slot: Slot, deadline: float, stop: Callable[[], bool] | None = None) -> Item | None:
        """:meth:`pop` ``slot``'s item, waiting for it until ``deadline`` (``time.monotonic()``).

        None at the deadline, once sealed, or once ``stop()`` holds (checked at each wake-up:
        whoever makes it true calls :meth:`wake_waiters`).
        """
        with self.lock:
            while True:
                if stop is not None and stop():
                    return None
                item = self.pop_locked(slot)
                if item is not None or self.closed:
                    return item
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._wait(remaining)

    def _wait(self, timeout: float) -> None:
        """Wait at most ``timeout`` for an arrival, a seal or a wake (holds :attr:`lock`, released meanwhile)."""
        sleeper = thread_sleeper()  # in use till released (a get in a signal handler meanwhile takes another)
        self._sleepers.append(sleeper)
        self.waiting += 1
        self.lock.release()
        try:
            sleeper.wait(timeout)
        finally:
            sleeper.in_use = False
            self.lock.acquire()
            self.waiting -= 1
            if sleeper in self._sleepers:  # (a timeout, or interrupted, with no wake meanwhile)
                self._sleepers.remove(sleeper)

    def _wake_all(self) -> None:
        """Wake every waiting thread (holds :attr:`lock`)."""
        sleepers = self._sleepers
        if sleepers:
            self._sleepers = []
            for sleeper in sleepers:
                sleeper.wake()

    def wake_waiters(self) -> None:
        """Wake the waiting threads: each checks its ``stop`` again."""
        with self.lock:
            self._wake_all()

    def buries(self, key: str) -> bool:
        """True while a tombstone covers ``key``: an arrival of it now would be dropped."""
        with self.lock:
            return bool(self._tombs.entries) and self._tombs.covers(key, time.monotonic())

    def forget(self, match: Callable[[str], bool], *, key: str | None, prefix: str | None, firm: bool = False) -> int:
        """Drop the items whose key matches, burying ``key`` and/or ``prefix`` (``firm``: no get lifts it); how many."""
        with self.lock:
            self._tombs.bury(time.monotonic(), key=key, prefix=prefix, firm=firm)
            items = self._cancel_where(match)
        self._discard(items)
        return len(items)

    def bury_all(self, tombs: Tombstones) -> int:
        """Take over ``tombs`` (cleanups made before the bind) and drop the items they cover; how many."""
        with self.lock:
            now = time.monotonic()
            self._tombs.absorb(tombs, now)
            items = self._cancel_where(functools.partial(self._tombs.covers, now=now))
        self._discard(items)
        return len(items)

    def _cancel_where(self, match: Callable[[str], bool]) -> list[Item]:
        """Take out the items whose key matches, handed over as cancelled (under the lock); the caller discards them."""
        items = [self._box.pop(slot) for slot in [s for s in self._box if match(s[2])]]
        self._dropped.extend((item.sid, item.seq, DROPPED_CANCELLED) for item in items)
        self.drops["cleanup"] += len(items)
        if items:
            self._left()
        return items

    def expire(self, now: float, unclaimed_ttl_s: float) -> int:
        """Drop the items no get took within ``unclaimed_ttl_s``, and the lapsed tombstones; how many items."""
        cutoff = now - unclaimed_ttl_s
        with self.lock:
            expired = []
            for slot, item in self._box.items():  # arrival order: the expired ones are a prefix
                if item.arrived > cutoff:
                    break
                expired.append((slot, item))
            for slot, item in expired:
                del self._box[slot]
                self._dropped.append((item.sid, item.seq, DROPPED_UNCLAIMED))
            self.drops["unclaimed"] += len(expired)
            if expired:
                self._left()
            self._tombs.lapse(now)
        self._discard([item for _, item in expired])
        return len(expired)

    def result(self, item: Item) -> tuple[Any, int]:
        """What a get returns for ``item`` taken by :meth:`pop`: a slot handle's payload is opened here.

        Its consumption counts only once the slot is mapped (or found gone): a sender that hears
        "consumed" may unlink the slot, and one unlinked before the mapping would be lost while its
        sender counts it delivered. A seal meanwhile waits for this open (:meth:`close`), so the
        consumption is still in the last acknowledgements.

        Raises:
            ShmError: the payload expired or its sender withdrew it (the item is gone).
            DecodeError: the payload is not a valid encoding.
        """
        if item.loc is None:
            return item.obj, item.nbytes
        assert self._shm is not None
        try:
            views = self._shm.open(item.loc)
        finally:
            with self.lock:
                self._note_taken(item)
                self._opening -= 1
                if self.closed and not self._opening:
                    self._wake_all()
        if views is None:
            if self._counters is not None:
                self._counters.add("shm_stale")
            raise ShmError("its shared-memory payload expired or its sender withdrew it")
        return self._decode(views), item.nbytes

    def _discard(self, items: list[Item]) -> None:
        """Release the slots of items dropped unopened."""
        if self._shm is not None:
            for item in items:
                if item.loc is not None:
                    self._shm.discard(item.loc)

    def wait_for_change(self, generation: int, timeout: float, stop: Callable[[], bool] | None = None) -> int:
        """Wait until the generation differs from ``generation``, at most ``timeout``; the generation then.

        It also ends once sealed, or once ``stop()`` holds (as :meth:`take`).
        """
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.generation == generation and not self.closed and not (stop is not None and stop()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wait(remaining)
            return self.generation

    def close(self, timeout: float = 1.0) -> None:
        """Seal: no take succeeds from now on, every waiting thread wakes (see the module docstring).

        Returns once the shared-memory items taken before the seal are mapped and their consumptions
        noted (they are mapped in microseconds; at most ``timeout``), so the last acknowledgements,
        sent after this, name them. On an event loop's thread it does not wait (the loop would stall).
        Items still being mapped when it returns are logged (a WARNING): their consumptions may miss
        the last acknowledgements, and their senders may put them again.
        """
        if _on_a_loop():
            timeout = 0.0
        deadline = time.monotonic() + timeout
        with self.lock:
            self.closed = True
            self._wake_all()
            while self._opening:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wait(remaining)
            opening = self._opening
        if opening:
            log.warning(
                "sealed with %d shared-memory item(s) still being mapped after %.1f s: their consumptions may "
                "miss the last acknowledgements",
                opening,
                timeout,
            )

    def stats(self) -> dict[str, Any]:
        """Gets, bytes taken, items waiting, the oldest one's age, tombstones and what was dropped."""
        now = time.monotonic()
        with self.lock:
            oldest = next(iter(self._box.values()), None)
            return {
                "gets": self.gets,
                "bytes_received": self.bytes_taken,
                "mailbox": len(self._box),
                "mailbox_oldest_s": 0.0 if oldest is None else max(0.0, now - oldest.arrived),
                "tombstones": len(self._tombs),
                "tombstones_evicted": self._tombs.evicted,
                **{f"dropped_{k}": v for k, v in self.drops.items()},
            }


def _on_a_loop() -> bool:
    """True on the thread of a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
