"""What a stage of ``benchmarks/vllm_main_pipeline.py`` records: its connector calls' times, its threads' CPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


class Timed:
    """Wraps the adapter's connector: each ``put`` (start, end, ok), ``get`` hit (start, end) and miss (duration).

    It also sums the CPU seconds of the calling thread spent in puts, hits and
    misses (``calls_cpu``), which the CPU snapshots read.
    """

    def __init__(self, connector: Any, records: dict[str, Any]) -> None:
        self._connector = connector
        self._puts = records.setdefault("puts", {})
        self._gets = records.setdefault("gets", {})
        self._misses = records.setdefault("misses", [])
        self.calls_cpu = {"(in put)": 0.0, "(in get hit)": 0.0, "(in get miss)": 0.0}

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Any:
        start, cpu = time.monotonic(), time.thread_time()
        result = self._connector.put(from_stage=from_stage, to_stage=to_stage, put_key=put_key, data=data)
        self._puts[put_key] = (start, time.monotonic(), bool(result[0]))
        self.calls_cpu["(in put)"] += time.thread_time() - cpu
        return result

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None) -> Any:
        start, cpu = time.monotonic(), time.thread_time()
        result = self._connector.get(from_stage, to_stage, get_key, metadata)
        if result is not None:
            self._gets.setdefault(get_key, (start, time.monotonic()))
            self.calls_cpu["(in get hit)"] += time.thread_time() - cpu
        else:
            self._misses.append(time.monotonic() - start)
            self.calls_cpu["(in get miss)"] += time.thread_time() - cpu
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connector, name)


def cpu_by_thread() -> dict[str, float]:
    """CPU seconds (user + system) each live thread of this process has spent, by thread name.

    Python threads by their ``threading`` name, the others (libzmq's I/O and
    reaper threads) by their kernel name; ``/proc/self/task/TID/stat`` counts
    in clock ticks.
    """
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(task.name), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    times = os.times()
    out["(process)"] = times.user + times.system
    return out
