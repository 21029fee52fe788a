"""Stage processes of the three-stage chunk pipeline test (run with multiprocessing spawn).

Each stage builds a ZmqConnector + OmniChunkManager, runs, and writes a JSON
report to ``out``. Stage 0 streams CHUNKS chunks for each request (and
cancels ``req-cancel`` mid-stream); stage 1 assembles, transforms (x*2+1) and
streams on; stage 2 checks content and order.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

CHUNKS = 50
WIDTH = 4


def request_ids(n: int) -> list[str]:
    return [f"req-{i}" for i in range(n)]


def chunk_values(request_index: int, chunk: int) -> np.ndarray:
    base = (request_index * 1000 + chunk) * WIDTH
    return np.arange(base, base + WIDTH, dtype=np.float32).reshape(1, WIDTH)


def _manager(stage: int, endpoints: dict[str, str], role: str, opts: dict[str, Any]) -> Any:
    from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
    from zmq_omni.connectors import create_connector

    conn = create_connector(
        {
            "name": "ZmqConnector",
            "extra": {
                "stage_id": str(stage),
                "role": role,
                "endpoints": endpoints,
                "mode": "push",
                "put_timeout_s": opts.get("put_timeout_s", 2.0),
                "delivery_timeout_s": opts.get("delivery_timeout_s", 5.0),
            },
        }
    )
    retry = RetryPolicy(attempts=3, deadline_s=opts.get("retry_deadline_s", 3.0), backoff_initial_s=0.05)
    cfg = ChunkManagerConfig(stage_id=str(stage), retry=retry, stall_timeout_s=opts.get("stall_timeout_s", 20.0))
    return OmniChunkManager(cfg, conn)


def _finish(manager: Any, out: str, report: dict[str, Any]) -> None:
    started = time.monotonic()
    manager.shutdown()
    report["shutdown_s"] = time.monotonic() - started
    with open(out, "w") as f:
        json.dump(report, f)


def stage0(endpoints: dict[str, str], n: int, out: str, opts: dict[str, Any]) -> None:
    manager = _manager(0, endpoints, "sender", opts)
    ids = request_ids(n)
    finished: set[str] = set()
    failed: dict[str, str] = {}
    failed_at: dict[str, float] = {}
    pace = opts.get("pace_s", 0.0)
    for chunk in range(CHUNKS):
        for i, rid in enumerate(ids):
            if rid not in failed:
                manager.save_async(rid, {"x": chunk_values(i, chunk), "seq": [chunk]}, is_final=chunk == CHUNKS - 1)
        if chunk == 20:
            manager.save_async("req-cancel", {"x": chunk_values(999, 0), "seq": [0]})
            manager.cancel("req-cancel")
        for rid, reason in manager.collect_failed_send_request_ids().items():
            failed[rid] = reason
            failed_at[rid] = time.time()
        if pace:
            time.sleep(pace)  # a model producing chunks at a steady rate
    deadline = time.monotonic() + opts.get("drain_s", 60)
    while len(finished | set(failed)) < n + 1 and time.monotonic() < deadline:
        manager.wait_for_progress(0.1)
        finished |= manager.get_finished_requests().saved
        for rid, reason in manager.collect_failed_send_request_ids().items():
            failed.setdefault(rid, reason)
            failed_at.setdefault(rid, time.time())
    _finish(
        manager,
        out,
        {"finished": sorted(finished), "failed": failed, "failed_at": failed_at, "state": manager.pending_state()},
    )


def stage1(endpoints: dict[str, str], n: int, out: str, opts: dict[str, Any], progress: Any = None) -> None:
    from zmq_omni.adapters import ReferenceScheduler, StepRequest

    manager = _manager(1, endpoints, "dual", opts)
    scheduler = ReferenceScheduler(manager)
    for rid in [*request_ids(n), "req-cancel"]:
        scheduler.add_request(StepRequest(rid))
    forwarded = 0
    cancelled: list[str] = []
    deadline = time.monotonic() + opts.get("run_s", 90)
    while scheduler.has_requests() and time.monotonic() < deadline:
        manager.wait_for_progress(0.1)
        output = scheduler.step()
        for rid, inputs in output.chunk_inputs.items():
            if inputs.cancelled:
                cancelled.append(rid)
                scheduler.abort_request(rid, notify_downstream=True)  # forward the cancellation
                continue
            data = {"x": inputs.data["x"] * 2 + 1, "seq": inputs.data["seq"]} if inputs.num_chunks else {}
            manager.save_async(rid, data, is_final=inputs.is_final)
            forwarded += inputs.num_chunks
            if inputs.is_final:
                scheduler.finish_request(rid)
        if progress is not None and forwarded >= 5 * n:
            progress.set()
    # Let the last chunks leave, and their delivery be confirmed, before shutting down: closing a
    # connector drops what the next stage has not acknowledged yet.
    end = time.monotonic() + 10
    while (manager.pending_state()["queued"] or manager.connector.health()["pending"]) and time.monotonic() < end:
        time.sleep(0.01)
    _finish(
        manager,
        out,
        {
            "forwarded": forwarded,
            "cancelled": cancelled,
            "state": manager.pending_state(),
            "failed": manager.collect_failed_send_request_ids(),
        },
    )


def stage2(endpoints: dict[str, str], n: int, out: str, opts: dict[str, Any]) -> None:
    from zmq_omni.adapters import ReferenceScheduler, StepRequest

    manager = _manager(2, endpoints, "receiver", opts)
    scheduler = ReferenceScheduler(manager)
    for rid in [*request_ids(n), "req-cancel"]:
        scheduler.add_request(StepRequest(rid))
    seqs: dict[str, list[int]] = {}
    bad: list[str] = []
    done: list[str] = []
    cancelled: list[str] = []
    failed: dict[str, str] = {}
    failed_at: dict[str, float] = {}
    deadline = time.monotonic() + opts.get("run_s", 90)
    while scheduler.has_requests() and time.monotonic() < deadline:
        manager.wait_for_progress(0.1)
        output = scheduler.step()
        for rid, reason in output.failed.items():
            failed[rid] = reason
            failed_at[rid] = time.time()
        for rid, inputs in output.chunk_inputs.items():
            if "x" in inputs.data:
                i = int(rid.split("-")[1])
                got_seq = list(inputs.data["seq"])
                expected = np.concatenate([chunk_values(i, c) for c in got_seq]) * 2 + 1
                if not np.array_equal(inputs.data["x"], expected):
                    bad.append(rid)
                seqs.setdefault(rid, []).extend(got_seq)
            if inputs.is_final:
                (cancelled if inputs.cancelled else done).append(rid)
                scheduler.finish_request(rid)
    _finish(
        manager,
        out,
        {
            "seqs": seqs,
            "bad": bad,
            "done": done,
            "cancelled": cancelled,
            "failed": failed,
            "failed_at": failed_at,
            "state": manager.pending_state(),
        },
    )
