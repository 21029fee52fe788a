"""``zmq-omni bench``: a compact run of the five benchmark grids, one table of ratios.

The grids are :mod:`zmq_omni.bench` (the same code as ``benchmarks/*.py``),
with fewer sizes and repetitions so the whole run stays well under two
minutes on two shared cores. Every row is measured beside its baseline in the
same run, so the ratio holds on a busy machine even when absolute figures do
not. ``ratio`` is how many times better zmq_omni is: baseline time / our time,
or our rate / baseline rate (> 1: zmq_omni wins). The plot (``--plot``) needs
the ``plot`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..bench import Comparison
from ..bench._common import KIB, MIB

__all__ = ["run_bench"]

_COLUMNS = f"{'benchmark':<34} {'size':>12} {'ours':>12} {'baseline':>12} {'ratio':>9}  baseline name"
_SHM_PATHS = ("memcpy", "zmq-tcp", "vllm-style", "pickle-shm", "zmq-conn")


@dataclass(frozen=True)
class _Plan:
    codec_sizes: tuple[int, ...]
    codec_budget_s: float
    codec_repeats: int
    transports: tuple[str, ...]
    transport_sizes: tuple[int, ...]
    transport_budget: int
    transport_max_count: int
    small_count: int
    latency_transports: tuple[str, ...]
    latency_sizes: tuple[int, ...]
    latency_count: int
    shm_sizes: tuple[int, ...]
    shm_budget: int
    adapters_n: int


_FULL = _Plan(
    codec_sizes=(1 * KIB, 1 * MIB, 64 * MIB), codec_budget_s=0.3, codec_repeats=9,
    transports=("ipc", "tcp"), transport_sizes=(1 * KIB, 1 * MIB, 64 * MIB), transport_budget=512 * MIB,
    transport_max_count=8000, small_count=20_000,
    latency_transports=("ipc", "tcp"), latency_sizes=(1 * KIB, 64 * KIB, 1 * MIB), latency_count=1000,
    shm_sizes=(1 * MIB, 64 * MIB), shm_budget=512 * MIB,
    adapters_n=1000,
)
_QUICK = _Plan(
    codec_sizes=(1 * KIB, 1 * MIB), codec_budget_s=0.05, codec_repeats=5,
    transports=("ipc",), transport_sizes=(1 * MIB,), transport_budget=64 * MIB,
    transport_max_count=500, small_count=2000,
    latency_transports=("ipc",), latency_sizes=(1 * KIB,), latency_count=200,
    shm_sizes=(1 * MIB,), shm_budget=32 * MIB,
    adapters_n=100,
)


def _value(seconds_or_rate: float, unit: str) -> str:
    if unit == "B/s":
        return f"{seconds_or_rate / 1e9:.2f} GB/s"
    if unit == "msg/s":
        return f"{seconds_or_rate / 1e3:.0f}k msg/s"
    if seconds_or_rate < 1e-3:
        return f"{seconds_or_rate * 1e6:.1f} us"
    return f"{seconds_or_rate * 1e3:.2f} ms"


def _ratio(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.2f}x"


def _line(c: Comparison) -> str:
    return (f"{c.benchmark:<34} {c.size:>12} {_value(c.ours, c.unit):>12} {_value(c.baseline, c.unit):>12} "
            f"{_ratio(c.ratio):>9}  {c.baseline_name}")


def _grids(plan: _Plan, emit: Callable[[list[Comparison]], None]) -> None:
    from ..bench.adapters import run_adapters
    from ..bench.codec import run_codec, run_small_dict
    from ..bench.latency import run_latency
    from ..bench.shm import run_shm
    from ..bench.transport import run_transport

    run_codec(plan.codec_sizes, budget_s=plan.codec_budget_s, repeats=plan.codec_repeats,
              large_budget_s=plan.codec_budget_s * 2, large_repeats=plan.codec_repeats,
              on_row=lambda row: emit(row.comparisons()))
    emit(run_small_dict(budget_s=plan.codec_budget_s, repeats=plan.codec_repeats).comparisons())
    run_transport(plan.transport_sizes, transports=plan.transports, budget_bytes=plan.transport_budget,
                  max_count=plan.transport_max_count, small_count=plan.small_count,
                  on_row=lambda row: emit(row.comparisons()))
    run_latency(plan.latency_sizes, transports=plan.latency_transports, count=plan.latency_count,
                warmup=min(200, plan.latency_count), on_row=lambda row: emit(row.comparisons()))
    run_shm(plan.shm_sizes, budget_bytes=plan.shm_budget, paths=_SHM_PATHS, on_row=lambda row: emit(row.comparisons()))
    emit(run_adapters(plan.adapters_n, cpu_window_s=0).comparisons())


def run_bench(args: argparse.Namespace) -> int:
    """Run the grids, print the table as rows arrive, then write the plot unless ``--no-plot``."""
    plan = _QUICK if args.quick else _FULL
    started = time.monotonic()
    cells: list[Comparison] = []

    def emit(new: list[Comparison]) -> None:
        for cell in new:
            cells.append(cell)
            print(_line(cell), flush=True)

    print(f"zmq-omni bench{' --quick' if args.quick else ''}: each row measured beside its baseline in the same "
          f"run; ratio > 1 means zmq_omni is faster", flush=True)
    print(_COLUMNS)
    print("-" * (len(_COLUMNS) + 16), flush=True)
    try:
        _grids(plan, emit)
    except RuntimeError as exc:  # a grid's own check failed (a put refused, the wrong path taken)
        print(f"zmq-omni bench: error: {exc}", file=sys.stderr)
        return 1
    print(f"\nratio = baseline time / our time, or our rate / baseline rate; "
          f"{len(cells)} rows, total time {time.monotonic() - started:.1f} s", flush=True)
    if args.plot is not None:
        _plot(cells, args.plot)
    return 0


def _plot(cells: list[Comparison], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("no plot written: matplotlib is not installed; pip install 'zmq-omni[plot]' to get it")
        return
    colours = {"codec": "tab:blue", "transport": "tab:orange", "latency": "tab:red", "shm": "tab:green",
               "adapters": "tab:purple"}
    labels = [f"{c.benchmark}, {c.size}  vs {c.baseline_name}" for c in cells]
    ratios = [c.ratio for c in cells]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.3 * len(cells)))
    positions = range(len(cells))
    ax.barh(positions, ratios, color=[colours.get(c.grid, "tab:gray") for c in cells])
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=1.0, linestyle="--")
    ax.set_yticks(list(positions), labels, fontsize=8)
    ax.invert_yaxis()
    for y, ratio in zip(positions, ratios, strict=True):
        ax.annotate(_ratio(ratio), (ratio, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    low, high = min(ratios), max(ratios)
    ax.set_xlim(min(low, 1.0) / 2, max(high, 1.0) * 10)
    ax.set_xlabel("ratio (log scale): > 1 means zmq_omni is faster than the baseline")
    ax.set_title("zmq-omni bench: zmq_omni against baselines measured in the same run")
    ax.legend(handles=[Patch(color=colour, label=grid) for grid, colour in colours.items()], loc="lower right",
              fontsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
