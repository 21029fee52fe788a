"""The stage worker API and the pipeline driver, with every stage in this process.

Stages run as StageWorker threads over real backends (InProcConnector, and
ZmqConnector over ipc:// for one test); the process-level tests are in
test_cli.py and test_demo.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni import ConfigError, PipelineDriver, StageWorker, load_pipeline_config
from zmq_omni.stages import DriverEvent, PipelineConfig


def producer(request_id: str, payload: dict[str, Any], is_final: bool) -> Iterator[dict[str, Any]]:
    for i in range(int(payload["n"])):
        yield {"x": np.full(4, i, dtype=np.int64)}


def doubler(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    if "x" not in payload:
        return None
    if request_id.endswith("boom"):
        raise RuntimeError("doubler exploded")
    return {"x": payload["x"] * 2}


def collector(request_id: str, payload: dict[str, Any], is_final: bool) -> list[dict[str, Any]]:
    return [{"x": payload["x"] + 1}] if "x" in payload else []


def _config(
    connector: dict[str, Any],
    *,
    stall: float = 5.0,
    timeout: float = 20.0,
    stages: tuple[tuple[str, str], ...] = (("producer", "0"), ("doubler", "1"), ("collector", "2")),
    endpoints: dict[str, str] | None = None,
) -> dict[str, Any]:
    endpoints = endpoints or {}
    return {
        "pipeline": {
            "name": "test",
            "stall_timeout_s": stall,
            "request_timeout_s": timeout,
            "retry": {"attempts": 2, "deadline_s": 1.0},
            "driver": {"stage_id": "driver", **({"endpoint": endpoints["driver"]} if "driver" in endpoints else {})},
            "stages": [
                {
                    "name": name,
                    "stage_id": sid,
                    "function": f"tests.test_worker:{name}",
                    **({"endpoint": endpoints[name]} if name in endpoints else {}),
                }
                for name, sid in stages
            ],
        },
        "runtime": {"connectors": {"edge": connector}, "default_connector": "edge"},
    }


def _start(pipeline: PipelineConfig, names: list[str]) -> list[StageWorker]:
    workers = [StageWorker.from_pipeline(pipeline, name) for name in names]
    for worker in workers:
        worker.start()
    return workers


def _collect(driver: PipelineDriver, deadline_s: float = 30.0) -> dict[str, list[DriverEvent]]:
    events: dict[str, list[DriverEvent]] = {}
    end = time.monotonic() + deadline_s
    while driver.pending:
        assert time.monotonic() < end, "the driver never finished its requests"
        for event in driver.poll(0.05):
            events.setdefault(event.request_id, []).append(event)
    return events


def _outputs(events: list[DriverEvent]) -> list[int]:
    values: list[int] = []
    for event in events:
        if "x" in event.data:
            values.extend(np.asarray(event.data["x"]).reshape(-1, 4)[:, 0].tolist())
    return values


def _inproc() -> dict[str, Any]:
    return {"name": "InProcConnector", "extra": {"namespace": uuid.uuid4().hex}}


def test_three_stage_pipeline_delivers_every_chunk_in_order() -> None:
    pipeline = load_pipeline_config(_config(_inproc()))
    workers = _start(pipeline, ["producer", "doubler", "collector"])
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            for i in range(5):
                driver.submit(f"r{i}", {"n": 6 + i})
            events = _collect(driver)
    finally:
        for worker in workers:
            worker.close()
    assert sorted(events) == [f"r{i}" for i in range(5)]
    for i in range(5):
        kinds = [e.kind for e in events[f"r{i}"]]
        assert kinds[-1] == "completed" and "failed" not in kinds
        # producer i -> doubler 2i -> collector 2i + 1, in order, nothing lost or repeated.
        assert _outputs(events[f"r{i}"]) == [2 * k + 1 for k in range(6 + i)]
        trace = events[f"r{i}"][0].trace
        assert set(trace) >= {"driver", "0", "1", "2"}
    assert [w.stats["completed"] for w in workers] == [5, 5, 5]


def test_function_error_fails_only_that_request_and_reaches_the_driver_in_band() -> None:
    pipeline = load_pipeline_config(_config(_inproc(), stall=30.0, timeout=30.0))
    workers = _start(pipeline, ["producer", "doubler", "collector"])
    started = time.monotonic()
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            driver.submit("ok", {"n": 3})
            driver.submit("req-boom", {"n": 3})
            events = _collect(driver)
    finally:
        for worker in workers:
            worker.close()
    # In-band, so far sooner than the 30 s stall timeout.
    assert time.monotonic() - started < 20
    assert events["ok"][-1].kind == "completed"
    failed = [e for e in events["req-boom"] if e.kind == "failed"]
    assert len(failed) == 1 and "doubler exploded" in failed[0].reason and "RuntimeError" in failed[0].reason


def test_cancel_mid_stream_fails_the_request_with_its_reason_and_the_stage_serves_on() -> None:
    pipeline = load_pipeline_config(_config(_inproc(), stall=30.0, timeout=30.0))
    workers = _start(pipeline, ["collector"])
    seen = threading.Event()

    def gated(request_id: str, payload: dict[str, Any], is_final: bool) -> Iterator[dict[str, Any]]:
        for i, chunk in enumerate(producer(request_id, payload, is_final)):
            if i == 1 and request_id == "gone":
                seen.wait(10)  # the rest of the stream comes after the doubler cancelled: mid-stream
            yield chunk

    def gated_producer(request_id: str, payload: dict[str, Any], is_final: bool) -> Any:
        if request_id == "at-the-end":
            return {"x": np.zeros(4, dtype=np.int64)}  # one chunk, which is also the final one
        return gated(request_id, payload, is_final)

    def doubler_that_cancels(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
        if request_id in ("gone", "at-the-end") and "x" in payload:
            middle.cancel(request_id, "the client went away")
            seen.set()
            return None
        return doubler(request_id, payload, is_final)

    middle = StageWorker.from_pipeline(pipeline, "doubler", fn=doubler_that_cancels)
    for worker in (StageWorker.from_pipeline(pipeline, "producer", fn=gated_producer), middle):
        worker.start()
        workers.append(worker)
    started = time.monotonic()
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            driver.submit("gone", {"n": 10})
            driver.submit("kept", {"n": 3})
            driver.submit("at-the-end", {})  # its only input is final: the cancel still wins
            events = _collect(driver)
    finally:
        for worker in workers:
            worker.close()
    assert seen.is_set()
    assert time.monotonic() - started < 20  # in-band, far sooner than the 30 s stall
    assert events["kept"][-1].kind == "completed" and _outputs(events["kept"]) == [1, 3, 5]
    for request_id in ("gone", "at-the-end"):
        assert [e.kind for e in events[request_id]] == ["failed"], events[request_id]
        assert events[request_id][0].reason == "stage doubler: cancelled: the client went away"
    assert middle.stats["cancelled"] == 2 and middle.stats["failed"] == 0
    health = middle.health()
    assert health["active_requests"] == health["running_generators"] == health["refused_draining"] == 0
    middle.cancel("unknown", "ignored")  # not served here: nothing happens


def test_missing_stage_fails_requests_instead_of_hanging() -> None:
    pipeline = load_pipeline_config(_config(_inproc(), stall=0.5, timeout=2.0))
    workers = _start(pipeline, ["producer", "collector"])  # no doubler: its inputs go nowhere
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            driver.submit("a", {"n": 2})
            driver.submit("b", {"n": 2})
            events = _collect(driver, deadline_s=15.0)
    finally:
        for worker in workers:
            worker.close()
    for rid in ("a", "b"):
        assert [e.kind for e in events[rid]] == ["failed"]


def test_pipeline_over_zmq_ipc(short_tmp: Path) -> None:
    endpoints = {name: f"ipc://{short_tmp}/{name}" for name in ("driver", "producer", "doubler", "collector")}
    pipeline = load_pipeline_config(_config({"name": "ZmqConnector", "extra": {"shm": "off"}}, endpoints=endpoints))
    workers = _start(pipeline, ["producer", "doubler", "collector"])
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            for i in range(3):
                driver.submit(f"z{i}", {"n": 4})
            events = _collect(driver)
    finally:
        for worker in workers:
            worker.close()
    for i in range(3):
        assert events[f"z{i}"][-1].kind == "completed"
        assert _outputs(events[f"z{i}"]) == [1, 3, 5, 7]
    assert not [
        t for t in threading.enumerate() if t.name.startswith(("stage-", "chunks-", "stage", "driver")) and t.is_alive()
    ]


def test_embedding_a_worker_with_a_function_object() -> None:
    seen: list[tuple[str, bool]] = []

    def fn(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any]:
        seen.append((request_id, is_final))
        return {"x": np.asarray(payload["x"]) * 10} if "x" in payload else {}

    cfg = _config(_inproc(), stages=(("producer", "0"), ("doubler", "1")))
    pipeline = load_pipeline_config(cfg)
    with (
        StageWorker.from_pipeline(pipeline, "doubler", fn=fn) as doubler_worker,
        StageWorker.from_pipeline(pipeline, "producer") as producer_worker,
        PipelineDriver.from_pipeline(pipeline) as driver,
    ):
        doubler_worker.start()
        producer_worker.start()
        driver.submit("e", {"n": 2})
        events = _collect(driver)
    assert _outputs(events["e"]) == [0, 10]
    assert seen and seen[-1] == ("e", True)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["pipeline"]["stages"][0].pop("function"), "pipeline.stages[0].function"),
        (lambda c: c["pipeline"]["stages"][1].update(colour="red"), "pipeline.stages[1].colour"),
        (lambda c: c["pipeline"]["stages"][1].update(stage_id="0"), "duplicate stage stage_id '0'"),
        (lambda c: c["pipeline"].update(stages=[]), "pipeline.stages"),
        (lambda c: c.pop("pipeline"), "'pipeline'"),
        (lambda c: c["pipeline"]["stages"][0].update(endpoint="http://x"), "pipeline.stages[0].endpoint"),
        (lambda c: c["pipeline"].update(stall_timeout_s="soon"), "pipeline.stall_timeout_s"),
    ],
)
def test_bad_pipeline_config_names_the_key(mutate: Any, message: str) -> None:
    cfg = _config(_inproc())
    mutate(cfg)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_pipeline_config(cfg)


def test_endpoint_environment_override_and_edge_specs() -> None:
    endpoints = {
        "driver": "tcp://127.0.0.1:1",
        "producer": "tcp://127.0.0.1:2",
        "doubler": "tcp://127.0.0.1:3",
        "collector": "tcp://127.0.0.1:4",
    }
    cfg = _config({"name": "ZmqConnector", "extra": {"put_timeout_s": 1.0}}, endpoints=endpoints)
    cfg["pipeline"]["stages"][1]["bind"] = "tcp://0.0.0.0:3"
    pipeline = load_pipeline_config(cfg, environ={"ZMQ_OMNI_ENDPOINT_1": "tcp://doubler:5555"})
    assert pipeline.stage("doubler").endpoint == "tcp://doubler:5555"
    inbound, outbound = pipeline.edge_specs(pipeline.stage("doubler"))
    assert inbound.extra["role"] == "receiver" and inbound.extra["bind"] == "tcp://0.0.0.0:3"
    assert inbound.extra["endpoints"] == {"1": "tcp://doubler:5555"}
    assert outbound.extra["role"] == "sender" and outbound.extra["endpoints"] == {"2": "tcp://127.0.0.1:4"}
    assert outbound.extra["put_timeout_s"] == 1.0 and "bind" not in outbound.extra
    # The driver closes the loop at both ends.
    d_in, d_out = pipeline.edge_specs(pipeline.driver)
    assert d_in.extra["endpoints"] == {"driver": "tcp://127.0.0.1:1"}
    assert d_out.extra["endpoints"] == {"0": "tcp://127.0.0.1:2"}
    with pytest.raises(ConfigError, match="no stage 'nope'"):
        pipeline.stage("nope")
