"""Peer processes of the asyncio tests: ``python -m tests.aio_peers NAME JSON_ARGS``.

Each prints one JSON line per event on stdout (``{"event": ...}``) and reads
``go`` / ``quit`` lines on stdin, so the test drives it without a
multiprocessing queue (whose feeder thread would skew the thread counts) and
shows its output when it fails.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

from tests.zmq_peers import make_payload


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def wait_for(line: str) -> None:
    for got in sys.stdin:
        if got.strip() == line:
            return
    raise SystemExit(f"stdin closed before {line!r}")


def sizes(n: int) -> list[int]:
    """Payload sizes: mostly small (batched), every 97th large (frames, or shared memory on one host)."""
    return [200_000 if i % 97 == 0 else 16 + (i * 37) % 3000 for i in range(n)]


def putter(config: dict[str, Any], n: int) -> None:
    """Put ``n`` payloads (key ``k{i}``, seed ``i``) on ``go``; then wait for delivery and ``quit``."""
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector(config) as conn:
        say("ready", endpoint=conn.endpoint)
        wait_for("go")
        bad = []
        for i, size in enumerate(sizes(n)):
            ok, _, _ = conn.put("0", "1", f"k{i}", make_payload(size, i))
            if not ok:
                bad.append(i)
        delivered = conn.flush(60.0)
        failures = [f.reason for f in conn.drain_failures()]
        say("sent", bad=bad, delivered=delivered, failures=failures)
        wait_for("quit")


def echo(config: dict[str, Any], n: int, face: str) -> None:
    """Stage b on asyncio: take ``p{i}`` from a and put it back to a as ``q{i}``, ``n`` times.

    ``face``: ``loop`` for a connector driven by the event loop (``AsyncConnector.create``),
    ``threaded`` for a threaded one wrapped.
    """
    from zmq_omni.aio import AsyncConnector
    from zmq_omni.connectors.zmq import ZmqConnector

    async def main() -> None:
        if face == "loop":
            conn = AsyncConnector.create({"name": "ZmqConnector", "extra": config})
        else:
            conn = AsyncConnector(ZmqConnector(config))
        async with conn:
            say("ready")
            for i in range(n):
                got = await conn.get("a", "b", f"p{i}", timeout=60)
                if got is None:
                    say("echoed", missing=i, delivered=False)
                    return
                ok, _, _ = await conn.put("b", "a", f"q{i}", got[0])
                if not ok:
                    say("echoed", refused=i, failures=[f.reason for f in conn.connector.drain_failures()])
                    return
            say("echoed", delivered=await conn.flush(30))

    asyncio.run(main())


def chunk_source(endpoints: dict[str, str], requests: int, chunks: int) -> None:
    """Stage 0 with the threaded chunk manager: ``chunks`` chunks of each request, the last final."""
    from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager
    from zmq_omni.connectors.zmq import ZmqConnector

    conn = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints})
    manager = OmniChunkManager(ChunkManagerConfig(stage_id="0"), conn)
    try:
        say("ready")
        wait_for("go")
        for chunk in range(chunks):
            for r in range(requests):
                values = np.full((1, 4), r * 1000 + chunk, dtype=np.float32)
                manager.save_async(f"req{r}", {"x": values, "n": chunk}, is_final=chunk == chunks - 1)
        deadline = time.monotonic() + 60
        while manager.pending_state()["queued"] and time.monotonic() < deadline:
            time.sleep(0.01)
        say("sent", delivered=conn.flush(60.0), failed=sorted(manager.collect_failed_send_request_ids()))
        wait_for("quit")
    finally:
        manager.shutdown()


def chunk_sink(endpoints: dict[str, str], requests: int, chunks: int) -> None:
    """Stage 2 on asyncio: every request's stream at once; report each chunk id and value seen, in order."""
    from zmq_omni.aio import AsyncChunkStream, AsyncConnector

    async def main() -> None:
        async with AsyncConnector.create(
            {"name": "ZmqConnector", "extra": {"stage_id": "2", "role": "receiver", "endpoints": endpoints}}
        ) as conn:
            say("ready")

            async def one(r: int) -> list[list[float]]:
                seen = []
                async for chunk in AsyncChunkStream(conn, "1", "2", f"req{r}", stall_timeout_s=60):
                    seen.append([chunk.chunk_id, float(chunk.data["x"][0, 0]), chunk.final])
                return seen

            results = await asyncio.gather(*(one(r) for r in range(requests)))
            say("received", streams=results)

    asyncio.run(main())


if __name__ == "__main__":
    globals()[sys.argv[1]](**json.loads(sys.argv[2]))
