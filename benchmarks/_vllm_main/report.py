"""The figures of ``benchmarks/vllm_main_pipeline.py``: one run's result, the table, the CPU per chunk."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASELINE = "main-shm"
BACKENDS = ("main-shm", "zmq-push-ipc", "zmq-push-tcp", "zmq-pull-tcp")
LABELS = {
    "main-shm": "main's SharedMemoryConnector (YAML as shipped)",
    "zmq-push-ipc": "ZmqConnector push ipc, shm auto",
    "zmq-push-tcp": "ZmqConnector push tcp, shm off",
    "zmq-pull-tcp": "ZmqConnector pull tcp",
}


@dataclass
class RunResult:
    """One backend, one repetition."""

    chunk0_ms: list[float]
    per_chunk_ms: list[float]
    chunks_per_s: float
    put_us: list[float]
    paced_put_us: list[float]
    first_chunk0_ms: float
    hops_ms: dict[str, list[float]]
    shm_puts: int | None
    hop1_chunks_per_s: float
    cpu_ms_per_chunk: dict[str, dict[str, float]]
    host_busy_cores: float = 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def host_cpu() -> float:
    """CPU seconds every core of the host has spent busy (not idle, not waiting for I/O), from ``/proc/stat``."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def print_cpu(result: RunResult) -> None:
    """The burst's CPU per chunk: each stage process (its connector's share), its threads and calls of >= 0.01 ms."""
    total = sum(stage["(process)"] for stage in result.cpu_ms_per_chunk.values())
    print(
        f"    burst CPU ms/chunk: stages {total:.2f} (3 stages at {result.chunks_per_s:.0f} chunks/s:"
        f" {total * result.chunks_per_s / 1e3:.2f} cores; host busy {result.host_busy_cores:.2f} of {os.cpu_count()})"
    )
    for stage, threads in result.cpu_ms_per_chunk.items():
        rest = sorted(((v, k) for k, v in threads.items() if k != "(process)" and v >= 0.01), reverse=True)
        # the connector's: its calls, ZmqConnector's I/O threads and libzmq's; the rest is main's code and the harness
        ours = sum(v for k, v in threads.items() if k.startswith(("(in ", "zmq-omni", "ZMQbg")))
        print(
            f"      stage {stage} {threads['(process)']:.2f} (connector {ours:.2f}, the rest"
            f" {threads['(process)'] - ours:.2f}): " + ", ".join(f"{k} {v:.2f}" for v, k in rest)
        )


def report(results: dict[str, list[RunResult]], args: argparse.Namespace) -> None:
    def med(backend: str, pick: Any) -> float:
        return float(statistics.median(pick(r) for r in results[backend]))

    rows = {}
    for backend, runs in results.items():
        rows[backend] = {
            "chunk0_p50_ms": med(backend, lambda r: statistics.median(r.chunk0_ms)),
            "first_chunk0_ms": med(backend, lambda r: r.first_chunk0_ms),
            "per_chunk_p50_ms": med(backend, lambda r: pct(r.per_chunk_ms, 0.5)),
            "per_chunk_p99_ms": med(backend, lambda r: pct(r.per_chunk_ms, 0.99)),
            "chunks_per_s": med(backend, lambda r: r.chunks_per_s),
            "hop1_chunks_per_s": med(backend, lambda r: r.hop1_chunks_per_s),
            "put_p50_us": med(backend, lambda r: pct(r.put_us, 0.5)),
            "put_p99_us": med(backend, lambda r: pct(r.put_us, 0.99)),
            "paced_put_p50_us": med(backend, lambda r: pct(r.paced_put_us, 0.5)),
            "runs": len(runs),
        }
    base = rows.get(BASELINE)
    print(f"\nmedians of {args.reps} reps (ratio: vs {BASELINE} in this run; above 1, better than it)")
    print(
        f"{'backend':48s} {'chunk0 p50':>10s} {'1st chunk0':>10s} {'chunk p50':>9s} {'chunk p99':>9s}"
        f" {'chunks/s':>9s} {'ratio':>6s} {'put p50':>9s} {'put p99':>9s} {'paced put p50':>13s}"
    )
    for backend, row in rows.items():
        ratio = f"{row['chunks_per_s'] / base['chunks_per_s']:.2f}x" if base else "-"
        print(
            f"{LABELS[backend]:48s} {row['chunk0_p50_ms']:8.2f}ms {row['first_chunk0_ms']:8.2f}ms"
            f" {row['per_chunk_p50_ms']:7.2f}ms {row['per_chunk_p99_ms']:7.2f}ms {row['chunks_per_s']:9.1f}"
            f" {ratio:>6s} {row['put_p50_us']:7.0f}us {row['put_p99_us']:7.0f}us {row['paced_put_p50_us']:11.0f}us"
        )
    if base:
        print("\nlatency ratios (theirs / ours; above 1, ZmqConnector is faster):")
        for backend, row in rows.items():
            if backend != BASELINE:
                print(
                    f"  {backend:13s} chunk0 {base['chunk0_p50_ms'] / row['chunk0_p50_ms']:.2f}x"
                    f"  per-chunk p50 {base['per_chunk_p50_ms'] / row['per_chunk_p50_ms']:.2f}x"
                    f"  p99 {base['per_chunk_p99_ms'] / row['per_chunk_p99_ms']:.2f}x"
                    f"  put p50 {base['put_p50_us'] / row['put_p50_us']:.2f}x"
                    f" (paced {base['paced_put_p50_us'] / row['paced_put_p50_us']:.2f}x)"
                )
    if args.json:
        raw = {b: [r.__dict__ for r in runs] for b, runs in results.items()}
        args.json.write_text(json.dumps({"medians": rows, "runs": raw, "args": vars(args)}, default=str, indent=1))
