"""The stall ticker the loop tests rely on: it must see a stall of ours, blocking or busy, on a busy machine too."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from .contention import Ticker, busy_cores


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy-cores"])
async def test_the_ticker_counts_a_blocked_or_busy_loop_thread_as_a_stall(busy: bool) -> None:
    with busy_cores() if busy else contextlib.nullcontext():
        for stall in (lambda: time.sleep(0.25), lambda: _spin(0.25)):
            with Ticker() as ticker:
                await asyncio.sleep(0.02)
                stall()  # the loop's own thread is held: nothing else on the loop runs
                await asyncio.sleep(0.02)
            assert ticker.worst >= 0.2, (ticker.worst, ticker.worst_wall)
