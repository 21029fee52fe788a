"""OmniChunkManager over real in-process connectors: streams, assembly, stalls, cancellation, hooks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.adapter_helpers import FlakyConnector, chunk_pair, rid
from tests.test_adapter_base import drain_stream, wait_until
from zmq_omni.adapters import (
    ChunkInputs,
    ChunkManagerConfig,
    OmniChunkManager,
    ReferenceScheduler,
    StepOutput,
    StepRequest,
    assemble_chunks,
)


def test_keys_follow_the_vllm_omni_scheme() -> None:
    with chunk_pair(stages=2) as ((s0, s1), _):
        assert s0.send_key("abc", 7) == "abc_0_7"
        assert s1.recv_key("abc", 7) == "abc_0_7"
        assert s1.send_key("abc", 0) == "abc_1_0"


def test_concurrent_streams_arrive_whole_in_order_exactly_once() -> None:
    with chunk_pair() as ((sender, receiver), (_, conn1)):
        requests = [rid() for _ in range(8)]
        for request in requests:
            receiver.load_async(request)
            receiver.load_async(request)  # idempotent
        for i in range(20):
            for n, request in enumerate(requests):
                assert sender.save_async(request, {"x": np.array([[n, i]]), "ids": [i]}, is_final=i == 19) == i
        for n, request in enumerate(requests):
            got = drain_stream(receiver, request)
            x = np.concatenate([g.data["x"] for g in got])
            assert x.tolist() == [[n, i] for i in range(20)]
            assert [i for g in got for i in g.data["ids"]] == list(range(20))
            ids = [g.first_chunk_id + k for g in got for k in range(g.num_chunks)]
            assert ids == list(range(20))
        saved: set[str] = set()
        assert wait_until(lambda: bool(saved.update(sender.get_finished_requests().saved) or saved == set(requests)))
        assert receiver.pending_state() == {"sending": 0, "receiving": 0, "queued": 0, "parked": 0}
        assert sender.pending_state()["sending"] == 0
        assert conn1.health()["pending"] == 0


def test_finished_requests_are_reported_once() -> None:
    with chunk_pair() as ((sender, receiver), _):
        request = rid()
        receiver.load_async(request)
        sender.save_async(request, {"a": 1}, is_final=True)
        drain_stream(receiver, request)
        assert wait_until(lambda: sender.counters.get("puts") == 1)
        assert sender.get_finished_requests().saved == {request}
        assert sender.get_finished_requests().saved == set()
        assert receiver.get_finished_requests().loaded == {request}


def test_assembly_concatenates_arrays_and_merges_metadata() -> None:
    chunks = [
        {"h": np.ones((1, 2)), "ids": [1], "meta": {"a": 1, "n": {"x": 1}}, "step": np.int64(0), "t": (1,)},
        {"h": np.zeros((2, 2)), "ids": [2, 3], "meta": {"b": 2, "n": {"y": 2}}, "step": np.int64(1), "t": (2,)},
    ]
    out = assemble_chunks(chunks)
    assert out["h"].shape == (3, 2) and out["h"][0].tolist() == [1, 1]
    assert out["ids"] == [1, 2, 3] and out["t"] == (1, 2)
    assert out["meta"] == {"a": 1, "b": 2, "n": {"x": 1, "y": 2}}
    assert out["step"] == 1
    assert assemble_chunks([{"h": np.ones((2, 1))}, {"h": np.ones((2, 3))}], axis=1)["h"].shape == (2, 4)
    single = np.arange(3)
    assert assemble_chunks([{"h": single}])["h"] is single


def test_concat_axis_is_configurable_end_to_end() -> None:
    with chunk_pair() as ((sender, _), conns):
        receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1", concat_axis=1), conns[1])
        try:
            request = rid()
            receiver.load_async(request)
            sender.save_async(request, {"a": np.ones((2, 1))})
            sender.save_async(request, {"a": np.zeros((2, 2))}, is_final=True)
            full = receiver.load(request, timeout_s=5)
            assert full is not None and full.data["a"].shape == (2, 3) and full.num_chunks == 2
        finally:
            receiver.shutdown()


def test_empty_chunks_keep_alive_and_an_empty_terminal_ends_the_stream() -> None:
    with chunk_pair(stall_timeout_s=0.6) as ((sender, receiver), _):
        request = rid()
        receiver.load_async(request)
        for _ in range(6):
            sender.save_async(request, {})
            assert wait_until(lambda: receiver.is_receiving(request), 1)
            time.sleep(0.15)
            assert not receiver.is_ready(request)  # keep-alives are not inputs
        assert receiver.collect_failed_receive_request_ids() == {}  # 0.9 s > stall timeout, yet no stall
        sender.save_async(request, None, is_final=True)
        got = drain_stream(receiver, request)
        assert len(got) == 1 and got[0].is_final and got[0].data == {} and got[0].first_chunk_id == 6


def test_a_silent_upstream_is_reported_within_the_stall_timeout() -> None:
    with chunk_pair(stall_timeout_s=0.3) as ((sender, receiver), _):
        silent, alive = rid(), rid()
        started = time.monotonic()
        receiver.load_async(silent)
        receiver.load_async(alive)
        sender.save_async(alive, {"x": np.zeros(1)}, is_final=True)
        failed: dict[str, str] = {}
        while not failed and time.monotonic() - started < 5:
            receiver.wait_for_progress(0.05)
            failed = receiver.collect_failed_receive_request_ids()
        elapsed = time.monotonic() - started
        assert list(failed) == [silent] and "stalled" in failed[silent] and "chunk 0" in failed[silent]
        assert 0.3 <= elapsed < 0.3 + 1.0
        assert not receiver.is_receiving(silent)
        assert receiver.take_inputs(alive) is not None


def test_cancel_mid_stream_cleans_both_sides_and_tells_downstream() -> None:
    with chunk_pair(flaky=True) as ((sender, receiver), (conn0, conn1)):
        assert isinstance(conn0, FlakyConnector)
        request = rid()
        receiver.load_async(request)
        sender.save_async(request, {"x": np.array([0])})
        sender.save_async(request, {"x": np.array([1])})
        first = drain_stream_until(receiver, request, 2)
        conn0.gate.clear()  # the link stalls: the next chunks stay queued
        for i in range(2, 6):
            sender.save_async(request, {"x": np.array([i])})
        assert wait_until(lambda: sender.pending_state()["queued"] == 3)  # one is in flight
        sender.cancel(request)
        assert sender.save_async(request, {"x": np.array([99])}) is None
        conn0.gate.set()
        rest = drain_stream(receiver, request)
        assert rest[-1].is_final and rest[-1].cancelled
        assert [int(v) for g in first + rest for v in g.data.get("x", [])] == [0, 1, 2]
        assert f"{request}_0_3" in conn0.put_calls and f"{request}_0_4" not in conn0.put_calls
        assert wait_until(
            lambda: (
                sender.pending_state()
                == receiver.pending_state()
                == {"sending": 0, "receiving": 0, "queued": 0, "parked": 0}
            )
        )
        assert conn1.health()["pending"] == 0
        assert sender.collect_failed_send_request_ids() == {}


def drain_stream_until(manager: OmniChunkManager, request_id: str, n: int) -> list[ChunkInputs]:
    got: list[ChunkInputs] = []
    end = time.monotonic() + 5
    while sum(g.num_chunks for g in got) < n and time.monotonic() < end:
        manager.wait_for_progress(0.05)
        inputs = manager.take_inputs(request_id)
        if inputs is not None:
            got.append(inputs)
    assert sum(g.num_chunks for g in got) == n
    return got


def test_cancel_lets_an_already_queued_terminal_chunk_through() -> None:
    with chunk_pair(flaky=True) as ((sender, receiver), (conn0, _)):
        assert isinstance(conn0, FlakyConnector)
        request = rid()
        receiver.load_async(request)
        conn0.gate.clear()
        for i in range(5):
            sender.save_async(request, {"x": np.array([i])}, is_final=i == 4)
        sender.cancel(request)  # vllm-omni #6670: the queued terminal chunk must survive
        conn0.gate.set()
        got = drain_stream(receiver, request)
        assert got[-1].is_final and not got[-1].cancelled
        assert np.concatenate([g.data["x"] for g in got]).tolist() == [0, 1, 2, 3, 4]
        assert wait_until(lambda: sender.pending_state()["sending"] == 0)


def test_receiver_cancel_is_a_barrier_and_drops_what_the_connector_holds() -> None:
    with chunk_pair() as ((sender, receiver), _):
        request = rid()
        receiver.load_async(request)
        sender.save_async(request, {"x": np.array([0])})
        assert wait_until(lambda: receiver.is_ready(request) and receiver.take_inputs(request) is not None)
        receiver.cancel(request)
        assert not receiver.is_receiving(request) and receiver.take_inputs(request) is None
        sender.save_async(request, {"x": np.array([1])}, is_final=True)
        assert wait_until(lambda: sender.counters.get("puts") == 2)
        time.sleep(0.05)
        assert receiver.take_inputs(request) is None
        assert receiver.pending_state()["receiving"] == 0
        receiver.release(request)


def test_synchronous_save_and_load() -> None:
    with chunk_pair() as ((sender, receiver), _):
        request = rid()
        result: list[ChunkInputs | None] = []
        loader = threading.Thread(target=lambda: result.append(receiver.load(request, timeout_s=5)))
        loader.start()
        assert sender.save(request, {"x": np.arange(3)}, is_final=False, timeout_s=5)
        assert sender.save(request, {"x": np.arange(3, 5)}, timeout_s=5)
        loader.join(10)
        assert result and result[0] is not None and result[0].data["x"].tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError):
            sender.save_async(request, {"x": np.arange(1)})
        missing = rid()
        assert receiver.load(missing, timeout_s=0.2) is None
        assert "load timed out" in receiver.collect_failed_receive_request_ids()[missing]


def test_a_bad_chunk_fails_its_request() -> None:
    with chunk_pair() as ((_, receiver), (conn0, _)):
        request = rid()
        receiver.load_async(request)
        conn0.put("0", "1", f"{request}_0_0", {"not": "a chunk"})
        failed: dict[str, str] = {}
        assert wait_until(lambda: bool(failed.update(receiver.collect_failed_receive_request_ids()) or failed), 3)
        assert list(failed) == [request] and "bad chunk" in failed[request]
        assert not receiver.is_receiving(request)


def test_reference_scheduler_runs_a_stream_through_the_hooks() -> None:
    with chunk_pair() as ((sender, receiver), _):
        scheduler = ReferenceScheduler(receiver)
        requests = [rid() for _ in range(4)]
        for request in requests:
            scheduler.add_request(StepRequest(request))
        for i in range(10):
            for request in requests:
                sender.save_async(request, {"x": np.array([i])}, is_final=i == 9)
        seen: dict[str, list[int]] = {r: [] for r in requests}
        end = time.monotonic() + 10
        while scheduler.has_requests() and time.monotonic() < end:
            receiver.wait_for_progress(0.05)
            out: StepOutput = scheduler.step()
            assert not out.failed
            assert set(out.chunk_inputs) == set(out.scheduled_request_ids)
            for request_id, inputs in out.chunk_inputs.items():
                seen[request_id].extend(int(v) for v in inputs.data["x"])
                if inputs.is_final:
                    scheduler.finish_request(request_id)
        assert all(v == list(range(10)) for v in seen.values())


def test_reference_scheduler_drops_failed_requests() -> None:
    with chunk_pair(stall_timeout_s=0.2) as ((_, receiver), _):
        scheduler = ReferenceScheduler(receiver)
        request = rid()
        scheduler.add_request(StepRequest(request))
        end = time.monotonic() + 5
        failed: dict[str, str] = {}
        while not failed and time.monotonic() < end:
            receiver.wait_for_progress(0.05)
            out = scheduler.step()
            assert out.scheduled_request_ids == []
            failed = out.failed
        assert request in failed and not scheduler.has_requests()
