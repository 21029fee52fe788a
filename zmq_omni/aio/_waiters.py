"""The bookkeeping of an ``AsyncConnector``'s waiting calls: no sockets, no I/O.

:class:`GetWaiters` holds the waiting gets by address, :class:`PutLine` the
puts waiting for window room (first come, first served), and :class:`HandedBack`
the items taken for gets that were gone by then (a cancelled get, or a pull-mode
reply after its get timed out), which the next get of the address takes.

Who owns what: each object belongs to one ``AsyncConnector`` and is touched on
its event loop's thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..connectors.base import Slot, TransferFailure
from ..errors import ClosedResourceError

log = logging.getLogger("zmq_omni.aio")

PutResult = tuple[bool, int, "dict[str, Any] | None"]
Metadata = dict[str, Any] | None

_HANDED_BACK_MAX = 65_536  # items handed back and not taken again; beyond it the oldest are dropped (logged)


@dataclass(eq=False, slots=True)
class GetWaiter:
    """A waiting get: its future, its address, and the metadata its caller passed."""

    fut: asyncio.Future[tuple[Any, int] | None]
    slot: Slot
    metadata: dict[str, Any] | None


@dataclass(eq=False, slots=True)
class PutWaiter:
    """A put waiting for window room: its future and the arguments of its ``try_put``."""

    fut: asyncio.Future[PutResult]
    args: tuple[str, str, str, Any]


class GetWaiters:
    """The waiting gets, by address, each address's in the order they came.

    Args:
        look: the backend's non-blocking get of an address, given the waiter's metadata.
    """

    def __init__(self, look: Callable[[Slot, Metadata], tuple[Any, int] | None]) -> None:
        self._by_slot: dict[Slot, deque[GetWaiter]] = {}
        self._look = look

    def __bool__(self) -> bool:
        return bool(self._by_slot)

    def count(self) -> int:
        """How many gets wait (resolved ones not yet gone included)."""
        return sum(len(w) for w in self._by_slot.values())

    def add(self, waiter: GetWaiter) -> None:
        """Queue ``waiter`` behind the other waiters of its address."""
        waiters = self._by_slot.get(waiter.slot)
        if waiters is None:
            waiters = self._by_slot[waiter.slot] = deque()
        waiters.append(waiter)

    def waits(self, slot: Slot) -> bool:
        """True while gets of ``slot`` are queued (a resolved waiter has left its queue)."""
        return slot in self._by_slot

    def forget(self, waiter: GetWaiter) -> None:
        """Take ``waiter`` out of its queue (it ended without an item)."""
        waiters = self._by_slot.get(waiter.slot)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            del self._by_slot[waiter.slot]

    def deliver(self, slot: Slot, got: tuple[Any, int]) -> bool:
        """Give ``got`` to the first live waiter of ``slot`` (it leaves the queue); False when there is none."""
        waiters = self._by_slot.get(slot)
        if waiters is None:
            return False
        while waiters:
            waiter = waiters.popleft()
            if not waiter.fut.done():
                waiter.fut.set_result(got)
                if not waiters:
                    del self._by_slot[slot]
                return True
        del self._by_slot[slot]
        return False

    def resolve(self, arrived: list[Slot] | None) -> None:
        """Resolve the waiters of the addresses that ``arrived`` (None: of every address) with what the look finds."""
        gets = self._by_slot
        if not gets:
            return
        look = self._look
        if arrived is None:
            slots: list[Slot] = list(gets)
        elif len(arrived) == 1:  # a lone message (what a round trip waits for)
            slots = arrived
        else:
            slots = [slot for slot in dict.fromkeys(arrived) if slot in gets]
        for slot in slots:
            waiters = gets.get(slot)
            if waiters is None:
                continue
            while waiters:
                waiter = waiters[0]
                if waiter.fut.done():
                    waiters.popleft()
                    continue
                got = look(slot, waiter.metadata)
                if got is None:
                    break
                waiters.popleft()
                waiter.fut.set_result(got)
            if not waiters:
                gets.pop(slot, None)

    def wake_all(self) -> None:
        """Closed: every waiting get gets None."""
        for waiters in list(self._by_slot.values()):
            for waiter in waiters:
                if not waiter.fut.done():
                    waiter.fut.set_result(None)
        self._by_slot.clear()


class PutLine:
    """The puts waiting for window room, admitted in order through ``try_put`` (None: puts never wait)."""

    def __init__(self, try_put: Callable[..., PutResult | None] | None) -> None:
        self._try_put = try_put
        self._waiters: deque[PutWaiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def add(self, waiter: PutWaiter) -> None:
        """Queue ``waiter`` behind the puts already waiting."""
        self._waiters.append(waiter)

    def remove(self, waiter: PutWaiter) -> None:
        """Take ``waiter`` out of the line (it ended); a no-op when it already left."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def serve(self) -> None:
        """Admit waiting puts in order while the window takes them."""
        try_put = self._try_put
        assert try_put is not None  # (a backend without try_put never waits for room)
        puts = self._waiters
        while puts:
            waiter = puts[0]
            if waiter.fut.done():
                puts.popleft()
                continue
            try:
                got = try_put(*waiter.args)
            except Exception as exc:  # a programming error of that put (its payload): its caller gets it
                puts.popleft()
                waiter.fut.set_exception(exc)
                continue
            if got is None:
                return
            puts.popleft()
            waiter.fut.set_result(got)

    def timed_out(self, waiter: PutWaiter) -> None:
        """``waiter``'s wait for room ended: one last try that, without room, fails the put."""
        if waiter.fut.done():
            return
        self.remove(waiter)
        assert self._try_put is not None
        # One last try that, without room, fails the put as put_timeout_s does in the blocking put.
        try:
            got = self._try_put(*waiter.args, True)
        except Exception as exc:
            waiter.fut.set_exception(exc)
            return
        waiter.fut.set_result(got if got is not None else (False, 0, None))

    def fail_all(self, put: Callable[..., PutResult] | None) -> None:
        """Closed: every waiting put fails (``put``: the closed connector's, which counts and keeps the failure)."""
        puts, self._waiters = self._waiters, deque()
        for waiter in puts:
            if waiter.fut.done():
                continue
            try:
                waiter.fut.set_result(put(*waiter.args) if put is not None else (False, 0, None))
            except Exception as exc:
                waiter.fut.set_exception(exc)


class HandedBack:
    """Items taken for gets that were gone by then, by address; the oldest go beyond ``_HANDED_BACK_MAX``."""

    def __init__(self) -> None:
        self._items: dict[Slot, deque[tuple[Any, int]]] = {}
        self.count = 0  # items kept, all addresses

    def __bool__(self) -> bool:
        return bool(self._items)

    def take(self, slot: Slot) -> tuple[Any, int] | None:
        """The oldest item kept for ``slot``, taken; None when there is none."""
        kept = self._items.get(slot)
        if not kept:
            return None
        got = kept.popleft()
        self.count -= 1
        if not kept:
            del self._items[slot]
        return got

    def keep(self, slot: Slot, got: tuple[Any, int]) -> None:
        """Keep ``got`` for the next get of ``slot`` (dropping the oldest item kept when at the limit)."""
        if self.count >= _HANDED_BACK_MAX:
            oldest = next(iter(self._items))
            self.take(oldest)
            log.warning("dropped an item of %s handed back by a cancelled get: %d are kept", oldest, _HANDED_BACK_MAX)
        self._items.setdefault(slot, deque()).append(got)
        self.count += 1

    def abandon(self) -> list[TransferFailure]:
        """The wrapper closes: every item kept, as a failure each (they were acknowledged consumed); logged."""
        lost = [
            TransferFailure(
                slot[2],
                slot[0],
                slot[1],
                "get",
                "taken for a get that was cancelled, and no get took it before the AsyncConnector closed",
                ClosedResourceError("AsyncConnector closed"),
                time.time(),
            )
            for slot, kept in self._items.items()
            for _ in kept
        ]
        self._items.clear()
        self.count = 0
        if lost:
            shown = ", ".join(repr(failure.key) for failure in lost[:10])
            log.warning("closed with %d item(s) taken for cancelled gets and never taken again: %s", len(lost), shown)
        return lost
