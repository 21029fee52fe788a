"""Embed a pipeline stage in your own program with the stage worker API.

Run the other stages with ``zmq-omni stage`` and this one as the talker::

    python examples/embed_stage.py examples/pipeline.yaml talker

SIGTERM or Ctrl-C stops it cleanly.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import numpy as np

from zmq_omni import StageWorker


def my_talker(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    """Per received chunk: hidden states in, codec codes out (None: nothing to send)."""
    hidden = payload.get("hidden")
    if hidden is None:
        return None
    pooled = hidden[: len(hidden) // 16 * 16].reshape(-1, 16, hidden.shape[1]).mean(axis=1)
    return {"codes": (np.abs(pooled[:, :4]) * 4096).astype(np.int32) % 1024}


def main(argv: list[str]) -> int:
    config, stage = argv[1], argv[2] if len(argv) > 2 else "talker"
    with StageWorker.from_pipeline(config, stage, fn=my_talker) as worker:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.stop())
        worker.run()  # returns after worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
