"""Acceptance of ``zmq_omni.aio`` (issue 15): real sockets, real processes, default asyncio loop and uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvloop

from tests.aio_peers import sizes
from tests.connector_kinds import KINDS
from tests.zmq_peers import digest, expected_digest
from zmq_omni.aio import AsyncChunkSender, AsyncChunkStream, AsyncConnector
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import DecodeError, EncodeError, TransportTimeoutError

ROOT = Path(__file__).resolve().parent.parent

LOOPS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


# -- peers -------------------------------------------------------------------------------


class Peer:
    """A peer process of tests/aio_peers.py, driven through stdin/stdout; its output is shown when a test fails."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 -- closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.aio_peers", name, json.dumps(kwargs)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )
        self.lines: list[str] = []

    def event(self, name: str, timeout: float = 90.0) -> dict[str, Any]:
        """The next event line; it must be ``name``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, remaining))
            assert ready, f"no {name!r} from the peer within {timeout}s\n{self.output()}"
            line = self.proc.stdout.readline()
            assert line, f"peer exited before {name!r}\n{self.output()}"
            self.lines.append(line)
            message: dict[str, Any] = json.loads(line)
            assert message["event"] == name, self.output()
            return message

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def output(self) -> str:
        self.err.seek(0)
        return "peer stdout:\n" + "".join(self.lines) + "peer stderr:\n" + self.err.read().decode(errors="replace")

    def stop(self) -> None:
        self.send("quit")
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        code = self.proc.returncode
        out = self.output()
        self.err.close()
        assert code == 0, f"peer exited with {code}\n{out}"


@contextlib.contextmanager
def peer(name: str, **kwargs: Any) -> Iterator[Peer]:
    p = Peer(name, **kwargs)
    try:
        yield p
    except BaseException:
        print(p.output())  # pytest shows it with the failure
        p.proc.kill()
        raise
    finally:
        if p.proc.poll() is None or not p.err.closed:
            with contextlib.suppress(AssertionError, ValueError):
                p.stop()


def _loop_specs(kind: str, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Receiver and sender specs of a ZmqConnector pair driven by the event loop (``AsyncConnector.create``)."""
    if kind == "zmq-loop":
        endpoints = {"1": f"ipc://{tmp}/zmq-loop-1.sock"}
        receiver, sender = {"mode": "push"}, {"mode": "push"}
    else:
        endpoints = {"0": f"ipc://{tmp}/zmq-loop-0.sock"}
        receiver, sender = {"mode": "pull"}, {"mode": "pull"}
    receiver.update(stage_id="1", role="receiver", endpoints=endpoints)
    sender.update(stage_id="0", role="sender", endpoints=endpoints)
    return {"name": "ZmqConnector", "extra": receiver}, {"name": "ZmqConnector", "extra": sender}


@contextlib.asynccontextmanager
async def pair(kind: str, tmp: Path) -> AsyncIterator[tuple[AsyncConnector, AsyncConnector, tuple[str, str]]]:
    """Sender and receiver of a connector kind, both wrapped; closed on exit.

    ``zmq-loop`` and ``zmq-loop-pull``: ZeroMQ connectors driven by the event loop, built by
    ``AsyncConnector.create``; the other kinds are the contract suite's, wrapped.
    """
    if kind.startswith("zmq-loop"):
        receiver_spec, sender_spec = _loop_specs(kind, tmp)
        async with AsyncConnector.create(receiver_spec) as get_side, AsyncConnector.create(sender_spec) as put_side:
            yield put_side, get_side, ("0", "1")
        return
    with KINDS[kind](tmp) as (sender, receiver, edge):
        async with (
            AsyncConnector(sender, close_connector=False) as put_side,
            AsyncConnector(receiver, close_connector=False) as get_side,
        ):
            yield put_side, get_side, edge


ALL_KINDS = ["inproc", "shm", "zmq", "zmq-pull", "zmq-loop", "zmq-loop-pull"]


# -- 5,000 concurrent gets across two processes ------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_5000_concurrent_gets_across_processes_exact_and_threadless(short_tmp: Path, mode: str) -> None:
    n = 5000
    if mode == "push":
        endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
        receiver = {"stage_id": "1", "role": "receiver", "endpoints": endpoints}
        sender = {"stage_id": "0", "role": "sender", "endpoints": endpoints}
    else:
        endpoints = {"0": f"ipc://{short_tmp}/s.sock"}
        receiver = {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": endpoints}
        sender = {"stage_id": "0", "role": "sender", "mode": "pull", "endpoints": endpoints, "max_unacked": n}
    async with AsyncConnector(ZmqConnector(receiver)) as conn:
        with peer("putter", config=sender, n=n) as putter:
            putter.event("ready")
            await conn.get("0", "1", "warm-up", timeout=0)  # binds the loop (and pull mode's channel)
            threads_before = threading.active_count()
            os_threads_before = len(os.listdir("/proc/self/task"))  # ZeroMQ's own I/O threads included
            tasks = [asyncio.create_task(conn.get("0", "1", f"k{i}", timeout=120)) for i in range(n)]
            while conn.health()["aio_gets_waiting"] < n:
                await asyncio.sleep(0.01)
            threads_during = threading.active_count()
            os_threads_during = len(os.listdir("/proc/self/task"))
            putter.send("go")
            results = await asyncio.gather(*tasks)
            sent = putter.event("sent")
        assert sent["bad"] == [] and sent["failures"] == [], sent
    missing = [i for i, got in enumerate(results) if got is None]
    assert missing == []
    wrong = [
        i
        for i, (got, size) in enumerate(zip(results, sizes(n), strict=True))
        if got is None or digest(got[0]) != expected_digest(size, i)
    ]
    assert wrong == []
    # Every get waited at once, and they cost no thread: the count is what it was with none waiting.
    assert threads_during == threads_before
    assert os_threads_during == os_threads_before


# -- cancellation loses nothing ---------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ALL_KINDS)
async def test_cancellation_at_any_point_loses_nothing(short_tmp: Path, kind: str) -> None:
    rng = random.Random(1515)
    rounds, per_round = 30, 12
    handed_back_seen = 0
    async with pair(kind, short_tmp) as (put_side, get_side, edge):
        for round_no in range(rounds):
            keys = [f"r{round_no}-{i}" for i in range(per_round)]
            got: dict[str, Any] = {}

            tasks: list[asyncio.Task[None]] = []

            async def getter(key: str, got: dict[str, Any] = got, tasks: list[asyncio.Task[None]] = tasks) -> None:
                result = await get_side.get(*edge, key, timeout=30)
                if result is not None:
                    assert key not in got, f"{key} delivered twice"
                    got[key] = result[0]
                    if rng.random() < 0.3:
                        # Resumed by a wake-up that may have taken items for other gets too, whose tasks
                        # resume after this one: a cancel here lands between their take and their resumption.
                        rng.choice(tasks).cancel()

            async def putter(key: str, value: int) -> None:
                for _ in range(rng.randrange(4)):
                    await asyncio.sleep(0)
                ok, _, _ = await put_side.put(*edge, key, {"v": value})
                assert ok

            tasks += [asyncio.create_task(getter(k)) for k in keys]
            puts = [asyncio.create_task(putter(k, i)) for i, k in enumerate(keys)]
            # Cancel each get after a random number of loop turns: before it waits and while it waits.
            for task in tasks:
                for _ in range(rng.randrange(6)):
                    await asyncio.sleep(0)
                if rng.random() < 0.7:
                    task.cancel()
            await asyncio.gather(*puts)
            await asyncio.gather(*tasks, return_exceptions=True)
            handed_back_seen += get_side.health()["aio_handed_back"]
            # Whatever a cancelled get did not deliver is still there for a later one, exactly once.
            for key in keys:
                if key not in got:
                    again = await get_side.get(*edge, key, timeout=10)
                    assert again is not None, f"{kind}: {key} lost in round {round_no}"
                    got[key] = again[0]
            assert {k: v["v"] for k, v in got.items()} == {k: i for i, k in enumerate(keys)}
            assert await get_side.get(*edge, keys[0], timeout=0) is None  # nothing twice
            assert get_side.health()["aio_handed_back"] == 0
    # The schedule did reach the window where an item was already taken for a cancelled get.
    assert handed_back_seen > 0


@pytest.mark.anyio
async def test_an_awaited_get_whose_shared_memory_payload_is_gone_times_out_and_records_why(
    short_tmp: Path, shm_dir: str
) -> None:
    """The loop reads the socket (a get waited), the payload's pool is unlinked before any read: None, one failure."""
    endpoints = {"1": f"ipc://{short_tmp}/r1"}
    base = {"endpoints": endpoints, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "heartbeat_s": 0.1}
    receiver = ZmqConnector({**base, "stage_id": "1", "role": "receiver"})
    async with AsyncConnector(receiver) as conn:
        assert await conn.get("0", "1", "warm-up", timeout=0.05) is None  # a get waited: the loop reads now
        sender = ZmqConnector({**base, "stage_id": "0", "role": "sender", "shm": "on", "shm_threshold": 8192})
        try:  # on the loop thread: nothing reads the handle before the pool is gone
            assert sender.put("0", "1", "k0", {"data": np.ones(1 << 16, np.uint8)})[0]
            assert sender.health()["shm_puts"] == 1
        finally:
            sender.close()
        assert await conn.get("0", "1", "k0", timeout=1.0) is None
        failures = receiver.drain_failures()
        assert [(f.op, f.key) for f in failures] == [("get", "k0")], failures
        assert "shared-memory payload of 'k0'" in failures[0].reason
    assert [n for n in os.listdir(shm_dir) if n.startswith("zomni_")] == []


@pytest.mark.anyio
async def test_get_cancelled_after_its_item_was_taken_hands_it_back() -> None:
    namespace = uuid.uuid4().hex
    async with (
        AsyncConnector(InProcConnector({"namespace": namespace})) as conn,
        AsyncConnector(InProcConnector({"namespace": namespace})) as other,
    ):
        cancelled_b: list[bool] = []

        async def get_a() -> None:
            assert await conn.get("0", "1", "a") is not None
            # Resumed after the wake-up that took b's item too, before b's task resumes: b is the
            # only place that item is now.
            cancelled_b.append(task_b.cancel())

        task_a = asyncio.create_task(get_a())
        task_b = asyncio.create_task(conn.get("0", "1", "b"))
        await asyncio.sleep(0)
        assert conn.health()["aio_gets_waiting"] == 2
        await other.put("0", "1", "a", {"v": 1})  # both before the wake-up: one wake-up takes both
        await other.put("0", "1", "b", {"v": 2})
        await task_a
        with pytest.raises(asyncio.CancelledError):
            await task_b
        assert cancelled_b == [True]
        assert conn.health()["aio_handed_back"] == 1
        got = await conn.get("0", "1", "b", timeout=1)
        assert got is not None and got[0] == {"v": 2}
        assert conn.health()["aio_handed_back"] == 0


@pytest.mark.anyio
async def test_pull_mode_item_served_after_cancel_is_handed_back(short_tmp: Path) -> None:
    async with pair("zmq-pull", short_tmp) as (put_side, get_side, edge):
        task = asyncio.create_task(get_side.get(*edge, "late", timeout=30))
        # A waiting pull-mode get has sent its FETCH (both happen before its first await).
        while get_side.health()["aio_gets_waiting"] < 1:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ok, _, _ = await put_side.put(*edge, "late", {"v": 1})
        assert ok
        # The parked FETCH of the cancelled get is served; its item waits here for the next get.
        got = await get_side.get(*edge, "late", timeout=10)
        assert got is not None and got[0] == {"v": 1}


# -- a put waiting for window room does not block the loop -------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("face", ["threaded", "loop"])
async def test_put_waiting_for_room_lets_a_ticker_tick(short_tmp: Path, mode: str, face: str) -> None:
    if mode == "push":
        endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
        send_cfg = {"stage_id": "0", "role": "sender", "endpoints": endpoints, "max_unacked": 2}
        recv_cfg = {"stage_id": "1", "role": "receiver", "endpoints": endpoints}
    else:
        endpoints = {"0": f"ipc://{short_tmp}/s.sock"}
        send_cfg = {"stage_id": "0", "role": "sender", "mode": "pull", "endpoints": endpoints, "max_unacked": 2}
        recv_cfg = {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": endpoints}
    with ZmqConnector(recv_cfg) as receiver:
        wrapped = (
            AsyncConnector(ZmqConnector(send_cfg))
            if face == "threaded"
            else AsyncConnector.create({"name": "ZmqConnector", "extra": send_cfg})
        )
        async with wrapped as sender:
            assert (await sender.put("0", "1", "a", 1))[0]
            assert (await sender.put("0", "1", "b", 2))[0]
            ticks = 0
            stop = asyncio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.005)

            ticking = asyncio.create_task(ticker())
            blocked = asyncio.create_task(sender.put("0", "1", "c", 3))
            while ticks < 20:  # the loop runs on while the third put waits
                await asyncio.sleep(0.005)
            assert not blocked.done(), "the window was full: the put must still be waiting"
            assert sender.health()["aio_puts_waiting"] == 1
            ticks_while_waiting = ticks

            # Consuming one put frees room: the waiting put goes through. (The blocking gets run in a
            # thread: a pull-mode get is served by the sender, on this loop when the loop drives it.)
            def take(key: str) -> Any:
                return receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 10)

            assert await asyncio.to_thread(take, "a") == (1, 10)
            ok, _, _ = await asyncio.wait_for(blocked, 30)
            stop.set()
            await ticking
            assert ok and ticks_while_waiting >= 20
            for key, value in (("b", 2), ("c", 3)):
                got = await asyncio.to_thread(take, key)
                assert got is not None and got[0] == value


@pytest.mark.anyio
async def test_replies_that_free_room_wake_the_loop_only_while_a_put_waits(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    send_cfg = {"stage_id": "0", "role": "sender", "endpoints": endpoints, "max_unacked": 10_000}
    with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}) as receiver:
        async with AsyncConnector(ZmqConnector(send_cfg)) as sender:
            watch = sender._watch
            assert watch is not None
            drain = watch.drain
            room_wake_ups = 0

            def counting_drain() -> tuple[Any, bool]:
                nonlocal room_wake_ups
                arrived, room = drain()
                room_wake_ups += room
                return arrived, room

            watch.drain = counting_drain  # type: ignore[method-assign]
            for i in range(300):  # the window never fills: no put waits
                assert (await sender.put("0", "1", f"k{i}", i))[0]
            taken = await asyncio.to_thread(
                lambda: [
                    receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 10) for i in range(300)
                ]
            )
            assert [got[0] if got else None for got in taken] == list(range(300))
            assert await asyncio.to_thread(sender.connector.flush, 10)  # every reply (arrived, consumed) came in
            await asyncio.sleep(0.05)  # a wake-up on its way would be drained by now
            assert room_wake_ups == 0


@pytest.mark.anyio
async def test_put_cancelled_while_waiting_for_room_is_not_made(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}) as receiver:
        async with AsyncConnector(
            ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints, "max_unacked": 1})
        ) as sender:
            assert (await sender.put("0", "1", "a", 1))[0]
            waiting = asyncio.create_task(sender.put("0", "1", "b", 2))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert sender.health()["aio_puts_waiting"] == 0
            assert receiver.get_with_deadline("0", "1", "a", deadline=time.monotonic() + 10) == (1, 10)
            assert (await sender.put("0", "1", "c", 3, timeout=10))[0]  # the room went to the next put
            got = receiver.get_with_deadline("0", "1", "c", deadline=time.monotonic() + 10)
            assert got is not None and got[0] == 3
            assert receiver.get("0", "1", "b") is None


@pytest.mark.anyio
async def test_put_without_room_fails_at_its_timeout(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}):
        async with AsyncConnector(
            ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints, "max_unacked": 1})
        ) as sender:
            assert (await sender.put("0", "1", "a", 1))[0]
            assert await sender.put("0", "1", "b", 2, timeout=0.2) == (False, 0, None)
            failures = sender.connector.drain_failures()
            assert [(f.key, type(f.error)) for f in failures] == [("b", TransportTimeoutError)]
            # A payload that cannot be encoded, found out while it waited for room, raises in its own caller.
            ahead = asyncio.create_task(sender.put("0", "1", "c", 3, timeout=0.5))
            await asyncio.sleep(0.01)
            assert sender.health()["aio_puts_waiting"] == 1
            with pytest.raises(EncodeError):
                await sender.put("0", "1", "bad", object(), timeout=0.1)  # queued behind "c", tried at its timeout
            assert await ahead == (False, 0, None)


@pytest.mark.anyio
async def test_put_at_zeromq_high_water_mark_waits_without_blocking_the_loop(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}  # no receiver yet: ZeroMQ queues up to its high-water mark
    big = np.ones(4096, dtype=np.float64)  # too large to ride in a batch: a direct send
    async with AsyncConnector(
        ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints, "hwm": 4, "shm": "off"})
    ) as sender:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticking = asyncio.create_task(ticker())
        results = [await sender.put("0", "1", f"k{i}", big, timeout=0.3) for i in range(12)]
        refused = [i for i, (ok, _, _) in enumerate(results) if not ok]
        assert refused, "ZeroMQ's queue never filled"
        assert ticks >= 20, "the loop stopped while puts waited at the high-water mark"
        failures = sender.connector.drain_failures()
        assert {f.key for f in failures} == {f"k{i}" for i in refused}
        # A receiver drains the queue: its arrivals tell the waiting put there is room again.
        with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}) as receiver:
            ok, _, _ = await sender.put("0", "1", "late", big, timeout=20)
            assert ok
            got = receiver.get_with_deadline("0", "1", "late", deadline=time.monotonic() + 20)
            assert got is not None and np.array_equal(got[0], big)
            ticking.cancel()


# -- timeouts and close ---------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ALL_KINDS)
async def test_timeouts_return_none(short_tmp: Path, kind: str) -> None:
    async with pair(kind, short_tmp) as (put_side, get_side, edge):
        assert await get_side.get(*edge, "absent", timeout=0.15) is None
        assert await get_side.get(*edge, "absent", timeout=0) is None
        await put_side.put(*edge, "there", {"v": 1})
        got = await get_side.get(*edge, "there", timeout=10)
        assert got is not None and got[0] == {"v": 1}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ALL_KINDS)
async def test_a_get_given_its_puts_metadata_waits_on_the_loop(short_tmp: Path, kind: str) -> None:
    # vllm-omni hands a stage the metadata that the put returned. Given it, a push receiver's blocking
    # get waits up to metadata_get_timeout_s (10 s) for that put: an awaited get must wait on the
    # loop instead (other tasks run), keep its own timeout, and still take the item when it comes.
    async with pair(kind, short_tmp) as (put_side, get_side, edge):
        ok, _, meta = await put_side.put(*edge, "a", {"v": 0})
        assert ok and meta is not None
        assert await get_side.get(*edge, "a", meta, timeout=10) is not None
        announced = {**meta, "key": "b"}  # what a put of "b" returns, before that put is made
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            started = time.monotonic()
            assert await get_side.get(*edge, "b", announced, timeout=0.3) is None
            assert time.monotonic() - started < 5.0, "the get's timeout was not kept"
            assert ticks >= 3, "the event loop was blocked while the get waited"
            waiting = asyncio.create_task(get_side.get(*edge, "b", announced, timeout=30))
            await asyncio.sleep(0.05)
            await put_side.put(*edge, "b", {"v": 1})
            got = await waiting
            assert got is not None and got[0] == {"v": 1}
        finally:
            ticker.cancel()
        drain = getattr(get_side.connector, "drain_failures", None)
        assert drain is None or not drain(), "an awaited get's own timeout is not a connector failure"


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ALL_KINDS)
async def test_aclose_wakes_every_waiter_with_none(short_tmp: Path, kind: str) -> None:
    async with pair(kind, short_tmp) as (_, get_side, edge):
        waiters = [asyncio.create_task(get_side.get(*edge, f"never-{i}")) for i in range(200)]
        while get_side.health()["aio_gets_waiting"] < 200:
            await asyncio.sleep(0.01)
        await get_side.aclose()
        assert await asyncio.wait_for(asyncio.gather(*waiters), 10) == [None] * 200
        assert await get_side.get(*edge, "after", timeout=5) is None


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["zmq", "zmq-loop", "zmq-loop-pull"])
async def test_gets_racing_aclose_return_none(short_tmp: Path, kind: str) -> None:
    for round_no in range(20):
        async with pair(kind, short_tmp) as (_, get_side, edge):
            early = [asyncio.create_task(get_side.get(*edge, f"e{i}", timeout=10)) for i in range(10)]
            await asyncio.sleep(0)
            closing = asyncio.create_task(get_side.aclose())
            late = [asyncio.create_task(get_side.get(*edge, f"l{i}", timeout=10)) for i in range(10)]
            results = await asyncio.wait_for(asyncio.gather(*early, *late), 10)
            await closing
        assert results == [None] * 20, f"round {round_no}"


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["inproc", "zmq", "zmq-loop"])
async def test_closing_the_connector_wakes_waiters(short_tmp: Path, kind: str) -> None:
    async with pair(kind, short_tmp) as (_, get_side, edge):
        waiters = [asyncio.create_task(get_side.get(*edge, f"never-{i}")) for i in range(50)]
        while get_side.health()["aio_gets_waiting"] < 50:
            await asyncio.sleep(0.01)
        get_side.connector.close()  # from outside the wrapper: its close notification wakes them
        assert await asyncio.wait_for(asyncio.gather(*waiters), 10) == [None] * 50


RUNNERS = [pytest.param(asyncio.run, id="asyncio"), pytest.param(uvloop.run, id="uvloop")]


@pytest.mark.parametrize("run", RUNNERS)
def test_loop_shutdown_with_pending_gets_cancels_them_cleanly(short_tmp: Path, run: Any) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    conn = AsyncConnector(ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}))
    seen: list[BaseException] = []
    loop_kinds: list[str] = []

    async def waiter(i: int) -> None:
        try:
            await conn.get("0", "1", f"k{i}")
        except asyncio.CancelledError as exc:
            seen.append(exc)
            raise

    async def main() -> None:
        loop_kinds.append(type(asyncio.get_running_loop()).__module__)
        for i in range(100):
            asyncio.create_task(waiter(i))  # noqa: RUF006 -- left pending on purpose
        while conn.health()["aio_gets_waiting"] < 100:
            await asyncio.sleep(0.01)

    run(main())  # cancels the pending gets as it shuts the loop down
    assert len(seen) == 100
    assert conn.health()["aio_gets_waiting"] == 0
    conn.close()
    assert conn.connector.closed
    assert loop_kinds == ["uvloop" if run is uvloop.run else "asyncio.unix_events"]


@pytest.mark.anyio
async def test_each_backend_runs_on_its_loop(anyio_backend: Any) -> None:
    uses_uvloop = anyio_backend[1].get("use_uvloop", False)
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop) == uses_uvloop


def test_a_connector_without_a_wakeup_hook_is_refused() -> None:
    from zmq_omni.connectors.base import OmniConnectorBase

    class Bare(InProcConnector):
        def watch_arrivals(self) -> None:  # type: ignore[override]
            return OmniConnectorBase.watch_arrivals(self)

    with Bare({"namespace": uuid.uuid4().hex}) as bare, pytest.raises(TypeError, match="wake-up"):
        AsyncConnector(bare)


@pytest.mark.anyio
async def test_shm_waiter_survives_its_mailbox_directory_being_removed(tmp_path: Path, shm_dir: str) -> None:
    from zmq_omni.connectors.shm import SharedMemoryConnector

    config = {"namespace": f"aio-{uuid.uuid4().hex[:8]}", "shm_dir": shm_dir, "spill_dir": str(tmp_path)}
    async with AsyncConnector(SharedMemoryConnector(config)) as conn:
        waiting = asyncio.create_task(conn.get("0", "1", "k", timeout=20))
        await asyncio.sleep(0.05)
        box = Path(conn.connector._box.path)
        SharedMemoryConnector(config).close()  # another connector's close removes the empty directory
        assert not box.exists()
        await asyncio.sleep(0.05)  # the watch hears it and watches the directory anew
        with SharedMemoryConnector(config) as other:
            assert other.put("0", "1", "k", {"v": 1})[0]
            got = await asyncio.wait_for(waiting, 5)  # woken by the new watch, not by its timeout
        assert got is not None and got[0] == {"v": 1}
        conn.connector.close()  # closed under the watch: its removal of the directory must not be undone
        await asyncio.sleep(0.1)
        assert not box.exists(), "the watch made the closed connector's mailbox directory again"


# -- chunk streams ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_three_stage_async_chunk_stream_in_order(short_tmp: Path) -> None:
    requests, chunks = 6, 25
    ep1, ep2 = f"ipc://{short_tmp}/s1.sock", f"ipc://{short_tmp}/s2.sock"
    with peer("chunk_sink", endpoints={"2": ep2}, requests=requests, chunks=chunks) as sink:
        sink.event("ready")
        async with AsyncConnector.create(
            {"name": "ZmqConnector", "extra": {"stage_id": "1", "role": "dual", "endpoints": {"1": ep1, "2": ep2}}}
        ) as middle:
            with peer("chunk_source", endpoints={"1": ep1}, requests=requests, chunks=chunks) as source:
                source.event("ready")
                source.send("go")

                async def forward(r: int) -> list[int]:
                    sender = AsyncChunkSender(middle, "1", "2", f"req{r}")
                    order = []
                    async for chunk in AsyncChunkStream(middle, "0", "1", f"req{r}", stall_timeout_s=60):
                        order.append(chunk.chunk_id)
                        await sender.send({"x": chunk.data["x"] * 2 + 1}, final=chunk.final)
                    return order

                orders = await asyncio.gather(*(forward(r) for r in range(requests)))
                # Waited for in a thread: the loop acknowledges the last chunks meanwhile (it drives the middle).
                assert (await asyncio.to_thread(source.event, "sent"))["failed"] == []
                received = (await asyncio.to_thread(sink.event, "received"))["streams"]
    assert orders == [list(range(chunks))] * requests
    for r, stream in enumerate(received):
        assert [c[0] for c in stream] == list(range(chunks)), f"req{r} out of order"
        assert [c[1] for c in stream] == [(r * 1000 + n) * 2 + 1 for n in range(chunks)]
        assert [c[2] for c in stream] == [False] * (chunks - 1) + [True]


@pytest.mark.anyio
async def test_chunk_stream_raises_the_request_failure() -> None:
    namespace = uuid.uuid4().hex
    async with AsyncConnector(InProcConnector({"namespace": namespace})) as conn:
        with pytest.raises(TransportTimeoutError, match="stalled"):
            async for _ in AsyncChunkStream(conn, "0", "1", "req", stall_timeout_s=0.1):
                pass
        await conn.put("0", "1", "bad_0_0", {"not": "a chunk"})
        with pytest.raises(DecodeError, match="bad chunk"):
            async for _ in AsyncChunkStream(conn, "0", "1", "bad", stall_timeout_s=5):
                pass
        sender = AsyncChunkSender(conn, "0", "1", "cx")
        await sender.send({"x": np.zeros(2)})
        await sender.cancel()
        seen = [(c.chunk_id, c.final, c.cancelled) async for c in AsyncChunkStream(conn, "0", "1", "cx")]
        assert seen == [(0, False, False), (1, True, True)]
        with pytest.raises(ValueError, match="after the final"):
            await sender.send({})


# -- the example -----------------------------------------------------------------------------


def test_async_stage_example_runs(short_tmp: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "async_stage.py")],
        cwd=short_tmp,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stage 2 received 3 requests, every chunk in order" in result.stdout


@pytest.mark.anyio
async def test_a_role_less_connector_binding_at_its_first_get_wakes_its_waiters(short_tmp: Path) -> None:
    # vllm-omni's older model: both ends from one extra, no role; the receiving end binds at its first
    # get, after the AsyncConnector took its watch. The bound receiver must signal that watch.
    extra = {"endpoints": {"1": f"ipc://{short_tmp}/lazy.sock"}}
    async with AsyncConnector(ZmqConnector(dict(extra))) as get_side:
        waiter = asyncio.create_task(get_side.get("0", "1", "late", timeout=30))
        while get_side.health()["aio_gets_waiting"] < 1:
            await asyncio.sleep(0.01)
        with ZmqConnector(dict(extra)) as put_side:
            ok, _, _ = put_side.put("0", "1", "late", {"v": 7})
            assert ok
            got = await asyncio.wait_for(waiter, 20)
        assert got is not None and got[0] == {"v": 7}
