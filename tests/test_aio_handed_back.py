"""Items taken for cancelled gets and never taken again are reported when the AsyncConnector closes, not dropped."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from zmq_omni.aio import AsyncConnector, _waiters
from zmq_omni.aio._waiters import HandedBack
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.errors import ClosedResourceError


def test_abandoning_handed_back_items_reports_each_one(caplog: pytest.LogCaptureFixture) -> None:
    kept = HandedBack()
    kept.keep(("0", "1", "a"), ({"x": 1}, 10))
    kept.keep(("0", "1", "a"), ({"x": 2}, 10))
    kept.keep(("0", "1", "b"), ({"x": 3}, 10))
    assert kept.take(("0", "1", "b")) == ({"x": 3}, 10)  # a later get took this one
    with caplog.at_level(logging.WARNING, logger="zmq_omni.aio"):
        lost = kept.abandon()
    assert [(f.key, f.from_stage, f.to_stage, f.op) for f in lost] == [("a", "0", "1", "get")] * 2
    assert all(isinstance(f.error, ClosedResourceError) for f in lost)
    assert "2 item(s)" in caplog.text and "'a'" in caplog.text
    assert kept.count == 0 and not kept and kept.abandon() == []


def test_an_item_handed_back_after_abandon_is_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    kept = HandedBack()
    assert kept.abandon() == []
    with caplog.at_level(logging.WARNING, logger="zmq_omni.aio"):
        lost = kept.keep(("0", "1", "late"), ({"x": 1}, 10))
    assert [(f.key, f.op) for f in lost] == [("late", "get")] and isinstance(lost[0].error, ClosedResourceError)
    assert kept.count == 0 and "after the AsyncConnector closed" in caplog.text


def test_an_item_dropped_over_the_limit_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_waiters, "_HANDED_BACK_MAX", 2)
    kept = HandedBack()
    assert kept.keep(("0", "1", "a"), ({"x": 1}, 10)) == []
    assert kept.keep(("0", "1", "b"), ({"x": 2}, 10)) == []
    lost = kept.keep(("0", "1", "c"), ({"x": 3}, 10))
    assert [(f.key, f.op) for f in lost] == [("a", "get")] and kept.count == 2


@pytest.mark.anyio
async def test_get_cancelled_after_aclose_reports_its_item() -> None:
    namespace = uuid.uuid4().hex
    conn = AsyncConnector(InProcConnector({"namespace": namespace}))
    async with AsyncConnector(InProcConnector({"namespace": namespace})) as other:

        async def get_a() -> None:
            assert await conn.get("0", "1", "a") is not None
            # The wake-up took b's item too; b is cancelled after aclose let go of the handed-back store.
            task_b.cancel()
            await conn.aclose()

        task_a = asyncio.create_task(get_a())
        task_b = asyncio.create_task(conn.get("0", "1", "b"))
        await asyncio.sleep(0)
        await other.put("0", "1", "a", {"v": 1})  # both before the wake-up: one wake-up takes both
        await other.put("0", "1", "b", {"v": 2})
        await task_a
        with pytest.raises(asyncio.CancelledError):
            await task_b
    assert [(f.op, f.key) for f in conn.drain_failures()] == [("get", "b")]
