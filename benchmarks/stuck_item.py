"""One item never taken beside a stream of puts: put->get latency with and without it, and the cost of a pong.

Run: ``python benchmarks/stuck_item.py`` (two live runs of ``--duration`` seconds, 60 by
default, then the micro case). Each live run starts a receiving ``ZmqConnector`` here
and a sending one in a spawned process, over ipc; the sender puts small dicts under
the keys ``k0, k1, ...`` at ``--rate`` puts per second (paced, never faster), each
stamped with ``time.monotonic()`` (one clock for every process of the host), and the
receiver takes them in order with ``get_with_deadline``: the latency of a put is the
time its get returned minus its stamp. The second run first puts one item under a key
nobody takes: it stays unclaimed, pinning the sender's low mark for the whole run (its
``unclaimed_ttl_s`` is the default 300 s). The table gives p50 and p99 over the whole
run and p50 over its last quarter (where a cost that grows with the run shows), and the
ratio of the stuck run to the clean one. A run stops waiting ``2 * duration + 30`` s
after it started; the items it has not taken by then are counted ``missed`` (a receiver
that falls that far behind has no latency worth printing).

The micro case (``--repeats``, default 1,000,000) plays a hostile or broken sender
against ``ReceiveProtocol`` directly, no sockets: that many puts under one key, each
replacing the one before (consumed), while the sender's low mark stays at 0; every
1,024 puts the acknowledgements are flushed (every consumption told once). Then PINGs,
each timed in CPU time (``time.thread_time``), until every consumption told once was said
once more: the first two and the first after that (the steady state) are printed, with
the REPLYs answering each, their bytes and the seqs they name; and
how much the process's RSS grew while the puts were fed (the receiver's state for that sender).
Run it with another checkout's package first on ``PYTHONPATH`` to compare
(``--repeats 1000000 --duration 0``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SPAWN = mp.get_context("spawn")
STUCK_KEY = "never-taken"


def _sender(endpoint: str, rate: float, count: int, stuck: bool, out: Any, done: Any) -> None:
    """Put ``count`` stamped items at ``rate`` per second (after one never taken when ``stuck``)."""
    from zmq_omni.connectors.zmq import ZmqConnector

    config = {"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}, "close_timeout_s": 0.5}
    failed = 0
    with ZmqConnector(config) as conn:
        if stuck:
            failed += not conn.put("0", "1", STUCK_KEY, {"t": time.monotonic(), "i": -1})[0]
        start = time.monotonic()
        for i in range(count):
            due = start + i / rate
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            failed += not conn.put("0", "1", f"k{i}", {"t": time.monotonic(), "i": i})[0]
        elapsed = time.monotonic() - start
        out.put(("sent", count / elapsed, failed))
        done.get()  # the receiver took everything: close now


def _live(rate: float, duration: float, stuck: bool) -> dict[str, float]:
    from zmq_omni.connectors.zmq import ZmqConnector

    count = int(rate * duration)
    with tempfile.TemporaryDirectory(prefix="zo-stuck-") as tmp:
        config = {"stage_id": "1", "role": "receiver", "endpoints": {"1": f"ipc://{Path(tmp) / 'r.sock'}"}}
        with ZmqConnector(config) as conn:
            out, done = SPAWN.Queue(), SPAWN.Queue()
            proc = SPAWN.Process(target=_sender, args=(conn.endpoint, rate, count, stuck, out, done), daemon=True)
            proc.start()
            try:
                lat: list[float] = []
                missed = 0
                give_up = time.monotonic() + 2 * duration + 30
                for i in range(count):
                    left = give_up - time.monotonic()
                    if left <= 0:
                        missed += count - i
                        break
                    got = conn.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + min(10.0, left))
                    now = time.monotonic()
                    if got is None:
                        missed += 1
                        continue
                    lat.append(now - got[0]["t"])
                try:
                    _, sent_rate, failed = out.get(timeout=60)
                except queue.Empty:
                    sent_rate, failed = float("nan"), -1
                done.put("done")
                proc.join(10)
            finally:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    tail = lat[len(lat) * 3 // 4 :]
    return {
        "rate": sent_rate,
        "p50": statistics.median(lat),
        "p99": statistics.quantiles(lat, n=100)[98],
        "tail_p50": statistics.median(tail),
        "missed": missed,
        "failed": failed,
    }


def _rss_mib() -> float:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _micro(repeats: int) -> None:
    from zmq_omni.metrics import Counters
    from zmq_omni.transport._envelope import Kind, from_ranges, pack, unpack
    from zmq_omni.transport._receive_protocol import ReceiveProtocol

    sid = "hostile"
    identity = b"d" + sid.encode()
    proto = ReceiveProtocol(
        endpoint="bench",
        incarnation="r1",
        decode=lambda parts: bytes(parts[0]),
        decode_each=lambda wires: [bytes(w) for w in wires],
        max_message_bytes=1 << 20,
        max_frames=8,
        counters=Counters(),
        shm=None,
    )
    wire = b"x" * 16
    prev: int | None = None
    rss = _rss_mib()
    started = time.perf_counter()
    for base in range(0, repeats, 1024):
        entries: list[Any] = []
        for seq in range(base, min(base + 1024, repeats)):
            entries += [seq, "0", "one-key", wire]
        if len(entries) < 8:  # a BATCH holds two puts or more
            entries += [base + 1, "0", "one-key", wire]
        proto.receive(identity, [pack(Kind.BATCH, (sid, 0, "1", entries))], True, 1.0)
        consumed = []
        for _, item in proto.arrivals:  # each re-put under the key consumes the one before
            if prev is not None:
                consumed.append((sid, prev))
            prev = item.seq
        proto.arrivals = []
        proto.taken(consumed, [], 0)
        for reply in proto.flush():
            proto.sent(reply, True)
    fed = time.perf_counter() - started
    grown = _rss_mib() - rss
    print(f"micro: {repeats:,} re-puts under one key, low mark at 0 (fed in {fed:.1f} s, RSS +{grown:.0f} MiB)")
    print(f"{'PING':>6} {'CPU ms':>9} {'REPLYs':>7} {'bytes':>10} {'seqs named':>11}")
    # Every consumption was told once by an acknowledgement: the first pongs say each once more (16,384 a
    # pong, with a share of the rotation); then every pong repeats only its share of the rotation.
    source = proto.sources[sid]
    ping = 0
    while True:
        ping += 1
        drained = not source.recent
        frame = pack(Kind.PING, (sid, ping, 0))
        cpu = time.thread_time()
        proto.receive(identity, [frame], True, 2.0)
        replies, proto.replies = proto.replies, []
        cpu = time.thread_time() - cpu
        named = 0
        for reply in replies:
            _, header, _ = unpack(reply.frame)
            named += len(from_ranges(header[2], 1 << 40)) + len(from_ranges(header[3], 1 << 40))
            proto.sent(reply, True)
        size = sum(len(r.frame) for r in replies)
        if ping <= 2 or drained:
            print(f"{ping:>6} {cpu * 1e3:>9.2f} {len(replies):>7} {size:>10,} {named:>11,}")
        if drained:
            break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per live run (0: skip them)")
    parser.add_argument("--rate", type=float, default=10_000.0, help="puts per second the sender aims at")
    parser.add_argument("--repeats", type=int, default=1_000_000, help="re-puts in the micro case (0: skip it)")
    args = parser.parse_args()
    if args.duration > 0:
        print(f"live: {args.rate:,.0f} puts/s aimed, {args.duration:.0f} s per run, ipc; latency in ms")
        print(f"{'run':<14} {'puts/s':>8} {'p50':>8} {'p99':>8} {'last-quarter p50':>17} {'missed':>7} {'failed':>7}")
        rows = {}
        for name, stuck in (("clean", False), ("one stuck", True)):
            row = rows[name] = _live(args.rate, args.duration, stuck)
            print(
                f"{name:<14} {row['rate']:>8,.0f} {row['p50'] * 1e3:>8.3f} {row['p99'] * 1e3:>8.3f} "
                f"{row['tail_p50'] * 1e3:>17.3f} {row['missed']:>7} {row['failed']:>7}",
                flush=True,
            )
        clean, stuck_row = rows["clean"], rows["one stuck"]
        ratios = [stuck_row[k] / clean[k] for k in ("p50", "p99", "tail_p50")]
        print("ratio stuck/clean: p50 {:.2f}x, p99 {:.2f}x, last-quarter p50 {:.2f}x".format(*ratios))
    if args.repeats > 0:
        _micro(args.repeats)


if __name__ == "__main__":
    main()
