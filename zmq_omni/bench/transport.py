"""Transport grid: ZmqConnector put->get throughput and small-message rate beside raw pyzmq.

Each cell is one sender (this process) and one receiver process (spawned):

* raw: PUSH/PULL, ``send(copy=False)`` of the same bytes, ``recv(copy=False)``
  plus an ``np.frombuffer`` view (no malloc tuning: what pyzmq gives you);
* omni: ``ZmqConnector`` push mode, ``put`` of ``{"data": array}``, ``get``
  (delivery confirmation on: arrival and consumption acks, resend window),
  once with ``shm: off`` (frames only) and once with ``shm: auto`` (the
  default: payloads >= ``shm_threshold`` go through the same-host fast path,
  since sender and receiver share this host, over tcp too);
* small messages: 200-byte payloads, many in flight; raw pays one msgpack
  ``packb``/``unpackb`` per message, omni pays its full protocol. Timed in
  interleaved rounds (raw, shm off, shm auto, again), median of each.

Throughput = bytes / (first send -> last receive), both clocks CLOCK_MONOTONIC.
One untimed warm-up message per size precedes each timed batch.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import statistics
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
from ._common import KIB, MIB, Comparison, size_label

__all__ = ["SIZES", "SMALL", "RateRow", "ThroughputRow", "TransportResult", "message_count", "run_transport"]

SIZES = [1 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
SMALL = 200
_SPAWN = mp.get_context("spawn")
_RAW = "raw pyzmq PUSH/PULL copy=False"


@dataclass(frozen=True)
class ThroughputRow:
    """Bytes per second of ``count`` messages of ``size`` bytes, raw pyzmq and ZmqConnector shm off/auto."""

    transport: str
    size: int
    count: int
    raw: float
    off: float
    auto: float

    def comparisons(self) -> list[Comparison]:
        """The row as ratio-table cells: each ZmqConnector policy against raw pyzmq."""
        label = size_label(self.size)
        return [
            Comparison("transport", f"ZmqConnector {self.transport} shm=off", label, self.off, self.raw, _RAW, "B/s"),
            Comparison("transport", f"ZmqConnector {self.transport} shm=auto", label, self.auto, self.raw, _RAW, "B/s"),
        ]


@dataclass(frozen=True)
class RateRow:
    """Messages per second of ``count`` 200-byte payloads, all in flight; ``auto_shm_puts`` from health()."""

    transport: str
    count: int
    raw: float
    off: float
    auto: float
    auto_shm_puts: int

    def comparisons(self) -> list[Comparison]:
        """The row as a ratio-table cell: ZmqConnector (shm off) against raw pyzmq + msgpack."""
        return [
            Comparison(
                "transport",
                f"ZmqConnector {self.transport} rate",
                f"{SMALL} B msgs",
                self.off,
                self.raw,
                "raw pyzmq + msgpack per msg",
                "msg/s",
            )
        ]


@dataclass(frozen=True)
class TransportResult:
    """The throughput rows (per transport, per size) and the small-message rows (per transport)."""

    throughput: list[ThroughputRow]
    small: list[RateRow]

    def comparisons(self) -> list[Comparison]:
        """Every row as ratio-table cells."""
        cells = [c for row in self.throughput for c in row.comparisons()]
        return cells + [c for rate in self.small for c in rate.comparisons()]


def message_count(size: int, *, budget_bytes: int = 768 * MIB, max_count: int = 20_000) -> int:
    """Messages timed per cell: ``budget_bytes`` worth, between 3 and ``max_count``."""
    return max(3, min(max_count, budget_bytes // size))


# -- receivers (spawned: their own process and GIL, as a real next stage) --------------
def _raw_receiver(endpoint: str, ctl: Any, out: Any) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while (job := ctl.get()) is not None:
        kind, n = job
        for _ in range(n + 1):  # warm-up + timed
            frame = sock.recv(copy=False)
            if kind == "small":
                msgpack.unpackb(frame.bytes)
            else:
                view = np.frombuffer(frame.buffer, dtype=np.uint8)
                del view
            del frame
        out.put(time.perf_counter())
    sock.close()
    ctx.term()


def _omni_receiver(endpoint: str, shm: str, ctl: Any, out: Any) -> None:
    conn = ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}, "shm": shm})
    with conn:
        out.put(conn.endpoint)
        while (job := ctl.get()) is not None:
            tag, n = job
            for i in range(n + 1):
                got = conn.get_with_deadline("0", "1", f"{tag}{i}", deadline=time.monotonic() + 60)
                if got is None:
                    raise RuntimeError(f"{tag}{i} never arrived")
                del got
            out.put(time.perf_counter())


class _Peer:
    """A spawned receiver process driven through two queues."""

    def __init__(self, target: Callable[..., None], *args: str) -> None:
        self.ctl, self.out = _SPAWN.Queue(), _SPAWN.Queue()
        self.proc = _SPAWN.Process(target=target, args=(*args, self.ctl, self.out), daemon=True)
        self.proc.start()

    def stop(self) -> None:
        self.ctl.put(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.ctl.close()
        self.out.close()


class _Raw:
    def __init__(self, endpoint: str) -> None:
        self.peer = _Peer(_raw_receiver, endpoint)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.peer.out.get(timeout=60))

    def large(self, data: np.ndarray[Any, Any], n: int) -> float:
        self.peer.ctl.put(("large", n))
        self.sock.send(data.data, copy=False)
        start = time.perf_counter()
        for _ in range(n):
            self.sock.send(data.data, copy=False)
        end: float = self.peer.out.get(timeout=300)
        return end - start

    def small(self, n: int) -> float:
        self.peer.ctl.put(("small", n))
        payload = b"x" * SMALL
        self.sock.send(msgpack.packb({"key": "w", "data": payload}))
        start = time.perf_counter()
        for i in range(n):
            self.sock.send(msgpack.packb({"key": f"s{i}", "data": payload}))
        end: float = self.peer.out.get(timeout=300)
        return end - start

    def close(self) -> None:
        self.peer.stop()
        self.sock.close()
        self.ctx.term()


class _Omni:
    def __init__(self, endpoint: str, shm: str) -> None:
        self.peer = _Peer(_omni_receiver, endpoint, shm)
        bound = self.peer.out.get(timeout=60)
        self.conn = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": bound}, "shm": shm})
        self.batch = 0

    def _run(self, payload: Any, n: int) -> float:
        self.batch += 1
        tag = f"b{self.batch}_"
        self.peer.ctl.put((tag, n))
        if not self.conn.put("0", "1", f"{tag}0", payload)[0]:
            raise RuntimeError("warm-up put failed")
        start = time.perf_counter()
        for i in range(1, n + 1):
            if not self.conn.put("0", "1", f"{tag}{i}", payload)[0]:
                raise RuntimeError(f"put failed: {self.conn.drain_failures()}")
        end: float = self.peer.out.get(timeout=300)
        return end - start

    def large(self, data: np.ndarray[Any, Any], n: int) -> float:
        return self._run({"data": data}, n)

    def small(self, n: int) -> float:
        return self._run({"data": b"x" * SMALL}, n)

    def close(self) -> None:
        self.peer.stop()
        self.conn.close()


def run_transport(
    sizes: Sequence[int] = SIZES,
    *,
    transports: Sequence[str] = ("tcp", "ipc"),
    budget_bytes: int = 768 * MIB,
    max_count: int = 20_000,
    small_count: int = 40_000,
    small_rounds: int = 3,
    on_row: Callable[[ThroughputRow | RateRow], None] | None = None,
) -> TransportResult:
    """Throughput per size and small-message rate, raw pyzmq beside ZmqConnector shm off and auto.

    Args:
        sizes: payload sizes in bytes.
        transports: ``"tcp"`` (``tcp://127.0.0.1``) and/or ``"ipc"`` (a socket in a temp dir).
        budget_bytes: bytes timed per cell (see :func:`message_count`).
        max_count: most messages timed per cell.
        small_count: 200-byte messages timed per small-message cell (0 skips them).
        small_rounds: small-message cells are timed this many times, raw and both
            policies in turn, and the median of each is reported.
        on_row: called with each row as soon as it is measured.

    Returns:
        The rows, in the order measured.
    """
    tmp = Path(tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp"))
    throughput: list[ThroughputRow] = []
    small: list[RateRow] = []
    try:
        for transport in transports:
            endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp}/{{}}.sock"
            pairs: list[_Raw | _Omni] = []
            try:
                raw = _Raw(endpoint.format("raw"))
                pairs.append(raw)
                off = _Omni(endpoint.format("off"), "off")
                pairs.append(off)
                auto = _Omni(endpoint.format("auto"), "auto")
                pairs.append(auto)
                for size in sizes:
                    n = message_count(size, budget_bytes=budget_bytes, max_count=max_count)
                    data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                    row = ThroughputRow(
                        transport,
                        size,
                        n,
                        n * size / raw.large(data, n),
                        n * size / off.large(data, n),
                        n * size / auto.large(data, n),
                    )
                    del data
                    throughput.append(row)
                    if on_row is not None:
                        on_row(row)
                if small_count:
                    # Interleaved rounds, median of each: one round on a shared machine varies by a third.
                    rounds = [
                        [small_count / peer.small(small_count) for peer in (raw, off, auto)]
                        for _ in range(max(1, small_rounds))
                    ]
                    raw_rate, off_rate, auto_rate = (statistics.median(cell) for cell in zip(*rounds, strict=True))
                    rate = RateRow(
                        transport, small_count, raw_rate, off_rate, auto_rate, int(auto.conn.health()["shm_puts"])
                    )
                    small.append(rate)
                    if on_row is not None:
                        on_row(rate)
            finally:
                for pair in pairs:
                    pair.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TransportResult(throughput, small)
