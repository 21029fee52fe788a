"""A stage process that forks after building its connector (review 46, F3 and F7).

The child starts with none of its parent's endpoints: a connector it builds is a
local client of the stage's binder (its parent), and the copies of the parent's
bound sockets are closed in it, so when the parent dies the child (or any other
process of the stage) binds the endpoint.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import python_in_repo, stage_receiver_extra
from zmq_omni.connectors.zmq import ZmqConnector


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_child_forked_by_the_binder_is_a_client_and_binds_once_the_parent_dies(
    transport: str, short_tmp: Path, shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.ports import reserve_port

    monkeypatch.setenv("ZMQ_OMNI_RUN_DIR", str(short_tmp / "run"))
    endpoint = f"ipc://{short_tmp}/stage1.sock" if transport == "ipc" else f"tcp://127.0.0.1:{reserve_port()}"
    extra = stage_receiver_extra(endpoint, shm_dir)
    proc = python_in_repo("-m", "tests.stage_fork_proc", json.dumps(extra), "k_0_0")
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().split() == ["up", "PushReceiver"]
        assert proc.stdout.readline().split() == ["child", "StageClient"]  # not the parent's receiver
        proc.send_signal(signal.SIGKILL)  # the parent, the stage's binder, dies; its child lives on
        proc.wait(timeout=10)
        time.sleep(1.0)  # the child notices and binds (its inherited copy of the endpoint no longer holds it)
        with ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender:
            assert sender.put("0", "1", "k_0_0", {"x": 7})[0]
            line = proc.stdout.readline().split()
            assert line == ["child", "got", "7", "binds"], line
            assert sender.flush(10.0)
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
