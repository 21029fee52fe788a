"""Child-process bodies for the shared-memory tests (importable by the spawn start method)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

EDGE = ("0", "1")


def digest(arr: np.ndarray[Any, Any]) -> tuple[str, tuple[int, ...], str]:
    """dtype, shape and a hash of the raw bytes: bit-exact comparison across processes."""
    return arr.dtype.str, tuple(arr.shape), hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8)).hexdigest()


def dead_process_segment(shm_dir: str) -> str:
    """The name of a segment left in ``shm_dir`` by a process that exited without closing it."""
    child = (
        "import os, sys; from zmq_omni.shm import Segment; "
        "seg = Segment.create(4096, directory=sys.argv[1]); print(seg.name, flush=True); os._exit(0)"
    )
    left = subprocess.run([sys.executable, "-c", child, shm_dir], capture_output=True, text=True, check=True)
    name = left.stdout.strip()
    assert name in os.listdir(shm_dir)  # the dead process's segment is still there
    return name


def receive_digests(config: dict[str, Any], keys: list[str], out: Any) -> None:
    """Get each key and send back the digest of every array of the payload."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    with SharedMemoryConnector(config) as conn:
        result = {}
        for key in keys:
            got = conn.get_with_deadline(*EDGE, key, deadline=time.monotonic() + 30)
            assert got is not None, key
            result[key] = {name: digest(arr) for name, arr in got[0].items()}
        out.put(result)


def put_keys(config: dict[str, Any], payloads: dict[str, Any], delay: float, done: Any) -> None:
    """Sleep ``delay``, put every payload, and keep the connector open until ``done`` is set."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    time.sleep(delay)
    with SharedMemoryConnector(config) as conn:
        for key, payload in payloads.items():
            assert conn.put(*EDGE, key, payload)[0]
        # close() withdraws unconsumed puts, so stay open until the receiver is done.
        done.wait(30)


def race_for_keys(config: dict[str, Any], keys: list[str], start: Any, out: Any) -> None:
    """One pass over ``keys`` (all already put) once ``start`` fires; report the keys won."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    with SharedMemoryConnector(config) as conn:
        start.wait(30)
        won = []
        for key in keys:
            got = conn.get(*EDGE, key)
            if got is not None:
                assert got[0] == key
                won.append(key)
        out.put(won)


def stream_puts(config: dict[str, Any], count: int, size: int, ready: Any) -> None:
    """Put ``count`` payloads of ``size`` bytes as fast as possible, then block (to be killed)."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    conn = SharedMemoryConnector(config)
    data = np.zeros(size, dtype=np.uint8)
    for i in range(count):
        data[:8] = np.frombuffer(np.int64(i).tobytes(), dtype=np.uint8)
        assert conn.put(*EDGE, f"s{i}", {"i": i, "data": data})[0]
        if i == count // 2:
            ready.set()
    ready.set()
    time.sleep(600)


def hold_leases(config: dict[str, Any], keys: list[str], ready: Any) -> None:
    """Get every key, keep the arrays (leases) alive, then block (to be killed)."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    conn = SharedMemoryConnector(config)
    held = []
    for key in keys:
        got = conn.get_with_deadline(*EDGE, key, deadline=time.monotonic() + 30)
        assert got is not None, key
        held.append(got[0])
    ready.set()
    time.sleep(600)


def inspect_zero_copy(config: dict[str, Any], key: str, out: Any) -> None:
    """Get ``key`` and report where the array's memory lives (from /proc/self/maps)."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    with SharedMemoryConnector(config) as conn:
        got = conn.get_with_deadline(*EDGE, key, deadline=time.monotonic() + 30)
        assert got is not None
        arr = got[0]["data"]
        address = arr.__array_interface__["data"][0]
        mapped = None
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi and len(fields) >= 6:
                    mapped = fields[5]
        out.put({"mapped": mapped, "digest": digest(arr), "owndata": bool(arr.flags.owndata)})
        del arr, got


def attach_and_exit(shm_dir: str, name: str) -> None:
    """Attach a segment and exit normally: nothing may unlink it behind the owner's back."""
    from zmq_omni.shm import Segment

    seg = Segment.attach(name, directory=shm_dir)
    assert seg.mm[:4] == b"ZOSL"
    seg.close()


def make_leftovers(shm_dir: str, namespace: str, ready: Any) -> None:
    """Leave a slot, a record and a spill-less mailbox entry behind, then wait to be killed."""
    from zmq_omni.connectors.shm import SharedMemoryConnector

    conn = SharedMemoryConnector({"namespace": namespace, "shm_dir": shm_dir, "inline_max_bytes": 0})
    assert conn.put(*EDGE, "left", {"data": np.ones(1 << 16)})[0]
    assert conn.put(*EDGE, "left-small", {"x": 1})[0]
    ready.set()
    time.sleep(600)


def lease_one(shm_dir: str, handle: bytes, ready: Any) -> None:
    """Lease a slot and block until killed, holding the view."""
    from zmq_omni.shm import SlotHandle, SlotReader

    reader = SlotReader(directory=shm_dir)
    views = reader.open(SlotHandle.unpack(handle))
    assert views is not None
    ready.set()
    time.sleep(600)
    del views
