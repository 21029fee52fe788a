"""An awaited flush and a foreign thread's stop of a loop driver end on their events, not on a clock.

An awaited push-mode flush looks once, then once at each wake-up: the receiver's confirmation,
or the connector's close. A stop handed to a running loop returns as the loop runs it; only a
loop that stops running first (asyncio signals nothing then) is noticed by a look.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.aio import AsyncConnector
from zmq_omni.aio._driver import LoopDriver
from zmq_omni.connectors.zmq import ZmqConnector


def _sender(endpoint: str) -> AsyncConnector:
    extra = {"role": "sender", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}, "delivery_timeout_s": 60}
    return AsyncConnector.create({"name": "ZmqConnector", "extra": extra})


def _count_looks(conn: AsyncConnector) -> list[int]:
    """Count the wrapped connector's ``flush`` calls (each look of an awaited flush is one)."""
    looks = [0]
    flush = conn.connector.flush

    def counted(timeout_s: float) -> bool:
        looks[0] += 1
        return flush(timeout_s)

    conn.connector.flush = counted  # type: ignore[method-assign]
    return looks


@pytest.mark.timeout(60)
def test_an_awaited_flush_ends_on_the_receivers_confirmation_and_looks_only_when_woken(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/flush.sock"

    async def main() -> None:
        tx = _sender(endpoint)
        looks = _count_looks(tx)
        ok, _, _ = await tx.put("0", "1", "k", {"a": 1})
        assert ok
        flushing = asyncio.create_task(tx.flush(3600))
        await asyncio.sleep(0.3)  # nobody confirms meanwhile: nothing wakes the flush
        assert not flushing.done()
        assert looks[0] == 1
        rx = ZmqConnector({"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}})
        try:
            assert await flushing  # the receiver's acknowledgement ends it
            got = rx.get_with_deadline("0", "1", "k", deadline=asyncio.get_running_loop().time() + 10)
            assert got is not None and got[0] == {"a": 1}
        finally:
            await tx.aclose()
            rx.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_awaited_flush_ends_when_its_connector_closes(short_tmp: Path) -> None:
    async def main() -> None:
        tx = _sender(f"ipc://{short_tmp}/nobody.sock")  # no receiver: nothing confirms the put
        ok, _, _ = await tx.put("0", "1", "k", {"a": 1})
        assert ok
        flushing = asyncio.create_task(tx.flush(3600))
        await asyncio.sleep(0.05)
        tx.connector.close_with_linger(0.0)  # on the loop's thread: its close wakes the flush
        assert await flushing is False
        assert [f.key for f in tx.drain_failures()] == ["k"]
        await tx.aclose()

    asyncio.run(main())


def _loop_in_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _attached(loop: asyncio.AbstractEventLoop, stopped: list[int]) -> LoopDriver:
    driver = LoopDriver("foreign-stop")
    driver.on_stop(lambda: stopped.append(threading.get_ident()))

    async def attach() -> None:
        driver.attach(asyncio.get_running_loop())
        driver.start()

    asyncio.run_coroutine_threadsafe(attach(), loop).result(10)
    return driver


@pytest.mark.timeout(60)
def test_a_foreign_stop_returns_as_the_running_loop_runs_it() -> None:
    loop, thread = _loop_in_thread()
    stopped: list[int] = []
    try:
        driver = _attached(loop, stopped)
        assert driver.stop(timeout=3600)
        assert stopped == [thread.ident]  # the loop ran the stop it was handed
        assert loop.is_running()  # ...and runs on: the stop ended on that, not on a look at the loop's end
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.timeout(60)
def test_a_foreign_stop_of_a_loop_that_stops_running_first_stops_there() -> None:
    loop, thread = _loop_in_thread()
    stopped: list[int] = []
    try:
        driver = _attached(loop, stopped)
        handed = threading.Event()
        hand = loop.call_soon_threadsafe

        def call_soon_threadsafe(*args: Any, **kwargs: Any) -> Any:
            got = hand(*args, **kwargs)
            handed.set()
            return got

        busy = threading.Event()

        def busy_then_end() -> None:
            busy.set()
            handed.wait(10)  # the stop is queued behind this callback...
            loop.stop()  # ...and the loop ends before it runs it

        loop.call_soon_threadsafe(busy_then_end)
        assert busy.wait(10)
        loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]
        assert driver.stop(timeout=3600)
        thread.join(10)
        assert not loop.is_running()
        assert stopped and stopped != [thread.ident]  # stopped by the foreign thread, once the loop had ended
    finally:
        thread.join(10)
        loop.close()
