"""Peer processes for the ZmqConnector tests: each entry point runs in a spawned process.

Payloads are pseudo-random arrays rebuilt from ``(seed, size)``, so a receiver
checks bit-exactness by comparing digests without the parent holding the data.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

SPAWN = mp.get_context("spawn")

Item = tuple[str, str, int, int]  # (to_stage, key, size, seed)
Want = tuple[str, str, dict[str, Any] | None]  # (from_stage, key, metadata)


def make_payload(size: int, seed: int) -> dict[str, Any]:
    """``size`` pseudo-random bytes (as a uint8 array) plus metadata naming the seed."""
    words = (size + 7) // 8
    mixed = (np.arange(words, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    mixed ^= mixed >> np.uint64(29)
    return {"data": mixed.view(np.uint8)[:size], "seed": seed, "size": size}


def digest(obj: Any) -> str:
    """A digest of a received payload (data bytes, seed, size)."""
    data = np.ascontiguousarray(obj["data"])
    return hashlib.blake2b(data.data, digest_size=16, key=f"{obj['seed']}:{obj['size']}".encode()).hexdigest()


def expected_digest(size: int, seed: int) -> str:
    """What :func:`digest` gives for the payload ``make_payload(size, seed)``."""
    return digest(make_payload(size, seed))


def put_main(
    config: dict[str, Any],
    items: Sequence[Item],
    out: Any,
    threads: int = 1,
    from_stage: str = "0",
    linger_s: float = 30.0,
) -> None:
    """Put every item (from ``threads`` threads), report metadata, wait until nothing is pending."""
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector(config) as conn:
        out.put(("ready", conn.endpoint))
        results: dict[str, Any] = {}
        lock = threading.Lock()

        def run(part: Sequence[Item]) -> None:
            for to_stage, key, size, seed in part:
                ok, nbytes, meta = conn.put(from_stage, to_stage, key, make_payload(size, seed))
                with lock:
                    results[key] = (ok, nbytes, meta)

        workers = [threading.Thread(target=run, args=(items[i::threads],)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        out.put(("sent", results))
        deadline = time.monotonic() + linger_s
        while conn.health()["pending"] and time.monotonic() < deadline:
            time.sleep(0.02)
        failures = [(f.key, f.reason, type(f.error).__name__) for f in conn.drain_failures()]
        out.put(("done", failures, conn.health()))


def get_main(
    config: dict[str, Any],
    wants: Sequence[Want],
    out: Any,
    to_stage: str = "1",
    timeout_s: float = 60.0,
    log_path: str | None = None,
    pace_s: float = 0.0,
) -> None:
    """Get every wanted key (waiting up to ``timeout_s`` in all), reporting digests (None = missing)."""
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector(config) as conn:
        out.put(("ready", conn.endpoint))
        deadline = time.monotonic() + timeout_s
        results: dict[str, str | None] = {}
        log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 -- closed below
        try:
            for from_stage, key, meta in wants:
                got = conn.get_with_deadline(from_stage, to_stage, key, meta, deadline=deadline)
                results[key] = None if got is None else digest(got[0])
                if got is not None and log is not None:
                    log.write(key + "\n")
                if pace_s:
                    time.sleep(pace_s)  # a deliberately slow consumer
        finally:
            if log is not None:
                log.close()
        out.put(("done", results, conn.health()))


def resume_main(config: dict[str, Any], keys: Sequence[str], out: Any, seen_before: Sequence[str]) -> None:
    """A restarted receiver: collect keys in any order until all not seen before arrived, plus a grace period."""
    from zmq_omni.connectors.zmq import ZmqConnector

    with ZmqConnector(config) as conn:
        out.put(("ready", conn.endpoint))
        needed = set(keys) - set(seen_before)
        got: dict[str, str] = {}
        deadline = time.monotonic() + 60.0
        settled_at: float | None = None
        while time.monotonic() < deadline:
            for key in keys:
                if key not in got:
                    item = conn.get("0", "1", key)
                    if item is not None:
                        got[key] = digest(item[0])
            if settled_at is None and needed <= set(got):
                settled_at = time.monotonic()
            if settled_at is not None and time.monotonic() - settled_at > 1.5:
                break
            time.sleep(0.005)
        out.put(("done", got, conn.health()))


def expect(queue: Any, tag: str, timeout: float = 60.0) -> tuple[Any, ...]:
    """Next message from a peer, which must carry ``tag``."""
    message = queue.get(timeout=timeout)
    assert message[0] == tag, message
    return tuple(message[1:])


@contextmanager
def spawned(target: Any, *args: Any) -> Iterator[tuple[Any, Any]]:
    """Run ``target(*args, queue)`` in a spawned process; yield ``(process, queue)``; always reap it."""
    queue = SPAWN.Queue()
    proc = SPAWN.Process(target=target, args=(*args[:2], queue, *args[2:]), daemon=True)
    proc.start()
    try:
        yield proc, queue
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        queue.close()
        queue.join_thread()


@contextmanager
def io_paused(conn: Any) -> Iterator[None]:
    """Keep ``conn``'s I/O thread busy while the block runs, so puts queue instead of leaving one by one."""
    release = threading.Event()
    loop = conn._loop
    assert loop is not None
    loop.call_soon(lambda: release.wait(5))
    try:
        yield
    finally:
        release.set()
