"""Awaited flushes of an ``AsyncConnector``: suspended until the wrapped connector's puts are all confirmed.

A flush looks at the connector's non-blocking ``flush(0)`` once, then once at each
wake-up: what makes it true signals the connector's watch (push mode: each
confirmation of an arrival or a consumption is a room notice; pull mode: each fetch
from the store), and so does the connector's close. While any flush waits, the watch
reports room (:meth:`~zmq_omni.connectors.base.ArrivalWatch.want_room`). Only a
pull-mode flush also looks on the clock, at :data:`PULL_FLUSH_LOOK_S`.

Who owns what: the event loop's thread alone uses a :class:`Flushes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

from ..connectors import OmniConnectorBase
from ..connectors.base import ArrivalWatch

__all__ = ["PULL_FLUSH_LOOK_S", "Flushes"]

#: Pull mode only: an awaited flush looks again this often while its payloads' replies are leaving. The clock
#: is the event there: ZeroMQ signals nothing when a sent reply's buffers are released, nor does a fetcher when
#: it opened a shared-memory reply.
PULL_FLUSH_LOOK_S = 0.01


class Flushes:
    """The awaited flushes of one wrapper: how many wait, and the event each wake-up sets for them.

    Args:
        connector: the wrapped connector.
        pull: its gets fetch (pull mode): its flush also looks on the clock.
        puts_wait: whether puts wait for room (the watch keeps reporting room for them).
    """

    def __init__(self, connector: OmniConnectorBase, *, pull: bool, puts_wait: Callable[[], bool]) -> None:
        self._connector = connector
        self._look_s = PULL_FLUSH_LOOK_S if pull else math.inf
        self._puts_wait = puts_wait
        self._waiting = 0
        self._woken: asyncio.Event | None = None  # set by each wake-up while a flush waits

    def __bool__(self) -> bool:
        """True while a flush waits (it wants the watch's room notices)."""
        return self._waiting > 0

    def wake(self) -> None:
        """Something a flush waits for may have happened (room freed, or the connector closed): look again."""
        if self._woken is not None:
            self._woken.set()

    async def wait(self, watch: ArrivalWatch | None, timeout_s: float) -> bool:
        """Wait until nothing is left unconfirmed (True), or ``timeout_s`` passed or the connector closed (False)."""
        connector, loop = self._connector, asyncio.get_running_loop()
        self._waiting += 1
        if watch is not None:  # before the first look: a notice after it is heard
            watch.want_room(True)
        woken = self._woken = self._woken or asyncio.Event()
        deadline = loop.time() + timeout_s
        try:
            while not connector.flush(0):
                remaining = deadline - loop.time()
                if remaining <= 0 or connector.closed:
                    return False
                woken.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(remaining, self._look_s))
            return True
        finally:
            self._waiting -= 1
            if not self._waiting and not self._puts_wait() and watch is not None:
                watch.want_room(False)
