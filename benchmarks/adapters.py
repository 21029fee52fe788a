"""Adapter overheads: how long the scheduler thread is held, and chunk latency vs raw ZmqConnector.

Run: python benchmarks/adapters.py [--n 2000]

Two ZmqConnectors (stage 0 sender, stage 1 receiver) in one process over ipc://
in a temp dir. Prints p50/p99 of:
  * save_async / load_async / process_pending_chunks(+restore_queues) call time
    on the calling (scheduler) thread;
  * chunk latency save_async -> assembled input taken on the receiver, beside a
    raw ZmqConnector put -> get_with_deadline of the same payload;
  * receive-worker CPU with nothing pending and with 20 loads pending (no data).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, StepRequest
from zmq_omni.connectors import create_connector


def pct(samples: list[float]) -> str:
    arr = np.array(samples) * 1e6
    return f"p50 {np.percentile(arr, 50):8.1f} us   p99 {np.percentile(arr, 99):8.1f} us"


def thread_cpu(native_id: int | None) -> float:
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="samples per measurement")
    parser.add_argument("--payload", type=int, default=4096, help="bytes of array per chunk")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp"))
    ep = f"ipc://{tmp}/s1.sock"
    def zmq(stage: str, role: str):  # type: ignore[no-untyped-def]
        return create_connector({"name": "ZmqConnector",
                                 "extra": {"stage_id": stage, "role": role, "endpoints": {"1": ep}}})

    c0, c1 = zmq("0", "sender"), zmq("1", "receiver")
    sender = OmniChunkManager(ChunkManagerConfig(stage_id="0"), c0)
    receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1"), c1)
    payload = {"x": np.random.default_rng(0).random(args.payload // 8), "meta": {"step": 1}}
    try:
        n = args.n
        print(f"adapters benchmark: n={n}, payload {args.payload} B array + metadata, ZmqConnector ipc://")

        # -- raw connector round trip (baseline) --
        raw = []
        for i in range(n):
            t0 = time.perf_counter()
            ok, _, _ = c0.put("0", "1", f"raw_0_{i}", {"meta": {"chunk_id": i}, "data": payload})
            got = c1.get_with_deadline("0", "1", f"raw_0_{i}", deadline=time.monotonic() + 5)
            raw.append(time.perf_counter() - t0)
            assert ok and got is not None

        # -- chunk latency: save_async -> assembled input --
        latency, save_hold = [], []
        receiver.load_async("lat")
        for i in range(n):
            t0 = time.perf_counter()
            sender.save_async("lat", payload, is_final=i == n - 1)
            save_hold.append(time.perf_counter() - t0)
            while True:
                inputs = receiver.take_inputs("lat")
                if inputs is not None:
                    break
                receiver.wait_for_progress(1.0)
            latency.append(time.perf_counter() - t0)

        # -- save_async hold time under a burst (queue grows, the worker competes for the GIL) --
        burst = []
        for i in range(n):
            t0 = time.perf_counter()
            sender.save_async("burst", payload, is_final=i == n - 1)
            burst.append(time.perf_counter() - t0)

        # -- load_async hold time --
        loads = []
        for i in range(n):
            t0 = time.perf_counter()
            receiver.load_async(f"load-{i}")
            loads.append(time.perf_counter() - t0)
        for i in range(n):
            receiver.cancel(f"load-{i}")

        # -- process_pending_chunks + restore_queues with 64 queued requests, half ready --
        waiting: deque[StepRequest] = deque(StepRequest(f"q{i}") for i in range(32))
        running: deque[StepRequest] = deque(StepRequest(f"q{i}") for i in range(32, 64))
        for i in range(64):
            receiver.load_async(f"q{i}")
            if i % 2:
                c0.put("0", "1", f"q{i}_0_0", {"meta": {"chunk_id": 0, "final": False}, "data": payload})
        end = time.monotonic() + 5
        while sum(receiver.is_ready(f"q{i}") for i in range(64)) < 32 and time.monotonic() < end:
            time.sleep(0.01)
        hooks, restore = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            receiver.process_pending_chunks(waiting, running)
            t1 = time.perf_counter()
            receiver.restore_queues(waiting, running)
            hooks.append(t1 - t0)
            restore.append(time.perf_counter() - t1)

        # -- receive worker CPU: 20 loads pending, no data (then idle) --
        window = 1.0
        tid = receiver.recv_thread.native_id
        before = thread_cpu(tid)
        time.sleep(window)
        pending_cpu = (thread_cpu(tid) - before) / window
        for i in range(64):
            receiver.cancel(f"q{i}")
        time.sleep(0.05)
        before = thread_cpu(tid)
        time.sleep(window)
        idle_cpu = (thread_cpu(tid) - before) / window

        print(f"  save_async hold (1 in flight)    {pct(save_hold)}")
        print(f"  save_async hold (burst of {n})  {pct(burst)}")
        print(f"  load_async hold                  {pct(loads)}")
        print(f"  process_pending_chunks (64 req)  {pct(hooks)}")
        print(f"  restore_queues (64 req)          {pct(restore)}")
        print(f"  raw ZmqConnector put->get        {pct(raw)}")
        print(f"  chunk save_async->assembled      {pct(latency)}")
        print(f"  ratio chunk/raw latency          p50 {np.percentile(latency, 50) / np.percentile(raw, 50):.2f}x"
              f"   p99 {np.percentile(latency, 99) / np.percentile(raw, 99):.2f}x")
        print(f"  recv worker CPU: 64 loads pending, no data {pending_cpu * 100:.2f}% of a core;"
              f" idle {idle_cpu * 100:.3f}%")
    finally:
        sender.shutdown()
        receiver.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
