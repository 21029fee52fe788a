"""A push receiver under one message of ten million frames: it binds anew, and a real stream loses nothing.

Live sockets over ipc, plaintext: a raw ZMTP writer (no ZeroMQ, from
:mod:`tests.test_pull_bounds`) sends one DATA-sized message of 10,000,000 empty
frames while a real sender puts every 5 ms and a get takes each put. The
receiver closes its ROUTER past ``max_frames`` and binds a new one on the same
endpoint; the sender reconnects and resends what no REPLY acknowledged. Each
test prints put->get p50/p99 before and during the attack (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.contention import Ticker, _runqueue_wait_s
from tests.test_pull_bounds import ROOT, p50_p99, rss_mb, zmtp_flood
from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import _router
from zmq_omni.transport._router import trim_malloc, trim_malloc_in_steps, trim_malloc_later, trims
from zmq_omni.transport._sockets import tune_malloc

from .conftest import wait_until

_FRAMES = 10_000_000
PIPE = asyncio.subprocess.PIPE
_PACE_S = 0.005


def _stream(
    put: Callable[[str, Any], bool], get: Callable[[str], Any], tag: str, done: Callable[[int], bool]
) -> list[float]:
    """Put a fresh key every 5 ms and get it, until ``done(rounds)``; each round's put->get seconds."""
    took: list[float] = []
    while not done(len(took)):
        key = f"{tag}-{len(took)}"
        start = time.perf_counter()
        assert put(key, {"i": len(took)}), key
        got = get(key)
        took.append(time.perf_counter() - start)
        assert got is not None and got[0] == {"i": len(took) - 1}, (key, got)
        time.sleep(max(0.0, _PACE_S - (time.perf_counter() - start)))
    return took


class _Ticker(Ticker):
    """:class:`Ticker` that also keeps when its longest gap ended (``time.monotonic()``), for the failure message."""

    worst_at = 0.0

    def __enter__(self) -> _Ticker:
        super().__enter__()
        return self

    async def _run(self) -> None:
        last, queued = time.monotonic(), _runqueue_wait_s()
        while True:
            await asyncio.sleep(0.005)
            now, queued_now = time.monotonic(), _runqueue_wait_s()
            self.worst_wall = max(self.worst_wall, now - last)
            if now - last - (queued_now - queued) > self.worst:
                self.worst, self.worst_at = now - last - (queued_now - queued), now
            last, queued = now, queued_now


def test_a_message_of_ten_million_frames_rebinds_the_receiver_and_no_put_is_lost(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/edge.sock"
    common = {"endpoints": {"1": endpoint}, "shm": "off"}
    with (
        ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as rconn,
        ZmqConnector({"stage_id": "0", "role": "sender", **common}) as sconn,
    ):

        def put(key: str, obj: Any) -> bool:
            ok: bool = sconn.put("0", "1", key, obj)[0]
            return ok

        def get(key: str) -> Any:
            return rconn.get_with_deadline("0", "1", key, deadline=time.monotonic() + 20)

        assert put("warm", 0) and get("warm") is not None
        trim_malloc()
        start_rss = rss_mb()
        before = _stream(put, get, "before", lambda n: n == 100)
        flood = threading.Thread(target=zmtp_flood, args=(endpoint[len("ipc://") :], _FRAMES), daemon=True)
        flood.start()
        rebound_at: list[float] = []

        def done(_: int) -> bool:
            if not rebound_at and rconn.health()["rebinds"]:
                rebound_at.append(time.monotonic())
            return bool(rebound_at) and time.monotonic() > rebound_at[0] + 2.0

        during = _stream(put, get, "during", done)
        flood.join(timeout=30)
        health = rconn.health()
        print(f"\nput->get before: {p50_p99(before)}; beside a {_FRAMES:,}-frame message: {p50_p99(during)}")
        assert health["rebinds"] == 1
        assert sconn.health()["delivery_failures"] == 0
        assert sconn.drain_failures() == []
        assert wait_until(lambda: rss_mb() - start_rss < 100, timeout=10), (start_rss, rss_mb())


_SENDER = """
import json, sys, time
from zmq_omni.connectors.zmq import ZmqConnector
n, failed = int(sys.argv[2]), []
with ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": sys.argv[1]}, "shm": "off"}) as conn:
    for i in range(n):
        start = time.monotonic()
        if not conn.put("0", "1", f"k{i}", {"i": i, "t": start})[0]:
            failed.append(i)
        time.sleep(max(0.0, 0.005 - (time.monotonic() - start)))
    health = conn.health()
print(json.dumps({"failed": failed, "delivery_failures": health["delivery_failures"],
                  "unconfirmed": [f.key for f in conn.drain_failures()]}))
"""


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_event_loop_receiver_never_stalls_beside_ten_million_frames(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/loop.sock"
    spec: dict[str, Any] = {
        "name": "ZmqConnector",
        "extra": {"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}},
    }
    n, attack_at = 1500, 100  # puts every 5 ms: the attack starts after the 100th, the stream runs ~7 s
    # The sender and the attacker in processes of their own, as they are, started before the ticker: a spawn
    # waits for the child's exec (under load, 100 ms and more), a wait of the test's, not of the receiver's.
    attack = (
        "import sys\n"
        "from tests.test_pull_bounds import zmtp_flood\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"  # the test's word to begin
        f"zmtp_flood(sys.argv[1][len('ipc://'):], {_FRAMES})\n"
    )
    async with AsyncConnector.create({**spec, "extra": {**spec["extra"], "shm": "off"}}) as conn:
        trim_malloc()
        start_rss = rss_mb()
        took: list[float] = []
        rebound_at, attacked_at = 0.0, 0.0
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, "-c", attack, endpoint, cwd=ROOT, stdin=PIPE, stdout=PIPE
        )
        assert attacker.stdin is not None and attacker.stdout is not None
        assert await asyncio.wait_for(attacker.stdout.readline(), 60) == b"ready\n"  # its imports done
        sender = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SENDER, endpoint, str(n), cwd=ROOT, stdout=PIPE
        )
        with _Ticker() as ticker:
            for i in range(n):
                got = await conn.get("0", "1", f"k{i}", timeout=20)
                assert got is not None and got[0]["i"] == i, (i, got)
                took.append(time.monotonic() - got[0]["t"])
                if attacked_at and not rebound_at and conn.health()["rebinds"]:
                    rebound_at = time.monotonic()
                if i == attack_at:
                    attacked_at = time.monotonic()
                    attacker.stdin.write(b"go\n")
                    await attacker.stdin.drain()
            out, _ = await asyncio.wait_for(sender.communicate(), 60)
            assert await asyncio.wait_for(attacker.wait(), 60) == 0
        health = conn.health()
        for _ in range(100):  # the dropped message's pages go back to the OS (1 s after the rebind)
            if rss_mb() - start_rss < 100:
                break
            await asyncio.sleep(0.1)
    sent = json.loads(out)
    before, during = took[:attack_at], took[attack_at:]
    print(
        f"\nput->get before: {p50_p99(before)}; beside a {_FRAMES:,}-frame message: {p50_p99(during)}; "
        f"loop's worst stall {ticker.worst * 1000:.0f} ms ({ticker.worst_at - attacked_at:+.2f} s from the attack, "
        f"{ticker.worst_at - rebound_at:+.2f} s from the rebind "
        f"seen); RSS {start_rss:.0f} -> {rss_mb():.0f} MB"
    )
    assert health["rebinds"] == 1
    assert sent == {"failed": [], "delivery_failures": 0, "unconfirmed": []}, sent
    # The reads of a loop's turn share 10 ms (a ticker's wake-up waits up to three turns: ~30 ms). The C heap's
    # ~640 MB go back to the OS on a thread of its own 1 s after the rebind, in steps that hold the heap's lock
    # (the loop's thread allocates from it) a few ms each.
    assert ticker.worst < 0.1, (
        f"the loop stalled {ticker.worst * 1000:.0f} ms ({ticker.worst_wall * 1000:.0f} by the clock), ending "
        f"{ticker.worst_at - attacked_at:.2f} s after the attack began, {ticker.worst_at - rebound_at:.2f} s after "
        "the rebind was seen"
    )
    assert rss_mb() - start_rss < 100


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _fill(libc: Any, n: int, size: int) -> list[int]:
    """``n`` blocks of ``size`` bytes, every page touched."""
    blocks = [libc.malloc(size) for _ in range(n)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    return blocks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_heap_goes_back_a_slice_at_a_time() -> None:
    libc = _libc()
    trim_malloc()
    start = rss_mb()
    blocks = _fill(libc, 16 << 10, 16 << 10)  # 256 MB in 16 KB blocks, as libzmq's pipes hold it
    assert rss_mb() - start > 200
    for block in reversed(blocks):
        libc.free(block)
    trim_malloc_in_steps(32 << 20, 0.0)
    assert rss_mb() - start < 50, (start, rss_mb())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_free_memory_below_a_live_block_goes_back_without_one_long_trim() -> None:
    if not tune_malloc():  # the heap the connectors run on: one arena, no mmap'd blocks
        pytest.skip("glibc's malloc not tuned")
    libc = _libc()
    trim_malloc()
    start = rss_mb()
    blocks = _fill(libc, 16 << 10, 16 << 10)  # 256 MB, then a live block above them
    live = _fill(libc, 1, 1 << 20)
    for block in blocks:
        libc.free(block)
    assert rss_mb() - start > 200  # freed below a live block: the heap keeps the pages
    _router._hand_back_free(_router._load_libc(), 0.0)  # the steps alone, no malloc_trim
    try:
        assert rss_mb() - start < 50, (start, rss_mb())
        blocks = _fill(libc, 1 << 10, 16 << 10)  # the heap serves the handed-back memory again
        assert rss_mb() - start > 10
    finally:
        for block in blocks + live:
            libc.free(block)
        trim_malloc()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_hand_back_keeps_the_heaps_address_range_for_the_next_message() -> None:
    if not tune_malloc():
        pytest.skip("glibc's malloc not tuned")
    libc = _libc()
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_ssize_t]
    trim_malloc()
    start = rss_mb()
    blocks = _fill(libc, 16 << 10, 16 << 10)  # 256 MB at the heap's top
    for block in blocks:
        libc.free(block)
    blocks, end = [], libc.sbrk(0)
    trim_malloc_in_steps(32 << 20, 0.0)
    try:
        assert rss_mb() - start < 50, (start, rss_mb())  # the pages went back
        assert libc.sbrk(0) >= end  # not the address range: no sbrk shrank the heap
        end = libc.sbrk(0)
        blocks = _fill(libc, 16 << 10, 16 << 10)  # the next message's memory: the same range, the heap not grown
        assert libc.sbrk(0) - end < 1 << 20
    finally:
        for block in blocks:
            libc.free(block)
        trim_malloc()


def test_a_burst_of_trims_makes_one() -> None:
    assert wait_until(lambda: _router._trimmer is None, timeout=20)  # an earlier test's trim is over
    before = trims()
    for _ in range(5):  # five rebinds in a burst
        trim_malloc_later(1.0)
    assert wait_until(lambda: trims() == before + 1, timeout=20)
    time.sleep(1.5)
    assert trims() == before + 1
