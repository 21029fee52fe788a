"""A send window smaller than what a stage has in flight slows a pipeline down; it never fails a request.

A stage announces each request to the next one with a small put on the same
edge as the request's chunks, so announcements and chunks share the sender's
window (``max_unacked`` puts, ``max_unacked_bytes``). The stages put a
request's chunks only once its announcement was put, and announcements ahead
of any chunk (``_PutOrder``): every chunk in the window belongs to a request
the next stage knows, so the window drains, and an announcement gets one of
the next slots that free. Tested here end to end (stage threads over ZeroMQ
ipc, windows of a few chunks, a second driver against running stages), on
the order itself, and on the announcer and admitter over real connectors
(gaps, restarts, failures).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.stage_procs import stop_and_show
from zmq_omni import PipelineDriver, StageWorker, load_pipeline_config
from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
from zmq_omni.connectors import create_connector
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.errors import TransportTimeoutError
from zmq_omni.stages import DriverEvent
from zmq_omni.stages._announce import _ANNOUNCE_WINDOW, ANNOUNCE_PREFIX
from zmq_omni.stages._edge import _EdgePair, _PutOrder
from zmq_omni.stages._link import _Endpoint
from zmq_omni.transport import probe

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


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


def _start_stage_processes(tmp: Path, doc: dict[str, Any]) -> tuple[dict[str, subprocess.Popen[str]], dict[str, Path]]:
    """``zmq-omni stage`` for the producer and the relay, each in its own process, as a deployment runs them."""
    config = tmp / "pipeline.json"
    config.write_text(json.dumps(doc), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    procs: dict[str, subprocess.Popen[str]] = {}
    logs = {name: tmp / f"{name}.log" for name in ("producer", "relay")}
    for name, log_path in logs.items():
        with log_path.open("w", encoding="utf-8") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "zmq_omni.cli", "stage", "--config", str(config), "--stage", name],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
    return procs, logs


def _wait_until_bound(doc: dict[str, Any], procs: dict[str, subprocess.Popen[str]]) -> None:
    for stage in doc["pipeline"]["stages"]:
        deadline = time.monotonic() + 60
        while True:
            assert all(p.poll() is None for p in procs.values()), "a stage process exited"
            try:
                probe(stage["endpoint"], timeout_s=1.0)
                break
            except Exception:
                assert time.monotonic() < deadline, f"stage {stage['name']} never answered"
                time.sleep(0.1)


def _run(
    tmp: Path,
    window: dict[str, int],
    *,
    requests: int,
    chunks: int,
    size: int,
    drives: int = 1,
    processes: bool = False,
) -> list[dict[str, list[DriverEvent]]]:
    """Start the stages (threads here, or ``processes``), then run ``drives`` drivers one after the other."""
    doc = _pipeline(tmp, window)
    pipeline = load_pipeline_config(doc)
    workers: list[StageWorker] = []
    procs: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Path] = {}
    if processes:
        procs, logs = _start_stage_processes(tmp, doc)
    else:
        workers = [StageWorker.from_pipeline(pipeline, name) for name in ("producer", "relay")]
        for worker in workers:
            worker.start()
    runs: list[dict[str, list[DriverEvent]]] = []
    try:
        if procs:
            _wait_until_bound(doc, procs)
        for _ in range(drives):
            events: dict[str, list[DriverEvent]] = {}
            with PipelineDriver.from_pipeline(pipeline) as driver:
                for i in range(requests):
                    driver.submit(f"q{len(runs)}-{i:02d}", {"n": chunks, "size": size})
                deadline = time.monotonic() + 120
                while driver.pending:
                    assert time.monotonic() < deadline, f"requests still pending: {driver.pending}"
                    for event in driver.poll(0.05):
                        events.setdefault(event.request_id, []).append(event)
            runs.append(events)
    finally:
        for worker in workers:
            worker.close()
        if procs:
            stop_and_show(procs, logs)
    for worker in workers:
        print(worker.name, worker.stats)
    return runs


def _check_all_completed(events: dict[str, list[DriverEvent]], requests: int, chunks: int, run: int = 0) -> None:
    failed = {rid: evs[-1].reason for rid, evs in events.items() if evs[-1].kind != "completed"}
    assert not failed, failed
    assert sorted(events) == [f"q{run}-{i:02d}" for i in range(requests)]
    for rid, evs in events.items():
        seqs = [int(k) for event in evs for k in event.data.get("seq", [])]
        assert seqs == list(range(chunks)), (rid, seqs)
        rows = np.concatenate([np.asarray(event.data["x"])[:, 0] for event in evs if "x" in event.data])
        assert rows.tolist() == list(range(chunks)), rid


def test_a_byte_window_of_a_few_one_mib_chunks_completes_every_request(short_tmp: Path) -> None:
    # Room for three 1 MiB chunks (and the small announcements) per sender, 12 requests of 6 chunks in flight;
    # each stage in its own process, as deployed (docs/deployment.md says why stages sharing a process with
    # such a window can stall: a put to an endpoint of its own process is waited for before it is admitted).
    requests, chunks = 12, 6
    window = {"max_unacked_bytes": 3 * MIB + 64 * 1024}
    (events,) = _run(short_tmp, window, requests=requests, chunks=chunks, size=MIB, processes=True)
    _check_all_completed(events, requests, chunks)


def test_a_put_window_far_below_the_chunks_in_flight_completes_every_request(short_tmp: Path) -> None:
    # 24 requests x 10 chunks through windows of 8 puts: announcements, heads and chunks share them.
    requests, chunks = 24, 10
    (events,) = _run(short_tmp, {"max_unacked": 8}, requests=requests, chunks=chunks, size=1024)
    _check_all_completed(events, requests, chunks)


def test_a_second_driver_against_running_stages_with_a_small_window_completes_every_request(short_tmp: Path) -> None:
    # `zmq-omni drive` again and again: each new driver starts its announcements at seq 0 (the
    # producer reads them as a restarted upstream) and reads the relay's from seq 0 while the relay
    # is 40 past it (it can only catch up through the relay's head, with the window of 8 still open).
    first, second = _run(short_tmp, {"max_unacked": 8}, requests=40, chunks=4, size=1024, drives=2)
    _check_all_completed(first, 40, 4, run=0)
    _check_all_completed(second, 40, 4, run=1)


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


def test_a_withdrawn_hold_leaves_an_earlier_attempts_hold_and_failure_is_cleared_by_an_announcement() -> None:
    order = _PutOrder()
    order.expect("a_0_")  # attempt 1: its announcement is queued
    order.expect("a_0_")  # attempt 2 of the same id: its chunk could not be queued
    order.release("a_0_")
    waiter, out = _in_thread(order.before_chunk, "a_0_0")
    waiter.join(0.2)
    assert waiter.is_alive(), "attempt 1's chunk went before its announcement"
    order.announced("a_0_", None)
    waiter.join(5)
    assert out == [None]  # not refused by attempt 2's withdrawal
    order.failed_later("a_0_", "delivery failed")  # the announcement's delivery failed after its put returned
    assert order.before_chunk("a_0_1") == "delivery failed"
    order.expect("a_0_")
    order.announced("a_0_", None)
    assert order.before_chunk("a_0_2") is None


# -- announcements over real connectors ---------------------------------------------------------------
class _FlakyAnnouncements(InProcConnector):
    """An in-process connector whose puts of the announcement seqs in ``failing`` fail (a timeout, retryable)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.failing: set[int] = set()
        self.attempts: dict[str, int] = {}
        self.attempted = threading.Event()

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        seq = put_key.rsplit("_", 1)[-1]
        if put_key.startswith(ANNOUNCE_PREFIX) and seq.isdigit():
            self.attempts[put_key] = self.attempts.get(put_key, 0) + 1
            self.attempted.set()
            if int(seq) in self.failing:
                reason = "injected: no room in the send window"
                self._record_failure("put", from_stage, to_stage, put_key, reason, TransportTimeoutError(reason))
                return False, 0, None
        return super().put(from_stage, to_stage, put_key, data)


def _endpoint(
    namespace: str, stage_id: str, upstream: str, downstream: str, retry: RetryPolicy, outbound: Any = None
) -> _Endpoint:
    return _Endpoint(
        stage_id=stage_id,
        upstream_stage_id=upstream,
        downstream_stage_id=downstream,
        inbound=InProcConnector({"namespace": namespace, "stage_id": stage_id}),
        outbound=outbound or InProcConnector({"namespace": namespace, "stage_id": stage_id}),
        stall_timeout_s=30.0,
        retry=retry,
        label="test",
    )


def _admitted(endpoint: _Endpoint, count: int, timeout: float = 20.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            got.append(endpoint.admitted.get(timeout=0.1)[0])
    return got


@pytest.fixture
def namespace() -> str:
    return f"windows-{time.monotonic_ns()}"


def test_a_restarted_upstream_is_read_past_the_look_ahead_without_a_head(namespace: str) -> None:
    # The test plays the upstream: announcements 0..39, then (restarted) 0..29 again, and no head.
    upstream = InProcConnector({"namespace": namespace, "stage_id": "0"})
    receiver = _endpoint(namespace, "1", "0", "2", RetryPolicy())
    try:
        for seq in range(40):
            upstream.put("0", "1", f"{ANNOUNCE_PREFIX}0_{seq}", {"request_id": f"a{seq}"})
        assert _admitted(receiver, 40) == [f"a{seq}" for seq in range(40)]
        for seq in range(30):
            upstream.put("0", "1", f"{ANNOUNCE_PREFIX}0_{seq}", {"request_id": f"b{seq}"})
        assert sorted(_admitted(receiver, 30)) == sorted(f"b{seq}" for seq in range(30))
    finally:
        receiver.close()
        upstream.close()


def test_a_gap_of_failed_announcements_wider_than_the_look_ahead_is_crossed(namespace: str) -> None:
    outbound = _FlakyAnnouncements({"namespace": namespace, "stage_id": "0"})
    outbound.failing = set(range(3, 3 + 2 * _ANNOUNCE_WINDOW))
    retry = RetryPolicy(attempts=1, deadline_s=5.0)
    sender = _endpoint(namespace, "0", "d", "1", retry, outbound)
    receiver = _endpoint(namespace, "1", "0", "2", retry)
    try:
        total = 3 + 2 * _ANNOUNCE_WINDOW + 10
        for i in range(total):
            sender.announce(f"r{i}")
        expected = [f"r{i}" for i in range(total) if i not in outbound.failing]
        assert sorted(_admitted(receiver, len(expected))) == sorted(expected)
        failed = [sender.announce_failures.get(timeout=5)[0] for _ in outbound.failing]
        assert sorted(failed) == sorted(f"r{i}" for i in outbound.failing)
    finally:
        receiver.close()
        sender.close()


def test_chunks_of_announced_requests_go_while_an_announcement_waits_to_retry(namespace: str) -> None:
    outbound = _FlakyAnnouncements({"namespace": namespace, "stage_id": "0"})
    outbound.failing = {1}
    # A long backoff: the announcement of "b" sits between its attempts for the whole test.
    retry = RetryPolicy(attempts=2, deadline_s=120.0, backoff_initial_s=60.0, backoff_max_s=60.0)
    sender = _endpoint(namespace, "0", "d", "1", retry, outbound)
    reader = InProcConnector({"namespace": namespace, "stage_id": "1"})
    try:
        sender.announce("a")
        assert reader.get_with_deadline("0", "1", f"{ANNOUNCE_PREFIX}0_0", deadline=time.monotonic() + 10)
        outbound.attempted.clear()
        sender.announce("b")
        assert outbound.attempted.wait(10) and outbound.attempts.get(f"{ANNOUNCE_PREFIX}0_1") == 1
        sender.chunks.save_async("a", {"x": np.zeros(4)}, is_final=True)
        got = reader.get_with_deadline("0", "1", "a_0_0", deadline=time.monotonic() + 20)
        assert got is not None, "a chunk of an announced request waited for another announcement's backoff"
        assert sender.announce_failures.empty()  # "b" is still between its attempts
    finally:
        sender.close()
        reader.close()


def test_after_an_announcement_gave_up_the_next_ones_get_one_attempt_until_one_goes(namespace: str) -> None:
    outbound = _FlakyAnnouncements({"namespace": namespace, "stage_id": "0"})
    outbound.failing = {0, 1, 3}
    retry = RetryPolicy(attempts=3, deadline_s=30.0, backoff_initial_s=0.01, backoff_max_s=0.01)
    sender = _endpoint(namespace, "0", "d", "1", retry, outbound)
    try:
        for i in range(4):
            sender.announce(f"r{i}")
        failed = [sender.announce_failures.get(timeout=10)[0] for _ in range(3)]
        assert failed == ["r0", "r1", "r3"]
        attempts = [outbound.attempts.get(f"{ANNOUNCE_PREFIX}0_{seq}") for seq in range(4)]
        assert attempts == [3, 1, 1, 3]  # the downstream is taken as down after r0, as up again after r2
    finally:
        sender.close()


def test_chunks_are_refused_once_their_announcements_delivery_failed(short_tmp: Path, namespace: str) -> None:
    # The downstream never comes up: the announcement's put returns, its delivery fails later.
    outbound = create_connector(
        {
            "name": "ZmqConnector",
            "extra": {
                "stage_id": "0",
                "role": "sender",
                "endpoints": {"1": f"ipc://{short_tmp}/nobody"},
                "shm": "off",
                "delivery_timeout_s": 0.5,
            },
        }
    )
    retry = RetryPolicy(attempts=1, deadline_s=5.0)
    sender = _endpoint(namespace, "0", "d", "1", retry, outbound)
    try:
        sender.announce("a")
        deadline = time.monotonic() + 20
        while sender.announce_failures.empty():
            assert time.monotonic() < deadline, "the announcement's delivery failure was never reported"
            sender.connector.route_failures()
            time.sleep(0.05)
        request_id, reason = sender.announce_failures.get()
        assert request_id == "a" and "announcing the request to stage 1 failed" in reason, reason
        sender.chunks.save_async("a", {"x": np.zeros(4)}, is_final=True)
        failed: dict[str, str] = {}
        while "a" not in failed:
            assert time.monotonic() < deadline, "the chunk's failure was never reported"
            failed.update(sender.chunks.collect_failed_send_request_ids())
            time.sleep(0.05)
        assert "announcing the request to stage 1 failed" in failed["a"], failed  # refused, never put
    finally:
        sender.close()
