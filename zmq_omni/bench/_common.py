"""What every grid shares: the comparison row of the ratio table, timers, size labels."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
_UNITS = {"K": KIB, "M": MIB, "G": 1 << 30}
RATES = ("B/s", "msg/s", "chunks/s")


@dataclass(frozen=True)
class Comparison:
    """One cell of the ratio table: a zmq_omni figure beside a baseline measured in the same run.

    Attributes:
        grid: which grid measured it (``codec``, ``transport``, ``latency``, ``shm``, ``adapters``, ``vllm``).
        benchmark: what "ours" is, for example ``"ZmqConnector tcp shm=off"``.
        size: the payload label (``"1 MiB"``) or the statistic (``"p99"``).
        ours: our figure, in ``unit``.
        baseline: the baseline's figure, in ``unit``.
        baseline_name: what the baseline is, for example ``"raw pyzmq PUSH/PULL"``.
        unit: ``"s"`` for a time (lower is better), ``"B/s"``, ``"msg/s"`` or ``"chunks/s"`` for a rate
            (higher is better).
    """

    grid: str
    benchmark: str
    size: str
    ours: float
    baseline: float
    baseline_name: str
    unit: str = "s"

    @property
    def ratio(self) -> float:
        """How many times better ours is than the baseline (> 1: ours wins), whatever the unit."""
        if self.unit in RATES:
            return self.ours / self.baseline
        return self.baseline / self.ours


def median_seconds(fns: Mapping[str, Callable[[], Any]], budget: float, repeats: int) -> dict[str, float]:
    """Median per-call seconds of each function over ``repeats`` batches, interleaved.

    Each function is warmed up, then timed in batches of ``number`` calls, with
    ``number`` chosen so one batch lasts about ``budget / repeats`` seconds (at
    least one call): fast functions get many calls per batch, so timer
    resolution and call jitter average out. Interleaving the contenders batch by
    batch makes a noisy neighbour slow all of them alike.
    """
    numbers = {}
    for name, fn in fns.items():
        fn()  # warm-up: first-touch page faults, caches, lazy imports
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-7)
        numbers[name] = max(1, min(1_000_000, int(budget / repeats / once)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            number = numbers[name]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number)
    return {name: statistics.median(times) for name, times in samples.items()}


def median_time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one untimed warm-up call."""
    fn()  # first-touch faults and caches are not what we compare
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``samples``, linear interpolation (numpy's default)."""
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def parse_size(text: str) -> int:
    """``"64K"``, ``"1M"``, ``"1MiB"``, ``"4096"`` -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def size_label(n: int) -> str:
    """``1048576`` -> ``"1 MiB"``; ``1536`` -> ``"1.5 KiB"``; ``200`` -> ``"200 B"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
