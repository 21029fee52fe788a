"""Acceptance: a three-stage chunk streaming pipeline in three processes over ZmqConnector."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.chunk_pipeline_stages import CHUNKS, request_ids, stage0, stage1, stage2
from tests.conftest import sweep_leftovers_of

pytest.importorskip("zmq_omni.connectors.zmq")

N = 20


def endpoints(tmp: Path) -> dict[str, dict[str, str]]:
    ep1, ep2 = f"ipc://{tmp}/s1.sock", f"ipc://{tmp}/s2.sock"
    return {"0": {"1": ep1}, "1": {"1": ep1, "2": ep2}, "2": {"2": ep2}}


def start(target: Any, *args: Any) -> mp.process.BaseProcess:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def stop_all(procs: list[mp.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_three_stage_stream_loses_and_duplicates_nothing(short_tmp: Path) -> None:
    eps = endpoints(short_tmp)
    outs = [short_tmp / f"out{i}.json" for i in range(3)]
    opts: dict[str, Any] = {}
    procs = [
        start(stage2, eps["2"], N, str(outs[2]), opts),
        start(stage1, eps["1"], N, str(outs[1]), opts),
        start(stage0, eps["0"], N, str(outs[0]), opts),
    ]
    try:
        for proc in procs:
            proc.join(100)
        assert [proc.exitcode for proc in procs] == [0, 0, 0]
    finally:
        stop_all(procs)
    r0, r1, r2 = (read(p) for p in outs)
    ids = request_ids(N)
    assert r0["failed"] == {} and set(r0["finished"]) == {*ids, "req-cancel"}
    assert r2["failed"] == {} and r2["bad"] == []
    assert sorted(r2["done"]) == sorted(ids)
    for rid in ids:
        assert r2["seqs"][rid] == list(range(CHUNKS)), rid  # every chunk once, in order
    # The cancellation crossed both hops and left no state behind on any side.
    assert r1["cancelled"] == ["req-cancel"] and r2["cancelled"] == ["req-cancel"]
    assert "req-cancel" not in r2["seqs"] or r2["seqs"]["req-cancel"] == []
    for report in (r0, r1, r2):
        assert report["state"] == {"sending": 0, "receiving": 0, "queued": 0, "parked": 0}
        assert report["shutdown_s"] < 1.0


@pytest.mark.slow
def test_killing_the_middle_stage_fails_requests_on_both_sides(short_tmp: Path) -> None:
    eps = endpoints(short_tmp)
    outs = [short_tmp / f"out{i}.json" for i in range(3)]
    stall = 2.0
    opts: dict[str, Any] = {
        "pace_s": 0.05,
        "put_timeout_s": 0.5,
        "delivery_timeout_s": 2.0,
        "retry_deadline_s": 1.0,
        "stall_timeout_s": stall,
        "drain_s": 30,
        "run_s": 40,
    }
    progress = mp.get_context("spawn").Event()
    procs = [
        start(stage2, eps["2"], N, str(outs[2]), opts),
        start(stage1, eps["1"], N, str(outs[1]), opts, progress),
        start(stage0, eps["0"], N, str(outs[0]), opts),
    ]
    try:
        assert progress.wait(60), "stage 1 never got going"
        pid = procs[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        procs[0].join(60)
        procs[2].join(60)
        assert procs[0].exitcode == 0 and procs[2].exitcode == 0, "a surviving stage hung"
    finally:
        stop_all(procs)
    sweep_leftovers_of([pid])  # the killed stage's probe segment does not outlive a sweep
    r0, r2 = read(outs[0]), read(outs[2])
    ids = set(request_ids(N))
    # Stage 0 was mid-stream for every request: each comes out as a send failure.
    assert ids <= set(r0["failed"]), sorted(ids - set(r0["failed"]))
    assert all("gave up" in reason or "deliver" in reason for reason in r0["failed"].values())
    # Stage 2 stopped hearing from stage 1: every unfinished request stalls and is reported in time.
    assert set(r2["failed"]) | set(r2["done"]) | set(r2["cancelled"]) == ids | {"req-cancel"}
    assert set(r2["failed"]) >= ids - set(r2["done"])
    assert len(r2["failed"]) > 0
    for rid in r2["failed"]:
        assert "stalled" in r2["failed"][rid]
        assert r2["failed_at"][rid] - killed_at < stall + 3.0
    for rid, seq in r2["seqs"].items():
        assert seq == list(range(len(seq))), rid  # what arrived is a clean prefix
    for report in (r0, r2):
        assert report["shutdown_s"] < 1.0  # with the peer gone
