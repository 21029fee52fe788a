"""Closing: aclose cancelled in its linger still closes, refuses a foreign loop and raises a failed close;
an address still in use after a close is logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from zmq_omni.aio import AsyncConnector
from zmq_omni.aio._closing import address_freed
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.transport import _sockets, listening
from zmq_omni.transport._sockets import close_bound

from .conftest import wait_until


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


class _CloseFails(InProcConnector):
    """An in-process connector whose close raises after it closed."""

    def close(self) -> None:
        super().close()
        raise OSError("close failed")


def test_aclose_raises_what_a_threaded_close_raised() -> None:
    async def main() -> None:
        conn = AsyncConnector(_CloseFails({"namespace": uuid.uuid4().hex}))
        with pytest.raises(OSError, match="close failed"):
            await conn.aclose()
        assert conn.closed

    asyncio.run(main())


@pytest.fixture
def listener(short_tmp: Path) -> Iterator[str]:
    """An ipc endpoint something listens on throughout the test (a plain Unix socket)."""
    path = str(short_tmp / "held.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
        held.bind(path)
        held.listen()
        yield f"ipc://{path}"


def test_close_bound_warns_when_the_address_stays_in_use(listener: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zmq_omni.transport"):
        close_bound(None, listener, wait_s=0.05)
    assert f"still listens on {listener}" in caplog.text


def test_address_freed_warns_when_the_address_stays_in_use(listener: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zmq_omni.aio"):
        asyncio.run(address_freed(listener, wait_s=0.05))
    assert f"still listens on {listener}" in caplog.text


def test_a_loop_busy_through_a_close_from_another_thread_then_stopped_still_closes(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"ipc://{short_tmp}/busy.sock"
    users = _sockets._shared_users
    loop = asyncio.new_event_loop()
    try:

        async def build() -> AsyncConnector:
            return AsyncConnector.create(
                {
                    "name": "ZmqConnector",
                    "extra": {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}},
                }
            )

        conn = loop.run_until_complete(build())
        closer = threading.Thread(target=conn.connector.close)

        def busy_then_stop() -> None:
            closer.start()
            closer.join()  # the close hands its stop to this busy loop, and gives up waiting for it
            loop.stop()  # (the stop handed over is still queued: the loop ends without running it)

        loop.call_soon(busy_then_stop)
        with caplog.at_level(logging.ERROR, logger="zmq_omni.aio"):
            loop.run_forever()
        assert "its sockets stay open" in caplog.text
        assert conn.connector.closed
        assert wait_until(lambda: not listening(endpoint))
        assert wait_until(lambda: _sockets._shared_users == users)  # the context's hold released
        conn.close()
    finally:
        loop.close()
