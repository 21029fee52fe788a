"""vllm-omni main's Qwen3-Omni deploy YAML, switched to ZmqConnector, streams every chunk across three processes.

The shape is main's ``deploy/qwen3_omni_moe.yaml`` (async_chunk: thinker 0 ->
talker 1 -> code2wav 2, one connector section for both edges), switched as
the recipe in docs/vllm-omni.md says. Each stage process builds two
connectors from its ``stage_connector_config`` (the scheduler's chunk adapter
and the model runner's mixin, see ``tests/vllm_main/stand_ins.py``); the talker's
connector has ``role: receiver`` and also sends. On failure the assertion
shows every stage's output.

Run alone: ``PYTHONPATH=$PWD python -m pytest -q tests/test_vllm_main_pipeline.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ports import reserve_port
from tests.vllm_main.main_loader import (
    DEPLOY_DIR,
    edges,
    load_view,
    stage_connector_config,
    stage_connector_spec,
    switch_to_zmq,
)

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = [f"chatcmpl-{i}" for i in range(6)]
CHUNKS = 8
RESULT_WAIT_S = 60.0
EXIT_WAIT_S = 20.0  # all three together: the test stays inside the 120 s timeout and still shows output


def _stage_configs(mode: str, transport: str, tmp: Path) -> dict[int, dict[str, Any]]:
    original = load_view(DEPLOY_DIR / "qwen3_omni_moe.yaml")
    if transport == "ipc":
        endpoints = {str(s): f"ipc://{tmp}/stage{s}.sock" for s in (0, 1, 2)}
    else:
        endpoints = {str(s): f"tcp://127.0.0.1:{reserve_port()}" for s in (0, 1, 2)}
    view = switch_to_zmq(original, {"mode": mode, "endpoints": endpoints})
    all_edges = edges(view)
    assert set(all_edges) == {("0", "1"), ("1", "2")}
    configs = {sid: stage_connector_config(stage_connector_spec(all_edges, sid, True), sid) for sid in (0, 1, 2)}
    # what main hands each stage process: the YAML's extra, a role, an int stage id; no from/to stage
    assert [c["extra"]["role"] for c in configs.values()] == ["sender", "receiver", "receiver"]
    assert all(c["extra"]["initial_codec_chunk_frames"] == 4 for c in configs.values())
    return configs


def _outputs(logs: dict[int, Path]) -> str:
    return "\n".join(f"--- stage {sid} ---\n{path.read_text(errors='replace')}" for sid, path in logs.items())


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_three_stage_async_chunk_pipeline_streams_every_chunk(mode: str, transport: str, short_tmp: Path) -> None:
    configs = _stage_configs(mode, transport, short_tmp)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = {sid: short_tmp / f"stage{sid}.log" for sid in configs}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for sid, config in configs.items():
            with logs[sid].open("wb") as log:
                procs[sid] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.vllm_main.stage_proc",
                        str(sid),
                        json.dumps(config),
                        str(short_tmp),
                        ",".join(REQUESTS),
                        str(CHUNKS),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        result_path = short_tmp / "result.json"
        deadline = time.monotonic() + RESULT_WAIT_S
        while not result_path.exists() and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.05)
    finally:
        codes = {}
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
        exit_by = time.monotonic() + EXIT_WAIT_S
        for sid, proc in procs.items():
            try:
                codes[sid] = proc.wait(timeout=max(0.1, exit_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[sid] = proc.wait()
    outputs = _outputs(logs)
    assert result_path.exists(), f"code2wav never received every chunk\n{outputs}"
    result = json.loads(result_path.read_text())
    assert result["problems"] == [], outputs
    assert result["received"] == {r: list(range(CHUNKS)) for r in REQUESTS}, outputs
    assert codes == {0: 0, 1: 0, 2: 0}, outputs
