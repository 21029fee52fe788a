"""An event loop driving a receiver, busy processes beside it: its stalls with a 10-million-frame message, and without.

Run: ``python benchmarks/loop_stall.py [--busy 10] [--rounds 5] [--frames 10000000]``
(about 25 s a round pair on 2 cores).

An ``AsyncConnector`` receiver (push mode, ``ipc://``, ``shm: off``) takes every put of a
real sender (a ``ZmqConnector`` in a process of its own, a put every 5 ms, ``--puts`` of
them) with ``get``, while a ticker task on the same loop sleeps 5 ms at a time and keeps
each gap between its wake-ups less the time the loop's thread waited for a CPU
(``/proc/thread-self/schedstat``): what the loop stalled. ``--busy`` processes spin
beside it the whole run. The rounds alternate: an ``attack`` round has a raw ZMTP writer
(a process of its own, no ZeroMQ) send one message of ``--frames`` empty frames 0.5 s into
the stream (the receiver rebinds, and 1 s later hands the message's memory back to the
OS); a ``none`` round runs the same processes and stream, the writer sending nothing. The
table gives, per kind of round, the rounds, the worst stall, the median of each round's
worst, the p99 of every tick, put->get p50/p99, the rebinds and trims seen, and failed puts.
The same stalls in both kinds, at a load, are the machine's, not the peer's.
``--sample`` also prints, for each round's worst tick, the loop's and every other
thread's state while it lasted (``/proc/<pid>/task`` read every millisecond by a process
of its own, at real-time priority where allowed; the loop thread's kernel stack as root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
_PACE_S = 0.005
PIPE = asyncio.subprocess.PIPE


def attacker(path: str, frames: int) -> None:
    """Wait for a line: ``go`` sends one message of ``frames`` empty frames to the ipc ``path``; else nothing."""
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    wire = b"\x01\x00" * (frames - 1) + b"\x00\x00"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.sendall(_GREETING + b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY)
        conn.recv(64)
        conn.sendall(wire)
        conn.settimeout(5.0)  # held until the receiver closes it: closed earlier, libzmq drops the message
        end = time.monotonic() + 5.0
        try:
            while time.monotonic() < end and conn.recv(65536):
                pass
        except OSError:
            pass


def sender(endpoint: str, n: int) -> None:
    """Put ``{"i": i, "t": stamp}`` under ``k0..`` every 5 ms (the line ``go`` on stdin starts it); JSON on stdout."""
    from zmq_omni.connectors.zmq import ZmqConnector

    failed = []
    with ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}, "shm": "off"}) as conn:
        print("ready", flush=True)
        sys.stdin.readline()
        for i in range(n):
            start = time.monotonic()
            if not conn.put("0", "1", f"k{i}", {"i": i, "t": start})[0]:
                failed.append(i)
            time.sleep(max(0.0, _PACE_S - (time.monotonic() - start)))
        failures = conn.health()["delivery_failures"] + len(conn.drain_failures())
    print(json.dumps({"failed": len(failed) + failures}), flush=True)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def _runqueue_wait_s() -> float:
    with open("/proc/thread-self/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9


def sample(pid: int, out: str) -> None:
    """Every millisecond, each thread of ``pid``: state and wait channel (and the loop thread's kernel stack
    when it waits on anything but ``epoll``), one line each to ``out``; real-time priority where allowed."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    with open(out, "w") as log:
        while os.path.exists(f"/proc/{pid}"):
            now = time.monotonic()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                break
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                        name, rest = stat.read().rsplit(")", 1)
                    with open(f"/proc/{pid}/task/{tid}/wchan") as wchan:
                        chan = wchan.read() or "-"
                    state, where = rest.split()[0], ""
                    if int(tid) == pid and state != "R" and "epoll" not in chan:
                        with open(f"/proc/{pid}/task/{tid}/stack") as stack:
                            where = ">".join(line.split()[1].split("+")[0] for line in stack.read().splitlines()[:6])
                except (OSError, IndexError):
                    continue
                label = "loop" if int(tid) == pid else name.split("(", 1)[1].replace(" ", "_")
                log.write(f"{now:.4f} {label} {state} {chan} {where}\n")
            log.flush()
            time.sleep(0.001)


class Sampler:
    """:func:`sample` on this process, in a process of its own (it needs no lock this process holds)."""

    def __init__(self) -> None:
        self.path = tempfile.mktemp(prefix="stall-samples")
        self.proc: Any = None

    async def start(self) -> None:
        here = [sys.executable, str(Path(__file__).resolve())]
        self.proc = await asyncio.create_subprocess_exec(*here, "--sampler", str(os.getpid()), self.path)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def during(self, start: float, end: float) -> str:
        """Each thread's states over ``[start, end]``, counted: ``name R x12 S:futex_wait x3 ...``."""
        counts: dict[str, dict[str, int]] = {}
        try:
            with open(self.path) as log:
                for line in log:
                    parts = line.split()
                    if len(parts) < 4 or not start <= float(parts[0]) <= end:
                        continue
                    key = parts[2] if parts[2] == "R" else f"{parts[2]}:{parts[3]}"
                    if len(parts) > 4:
                        key += f"[{parts[4]}]"
                    counts.setdefault(parts[1], {}).setdefault(key, 0)
                    counts[parts[1]][key] += 1
        except OSError:
            return ""
        return "; ".join(f"{n} " + " ".join(f"{k} x{v}" for k, v in c.items()) for n, c in sorted(counts.items()))


async def one_round(conn: Any, path: str, kind: str, args: argparse.Namespace, sampler: Sampler | None) -> dict:
    from zmq_omni.transport._router import trims

    here = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Both started (their imports done) before the ticker: a spawn makes the loop wait for the child's exec.
    attack = await asyncio.create_subprocess_exec(
        *here, "--attacker", path, str(args.frames), stdin=PIPE, stdout=PIPE, env=env
    )
    send = await asyncio.create_subprocess_exec(
        *here, "--sender", f"ipc://{path}", str(args.puts), stdin=PIPE, stdout=PIPE, env=env
    )
    assert attack.stdin and attack.stdout and send.stdin and send.stdout
    for proc in (attack, send):
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"ready\n"  # type: ignore[union-attr]
    rebinds, trims_before = conn.health()["rebinds"], trims()
    gaps: list[tuple[float, float]] = []  # (stall, when it ended)
    stop = asyncio.Event()

    async def tick() -> None:
        last, queued = time.monotonic(), _runqueue_wait_s()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now, queued_now = time.monotonic(), _runqueue_wait_s()
            gaps.append((now - last - (queued_now - queued), now))
            last, queued = now, queued_now

    gc.collect()
    gc.freeze()
    ticker = asyncio.get_running_loop().create_task(tick())
    send.stdin.write(b"go\n")
    await send.stdin.drain()
    took: list[float] = []
    attacked, rebound = 0.0, 0.0
    for i in range(args.puts):
        got = await conn.get("0", "1", f"k{i}", timeout=30)
        if got is None:
            break
        took.append(time.monotonic() - got[0]["t"])
        if attacked and not rebound and conn.health()["rebinds"] > rebinds:
            rebound = time.monotonic()
        if i == 100:  # 0.5 s in
            attack.stdin.write(b"go\n" if kind == "attack" else b"none\n")
            await attack.stdin.drain()
            attacked = time.monotonic()
    if not attacked:
        attack.stdin.write(b"none\n")
    out, _ = await asyncio.wait_for(send.communicate(), 60)
    await asyncio.wait_for(attack.communicate(), 60)
    stop.set()
    await ticker
    gc.unfreeze()
    worst, worst_at = max(gaps)
    where = sampler.during(worst_at - worst, worst_at) if sampler else ""
    trimmed = [(a - attacked, b - attacked) for a, b in _TRIMS if a > attacked]
    del _TRIMS[:]
    return {
        "stalls": [g for g, _ in gaps],
        "worst": worst,
        "when": (worst_at - attacked, rebound - attacked if rebound else None, trimmed),
        "where": where,
        "took": took,
        "missed": args.puts - len(took),
        "failed": json.loads(out)["failed"] if out else -1,
        "rebinds": conn.health()["rebinds"] - rebinds,
        "trims": trims() - trims_before,
    }


_TRIMS: list[tuple[float, float]] = []  # when each hand-back of the heap ran (its start and end)


def _time_trims() -> None:
    """Keep when each hand-back ran: the receiver's trim thread calls ``_router.trim_malloc_in_steps``."""
    from zmq_omni.transport import _router

    trim = _router.trim_malloc_in_steps

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        trim(*args, **kwargs)
        _TRIMS.append((start, time.monotonic()))

    _router.trim_malloc_in_steps = timed


async def rounds(args: argparse.Namespace) -> dict[str, list[dict]]:
    from zmq_omni.aio import AsyncConnector

    _time_trims()

    results: dict[str, list[dict]] = {"attack": [], "none": []}
    sampler = Sampler() if args.sample else None
    with tempfile.TemporaryDirectory(prefix="stall") as tmp:
        path = f"{tmp}/edge.sock"
        spec = {
            "name": "ZmqConnector",
            "extra": {"stage_id": "1", "role": "receiver", "endpoints": {"1": f"ipc://{path}"}},
        }
        async with AsyncConnector.create({**spec, "extra": {**spec["extra"], "shm": "off"}}) as conn:
            if sampler:
                await sampler.start()
            for r in range(args.rounds):
                for kind in ("attack", "none") if r % 2 == 0 else ("none", "attack"):
                    row = await one_round(conn, path, kind, args, sampler)
                    results[kind].append(row)
                    print(
                        f"round {r} {kind:<6} worst {row['worst'] * 1000:6.1f} ms, rebinds {row['rebinds']}, trims "
                        f"{row['trims']}, missed {row['missed']}, failed {row['failed']}; "
                        f"load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                    at, rebound, trimmed = row["when"]
                    print(f"  worst ended {at:+.2f} s from the attack; rebind seen {rebound}; trims {trimmed}")
                    if row["where"]:
                        print(f"  during the worst: {row['where']}", flush=True)
            if sampler:
                sampler.stop()
    return results


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=10, help="spinning processes beside the loop")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each kind")
    parser.add_argument("--frames", type=int, default=10_000_000)
    parser.add_argument("--puts", type=int, default=1600, help="puts a round (one every 5 ms)")
    parser.add_argument("--sample", action="store_true", help="the threads' states during each round's worst")
    parser.add_argument("--attacker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--sender", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--sampler", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attacker:
        attacker(args.attacker[0], int(args.attacker[1]))
        return
    if args.sender:
        sender(args.sender[0], int(args.sender[1]))
        return
    if args.sampler:
        sample(int(args.sampler[0]), args.sampler[1])
        return
    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    hogs = [spawn.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for hog in hogs:
        hog.start()
    try:
        results = asyncio.run(rounds(args))
    finally:
        stop.set()
        for hog in hogs:
            hog.join(5)
    print(f"\n{args.busy} busy processes, {args.frames:,} frames, {args.puts} puts a round; load {os.getloadavg()}")
    print(
        f"{'rounds':<8} {'n':>3} {'worst ms':>9} {'median worst':>13} {'p99 tick ms':>12} {'put->get p50/p99 ms':>20}"
    )
    for kind, rows in results.items():
        stalls = [s for row in rows for s in row["stalls"]]
        took = [t for row in rows for t in row["took"]]
        worst = [row["worst"] for row in rows]
        print(
            f"{kind:<8} {len(rows):>3} {max(worst) * 1000:>9.1f} {statistics.median(worst) * 1000:>13.1f} "
            f"{_p(stalls, 0.99) * 1000:>12.1f} {_p(took, 0.5) * 1000:>9.2f}/{_p(took, 0.99) * 1000:.1f}"
            f"   rebinds {sum(r['rebinds'] for r in rows)}, trims {sum(r['trims'] for r in rows)}, "
            f"missed {sum(r['missed'] for r in rows)}, failed {sum(r['failed'] for r in rows)}"
        )


if __name__ == "__main__":
    main()
