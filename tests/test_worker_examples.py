"""The files in examples/ load and run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from zmq_omni import PipelineDriver, StageWorker, create_connector, load_pipeline_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLI = [sys.executable, "-m", "zmq_omni.cli"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_example_pipeline_yaml_selects_zmq_connector_per_edge() -> None:
    pipeline = load_pipeline_config(EXAMPLES / "pipeline.yaml", environ={})
    assert [s.name for s in pipeline.stages] == ["thinker", "talker", "vocoder"]
    for edge in (("driver", "0"), ("0", "1"), ("1", "2"), ("2", "driver")):
        assert pipeline.transfer.get_connector_for_edge(*edge).name == "ZmqConnector"
    inbound, outbound = pipeline.edge_specs(pipeline.stage("talker"))
    assert inbound.extra["endpoints"] == {"1": "tcp://127.0.0.1:5562"}
    assert outbound.extra["endpoints"] == {"2": "tcp://127.0.0.1:5563"}
    moved = load_pipeline_config(EXAMPLES / "pipeline.yaml", environ={"ZMQ_OMNI_ENDPOINT_1": "tcp://talker:5562"})
    assert moved.stage("talker").endpoint == "tcp://talker:5562"


def test_custom_connector_builds_by_module_path_and_runs_a_pipeline() -> None:
    with create_connector({"name": "examples.custom_connector:AuditedConnector",
                           "extra": {"namespace": "ex-unit", "label": "x"}}) as conn:
        assert type(conn).__name__ == "AuditedConnector"
        assert conn.put("a", "b", "k", {"v": np.arange(3)})[0]
        got = conn.get("a", "b", "k")
        assert got is not None and got[0]["v"].tolist() == [0, 1, 2]
        assert conn.health()["puts_per_edge"] == {"a->b": 1}

    pipeline = load_pipeline_config(EXAMPLES / "custom_connector.yaml")
    workers = [StageWorker.from_pipeline(pipeline, name) for name in ("thinker", "talker", "vocoder")]
    for worker in workers:
        worker.start()
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            driver.submit("r1", {"n_chunks": 2, "payload_size": 16384})
            kinds: list[str] = []
            end = time.monotonic() + 30
            while driver.pending and time.monotonic() < end:
                kinds += [event.kind for event in driver.poll(0.05)]
        assert kinds and kinds[-1] == "completed"
        health = workers[1].health()["chunks"]["connector"]
        assert health["outbound"]["label"] == "example"
        assert health["outbound"]["puts_per_edge"].get("1->2", 0) >= 1
    finally:
        for worker in workers:
            worker.close()


def test_embedded_stage_example_serves_as_the_talker(short_tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}
    for stage in ("DRIVER", "0", "1", "2"):
        env[f"ZMQ_OMNI_ENDPOINT_{stage}"] = f"tcp://127.0.0.1:{_port()}"
    config = str(EXAMPLES / "pipeline.yaml")
    procs = [
        subprocess.Popen([*CLI, "stage", "--config", config, "--stage", "thinker"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, str(EXAMPLES / "embed_stage.py"), config, "talker"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
        subprocess.Popen([*CLI, "stage", "--config", config, "--stage", "vocoder"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
    ]
    try:
        drive = subprocess.run([*CLI, "drive", "--config", config, "--requests", "2", "--chunks", "2",
                                "--payload-size", "32768"], env=env, capture_output=True, text=True, timeout=90,
                               check=False)
        assert drive.returncode == 0, drive.stdout + drive.stderr
        assert "req-000 completed" in drive.stdout and "req-001 completed" in drive.stdout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            codes.append((proc.returncode, err))
    assert [code for code, _ in codes] == [0, 0, 0], codes
