"""A driver's one-shot timers can be cancelled: a cancelled one never runs and wakes nothing (real loops)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from zmq_omni.aio._driver import LoopDriver
from zmq_omni.transport import Driver, IoLoop


def _set_timers(driver: Driver, ran: list[str], done: threading.Event) -> None:
    """On the driver's thread: five timers cancelled before they are due, one cancelled after it ran, one kept."""
    cancelled = [driver.call_later(0.01 * (i + 1), lambda i=i: ran.append(f"cancelled {i}")) for i in range(5)]
    for timer in cancelled:
        timer.cancel()

    def last() -> None:
        ran.append("kept")
        first.cancel()  # it ran already: nothing happens
        done.set()

    first = driver.call_later(0.0, lambda: ran.append("first"))
    driver.call_later(0.2, last)


@pytest.mark.timeout(30)
def test_io_loop_runs_no_cancelled_timer_and_does_not_wake_for_one() -> None:
    loop = IoLoop("test-timers")
    polls = 0
    poll = loop._poller.poll

    def counting(timeout: Any = None) -> Any:
        nonlocal polls
        polls += 1
        return poll(timeout)

    loop._poller.poll = counting  # type: ignore[method-assign]
    ran: list[str] = []
    done = threading.Event()
    started = threading.Event()

    def setup() -> None:
        nonlocal polls
        polls = 0
        _set_timers(loop, ran, done)
        started.set()

    loop.start()
    try:
        loop.call_soon(setup)
        assert started.wait(5)
        assert done.wait(5)
        assert ran == ["first", "kept"]
        # One poll for "first" (due at once), one waiting for "kept": none ends at a cancelled timer's due time.
        assert polls <= 3, f"{polls} polls"
    finally:
        loop.stop()


@pytest.mark.timeout(30)
def test_io_loop_cancels_before_start() -> None:
    loop = IoLoop("test-timers-early")
    ran: list[str] = []
    done = threading.Event()
    loop.call_later(0.0, lambda: ran.append("cancelled")).cancel()
    loop.call_later(0.05, done.set)
    loop.start()
    try:
        assert done.wait(5)
        assert ran == []
    finally:
        loop.stop()


@pytest.mark.timeout(30)
def test_loop_driver_runs_no_cancelled_timer() -> None:
    async def run() -> list[str]:
        driver = LoopDriver("test-timers-aio")
        ran: list[str] = []
        done = threading.Event()
        early: Callable[[], None] = lambda: ran.append("cancelled before attach")  # noqa: E731
        driver.call_later(0.0, early).cancel()  # before the driver is attached: never scheduled
        driver.attach(asyncio.get_running_loop())
        driver.start()
        _set_timers(driver, ran, done)
        while not done.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not driver._timers  # nothing cancelled is kept to move to another loop
        driver.stop()
        return ran

    assert asyncio.run(run()) == ["first", "kept"]
