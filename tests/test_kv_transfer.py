"""KV transfer manager: TP-aware keys, shard split/merge bit-exact, bounded failing waits."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from tests.adapter_helpers import FlakyConnector
from zmq_omni.adapters import KVTransferConfig, KVTransferManager, RetryPolicy, kv_key
from zmq_omni.connectors.inproc import InProcConnector

HEADS, LAYERS = 8, 3
FAST = RetryPolicy(attempts=2, deadline_s=0.5, backoff_initial_s=0.01, jitter_s=0)


def full_cache(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # vLLM layout: (2, num_blocks, block_size, num_kv_heads, head_size); bit patterns incl. NaN payloads.
    return {
        f"layer.{i}": rng.integers(0, 2**16, size=(2, 3, 4, HEADS, 5), dtype=np.uint16).view(np.float16)
        for i in range(LAYERS)
    }


def shard(cache: dict[str, np.ndarray], rank: int, tp: int) -> dict[str, np.ndarray]:
    per = HEADS // tp
    return {name: np.ascontiguousarray(arr[..., rank * per : (rank + 1) * per, :]) for name, arr in cache.items()}


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 4), (4, 2), (1, 1)])
def test_tp_round_trip_is_bit_exact(src_tp: int, dst_tp: int) -> None:
    namespace = uuid.uuid4().hex
    cfg = KVTransferConfig(
        from_stage="0", to_stage="1", src_tp_size=src_tp, dst_tp_size=dst_tp, retry=FAST, recv_timeout_s=5
    )
    cache = full_cache(src_tp * 10 + dst_tp)
    with InProcConnector({"namespace": namespace}) as conn:
        senders = [KVTransferManager(cfg, conn, rank=r) for r in range(src_tp)]
        receivers = [KVTransferManager(cfg, conn, rank=d) for d in range(dst_tp)]
        threads = [
            threading.Thread(target=s.save, args=("req", shard(cache, r, src_tp)), kwargs={"metadata": {"seq_len": 11}})
            for r, s in enumerate(senders)
        ]
        for t in threads:
            t.start()
        results = [r.load("req") for r in receivers]
        for t in threads:
            t.join(10)
        for d, result in enumerate(results):
            assert result is not None
            assert result.metadata == {"seq_len": 11}
            want = shard(cache, d, dst_tp)
            assert list(result.layers) == list(want)
            for name in want:
                assert result.layers[name].tobytes() == want[name].tobytes()
                assert result.layers[name].shape == want[name].shape
        assert conn.health()["pending"] == 0
        for m in senders + receivers:
            assert m.collect_failed_send_request_ids() == {} and m.collect_failed_receive_request_ids() == {}


def test_keys_carry_source_and_destination_ranks() -> None:
    assert kv_key("r1", "0", "1", 1, 0) == "r1_kv_0_1_1_0"
    namespace = uuid.uuid4().hex
    cfg = KVTransferConfig(from_stage="0", to_stage="1", src_tp_size=1, dst_tp_size=2)
    with InProcConnector({"namespace": namespace}) as conn:
        KVTransferManager(cfg, conn, rank=0).save("r1", shard(full_cache(1), 0, 1))
        assert conn.get("0", "1", "r1_kv_0_1_0_1") is not None
        assert conn.get("0", "1", "r1_kv_0_1_0_0") is not None


def test_save_finished_gathers_blocks_of_a_paged_cache() -> None:
    namespace = uuid.uuid4().hex
    cfg = KVTransferConfig(from_stage="0", to_stage="1")
    paged = full_cache(3)
    with InProcConnector({"namespace": namespace}) as conn:
        assert KVTransferManager(cfg, conn).save_finished({"a": [2, 0]}, paged) == {"a": True}
        got = KVTransferManager(cfg, conn).load("a", timeout_s=2)
        assert got is not None and got.metadata["block_ids"] == [2, 0]
        for name, arr in paged.items():
            assert got.layers[name].tobytes() == arr[:, [2, 0]].tobytes()


def test_a_missing_shard_ends_in_a_reported_failure_within_the_bound() -> None:
    import time

    namespace = uuid.uuid4().hex
    cfg = KVTransferConfig(from_stage="0", to_stage="1", src_tp_size=2, dst_tp_size=1, recv_timeout_s=0.3)
    with InProcConnector({"namespace": namespace}) as conn:
        KVTransferManager(cfg, conn, rank=0).save("r", shard(full_cache(2), 0, 2))  # rank 1 never sends
        receiver = KVTransferManager(cfg, conn, rank=0)
        started = time.monotonic()
        assert receiver.load("r") is None
        assert 0.3 <= time.monotonic() - started < 2
        failed = receiver.collect_failed_receive_request_ids()
        assert "r_kv_0_1_1_0" in failed["r"] and "source rank 1" in failed["r"]


def test_a_send_that_exhausts_its_policy_is_reported() -> None:
    namespace = uuid.uuid4().hex
    cfg = KVTransferConfig(from_stage="0", to_stage="1", retry=FAST)
    with FlakyConnector({"namespace": namespace}) as conn:
        conn.dead = True
        sender = KVTransferManager(cfg, conn)
        assert not sender.save("r", shard(full_cache(4), 0, 1))
        failed = sender.collect_failed_send_request_ids()
        assert "gave up after 2 attempt(s)" in failed["r"] and "PeerGoneError" in failed["r"]
        assert conn.put_calls == ["r_kv_0_1_0_0"] * 2


def test_bad_inputs_raise() -> None:
    cfg = KVTransferConfig(from_stage="0", to_stage="1", src_tp_size=1, dst_tp_size=3)
    with InProcConnector({"namespace": uuid.uuid4().hex}) as conn:
        with pytest.raises(ValueError, match="cannot be split"):
            KVTransferManager(cfg, conn).save("r", shard(full_cache(1), 0, 1))
        with pytest.raises(ValueError):
            KVTransferManager(cfg, conn, rank=5).load("r")
