"""Peer processes for the ZmqConnector tests: each entry point runs in a spawned process.

Payloads are pseudo-random arrays rebuilt from ``(seed, size)``, so a receiver
checks bit-exactness by comparing digests without the parent holding the data.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
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


def stream_size(n: int) -> int:
    """The payload size of item ``n`` of a stream: mostly small (batched), some framed, a few over the shm threshold."""
    if n % 40 == 0:
        return 600_000
    if n % 7 == 0:
        return 64_000
    return 16 + (n * 37) % 3000


#: Who takes item ``n`` of a stream in :func:`concurrent_getters_main`, by ``n % 6``.
BLOCKING_GROUPS = (0, 1, 2)  # one blocking getter each, waiting for its keys in order
POLLED_GROUPS = (3, 4)  # one polling thread each
CONTESTED_GROUP = 5  # polled by both polling threads and waited for briefly by a fourth getter


def concurrent_getters_main(config: dict[str, Any], n: int, out: Any, forced: bool) -> None:
    """Take keys ``k0``..``k{n-1}`` (payload ``make_payload(stream_size(i), i)``) with several threads at once.

    Three consumers block in ``get_with_deadline`` on keys of their own, two threads poll ``get`` for
    keys of their own, and the keys of a last group are contended for by both pollers and a fourth
    thread waiting briefly. Every take is recorded; the report says which keys were missed, taken
    twice, or taken with another key's payload. ``forced``: under :func:`~tests.contention.forced_switches`.
    """
    from contextlib import nullcontext

    from tests.contention import forced_switches
    from zmq_omni.connectors.zmq import ZmqConnector

    keys = [f"k{i}" for i in range(n)]
    taken: list[tuple[str, int, str]] = []  # (key, seed of the payload, digest)
    errors: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    end = time.monotonic() + 60.0

    def record(key: str, got: tuple[Any, int]) -> None:
        with lock:
            taken.append((key, int(got[0]["seed"]), digest(got[0])))
            if len(taken) >= n:
                done.set()

    def guarded(body: Any) -> Any:
        def run(*args: Any) -> None:
            try:
                body(*args)
            except BaseException as exc:
                with lock:
                    errors.append(repr(exc))
                done.set()

        return run

    def own(group: int) -> list[str]:
        return [key for i, key in enumerate(keys) if i % 6 == group]

    @guarded
    def blocking(mine: list[str], seed: int) -> None:
        # A consumer: it waits for its key 20 ms at a time and works a while (up to 30 ms) after each
        # wait, so the socket changes hands between waiting getters and whoever reads it when none waits.
        think = random.Random(seed)
        for key in mine:
            got = None
            while got is None and time.monotonic() < end:
                got = conn.get_with_deadline("0", "1", key, deadline=min(time.monotonic() + 0.02, end))
                time.sleep(think.uniform(0.0, 0.03))
            if got is not None:  # a miss is named by the report
                record(key, got)

    def pending_of(mine: list[str], seen: set[str]) -> list[str]:
        with lock:
            return [key for key in mine if key not in seen]

    @guarded
    def polling(mine: list[str], contested: list[str], seen: set[str]) -> None:
        while not done.is_set() and time.monotonic() < end:
            left = pending_of(mine + contested, seen)
            if not left:
                return
            for key in left:
                got = conn.get("0", "1", key)
                if got is not None:
                    with lock:
                        seen.add(key)
                    record(key, got)
            time.sleep(0.0005)

    @guarded
    def briefly_waiting(contested: list[str], seen: set[str]) -> None:
        think = random.Random(len(contested))
        while not done.is_set() and time.monotonic() < end:
            time.sleep(think.uniform(0.0, 0.03))  # a consumer too, between its rounds of brief waits
            left = pending_of(contested, seen)
            if not left:
                return
            for key in left:
                got = conn.get_with_deadline("0", "1", key, deadline=time.monotonic() + 0.002)
                if got is not None:
                    with lock:
                        seen.add(key)
                    record(key, got)

    with forced_switches() if forced else nullcontext(), ZmqConnector(config) as conn:
        out.put(("ready", conn.endpoint))
        contested = own(CONTESTED_GROUP)
        seen: set[str] = set()  # contested and polled keys some thread took (the pollers stop asking for them)
        threads = [threading.Thread(target=blocking, args=(own(g), g)) for g in BLOCKING_GROUPS]
        threads += [threading.Thread(target=polling, args=(own(g), contested, seen)) for g in POLLED_GROUPS]
        threads.append(threading.Thread(target=briefly_waiting, args=(contested, seen)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, end - time.monotonic() + 5.0))
        stuck = sum(thread.is_alive() for thread in threads)
        health = conn.health()
    counts: dict[str, int] = {}
    for key, _, _ in taken:
        counts[key] = counts.get(key, 0) + 1
    wrong = [key for key, seed, dig in taken if f"k{seed}" != key or dig != expected_digest(stream_size(seed), seed)]
    report = {
        "taken": len(taken),
        "missing": [key for key in keys if key not in counts],
        "twice": sorted(key for key, count in counts.items() if count > 1),
        "wrong_payload": wrong,
        "errors": errors,
        "stuck_threads": stuck,
        "health": {k: health.get(k) for k in ("mailbox", "gets", "rejected_frames", "status")},
    }
    out.put(("done", report))


def expect_while_alive(proc: Any, queue: Any, tag: str, timeout: float = 60.0) -> tuple[Any, ...]:
    """:func:`expect`, failing at once (with the exit code) when the peer process died before sending it.

    A peer's output reaches the test's captured stderr, so pytest shows it with the failure.
    """
    import queue as queue_module

    deadline = time.monotonic() + timeout
    while True:
        try:
            message = queue.get(timeout=0.2)
        except queue_module.Empty:
            assert proc.is_alive(), f"the peer exited with code {proc.exitcode} before {tag!r} (its output is above)"
            assert time.monotonic() < deadline, f"no {tag!r} from the peer within {timeout} s"
            continue
        assert message[0] == tag, message
        return tuple(message[1:])


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
    """Keep ``conn``'s I/O thread busy while the block runs, so puts queue instead of leaving one by one.

    The data sockets of the peers already known are held too: a put that finds its peer idle would
    otherwise send at once from its own thread, alone, whenever the machine is slow enough that no
    two puts come within ``LONE_GAP_S`` of each other.
    """
    release = threading.Event()
    loop = conn.driver
    assert loop is not None
    loop.call_soon(lambda: release.wait(5))
    held = [peer.data_lock for peer in conn._sending.sender._core.peers.values()]
    for lock in held:
        assert lock.acquire(timeout=5)
    try:
        yield
    finally:
        for lock in held:
            lock.release()
        release.set()
