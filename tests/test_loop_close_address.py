"""A loop-driven connector's synchronous close() keeps its promise about the bound address.

From another thread it returns with the address free; on the loop's thread it returns with the
address free or a WARNING naming the endpoint; either way a rebind in this process right after
it waits for the old listener instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import listening
from zmq_omni.transport._sockets import reserve_loopback_port

pytestmark = pytest.mark.timeout(120)

ROUNDS = 25


def _endpoint(transport: str, tmp: Path) -> str:
    return f"ipc://{tmp}/r.sock" if transport == "ipc" else f"tcp://127.0.0.1:{reserve_loopback_port()}"


def _extra(endpoint: str) -> dict[str, Any]:
    return {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}, "shm": "off"}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_close_on_the_loop_frees_the_address_or_warns_and_a_rebind_waits(
    transport: str, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = _endpoint(transport, short_tmp)
    spec = {"name": "ZmqConnector", "extra": _extra(endpoint)}
    silent: list[int] = []

    async def main() -> None:
        rc = AsyncConnector.create(spec)
        for i in range(ROUNDS):
            gets = [asyncio.ensure_future(rc.get("0", "1", f"never{i}-{j}", timeout=30)) for j in range(3)]
            await asyncio.sleep(0.002)
            caplog.clear()
            rc.close()  # the connector's synchronous close(), on the loop's thread
            if listening(endpoint) and not any(
                r.levelno == logging.WARNING and endpoint in r.getMessage() and "aclose" in r.getMessage()
                for r in caplog.records
            ):
                silent.append(i)
            assert await asyncio.wait_for(asyncio.gather(*gets), 5) == [None] * 3
            rc = AsyncConnector.create(spec)  # at once, in this process: waits for the old listener
        await rc.aclose()
        assert not listening(endpoint)

    with caplog.at_level(logging.WARNING, logger="zmq_omni"):
        asyncio.run(main())
    assert silent == []


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_close_from_another_thread_returns_with_the_address_free(transport: str, short_tmp: Path) -> None:
    endpoint = _endpoint(transport, short_tmp)
    extra = _extra(endpoint)
    still_bound = 0
    for _ in range(ROUNDS):
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def run(box: dict[str, Any], ready: threading.Event) -> None:
            rc = AsyncConnector.create({"name": "ZmqConnector", "extra": extra})
            box["rc"] = rc
            gets = [asyncio.ensure_future(rc.get("0", "1", f"n{j}", timeout=30)) for j in range(3)]
            ready.set()
            box["res"] = await asyncio.gather(*gets)

        thread = threading.Thread(target=loop.run_until_complete, args=(run(box, ready),))
        thread.start()
        try:
            assert ready.wait(10)
            time.sleep(0.002)
            box["rc"].connector.close()  # from this thread: handed to the loop
            still_bound += listening(endpoint)
            ZmqConnector(extra).close()  # a threaded rebind from the closing thread, at once
        finally:
            thread.join(10)
            box["rc"].close()  # (the wrapper; its connector closed already)
            loop.close()
        assert box["res"] == [None] * 3
    assert still_bound == 0
