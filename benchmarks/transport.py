"""ZmqConnector put->get throughput and small-message rate beside raw pyzmq, measured in one run.

Run: ``python benchmarks/transport.py`` (about a minute and a half on 2 cores).
``--quick`` halves the message counts.

Each cell is one sender (this process) and one receiver process:

* raw: PUSH/PULL, ``send(copy=False)`` of the same bytes, ``recv(copy=False)``
  plus an ``np.frombuffer`` view (no malloc tuning: what pyzmq gives you);
* omni: ``ZmqConnector`` push mode, ``put`` of ``{"data": array}``, ``get``
  (delivery confirmation on: arrival and consumption acks, resend window),
  once with ``shm: off`` (frames only) and once with ``shm: auto`` (the
  default: payloads >= ``shm_threshold`` go through the same-host fast path,
  since sender and receiver share this host, over tcp too);
* small messages: 200-byte payloads, many in flight; raw pays one msgpack
  ``packb``/``unpackb`` per message, omni pays its full protocol.

Throughput = bytes / (first send -> last receive), both clocks CLOCK_MONOTONIC.
One untimed warm-up message per size precedes each timed batch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

SPAWN = mp.get_context("spawn")
MiB = 1 << 20
SIZES = [1 << 10, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
SMALL = 200


def count_for(size: int, quick: bool) -> int:
    n = max(3, min(20_000, (768 * MiB) // size))
    return max(3, n // 2) if quick else n


# -- receivers (spawned) ----------------------------------------------------------------
def raw_receiver(endpoint: str, ctl: Any, out: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    out.put(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
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


def omni_receiver(endpoint: str, shm: str, ctl: Any, out: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}, "shm": shm}) as conn:
        out.put(conn.endpoint)
        while (job := ctl.get()) is not None:
            tag, n = job
            for i in range(n + 1):
                got = conn.get_with_deadline("0", "1", f"{tag}{i}", deadline=time.monotonic() + 60)
                if got is None:
                    raise RuntimeError(f"{tag}{i} never arrived")
                del got
            out.put(time.perf_counter())


# -- senders (this process) -------------------------------------------------------------
class Raw:
    def __init__(self, endpoint: str) -> None:
        self.ctl, self.out = SPAWN.Queue(), SPAWN.Queue()
        self.proc = SPAWN.Process(target=raw_receiver, args=(endpoint, self.ctl, self.out), daemon=True)
        self.proc.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.out.get(timeout=30))

    def large(self, data: np.ndarray, n: int) -> float:
        self.ctl.put(("large", n))
        self.sock.send(data, copy=False)
        start = time.perf_counter()
        for _ in range(n):
            self.sock.send(data, copy=False)
        return self.out.get(timeout=300) - start

    def small(self, n: int) -> float:
        self.ctl.put(("small", n))
        payload = b"x" * SMALL
        self.sock.send(msgpack.packb({"key": "w", "data": payload}))
        start = time.perf_counter()
        for i in range(n):
            self.sock.send(msgpack.packb({"key": f"s{i}", "data": payload}))
        return self.out.get(timeout=300) - start

    def close(self) -> None:
        self.ctl.put(None)
        self.proc.join(10)
        self.sock.close()
        self.ctx.term()


class Omni:
    def __init__(self, endpoint: str, shm: str) -> None:
        from zmq_omni.connectors.zmq import ZmqConnector

        self.ctl, self.out = SPAWN.Queue(), SPAWN.Queue()
        self.proc = SPAWN.Process(target=omni_receiver, args=(endpoint, shm, self.ctl, self.out), daemon=True)
        self.proc.start()
        bound = self.out.get(timeout=30)
        self.conn = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": bound}, "shm": shm})
        self.batch = 0

    def _run(self, payload: Any, n: int) -> float:
        self.batch += 1
        tag = f"b{self.batch}_"
        self.ctl.put((tag, n))
        if not self.conn.put("0", "1", f"{tag}0", payload)[0]:
            raise RuntimeError("warm-up put failed")
        start = time.perf_counter()
        for i in range(1, n + 1):
            if not self.conn.put("0", "1", f"{tag}{i}", payload)[0]:
                raise RuntimeError(f"put failed: {self.conn.drain_failures()}")
        return self.out.get(timeout=300) - start

    def large(self, data: np.ndarray, n: int) -> float:
        return self._run({"data": data}, n)

    def small(self, n: int) -> float:
        return self._run({"data": b"x" * SMALL}, n)

    def close(self) -> None:
        self.ctl.put(None)
        self.proc.join(10)
        self.conn.close()


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= MiB else f"{size >> 10} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the message counts")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp"))
    started = time.perf_counter()
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; GB/s = 1e9 bytes/s")
    ratios = f"{'off/raw':>8} {'auto/raw':>9}"
    print(f"{'transport':<9} {'size':>8} {'n':>6} {'raw GB/s':>9} {'shm:off':>8} {'shm:auto':>9} {ratios}")
    small_rows = []
    try:
        for transport in ("tcp", "ipc"):
            endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp}/{{}}.sock"
            raw = Raw(endpoint.format("raw"))
            off = Omni(endpoint.format("off"), "off")
            auto = Omni(endpoint.format("auto"), "auto")
            try:
                for size in SIZES:
                    n = count_for(size, args.quick)
                    data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                    raw_gbs = n * size / raw.large(data, n) / 1e9
                    off_gbs = n * size / off.large(data, n) / 1e9
                    auto_gbs = n * size / auto.large(data, n) / 1e9
                    print(
                        f"{transport:<9} {human(size):>8} {n:>6} {raw_gbs:>9.2f} {off_gbs:>8.2f} {auto_gbs:>9.2f} "
                        f"{off_gbs / raw_gbs:>7.2f}x {auto_gbs / raw_gbs:>8.2f}x",
                        flush=True,
                    )
                    del data
                n_small = 20_000 if args.quick else 40_000
                raw_rate = n_small / raw.small(n_small)
                off_rate = n_small / off.small(n_small)
                auto_rate = n_small / auto.small(n_small)
                small_rows.append((transport, n_small, raw_rate, off_rate, auto_rate))
                print(f"{transport}: shm:auto sender health: shm_puts={auto.conn.health()['shm_puts']}", flush=True)
            finally:
                raw.close()
                off.close()
                auto.close()
        print(f"\nsmall messages ({SMALL} B payload, all in flight; raw = PUSH/PULL + msgpack per message)")
        print(f"{'transport':<9} {'n':>6} {'raw msg/s':>10} {'shm:off':>9} {'shm:auto':>9} {ratios}")
        for transport, n, raw_rate, off_rate, auto_rate in small_rows:
            print(
                f"{transport:<9} {n:>6} {raw_rate:>10,.0f} {off_rate:>9,.0f} {auto_rate:>9,.0f} "
                f"{off_rate / raw_rate:>7.2f}x {auto_rate / raw_rate:>8.2f}x"
            )
        print(f"\ntotal time {time.perf_counter() - started:.1f}s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
