"""ResumingFuture: a get's task resumes inside the wake-up that resolved it, and nothing else changes (issue 15).

What the pump relies on: a held future's task takes its next step before
``resume`` returns (not on the loop's next turn); inside a running task, or when
a resumed step raises out, the wake-ups are queued as ``set_result`` would
queue them, never dropped; everything else is a plain ``asyncio.Future``.
Both loops, no sockets.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmq_omni.aio._resume import ResumingFuture, queue, resume

LOOPS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


async def _waiting(n: int) -> tuple[list[ResumingFuture[int]], list[asyncio.Task[int]], list[int]]:
    """``n`` tasks, each awaiting its own ResumingFuture and noting its result in ``resumed`` once it runs."""
    loop = asyncio.get_running_loop()
    futures: list[ResumingFuture[int]] = [ResumingFuture(loop=loop) for _ in range(n)]
    resumed: list[int] = []

    async def wait(fut: ResumingFuture[int]) -> int:
        value = await fut
        resumed.append(value)
        return value

    tasks = [asyncio.create_task(wait(fut)) for fut in futures]
    await asyncio.sleep(0)  # each task is now suspended on its future
    return futures, tasks, resumed


@pytest.mark.anyio
async def test_held_futures_resume_their_tasks_in_order_before_resume_returns() -> None:
    futures, tasks, resumed = await _waiting(3)
    loop = asyncio.get_running_loop()
    seen_at_return: list[list[int]] = []

    def wake_up() -> None:  # as the pump: a loop callback, no task running
        for i, fut in enumerate(futures):
            fut.hold(i)
            assert fut.done() and fut.result() == i
        assert resumed == []  # held: nothing ran yet
        resume(futures, loop)
        seen_at_return.append(list(resumed))

    loop.call_soon(wake_up)
    assert await asyncio.gather(*tasks) == [0, 1, 2]
    assert seen_at_return == [[0, 1, 2]]


@pytest.mark.anyio
async def test_set_result_still_waits_for_the_loops_next_turn() -> None:
    futures, tasks, resumed = await _waiting(1)
    loop = asyncio.get_running_loop()
    seen: list[list[int]] = []

    def plain() -> None:
        futures[0].set_result(5)
        seen.append(list(resumed))

    loop.call_soon(plain)
    assert await tasks[0] == 5
    assert seen == [[]]


@pytest.mark.anyio
async def test_resume_inside_a_running_task_queues_the_wake_ups() -> None:
    futures, tasks, resumed = await _waiting(2)
    for i, fut in enumerate(futures):
        fut.hold(i)
    resume(futures, asyncio.get_running_loop())  # this test is a task: none can be entered here
    assert resumed == []
    assert await asyncio.gather(*tasks) == [0, 1]


@pytest.mark.anyio
async def test_a_step_that_raises_out_leaves_the_rest_queued_not_dropped() -> None:
    loop = asyncio.get_running_loop()
    futures: list[ResumingFuture[int]] = [ResumingFuture(loop=loop) for _ in range(3)]
    ran: list[int] = []

    class Boom(BaseException):
        pass

    def first(fut: asyncio.Future[int]) -> None:
        ran.append(0)
        raise Boom

    futures[0].add_done_callback(first)
    futures[0].add_done_callback(lambda fut: ran.append(10))  # the same future's next callback
    futures[1].add_done_callback(lambda fut: ran.append(1))
    futures[2].add_done_callback(lambda fut: ran.append(2))
    caught: list[BaseException] = []

    def wake_up() -> None:
        for i, fut in enumerate(futures):
            fut.hold(i)
        try:
            resume(futures, loop)
        except Boom as exc:
            caught.append(exc)

    loop.call_soon(wake_up)
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(caught) == 1
    assert sorted(ran) == [0, 1, 2, 10]


@pytest.mark.anyio
async def test_cancel_set_exception_and_callbacks_behave_as_a_plain_future() -> None:
    loop = asyncio.get_running_loop()
    calls: list[str] = []

    def note(fut: asyncio.Future[int]) -> None:
        calls.append("called")

    cancelled: ResumingFuture[int] = ResumingFuture(loop=loop)
    cancelled.add_done_callback(note)
    assert cancelled.cancel("bye")
    assert not cancelled.cancel()
    assert calls == []  # queued, as a plain future's
    await asyncio.sleep(0)
    assert calls == ["called"] and cancelled.cancelled()

    failed: ResumingFuture[int] = ResumingFuture(loop=loop)
    failed.add_done_callback(note)
    failed.set_exception(ValueError("bad"))
    await asyncio.sleep(0)
    assert calls == ["called", "called"]
    with pytest.raises(ValueError, match="bad"):
        failed.result()

    removed: ResumingFuture[int] = ResumingFuture(loop=loop)
    removed.add_done_callback(note)
    removed.add_done_callback(note)
    assert removed.remove_done_callback(note) == 2
    removed.hold(1)
    resume([removed], loop)
    queue([removed])
    await asyncio.sleep(0)
    assert calls == ["called", "called"]  # removed callbacks never run

    done: ResumingFuture[int] = ResumingFuture(loop=loop)
    done.set_result(3)
    done.add_done_callback(note)  # added once done: queued at once, as a plain future does
    await asyncio.sleep(0)
    assert calls == ["called"] * 3
    with pytest.raises(asyncio.InvalidStateError):
        done.hold(4)


@pytest.mark.anyio
async def test_a_task_cancelled_while_held_gets_its_cancel_at_its_await() -> None:
    futures, tasks, resumed = await _waiting(2)
    loop = asyncio.get_running_loop()

    def wake_up() -> None:
        for i, fut in enumerate(futures):
            fut.hold(i)
        assert tasks[1].cancel()  # as a task resumed before it might: the result is there, the cancel wins
        resume(futures, loop)

    loop.call_soon(wake_up)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] == 0 and isinstance(results[1], asyncio.CancelledError)
    assert resumed == [0]
    assert futures[1].result() == 1  # what the cancelled task had been given stays readable (to hand back)
