"""The deadlines of many waiting calls on one event-loop timer.

A timer per waiting ``get`` costs a ``TimerHandle`` made and cancelled on
every call, most of them long before they would fire (a get usually ends with
its item). Here a waiting call adds its deadline to a heap and the loop holds
one timer, for the earliest; an ended call only marks its entry dead (which
drops its reference at once), and dead entries are swept when they outnumber
the live ones.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Deadlines"]

T = TypeVar("T")

# A deadline within this of the loop's clock is due: timers may fire a hair early (uvloop counts in ms).
_SLACK_S = 0.001


class Deadlines(Generic[T]):
    """Call ``on_due(item)`` once an added item's deadline passed, unless discarded first (loop thread only)."""

    def __init__(self, on_due: Callable[[T], None]) -> None:
        self._on_due = on_due
        self._heap: list[list[Any]] = []  # [when, seq, item or None once discarded]
        self._seq = 0
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, loop: asyncio.AbstractEventLoop, when: float, item: T) -> list[Any]:
        """Watch ``item``'s deadline ``when`` (``loop.time()`` clock); the returned entry is for :meth:`discard`."""
        self._seq += 1
        entry = [when, self._seq, item]
        heapq.heappush(self._heap, entry)
        self._live += 1
        if when < self._timer_at:
            self._arm(loop, when)
        return entry

    def discard(self, entry: list[Any]) -> None:
        """Forget an entry whose call ended (idempotent)."""
        if entry[2] is None:
            return
        entry[2] = None
        self._live -= 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)

    def close(self) -> None:
        """Cancel the timer and forget every entry."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf
        for entry in self._heap:
            entry[2] = None
        self._heap.clear()
        self._live = 0

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop = loop
        self._timer = loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        loop = self._loop
        assert loop is not None
        heap = self._heap
        due = loop.time() + _SLACK_S
        while heap and (heap[0][2] is None or heap[0][0] <= due):
            entry = heapq.heappop(heap)
            item = entry[2]
            if item is not None:
                entry[2] = None
                self._live -= 1
                self._on_due(item)
        if heap and self._timer is None:
            self._arm(loop, heap[0][0])
