"""A stage process whose connector is driven by an event loop (review 46, F9).

It takes part in the stage endpoint only as its binder: holding the stage lock
it binds and serves the stage's other (threaded) processes; when another process
holds the lock it is refused with a ConfigError that says how to build it instead.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_in_repo, stage_receiver_extra
from zmq_omni.connectors.zmq import ZmqConnector


def _aio_proc(extra: dict[str, Any]) -> subprocess.Popen[str]:
    return python_in_repo("-m", "tests.stage_aio_proc", json.dumps(extra))


def _extra(short_tmp: Path, shm_dir: str) -> dict[str, Any]:
    return stage_receiver_extra(f"ipc://{short_tmp}/stage1.sock", shm_dir)


@pytest.mark.timeout(60)
def test_an_event_loop_connector_of_a_stage_whose_binder_is_another_process_is_refused_saying_why(
    short_tmp: Path, shm_dir: str
) -> None:
    extra = _extra(short_tmp, shm_dir)
    with ZmqConnector(extra):  # this process binds the stage endpoint
        proc = _aio_proc(extra)
        out, _ = proc.communicate("", timeout=30)
    assert out.startswith("error ConfigError"), out
    assert "another process of this stage binds" in out and "AsyncConnector(ZmqConnector(extra))" in out


@pytest.mark.timeout(60)
def test_an_event_loop_connector_that_binds_first_serves_the_stages_threaded_processes(
    short_tmp: Path, shm_dir: str
) -> None:
    extra = _extra(short_tmp, shm_dir)
    proc = _aio_proc(extra)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().split() == ["up"]
        with (
            ZmqConnector(extra) as client,
            ZmqConnector({"role": "sender", "endpoints": extra["endpoints"], "shm_dir": shm_dir}) as sender,
        ):
            assert type(client._bound.receiver).__name__ == "StageClient"
            assert sender.put("0", "1", "k_0_0", {"x": 3})[0]
            got = client.get_with_deadline("0", "1", "k_0_0", deadline=time.monotonic() + 10)
            assert got is not None and got[0] == {"x": 3}
            assert sender.flush(10.0)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
