"""A burst of like failures (a stopped downstream) logs one line per interval, not one per chunk."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.adapter_helpers import FAST_RETRY
from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, WarningBurst
from zmq_omni.connectors.inproc import InProcConnector


def test_the_first_of_an_interval_is_logged_and_the_rest_summed_up() -> None:
    burst = WarningBurst(interval_s=5.0)
    assert burst.note("r1", "boom 1", now=100.0) == (True, None)
    for i in range(799):
        assert burst.note(f"r{i % 4}", f"boom {i}", now=101.0 + i / 1000) == (False, None)
    full, summary = burst.note("r9", "boom again", now=105.0)
    assert full and summary is not None
    assert summary.startswith("799 more like the one logged 5 s or less before (4 requests); the last: boom 798")
    assert burst.flush() is None
    assert burst.note("r9", "late", now=106.0) == (False, None)
    assert burst.flush() == "1 more like the one logged 5 s or less before (1 requests); the last: late"


def test_a_chunk_manager_logs_a_burst_of_send_failures_in_two_lines(caplog: pytest.LogCaptureFixture) -> None:
    connector = InProcConnector({"namespace": "burst"})
    manager = OmniChunkManager(ChunkManagerConfig(stage_id="1", retry=FAST_RETRY), connector)
    try:
        with caplog.at_level(logging.WARNING, logger="zmq_omni.adapters"):
            for i in range(300):
                manager.record_send_failure(f"req-{i % 3}", f"delivery to stage '2' not confirmed [key={i}]")
        assert len(manager.collect_failed_send_request_ids()) == 3  # every request still reported
    finally:
        manager.shutdown()
    lines: list[Any] = [r.getMessage() for r in caplog.records if r.name == "zmq_omni.adapters"]
    assert len(lines) == 2, lines
    assert lines[0] == "stage 1: request req-0 send failed: delivery to stage '2' not confirmed [key=0]"
    assert lines[1].startswith("stage 1: send failures: 299 more like the one logged 5 s or less before (3 requests)")
