"""A send window smaller than what a stage has in flight slows a pipeline down; it never fails a request.

A stage announces each request to the next one with a small put on the same
edge as the request's chunks, so announcements and chunks share the sender's
window (``max_unacked`` puts, ``max_unacked_bytes``). The stages put a
request's chunks only once its announcement was put, and announcements ahead
of any chunk (``_PutOrder``): every chunk in the window belongs to a request
the next stage knows, so the window drains, and an announcement takes the
next slot that frees. Tested here end to end (stage threads over ZeroMQ ipc,
windows of a few chunks) and on the order itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni import PipelineDriver, StageWorker, load_pipeline_config
from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.stages import DriverEvent
from zmq_omni.stages._link import _EdgePair, _PutOrder

MIB = 1 << 20


def producer(request_id: str, payload: dict[str, Any], is_final: bool) -> Iterator[dict[str, Any]]:
    """Stream ``n`` chunks of ``size`` bytes; row 0 of chunk k holds k."""
    size = int(payload["size"])
    for k in range(int(payload["n"])):
        x = np.empty(size // 8, dtype=np.int64)
        x[:] = k
        yield {"x": x.reshape(1, -1), "seq": [k]}


def relay(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    """Pass the chunks on (several that arrived together go on as one)."""
    return {"x": payload["x"], "seq": payload["seq"]} if "x" in payload else None


def _pipeline(tmp: Path, window: dict[str, int]) -> dict[str, Any]:
    names = ("producer", "relay", "driver")
    endpoints = {name: f"ipc://{tmp}/{name}" for name in names}
    extra = {"shm": "off", "put_timeout_s": 2.0, "delivery_timeout_s": 10.0, **window}
    return {
        "pipeline": {
            "name": "small-window",
            "stall_timeout_s": 10.0,
            "request_timeout_s": 60.0,
            "retry": {"attempts": 2, "deadline_s": 1.0},
            "driver": {"stage_id": "driver", "endpoint": endpoints["driver"]},
            "stages": [
                {"name": name, "stage_id": sid, "function": f"tests.test_stage_windows:{name}", "endpoint": ep}
                for (name, sid), ep in zip(
                    (("producer", "0"), ("relay", "1")), (endpoints["producer"], endpoints["relay"]), strict=True
                )
            ],
        },
        "runtime": {"connectors": {"edge": {"name": "ZmqConnector", "extra": extra}}, "default_connector": "edge"},
    }


def _run(tmp: Path, window: dict[str, int], *, requests: int, chunks: int, size: int) -> dict[str, list[DriverEvent]]:
    pipeline = load_pipeline_config(_pipeline(tmp, window))
    workers = [StageWorker.from_pipeline(pipeline, name) for name in ("producer", "relay")]
    for worker in workers:
        worker.start()
    events: dict[str, list[DriverEvent]] = {}
    try:
        with PipelineDriver.from_pipeline(pipeline) as driver:
            for i in range(requests):
                driver.submit(f"q{i:02d}", {"n": chunks, "size": size})
            deadline = time.monotonic() + 120
            while driver.pending:
                assert time.monotonic() < deadline, f"requests still pending: {driver.pending}"
                for event in driver.poll(0.05):
                    events.setdefault(event.request_id, []).append(event)
    finally:
        for worker in workers:
            worker.close()
    for worker in workers:
        print(worker.name, worker.stats)
    return events


def _check_all_completed(events: dict[str, list[DriverEvent]], requests: int, chunks: int) -> None:
    failed = {rid: evs[-1].reason for rid, evs in events.items() if evs[-1].kind != "completed"}
    assert not failed, failed
    assert sorted(events) == [f"q{i:02d}" for i in range(requests)]
    for rid, evs in events.items():
        seqs = [int(k) for event in evs for k in event.data.get("seq", [])]
        assert seqs == list(range(chunks)), (rid, seqs)
        rows = np.concatenate([np.asarray(event.data["x"])[:, 0] for event in evs if "x" in event.data])
        assert rows.tolist() == list(range(chunks)), rid


def test_a_byte_window_of_a_few_one_mib_chunks_completes_every_request(short_tmp: Path) -> None:
    # Room for three 1 MiB chunks (and the small announcements) per sender, 12 requests of 6 chunks in flight.
    requests, chunks = 12, 6
    events = _run(short_tmp, {"max_unacked_bytes": 3 * MIB + 64 * 1024}, requests=requests, chunks=chunks, size=MIB)
    _check_all_completed(events, requests, chunks)


def test_a_put_window_far_below_the_chunks_in_flight_completes_every_request(short_tmp: Path) -> None:
    # 24 requests x 10 chunks through windows of 8 puts: announcements, heads and chunks share them.
    requests, chunks = 24, 10
    events = _run(short_tmp, {"max_unacked": 8}, requests=requests, chunks=chunks, size=1024)
    _check_all_completed(events, requests, chunks)


# -- the order itself ------------------------------------------------------------------------------------
def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def test_a_chunk_waits_for_its_announcement_and_others_do_not() -> None:
    order = _PutOrder()
    order.expect("a_0_")
    assert order.before_chunk("b_0_3") is None  # never announced through this order: not held
    waiter, out = _in_thread(order.before_chunk, "a_0_0")
    waiter.join(0.2)
    assert waiter.is_alive(), "a chunk went before its announcement"
    order.announced("a_0_", None)
    waiter.join(5)
    assert out == [None]
    assert order.before_chunk("a_0_1") is None


def test_a_failed_announcement_refuses_its_chunks_until_announced_again() -> None:
    order = _PutOrder(remembered=2)
    order.expect("a_0_")
    waiter, out = _in_thread(order.before_chunk, "a_0_0")
    order.announced("a_0_", "could not announce")
    waiter.join(5)
    assert out == ["could not announce"]
    assert order.before_chunk("a_0_1") == "could not announce"
    order.expect("a_0_")
    order.announced("a_0_", None)
    assert order.before_chunk("a_0_2") is None
    for rid in ("b", "c", "d"):  # the failures remembered are bounded: the oldest goes
        order.expect(f"{rid}_0_")
        order.announced(f"{rid}_0_", "no")
    assert order.before_chunk("b_0_0") is None
    assert order.before_chunk("d_0_0") == "no"


def test_chunks_wait_while_a_control_put_is_in_progress() -> None:
    order = _PutOrder()
    with order.control():
        waiter, out = _in_thread(order.before_chunk, "a_0_0")
        waiter.join(0.2)
        assert waiter.is_alive(), "a chunk went while an announcement was being put"
        with order.control():  # nested (an announcement's retries around each put)
            pass
        waiter.join(0.2)
        assert waiter.is_alive()
    waiter.join(5)
    assert out == [None]


def test_close_ends_every_wait_and_refuses_only_the_unannounced() -> None:
    order = _PutOrder()
    order.expect("a_0_")
    unannounced, out_a = _in_thread(order.before_chunk, "a_0_0")
    with order.control():
        announced, out_b = _in_thread(order.before_chunk, "b_0_0")
        time.sleep(0.1)
        order.close()
        unannounced.join(5)
        announced.join(5)
    assert out_a and "never announced" in out_a[0]
    assert out_b == [None]  # a shutdown still flushes the chunks of announced requests


@pytest.mark.parametrize("suffix", ["0", "17", "12345"])
def test_request_ids_with_underscores_map_to_their_stream(suffix: str) -> None:
    order = _PutOrder()
    order.expect("req_1_x_2_")
    order.announced("req_1_x_2_", "failed")
    assert order.before_chunk(f"req_1_x_2_{suffix}") == "failed"
    assert order.before_chunk(f"req_1_x_{suffix}") is None


def test_the_chunks_of_a_request_whose_announcement_failed_fail_at_once_without_a_put() -> None:
    namespace = f"order-{time.monotonic_ns()}"
    inbound = InProcConnector({"namespace": namespace, "stage_id": "0"})
    outbound = InProcConnector({"namespace": namespace, "stage_id": "0"})
    pair = _EdgePair(inbound, outbound)
    retry = RetryPolicy(attempts=5, deadline_s=30.0, backoff_initial_s=1.0)
    with OmniChunkManager(ChunkManagerConfig(stage_id="0", downstream_stage_id="1", retry=retry), pair) as chunks:
        pair.order.expect("a_0_")
        chunks.save_async("a", {"x": np.zeros(4)})
        time.sleep(0.1)
        assert outbound.health()["pending"] == 0  # held: its announcement has not gone
        pair.order.announced("a_0_", "could not announce the request to stage 1")
        deadline = time.monotonic() + 5
        failed: dict[str, str] = {}
        while not failed:
            assert time.monotonic() < deadline, "the chunk's failure was never reported"
            failed = chunks.collect_failed_send_request_ids()
            time.sleep(0.01)
        assert "could not announce" in failed["a"] and "after 1 attempt" in failed["a"], failed  # not retried
        assert outbound.health()["pending"] == 0  # never put
