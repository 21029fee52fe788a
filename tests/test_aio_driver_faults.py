"""The event-loop driver keeps the loop usable when a handler fails: it backs off instead of spinning."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from zmq_omni.aio._driver import LoopDriver


@pytest.mark.timeout(30)
def test_a_failing_handler_on_a_readable_descriptor_is_retried_with_a_pause(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> tuple[int, int]:
        driver = LoopDriver("faulty")
        read_end, write_end = os.pipe()
        os.write(write_end, b"x")  # readable until read, which the handler never does
        calls = 0

        def failing() -> None:
            nonlocal calls
            calls += 1
            raise ValueError("a bug in a handler")

        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        driver.attach(asyncio.get_running_loop())
        driver.start()
        driver.add_reader(read_end, failing)
        await asyncio.sleep(0.5)
        driver.remove_reader(read_end)
        driver.stop()
        tick_task.cancel()
        os.close(read_end)
        os.close(write_end)
        return calls, ticks

    with caplog.at_level(logging.ERROR, logger="zmq_omni.aio"):
        calls, ticks = asyncio.run(run())
    assert 1 <= calls <= 30, calls  # served again after a pause, not thousands of times
    assert ticks >= 20  # the loop kept running its other tasks
    assert "a bug in a handler" in caplog.text


def test_call_soon_after_stop_does_nothing() -> None:
    async def run() -> list[str]:
        driver = LoopDriver("stopped")
        driver.attach(asyncio.get_running_loop())
        driver.start()
        ran: list[str] = []
        driver.stop()
        driver.call_soon(lambda: ran.append("late"))
        await asyncio.sleep(0.05)
        return ran

    assert asyncio.run(run()) == []
