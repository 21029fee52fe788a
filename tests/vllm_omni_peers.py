"""Processes that use our connectors the way vllm-omni's orchestrator and stage workers do.

Run as ``python -m tests.vllm_omni_peers ROLE CONFIG_JSON``. Lines on stdin and
stdout are JSON: the pipe between the two processes is the control plane
vllm-omni's orchestrator forwards ``connector_metadata`` over.

* ``orchestrator``: builds its connector from the edge's ``extra`` as is (no role,
  no stage id: vllm-omni's ``create_connector(spec)``), puts ``count`` payloads
  under ``str(request_id)`` and prints ``{"key", "metadata"}`` per put that returned ok.
* ``stage``: builds its connector from the ``extra`` given, prints ``{"ready": endpoint}``,
  then for each line read calls ``get`` ONCE with that metadata, as
  ``try_recv_via_connector`` does, and finally prints a summary.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np


def payload(i: int) -> dict[str, Any]:
    """What vllm-omni's ``try_send_via_connector`` puts: engine inputs, sampling params, metadata."""
    # Every 20th request is large enough to take the same-host shared-memory path.
    n = (1 << 18) if i % 20 == 0 else 64 + i
    return {
        "engine_inputs": {"prompt_token_ids": list(range(i % 7 + 1)), "hidden": np.full(n, i, dtype=np.float32)},
        "sampling_params": {"temperature": 0.7, "max_tokens": 16 + i},
        "metadata": {"original_prompt": f"prompt {i}", "stage_transition": [0, 1], "timestamp": float(i)},
    }


def check(i: int, got: Any) -> bool:
    """True when ``got`` is exactly ``payload(i)``."""
    want = payload(i)
    hidden = got["engine_inputs"]["hidden"]
    return bool(
        np.array_equal(hidden, want["engine_inputs"]["hidden"])
        and got["engine_inputs"]["prompt_token_ids"] == want["engine_inputs"]["prompt_token_ids"]
        and got["sampling_params"] == want["sampling_params"]
        and got["metadata"]["original_prompt"] == want["metadata"]["original_prompt"]
    )


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def orchestrator(config: dict[str, Any]) -> None:
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector(config["extra"]) as conn:
        for i in range(config["count"]):
            ok, _, metadata = conn.put(
                from_stage=config["from_stage"], to_stage=config["to_stage"], put_key=str(i), data=payload(i)
            )
            if ok:
                _say({"key": str(i), "metadata": metadata})
            else:
                _say({"key": str(i), "failed": True})
        # Keep pull-mode payloads served (and push-mode ones resent) until the stage has them all.
        done = sys.stdin.readline()
        _say({"bye": done.strip(), "failures": [f.reason for f in conn.drain_failures()]})


def stage(config: dict[str, Any]) -> None:
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector(config["extra"]) as conn:
        _say({"ready": conn.endpoint, "stage_id": conn.stage_id})
        got, bad, missing = 0, [], []
        for line in sys.stdin:
            task = json.loads(line)
            if task.get("end"):
                break
            key = task["key"]
            result = conn.get(config["from_stage"], config["to_stage"], key, metadata=task["metadata"])
            if result is None:
                missing.append(key)
            elif check(int(key), result[0]):
                got += 1
            else:
                bad.append(key)
        _say({"got": got, "bad": bad, "missing": missing, "failures": [f.reason for f in conn.drain_failures()]})


if __name__ == "__main__":
    {"orchestrator": orchestrator, "stage": stage}[sys.argv[1]](json.loads(sys.argv[2]))
