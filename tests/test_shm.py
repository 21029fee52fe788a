"""The shm room: owner-carrying names, segments, the slot pool and its leases, the sweep."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from zmq_omni.errors import ShmError, ShmSpaceError
from zmq_omni.shm import (
    Owner,
    Segment,
    SlotHandle,
    SlotPool,
    SlotReader,
    check_free_space,
    make_name,
    parse_name,
    self_owner,
    sweep,
    sweep_dead_once,
)
from zmq_omni.shm.pool import FREE, LEASED, READY

from . import _shm_workers as workers

SPAWN = mp.get_context("spawn")
MiB = 1 << 20


@pytest.fixture
def pool(shm_dir: str) -> Iterator[SlotPool]:
    made = SlotPool(directory=shm_dir, max_bytes=64 * MiB, min_free_bytes=0, min_slot_bytes=MiB)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def reader(shm_dir: str) -> Iterator[SlotReader]:
    made = SlotReader(directory=shm_dir)
    try:
        yield made
    finally:
        made.close()


def dead_owner() -> Owner:
    """The owner identity of a process that has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    me = self_owner()
    return Owner(me.uid, me.pidns, int(proc.stdout), 12345)


def state_of(pool: SlotPool, name: str) -> int:
    return next(slot.state for slot in pool._slots if slot.seg.name == name)


# -- names and owners ---------------------------------------------------------------


def test_names_carry_the_owner_and_round_trip() -> None:
    name = make_name()
    assert parse_name(name) == self_owner()
    assert self_owner().is_alive()
    for foreign in ("psm_1234", "zomni_x", "zomni_0_1_2_3", "zomni_0_1_2_3_nothex!", "../zomni_0_1_2_3_abcdef01"):
        assert parse_name(foreign) is None


def test_owner_is_dead_when_pid_gone_or_start_time_differs() -> None:
    assert not dead_owner().is_alive()
    me = self_owner()
    assert not Owner(me.uid, me.pidns, me.pid, me.start + 1).is_alive()  # pid reused by another process
    # Another PID namespace: we cannot judge, so it counts as alive.
    assert Owner(me.uid, me.pidns + 1, 999_999, 1).is_alive()


# -- segments --------------------------------------------------------------------------


def test_attach_refuses_names_that_are_not_ours(shm_dir: str) -> None:
    for bad in ("../../etc/passwd", "psm_deadbeef", "zomni_evil"):
        with pytest.raises(ShmError, match="not a zmq_omni segment"):
            Segment.attach(bad, directory=shm_dir)


def test_attaching_process_never_unlinks_the_segment(shm_dir: str) -> None:
    seg = Segment.create(MiB, directory=shm_dir)
    try:
        seg.mm[:4] = b"ZOSL"
        child = SPAWN.Process(target=workers.attach_and_exit, args=(shm_dir, seg.name))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        # multiprocessing.shared_memory would have had the child's resource tracker unlink it.
        assert os.path.exists(seg.path)
    finally:
        seg.unlink()
        seg.close()


def test_free_space_check_and_full_tmpfs_raise_space_error(shm_dir: str) -> None:
    with pytest.raises(ShmSpaceError):
        check_free_space(shm_dir, MiB, min_free_bytes=1 << 60)
    with pytest.raises(ShmSpaceError):
        Segment.create(MiB, directory=shm_dir, min_free_bytes=1 << 60)
    assert os.listdir(shm_dir) == []


# -- the pool and its leases ---------------------------------------------------------------


def test_handle_packs_and_rejects_garbage() -> None:
    handle = SlotHandle(make_name(), 7, ((0, 10), (64, 1 << 30)))
    assert SlotHandle.unpack(handle.pack()) == handle
    for bad in (b"", b"XXXX" + handle.pack()[4:], handle.pack()[:-1]):
        with pytest.raises(ShmError):
            SlotHandle.unpack(bad)


def test_slot_round_trip_is_zero_copy_and_written_once(pool: SlotPool, reader: SlotReader) -> None:
    src = np.random.default_rng(1).integers(0, 255, 3 * MiB, dtype=np.uint8)
    handle = pool.write([b"head", src])
    src[:] = 0  # the sender may reuse its buffer at once
    views = reader.open(handle)
    assert views is not None
    got = np.frombuffer(views[1], dtype=np.uint8)
    assert bytes(views[0]) == b"head"
    assert pool.stats()["bytes_written"] == 64 + src.nbytes  # one copy; the 4-byte frame pads to 64
    # The view is the slot: a write through the sender's mapping shows through.
    seg = next(slot.seg for slot in pool._slots if slot.seg.name == handle.segment)
    seg.mm[4096 + 64] = 0xAB
    assert got[0] == 0xAB
    assert reader.open(handle) is None  # a handle is consumed once


def test_pooled_memory_is_never_reused_while_a_view_lives(pool: SlotPool, reader: SlotReader) -> None:
    payload = np.arange(MiB // 8, dtype=np.int64)
    handle = pool.write([payload])
    views = reader.open(handle)
    assert views is not None
    kept = np.frombuffer(views[0], dtype=np.int64)[10:20]  # only a small slice survives
    del views
    gc.collect()
    assert state_of(pool, handle.segment) == LEASED
    for i in range(40):  # more payloads than the pool could hold if the slot were reused
        other = pool.write([np.full(MiB // 8, -i, dtype=np.int64)])
        assert other.segment != handle.segment
        again = reader.open(other)
        assert again is not None
        del again
        gc.collect()
    np.testing.assert_array_equal(kept, np.arange(10, 20))
    created = pool.stats()["segments_created"]
    del kept
    gc.collect()
    assert state_of(pool, handle.segment) == FREE
    pool.write([payload])
    assert pool.stats()["segments_created"] == created  # reused, not grown


def test_full_pool_refuses_instead_of_reusing_leased_memory(shm_dir: str, reader: SlotReader) -> None:
    small = SlotPool(directory=shm_dir, max_bytes=2 * MiB, min_free_bytes=0, min_slot_bytes=MiB)
    try:
        held = reader.open(small.write([np.ones(MiB // 2, dtype=np.uint8)]))
        assert held is not None
        with pytest.raises(ShmSpaceError):
            small.write([np.zeros(MiB // 2, dtype=np.uint8)])
        assert bytes(held[0][:4]) == b"\x01\x01\x01\x01"
        del held
        gc.collect()
        small.write([np.zeros(MiB // 2, dtype=np.uint8)])
    finally:
        small.close()


def test_a_prepared_slot_takes_the_first_write_and_is_made_only_once(pool: SlotPool, reader: SlotReader) -> None:
    assert pool.prepare(4 * MiB) is True
    assert pool.prepare(4 * MiB) is False  # the pool holds a slot: nothing more
    (name,) = pool.segment_names()
    assert pool.stats()["slots_free"] == 1 and pool.stats()["bytes_written"] == 0
    payload = np.arange(3 * MiB // 8, dtype=np.int64)  # 3 MiB: fits the prepared slot
    handle = pool.write([payload])
    assert handle.segment == name and pool.stats()["segments_created"] == 1
    views = reader.open(handle)
    assert views is not None and np.array_equal(np.frombuffer(views[0], dtype=np.int64), payload)
    del views
    pool.close()
    with pytest.raises(ShmError):
        pool.prepare(MiB)


def test_prepare_leaves_a_pool_that_cannot_grow_as_it_is(shm_dir: str) -> None:
    small = SlotPool(directory=shm_dir, max_bytes=2 * MiB, min_free_bytes=0, min_slot_bytes=MiB)
    try:
        assert small.prepare(4 * MiB) is False  # above max_bytes: no slot, no error
        assert small.stats()["slots"] == 0
    finally:
        small.close()


def test_unconsumed_slot_expires_and_late_handle_is_stale(shm_dir: str, reader: SlotReader) -> None:
    quick = SlotPool(directory=shm_dir, min_free_bytes=0, ttl=0.05)
    try:
        handle = quick.write([b"x" * 100])
        assert quick.reap() == 0
        time.sleep(0.1)
        assert quick.reap() == 1
        assert reader.open(handle) is None
        fresh = quick.write([b"y" * 100])  # the slot is reused with a new generation
        assert fresh.segment == handle.segment and fresh.gen == handle.gen + 1
        assert reader.open(handle) is None
    finally:
        quick.close()


def test_lease_of_a_killed_receiver_is_reclaimed(pool: SlotPool, shm_dir: str) -> None:
    handle = pool.write([np.ones(MiB, dtype=np.uint8)])
    ready = SPAWN.Event()
    child = SPAWN.Process(target=workers.lease_one, args=(shm_dir, handle.pack(), ready))
    child.start()
    try:
        assert ready.wait(30)
        assert state_of(pool, handle.segment) == LEASED
        assert pool.reap() == 0  # a live holder keeps its lease
    finally:
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
    assert pool.reap() == 1
    assert state_of(pool, handle.segment) == FREE


def test_discard_frees_only_the_matching_generation(pool: SlotPool) -> None:
    handle = pool.write([b"a" * 10])
    stale = SlotHandle(handle.segment, handle.gen - 1, handle.spans)
    assert not pool.discard(stale)
    assert state_of(pool, handle.segment) == READY
    assert pool.discard(handle)
    assert state_of(pool, handle.segment) == FREE


# -- the sweep -------------------------------------------------------------------------------


def test_sweep_removes_only_dead_owners_leftovers(shm_dir: str, tmp_path: Path) -> None:
    ready = SPAWN.Event()
    child = SPAWN.Process(target=workers.make_leftovers, args=(shm_dir, "sweepme", ready))
    child.start()
    assert ready.wait(30)
    live = Segment.create(MiB, directory=shm_dir)
    me = self_owner()
    other_ns = f"zomni_{me.uid}_{me.pidns + 1}_{child.pid}_1_00112233aabbccdd"
    for foreign in ("psm_0011", "not-ours", other_ns):
        Path(shm_dir, foreign).write_bytes(b"x")
    try:
        report = sweep(shm_dir=shm_dir, spill_dir=str(tmp_path))
        assert report.removed == () and report.kept_live >= 3  # the child is alive: nothing goes
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
        dry = sweep(dry_run=True, shm_dir=shm_dir, spill_dir=str(tmp_path))
        dead_segments = {n for n in os.listdir(shm_dir) if (o := parse_name(n)) and o.pid == child.pid and o.is_local()}
        assert len(dead_segments) == 2  # inline_max_bytes=0: both puts used a slot
        assert {os.path.basename(p) for p in dry.removed} == dead_segments | {"k.left=0=1", "k.left-small=0=1"}
        assert dead_segments <= set(os.listdir(shm_dir))  # a dry run removes nothing
        report = sweep(shm_dir=shm_dir, spill_dir=str(tmp_path))
        assert sorted(report.removed) == sorted(dry.removed)
        assert report.freed_bytes >= 1 << 19
        assert report.kept_foreign >= 1
        left = sorted(os.listdir(shm_dir))
        assert left == sorted(["not-ours", "psm_0011", other_ns, live.name])
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join(30)
        live.unlink()
        live.close()


def test_sweep_expires_unconsumed_records_of_live_owners(shm_dir: str, tmp_path: Path) -> None:
    from zmq_omni.connectors.shm import SharedMemoryConnector

    with SharedMemoryConnector({"namespace": "exp", "shm_dir": shm_dir, "inline_max_bytes": 0}) as conn:
        assert conn.put("0", "1", "old", {"a": np.ones(1000)})[0]
        assert sweep(shm_dir=shm_dir, spill_dir=str(tmp_path), expire_after=3600).expired == ()
        report = sweep(shm_dir=shm_dir, spill_dir=str(tmp_path), expire_after=0)
        assert len(report.expired) == 1
        assert conn.get("0", "1", "old") is None
        assert conn.health()["pool_slots_free"] == 1  # the expired record's slot was released


def test_a_slot_pool_sweeps_nothing_the_connectors_do(shm_dir: str) -> None:
    name = workers.dead_process_segment(shm_dir)
    with SlotPool(directory=shm_dir, max_bytes=MiB, min_free_bytes=0):
        assert name in os.listdir(shm_dir)  # a pool is storage: the sweep is the connectors' choice
    sweep_dead_once(shm_dir)
    assert name not in os.listdir(shm_dir)
