"""Shared-memory transfer benchmark: put->get time per payload size, with ratios, in one run.

Run:  python benchmarks/shm.py [--sizes 1K,64K,1M,16M,64M,256M] [--budget-mib 768]

Every row is the median over repetitions of one put->get of a dict holding one
float32 array of the given size, sender and receiver in this process (the data
path -- copies and page faults -- is the same across processes; only wake-ups
differ, and those are measured by the tests, not here). Paths:

* memcpy      -- one ``np.copyto`` into a pre-faulted buffer: the floor.
* zmq-ipc     -- raw pyzmq PUSH->PULL over ``ipc://`` with ``copy=False``.
* zmq-tcp     -- the same over ``tcp://127.0.0.1``.
* vllm-style  -- vllm-omni's SharedMemoryConnector path: pickle -> a new
                 segment -> copy out -> unpickle -> unlink.
* shm-conn    -- our SharedMemoryConnector (mailbox record + reused slot,
                 zero-copy lease on the receiver).
* zmq+slot    -- the handle-over-ZeroMQ design ZmqConnector's fast path will
                 use: SlotPool.write -> send the packed SlotHandle over ipc ->
                 SlotReader.open -> wire.decode (a prototype built from the
                 public shm API; see ``zmq_connector_fast_path``).
* zmq-off     -- ZmqConnector push mode over ``ipc://`` with ``shm: off``
                 (ordinary frames, copy=False; the small-message baseline).
* zmq-conn    -- ZmqConnector with ``shm: on``: its same-host fast path for
                 payloads >= ``shm_threshold`` (256 KiB), frames below it.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import zmq

from zmq_omni.connectors.shm import SharedMemoryConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.shm import SlotHandle, SlotPool, SlotReader
from zmq_omni.wire import decode, encode

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up: first-touch faults and caches are not what we compare
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_memcpy(arr: np.ndarray[Any, Any], reps: int) -> float:
    dst = np.empty_like(arr)
    dst.fill(0)
    return timed(lambda: np.copyto(dst, arr), reps)


def bench_zmq(arr: np.ndarray[Any, Any], reps: int, endpoint: str) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.bind(endpoint)
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))

        def once() -> None:
            push.send_multipart(encode({"data": arr}), copy=False)
            frames = pull.recv_multipart(copy=False)
            out = decode(frames)
            assert out["data"].nbytes == arr.nbytes

        return timed(once, reps)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def bench_vllm_style(arr: np.ndarray[Any, Any], reps: int) -> float:
    def once() -> None:
        payload = pickle.dumps({"data": arr}, protocol=5)
        seg = shared_memory.SharedMemory(create=True, size=len(payload))
        seg.buf[: len(payload)] = payload
        name, size = seg.name, len(payload)
        seg.close()
        reader = shared_memory.SharedMemory(name=name)
        copied = bytes(reader.buf[:size])
        reader.close()
        reader.unlink()
        out = pickle.loads(copied)
        assert out["data"].nbytes == arr.nbytes

    return timed(once, reps)


def bench_shm_connector(arr: np.ndarray[Any, Any], reps: int, shm_dir: str) -> float:
    config = {"namespace": f"bench-{uuid.uuid4().hex[:8]}", "shm_dir": shm_dir, "min_free_bytes": 0}
    with SharedMemoryConnector(config) as sender, SharedMemoryConnector(config) as receiver:

        def once() -> None:
            assert sender.put("0", "1", "k", {"data": arr})[0]
            got = receiver.get("0", "1", "k")
            assert got is not None and got[0]["data"].nbytes == arr.nbytes

        return timed(once, reps)


def bench_zmq_slot(arr: np.ndarray[Any, Any], reps: int, shm_dir: str, endpoint: str) -> float:
    """The fast-path design on raw pyzmq: only a SlotHandle crosses the socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pool = SlotPool(directory=shm_dir, min_free_bytes=0)
    reader = SlotReader(directory=shm_dir)
    try:
        pull.bind(endpoint)
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))

        def once() -> None:
            push.send(pool.write(encode({"data": arr})).pack())
            views = reader.open(SlotHandle.unpack(pull.recv()))
            assert views is not None
            out = decode(views)
            assert out["data"].nbytes == arr.nbytes

        return timed(once, reps)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        reader.close()
        pool.close()


def zmq_connector(arr: np.ndarray[Any, Any], reps: int, shm_dir: str, endpoint: str, shm: str) -> float:
    """ZmqConnector push mode over ``ipc://``, put then ``get_with_deadline``; ``shm`` is its policy."""
    base = {"endpoints": {"1": endpoint}, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "shm": shm}
    with (
        ZmqConnector({**base, "stage_id": "1", "role": "receiver"}) as receiver,
        ZmqConnector({**base, "stage_id": "0", "role": "sender"}) as sender,
    ):
        # Let the sender learn (same-host probe) that the receiver reads its shared memory.
        assert sender.put("0", "1", "warm", {"data": np.zeros(1 << 20, np.uint8)})[0]
        assert receiver.get_with_deadline("0", "1", "warm", deadline=time.monotonic() + 10) is not None

        def once() -> None:
            assert sender.put("0", "1", "k", {"data": arr})[0]
            got = receiver.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 30)
            assert got is not None and got[0]["data"].nbytes == arr.nbytes

        took = timed(once, reps)
        health = sender.health()
        fast = health["shm_puts"] > 1
        if shm != "off" and arr.nbytes >= sender.config.shm_threshold:
            assert fast, "the fast path was not taken"
        if shm == "off" or arr.nbytes < sender.config.shm_threshold:
            assert health["shm_puts"] <= 1
        return took


def reps_for(size: int, budget: int) -> int:
    return max(3, min(300, budget // max(size, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1K,64K,1M,16M,64M,256M")
    parser.add_argument("--budget-mib", type=int, default=768, help="bytes moved per path and size")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    budget = args.budget_mib << 20
    tmp = tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp")
    shm_dir = tempfile.mkdtemp(prefix="zo-bench-", dir="/dev/shm")
    cols = ["memcpy", "zmq-ipc", "zmq-tcp", "vllm-style", "shm-conn", "zmq+slot", "zmq-off", "zmq-conn"]
    print(f"put->get median, ms (pid {os.getpid()}, {os.cpu_count()} cpus)")
    print(f"{'size':>9} " + " ".join(f"{c:>10}" for c in cols) + "   ratios")
    try:
        for size in sizes:
            arr = np.random.default_rng(0).standard_normal(max(size // 4, 1)).astype(np.float32)
            reps = reps_for(size, budget)
            results = {
                "memcpy": bench_memcpy(arr, reps),
                "zmq-ipc": bench_zmq(arr, reps, f"ipc://{tmp}/raw.sock"),
                "zmq-tcp": bench_zmq(arr, reps, "tcp://127.0.0.1:*"),
                "vllm-style": bench_vllm_style(arr, reps),
                "shm-conn": bench_shm_connector(arr, reps, shm_dir),
                "zmq+slot": bench_zmq_slot(arr, reps, shm_dir, f"ipc://{tmp}/slot.sock"),
                "zmq-off": zmq_connector(arr, reps, shm_dir, f"ipc://{tmp}/off.sock", "off"),
                "zmq-conn": zmq_connector(arr, reps, shm_dir, f"ipc://{tmp}/conn.sock", "on"),
            }
            gc.collect()
            cells = " ".join(f"{v * 1e3:>10.3f}" for v in results.values())
            best = results["zmq-conn"]
            ratios = (
                f"conn/off {best / results['zmq-off']:.2f}x  "
                f"fast/memcpy {best / results['memcpy']:.2f}x  "
                f"vllm/fast {results['vllm-style'] / best:.1f}x  "
                f"tcp/fast {results['zmq-tcp'] / best:.1f}x  "
                f"ipc/shm-conn {results['zmq-ipc'] / results['shm-conn']:.2f}x  "
                f"vllm/shm-conn {results['vllm-style'] / results['shm-conn']:.1f}x"
            )
            print(f"{human(size):>9} {cells}   {ratios}", flush=True)
    finally:
        for directory in (tmp, shm_dir):
            for name in os.listdir(directory):
                os.unlink(os.path.join(directory, name))
            os.rmdir(directory)
    print("fast = zmq-conn (ZmqConnector, shm: on); conn/off < 1 means the shm machinery is not slower.")


if __name__ == "__main__":
    main()
