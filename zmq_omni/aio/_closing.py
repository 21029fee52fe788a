"""Closing the connector an ``AsyncConnector`` wraps, without blocking its event loop.

A connector driven by the loop closes on the loop (its acknowledgements were
awaited first, so without a linger); one driven by threads closes in a one-shot
thread, since its close may wait for its I/O thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from ..connectors import Lingering, OmniConnectorBase
from ..transport import listening


def close_without_linger(connector: OmniConnectorBase) -> None:
    """Close a connector whose acknowledgements were already waited for (on the loop)."""
    if isinstance(connector, Lingering):
        connector.close_with_linger(0.0)
    else:
        connector.close()


async def close_in_thread(connector: OmniConnectorBase) -> None:
    """Close ``connector`` in a one-shot thread; the loop runs on until it is closed."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def close() -> None:
        try:
            connector.close()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(finish)

    threading.Thread(target=close, name="zmq-omni-aio-close", daemon=True).start()
    await done


async def address_freed(endpoint: str | None, wait_s: float = 1.0) -> None:
    """Wait, suspended, until nothing listens on ``endpoint`` any more (at most ``wait_s``; None: nothing to wait for).

    A closed socket's listener is closed by libzmq's I/O thread a moment after ``zmq_close``: an
    event loop waits for that here rather than in the close, which runs on the loop.
    """
    if endpoint is None:
        return
    deadline = time.monotonic() + wait_s
    while listening(endpoint) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
