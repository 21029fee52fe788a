"""A process of stage 1 for tests/test_stage_endpoint.py: ``python -m tests.stage_endpoint_proc EXTRA_JSON KEYS``.

With ``KEYS`` empty it only holds its connector (the binder, until killed). Else it
gets each key in turn (polling, as vllm-omni does, a pause between keys so that the
others wait in the binder's mailbox) and prints ``key nbytes first-value`` for each,
then ``done``, its receiving part's class and whether it binds the endpoint now; it exits 0 when it got them all.
"""

from __future__ import annotations

import json
import sys
import time

from zmq_omni.connectors.zmq import ZmqConnector


def main(argv: list[str]) -> int:
    """Hold, or get every key."""
    extra, keys = json.loads(argv[0]), [k for k in argv[1].split(",") if k]
    connector = ZmqConnector(extra)
    print(f"up {type(connector._receiver).__name__}", flush=True)
    if not keys:
        sys.stdin.read()
        connector.close()
        return 0
    deadline = time.monotonic() + 60
    for key in keys:
        while (got := connector.get("0", "1", key)) is None:
            if time.monotonic() > deadline:
                print(f"missing {key}", flush=True)
                return 1
            time.sleep(0.002)
        value = got[0]["data"]
        print(f"{key} {value.nbytes} {int(value[0])}", flush=True)
        time.sleep(0.05)
    part = connector._receiver
    print(f"done {type(part).__name__} {'binds' if getattr(part, 'binds', False) else 'client'}", flush=True)
    connector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
