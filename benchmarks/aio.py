"""The asyncio path (zmq_omni.aio) beside the threaded one, measured in one run.

Run: ``python benchmarks/aio.py`` (about a minute on 2 cores; ``--quick`` for less, ``--only rtt``
for the round trip alone).

Two processes, each with two ``ZmqConnector`` (push mode, ``role: dual``, ``ipc://``):
a threaded one (its I/O thread drives its sockets) and one built by
``AsyncConnector.create`` (its event loop drives its sockets; no I/O thread).

* **lone-message RTT** -- one message in flight: A puts ``k``, B gets it and
  puts it back, A gets it. Threaded: both ends call ``put`` and
  ``get_with_deadline`` (a condition wait) on the threaded connector. Async:
  both ends run ``await conn.put`` / ``await conn.get`` on the loop-driven
  connector (asyncio, and uvloop when installed). Median and p99 of the round
  trips, in microseconds. Both paths run in the same two processes, in blocks
  of 50 round trips that alternate; the threaded blocks call their connector
  from the loop's thread while nothing else runs on the loop (the loop-driven
  connector is idle then). On this kind of machine a round
  trip's time depends much on where the scheduler put the threads of both
  processes (threaded rounds in separate process pairs ranged 143-219 us); in
  one pair, both paths see the same placement, and "vs threaded" is the median
  over blocks of (an async block's median / the threaded block before it's).
* **many in flight** -- A puts N messages of 200 bytes as fast as it can; B
  takes them all. Threaded: B's one receive thread takes the keys in order with
  ``get_with_deadline`` (what an adapter's receive worker does). Async, in
  order: one task awaits each key in turn. Async, all waiting: B starts N get
  tasks first, then A puts (the pattern the asyncio face is for; threaded, it
  would take N threads). B's async receivers are loop-driven; A puts from a
  plain thread on threaded connectors in every mode. Messages per second from A's first put to B's last get.
  As for the round trip, the three receivers run in the same two processes (a
  pair per loop kind, one connector per receiver at each end), in turn within
  each round, and "threaded/this" is the median over rounds of this round's
  threaded rate over this one's: separate process pairs differed by more than
  the gap being judged.

For scale, the same lone round trip over raw pyzmq (PAIR sockets, ``ipc://``,
the 200 bytes as one frame) with blocking ``recv`` on both ends, and on an
event loop at both ends (each loop kind), done with the least a loop needs
(``ZMQ_FD`` registered once, its callback reads the frame and resolves the
awaited future): what the event loop itself adds to a round trip, with no
connector at all. The last lines set the two side by side: how much the loop
adds to a raw round trip, and how much the async path adds to ours. For the
all-waiting rate, the same kind of floor: what the loop alone takes to wake N
tasks that each await a future (resolved 64 at a time from callbacks, no
connector, no socket), set beside what waiting costs us per message more than
the threaded receive.

Round-trip rounds interleave the paths (each loop's pair of processes, the raw
rows; the order rotated every round so that none always runs first) so that a
change in the machine's load hits them alike; the rates follow, one pair of
processes per loop kind running every round (the receivers' order rotated every
round). RTT: the median and p99 of every round trip of a path, and "vs threaded"
(above; for the raw rows, the median over rounds of this round's median / raw
blocking's). Rates: the median of the rounds, and "threaded/this" (above). The
load average and the CPU count are printed before and after (the figures mean
little without them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any

SMALL = 200
BLOCK = 50  # lone round trips per block; the threaded and async blocks alternate in one pair of processes


def config(stage: str, endpoints: dict[str, str]) -> dict[str, Any]:
    return {"stage_id": stage, "role": "dual", "endpoints": endpoints, "max_unacked": 100_000}


def path_config(stage: str, endpoints: dict[str, str], *, awaited: bool) -> dict[str, Any]:
    """One path's connector at ``stage``: the threaded path's on endpoints a and b, the awaited one's on a2 and b2."""
    suffix = "2" if awaited else ""
    return config(stage, {"a": endpoints["a" + suffix], "b": endpoints["b" + suffix]})


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


# -- the peer (B) ----------------------------------------------------------------------------


def child(mode: str, endpoints: dict[str, str], n: int, loop_kind: str) -> None:
    if mode.startswith("raw-"):
        raw_echo(mode, endpoints["b"], n, loop_kind)
    elif mode == "echo-mixed":
        echo_mixed(endpoints, n, loop_kind)
    else:
        drain_mixed(endpoints, n, loop_kind)


def echo_mixed(endpoints: dict[str, str], n: int, loop_kind: str) -> None:
    """B of the lone round trip: ``n`` blocks of ``BLOCK`` echoes, threaded and async in turn (see the module doc)."""
    from zmq_omni.aio import AsyncConnector
    from zmq_omni.connectors.zmq import ZmqConnector

    threaded = ZmqConnector(path_config("b", endpoints, awaited=False))
    loop = new_loop(loop_kind)
    # Driven by ``loop`` from its first await: no I/O thread.
    awaited = AsyncConnector.create(spec(path_config("b", endpoints, awaited=True)))
    print("ready", flush=True)
    sys.stdin.readline()

    async def main() -> None:
        async with awaited as conn:
            for block in range(2 * n // BLOCK):
                for i in range(block * BLOCK, (block + 1) * BLOCK):
                    if block % 2 == 0:
                        got = threaded.get_with_deadline("a", "b", f"p{i}", deadline=time.monotonic() + 30)
                        assert got is not None
                        threaded.put("b", "a", f"q{i}", got[0])
                    else:
                        got = await conn.get("a", "b", f"p{i}", timeout=30)
                        assert got is not None
                        await conn.put("b", "a", f"q{i}", got[0])
            await conn.flush(30)

    run_and_close(loop, main, threaded)
    sys.stdin.readline()


RATE_MODES = ("thread", "seq", "all")  # one receive thread; one task in order; every get waiting at once


def drain_mixed(endpoints: dict[str, str], n: int, loop_kind: str) -> None:
    """B of the rates: per command line ``MODE ROUND``, take ``n`` messages that way (see the module doc)."""
    from zmq_omni.aio import AsyncConnector
    from zmq_omni.connectors.zmq import ZmqConnector

    threaded = ZmqConnector(path_config("b", endpoints, awaited=False))
    loop = new_loop(loop_kind)
    awaited = AsyncConnector.create(spec(path_config("b", endpoints, awaited=True)))
    print("ready", flush=True)

    async def main() -> None:
        async with awaited as conn:
            while (command := sys.stdin.readline().split()) and command != ["quit"]:
                mode, tag = command
                keys = [f"{tag}-{i}" for i in range(n)]
                if mode == "thread":
                    print("waiting", flush=True)
                    for key in keys:
                        assert threaded.get_with_deadline("a", "b", key, deadline=time.monotonic() + 60) is not None
                elif mode == "seq":
                    print("waiting", flush=True)
                    for key in keys:
                        assert await conn.get("a", "b", key, timeout=60) is not None
                else:
                    tasks = [asyncio.ensure_future(conn.get("a", "b", key, timeout=60)) for key in keys]
                    while conn.health()["aio_gets_waiting"] < n:
                        await asyncio.sleep(0.001)
                    print("waiting", flush=True)
                    assert None not in await asyncio.gather(*tasks)
                print(json.dumps({"done": time.monotonic()}), flush=True)
            await conn.flush(30)

    run_and_close(loop, main, threaded)


def spec(extra: dict[str, Any]) -> dict[str, Any]:
    """The factory spec of a ZmqConnector with ``extra``."""
    return {"name": "ZmqConnector", "extra": extra}


def run_and_close(
    loop: asyncio.AbstractEventLoop, main: Callable[[], Coroutine[Any, Any, None]], threaded: Any
) -> None:
    """B's tail in both mixed modes: ``main`` on ``loop`` (it closes the awaited connector), then the threaded one."""
    loop.run_until_complete(main())
    loop.close()
    threaded.flush(30)
    threaded.close()


def raw_echo(mode: str, endpoint: str, n: int, loop_kind: str) -> None:
    """Raw pyzmq: send back each of ``n`` frames, blocking or on an event loop."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(endpoint)
    print("ready", flush=True)
    sys.stdin.readline()
    if mode == "raw-block":
        for _ in range(n):
            sock.send(sock.recv())
    else:

        async def echo() -> None:
            reader = RawReader(sock)
            for _ in range(n):
                sock.send(await reader.recv())

        loop = new_loop(loop_kind)
        loop.run_until_complete(echo())
        loop.close()
    sys.stdin.readline()
    sock.close(linger=1000)
    ctx.term()


class RawReader:
    """The least an event loop needs to receive from a ZeroMQ socket: what the loop itself costs.

    ZeroMQ's descriptor is registered once; its callback reads the frame and
    resolves the future the receiving task awaits (one future per frame, no
    extra look at the socket on the task's side).
    """

    def __init__(self, sock: Any) -> None:
        import zmq

        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.fut: asyncio.Future[bytes] | None = None
        self.again = zmq.Again
        self.loop.add_reader(sock.get(zmq.FD), self.on_fd)

    def on_fd(self) -> None:
        fut = self.fut
        if fut is None or fut.done():
            return
        try:
            fut.set_result(self.sock.recv(1))  # zmq.NOBLOCK
        except self.again:
            return  # the descriptor signals a change, not a message

    async def recv(self) -> bytes:
        try:
            frame: bytes = self.sock.recv(1)  # something may be queued already (the descriptor fired before)
            return frame
        except self.again:
            pass
        self.fut = self.loop.create_future()
        return await self.fut


def rtt_raw(tmp: str, n: int, mode: str, loop_kind: str = "") -> list[float]:
    import zmq

    endpoints = {"b": f"ipc://{tmp}/raw.sock"}
    peer = Peer(mode, endpoints, n, loop_kind)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoints["b"])
    peer.go()
    payload = b"\0" * SMALL
    samples: list[float] = []
    if mode == "raw-block":
        for _ in range(n):
            started = time.perf_counter()
            sock.send(payload)
            sock.recv()
            samples.append(time.perf_counter() - started)
    else:

        async def main() -> None:
            reader = RawReader(sock)
            for _ in range(n):
                started = time.perf_counter()
                sock.send(payload)
                await reader.recv()
                samples.append(time.perf_counter() - started)

        loop = new_loop(loop_kind)
        loop.run_until_complete(main())
        loop.close()
    peer.finish()
    sock.close(linger=0)
    ctx.term()
    return samples


def wake_floor(n: int, loop_kind: str) -> float:
    """Seconds per task the event loop itself takes to wake ``n`` waiting tasks: no connector, no socket.

    Each task awaits its own future, as an awaited get awaits its waiter's;
    callbacks resolve them 64 at a time, as pumps resolve a batch of arrivals;
    timed from the first resolve to the gather of every task.
    """

    async def wait(fut: asyncio.Future[int]) -> int:
        return await fut

    async def main() -> float:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        tasks = [asyncio.ensure_future(wait(fut)) for fut in futures]
        await asyncio.sleep(0)  # every task is now waiting on its future

        def resolve(start: int) -> None:
            for fut in futures[start : start + 64]:
                fut.set_result(1)
            if start + 64 < n:
                loop.call_soon(resolve, start + 64)

        started = time.perf_counter()
        resolve(0)
        await asyncio.gather(*tasks)
        return (time.perf_counter() - started) / n

    loop = new_loop(loop_kind)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


# -- the driver (A) ----------------------------------------------------------------------------


class Peer:
    def __init__(self, mode: str, endpoints: dict[str, str], n: int, loop_kind: str) -> None:
        args = [sys.executable, __file__, "--child", json.dumps([mode, endpoints, n, loop_kind])]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.readline() == "ready"

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited ({self.proc.wait()})")
        return line.strip()

    def go(self) -> None:
        self.send("go")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(60)


def rtt_mixed(tmp: str, n: int, loop_kind: str) -> tuple[list[list[float]], list[list[float]]]:
    """``n`` lone round trips of each path in one pair of processes: per block, threaded and async in turn."""
    from zmq_omni.aio import AsyncConnector
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoints = {name: f"ipc://{tmp}/{name}.sock" for name in ("a", "b", "a2", "b2")}
    threaded_blocks: list[list[float]] = []
    async_blocks: list[list[float]] = []

    async def main() -> None:
        threaded = ZmqConnector(path_config("a", endpoints, awaited=False))
        try:
            async with AsyncConnector.create(spec(path_config("a", endpoints, awaited=True))) as conn:
                peer = Peer("echo-mixed", endpoints, n, loop_kind)
                peer.go()
                payload = {"x": b"\0" * SMALL}
                for block in range(2 * n // BLOCK):
                    samples: list[float] = []
                    for i in range(block * BLOCK, (block + 1) * BLOCK):
                        started = time.perf_counter()
                        if block % 2 == 0:
                            threaded.put("a", "b", f"p{i}", payload)
                            got = threaded.get_with_deadline("b", "a", f"q{i}", deadline=time.monotonic() + 30)
                        else:
                            await conn.put("a", "b", f"p{i}", payload)
                            got = await conn.get("b", "a", f"q{i}", timeout=30)
                        assert got is not None
                        samples.append(time.perf_counter() - started)
                    (threaded_blocks if block % 2 == 0 else async_blocks).append(samples)
                # B's last puts wait for our acknowledgements, which this loop sends: it runs meanwhile.
                await asyncio.to_thread(peer.finish)
                await conn.flush(10)
        finally:
            threaded.flush(10)
            threaded.close()

    loop = new_loop(loop_kind)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return threaded_blocks, async_blocks


def rates_mixed(tmp: str, n: int, rounds: int, loop_kind: str) -> dict[str, list[float]]:
    """Messages per second of each receiver (``RATE_MODES``), ``rounds`` each, in one pair of processes.

    A's first put to B's last get; A puts from a plain thread in every mode. The order of the
    receivers rotates every round.
    """
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoints = {name: f"ipc://{tmp}/{name}.sock" for name in ("a", "b", "a2", "b2")}
    rates: dict[str, list[float]] = {mode: [] for mode in RATE_MODES}
    with (
        ZmqConnector(path_config("a", endpoints, awaited=False)) as threaded,
        ZmqConnector(path_config("a", endpoints, awaited=True)) as awaited,
    ):
        peer = Peer("drain-mixed", endpoints, n, loop_kind)
        payload = {"x": b"\0" * SMALL}
        for i in range(rounds):
            for mode in RATE_MODES[i % 3 :] + RATE_MODES[: i % 3]:
                conn = threaded if mode == "thread" else awaited
                tag = f"{mode}{i}"
                peer.send(f"{mode} {tag}")
                assert peer.readline() == "waiting"
                started = time.monotonic()
                for j in range(n):
                    ok, _, _ = conn.put("a", "b", f"{tag}-{j}", payload)
                    assert ok
                done = float(json.loads(peer.readline())["done"])
                rates[mode].append(n / (done - started))
        peer.finish()
        threaded.flush(30)
        awaited.flush(30)
    return rates


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and rounds")
    parser.add_argument("--rounds", type=int, help="rounds of each figure (default 5; 2 with --quick)")
    parser.add_argument("--only", choices=["rtt", "rate"], help="measure only the round trip or only the rates")
    parser.add_argument("--trips", type=int, help=f"lone round trips a path per round (a multiple of {2 * BLOCK})")
    parser.add_argument("--messages", type=int, help="messages of each many-in-flight rate")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*json.loads(args.child))
        return
    try:
        import uvloop  # noqa: F401

        loops = ["asyncio", "uvloop"]
    except ImportError:
        loops = ["asyncio"]
    rounds = args.rounds or (2 if args.quick else 5)
    n_rtt = args.trips or (1000 if args.quick else 2000)
    n_rate = args.messages or (10_000 if args.quick else 20_000)
    if n_rtt % (2 * BLOCK):
        parser.error(f"--trips must be a multiple of {2 * BLOCK}")
    started = time.perf_counter()
    print(f"before: {load()}", flush=True)
    rtt_paths = [*loops, "raw pyzmq, blocking", *(f"raw pyzmq, {kind}" for kind in loops)]
    rtts: dict[str, list[list[float]]] = {}
    for kind in loops:
        rtts[f"threaded ({kind} pair)"] = []
        rtts[f"async {kind}"] = []
    rtts.update({name: [] for name in rtt_paths if name.startswith("raw")})
    block_ratios: dict[str, list[float]] = {kind: [] for kind in loops}
    rates: dict[str, dict[str, list[float]]] = {}  # per loop kind, per receiver (RATE_MODES)
    wake_floors: dict[str, list[float]] = {kind: [] for kind in loops}
    with tempfile.TemporaryDirectory(prefix="zo-bench-") as tmp:
        for i in range(rounds):
            if args.only != "rate":
                for name in rtt_paths[i % len(rtt_paths) :] + rtt_paths[: i % len(rtt_paths)]:
                    if name.startswith("raw"):
                        kind = name.removeprefix("raw pyzmq, ")
                        mode = "raw-block" if kind == "blocking" else "raw-async"
                        rtts[name].append(rtt_raw(tmp, n_rtt, mode, "" if kind == "blocking" else kind))
                        continue
                    threaded_blocks, async_blocks = rtt_mixed(tmp, n_rtt, name)
                    rtts[f"threaded ({name} pair)"].append([x for block in threaded_blocks for x in block])
                    rtts[f"async {name}"].append([x for block in async_blocks for x in block])
                    for before, after in zip(threaded_blocks, async_blocks, strict=True):
                        block_ratios[name].append(statistics.median(after) / statistics.median(before))
            if args.only != "rtt":
                for kind in loops:
                    wake_floors[kind].append(wake_floor(n_rate, kind))
        if args.only != "rtt":
            for kind in loops:
                rates[kind] = rates_mixed(tmp, n_rate, rounds, kind)
    if args.only != "rate":
        print(f"\nlone-message RTT ({SMALL} B payload, push mode, ipc, {rounds} rounds x {n_rtt} round trips a path)")
        print(f"{'path':<24} {'median us':>10} {'p99 us':>8} {'vs threaded':>12}  per-round medians, us")
        print(f"(async: over the {BLOCK}-trip blocks, against the threaded block before each in the same processes;")
        print(" raw pyzmq: over rounds, against raw pyzmq, blocking)")
        raw_rounds = [statistics.median(samples) for samples in rtts["raw pyzmq, blocking"]]
        for name, per_round in rtts.items():
            medians = [statistics.median(samples) for samples in per_round]
            pooled = sorted(x for samples in per_round for x in samples)
            median, p99 = statistics.median(pooled), pooled[int(len(pooled) * 0.99)]
            if name.startswith("raw"):
                ratio = statistics.median(m / b for m, b in zip(medians, raw_rounds, strict=True))
            elif name.startswith("async"):
                ratio = statistics.median(block_ratios[name.removeprefix("async ")])
            else:
                ratio = 1.0
            listed = " ".join(f"{m * 1e6:.0f}" for m in medians)
            print(f"{name:<24} {median * 1e6:>10.1f} {p99 * 1e6:>8.1f} {ratio:>11.2f}x  {listed}")
        pooled_median = {name: statistics.median(x for s in per_round for x in s) for name, per_round in rtts.items()}
        for kind in loops:
            floor = pooled_median[f"raw pyzmq, {kind}"] - pooled_median["raw pyzmq, blocking"]
            threaded = pooled_median[f"threaded ({kind} pair)"]
            ours = pooled_median[f"async {kind}"] - threaded
            within = sum(r <= 1.2 for r in block_ratios[kind])
            print(
                f"{kind}: the loop adds {floor * 1e6:.1f} us to a raw round trip; the async path adds "
                f"{ours * 1e6:.1f} us to ours (1.2x of threaded allows {0.2 * threaded * 1e6:.1f} us); "
                f"{within} of {len(block_ratios[kind])} async blocks within 1.2x of their threaded block"
            )
    if args.only != "rtt":
        print(f"\nmany in flight ({n_rate} x {SMALL} B, push mode, ipc, {rounds} rounds in one process pair a loop)")
        print(f"{'receiver':<36} {'msg/s':>9} {'threaded/this':>14}  per-round msg/s")
        print("(msg/s: median of rounds; threaded/this: median over rounds of the round's threaded rate / this)")
        names = {"thread": "threaded ({kind} pair)", "seq": "async {kind}, one task in order"}
        names["all"] = f"async {{kind}}, all {n_rate} waiting"
        for kind in loops:
            per_mode = rates[kind]
            for mode in RATE_MODES:
                ratio = statistics.median(t / r for t, r in zip(per_mode["thread"], per_mode[mode], strict=True))
                listed = " ".join(f"{r:,.0f}" for r in per_mode[mode])
                name = names[mode].format(kind=kind)
                print(f"{name:<36} {statistics.median(per_mode[mode]):>9,.0f} {ratio:>13.2f}x  {listed}")
        for kind in loops:
            floor = statistics.median(wake_floors[kind])
            base_rate = statistics.median(rates[kind]["thread"])
            extra = 1 / statistics.median(rates[kind]["all"]) - 1 / base_rate
            print(
                f"{kind}: the loop alone takes {floor * 1e6:.2f} us to wake each of {n_rate} waiting tasks; "
                f"all waiting costs {extra * 1e6:.2f} us per message more than the threaded receive "
                f"({1e6 / base_rate:.2f} us; 1.2x allows {0.2e6 / base_rate:.2f} us)"
            )
    print(f"\nafter: {load()}; total time {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
