"""SharedMemoryConnector with real processes: fidelity, exactly-once, kills, leaks, full tmpfs."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import resource
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from zmq_omni.connectors.shm import SharedMemoryConnector
from zmq_omni.errors import ConfigError
from zmq_omni.shm import parse_name, sweep

from . import _shm_workers as workers
from ._shm_workers import EDGE, digest

SPAWN = mp.get_context("spawn")
MiB = 1 << 20


@pytest.fixture
def config(shm_dir: str, tmp_path: Path) -> dict[str, Any]:
    return {"namespace": f"t-{uuid.uuid4().hex[:12]}", "shm_dir": shm_dir, "spill_dir": str(tmp_path)}


def ours(directory: str) -> list[str]:
    """Every object of ours left in ``directory``: segments, spill files, and records/claims."""
    left = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if parse_name(name) is not None:
            left.append(name)
        elif name.startswith("zomni_") and os.path.isdir(path):
            left += [f"{name}/{entry}" for entry in os.listdir(path)]
    return left


def kill(proc: Any) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)


def every_dtype(n: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 256, n * 16, dtype=np.uint8)
    out: dict[str, np.ndarray[Any, Any]] = {"bool": raw[:n] % 2 == 1}
    for code in ("i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"):
        dtype = np.dtype(code)
        out[code] = raw[: n * dtype.itemsize].view(dtype).copy()  # random bits: NaNs and infs included
        out[">" + code] = out[code].astype(dtype.newbyteorder(">")) if dtype.itemsize > 1 else out[code]
    out["bf16"] = raw[: n * 2].view(ml_dtypes.bfloat16).copy()
    out["fortran"] = np.asfortranarray(out["f4"][: (n // 8) * 8].reshape(8, -1))
    out["strided"] = out["i8"][::3]
    out["empty"] = np.zeros((0, 5), dtype=np.float32)
    out["scalar0d"] = np.array(3.5, dtype=np.float64)
    return out


# -- fidelity and zero copy ------------------------------------------------------------


@pytest.mark.parametrize("n", [7, 300_000], ids=["inline", "slot"])
def test_every_dtype_round_trips_bit_exact_across_processes(config: dict[str, Any], n: int) -> None:
    payload = every_dtype(n)
    expected = {name: digest(arr) for name, arr in payload.items()}
    out = SPAWN.Queue()
    with SharedMemoryConnector(config) as sender:
        assert sender.put(*EDGE, "all", payload)[0]
        for arr in payload.values():  # the sender reuses its arrays right after put
            arr.fill(0)
        child = SPAWN.Process(target=workers.receive_digests, args=(config, ["all"], out))
        child.start()
        try:
            got = out.get(timeout=60)["all"]
        finally:
            child.join(30)
        assert got == expected
        kind = "inline_puts" if n == 7 else "shm_puts"
        assert sender.health()[kind] == 1


def test_receiver_array_views_shared_memory_and_sender_wrote_once(config: dict[str, Any], shm_dir: str) -> None:
    data = np.random.default_rng(3).standard_normal(2 * MiB)  # 16 MiB
    expected = digest(data)
    out = SPAWN.Queue()
    with SharedMemoryConnector(config) as sender:
        ok, nbytes, _ = sender.put(*EDGE, "big", {"data": data})
        assert ok
        child = SPAWN.Process(target=workers.inspect_zero_copy, args=(config, "big", out))
        child.start()
        try:
            report = out.get(timeout=60)
        finally:
            child.join(30)
        health = sender.health()
    assert report["digest"] == expected
    assert not report["owndata"]
    # The receiver's array lies inside a mapping of one of the sender's slot files: no copy.
    assert report["mapped"] is not None and report["mapped"].startswith(shm_dir + "/zomni_")
    # The payload was written once: slot bytes written == payload (+ alignment of the small header frame).
    assert nbytes <= health["pool_bytes_written"] < nbytes + 64


# -- exactly once ------------------------------------------------------------------------


def test_two_receiver_processes_racing_each_key_get_it_once(config: dict[str, Any]) -> None:
    keys = [f"r_{i}" for i in range(400)]
    start, out = SPAWN.Event(), SPAWN.Queue()
    racers = [SPAWN.Process(target=workers.race_for_keys, args=(config, keys, start, out)) for _ in range(2)]
    with SharedMemoryConnector(config) as sender:
        for key in keys:
            assert sender.put(*EDGE, key, key)[0]
        for proc in racers:
            proc.start()
        try:
            time.sleep(1.0)  # both racers imported and waiting
            start.set()
            first, second = out.get(timeout=60), out.get(timeout=60)
        finally:
            for proc in racers:
                proc.join(30)
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(keys)


def test_waiting_get_wakes_on_a_put_from_another_process_without_burning_cpu(config: dict[str, Any]) -> None:
    done = SPAWN.Event()
    child = SPAWN.Process(target=workers.put_keys, args=(config, {"late": {"v": np.arange(10)}}, 1.5, done))
    with SharedMemoryConnector(config) as receiver:
        child.start()
        try:
            cpu0 = resource.getrusage(resource.RUSAGE_THREAD)
            got = receiver.get_with_deadline(*EDGE, "late", deadline=time.monotonic() + 30)
            cpu1 = resource.getrusage(resource.RUSAGE_THREAD)
        finally:
            done.set()
            child.join(30)
    assert got is not None
    np.testing.assert_array_equal(got[0]["v"], np.arange(10))
    # The wait spanned >1 s (the child's start-up plus its delay); a sleep-poll loop or a spin would show.
    used = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    assert used < 0.2, f"waiting used {used:.3f} s of CPU"


# -- leaks -------------------------------------------------------------------------------


def test_ten_thousand_transfers_leave_nothing_behind(config: dict[str, Any], shm_dir: str) -> None:
    rng = np.random.default_rng(0)
    big = rng.standard_normal(40_000)  # 320 KB: goes through a slot
    with SharedMemoryConnector(config) as sender, SharedMemoryConnector(config) as receiver:
        for i in range(10_000):
            payload: Any = {"i": i, "data": big} if i % 10 == 0 else {"i": i, "tok": [i, i + 1]}
            assert sender.put(*EDGE, f"k{i}", payload)[0]
            got = receiver.get(*EDGE, f"k{i}")
            assert got is not None and got[0]["i"] == i
            del got
        health = sender.health()
        assert health["pool_segments_created"] <= 2  # slots were reused, not made per message
        assert health["shm_puts"] == 1000 and health["inline_puts"] == 9000
    assert ours(shm_dir) == []


def test_kill_9_of_the_sender_then_sweep_leaves_nothing_and_a_new_pair_works(
    config: dict[str, Any], shm_dir: str, tmp_path: Path
) -> None:
    ready = SPAWN.Event()
    sender = SPAWN.Process(target=workers.stream_puts, args=(config, 40, 300_000, ready))
    with SharedMemoryConnector(config) as receiver:
        sender.start()
        try:
            assert ready.wait(60)
            held = [receiver.get_with_deadline(*EDGE, f"s{i}", deadline=time.monotonic() + 30) for i in range(5)]
            assert all(h is not None for h in held)
        finally:
            kill(sender)
        assert ours(shm_dir)  # the dead sender left slots and unconsumed records
        report = sweep(shm_dir=shm_dir, spill_dir=str(tmp_path))
        assert report.removed and not report.errors
        assert ours(shm_dir) == []
        # Arrays the receiver already holds stay valid after their segment was swept.
        for i, got in enumerate(held):
            assert got is not None and got[0]["i"] == i
            assert int(got[0]["data"][:8].view(np.int64)[0]) == i
        del held
        gc.collect()
        assert receiver.get(*EDGE, "s30") is None  # a dead sender's unconsumed put is gone
        # A fresh pair on the same namespace works.
        done = SPAWN.Event()
        fresh = SPAWN.Process(target=workers.put_keys, args=(config, {"again": {"x": np.ones(200_000)}}, 0, done))
        fresh.start()
        try:
            got2 = receiver.get_with_deadline(*EDGE, "again", deadline=time.monotonic() + 30)
            assert got2 is not None and float(got2[0]["x"].sum()) == 200_000
            del got2
        finally:
            done.set()
            fresh.join(30)
    gc.collect()
    assert ours(shm_dir) == []


def test_kill_9_of_the_receiver_then_sweep_and_reap_leave_nothing(
    config: dict[str, Any], shm_dir: str, tmp_path: Path
) -> None:
    keys = [f"h{i}" for i in range(6)]
    ready = SPAWN.Event()
    receiver = SPAWN.Process(target=workers.hold_leases, args=(config, keys, ready))
    with SharedMemoryConnector(config) as sender:
        receiver.start()
        try:
            for key in keys:
                assert sender.put(*EDGE, key, {"data": np.full(100_000, 7.0)})[0]
            for i in range(3):  # never consumed
                assert sender.put(*EDGE, f"unread{i}", {"data": np.full(100_000, 1.0)})[0]
            assert ready.wait(60)
            assert sender.health()["pool_slots_leased"] == 6
        finally:
            kill(receiver)
        assert sender._pool.reap() == 6  # the dead receiver's leases come back
        assert sender.health()["pool_slots_leased"] == 0
        sweep(shm_dir=shm_dir, spill_dir=str(tmp_path))
        # What remains belongs to the live sender: its slots and its three unread records.
        assert all(parse_name(n) is None or parse_name(n).pid == os.getpid() for n in ours(shm_dir))  # type: ignore[union-attr]
        # A fresh receiver works and reuses the reclaimed slots.
        with SharedMemoryConnector(config) as fresh:
            got = fresh.get(*EDGE, "unread0")
            assert got is not None and float(got[0]["data"][0]) == 1.0
            del got
        created = sender.health()["pool_segments_created"]
        assert sender.put(*EDGE, "after", {"data": np.zeros(100_000)})[0]
        assert sender.health()["pool_segments_created"] == created
    assert ours(shm_dir) == []


def test_unconsumed_puts_expire(config: dict[str, Any], shm_dir: str) -> None:
    config = {**config, "ttl_s": 0.2}
    with SharedMemoryConnector(config) as sender, SharedMemoryConnector(config) as receiver:
        assert sender.put(*EDGE, "stale-big", {"data": np.ones(100_000)})[0]
        assert sender.put(*EDGE, "stale-small", 1)[0]
        time.sleep(0.3)
        assert receiver.get(*EDGE, "other") is None  # any call runs the (rate-limited) expiry
        assert receiver.health()["expired"] == 2
        assert receiver.get(*EDGE, "stale-big") is None
        assert sender.health()["pool_slots_free"] == 1
        assert not [n for n in ours(shm_dir) if "/k." in n]


def test_close_withdraws_unconsumed_puts_and_unlinks_slots(config: dict[str, Any], shm_dir: str) -> None:
    sender = SharedMemoryConnector(config)
    for i in range(5):
        assert sender.put(*EDGE, f"c{i}", {"data": np.ones(100_000)} if i % 2 else i)[0]
    assert ours(shm_dir)
    sender.close()
    assert ours(shm_dir) == []


# -- short shared memory ---------------------------------------------------------------


def test_too_small_shm_falls_back_to_spill_files_and_health_says_so(tiny_tmpfs: str, tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    config = {"namespace": "tiny", "shm_dir": tiny_tmpfs, "spill_dir": str(spill), "min_free_bytes": 0}
    data = np.random.default_rng(5).standard_normal(MiB)  # 8 MiB: more than the whole tmpfs
    expected = digest(data)
    out = SPAWN.Queue()
    with SharedMemoryConnector(config) as sender:
        assert sender.put(*EDGE, "fits", {"data": data[:100_000]})[0]
        assert sender.health()["status"] == "ok"
        assert sender.put(*EDGE, "huge", {"data": data})[0]
        data[:] = 0.0
        health = sender.health()
        assert health["status"] == "degraded" and health["shm_fallback"] and health["spill_puts"] == 1
        child = SPAWN.Process(target=workers.receive_digests, args=(config, ["huge", "fits"], out))
        child.start()
        try:
            got = out.get(timeout=60)
        finally:
            child.join(30)
        assert got["huge"]["data"] == expected
        assert os.listdir(spill) == []  # the receiver consumed and removed the spill file
        assert sender.put(*EDGE, "small-again", {"data": np.ones(100_000)})[0]
        assert sender.health()["status"] == "ok"  # shared memory took it again
    assert ours(tiny_tmpfs) == []


def test_free_space_floor_forces_the_fallback(config: dict[str, Any], tmp_path: Path) -> None:
    config = {**config, "min_free_bytes": 1 << 60}
    with SharedMemoryConnector(config) as sender, SharedMemoryConnector(config) as receiver:
        assert sender.put(*EDGE, "k", {"data": np.arange(200_000)})[0]
        assert sender.health()["status"] == "degraded" and sender.health()["shm_fallbacks"] == 1
        got = receiver.get(*EDGE, "k")
        assert got is not None
        np.testing.assert_array_equal(got[0]["data"], np.arange(200_000))


def test_bad_config_names_the_key(shm_dir: str) -> None:
    with pytest.raises(ConfigError, match="inline_max_bytes"):
        SharedMemoryConnector({"inline_max_bytes": "big", "shm_dir": shm_dir})
    with pytest.raises(ConfigError, match="namespace"):
        SharedMemoryConnector({"namespace": "../etc", "shm_dir": shm_dir})
    with pytest.raises(ConfigError, match="ttl_s"):
        SharedMemoryConnector({"ttl_s": -1, "shm_dir": shm_dir})


def test_a_connector_that_starts_sweeps_what_killed_processes_left(config: dict[str, Any], shm_dir: str) -> None:
    name = workers.dead_process_segment(shm_dir)
    with SharedMemoryConnector(config):
        assert name not in os.listdir(shm_dir)
