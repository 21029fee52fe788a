"""The files in examples/ load and run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.ports import reserve_port
from tests.stage_procs import stop_and_show
from zmq_omni import PipelineDriver, StageWorker, create_connector, load_pipeline_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLI = [sys.executable, "-m", "zmq_omni.cli"]


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
    with create_connector(
        {"name": "examples.custom_connector:AuditedConnector", "extra": {"namespace": "ex-unit", "label": "x"}}
    ) as conn:
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
        env[f"ZMQ_OMNI_ENDPOINT_{stage}"] = f"tcp://127.0.0.1:{reserve_port()}"
    config = str(EXAMPLES / "pipeline.yaml")
    commands = {
        "thinker": [*CLI, "stage", "--config", config, "--stage", "thinker"],
        "talker (embed_stage.py)": [sys.executable, str(EXAMPLES / "embed_stage.py"), config, "talker"],
        "vocoder": [*CLI, "stage", "--config", config, "--stage", "vocoder"],
    }
    procs: dict[str, subprocess.Popen[str]] = {}
    logs = {name: short_tmp / f"{index}.log" for index, name in enumerate(commands)}
    drive: subprocess.CompletedProcess[str] | None = None
    try:
        for name, argv in commands.items():
            with open(logs[name], "w", encoding="utf-8") as log:
                procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        drive = subprocess.run(
            [*CLI, "drive", "--config", config, "--requests", "2", "--chunks", "2", "--payload-size", "32768"],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    finally:
        stop_and_show(procs, logs)  # every process's whole output, shown when the test fails
        if drive is not None:
            print(f"--- drive (exit {drive.returncode}) ---\n{drive.stdout}{drive.stderr}")
    assert drive.returncode == 0, drive.stdout + drive.stderr
    assert "req-000 completed" in drive.stdout and "req-001 completed" in drive.stdout
    assert {name: proc.returncode for name, proc in procs.items()} == dict.fromkeys(commands, 0)
