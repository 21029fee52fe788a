"""The soak test's stage processes: thinker -> talker -> vocoder as StageWorker processes.

Run as ``python -m tests.soak_stages CONFIG STAGE STATUS_PATH`` (tests/soak.py starts them).
Each process serves its stage until SIGTERM and writes its ``StageWorker.health()``
(plus its pid) as JSON to ``STATUS_PATH`` a few times a second, so the soak can
watch windows, mailboxes and pending sets without touching the stage.

What a request does is decided by its id, so the driver picks the fault:

* the thinker streams ``payload["n"]`` chunks ``{"x": chunk_values(seed, k), "seq": [k]}``;
* the talker sends ``x * 2 + 1`` on; for an id ending in ``-cancel`` it cancels the
  request (``StageWorker.cancel``) once it has seen chunk ``CANCEL_AT``, mid-stream:
  the thinker goes on streaming chunks nobody will read;
* the vocoder passes chunks through; for an id ending in ``-raise`` its function
  raises at chunk ``RAISE_AT``: the talker goes on streaming chunks nobody will read.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROWS = 16
WIDTH = 256  # a chunk's x is ROWS x WIDTH float32: 16 KiB
CANCEL_AT = 2
RAISE_AT = 3
CANCEL_REASON = "the client went away"
RAISE_MESSAGE = "vocoder exploded on purpose"

_worker: Any = None  # this process's StageWorker (the talker cancels through it)


def chunk_values(seed: int, chunk: int) -> np.ndarray:
    """The thinker's chunk ``chunk`` of the request with ``seed``: exact in float32 (all < 2**23)."""
    base = float((seed % 4096) * 1000 + chunk)
    values: np.ndarray = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) + np.float32(base)
    return values


def _seq(payload: dict[str, Any]) -> list[int]:
    return [int(k) for k in payload.get("seq", [])]


def thinker(request_id: str, payload: dict[str, Any], is_final: bool) -> Iterator[dict[str, Any]]:
    seed = int(payload["seed"])
    for k in range(int(payload["n"])):
        yield {"x": chunk_values(seed, k), "seq": [k]}


def talker(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    seq = _seq(payload)
    if request_id.endswith("-cancel") and seq and max(seq) >= CANCEL_AT:
        _worker.cancel(request_id, CANCEL_REASON)
        return None
    if "x" not in payload:
        return None
    return {"x": payload["x"] * 2 + 1, "seq": seq}


def vocoder(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    seq = _seq(payload)
    if request_id.endswith("-raise") and seq and max(seq) >= RAISE_AT:
        raise RuntimeError(RAISE_MESSAGE)
    if "x" not in payload:
        return None
    return {"x": payload["x"], "seq": seq}


FUNCTIONS = {"thinker": thinker, "talker": talker, "vocoder": vocoder}


def _write_status(path: Path, status: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status, default=str), encoding="utf-8")
    os.replace(tmp, path)


def main(config: str, stage: str, status_path: str) -> int:
    global _worker
    from zmq_omni import StageWorker

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {stage} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("zmq_omni.stages").setLevel(logging.INFO)  # admissions, restarts and cancels, for a failing run
    worker = StageWorker.from_pipeline(config, stage, fn=FUNCTIONS[stage])
    _worker = worker
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
    path = Path(status_path)
    done = threading.Event()

    def report() -> None:
        while not done.wait(0.25):
            _write_status(path, {"pid": os.getpid(), "at": time.time(), **worker.health()})

    _write_status(path, {"pid": os.getpid(), "at": time.time(), **worker.health()})
    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        worker.run()
    finally:
        done.set()
        reporter.join(2)
        final = {"pid": os.getpid(), "at": time.time(), **worker.health()}
        worker.close()
        _write_status(path, {**final, "closed": True})
    print(f"soak stage {stage}: stopped {json.dumps(worker.stats)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
