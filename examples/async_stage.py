"""An asyncio pipeline stage: receive each request's chunks, transform them, put them downstream.

Run it::

    python examples/async_stage.py

It starts three stages over ZeroMQ (``ipc://`` sockets in a temp directory):
stage 0 streams three requests in chunks, stage 1 is the async stage below
(``talker``), stage 2 checks what arrives. In a deployment each stage is its
own process; only their connectors' endpoints change. Stage 1 could just as
well receive from a stage that runs the threaded ``OmniChunkManager``: the
keys and chunk format are the same.
"""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np

from zmq_omni.aio import AsyncChunkSender, AsyncChunkStream, AsyncConnector

REQUESTS = ["req-a", "req-b", "req-c"]
CHUNKS = 8


def connector_spec(stage: str, role: str, endpoints: dict[str, str]) -> dict[str, object]:
    return {"name": "ZmqConnector", "extra": {"stage_id": stage, "role": role, "endpoints": endpoints}}


async def talker(conn: AsyncConnector, request_id: str) -> None:
    """Stage 1, one request: every chunk from stage 0 in order, transformed, on to stage 2."""
    downstream = AsyncChunkSender(conn, "1", "2", request_id)
    async for chunk in AsyncChunkStream(conn, "0", "1", request_id, stall_timeout_s=30):
        hidden = chunk.data["hidden"]
        codes = (np.abs(hidden) * 100).astype(np.int32) % 1024  # the model step would run here
        await downstream.send({"codes": codes, "chunk": chunk.chunk_id}, final=chunk.final)


async def source(conn: AsyncConnector, request_id: str) -> None:
    """Stage 0, one request: CHUNKS chunks of hidden states, the last one final."""
    sender = AsyncChunkSender(conn, "0", "1", request_id)
    rng = np.random.default_rng(sum(map(ord, request_id)))
    for n in range(CHUNKS):
        await sender.send({"hidden": rng.standard_normal((4, 16), dtype=np.float32)}, final=n == CHUNKS - 1)


async def sink(conn: AsyncConnector, request_id: str) -> list[int]:
    """Stage 2, one request: the chunk ids as they arrive."""
    return [chunk.data["chunk"] async for chunk in AsyncChunkStream(conn, "1", "2", request_id)]


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="zo-") as tmp:
        ep1, ep2 = f"ipc://{tmp}/stage1.sock", f"ipc://{tmp}/stage2.sock"
        async with (
            AsyncConnector.create(connector_spec("2", "receiver", {"2": ep2})) as stage2,
            AsyncConnector.create(connector_spec("1", "dual", {"1": ep1, "2": ep2})) as stage1,
            AsyncConnector.create(connector_spec("0", "sender", {"1": ep1})) as stage0,
        ):
            # One task per request on each stage: thousands of requests wait on one event loop, no threads.
            received = await asyncio.gather(
                *(sink(stage2, rid) for rid in REQUESTS),
                *(talker(stage1, rid) for rid in REQUESTS),
                *(source(stage0, rid) for rid in REQUESTS),
            )
        orders = received[: len(REQUESTS)]
        assert all(order == list(range(CHUNKS)) for order in orders), orders
        print(f"stage 2 received {len(REQUESTS)} requests, every chunk in order")


if __name__ == "__main__":
    asyncio.run(main())
