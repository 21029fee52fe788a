"""A ZmqConnector peer run as ``python -m tests.netns_peer`` inside a network namespace.

It prints one JSON object per line on stdout (``ready``, then ``done``) so the
test in the root namespace can follow it through a pipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tests.zmq_peers import digest, make_payload
from zmq_omni.connectors.zmq import ZmqConnector


def _say(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["send", "recv"])
    parser.add_argument("--config", required=True, help="the connector config, as JSON")
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=0.0, help="send: seconds between puts")
    parser.add_argument("--linger", type=float, default=0.0, help="recv: seconds to stay up after the last get")
    args = parser.parse_args(argv)
    config = json.loads(args.config)
    keys = [f"req{i}_0_0" for i in range(args.count)]
    with ZmqConnector(config) as conn:
        _say(event="ready", endpoint=conn.endpoint)
        if args.role == "send":
            results = []
            for seed, key in enumerate(keys):
                results.append(conn.put("0", "1", key, make_payload(args.size, seed))[0])
                time.sleep(args.interval)
            deadline = time.monotonic() + args.timeout
            while conn.health()["pending"] and time.monotonic() < deadline:
                time.sleep(0.02)
            failures = [{"key": f.key, "error": type(f.error).__name__} for f in conn.drain_failures()]
            _say(event="done", accepted=results, failures=failures, health=conn.health())
        else:
            deadline = time.monotonic() + args.timeout
            got: dict[str, str | None] = {}
            for key in keys:
                item = conn.get_with_deadline("0", "1", key, deadline=deadline)
                got[key] = None if item is None else digest(item[0])
            time.sleep(args.linger)  # a late duplicate would land in the mailbox meanwhile
            _say(event="done", digests=got, health=conn.health())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
