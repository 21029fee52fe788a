"""ZmqConnector's same-host fast path with real processes: fidelity, zero copy, leaks, kills, full tmpfs, hosts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.shm import sweep

from ._shm_workers import dead_process_segment
from .conftest import need_privilege
from .test_shm_connector import every_dtype
from .zmq_peers import SPAWN

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20


# -- bodies of child processes (importable by spawn) -------------------------------------
def digest(arr: np.ndarray[Any, Any]) -> list[Any]:
    raw = np.ascontiguousarray(arr).view(np.uint8)
    return [arr.dtype.str, list(arr.shape), hashlib.sha256(raw).hexdigest()]


def mapped_file(address: int) -> str | None:
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) >= 6 else None
    return None


def run_receiver(config: dict[str, Any], keys: list[str], hold_s: float = 0.0, ready: Any = None) -> dict[str, Any]:
    """Get every key; report digests, where each array lives, and the connector's health.

    ``ready`` (an event), when given, is set once the receiver is bound.
    """
    result: dict[str, Any] = {}
    with ZmqConnector(config) as conn:
        if ready is not None:
            ready.set()
        held = []
        for key in keys:
            got = conn.get_with_deadline("0", config["stage_id"], key, deadline=time.monotonic() + 30)
            if got is None:
                result[key] = None
                continue
            arrays = {name: v for name, v in got[0].items() if isinstance(v, np.ndarray)}
            result[key] = {
                name: [*digest(a), mapped_file(a.__array_interface__["data"][0]), bool(a.flags.owndata)]
                for name, a in arrays.items()
            }
            if hold_s:
                held.append(got)
        if hold_s:
            time.sleep(hold_s)
        result["_health"] = {k: v for k, v in conn.health().items() if k.startswith("shm") or k == "status"}
    return result


def receiver_proc(config: dict[str, Any], keys: list[str], out: Any, hold_s: float = 0.0, ready: Any = None) -> None:
    out.put(run_receiver(config, keys, hold_s, ready))


def drain_proc(config: dict[str, Any], ready: Any) -> None:
    """Take whatever arrives, forever (to be killed) while holding every array."""
    with ZmqConnector(config) as conn:
        held = []
        i = 0
        while True:
            got = conn.get_with_deadline("0", config["stage_id"], f"k{i}", deadline=time.monotonic() + 30)
            if got is not None:
                held.append(got)
                i += 1
            if i == 20:
                ready.set()


def drain_until_end_proc(config: dict[str, Any], ready: Any, out: Any) -> None:
    """Get k0, k1, ... in order until a payload says ``end``; report how many came."""
    with ZmqConnector(config) as conn:
        ready.set()
        i = 0
        while True:
            got = conn.get_with_deadline("0", config["stage_id"], f"k{i}", deadline=time.monotonic() + 30)
            assert got is not None, f"k{i} never came"
            i += 1
            if got[0].get("end"):
                out.put(i)
                return


def stream_proc(config: dict[str, Any], n: int, ready: Any) -> None:
    """Put ``n`` payloads as fast as possible, then block (to be killed)."""
    with ZmqConnector(config) as conn:
        data = np.zeros(64 * KiB, dtype=np.uint8)
        for i in range(n):
            data[:8] = np.frombuffer(np.int64(i).tobytes(), dtype=np.uint8)
            assert conn.put("0", "1", f"k{i}", {"data": data})[0]
            if i == n // 2:
                ready.set()
        time.sleep(600)


def receive_once_proc(config: dict[str, Any], keys: list[str], ready: Any, done: Any, out: Any) -> None:
    """Get every key (digest, where it lives); once ``done`` is set, get each again (None: delivered once)."""
    with ZmqConnector(config) as conn:
        ready.set()
        result: dict[str, Any] = {}
        for key in keys:
            got = conn.get_with_deadline("0", config["stage_id"], key, deadline=time.monotonic() + 30)
            assert got is not None, f"{key} never came"
            data = got[0]["data"]
            result[key] = [*digest(data), mapped_file(data.__array_interface__["data"][0])]
            del got, data
        assert done.wait(60)
        result["_again"] = [conn.get("0", config["stage_id"], key) for key in keys]
        result["_health"] = {k: v for k, v in conn.health().items() if k.startswith(("shm", "duplicates"))}
    out.put(result)


# -- fixtures and helpers -------------------------------------------------------------------
def ours(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("zomni_"))


def configs(short_tmp: Path, shm_dir: str, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    endpoints = {"1": f"ipc://{short_tmp}/r1", "2": f"ipc://{short_tmp}/r2"}
    base = {"endpoints": endpoints, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "heartbeat_s": 0.1}
    sender = {**base, "stage_id": "0", "role": "sender", "shm": "on", **extra}
    receiver = {**base, "stage_id": "1", "role": "receiver"}
    return sender, receiver


def start(target: Any, *args: Any) -> Any:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def wait_for_verdict(sender: ZmqConnector, stage: str, timeout: float = 20) -> dict[str, Any]:
    """Poll ``health()`` until ``stage``'s receiver answered our probe; that health."""
    deadline = time.monotonic() + timeout
    health = sender.health()
    while health.get("peers", {}).get(stage, {}).get("shm") is None and time.monotonic() < deadline:
        time.sleep(0.005)
        health = sender.health()
    assert health.get("peers", {}).get(stage, {}).get("shm") is not None, health
    return health


def wait_empty(sender: ZmqConnector, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while sender.health()["pending"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sender.health()["pending"] == 0, sender.health()


# -- tests --------------------------------------------------------------------------------
def test_every_dtype_round_trips_bit_exact_and_the_source_may_be_overwritten(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = configs(short_tmp, shm_dir)
    out = SPAWN.Queue()
    proc = start(receiver_proc, rcfg, ["all", "again"], out)
    payload = every_dtype(300_000)
    expected = {name: digest(arr) for name, arr in payload.items()}
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "1", "all", payload)[0]
        for arr in payload.values():  # overwrite right after put: the receiver must still see the original
            arr.fill(0)
        assert sender.put("0", "1", "again", {"zeros": payload["f8"]})[0]
        result = out.get(timeout=60)
        wait_empty(sender)
        health = sender.health()
    proc.join(10)
    assert health["shm_puts"] == 2 and health["shm_fallbacks"] == 0
    assert {name: got[:3] for name, got in result["all"].items()} == expected
    assert result["again"]["zeros"][:3] == digest(np.zeros(300_000, dtype="f8"))
    for name in ("u1", ">f8", "bf16", "fortran", "strided"):
        mapped = result["all"][name][3]
        assert mapped is not None and Path(mapped).name.startswith("zomni_"), (name, mapped)
    assert ours(shm_dir) == []


def test_receiver_array_is_shared_memory_and_sender_wrote_it_once(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = configs(short_tmp, shm_dir)
    out = SPAWN.Queue()
    proc = start(receiver_proc, rcfg, ["big"], out)
    data = np.random.default_rng(1).standard_normal(2 * MiB)  # 16 MiB
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "1", "big", {"data": data})[0]
        written = sender.health()["shm_bytes_written"]
        result = out.get(timeout=60)
        wait_empty(sender)
    proc.join(10)
    dtype, shape, sha, mapped, owndata = result["big"]["data"]
    assert [dtype, shape, sha] == digest(data)
    assert mapped is not None and Path(mapped).parent == Path(shm_dir) and Path(mapped).name.startswith("zomni_")
    assert owndata is False
    # One copy into the slot: the payload bytes plus the codec's small header frame, nothing more.
    assert data.nbytes <= written < data.nbytes + 4 * KiB


def test_ten_thousand_transfers_leave_nothing_behind(short_tmp: Path, shm_dir: str) -> None:
    n = 10_000
    # A window of 256 puts: however slowly the receiver consumes, at most 256 slots are in use at once.
    scfg, rcfg = configs(short_tmp, shm_dir, shm_threshold=8 * KiB, max_unacked=256)
    out = SPAWN.Queue()
    keys = [f"k{i}" for i in range(n)]
    proc = start(receiver_proc, rcfg, keys, out)
    data = np.arange(4 * KiB, dtype=np.int32)  # 16 KiB, above the threshold
    with ZmqConnector(scfg) as sender:
        for i, key in enumerate(keys):
            data[0] = i
            assert sender.put("0", "1", key, {"data": data})[0]
        result = out.get(timeout=240)
        wait_empty(sender)
        health = sender.health()
        # Slots are reused: the pool only ever held what the window let be in flight (259 here), not one
        # segment per message (without the window bound, a receiver slowed by load made up to 2354).
        assert 0 < health["shm_segments_created"] <= 2 * 256, health
    proc.join(10)
    assert health["shm_puts"] == n
    assert all(result[k] is not None for k in keys)
    assert result["k9999"]["data"][:2] == ["<i4", [4096]]
    assert ours(shm_dir) == []


def test_kill_9_of_the_sender_then_sweep_leaves_nothing_and_a_new_pair_works(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = configs(short_tmp, shm_dir, shm_threshold=8 * KiB)
    ready = SPAWN.Event()
    with ZmqConnector(rcfg) as receiver:
        proc = start(stream_proc, scfg, 400, ready)
        assert ready.wait(60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        got = [receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 0.5) for i in range(3)]
        assert got[0] is not None and int(got[0][0]["data"][:8].view(np.int64)[0]) == 0
        del got
        assert ours(shm_dir)  # the dead sender's pool and probe
        report = sweep(shm_dir=shm_dir)
        assert report is not None
        assert ours(shm_dir) == []
        receiver.cleanup_prefix("k")
    # A fresh pair on the same endpoints.
    out = SPAWN.Queue()
    proc = start(receiver_proc, rcfg, ["fresh"], out)
    data = np.full(64 * KiB, 3, dtype=np.uint8)
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "1", "fresh", {"data": data})[0]
        result = out.get(timeout=60)
        wait_empty(sender)
        assert sender.health()["shm_puts"] == 1
    proc.join(10)
    assert result["fresh"]["data"][:3] == digest(data)
    assert ours(shm_dir) == []


def test_kill_9_of_the_receiver_then_reap_and_expiry_leave_nothing(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = configs(short_tmp, shm_dir, shm_threshold=8 * KiB, shm_ttl_s=2.0, delivery_timeout_s=60)
    ready = SPAWN.Event()
    proc = start(drain_proc, rcfg, ready)
    data = np.zeros(64 * KiB, dtype=np.uint8)
    with ZmqConnector(scfg) as sender:
        for i in range(40):
            data[0] = i
            assert sender.put("0", "1", f"k{i}", {"data": data})[0]
        assert ready.wait(60)
        os.kill(proc.pid, signal.SIGKILL)  # holding leases on what it got, the rest unconsumed
        proc.join(10)
        # The dead holder's leases are reclaimed by the I/O thread's reap; unopened slots expire.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            h = sender.health()
            if h["shm_slots_leased"] == 0 and h["shm_slots_ready"] == 0:
                break
            time.sleep(0.1)
        assert h["shm_slots_leased"] == 0 and h["shm_slots_ready"] == 0, h
        sweep(shm_dir=shm_dir)  # removes nothing of the live sender
        assert ours(shm_dir)
        # A fresh receiver works with the same sender.
        out = SPAWN.Queue()
        bound = SPAWN.Event()
        proc = start(receiver_proc, rcfg, ["fresh"], out, 0.0, bound)
        # Put once it is bound: a handle queued for a receiver still starting (seconds under load)
        # could outlive shm_ttl_s (2 s here) and be reclaimed before it is opened.
        assert bound.wait(60)
        data[:] = 9
        assert sender.put("0", "1", "fresh", {"data": data})[0]
        result = out.get(timeout=60)
        sender.cleanup_prefix("k")
        proc.join(10)
    assert result["fresh"]["data"][:3] == digest(data)
    assert ours(shm_dir) == []


def test_too_small_shm_falls_back_to_frames_and_health_says_so(short_tmp: Path, tiny_tmpfs: str) -> None:
    scfg, rcfg = configs(short_tmp, tiny_tmpfs)
    out = SPAWN.Queue()
    proc = start(receiver_proc, rcfg, ["a", "b", "small"], out)
    big = np.random.default_rng(3).standard_normal(MiB)  # 8 MiB: more than the whole tmpfs
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "1", "a", {"data": big})[0]
        assert sender.put("0", "1", "b", {"data": big[::2]})[0]
        health = sender.health()
        assert health["status"] == "degraded" and health["shm_fallbacks"] == 2, health
        assert any("fall back to frames" in p for p in health["shm_problems"])
        small = np.arange(512 * KiB, dtype=np.uint8)  # 512 KiB: above the threshold, and it fits
        assert sender.put("0", "1", "small", {"data": small})[0]
        result = out.get(timeout=60)
        wait_empty(sender)
        assert sender.health()["status"] == "ok"  # the next put that fitted cleared it
    proc.join(10)
    assert result["a"]["data"][:3] == digest(big) and not result["a"]["data"][3].startswith(tiny_tmpfs)
    assert result["b"]["data"][:3] == digest(np.ascontiguousarray(big[::2]))
    assert result["small"]["data"][3].startswith(tiny_tmpfs)
    assert ours(tiny_tmpfs) == []


def test_receiver_on_another_host_gets_frames_while_a_same_host_one_gets_shm(short_tmp: Path, shm_dir: str) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        need_privilege("needs unshare and root to give a receiver its own /dev/shm")
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto")
    other = {**rcfg, "stage_id": "2"}
    # "Another host": a mount namespace where shm_dir is a private, empty tmpfs.
    script = (
        "import json, sys; from tests.test_zmq_shm import run_receiver; "
        "print(json.dumps(run_receiver(json.loads(sys.argv[1]), ['x0', 'x1'])))"
    )
    remote = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs tmpfs "{shm_dir}" && exec "{sys.executable}" -c "$0" "$1"', script, json.dumps(other)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out = SPAWN.Queue()
    local = start(receiver_proc, rcfg, ["x0", "x1"], out)
    data = np.random.default_rng(4).standard_normal(128 * KiB)  # 1 MiB
    with ZmqConnector(scfg) as sender:
        deadline = time.monotonic() + 30
        peers: dict[str, Any] = {}
        while time.monotonic() < deadline:  # auto: wait until both receivers answered the probe
            for stage in ("1", "2"):
                sender._sending.sender.reads_shm(stage)
            peers = sender.health().get("peers", {})
            if all(peers.get(s, {}).get("shm") is not None for s in ("1", "2")):
                break
            time.sleep(0.05)
        assert peers["1"]["shm"] is True and peers["2"]["shm"] is False, peers
        for i in range(2):
            for stage in ("1", "2"):
                assert sender.put("0", stage, f"x{i}", {"data": data})[0]
        local_result = out.get(timeout=60)
        stdout, _ = remote.communicate(timeout=60)
        wait_empty(sender)
        assert sender.health()["shm_puts"] == 2
    local.join(10)
    remote_result = json.loads(stdout)
    for i in range(2):
        near, far = local_result[f"x{i}"]["data"], remote_result[f"x{i}"]["data"]
        assert near[:3] == far[:3] == digest(data)
        assert Path(near[3]).name.startswith("zomni_")
        assert far[3] is None or not Path(far[3]).name.startswith("zomni_")
    assert ours(shm_dir) == []


def test_a_stream_of_puts_gets_the_shm_verdict_without_waiting_for_a_heartbeat(short_tmp: Path, shm_dir: str) -> None:
    # Beats every 30 s: the verdict must come from the ping the connector sends when it first meets the
    # receiver (as it is built: role sender), although the put thread, streaming from its first put on, may
    # hold the data socket when that ping is due (the I/O thread then tries it again after 2, 4, 8 ... ms).
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto", heartbeat_s=30, peer_timeout_s=60, max_unacked=32)
    rcfg = {**rcfg, "heartbeat_s": 30, "peer_timeout_s": 60}
    out, ready = SPAWN.Queue(), SPAWN.Event()
    proc = start(drain_until_end_proc, rcfg, ready, out)
    assert ready.wait(60)
    data = np.zeros(MiB, dtype=np.uint8)
    with ZmqConnector(scfg) as sender:
        started = time.monotonic()
        i = 0
        while sender.health()["shm_puts"] == 0 and time.monotonic() - started < 10:
            assert sender.put("0", "1", f"k{i}", {"data": data})[0]
            i += 1
        learned_after = time.monotonic() - started
        for _ in range(3):  # the fast path, from now on
            assert sender.put("0", "1", f"k{i}", {"data": data})[0]
            i += 1
        assert sender.put("0", "1", f"k{i}", {"end": True})[0]
        got = out.get(timeout=60)
        wait_empty(sender)
        health = sender.health()
    proc.join(10)
    assert got == i + 1
    assert learned_after < 10 and health["shm_puts"] >= 3, (learned_after, health)
    assert ours(shm_dir) == []


def test_a_get_whose_shared_memory_payload_is_gone_returns_none_and_records_why(short_tmp: Path, shm_dir: str) -> None:
    """The sender closed (its pool unlinked) before the receiver opened the slot: None, a get failure, no leak."""
    scfg, rcfg = configs(short_tmp, shm_dir, shm_threshold=8 * KiB)
    with ZmqConnector(rcfg) as receiver:
        sender = ZmqConnector(scfg)
        try:
            generation = receiver.get_wakeup_generation()
            assert generation is not None
            assert sender.put("0", "1", "k0", {"data": np.ones(64 * KiB, np.uint8)})[0]
            assert sender.health()["shm_puts"] == 1
            assert receiver.wait_for_change(generation, timeout=30) != generation  # in the mailbox, not opened
        finally:
            sender.close()
        assert receiver.get("0", "1", "k0") is None
        failures = receiver.drain_failures()
        assert [(f.op, f.key) for f in failures] == [("get", "k0")]
        assert "shared-memory payload of 'k0'" in failures[0].reason
        assert receiver.get("0", "1", "k0") is None and receiver.drain_failures() == []  # the item is gone
    assert ours(shm_dir) == []


def test_the_first_put_after_start_goes_through_shared_memory_into_a_slot_made_before_it(
    short_tmp: Path, shm_dir: str
) -> None:
    """vllm-omni's stage 0 (role sender, no to_stage): its first large put, the chunk 0 of the first request."""
    # Beats every 30 s: the verdict can only come from the ping sent as the sender is built.
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto", heartbeat_s=30, peer_timeout_s=60)
    rcfg = {**rcfg, "heartbeat_s": 30, "peer_timeout_s": 60}
    out, ready, done = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    proc = start(receive_once_proc, rcfg, ["chunk0"], ready, done, out)
    assert ready.wait(60)
    data = np.random.default_rng(5).standard_normal(128 * KiB + 7)  # 1 MiB and a bit, as chunk 0 is
    with ZmqConnector(scfg) as sender:
        before = wait_for_verdict(sender, "1")  # learned without a put; stage 2 (never bound) is met too
        assert before["peers"]["1"]["shm"] is True and before["shm_puts"] == 0, before
        deadline = time.monotonic() + 20  # the I/O thread makes the pool's first slot after the verdict
        while sender.health()["shm_slots"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        prepared = sender.health()
        assert prepared["shm_slots_free"] == 1 and prepared["shm_bytes_written"] == 0, prepared
        assert sender.put("0", "1", "chunk0", {"data": data})[0]
        after = sender.health()
        assert sender.flush(30)
        done.set()
        result = out.get(timeout=60)
    proc.join(10)
    assert after["shm_puts"] == 1 and after["shm_fallbacks"] == 0, after
    assert after["shm_segments_created"] == 1, after  # the put took the slot made before it
    sha = result["chunk0"]
    assert sha[:3] == digest(data)
    assert sha[3] is not None and Path(sha[3]).parent == Path(shm_dir) and Path(sha[3]).name.startswith("zomni_")
    assert result["_again"] == [None]
    assert ours(shm_dir) == []


def test_a_sender_met_at_its_first_put_has_the_verdict_for_the_next_without_a_beat(
    short_tmp: Path, shm_dir: str
) -> None:
    """No role, no to_stage: the first put meets the receiver while it holds the data socket; the next one reads shm."""
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto", heartbeat_s=30, peer_timeout_s=60)
    scfg = {k: v for k, v in scfg.items() if k != "role"}
    rcfg = {**rcfg, "heartbeat_s": 30, "peer_timeout_s": 60}
    out, ready, done = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    proc = start(receive_once_proc, rcfg, ["a", "b"], ready, done, out)
    assert ready.wait(60)
    data = np.arange(MiB // 8, dtype=np.int64)
    with ZmqConnector(scfg) as sender:
        assert "1" not in sender.health().get("peers", {})  # nothing to meet before the first put
        assert sender.put("0", "1", "a", {"data": data})[0]
        health = wait_for_verdict(sender, "1")  # well before the first beat (30 s)
        assert health["peers"]["1"]["shm"] is True
        assert sender.put("0", "1", "b", {"data": data})[0]
        after = sender.health()
        assert sender.flush(30)
        done.set()
        result = out.get(timeout=60)
    proc.join(10)
    assert after["shm_puts"] >= 1, after  # "b" (and "a" too when the verdict beat it)
    assert result["a"][:3] == result["b"][:3] == digest(data)
    assert Path(result["b"][3]).name.startswith("zomni_")
    assert result["_again"] == [None, None]
    assert ours(shm_dir) == []


def test_a_receiver_that_cannot_read_our_memory_gets_the_first_puts_as_frames_once_and_nothing_leaks(
    short_tmp: Path, shm_dir: str
) -> None:
    """Another shm directory stands for another host or container: its receiver answers false."""
    other_dir = tempfile.mkdtemp(prefix="zt-other-", dir="/dev/shm")
    try:
        scfg, rcfg = configs(short_tmp, shm_dir, shm="auto", heartbeat_s=30, peer_timeout_s=60)
        rcfg = {**rcfg, "shm_dir": other_dir, "heartbeat_s": 30, "peer_timeout_s": 60}
        out, ready, done = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
        proc = start(receive_once_proc, rcfg, ["at-once", "later"], ready, done, out)
        assert ready.wait(60)
        data = np.random.default_rng(6).standard_normal(128 * KiB)  # 1 MiB
        with ZmqConnector(scfg) as sender:
            # Right after construction (the verdict may or may not be in), then once it is.
            assert sender.put("0", "1", "at-once", {"data": data})[0]
            health = wait_for_verdict(sender, "1")
            assert health["peers"]["1"]["shm"] is False
            assert sender.put("0", "1", "later", {"data": data})[0]
            assert sender.flush(30)
            after = sender.health()
            assert len(ours(shm_dir)) == 1  # the probe alone: no slot for a receiver that cannot read it
            done.set()
            result = out.get(timeout=60)
        proc.join(10)
        assert after["shm_puts"] == 0 and after["shm_fallbacks"] == 0 and after["shm_slots"] == 0, after
        assert after["status"] == "ok", after  # auto: frames to such a receiver are not a problem
        for key in ("at-once", "later"):
            assert result[key][:3] == digest(data)
            assert result[key][3] is None or not Path(result[key][3]).name.startswith("zomni_")
        assert result["_again"] == [None, None]  # each delivered exactly once
        assert ours(shm_dir) == [] and ours(other_dir) == []
    finally:
        shutil.rmtree(other_dir, ignore_errors=True)


def test_a_receiver_that_binds_after_the_sender_was_built_answers_the_ping_queued_for_it(
    short_tmp: Path, shm_dir: str
) -> None:
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto", heartbeat_s=30, peer_timeout_s=60)
    rcfg = {**rcfg, "heartbeat_s": 30, "peer_timeout_s": 60}
    data = np.arange(MiB // 4, dtype=np.int32)
    with ZmqConnector(scfg) as sender:
        assert sender.health()["peers"]["1"]["shm"] is None  # met, nobody bound there yet
        out, ready, done = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
        proc = start(receive_once_proc, rcfg, ["first"], ready, done, out)
        assert ready.wait(60)
        assert wait_for_verdict(sender, "1")["peers"]["1"]["shm"] is True  # long before the first beat (30 s)
        assert sender.put("0", "1", "first", {"data": data})[0]
        after = sender.health()
        assert sender.flush(30)
        done.set()
        result = out.get(timeout=60)
    proc.join(10)
    assert after["shm_puts"] == 1, after
    assert result["first"][:3] == digest(data) and Path(result["first"][3]).name.startswith("zomni_")
    assert result["_again"] == [None]
    assert ours(shm_dir) == []


def test_shm_on_health_counts_only_the_receivers_we_put_to(short_tmp: Path, shm_dir: str) -> None:
    """A role-sender meets every stage of ``endpoints``; one on another host that it never puts to is no problem."""
    other_dir = tempfile.mkdtemp(prefix="zt-other-", dir="/dev/shm")  # stands for another host or container
    scfg, rcfg = configs(short_tmp, shm_dir, shm="on")
    try:
        with (
            ZmqConnector(rcfg) as near,
            ZmqConnector({**rcfg, "stage_id": "2", "shm_dir": other_dir}) as far,
            ZmqConnector(scfg) as sender,
        ):
            wait_for_verdict(sender, "1")
            met = wait_for_verdict(sender, "2")
            assert met["peers"]["1"]["shm"] is True and met["peers"]["2"]["shm"] is False, met
            data = np.arange(MiB // 8, dtype=np.int64)
            assert sender.put("0", "1", "k", {"data": data})[0]
            got = near.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 30)
            assert got is not None and digest(got[0]["data"]) == digest(data)
            del got
            health = sender.health()
            assert health["shm_puts"] == 1 and health["status"] == "ok", health  # stage 2 was met, never put to
            assert health["peers"]["2"]["puts"] == 0 and health["peers"]["1"]["puts"] == 1, health
            # The same receiver, once put to, is what shm: on reports.
            assert sender.put("0", "2", "k", {"data": data})[0]
            assert far.get_with_deadline("0", "2", "k", deadline=time.monotonic() + 30) is not None
            health = sender.health()
            assert health["status"] == "degraded", health
            assert health["reasons"] == ["receivers of stages ['2'] cannot read our shared memory"], health
    finally:
        shutil.rmtree(other_dir, ignore_errors=True)


def test_a_stage_whose_socket_zeromq_refuses_is_not_met_and_stops_no_beat(
    short_tmp: Path, shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``tcp://127.0.0.1:*`` passes the endpoint check, but ZeroMQ cannot connect to it (EINVAL)."""
    endpoints = {"0": "tcp://127.0.0.1:*", "1": f"ipc://{short_tmp}/r1", "2": f"ipc://{short_tmp}/r2"}
    base = {"endpoints": endpoints, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "heartbeat_s": 0.05}
    with (
        caplog.at_level(logging.DEBUG, logger="zmq_omni"),
        ZmqConnector({**base, "stage_id": "2", "role": "receiver"}),
        ZmqConnector({**base, "stage_id": "1", "role": "dual"}) as middle,
    ):
        health = wait_for_verdict(middle, "2")
        assert set(health["peers"]) == {"2"}, health  # stage 0 not met: no socket can be made to it
        assert pings_reach(middle, "2", 5)
        assert health["status"] == "ok", health
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_peer_whose_socket_fails_stops_neither_the_beat_nor_the_ack_requests_of_the_others(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A put to a stage ZeroMQ cannot connect to leaves that peer behind; the ones after it are still pinged."""
    endpoints = {"0": "tcp://127.0.0.1:*", "2": f"ipc://{short_tmp}/r2"}
    base = {"endpoints": endpoints, "shm": "off", "heartbeat_s": 0.05, "peer_timeout_s": 0.5}
    with (
        caplog.at_level(logging.DEBUG, logger="zmq_omni"),
        ZmqConnector({**base, "stage_id": "2", "role": "receiver"}) as receiver,
        ZmqConnector({**base, "stage_id": "1", "role": "sender"}) as sender,
    ):
        assert not sender.put("1", "0", "lost", {"v": 0})[0]  # its peer is made first, its socket fails
        assert sender.put("1", "2", "k", {"v": 1})[0]
        assert receiver.get_with_deadline("1", "2", "k", deadline=time.monotonic() + 30) is not None
        assert pings_reach(sender, "2", 5)  # each beat reaches stage 2, after the failing stage 0
        assert sender.flush(30)  # its ack requests ping stage 0 first, then stage 2, and go on until done
        core = sender._sending.sender._core
        deadline = time.monotonic() + 30
        while core.acks_wanted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not core.acks_wanted  # the request chain ended; a later full window starts another
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    about = [r for r in caplog.records if "127.0.0.1:*" in r.getMessage()]
    warned = [r.getMessage() for r in about if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once for that peer (its control socket or its PING), not at every beat
    debug = [r for r in about if r.levelno == logging.DEBUG]
    assert len(debug) >= 5, len(debug)  # the later beats' retries


def pings_reach(sender: ZmqConnector, stage: str, count: int, timeout: float = 30) -> bool:
    """Wait until ``sender`` sent ``count`` PINGs to ``stage``'s receiver (the I/O thread's beats)."""
    peers = sender._sending.sender._core.peers
    deadline = time.monotonic() + timeout
    while peers[stage].ping_no < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(peers[stage].ping_no >= count)


def test_the_first_slot_is_made_once_our_puts_arrived_though_unconsumed(short_tmp: Path, shm_dir: str) -> None:
    """A put on its way holds the slot back; one that arrived and waits in the receiver's mailbox does not."""
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto")
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "1", "waits", {"v": 1})[0]  # queued for a receiver not bound yet
        with ZmqConnector(rcfg) as receiver:
            assert wait_for_verdict(sender, "1")["peers"]["1"]["shm"] is True
            deadline = time.monotonic() + 30
            while sender.health()["shm_slots"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            health = sender.health()
            assert health["shm_slots"] == 1 and health["pending"] == 1, health  # made while "waits" is unconsumed
            assert receiver.health()["mailbox"] == 1
            got = receiver.get("0", "1", "waits")
            assert got is not None and got[0] == {"v": 1}


def test_the_first_slot_waits_for_a_put_on_its_way_a_bounded_number_of_times(short_tmp: Path, shm_dir: str) -> None:
    """A put to a stage nobody serves stays on its way: the slot is left to the first large put, and the looks stop."""
    scfg, rcfg = configs(short_tmp, shm_dir, shm="auto", delivery_timeout_s=120)
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "2", "stuck", {"v": 1})[0]  # stage 2 is never bound
        with ZmqConnector(rcfg):
            assert wait_for_verdict(sender, "1")["peers"]["1"]["shm"] is True
            io = sender._sending.sender._io
            deadline = time.monotonic() + 60
            while io._preparing and time.monotonic() < deadline:
                time.sleep(0.05)
            health = sender.health()
            assert not io._preparing and health["shm_slots"] == 0, health
            assert health["peers"]["2"]["pending"] == 1, health  # still on its way: the chain gave up, not the put


def test_a_connector_that_starts_sweeps_what_killed_processes_left(short_tmp: Path, shm_dir: str) -> None:
    name = dead_process_segment(shm_dir)
    scfg, _ = configs(short_tmp, shm_dir)
    with ZmqConnector(scfg):
        assert name not in os.listdir(shm_dir)
