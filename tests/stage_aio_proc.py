"""A process of stage 1 whose connector is driven by its event loop, for tests/test_stage_aio.py.

``python -m tests.stage_aio_proc EXTRA``: ``AsyncConnector.create`` on ``EXTRA`` inside a running loop;
prints ``up`` (then holds it until stdin ends) or ``error TYPE MESSAGE``.
"""

from __future__ import annotations

import asyncio
import json
import sys

from zmq_omni.aio import AsyncConnector


async def run(extra: dict[str, object]) -> int:
    """Build on the loop, hold, close."""
    try:
        conn = AsyncConnector.create({"name": "ZmqConnector", "extra": extra})
    except Exception as exc:
        print(f"error {type(exc).__name__} {exc}", flush=True)
        return 0
    print("up", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await conn.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(run(json.loads(sys.argv[1]))))
