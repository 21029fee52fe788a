"""``zmq-omni bench``: a compact run of the six benchmark grids, one table of ratios.

The grids are :mod:`zmq_omni.bench` (the same code as ``benchmarks/*.py``),
with fewer sizes and repetitions so the whole run stays well under two
minutes on two shared cores. Every row is measured beside its baseline in the
same run, so the ratio holds on a busy machine even when absolute figures do
not. ``ratio`` is how many times better zmq_omni is: baseline time / our time,
or our rate / baseline rate (> 1: zmq_omni wins). The plot (``--plot``) needs
the ``plot`` extra (matplotlib). The codec's Struct rows and the vllm-omni
pipeline grid need torch and msgspec; without them they are skipped, with a
line that says what to install.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..bench import KIB, MIB, Comparison, size_label
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..bench.latency import LatencyRow

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
    vllm_backends: tuple[str, ...]
    vllm_paced_requests: int
    vllm_paced_chunks: int
    vllm_requests: int
    vllm_chunks: int


_FULL = _Plan(
    codec_sizes=(1 * KIB, 1 * MIB, 64 * MIB),
    codec_budget_s=0.3,
    codec_repeats=9,
    transports=("ipc", "tcp"),
    transport_sizes=(1 * KIB, 1 * MIB, 64 * MIB),
    transport_budget=512 * MIB,
    transport_max_count=8000,
    small_count=20_000,
    latency_transports=("ipc", "tcp"),
    latency_sizes=(1 * KIB, 64 * KIB, 1 * MIB),
    latency_count=1000,
    shm_sizes=(1 * MIB, 64 * MIB),
    shm_budget=512 * MIB,
    adapters_n=1000,
    vllm_backends=("main-shm", "push-ipc", "push-tcp", "pull-tcp"),
    vllm_paced_requests=2,
    vllm_paced_chunks=10,
    vllm_requests=8,
    vllm_chunks=50,
)
_QUICK = _Plan(
    codec_sizes=(1 * KIB, 1 * MIB),
    codec_budget_s=0.05,
    codec_repeats=5,
    transports=("ipc",),
    transport_sizes=(1 * MIB,),
    transport_budget=64 * MIB,
    transport_max_count=500,
    small_count=2000,
    latency_transports=("ipc",),
    latency_sizes=(1 * KIB,),
    latency_count=200,
    shm_sizes=(1 * MIB,),
    shm_budget=32 * MIB,
    adapters_n=100,
    vllm_backends=("main-shm", "push-ipc"),
    vllm_paced_requests=1,
    vllm_paced_chunks=5,
    vllm_requests=2,
    vllm_chunks=10,
)


def _value(seconds_or_rate: float, unit: str) -> str:
    if unit == "B/s":
        return f"{seconds_or_rate / 1e9:.2f} GB/s"
    if unit == "msg/s":
        return f"{seconds_or_rate / 1e3:.0f}k msg/s"
    if unit == "chunks/s":
        return f"{seconds_or_rate:.0f}/s"
    if seconds_or_rate < 1e-3:
        return f"{seconds_or_rate * 1e6:.1f} us"
    return f"{seconds_or_rate * 1e3:.2f} ms"


def _ratio(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.2f}x"


def _line(c: Comparison) -> str:
    return (
        f"{c.benchmark:<34} {c.size:>12} {_value(c.ours, c.unit):>12} {_value(c.baseline, c.unit):>12} "
        f"{_ratio(c.ratio):>9}  {c.baseline_name}"
    )


def _latency_row(row: LatencyRow, emit: Callable[[list[Comparison]], None], note: Callable[[str], None]) -> None:
    # Where the two processes ran decides a round trip (docs/benchmarks.md#latency): say it under the row.
    emit(row.comparisons())
    note(f"  (the {row.transport} {size_label(row.size)} round trip above: placement {row.placement})")


def _grids(plan: _Plan, emit: Callable[[list[Comparison]], None], note: Callable[[str], None]) -> None:
    from ..bench.adapters import run_adapters
    from ..bench.codec import run_codec, run_small_dict, run_struct_payloads
    from ..bench.latency import run_latency
    from ..bench.shm import run_shm
    from ..bench.transport import run_transport
    from ..bench.vllm_pipeline import INSTALL_HINT, missing_dependencies, run_vllm_pipeline

    run_codec(
        plan.codec_sizes,
        budget_s=plan.codec_budget_s,
        repeats=plan.codec_repeats,
        large_budget_s=plan.codec_budget_s * 2,
        large_repeats=plan.codec_repeats,
        on_row=lambda row: emit(row.comparisons()),
    )
    emit(run_small_dict(budget_s=plan.codec_budget_s, repeats=plan.codec_repeats).comparisons())
    missing = missing_dependencies()
    if missing:
        note(f"codec payload Structs and the vllm pipeline: skipped (no {', '.join(missing)}): {INSTALL_HINT}")
    else:
        for struct_row in run_struct_payloads(budget_s=plan.codec_budget_s, repeats=plan.codec_repeats):
            emit(struct_row.comparisons())
    run_transport(
        plan.transport_sizes,
        transports=plan.transports,
        budget_bytes=plan.transport_budget,
        max_count=plan.transport_max_count,
        small_count=plan.small_count,
        on_row=lambda row: emit(row.comparisons()),
    )
    run_latency(
        plan.latency_sizes,
        transports=plan.latency_transports,
        count=plan.latency_count,
        warmup=min(200, plan.latency_count),
        on_row=lambda row: _latency_row(row, emit, note),
    )
    run_shm(plan.shm_sizes, budget_bytes=plan.shm_budget, paths=_SHM_PATHS, on_row=lambda row: emit(row.comparisons()))
    emit(run_adapters(plan.adapters_n, cpu_window_s=0).comparisons())
    if not missing:
        pipeline = run_vllm_pipeline(
            plan.vllm_backends,
            repeats=1,
            paced_requests=plan.vllm_paced_requests,
            paced_chunks=plan.vllm_paced_chunks,
            requests=plan.vllm_requests,
            chunks=plan.vllm_chunks,
        )
        emit(pipeline.comparisons())


def run_bench(args: argparse.Namespace) -> int:
    """Run the grids, print the table as rows arrive, then write the plot unless ``--no-plot``."""
    plan = _QUICK if args.quick else _FULL
    if args.plot is not None:
        _check_plot_path(args.plot)  # before the benchmark, not after a minute of it
    started = time.monotonic()
    cells: list[Comparison] = []

    def emit(new: list[Comparison]) -> None:
        for cell in new:
            cells.append(cell)
            print(_line(cell), flush=True)

    print(
        f"zmq-omni bench{' --quick' if args.quick else ''}: each row measured beside its baseline in the same "
        f"run; ratio > 1 means zmq_omni is faster",
        flush=True,
    )
    print(_COLUMNS)
    print("-" * (len(_COLUMNS) + 16), flush=True)
    try:
        _grids(plan, emit, lambda line: print(line, flush=True))
    except RuntimeError as exc:  # a grid's own check failed (a put refused, the wrong path taken)
        print(f"zmq-omni bench: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"\nratio = baseline time / our time, or our rate / baseline rate; "
        f"{len(cells)} rows, total time {time.monotonic() - started:.1f} s",
        flush=True,
    )
    if args.plot is not None:
        _plot(cells, args.plot)
    return 0


def _check_plot_path(path: str) -> None:
    """Raise ConfigError when the plot could not be written to ``path``."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ConfigError(f"--plot {path}: is a directory")
    if not folder.is_dir():
        raise ConfigError(f"--plot {path}: no such directory {str(folder)!r}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"--plot {path}: not writable")


#: What a user compares, one panel each: (title, which cells). The codec against codecs that copy the
#: array (msgpack of bytes, one memcpy) is left to the table: zero-copy against a copy grows with the
#: size without limit and says nothing a user chooses between.
_PANELS: tuple[tuple[str, Callable[[Comparison], bool]], ...] = (
    (
        "ZmqConnector against raw pyzmq PUSH/PULL: same bytes, same socket type (throughput)",
        lambda c: c.grid == "transport",
    ),
    (
        "One message in flight: round trip against raw pyzmq PAIR (msgpack header + zero-copy frame)",
        lambda c: c.grid == "latency",
    ),
    (
        "Same-host shm fast path, put -> get, against the vllm-omni-style path and raw pyzmq tcp",
        lambda c: c.grid == "shm" and "memcpy" not in c.baseline_name,
    ),
    (
        "The same against one memcpy of the payload: a floor, 1x is as fast as copying it once",
        lambda c: c.grid == "shm" and "memcpy" in c.baseline_name,
    ),
    (
        "vllm-omni's pipeline with main's call patterns, against main's SharedMemoryConnector (restated)",
        lambda c: c.grid == "vllm",
    ),
    (
        "Codec against pickle-5 / msgpack; adapters against a plain synchronous connector",
        lambda c: (
            (c.grid == "codec" and c.baseline_name.startswith(("pickle5", "msgpack packb", "vllm-omni main")))
            or c.grid == "adapters"
        ),
    ),
)

_CAPTION = (
    "Each bar is one row of the table: how many times better zmq_omni did than the baseline named on its left, "
    "measured beside it in the same run (baseline time / our time, or our rate / baseline rate). Right of the "
    "dashed line (1x) zmq_omni is faster; left of it, slower (0.5x: half the speed). Against memcpy, 1x is the "
    "best any path that copies the payload once can do. Not plotted (see the table): the codec against codecs "
    "that copy the array, where a zero-copy encoder's lead grows with the size without limit."
)


def _plot_label(c: Comparison) -> str:
    what = c.benchmark.removeprefix("ZmqConnector ")
    if c.grid == "shm":
        return f"{c.size}: vs {c.baseline_name}"
    if c.grid == "transport":
        return f"{what}, {c.size}" + ("" if c.unit == "B/s" else f" vs {c.baseline_name}")
    if c.grid == "latency":
        return f"{what}, {c.size}"
    if c.grid == "vllm":
        return f"{what.removeprefix('vllm pipeline ')}, {c.size}"
    return f"{what}, {c.size}: vs {c.baseline_name}"


def _plot_panels(cells: list[Comparison]) -> list[tuple[str, list[Comparison]]]:
    """The plot's panels that have rows: ``(title, cells)`` in table order."""
    panels = [(title, [c for c in cells if chosen(c)]) for title, chosen in _PANELS]
    return [(title, rows) for title, rows in panels if rows]


def _plot(cells: list[Comparison], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot written: matplotlib is not installed; pip install 'zmq-omni[plot]' to get it")
        return
    panels = _plot_panels(cells)
    if not panels:
        print("no plot written: no rows to plot")
        return
    heights = [len(rows) + 1.5 for _, rows in panels]
    inches = 1.6 + 0.3 * sum(heights)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(11, inches), gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    for ax, (title, rows) in zip(axes[:, 0], panels, strict=True):
        ratios = [c.ratio for c in rows]
        # A bar far beyond the panel's others (a p99 outlier) would squash them into slivers: its bar is cut
        # at the panel's edge and its figure printed at the cut.
        usual = [r for r in ratios if r <= 4 * float(np.median(ratios))]
        high = max(2.0, max(usual) * 1.2)
        positions = list(range(len(rows)))
        ax.barh(
            positions,
            [min(r, high) for r in ratios],
            height=0.7,
            color=["tab:blue" if r >= 1 else "tab:orange" for r in ratios],
        )
        ax.axvline(1.0, color="black", linewidth=1.0, linestyle="--")
        ax.set_yticks(positions, [_plot_label(c) for c in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, high)
        for y, ratio in zip(positions, ratios, strict=True):
            if ratio > high:
                ax.annotate(
                    f"{_ratio(ratio)} (bar cut)",
                    (high, y),
                    xytext=(-3, 0),
                    textcoords="offset points",
                    va="center",
                    ha="right",
                    fontsize=8,
                    color="white",
                    fontweight="bold",
                )
            else:
                ax.annotate(
                    _ratio(ratio), (ratio, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8
                )
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ratio (linear): > 1 means zmq_omni is faster than that baseline", fontsize=9)
    fig.suptitle("zmq-omni bench: zmq_omni against the baselines measured beside it in the same run", fontsize=11)
    fig.text(0.01, 0.01, _CAPTION, fontsize=8, wrap=True, ha="left", va="bottom")
    # Room kept in inches: about 0.45 for the title above the panels, 0.75 for the caption below them.
    fig.tight_layout(rect=(0, 0.75 / inches, 1, 1 - 0.45 / inches), h_pad=1.2)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
