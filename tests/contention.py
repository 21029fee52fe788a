"""Ways the tests perturb scheduling: forced thread switches, busy cores, and a ticker that measures loop stalls.

None of them looks inside the library: they change only how the operating system and
the interpreter schedule what the library does, so a test built on them checks behaviour.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _sleep_before_acquire(frame: Any, event: str, arg: Any) -> None:
    """A profile hook: every lock acquisition yields the CPU first, so check-then-acquire windows open wide."""
    if event == "c_call" and getattr(arg, "__name__", "") == "acquire":
        time.sleep(random.random() * 2e-4)


@contextmanager
def forced_switches() -> Iterator[None]:
    """Thread switches everywhere: a switch interval of 1 us and a sleep before every ``acquire``.

    The profile hook applies to threads started inside the block (``threading.setprofile``).
    """
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threading.setprofile(_sleep_before_acquire)
    try:
        yield
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setswitchinterval(switch)


def _spin(stop: Any) -> None:
    """A CPU hog: spins until told to stop."""
    while not stop.is_set():
        pass


@contextmanager
def busy_cores() -> Iterator[None]:
    """One spinning process per core while the block runs; every one of them ends when it ends."""
    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    hogs = [spawn.Process(target=_spin, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    try:
        for hog in hogs:
            hog.start()
        yield
    finally:
        stop.set()
        for hog in hogs:
            if hog.pid is None:
                continue  # never started
            hog.join(5)
            if hog.is_alive():
                hog.kill()
                hog.join(5)


def _runqueue_wait_s() -> float:
    """Seconds this thread has spent runnable but not running (waiting for a CPU); 0 where Linux does not say."""
    try:
        with open("/proc/thread-self/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Ticker:
    """A task that sleeps 5 ms at a time and keeps the longest gap between its wake-ups (a loop stall).

    A gap counts the time the loop's thread ran or waited (for a lock, the GIL, I/O), not the time
    it was runnable but the machine had no free CPU: on a loaded machine the scheduler's delays are
    not stalls of ours. ``worst`` is that longest gap; ``worst_wall`` the same with the machine's
    delays left in, for the failure message.

    While it ticks, the objects that existed before are frozen out of the garbage collector
    (``gc.freeze``): a full collection over the test suite's heap (50 ms and more once torch and a
    thousand tests' leftovers are in it) is the interpreter's pause, not the loop's work, so a
    collection then walks only what the measured code allocates.
    """

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_wall = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, queued = time.monotonic(), _runqueue_wait_s()
        while True:
            await asyncio.sleep(0.005)
            now, queued_now = time.monotonic(), _runqueue_wait_s()
            self.worst_wall = max(self.worst_wall, now - last)
            self.worst = max(self.worst, now - last - (queued_now - queued))
            last, queued = now, queued_now

    def __enter__(self) -> Ticker:
        gc.collect()
        gc.freeze()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        gc.unfreeze()
