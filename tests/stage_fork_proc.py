"""The binder of stage 1 that forks after building its connector, for tests/test_stage_fork.py.

``python -m tests.stage_fork_proc EXTRA KEY``: builds its connector (it binds), prints ``up CLASS``,
forks. The child builds a connector from the same ``EXTRA`` and prints ``child CLASS``, then gets
``KEY`` (one blocking get of 20 s) and prints ``child got VALUE`` or ``child got None`` and whether it
binds now. The parent waits for stdin to end.
"""

from __future__ import annotations

import json
import os
import sys
import time

from zmq_omni.connectors.zmq import ZmqConnector


def main(argv: list[str]) -> int:
    """Bind, fork; the child becomes a process of the stage of its own."""
    extra, key = json.loads(argv[0]), argv[1]
    connector = ZmqConnector(extra)
    print(f"up {type(connector._bound.receiver).__name__}", flush=True)
    pid = os.fork()
    if pid == 0:
        child = ZmqConnector(extra)
        part = child._bound.receiver
        print(f"child {type(part).__name__}", flush=True)
        got = child.get_with_deadline("0", "1", key, deadline=time.monotonic() + 20)
        value = None if got is None else got[0]["x"]
        print(f"child got {value} {'binds' if getattr(part, 'binds', False) else 'client'}", flush=True)
        child.close()
        os._exit(0)
    sys.stdin.read()
    connector.close()
    os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
