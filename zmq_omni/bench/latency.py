"""Latency grid: the round trip of one message in flight between two processes, ZmqConnector beside raw pyzmq.

A streaming pipeline sends one chunk at a time, so what each hop costs is the
time from ``put`` returning to the next process's ``get`` returning, not a rate.
Each cell is a ping-pong between this process and a spawned echo process, one
message in flight, each side answering as soon as it has the message:

* raw: PAIR sockets, a msgpack header (key, dtype, shape) and the payload as a
  zero-copy frame; the echo views it with ``np.frombuffer`` and sends it back
  the same way;
* omni: ``ZmqConnector`` push mode with delivery confirmation on (its default):
  ``put`` of ``{"data": array}``, ``get_with_deadline`` on the other side, which
  puts what it got back on a second edge.

RTT = ``perf_counter`` before the send to after the answer is in hand. Raw and
omni run in interleaved rounds (a noisy neighbour slows both alike), after an
untimed warm-up; p50 and p99 are over every timed round trip.

Where the two processes run decides the figure, for raw pyzmq and for us alike:
on a small shared VM a round trip between processes on one CPU is a chain of
thread switches, while one between two CPUs pays a cross-CPU wake-up (and cold
caches) at every hop, several times dearer. ``pin`` fixes the placement
(``"same"``: both processes on one CPU; ``"split"``: this process on one, the
echo on another; ``"off"``: the scheduler decides), and each row says how often,
sampled after every round, each echo had last run on this process's CPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from ..connectors.zmq import ZmqConnector
from ._common import KIB, MIB, Comparison, percentile, size_label

__all__ = ["LATENCY_SIZES", "PLACEMENTS", "LatencyRow", "run_latency"]

LATENCY_SIZES = [1 * KIB, 64 * KIB, 1 * MIB]
_SPAWN = mp.get_context("spawn")
_RAW = "raw pyzmq PAIR, msgpack header + zero-copy frame"
_WAIT_S = 30.0


@dataclass(frozen=True)
class LatencyRow:
    """Round-trip seconds of one message in flight: p50/p99 of raw pyzmq and of ZmqConnector."""

    transport: str
    size: int
    count: int
    raw_p50: float
    raw_p99: float
    omni_p50: float
    omni_p99: float
    placement: str = "off"

    def comparisons(self) -> list[Comparison]:
        """The row as ratio-table cells (p50 and p99 of ZmqConnector against raw pyzmq)."""
        label = size_label(self.size)
        name = f"ZmqConnector {self.transport} RTT"
        return [
            Comparison("latency", f"{name} p50", label, self.omni_p50, self.raw_p50, _RAW),
            Comparison("latency", f"{name} p99", label, self.omni_p99, self.raw_p99, _RAW),
        ]


# -- CPU placement --------------------------------------------------------------------------------------------
PLACEMENTS = ("off", "same", "split")


def _cpus_for(pin: str) -> tuple[set[int] | None, set[int] | None]:
    # (this process's CPUs, the echo processes' CPUs) for a placement; None leaves it to the scheduler.
    if pin not in PLACEMENTS:
        raise ValueError(f"pin must be one of {PLACEMENTS}, not {pin!r}")
    if pin == "off":
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    if pin == "same":
        return {allowed[0]}, {allowed[0]}
    if len(allowed) < 2:
        raise ValueError("pin='split' needs two CPUs")
    return {allowed[0]}, {allowed[1]}


def _pin_process(cpus: set[int]) -> None:
    # Every thread of this process (a thread started later inherits its starter's CPUs).
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def _last_cpu(pid: int) -> int:
    # The CPU a process's main thread last ran on (field 39 of /proc/<pid>/stat).
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


# -- echo processes (spawned: their own process and GIL, as a real next stage) --------------------------------
def _raw_echo(endpoint: str, out: Any, cpus: set[int] | None = None) -> None:
    if cpus is not None:
        _pin_process(cpus)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        head, frame = sock.recv_multipart(copy=False)
        header = msgpack.unpackb(head.bytes)
        if header["key"] is None:
            break
        view = np.frombuffer(frame.buffer, dtype=header["dtype"]).reshape(header["shape"])
        sock.send_multipart([msgpack.packb(header), view.data], copy=False)
        del view, frame
    sock.close()
    ctx.term()


def _omni_echo(endpoint: str, shm: str, out: Any, cpus: set[int] | None = None) -> None:
    if cpus is not None:
        _pin_process(cpus)
    inbound = ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}, "shm": shm})
    with inbound:
        out.put(inbound.endpoint)
        outbound = ZmqConnector({"stage_id": "1", "role": "sender", "endpoints": {"2": _get(out)}, "shm": shm})
        with outbound:
            i = 0
            while True:
                got = inbound.get_with_deadline("0", "1", f"m{i}", None, deadline=time.monotonic() + _WAIT_S)
                if got is None:
                    raise RuntimeError(f"m{i} never arrived")
                obj = got[0]
                if obj is None:
                    break
                if not outbound.put("1", "2", f"m{i}", obj)[0]:
                    raise RuntimeError(f"echo put failed: {outbound.drain_failures()}")
                del got, obj
                i += 1
            outbound.flush(5.0)


def _get(queue: Any) -> str:
    # The next endpoint from a spawned process's queue (the omni echo waits there for ours).
    value: str = queue.get(timeout=60)
    return value


class _Raw:
    def __init__(self, endpoint: str, cpus: set[int] | None) -> None:
        self.out = _SPAWN.Queue()
        self.proc = _SPAWN.Process(target=_raw_echo, args=(endpoint, self.out, cpus), daemon=True)
        self.proc.start()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(_get(self.out))

    def round_trip(self, data: np.ndarray[Any, Any], i: int) -> float:
        start = time.perf_counter()
        header = {"key": f"m{i}", "dtype": data.dtype.str, "shape": data.shape}
        self.sock.send_multipart([msgpack.packb(header), data.data], copy=False)
        head, frame = self.sock.recv_multipart(copy=False)
        got = msgpack.unpackb(head.bytes)
        view = np.frombuffer(frame.buffer, dtype=got["dtype"]).reshape(got["shape"])
        end = time.perf_counter()
        del view, frame
        return end - start

    def close(self) -> None:
        self.sock.send_multipart([msgpack.packb({"key": None}), b""])
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.sock.close()
        self.ctx.term()
        self.out.close()


class _Omni:
    def __init__(self, endpoint: str, back: str, shm: str, cpus: set[int] | None) -> None:
        self.out = _SPAWN.Queue()
        self.proc = _SPAWN.Process(target=_omni_echo, args=(endpoint, shm, self.out, cpus), daemon=True)
        self.proc.start()
        bound = _get(self.out)
        self.inbound = ZmqConnector({"stage_id": "2", "role": "receiver", "endpoints": {"2": back}, "shm": shm})
        self.out.put(self.inbound.endpoint)
        self.outbound = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": bound}, "shm": shm})
        self.i = 0

    def round_trip(self, data: np.ndarray[Any, Any], _: int) -> float:
        key = f"m{self.i}"
        self.i += 1
        payload = {"data": data}
        start = time.perf_counter()
        if not self.outbound.put("0", "1", key, payload)[0]:
            raise RuntimeError(f"put failed: {self.outbound.drain_failures()}")
        got = self.inbound.get_with_deadline("1", "2", key, None, deadline=time.monotonic() + _WAIT_S)
        end = time.perf_counter()
        if got is None:
            raise RuntimeError(f"{key} never came back")
        return end - start

    def close(self) -> None:
        self.outbound.put("0", "1", f"m{self.i}", None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.outbound.close()
        self.inbound.close()
        self.out.close()


def run_latency(
    sizes: Sequence[int] = LATENCY_SIZES,
    *,
    transports: Sequence[str] = ("ipc", "tcp"),
    count: int = 2000,
    warmup: int = 200,
    rounds: int = 10,
    shm: str = "off",
    pin: str = "off",
    on_row: Callable[[LatencyRow], None] | None = None,
) -> list[LatencyRow]:
    """RTT p50/p99 of one message in flight, per transport and size, raw pyzmq beside ZmqConnector.

    Args:
        sizes: payload sizes in bytes.
        transports: ``"tcp"`` (``tcp://127.0.0.1``) and/or ``"ipc"`` (sockets in a temp dir).
        count: round trips timed per cell and contender (fewer for payloads over 64 KiB).
        warmup: untimed round trips per contender before the first round.
        rounds: the timed round trips are split in this many rounds, raw and omni in turn.
        shm: the connectors' ``shm`` policy; ``"off"`` (default) compares the same bytes on the same wire.
        pin: ``"same"`` runs this process and the echoes on one CPU, ``"split"`` on two (this process on the
            first CPU it may use, the echoes on the second; all its threads, restored after), ``"off"``
            (default) leaves it to the scheduler; each row's ``placement`` also says how often, sampled after
            each round, the raw and the omni echo had last run on this process's CPU.
        on_row: called with each row as soon as it is measured.

    Returns:
        The rows, in the order measured.
    """
    ours, theirs = _cpus_for(pin)
    before = os.sched_getaffinity(0)
    if ours is not None:
        _pin_process(ours)
    tmp = Path(tempfile.mkdtemp(prefix="zo-lat-", dir="/tmp"))
    rows: list[LatencyRow] = []
    try:
        for transport in transports:
            endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp}/{{}}.sock"
            raw: _Raw | None = None
            omni: _Omni | None = None
            try:
                raw = _Raw(endpoint.format("raw"), theirs)
                omni = _Omni(endpoint.format("there"), endpoint.format("back"), shm, theirs)
                for size in sizes:
                    n = count if size <= 64 * KIB else max(rounds, count // 4)
                    data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                    samples: dict[str, list[float]] = {"raw": [], "omni": []}
                    contenders: dict[str, _Raw | _Omni] = {"raw": raw, "omni": omni}
                    for contender in contenders.values():
                        for i in range(warmup):
                            contender.round_trip(data, i)
                    per_round = max(1, n // rounds)
                    together = dict.fromkeys(contenders, 0)  # rounds after which the echo had last run on our CPU
                    for _ in range(rounds):
                        for name, contender in contenders.items():
                            samples[name].extend(contender.round_trip(data, i) for i in range(per_round))
                            together[name] += _last_cpu(os.getpid()) == _last_cpu(contender.proc.pid or 0)
                    row = LatencyRow(
                        transport,
                        size,
                        len(samples["raw"]),
                        percentile(samples["raw"], 50),
                        percentile(samples["raw"], 99),
                        percentile(samples["omni"], 50),
                        percentile(samples["omni"], 99),
                        f"{pin}, same CPU raw {together['raw']}/{rounds} omni {together['omni']}/{rounds}",
                    )
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
            finally:
                for part in (raw, omni):
                    if part is not None:
                        part.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if ours is not None:
            _pin_process(before)
    return rows
