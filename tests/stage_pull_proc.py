"""A process of stage 0 in pull mode for tests/test_stage_pull.py.

``python -m tests.stage_pull_proc EXTRA PREFIX COUNT PACE_S [SIZE FLUSH_S]``

It builds its connector from ``EXTRA`` and prints ``up binds`` or ``up client``; then it puts ``COUNT``
keys ``PREFIX-i`` (every fourth one above the shared-memory threshold; with ``SIZE``, each of ``SIZE``
bytes, after a line on stdin), ``PACE_S`` apart, printing ``ok KEY`` for each confirmed put and
``failed KEY`` for each refused one; then ``flushed BOOL PENDING BINDS SHM_PUTS`` once every put was
fetched (or ``FLUSH_S``, default 30 s, passed). It closes its connector when stdin ends.

``python -m tests.stage_pull_proc fetch EXTRA KEY WAIT_S``: a process of stage 1 that prints ``up``,
and after a line on stdin prints ``asking`` and fetches ``KEY`` for up to ``WAIT_S``, then prints
``got KEY`` or ``none``; it closes its connector and ends.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from zmq_omni.connectors.zmq import ZmqConnector

BIG = 700 << 10


def payload(key: str, index: int, size: int | None = None) -> dict[str, object]:
    """The payload of ``key``: its name and an array (of ``size`` bytes, else large every fourth key)."""
    size = size or (BIG if index % 4 == 2 else 64)
    return {"key": key, "data": np.full(size // 4, index, dtype=np.int32)}


def main(argv: list[str]) -> int:
    """Put, report, hold until stdin ends (or fetch, see the module docstring)."""
    if argv[0] == "fetch":
        return fetch(json.loads(argv[1]), argv[2], float(argv[3]))
    extra, prefix, count, pace = json.loads(argv[0]), argv[1], int(argv[2]), float(argv[3])
    size = int(argv[4]) if len(argv) > 4 else None
    connector = ZmqConnector(extra)
    part = connector._bound.server
    print(f"up {'binds' if getattr(part, 'binds', True) else 'client'}", flush=True)
    if size is not None:
        sys.stdin.readline()
    for i in range(count):
        key = f"{prefix}-{i}"
        ok, _, _ = connector.put("0", "1", key, payload(key, i, size))
        print(f"{'ok' if ok else 'failed'} {key}", flush=True)
        time.sleep(pace)
    flushed = connector.flush(float(argv[5]) if len(argv) > 5 else 30.0)
    health = connector.health()
    print(
        f"flushed {flushed} {health.get('pending')} {getattr(part, 'binds', True)} {health.get('shm_puts')}", flush=True
    )
    sys.stdin.read()
    connector.close()
    return 0


def fetch(extra: dict[str, object], key: str, wait_s: float) -> int:
    """Fetch ``key`` once told to, report it."""
    connector = ZmqConnector(extra)
    try:
        print("up", flush=True)
        sys.stdin.readline()
        print("asking", flush=True)
        got = connector.get_with_deadline("0", "1", key, deadline=time.monotonic() + wait_s)
        print(f"got {got[0]['key']}" if got is not None else "none", flush=True)
    finally:
        connector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
