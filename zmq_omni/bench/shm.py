"""Shared-memory grid: put->get time per payload size through each path, with ratios.

Every figure is the median over repetitions of one put->get of a dict holding
one float32 array of the given size, sender and receiver in this process (the
data path -- copies and page faults -- is the same across processes; only
wake-ups differ, and those are measured by the tests, not here). Paths
(:data:`PATHS`):

* ``memcpy``: one ``np.copyto`` into a pre-faulted buffer: the floor.
* ``zmq-ipc``: raw pyzmq PUSH->PULL over ``ipc://`` with ``copy=False``.
* ``zmq-tcp``: the same over ``tcp://127.0.0.1``.
* ``vllm-style``: vllm-omni's shared-memory IPC path as its current code
  does it (``shm_write_bytes`` / ``shm_read_bytes`` with their CRC-32
  framing): pickle (protocol 5, in band, as cloudpickle does by default) ->
  prepend a magic/length/CRC-32 header (a second copy) -> a new segment ->
  copy out -> unlink -> strip the header (a copy) and check the CRC ->
  unpickle.
* ``pickle-shm``: the same without the framing (vllm-omni's earlier helpers):
  pickle -> a new segment -> copy out -> unlink -> unpickle. The cheapest
  pickle-through-a-fresh-segment path; reported so the gain does not rest on
  the framing alone.
* ``shm-conn``: our SharedMemoryConnector (mailbox record + reused slot,
  zero-copy lease on the receiver).
* ``zmq+slot``: the handle-over-ZeroMQ design on raw pyzmq: SlotPool.write ->
  send the packed SlotHandle over ipc -> SlotReader.open -> wire.decode.
* ``zmq-off``: ZmqConnector push mode over ``ipc://`` with ``shm: off``
  (ordinary frames, copy=False; the small-message baseline).
* ``zmq-conn``: ZmqConnector with ``shm: on``: its same-host fast path for
  payloads >= ``shm_threshold``, frames below it ("fast" in the ratios).
* ``zmq-pull``: ZmqConnector in pull mode with ``shm: on``: put, then a get
  with put's metadata; the server copies the payload into a slot at fetch
  time and replies with the handle.
"""

from __future__ import annotations

import binascii
import gc
import pickle
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import zmq

from ..connectors.shm import SharedMemoryConnector
from ..connectors.zmq import ZmqConnector
from ..shm import SlotHandle, SlotPool, SlotReader
from ..wire import decode, encode
from ._common import KIB, MIB, Comparison, median_time, size_label

__all__ = ["PATHS", "SIZES", "ShmRow", "repetitions", "run_shm"]

SIZES = [1 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
PATHS = (
    "memcpy",
    "zmq-ipc",
    "zmq-tcp",
    "vllm-style",
    "pickle-shm",
    "shm-conn",
    "zmq+slot",
    "zmq-off",
    "zmq-conn",
    "zmq-pull",
)
_FAST = "shm fast path (ZmqConnector ipc)"
_BASELINES = {
    "memcpy": "one memcpy of the payload",
    "vllm-style": "vllm-omni style: pickle+CRC framing+new segment",
    "pickle-shm": "pickle+new segment, no framing",
    "zmq-tcp": "raw pyzmq tcp copy=False",
    "zmq-ipc": "raw pyzmq ipc copy=False",
    "zmq-off": "ZmqConnector ipc shm=off",
}


@dataclass(frozen=True)
class ShmRow:
    """Median seconds of one put->get of ``size`` bytes per path (``times`` keyed by :data:`PATHS`)."""

    size: int
    reps: int
    times: Mapping[str, float]

    def comparisons(self) -> list[Comparison]:
        """The fast path (``zmq-conn``) against every other measured path that is a baseline."""
        if "zmq-conn" not in self.times:
            return []
        fast = self.times["zmq-conn"]
        return [
            Comparison("shm", _FAST, size_label(self.size), fast, self.times[path], name)
            for path, name in _BASELINES.items()
            if path in self.times
        ]


def _memcpy(arr: np.ndarray[Any, Any], reps: int) -> float:
    dst = np.empty_like(arr)
    dst.fill(0)
    return median_time(lambda: np.copyto(dst, arr), reps)


def _raw_zmq(arr: np.ndarray[Any, Any], reps: int, endpoint: str) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.bind(endpoint)
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))

        def once() -> None:
            push.send_multipart(encode({"data": arr}), copy=False)
            out = decode(pull.recv_multipart(copy=False))
            if out["data"].nbytes != arr.nbytes:
                raise RuntimeError("raw pyzmq: wrong size")

        return median_time(once, reps)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _buffer(seg: shared_memory.SharedMemory) -> memoryview:
    buf = seg.buf
    if buf is None:
        raise RuntimeError(f"segment {seg.name} is closed")
    return buf


# vllm-omni's framing of a shared-memory payload: magic, payload length, CRC-32 of the payload.
_VLLM_HEADER = struct.Struct(">8sQI")
_VLLM_MAGIC = b"OMNIIPC1"


def _through_new_segment(payload: bytes) -> bytes:
    """Write ``payload`` into a brand-new segment, copy it out, unlink: what both pickle paths share."""
    seg = shared_memory.SharedMemory(create=True, size=len(payload))
    name, size = seg.name, len(payload)
    _buffer(seg)[:size] = payload
    seg.close()
    reader = shared_memory.SharedMemory(name=name)
    copied = bytes(_buffer(reader)[:size])
    reader.close()
    reader.unlink()
    return copied


def _vllm_style(arr: np.ndarray[Any, Any], reps: int) -> float:
    def once() -> None:
        payload = pickle.dumps({"data": arr}, protocol=5)
        framed = _VLLM_HEADER.pack(_VLLM_MAGIC, len(payload), binascii.crc32(payload)) + payload
        raw = _through_new_segment(framed)
        magic, size, crc = _VLLM_HEADER.unpack(raw[: _VLLM_HEADER.size])
        body = raw[_VLLM_HEADER.size :]
        if magic != _VLLM_MAGIC or size != len(body) or binascii.crc32(body) != crc:
            raise RuntimeError("vllm-style: framing check failed")
        if pickle.loads(body)["data"].nbytes != arr.nbytes:
            raise RuntimeError("vllm-style: wrong size")

    return median_time(once, reps)


def _pickle_shm(arr: np.ndarray[Any, Any], reps: int) -> float:
    def once() -> None:
        copied = _through_new_segment(pickle.dumps({"data": arr}, protocol=5))
        if pickle.loads(copied)["data"].nbytes != arr.nbytes:
            raise RuntimeError("pickle-shm: wrong size")

    return median_time(once, reps)


def _shm_connector(arr: np.ndarray[Any, Any], reps: int, shm_dir: str) -> float:
    config = {"namespace": f"bench-{uuid.uuid4().hex[:8]}", "shm_dir": shm_dir, "min_free_bytes": 0}
    with SharedMemoryConnector(config) as sender, SharedMemoryConnector(config) as receiver:

        def once() -> None:
            if not sender.put("0", "1", "k", {"data": arr})[0]:
                raise RuntimeError("SharedMemoryConnector: put failed")
            got = receiver.get("0", "1", "k")
            if got is None or got[0]["data"].nbytes != arr.nbytes:
                raise RuntimeError("SharedMemoryConnector: get failed")

        return median_time(once, reps)


def _zmq_slot(arr: np.ndarray[Any, Any], reps: int, shm_dir: str, endpoint: str) -> float:
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
            if views is None or decode(views)["data"].nbytes != arr.nbytes:
                raise RuntimeError("zmq+slot: read failed")

        return median_time(once, reps)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        reader.close()
        pool.close()


def _zmq_connector(arr: np.ndarray[Any, Any], reps: int, shm_dir: str, endpoint: str, shm: str) -> float:
    base = {"endpoints": {"1": endpoint}, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "shm": shm}
    receiver = ZmqConnector({**base, "stage_id": "1", "role": "receiver"})
    with receiver:
        sender = ZmqConnector({**base, "stage_id": "0", "role": "sender"})
        with sender:
            return _timed_put_get(sender, receiver, arr, reps, fast_expected=shm != "off")


def _zmq_pull(arr: np.ndarray[Any, Any], reps: int, shm_dir: str, endpoint: str) -> float:
    base = {"mode": "pull", "endpoints": {"0": endpoint}, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "shm": "on"}
    sender = ZmqConnector({**base, "stage_id": "0", "role": "sender"})
    receiver = ZmqConnector({**base, "stage_id": "1", "role": "receiver"})
    with sender, receiver:

        def once() -> None:
            ok, _, meta = sender.put("0", "1", "k", {"data": arr})
            got = receiver.get_with_deadline("0", "1", "k", meta, deadline=time.monotonic() + 30) if ok else None
            if got is None or got[0]["data"].nbytes != arr.nbytes:
                raise RuntimeError(f"ZmqConnector pull: get failed: {receiver.drain_failures()}")

        once()  # the first fetch learns the server's probe (frames)
        took = median_time(once, reps)
        shm_puts = sender.health()["shm_puts"]
    if arr.nbytes >= sender.config.shm_threshold and shm_puts < reps:
        raise RuntimeError("ZmqConnector pull: the shared-memory fast path was not taken")
    return took


def _timed_put_get(
    sender: ZmqConnector, receiver: ZmqConnector, arr: np.ndarray[Any, Any], reps: int, *, fast_expected: bool
) -> float:
    # Let the sender learn (same-host probe) that the receiver reads its shared memory.
    if not sender.put("0", "1", "warm", {"data": np.zeros(MIB, np.uint8)})[0]:
        raise RuntimeError("ZmqConnector: warm-up put failed")
    if receiver.get_with_deadline("0", "1", "warm", deadline=time.monotonic() + 10) is None:
        raise RuntimeError("ZmqConnector: warm-up get failed")

    def once() -> None:
        if not sender.put("0", "1", "k", {"data": arr})[0]:
            raise RuntimeError(f"ZmqConnector: put failed: {sender.drain_failures()}")
        got = receiver.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 30)
        if got is None or got[0]["data"].nbytes != arr.nbytes:
            raise RuntimeError("ZmqConnector: get failed")

    took = median_time(once, reps)
    shm_puts = sender.health()["shm_puts"]
    fast_expected = fast_expected and arr.nbytes >= sender.config.shm_threshold
    # Figures for the wrong path would be worse than none.
    if fast_expected and shm_puts <= 1:
        raise RuntimeError("ZmqConnector: the shared-memory fast path was not taken")
    if not fast_expected and shm_puts > 1:
        raise RuntimeError("ZmqConnector: the shared-memory fast path was taken with shm off or below threshold")
    return took


def repetitions(size: int, budget_bytes: int) -> int:
    """Repetitions per path: ``budget_bytes`` worth, between 3 and 300."""
    return max(3, min(300, budget_bytes // max(size, 1)))


def run_shm(
    sizes: Sequence[int] = SIZES,
    *,
    budget_bytes: int = 768 * MIB,
    paths: Sequence[str] = PATHS,
    on_row: Callable[[ShmRow], None] | None = None,
) -> list[ShmRow]:
    """put->get time per size through each of ``paths``.

    Args:
        sizes: payload sizes in bytes.
        budget_bytes: bytes moved per path and size (see :func:`repetitions`).
        paths: which of :data:`PATHS` to measure.
        on_row: called with each row as soon as it is measured.

    Returns:
        One row per size.

    Raises:
        ValueError: a path that is not in :data:`PATHS`.
    """
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"unknown paths {unknown}; known: {list(PATHS)}")
    tmp = tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp")
    shm_dir = tempfile.mkdtemp(prefix="zo-bench-", dir="/dev/shm")
    runners: dict[str, Callable[[np.ndarray[Any, Any], int], float]] = {
        "memcpy": _memcpy,
        "zmq-ipc": lambda arr, reps: _raw_zmq(arr, reps, f"ipc://{tmp}/raw.sock"),
        "zmq-tcp": lambda arr, reps: _raw_zmq(arr, reps, "tcp://127.0.0.1:*"),
        "vllm-style": _vllm_style,
        "pickle-shm": _pickle_shm,
        "shm-conn": lambda arr, reps: _shm_connector(arr, reps, shm_dir),
        "zmq+slot": lambda arr, reps: _zmq_slot(arr, reps, shm_dir, f"ipc://{tmp}/slot.sock"),
        "zmq-off": lambda arr, reps: _zmq_connector(arr, reps, shm_dir, f"ipc://{tmp}/off.sock", "off"),
        "zmq-conn": lambda arr, reps: _zmq_connector(arr, reps, shm_dir, f"ipc://{tmp}/conn.sock", "on"),
        "zmq-pull": lambda arr, reps: _zmq_pull(arr, reps, shm_dir, f"ipc://{tmp}/pull.sock"),
    }
    rows = []
    try:
        for size in sizes:
            arr = np.random.default_rng(0).standard_normal(max(size // 4, 1)).astype(np.float32)
            reps = repetitions(size, budget_bytes)
            row = ShmRow(size, reps, {path: runners[path](arr, reps) for path in PATHS if path in paths})
            del arr
            gc.collect()
            rows.append(row)
            if on_row is not None:
                on_row(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return rows
