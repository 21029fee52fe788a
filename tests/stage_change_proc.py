"""A process of stage 1 for tests/test_stage_change.py: ``python -m tests.stage_change_proc MODE EXTRA KEY [SECONDS]``.

Modes (each prints ``up <receiving part's class>`` first):

- ``hold``: holds its connector until the end of stdin.
- ``lend``: one polling get of KEY (the binder lends it when it comes), prints ``asked``, then
  ``lent`` once it is in this process's mailbox; then runs stdin commands, one a line: ``take``
  (poll KEY up to 5 s: ``got KEY`` or ``none``), ``rebound`` (wait up to 10 s until the binder's
  incarnation changed and the next binder answered this client's hello: ``rebound`` or ``stuck``;
  it reads the client's ``_binder_token`` and ``_heard``, the test's only look inside).
- ``poll``: polls KEY for SECONDS (``got KEY`` or ``none``, and ``binds``/``client``); prints ``bound``
  when, a client, it binds the endpoint since its binder died.
- ``block``: one blocking get of KEY with a SECONDS deadline (``got KEY`` or ``none``).
- ``askclose``: one polling get of KEY, then closes its connector (``closed``), the process living on.
- ``send``: a sender: puts KEY, prints ``put``; at a stdin line ``flush`` prints ``flush True|False``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from zmq_omni.connectors.zmq import ZmqConnector


def _say(*words: object) -> None:
    print(*words, flush=True)


def _poll(connector: ZmqConnector, key: str, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while (got := connector.get("0", "1", key)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def _wait_rebound(part: Any, token: object) -> bool:
    """The binder's incarnation changed and a pong of the next binder came after the change."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now_token = getattr(part, "_binder_token", None)
        if now_token is not None and now_token != token:
            heard = part._heard
            while time.monotonic() < deadline:
                if part._heard > heard:
                    return True
                time.sleep(0.01)
        time.sleep(0.01)
    return False


def _lend(connector: ZmqConnector, key: str) -> None:
    generation = connector.get_wakeup_generation()
    connector.get("0", "1", key)
    _say("asked")
    if connector.wait_for_change(generation, timeout=20) != generation:
        _say("lent")
    part = connector._bound.receiver
    token = getattr(part, "_binder_token", None)
    for line in sys.stdin:
        command = line.strip()
        if command == "take":
            got = _poll(connector, key, 5.0)
            _say(f"got {key}" if got is not None else "none")
        elif command == "rebound":
            _say("rebound" if _wait_rebound(part, token) else "stuck")


def main(argv: list[str]) -> int:
    """Run one mode."""
    mode, extra, key = argv[0], json.loads(argv[1]), argv[2]
    seconds = float(argv[3]) if len(argv) > 3 else 0.0
    connector = ZmqConnector(extra)
    _say("up", type(connector._bound.receiver).__name__)
    if mode == "lend":
        _lend(connector, key)
    elif mode == "poll":
        part, bound = connector._bound.receiver, False
        deadline = time.monotonic() + seconds
        while (got := connector.get("0", "1", key)) is None and time.monotonic() < deadline:
            if not bound and getattr(part, "binds", False):
                bound = True
                _say("bound")  # a client that binds since its binder died
            time.sleep(0.01)
        _say(f"got {key}" if got is not None else "none", "binds" if getattr(part, "binds", True) else "client")
    elif mode == "block":
        got = connector.get_with_deadline("0", "1", key, deadline=time.monotonic() + seconds)
        _say(f"got {key}" if got is not None else "none")
    elif mode == "askclose":
        connector.get("0", "1", key)
        connector.close()
        _say("closed")
    elif mode == "send":
        assert connector.put("0", "1", key, {"x": 1})[0]
        _say("put")
        for line in sys.stdin:
            if line.strip() == "flush":
                _say("flush", connector.flush(10))
    sys.stdin.read()
    connector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
