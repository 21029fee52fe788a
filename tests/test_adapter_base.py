"""The adapter base through OmniChunkManager over real in-process connectors: retries, failures, idleness."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.adapter_helpers import FAST_RETRY, FlakyConnector, chunk_pair, rid
from tests.conftest import wait_until
from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, OmniTransferAdapterBase, RetryPolicy
from zmq_omni.errors import ConfigError, PeerGoneError


def drain_stream(manager: OmniChunkManager, request_id: str, timeout: float = 5.0) -> list:
    got = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        manager.wait_for_progress(0.05)
        inputs = manager.take_inputs(request_id)
        if inputs is not None:
            got.append(inputs)
            if inputs.is_final:
                return got
    raise AssertionError(f"stream of {request_id} did not end; got {got}")


def test_seed_surface_is_present() -> None:
    with chunk_pair() as ((sender, _receiver), _):
        for name in ("config", "connector", "recv_thread", "save_thread", "stop_event"):
            assert hasattr(sender, name)
        assert isinstance(sender, OmniTransferAdapterBase)
        assert sender.recv_thread.is_alive() and sender.save_thread.is_alive()
        for name in (
            "load",
            "load_async",
            "save",
            "save_async",
            "recv_loop",
            "save_loop",
            "get_finished_requests",
            "record_send_failure",
            "record_receive_failure",
            "collect_failed_send_request_ids",
            "collect_failed_receive_request_ids",
            "shutdown",
            "create_connector",
        ):
            assert callable(getattr(sender, name))


def test_create_connector_goes_through_the_factory() -> None:
    conn = OmniChunkManager.create_connector({"connector": {"name": "InProcConnector", "extra": {"namespace": "x"}}})
    try:
        assert type(conn).__name__ == "InProcConnector"
    finally:
        conn.close()
    manager = OmniChunkManager({"stage_id": 1, "connector": {"name": "InProcConnector", "extra": {}}})
    manager.shutdown()
    assert manager.connector.closed
    with pytest.raises(ConfigError):
        OmniChunkManager.create_connector({"stage_id": 1})


def test_retry_policy_config() -> None:
    policy = RetryPolicy.from_dict({"attempts": 2, "deadline_s": 0.5})
    assert policy.attempts == 2 and policy.deadline_s == 0.5
    with pytest.raises(ConfigError, match="bogus"):
        RetryPolicy.from_dict({"bogus": 1})
    with pytest.raises(ConfigError):
        RetryPolicy(attempts=0)


def test_retry_policy_gives_up_by_attempts_and_by_deadline() -> None:
    calls = 0

    def failing() -> None:
        nonlocal calls
        calls += 1
        raise PeerGoneError("gone")

    with pytest.raises(PeerGoneError):
        RetryPolicy(attempts=4, deadline_s=10, backoff_initial_s=0, jitter_s=0).retrying()(failing)
    assert calls == 4
    calls = 0
    started = time.monotonic()
    with pytest.raises(PeerGoneError):
        RetryPolicy(attempts=1000, deadline_s=0.2, backoff_initial_s=0.05, backoff_max_s=0.05, jitter_s=0).retrying()(
            failing
        )
    assert 2 <= calls < 1000
    assert time.monotonic() - started < 2
    calls = 0
    with pytest.raises(ValueError):
        RetryPolicy(attempts=5).retrying()(lambda: (_ for _ in ()).throw(ValueError("bug")))


def test_transient_put_failures_are_retried_under_the_same_key_without_duplicates() -> None:
    with chunk_pair(flaky=True) as ((sender, receiver), (conn0, _)):
        assert isinstance(conn0, FlakyConnector)
        request = rid()
        conn0.fail_puts[f"{request}_0_1"] = 2
        receiver.load_async(request)
        for i in range(3):
            sender.save_async(request, {"x": np.array([i])}, is_final=i == 2)
        got = drain_stream(receiver, request)
        assert np.concatenate([g.data["x"] for g in got]).tolist() == [0, 1, 2]
        assert conn0.put_calls.count(f"{request}_0_1") == 3
        assert sender.counters.get("put_retries") == 2
        assert sender.collect_failed_send_request_ids() == {}


def test_exhausted_policy_becomes_a_send_failure_and_later_chunks_are_skipped() -> None:
    with chunk_pair(flaky=True) as ((sender, _receiver), (conn0, _)):
        assert isinstance(conn0, FlakyConnector)
        conn0.dead = True
        request = rid()
        for i in range(5):
            sender.save_async(request, {"x": np.array([i])})
        assert wait_until(lambda: sender.counters.get("send_failures") >= 1)
        assert wait_until(lambda: sender.pending_state()["queued"] == 0)
        failed = sender.collect_failed_send_request_ids()
        assert list(failed) == [request]
        assert "gave up after 3 attempt(s)" in failed[request] and "PeerGoneError" in failed[request]
        assert conn0.put_calls == [f"{request}_0_0"] * 3
        assert sender.save_async(request, {"x": np.array([9])}) is None
        assert sender.collect_failed_send_request_ids() == {}
        # The breaker: the next request to the dead stage costs one attempt, not a policy.
        other = rid()
        sender.save_async(other, {"x": np.array([1])})
        assert wait_until(lambda: other in sender.collect_failed_send_request_ids())
        assert conn0.put_calls.count(f"{other}_0_0") == 1


def test_unencodable_payload_fails_its_request_without_retry() -> None:
    with chunk_pair() as ((sender, _), _conns):
        request = rid()
        sender.save_async(request, {"x": object()})
        assert wait_until(lambda: sender.counters.get("send_failures") == 1)
        reason = sender.collect_failed_send_request_ids()[request]
        assert "1 attempt(s)" in reason


def test_delivery_failures_from_the_connector_become_send_failures_of_their_request() -> None:
    with chunk_pair(flaky=True) as ((sender, _), (conn0, _)):
        assert isinstance(conn0, FlakyConnector)
        good, lost = rid(), rid()
        conn0.lost.add(f"{lost}_0_1")
        for request in (good, lost):
            for i in range(3):
                sender.save_async(request, {"x": np.array([i])}, is_final=i == 2)
        assert wait_until(lambda: sender.pending_state()["queued"] == 0 and sender.counters.get("puts") == 6)
        failed = sender.collect_failed_send_request_ids()
        assert list(failed) == [lost]
        assert "delivery never confirmed" in failed[lost] and f"{lost}_0_1" in failed[lost]


def _thread_cpu_seconds(native_id: int) -> float:
    path = Path(f"/proc/self/task/{native_id}/schedstat")
    return int(path.read_text().split()[0]) / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")
def test_idle_workers_use_no_measurable_cpu() -> None:
    with chunk_pair() as ((sender, receiver), _):
        # Exercise both workers first, so they are past start-up and really idle afterwards.
        request = rid()
        receiver.load_async(request)
        sender.save_async(request, {"x": np.zeros(4)}, is_final=True)
        drain_stream(receiver, request)
        threads = [t for m in (sender, receiver) for t in (m.recv_thread, m.save_thread)]
        ids = [t.native_id for t in threads]
        assert all(i is not None for i in ids)
        before = [_thread_cpu_seconds(i) for i in ids]  # type: ignore[arg-type]
        window = 1.0
        time.sleep(window)
        used = [_thread_cpu_seconds(i) - b for i, b in zip(ids, before, strict=True)]  # type: ignore[arg-type]
        assert all(t.is_alive() for t in threads)
        assert max(used) < 0.01 * window, f"idle worker CPU seconds: {used}"


def test_shutdown_is_prompt_with_the_peer_gone_and_work_pending() -> None:
    slow_retry = RetryPolicy(attempts=100, deadline_s=60, backoff_initial_s=0.2)
    with chunk_pair(flaky=True, stall_timeout_s=60, retry=slow_retry) as ((sender, receiver), (conn0, _)):
        assert isinstance(conn0, FlakyConnector)
        conn0.dead = True
        for n in range(5):
            receiver.load_async(f"r{n}")
            sender.save_async(f"r{n}", {"x": np.zeros(3)})
        time.sleep(0.1)  # the save worker is now inside its retry back-off
        for manager in (sender, receiver):
            started = time.monotonic()
            manager.shutdown()
            assert time.monotonic() - started < 1.0
            assert not manager.recv_thread.is_alive() and not manager.save_thread.is_alive()
            assert manager.connector.closed
        sender.shutdown()  # idempotent


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="nope"):
        ChunkManagerConfig.from_dict({"stage_id": 1, "nope": 2})
    cfg = ChunkManagerConfig.from_dict({"stage_id": 2, "retry": {"attempts": 2}, "stall_timeout_s": 3})
    assert (cfg.upstream_stage_id, cfg.downstream_stage_id, cfg.retry.attempts) == ("1", "3", 2)
    assert ChunkManagerConfig(stage_id="0").upstream_stage_id is None
    assert FAST_RETRY.attempts == 3


def test_shutdown_books_puts_still_unconfirmed_as_send_failures(short_tmp: Path) -> None:
    extra = {"stage_id": "0", "role": "sender", "endpoints": {"1": f"ipc://{short_tmp}/nobody.sock"}}
    manager = OmniChunkManager(
        {
            "stage_id": 0,
            "downstream_stage_id": 1,
            "shutdown_grace_s": 0.3,
            "connector": {"name": "ZmqConnector", "extra": extra},
        }
    )
    try:
        manager.save_async("r0", {"x": np.arange(4)}, is_final=True)
        assert wait_until(lambda: manager.connector.health()["puts"] >= 1, 5)
        started = time.monotonic()
        manager.shutdown()
        assert time.monotonic() - started < 1.5  # the grace, then a prompt close
        failed = manager.collect_failed_send_request_ids()
        assert set(failed) == {"r0"} and "confirmed delivery" in failed["r0"]
    finally:
        manager.shutdown()
