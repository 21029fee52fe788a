"""Adapters grid: how long the scheduler thread is held, and chunk latency beside a raw ZmqConnector.

Two ZmqConnectors (stage 0 sender, stage 1 receiver) in one process over
``ipc://`` in a temp dir, each under an :class:`~zmq_omni.adapters.OmniChunkManager`.
Measured, as p50/p99 of ``n`` samples:

* ``save_async`` / ``load_async`` / ``process_pending_chunks`` / ``restore_queues``
  call time on the calling (scheduler) thread, beside a synchronous
  ``ZmqConnector.put`` of the same payload (what the scheduler would be held
  for without the adapter);
* chunk latency ``save_async`` -> assembled input taken on the receiver, beside
  a raw ZmqConnector ``put`` -> ``get_with_deadline`` of the same payload;
* optionally, the receive worker's CPU with 64 loads pending and no data, and idle.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..adapters import ChunkManagerConfig, OmniChunkManager, StepRequest
from ..connectors import OmniConnectorBase, create_connector
from ._common import Comparison, percentile

__all__ = ["AdaptersResult", "Percentiles", "run_adapters"]


@dataclass(frozen=True)
class Percentiles:
    """p50 and p99 of a sample of durations, in seconds."""

    p50: float
    p99: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Percentiles:
        """The p50 and p99 of ``samples``."""
        return cls(percentile(samples, 50), percentile(samples, 99))


@dataclass(frozen=True)
class AdaptersResult:
    """Every measurement of :func:`run_adapters`; CPU shares are ``None`` when not measured."""

    n: int
    payload_bytes: int
    save_hold: Percentiles
    save_burst: Percentiles
    load_hold: Percentiles
    pending_hooks: Percentiles
    restore: Percentiles
    raw_put: Percentiles
    raw_put_get: Percentiles
    chunk_latency: Percentiles
    pending_cpu: float | None
    idle_cpu: float | None

    def comparisons(self) -> list[Comparison]:
        """save_async hold against a synchronous put, chunk latency against raw put->get (p50 and p99)."""
        out = []
        for stat in ("p50", "p99"):
            out.append(
                Comparison(
                    "adapters",
                    "save_async scheduler hold",
                    stat,
                    getattr(self.save_hold, stat),
                    getattr(self.raw_put, stat),
                    "synchronous ZmqConnector put",
                )
            )
        for stat in ("p50", "p99"):
            out.append(
                Comparison(
                    "adapters",
                    "chunk save_async->assembled",
                    stat,
                    getattr(self.chunk_latency, stat),
                    getattr(self.raw_put_get, stat),
                    "raw ZmqConnector put->get",
                )
            )
        return out


def _thread_cpu(native_id: int | None) -> float:
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0]) / 1e9


def _zmq(stage: str, role: str, endpoint: str) -> OmniConnectorBase:
    return create_connector(
        {"name": "ZmqConnector", "extra": {"stage_id": stage, "role": role, "endpoints": {"1": endpoint}}}
    )


def _wait_until_saved(sender: OmniChunkManager, request_id: str, *, timeout_s: float) -> None:
    """Wait until ``request_id``'s final chunk was put (the save worker sends a request's chunks in order)."""
    deadline = time.monotonic() + timeout_s
    while request_id not in sender.get_finished_requests().saved:
        failed = sender.collect_failed_send_request_ids()
        if request_id in failed:
            raise RuntimeError(f"request {request_id} failed to send: {failed[request_id]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"request {request_id} was not sent within {timeout_s} s")
        time.sleep(0.005)


def run_adapters(n: int = 2000, payload_bytes: int = 4096, *, cpu_window_s: float = 1.0) -> AdaptersResult:
    """Measure the adapters' scheduler-thread costs and chunk latency.

    Args:
        n: samples per measurement.
        payload_bytes: bytes of the float64 array in each chunk (plus a small metadata dict).
        cpu_window_s: seconds over which the receive worker's CPU is measured twice; 0 skips it.

    Returns:
        The p50/p99 of every measurement.
    """
    tmp = Path(tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp"))
    endpoint = f"ipc://{tmp}/s1.sock"
    c0 = _zmq("0", "sender", endpoint)
    c1 = _zmq("1", "receiver", endpoint)
    sender = OmniChunkManager(ChunkManagerConfig(stage_id="0"), c0)
    receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1"), c1)
    payload = {"x": np.random.default_rng(0).random(payload_bytes // 8), "meta": {"step": 1}}
    try:
        # -- raw connector round trip (baseline); its put alone is the synchronous-hold baseline --
        raw_put, raw = [], []
        for i in range(n):
            t0 = time.perf_counter()
            ok, _, _ = c0.put("0", "1", f"raw_0_{i}", {"meta": {"chunk_id": i}, "data": payload})
            t1 = time.perf_counter()
            got = c1.get_with_deadline("0", "1", f"raw_0_{i}", deadline=time.monotonic() + 5)
            raw.append(time.perf_counter() - t0)
            raw_put.append(t1 - t0)
            if not ok or got is None:
                raise RuntimeError(f"raw put->get {i} failed")

        # -- chunk latency: save_async -> assembled input --
        latency, save_hold = [], []
        receiver.load_async("lat")
        for i in range(n):
            t0 = time.perf_counter()
            sender.save_async("lat", payload, is_final=i == n - 1)
            save_hold.append(time.perf_counter() - t0)
            deadline = time.monotonic() + 10
            while receiver.take_inputs("lat") is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"chunk {i} was not assembled within 10 s")
                receiver.wait_for_progress(1.0)
            latency.append(time.perf_counter() - t0)

        # -- save_async hold time under a burst (queue grows, the worker competes for the GIL) --
        burst = []
        for i in range(n):
            t0 = time.perf_counter()
            sender.save_async("burst", payload, is_final=i == n - 1)
            burst.append(time.perf_counter() - t0)
        # The save worker is still sending the burst: shutting down now would fail its queued
        # chunks (a send failure, logged as a WARNING) and leave them out of the sender's work.
        _wait_until_saved(sender, "burst", timeout_s=30)

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

        # -- receive worker CPU: 64 loads pending, no data (then idle) --
        pending_cpu = idle_cpu = None
        tid = receiver.recv_thread.native_id
        if cpu_window_s > 0:
            before = _thread_cpu(tid)
            time.sleep(cpu_window_s)
            pending_cpu = (_thread_cpu(tid) - before) / cpu_window_s
        for i in range(64):
            receiver.cancel(f"q{i}")
        if cpu_window_s > 0:
            time.sleep(0.05)
            before = _thread_cpu(tid)
            time.sleep(cpu_window_s)
            idle_cpu = (_thread_cpu(tid) - before) / cpu_window_s
    finally:
        sender.shutdown()
        receiver.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return AdaptersResult(
        n=n,
        payload_bytes=payload_bytes,
        save_hold=Percentiles.of(save_hold),
        save_burst=Percentiles.of(burst),
        load_hold=Percentiles.of(loads),
        pending_hooks=Percentiles.of(hooks),
        restore=Percentiles.of(restore),
        raw_put=Percentiles.of(raw_put),
        raw_put_get=Percentiles.of(raw),
        chunk_latency=Percentiles.of(latency),
        pending_cpu=pending_cpu,
        idle_cpu=idle_cpu,
    )
