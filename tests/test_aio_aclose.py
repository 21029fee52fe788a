"""``AsyncConnector.aclose``: cancelled in its linger it still closes; awaited on a foreign loop it refuses."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import pytest

from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.inproc import InProcConnector


def test_aclose_cancelled_in_its_linger_still_closes(short_tmp: Path) -> None:
    async def main() -> None:
        conn = AsyncConnector.create(
            {
                "name": "ZmqConnector",
                "extra": {
                    "role": "sender",
                    "from_stage": 0,
                    "to_stage": 1,
                    "endpoints": {"1": f"ipc://{short_tmp}/nobody.sock"},  # no receiver: nothing confirms the put
                    "close_timeout_s": 30,
                    "delivery_timeout_s": 60,
                },
            }
        )
        ok, _, _ = await conn.put("0", "1", "k", {"a": 1})
        assert ok
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.aclose(), 0.2)  # cancelled while it lingers
        assert conn.connector.closed
        assert [(f.op, f.key) for f in conn.drain_failures()] == [("put", "k")]
        await conn.aclose()  # (closed: returns)

    asyncio.run(main())


def test_aclose_on_another_running_loop_refuses() -> None:
    owner = asyncio.new_event_loop()
    thread = threading.Thread(target=owner.run_forever, daemon=True)
    thread.start()
    conn = AsyncConnector(InProcConnector({"namespace": uuid.uuid4().hex}))
    try:
        bound = asyncio.run_coroutine_threadsafe(conn.get("0", "1", "k", timeout=0), owner)
        assert bound.result(5) is None  # bound to ``owner`` now
        with pytest.raises(RuntimeError, match="another running event loop"):
            asyncio.run(conn.aclose())
        assert not conn.closed
        asyncio.run_coroutine_threadsafe(conn.aclose(), owner).result(5)
        assert conn.closed
    finally:
        owner.call_soon_threadsafe(owner.stop)
        thread.join(5)
        owner.close()
