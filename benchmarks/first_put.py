"""The first large put after start: put->get time of a 1 MiB payload from a sender connector just built.

Run: ``python benchmarks/first_put.py [--trials 20] [--size 1M] [--gap-ms 0,100]``

A receiver process binds an ``ipc://`` endpoint and waits in ``get_with_deadline``
for each key; it notes ``time.monotonic()`` (one clock for every process of the
host) when the get returns, checks the payload's bytes and sends both back. For
each trial this process builds a fresh push-mode sender connector (its own
sender id, slot pool and probe, so the receiver meets a new sender each time),
waits ``gap`` (0: the put comes right after construction; 100 ms: a stage that
builds its connectors and then starts serving), puts one payload and reads back
when the receiver had it. A second put on the same connector gives the warm
figure beside it.

Columns: ``put`` is the put call alone, ``put->get`` from the call to the
receiver's get returning, ``shm`` how many of the trials' first puts went through
shared memory (``health()["shm_puts"]``). Medians and p90 over the trials.
The ``off`` rows (``shm: off``, frames always) are the baseline of the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zmq_omni.bench import parse_size, size_label
from zmq_omni.connectors.zmq import ZmqConnector

SPAWN = mp.get_context("spawn")


def _receive(config: dict[str, Any], keys: list[str], ready: Any, out: Any) -> None:
    """Get each key in turn; send back ``(key, when the get returned, bytes checked ok)``."""
    with ZmqConnector(config) as conn:
        ready.set()
        for key in keys:
            got = conn.get_with_deadline("0", "1", key, deadline=time.monotonic() + 60)
            when = time.monotonic()
            ok, obj = False, None
            if got is not None:
                obj = got[0]
                ok = bool(obj["data"].size == obj["size"] and obj["data"][0] == obj["mark"] == obj["data"][-1])
            del got, obj  # the last view of a slot ends its lease: the sender may reuse it
            out.put((key, when, ok))


def _ms(values: list[float]) -> str:
    """Median / p90 in milliseconds."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered) * 1e3:6.2f}/{p90 * 1e3:6.2f}"


@dataclass
class _Row:
    put: list[float] = field(default_factory=list)  # the first put call alone
    first: list[float] = field(default_factory=list)  # the first put -> the receiver's get
    warm: list[float] = field(default_factory=list)  # the second put -> its get
    shm_first: int = 0  # first puts that went through shared memory
    shm_warm: int = 0


def _trial(sender: ZmqConnector, row: _Row, out: Any, data: Any, gap: float, name: str, t: int) -> None:
    """One fresh sender: wait ``gap``, put twice (each waits for its get), note the times and the path."""
    with sender:
        time.sleep(gap)
        for n in ("first", "warm"):
            mark = (2 * t + (n == "warm")) % 251 + 1
            data[0] = data[-1] = mark
            key = f"{name}-{n}"
            shm_before = sender.health()["shm_puts"]
            began = time.monotonic()
            ok, _, _ = sender.put("0", "1", key, {"data": data, "size": data.size, "mark": mark})
            returned = time.monotonic()
            got_key, when, checked = out.get(timeout=60)
            if not (ok and checked and got_key == key):
                raise SystemExit(f"put {key}: ok={ok}, received {got_key} intact={checked}")
            via_shm = sender.health()["shm_puts"] - shm_before
            if n == "first":
                row.put.append(returned - began)
                row.first.append(when - began)
                row.shm_first += via_shm
            else:
                row.warm.append(when - began)
                row.shm_warm += via_shm
        sender.flush(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="fresh sender connectors per row")
    parser.add_argument("--size", default="1M", help="payload bytes (K, M suffixes)")
    parser.add_argument("--gap-ms", default="0,100", help="pauses between construction and the first put")
    parser.add_argument("--policies", default="off,auto", help="shm policies to compare")
    args = parser.parse_args()
    size = parse_size(args.size)
    gaps = [float(g) / 1e3 for g in args.gap_ms.split(",")]
    policies = args.policies.split(",")
    rows = [(policy, gap) for gap in gaps for policy in policies]
    tmp = Path(tempfile.mkdtemp(prefix="zo-first-", dir="/tmp"))
    endpoints = {"1": f"ipc://{tmp}/r1"}
    keys = [f"{policy}-{gap}-{t}-{n}" for t in range(args.trials) for policy, gap in rows for n in ("first", "warm")]
    out, ready = SPAWN.Queue(), SPAWN.Event()
    receiver = SPAWN.Process(
        target=_receive, args=({"endpoints": endpoints, "stage_id": "1", "role": "receiver"}, keys, ready, out)
    )
    receiver.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the receiver did not start")
        data = np.zeros(size, dtype=np.uint8)
        results = {row: _Row() for row in rows}
        for t in range(args.trials):  # rows interleaved: a change of load hits them all alike
            for policy, gap in rows:
                cfg = {"endpoints": endpoints, "stage_id": "0", "role": "sender", "to_stage": "1", "shm": policy}
                _trial(ZmqConnector(cfg), results[policy, gap], out, data, gap, f"{policy}-{gap}-{t}", t)
        print(
            f"{size_label(size)} payload, {args.trials} fresh senders per row; times in ms (median / p90)\n"
            f"{'shm':<5} {'gap':>6} {'first put':>13} {'first put->get':>15} {'via shm':>8} "
            f"{'warm put->get':>14} {'via shm':>8} {'first vs off':>12}"
        )
        for policy, gap in rows:
            row, off = results[policy, gap], results.get(("off", gap))
            ratio = f"{statistics.median(row.first) / statistics.median(off.first):>11.2f}x" if off else ""
            print(
                f"{policy:<5} {gap * 1e3:>4.0f}ms {_ms(row.put)} {_ms(row.first):>15} "
                f"{row.shm_first:>5}/{args.trials:<2} {_ms(row.warm):>14} {row.shm_warm:>5}/{args.trials:<2} {ratio}"
            )
    finally:
        receiver.join(30)
        if receiver.is_alive():
            receiver.kill()
            receiver.join()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
