"""A process of stage 1 for tests/test_stage_endpoint.py: ``python -m tests.stage_endpoint_proc EXTRA KEYS [WAIT_S]``.

With ``KEYS`` empty it only holds its connector (the binder, until killed). Else it
gets each key in turn (polling, as vllm-omni does, a pause between keys so that the
others wait in the binder's mailbox) and prints ``key nbytes first-value`` for each,
then ``done``, its receiving part's class and whether it binds the endpoint now; it exits 0 when it got them all.
With ``WAIT_S`` each key is one blocking get with that deadline instead (``missing`` if it returns None);
with ``$SLOW_SHM_OPEN_S`` each shared-memory payload takes that much longer to map (``opening`` is
printed as it starts); with ``once`` each key is asked once (one polling get), then it prints
``asked`` and holds its connector until a line on stdin (then it gets every key with a 5 s blocking
get) or the end of stdin (it exits).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import ShmReceive


def _get_one(connector: ZmqConnector, key: str, wait_s: float | None) -> Any:
    """One blocking get of ``key`` (``wait_s``), or polls for up to 60 s; None when it never came."""
    if wait_s is not None:
        return connector.get_with_deadline("0", "1", key, deadline=time.monotonic() + wait_s)
    deadline = time.monotonic() + 60
    while (got := connector.get("0", "1", key)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.002)
    return got


def _slow_opens(seconds: float) -> None:
    """Each shared-memory payload a get maps takes ``seconds`` longer; ``opening`` is printed as it starts."""
    original = ShmReceive.open

    def open_slowly(self: ShmReceive, loc: bytes) -> Any:
        print("opening", flush=True)
        time.sleep(seconds)
        return original(self, loc)

    ShmReceive.open = open_slowly  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """Hold, or get every key."""
    if os.environ.get("SLOW_SHM_OPEN_S"):
        _slow_opens(float(os.environ["SLOW_SHM_OPEN_S"]))
    extra, keys = json.loads(argv[0]), [k for k in argv[1].split(",") if k]
    once = argv[2:] == ["once"]
    wait_s = float(argv[2]) if len(argv) > 2 and not once else None
    connector = ZmqConnector(extra)
    print(f"up {type(connector._bound.receiver).__name__}", flush=True)
    if once:
        for key in keys:
            connector.get("0", "1", key)
        print("asked", flush=True)
        if sys.stdin.readline():
            wait_s = 5.0
        else:
            connector.close()
            return 0
    if not keys:
        sys.stdin.read()
        connector.close()
        return 0
    for key in keys:
        got = _get_one(connector, key, wait_s)
        if got is None:
            print(f"missing {key}", flush=True)
            return 1
        value = got[0]["data"]
        print(f"{key} {value.nbytes} {int(value[0])}", flush=True)
        time.sleep(0.05)
    part = connector._bound.receiver
    print(f"done {type(part).__name__} {'binds' if getattr(part, 'binds', False) else 'client'}", flush=True)
    connector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
