"""The event loop as the reading getter: awaited gets read the push receiver's socket on the loop's thread (issue 15).

While gets wait, ``AsyncConnector`` borrows the receiver's socket from its I/O
thread and reads it on the loop (``zmq_omni.transport._loop_reader``); the I/O
thread takes it back once nobody read it for a few milliseconds. These tests
watch on which thread messages are decoded (a registered type's decode
function runs on the reading thread), and check that nothing is lost or
stuck as the socket goes back and forth, beside threaded getters, with
acknowledgements owed, and at close. Real sockets over ipc, in one process.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import zmq

from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import PushReceiver
from zmq_omni.wire import register_type, unregister_type

from .conftest import wait_until

LOOPS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class Traced:
    """A payload whose decoding notes the thread that read it off the socket."""

    readers: ClassVar[list[str]] = []

    def __init__(self, value: int) -> None:
        self.value = value

    @classmethod
    def decode(cls, value: int) -> Traced:
        cls.readers.append(threading.current_thread().name)
        return cls(value)


@pytest.fixture
def traced() -> Iterator[list[str]]:
    name = register_type(Traced, name="test.Traced", encode=lambda t: t.value, decode=Traced.decode)
    Traced.readers = []
    try:
        yield Traced.readers
    finally:
        unregister_type(name)


@contextmanager
def _edge(short_tmp: Path, **sender: Any) -> Iterator[tuple[ZmqConnector, ZmqConnector]]:
    """A push receiver (stage 1) and a sender (stage 0) over ipc, both closed at the end."""
    common = {"endpoints": {"1": f"ipc://{short_tmp}/edge.sock"}, "shm": "off"}
    with ExitStack() as stack:
        receiver = stack.enter_context(ZmqConnector({"stage_id": "1", "role": "receiver", **common}))
        sender_conn = stack.enter_context(ZmqConnector({"stage_id": "0", "role": "sender", **common, **sender}))
        yield receiver, sender_conn


@asynccontextmanager
async def _async_edge(short_tmp: Path, **sender: Any) -> AsyncIterator[tuple[AsyncConnector, ZmqConnector]]:
    with _edge(short_tmp, **sender) as (receiver, sender_conn):
        async with AsyncConnector(receiver, close_connector=False) as conn:
            yield conn, sender_conn


async def _waiting_get(conn: AsyncConnector, key: str) -> asyncio.Task[Any]:
    """Start a get of ``key`` (30 s timeout) and return its task once a get waits."""
    task = asyncio.create_task(conn.get("0", "1", key, timeout=30))
    while conn.health()["aio_gets_waiting"] < 1:
        await asyncio.sleep(0)
    return task


async def _put_when_waiting(conn: AsyncConnector, sender: ZmqConnector, key: str, value: Any) -> Any:
    """Start a get of ``key``, put it once the get waits, and return what the get returned."""
    task = await _waiting_get(conn, key)
    ok, _, _ = sender.put("0", "1", key, value)
    assert ok, sender.drain_failures()
    got = await task
    assert got is not None, f"{key} never arrived"
    return got[0]


async def _read_on_the_loop(conn: AsyncConnector, sender: ZmqConnector) -> PushReceiver:
    """Serve a first awaited get (the loop reads the socket from then on); the receiver's part."""
    assert await _put_when_waiting(conn, sender, "warm", Traced(0)) is not None
    part = conn.connector._receiver
    assert part is not None
    return part


@pytest.mark.anyio
async def test_a_waiting_get_is_fed_by_the_loop_reading_the_socket(short_tmp: Path, traced: list[str]) -> None:
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        for i in range(50):
            got = await _put_when_waiting(conn, sender, f"k{i}", Traced(i))
            assert isinstance(got, Traced) and got.value == i
    # The first get's item may still reach the I/O thread (the socket is lent a moment later); then the loop reads.
    assert traced.count(loop_thread) >= 45, traced


@pytest.mark.anyio
async def test_the_socket_goes_back_to_the_io_thread_when_no_get_waits_and_returns(
    short_tmp: Path, traced: list[str]
) -> None:
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        for cycle in range(3):
            for i in range(10):  # gets waiting: the loop reads
                got = await _put_when_waiting(conn, sender, f"c{cycle}-{i}", Traced(i))
                assert got.value == i
            # No get waits: after a few idle milliseconds the I/O thread reads again. Puts keep coming
            # until one is read there (the machine may be slow to run the I/O thread's timer).
            before = len(traced)
            deadline = time.monotonic() + 20
            n = 0
            while all(t == loop_thread for t in traced[before:]):
                assert time.monotonic() < deadline, f"the I/O thread never read again: {traced[before:]}"
                await asyncio.sleep(0.02)
                ok, _, _ = sender.put("0", "1", f"idle{cycle}-{n}", Traced(-n))
                assert ok, sender.drain_failures()
                n += 1
                await asyncio.sleep(0.02)
            # Everything put meanwhile is in the mailbox, whoever read it.
            for j in range(n):
                got = await conn.get("0", "1", f"idle{cycle}-{j}", timeout=10)
                assert got is not None and got[0].value == -j
    assert loop_thread in traced and any(t != loop_thread for t in traced)


@pytest.mark.anyio
async def test_consumptions_are_acknowledged_while_the_loop_reads(short_tmp: Path) -> None:
    # A window of 4 puts and heartbeats an hour apart: 40 puts go through only if the I/O thread
    # acknowledges the consumptions while the loop holds the socket (a get waits all along).
    async with _async_edge(short_tmp, max_unacked=4, put_timeout_s=10.0, heartbeat_s=3600.0, peer_timeout_s=7200.0) as (
        conn,
        sender,
    ):
        never = asyncio.create_task(conn.get("0", "1", "never", timeout=60))
        for i in range(40):
            got = await _put_when_waiting(conn, sender, f"k{i}", {"i": i})
            assert got == {"i": i}
        assert not never.done()
        assert sender.flush(10.0)
        never.cancel()


@pytest.mark.anyio
async def test_threaded_getters_and_awaited_gets_share_one_receiver(short_tmp: Path) -> None:
    n = 200
    async with _async_edge(short_tmp) as (conn, sender):
        receiver = conn.connector
        threaded: dict[str, Any] = {}

        def take_in_a_thread() -> None:
            for i in range(n):
                got = receiver.get_with_deadline("0", "1", f"t{i}", deadline=time.monotonic() + 60)
                threaded[f"t{i}"] = None if got is None else got[0]

        worker = threading.Thread(target=take_in_a_thread, daemon=True)
        worker.start()
        awaited = [asyncio.create_task(conn.get("0", "1", f"a{i}", timeout=60)) for i in range(n)]

        def put_both() -> None:
            for i in range(n):
                for key in (f"a{i}", f"t{i}"):
                    ok, _, _ = sender.put("0", "1", key, {"k": key})
                    assert ok, sender.drain_failures()
                if i % 16 == 0:
                    time.sleep(0.002)  # now and then idle: the socket changes hands

        await asyncio.to_thread(put_both)
        results = await asyncio.gather(*awaited)
        await asyncio.to_thread(worker.join, 60)
        assert not worker.is_alive()
    assert [r and r[0] for r in results] == [{"k": f"a{i}"} for i in range(n)]
    assert threaded == {f"t{i}": {"k": f"t{i}"} for i in range(n)}


@pytest.mark.anyio
async def test_a_flood_is_read_in_turns_without_starving_the_loop(short_tmp: Path) -> None:
    # More than one drain's worth (512) arrives while gets wait: the loop reads it in turns,
    # and a ticker task runs between them.
    n = 3000
    async with _async_edge(short_tmp, max_unacked=n) as (conn, sender):
        tasks = [asyncio.create_task(conn.get("0", "1", f"f{i}", timeout=60)) for i in range(n)]
        while conn.health()["aio_gets_waiting"] < n:
            await asyncio.sleep(0.001)
        ticks = 0
        stop = asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())

        def put_all() -> None:
            for i in range(n):
                ok, _, _ = sender.put("0", "1", f"f{i}", i)
                assert ok, sender.drain_failures()

        await asyncio.to_thread(put_all)
        results = await asyncio.gather(*tasks)
        stop.set()
        await ticker
    assert [r and r[0] for r in results] == list(range(n))
    assert ticks > 0


@pytest.mark.anyio
async def test_what_queued_behind_a_woken_pumps_first_item_is_read_on_the_loop(
    short_tmp: Path, traced: list[str]
) -> None:
    # A pump woken by the descriptor stops after the first message that brought items (their waiter
    # resumes first); the loop then reads on. Three puts queue in ZeroMQ while the loop is held up:
    # all three must be read on the loop thread, none left for the I/O thread (kept from taking the
    # socket back here), and every get served.
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        part = await _read_on_the_loop(conn, sender)
        gets = {key: asyncio.create_task(conn.get("0", "1", key, timeout=10)) for key in ("a", "b", "c")}
        while conn.health()["aio_gets_waiting"] < 3:
            await asyncio.sleep(0)
        assert not part._io_watching
        assert part._owner.acquire(timeout=10)  # nobody reads meanwhile, the I/O thread's reclaim included
        try:
            del traced[:]
            for i, key in enumerate(gets):
                assert sender.put("0", "1", key, Traced(i + 1))[0]
            assert wait_until(lambda: part._sock.get(zmq.EVENTS) & zmq.POLLIN, 10)
            time.sleep(0.3)  # the loop is held up: the other puts reach ZeroMQ's queue too
            part._last_read = time.monotonic() + 60  # the I/O thread leaves the socket to the loop
        finally:
            part._release_owner()
        got = {key: await task for key, task in gets.items()}
    assert {key: value and value[0].value for key, value in got.items()} == {"a": 1, "b": 2, "c": 3}
    assert traced == [loop_thread] * 3


@pytest.mark.anyio
async def test_aclose_releases_the_loop_readers_descriptor(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, sender):
        sender.put("0", "1", "warm", 0)  # the sender's sockets open at its first put
        assert receiver.get_with_deadline("0", "1", "warm", deadline=time.monotonic() + 10) is not None
        # ...and connect a moment later: once a REPLY confirmed the put, its control socket's connection
        # (a descriptor at each end) exists too (under load it could come after the count below).
        assert sender.flush(10.0)
        fds_before = set(os.listdir("/proc/self/fd"))
        conn = AsyncConnector(receiver, close_connector=False)
        assert await _put_when_waiting(conn, sender, "k", {"v": 1}) == {"v": 1}
        part = receiver._receiver
        assert part is not None and len(part._loop_readers) == 1  # this loop polled the socket
        waiting = asyncio.create_task(conn.get("0", "1", "never"))
        while conn.health()["aio_gets_waiting"] < 1:
            await asyncio.sleep(0)
        await conn.aclose()
        assert await waiting is None
        assert part._loop_readers == ()
        assert set(os.listdir("/proc/self/fd")) <= fds_before
        # The receiver goes on without the loop: a threaded get is served.
        sender.put("0", "1", "after", {"v": 2})
        got = receiver.get_with_deadline("0", "1", "after", deadline=time.monotonic() + 10)
        assert got is not None and got[0] == {"v": 2}


@pytest.mark.anyio
async def test_a_failing_pump_leaves_the_socket_to_the_io_thread(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A bug in the loop's read must not cost deliveries nor spin the loop: it is logged once and
    # the I/O thread reads the socket again, feeding the waiters through the watch.
    from zmq_omni.transport import LoopReader

    def broken(self: LoopReader, rounds: int = 1, *, woken: bool = True, hand: Any = None) -> bool | None:
        raise RuntimeError("a bug in the pump")

    monkeypatch.setattr(LoopReader, "pump", broken)
    async with _async_edge(short_tmp) as (conn, sender):
        for i in range(20):
            assert await _put_when_waiting(conn, sender, f"k{i}", {"i": i}) == {"i": i}
    assert sum("reading the connector's socket on the event loop failed" in r.message for r in caplog.records) == 1


class _RecordingBox(dict):  # type: ignore[type-arg]
    """A mailbox that notes every address stored in it."""

    stored: list[str]

    def __setitem__(self, slot: Any, item: Any) -> None:
        self.stored.append(slot[2])
        super().__setitem__(slot, item)


@pytest.mark.anyio
async def test_an_arrival_read_on_the_loop_goes_straight_to_its_waiting_get(short_tmp: Path, traced: list[str]) -> None:
    # A message the loop reads for a get that waits is handed to that get: never stored in the
    # mailbox, never notified to the watches; it counts as a get, and its consumption is acknowledged.
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        part = await _read_on_the_loop(conn, sender)
        box = _RecordingBox(part._box)
        box.stored = []
        part._box = box
        notified: list[str] = []
        hook = part.on_arrivals
        assert hook is not None

        def noting(slots: list[tuple[str, str, str]]) -> None:
            notified.extend(slot[2] for slot in slots)
            hook(slots)

        part.on_arrivals = noting
        gets_before = conn.connector.health()["gets"]
        del traced[:]
        for i in range(50):
            got = await _put_when_waiting(conn, sender, f"k{i}", Traced(i))
            assert got.value == i
        on_loop = {f"k{i}" for i, thread in enumerate(traced) if thread == loop_thread}
        assert len(traced) == 50 and len(on_loop) >= 45, traced
        assert not on_loop & set(box.stored), box.stored
        assert not on_loop & set(notified), notified
        assert conn.connector.health()["gets"] == gets_before + 50
        assert conn.connector.health()["mailbox"] == 0
        assert sender.flush(10.0)  # every consumption reached the sender


@pytest.mark.anyio
async def test_a_waiting_loop_keeps_the_socket_through_an_idle_spell(short_tmp: Path, traced: list[str]) -> None:
    # A loop with a get waiting polls the socket and reads what comes: an idle spell (15 times the
    # 20 ms after which a socket nobody reads goes back to the I/O thread) leaves it lent, and the
    # item that ends the spell is read on the loop. Also after a long spell without any waiting get,
    # which the socket spent with the I/O thread: the lend's clock starts at the hand-over.
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        part = await _read_on_the_loop(conn, sender)
        for spell, before in enumerate((0.0, 1.5)):
            await asyncio.sleep(before)  # no get waits: the socket goes back to the I/O thread
            task = await _waiting_get(conn, f"k{spell}")
            assert wait_until(lambda: not part._io_watching, 10)  # (the loop asked for it: the I/O thread's turn)
            time.sleep(0.3)  # the loop is held up: it has not read the socket since the hand-over
            assert not part._io_watching, f"spell {spell}: taken back before the loop could read"
            await asyncio.sleep(0.3)  # the loop runs, nothing comes
            assert not part._io_watching, f"spell {spell}: the I/O thread took the socket back from a waiting loop"
            del traced[:]
            assert sender.put("0", "1", f"k{spell}", Traced(spell + 1))[0]
            got = await task
            assert got is not None and got[0].value == spell + 1
            assert traced == [loop_thread], f"spell {spell}: read on {traced}"


@pytest.mark.anyio
async def test_a_blocked_loop_loses_the_socket_to_the_io_thread(short_tmp: Path, traced: list[str]) -> None:
    # A loop with a get waiting that stops running (a long synchronous call) cannot read: after about
    # a second without a read the I/O thread takes the socket back and reads what came meanwhile.
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        await _read_on_the_loop(conn, sender)
        task = await _waiting_get(conn, "k")
        del traced[:]
        assert sender.put("0", "1", "k", Traced(1))[0]
        # The loop is blocked here (this coroutine does not yield): only the I/O thread can read it.
        assert wait_until(lambda: bool(traced), 20), "nobody read the item while the loop was blocked"
        assert traced[0] != loop_thread
        got = await task
        assert got is not None and got[0].value == 1


@pytest.mark.anyio
async def test_a_pump_that_finds_the_socket_busy_keeps_it_and_is_woken_by_the_holder(
    short_tmp: Path, traced: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The I/O thread's owed work (an ack flush, the reclaim tick) holds the socket a moment now and
    # then. A pump that finds it held keeps polling (the socket is still the loop's), and the
    # holder's release wakes the loop to read what it may have missed: no second lend, no read
    # left to the I/O thread.
    loop_thread = threading.current_thread().name
    async with _async_edge(short_tmp) as (conn, sender):
        part = await _read_on_the_loop(conn, sender)
        task = await _waiting_get(conn, "k")
        stops: list[bool] = []
        monkeypatch.setattr(conn, "_stop_reading", lambda: stops.append(True))
        woken_by: list[str] = []
        wake = part._wake_loops

        def noting_wake() -> None:
            woken_by.append(threading.current_thread().name)
            wake()

        monkeypatch.setattr(part, "_wake_loops", noting_wake)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            assert part._owner.acquire(timeout=10)
            held.set()
            try:
                release.wait(20)
            finally:
                part._release_owner()

        holder = threading.Thread(target=hold, name="holder", daemon=True)
        holder.start()
        assert await asyncio.to_thread(held.wait, 10)
        del traced[:]
        assert sender.put("0", "1", "k", Traced(1))[0]
        deadline = time.monotonic() + 10
        while not part._loop_missed:  # the loop's pump came for the item and found the socket held
            assert time.monotonic() < deadline, "the loop never pumped while the socket was held"
            await asyncio.sleep(0.001)
        release.set()
        got = await task
        await asyncio.to_thread(holder.join, 10)
        assert stops == []  # (before the close, which stops the polling)
    assert got is not None and got[0].value == 1
    assert traced == [loop_thread]
    assert "holder" in woken_by
