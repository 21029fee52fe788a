"""Closing the connector an ``AsyncConnector`` wraps, without blocking its event loop.

A connector driven by the loop closes on the loop (its acknowledgements were
awaited first, so without a linger); one driven by threads closes in a one-shot
thread, since its close may wait for its I/O thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..connectors import Lingering, OmniConnectorBase
from ..connectors.zmq import ZmqConnector
from ..transport import listening

log = logging.getLogger("zmq_omni.aio")


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread; None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def close_without_linger(connector: OmniConnectorBase) -> None:
    """Close a connector whose acknowledgements were already waited for (on the loop)."""
    if isinstance(connector, ZmqConnector):
        connector.close_with_linger(0.0, address_awaited=True)  # (aclose awaits the address: address_freed)
    elif isinstance(connector, Lingering):
        connector.close_with_linger(0.0)
    else:
        connector.close()


async def close_in_thread(connector: OmniConnectorBase) -> None:
    """Close ``connector`` in a one-shot thread; the loop runs on until it is closed.

    Raises:
        Exception: what the connector's ``close`` raised.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def close() -> None:
        error: BaseException | None = None
        try:
            connector.close()
        except BaseException as exc:  # raised by the awaiting aclose, on the loop
            error = exc
        try:
            loop.call_soon_threadsafe(finish, error)
        except RuntimeError:  # the loop closed meanwhile: nobody awaits the close any more
            if error is not None:
                log.error("closing %r failed", connector, exc_info=error)

    threading.Thread(target=close, name="zmq-omni-aio-close", daemon=True).start()
    await done


async def address_freed(endpoint: str | None, wait_s: float = 1.0) -> None:
    """Wait, suspended, until nothing listens on ``endpoint`` any more (at most ``wait_s``; None: nothing to wait for).

    Something still listening after ``wait_s`` is logged as a WARNING naming the endpoint.

    A closed socket's listener is closed by libzmq's I/O thread a moment after ``zmq_close``: an
    event loop waits for that here rather than in the close, which runs on the loop. libzmq gives
    no event for it short of a socket monitor, so the wait looks every 1 ms (a connect probe).
    """
    if endpoint is None:
        return
    deadline = time.monotonic() + wait_s
    while listening(endpoint):
        if time.monotonic() >= deadline:
            log.warning("closed, but something still listens on %s after %.1f s: a bind there fails", endpoint, wait_s)
            return
        await asyncio.sleep(0.001)
