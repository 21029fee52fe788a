"""A process of stage 0 in pull mode for tests/test_stage_pull.py.

``python -m tests.stage_pull_proc EXTRA PREFIX COUNT PACE_S``

It builds its connector from ``EXTRA`` and prints ``up binds`` or ``up client``; then it puts ``COUNT``
keys ``PREFIX-i`` (every fourth one above the shared-memory threshold), ``PACE_S`` apart, printing
``ok KEY`` for each confirmed put and ``failed KEY`` for each refused one; then ``flushed BOOL PENDING
BINDS SHM_PUTS`` once every put was fetched (or 30 s passed). It closes its connector when stdin ends.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from zmq_omni.connectors.zmq import ZmqConnector

BIG = 700 << 10


def payload(key: str, index: int) -> dict[str, object]:
    """The payload of ``key``: its name and an array (large every fourth key)."""
    size = BIG if index % 4 == 2 else 64
    return {"key": key, "data": np.full(size // 4, index, dtype=np.int32)}


def main(argv: list[str]) -> int:
    """Put, report, hold until stdin ends."""
    extra, prefix, count, pace = json.loads(argv[0]), argv[1], int(argv[2]), float(argv[3])
    connector = ZmqConnector(extra)
    part = connector._bound.server
    print(f"up {'binds' if getattr(part, 'binds', True) else 'client'}", flush=True)
    for i in range(count):
        key = f"{prefix}-{i}"
        ok, _, _ = connector.put("0", "1", key, payload(key, i))
        print(f"{'ok' if ok else 'failed'} {key}", flush=True)
        time.sleep(pace)
    flushed = connector.flush(30.0)
    health = connector.health()
    print(
        f"flushed {flushed} {health.get('pending')} {getattr(part, 'binds', True)} {health.get('shm_puts')}", flush=True
    )
    sys.stdin.read()
    connector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
