"""Items taken for cancelled gets and never taken again are reported when the AsyncConnector closes, not dropped."""

from __future__ import annotations

import logging

import pytest

from zmq_omni.aio._waiters import HandedBack
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
