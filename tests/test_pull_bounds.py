"""A pull server under a hostile local peer: every cost bounded per peer, real put->get going on beside it.

Live sockets over ipc, plaintext, as a peer on the same host would attack: raw
pyzmq DEALERs sending FETCHes, and a raw ZMTP writer (no ZeroMQ) sending one
message of millions of frames. Beside each attack a real sender (the pull
server) and a real receiver do put->get; each test prints their p50/p99 before
and during the attack (``pytest -s`` shows them), checks that every get found
its item and that the rejection was counted.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.test_hostile_input import Ticker
from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import _pull_server
from zmq_omni.transport._envelope import Kind, pack, unpack
from zmq_omni.transport._pull_client import ASK_PARK_S, SILENT_S
from zmq_omni.transport._router import trim_malloc
from zmq_omni.wire import encode

from .conftest import wait_until

ROOT = str(Path(__file__).resolve().parent.parent)
_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"


def zmtp_flood(path: str, frames: int, hold_s: float = 5.0) -> None:
    """Send one message of ``frames`` empty frames to the ipc socket ``path``, as a ZMTP 3.0 DEALER (no ZeroMQ)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.sendall(_GREETING + b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY)
        conn.recv(64)
        conn.sendall(b"\x01\x00" * (frames - 1) + b"\x00\x00")
        _hold(conn, hold_s)


def _hold(conn: socket.socket, hold_s: float) -> None:
    """Keep the connection until the server closes it or ``hold_s`` passed (closed earlier, libzmq drops a
    message it has not finished taking in)."""
    conn.settimeout(hold_s)
    end = time.monotonic() + hold_s
    try:
        while time.monotonic() < end and conn.recv(65536):
            pass
    except OSError:  # timed out, or reset by the server
        pass


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def fetch(i: int, key: str, wait_ms: int = 3_600_000) -> bytes:
    return pack(Kind.FETCH, (i, "0", "1", key, wait_ms))


def p50_p99(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return f"p50 {statistics.median(ordered) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"


@contextmanager
def pull_edge(short_tmp: Path) -> Iterator[tuple[ZmqConnector, ZmqConnector, str]]:
    """A pull server (stage 0) and a threaded pull receiver (stage 1) over ipc, closed at the end."""
    endpoint = f"ipc://{short_tmp}/pull.sock"
    common = {"mode": "pull", "endpoints": {"0": endpoint}, "shm": "off"}
    with ExitStack() as stack:
        server = stack.enter_context(ZmqConnector({"stage_id": "0", "role": "sender", **common}))
        client = stack.enter_context(ZmqConnector({"stage_id": "1", "role": "receiver", **common}))
        assert server.put("0", "1", "warm", 0)[0]  # binds
        assert client.get_with_deadline("0", "1", "warm", deadline=time.monotonic() + 10) is not None
        yield server, client, endpoint


def put_get_rounds(put: Callable[[str, Any], bool], get: Callable[[str], Any], tag: str, n: int) -> list[float]:
    """``n`` rounds of put then get of a fresh key; each round's seconds. Every get must find its item."""
    took = []
    for i in range(n):
        key = f"{tag}-{i}"
        start = time.perf_counter()
        assert put(key, {"i": i})
        got = get(key)
        took.append(time.perf_counter() - start)
        assert got is not None and got[0] == {"i": i}, (key, got)
    return took


def threaded_rounds(server: ZmqConnector, client: ZmqConnector, tag: str, n: int) -> list[float]:
    return put_get_rounds(
        lambda key, obj: server.put("0", "1", key, obj)[0],
        lambda key: client.get_with_deadline("0", "1", key, deadline=time.monotonic() + 10),
        tag,
        n,
    )


# -- the long-poll lot ----------------------------------------------------------------------------------------------
def test_one_peer_cannot_take_the_long_poll_lot(short_tmp: Path, zmq_ctx: zmq.Context[Any]) -> None:
    with pull_edge(short_tmp) as (server, client, endpoint):
        before = threaded_rounds(server, client, "before", 50)
        hog = zmq_ctx.socket(zmq.DEALER)
        hog.setsockopt(zmq.RCVHWM, 0)
        hog.connect(endpoint)
        for i in range(65_536):  # the whole lot, for keys nobody puts
            hog.send(fetch(i + 1, f"absent-{i}"))
        stop = threading.Event()

        def top_up() -> None:  # 2,000 more FETCHes a second, each evicted one answered and asked again
            i = 1 << 20
            while not stop.is_set():
                for _ in range(20):
                    i += 1
                    hog.send(fetch(i, f"absent-{i}"))
                while hog.poll(0):
                    hog.recv()
                time.sleep(0.01)

        assert wait_until(lambda: server.health()["parked"] == 65_536, timeout=30)
        topper = threading.Thread(target=top_up)
        topper.start()
        try:
            during = threaded_rounds(server, client, "during", 50)
            # A get of a key not put keeps asking until its deadline (its FETCH is parked, not refused).
            start = time.monotonic()
            assert client.get_with_deadline("0", "1", "not-yet", deadline=start + 1.5) is None
            waited = time.monotonic() - start
        finally:
            stop.set()
            topper.join(10)
            hog.close(linger=0)
        health = server.health()
        print(f"\nput->get before: {p50_p99(before)}; beside a peer holding the lot: {p50_p99(during)}")
        print(f"absent get waited {waited:.2f} s of 1.5; {health['fetches_evicted']} of the peer's FETCHes evicted")
        assert waited > 1.3
        assert health["fetches_evicted"] >= 1  # the real receiver's parked FETCH made room
        assert health["fetches_not_parked"] > 0  # the peer holding the most was refused more
        assert client.health()["errors"] == 0


def test_parked_fetches_of_a_gone_peer_are_dropped(
    short_tmp: Path, zmq_ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pull_server, "_PROBE_S", 0.1)
    with pull_edge(short_tmp) as (server, client, endpoint):
        gone = zmq_ctx.socket(zmq.DEALER)
        gone.connect(endpoint)
        for i in range(100):
            gone.send(fetch(i + 1, f"absent-{i}"))
        assert wait_until(lambda: server.health()["parked"] == 100, timeout=10)
        gone.close(linger=0)
        assert wait_until(lambda: server.health()["fetches_of_gone_peers"] == 100, timeout=10)
        assert wait_until(lambda: server.health()["parked"] == 0, timeout=5)
        threaded_rounds(server, client, "after", 5)


def test_parked_fetches_are_bounded_in_bytes_and_long_keys_refused(
    short_tmp: Path, zmq_ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pull_server, "_MAX_PARKED_BYTES", 1 << 20)
    with pull_edge(short_tmp) as (server, client, endpoint):
        start_rss = rss_mb()
        before = threaded_rounds(server, client, "before", 30)
        hog = zmq_ctx.socket(zmq.DEALER)
        hog.setsockopt(zmq.RCVHWM, 0)
        hog.connect(endpoint)
        for i in range(2000):  # 4 KB keys: about 230 fit in 1 MiB
            hog.send(fetch(i + 1, f"{i:04}" + "k" * 4000))
        rejected, rejected_keys = server.health()["rejected_frames"], server.health()["rejected_keys"]
        huge = "k" * 1_000_000  # under the socket's message limit, far over max_key_bytes
        for i in range(1000):
            hog.send(fetch(10_000 + i, huge + str(i)))
        try:
            during = threaded_rounds(server, client, "during", 30)
            assert wait_until(lambda: server.health()["rejected_frames"] - rejected == 1000, timeout=60)
            assert server.health()["rejected_keys"] - rejected_keys == 1000
            assert wait_until(lambda: server.health()["fetches_not_parked"] >= 2000 - 256, timeout=10)
        finally:
            hog.close(linger=0)
        health = server.health()
        trim_malloc()  # what is held, not what the C heap keeps for reuse (the attacker is in this process too)
        print(f"\nput->get before: {p50_p99(before)}; beside 3,000 large FETCHes: {p50_p99(during)}")
        print(f"parked {health['parked']} ({health['parked_bytes']} bytes); RSS {start_rss:.0f} -> {rss_mb():.0f} MB")
        assert health["parked_bytes"] <= 1 << 20
        assert rss_mb() - start_rss < 100


def test_a_fetch_of_a_too_long_key_is_counted_as_a_rejected_key(short_tmp: Path, zmq_ctx: zmq.Context[Any]) -> None:
    with pull_edge(short_tmp) as (server, client, endpoint):
        health = server.health()
        peer = zmq_ctx.socket(zmq.DEALER)
        peer.connect(endpoint)
        for i in range(3):  # one byte over max_key_bytes (4096), in characters of 1 and of 2 UTF-8 bytes
            peer.send(fetch(i + 1, "k" * 4097 if i < 2 else "\u00e9" * 2049))
        peer.send(b"not a request")
        peer.send(fetch(9, "k" * 4096))  # at the limit: parked, not refused
        assert wait_until(lambda: server.health()["rejected_frames"] - health["rejected_frames"] == 4)
        assert wait_until(lambda: server.health()["parked"] == 1)
        assert server.health()["rejected_keys"] - health["rejected_keys"] == 3
        peer.close(linger=0)
        threaded_rounds(server, client, "after", 5)


# -- many frames and the read budget -------------------------------------------------------------------------------
def test_a_message_of_millions_of_frames_rebinds_and_put_get_goes_on(short_tmp: Path) -> None:
    with pull_edge(short_tmp) as (server, client, endpoint):
        start_rss = rss_mb()
        before = threaded_rounds(server, client, "before", 30)
        zmtp_flood(endpoint[len("ipc://") :], 2_000_000)
        assert wait_until(lambda: server.health()["rebinds"] == 1, timeout=30)
        during = threaded_rounds(server, client, "after", 30)
        print(f"\nput->get before: {p50_p99(before)}; after a 2M-frame message: {p50_p99(during)}")
        assert wait_until(lambda: rss_mb() - start_rss < 100, timeout=5), (start_rss, rss_mb())
        assert server.health()["delivery_failures"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_event_loop_pull_server_never_stalls_whatever_a_peer_sends(
    short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    endpoint = f"ipc://{short_tmp}/loop.sock"
    common = {"mode": "pull", "endpoints": {"0": endpoint}, "shm": "off"}
    spec = {"name": "ZmqConnector", "extra": {"stage_id": "0", "role": "sender", **common}}
    async with AsyncConnector.create(spec) as conn:
        with ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as client:
            assert await conn.put("0", "1", "warm", 0)
            start_rss = rss_mb()

            def get(key: str) -> Any:
                return client.get_with_deadline("0", "1", key, deadline=time.monotonic() + 10)

            async def rounds(tag: str, n: int) -> list[float]:
                took = []
                for i in range(n):
                    start = time.perf_counter()
                    assert (await conn.put("0", "1", f"{tag}-{i}", {"i": i}))[0]
                    got = await asyncio.to_thread(get, f"{tag}-{i}")
                    took.append(time.perf_counter() - start)
                    assert got is not None and got[0] == {"i": i}
                return took

            # In a process of its own, as an attacker is (its sends take no turn of this loop), started before the
            # ticker: a spawn waits for the child's exec (under load, 100 ms and more), a wait of the test's.
            attack = (
                "import sys, zmq\n"
                "from tests.test_pull_bounds import fetch, zmtp_flood\n"
                "sys.stdin.readline()\n"  # the test's word to begin
                "sock = zmq.Context().socket(zmq.DEALER)\n"
                "sock.connect(sys.argv[1])\n"
                "for i in range(300):\n"  # FETCHes of 10k frames each (6 MB)
                "    sock.send_multipart([fetch(i + 1, 'x')] + [b''] * 10_000)\n"
                "sock.close(linger=5000)\n"
                "zmtp_flood(sys.argv[1][len('ipc://'):], 10_000_000)\n"
            )

            before = await rounds("before", 30)
            rejected = conn.health()["rejected_frames"]
            attacker = await asyncio.create_subprocess_exec(
                sys.executable, "-c", attack, endpoint, cwd=ROOT, stdin=asyncio.subprocess.PIPE
            )
            assert attacker.stdin is not None
            with Ticker() as ticker:
                attacker.stdin.write(b"go\n")
                await attacker.stdin.drain()
                during = await rounds("during", 60)
                assert await asyncio.wait_for(attacker.wait(), 120) == 0
                for _ in range(3000):
                    if conn.health()["rebinds"] == 1:
                        break
                    await asyncio.sleep(0.01)
                after = await rounds("after", 30)
            health = conn.health()
            await asyncio.sleep(2.0)  # the dropped message's pages go back to the OS
            print(
                f"\nput->get before: {p50_p99(before)}; during: {p50_p99(during)}; after: {p50_p99(after)}; "
                f"loop's worst stall {ticker.worst * 1000:.0f} ms; RSS {start_rss:.0f} -> {rss_mb():.0f} MB"
            )
            assert health["rebinds"] == 1
            assert health["rejected_frames"] - rejected == 300
            assert health["delivery_failures"] == 0
            assert ticker.worst < 0.1, f"the loop stalled {ticker.worst * 1000:.0f} ms"
            assert rss_mb() - start_rss < 150


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_event_loop_pull_server_shares_its_lot_and_keeps_its_turns_short(
    short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    endpoint = f"ipc://{short_tmp}/lot.sock"
    common = {"mode": "pull", "endpoints": {"0": endpoint}, "shm": "off"}
    spec = {"name": "ZmqConnector", "extra": {"stage_id": "0", "role": "sender", **common}}
    async with AsyncConnector.create(spec) as conn:
        with ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as client:
            assert (await conn.put("0", "1", "warm", 0))[0]

            def get(key: str, within: float = 10.0) -> Any:
                return client.get_with_deadline("0", "1", key, deadline=time.monotonic() + within)

            assert await asyncio.to_thread(get, "warm") is not None
            hog = zmq_ctx.socket(zmq.DEALER)
            hog.setsockopt(zmq.RCVHWM, 0)
            hog.connect(endpoint)
            try:
                with Ticker() as ticker:

                    def flood() -> None:
                        for i in range(65_536):
                            hog.send(fetch(i + 1, f"absent-{i}"))

                    await asyncio.to_thread(flood)
                    for _ in range(3000):
                        if conn.health()["parked"] == 65_536:
                            break
                        await asyncio.sleep(0.01)
                    start = time.monotonic()
                    assert await asyncio.to_thread(get, "not-yet", 1.5) is None
                    waited = time.monotonic() - start
                    took = []
                    for i in range(30):
                        begin = time.perf_counter()
                        assert (await conn.put("0", "1", f"k{i}", {"i": i}))[0]
                        got = await asyncio.to_thread(get, f"k{i}")
                        took.append(time.perf_counter() - begin)
                        assert got is not None and got[0] == {"i": i}
            finally:
                hog.close(linger=0)
            health = conn.health()
            print(
                f"\nbeside a peer holding the lot: {p50_p99(took)}; absent get waited {waited:.2f} s of 1.5; "
                f"loop's worst stall {ticker.worst * 1000:.0f} ms"
            )
            assert waited > 1.3 and health["fetches_evicted"] >= 1
            assert ticker.worst < 0.1, f"the loop stalled {ticker.worst * 1000:.0f} ms"


def test_a_threaded_get_asks_again_when_its_fetch_was_lost(zmq_ctx: zmq.Context[Any]) -> None:
    """A server that loses the first FETCH (as one bound anew does) and answers the next: the get gets the payload."""
    fake = zmq_ctx.socket(zmq.ROUTER)
    fake.bind("tcp://127.0.0.1:*")
    endpoint = fake.getsockopt(zmq.LAST_ENDPOINT).decode()
    asked: list[tuple[float, int]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not fake.poll(20):
                continue
            identity, request_frame = fake.recv_multipart()
            _, request, _ = unpack(request_frame)
            asked.append((time.monotonic(), request[4]))
            if len(asked) > 1:
                fake.send_multipart([identity, pack(Kind.FETCH_REPLY, (request[0], True), encode({"ok": 1})[0])])

    server = threading.Thread(target=serve)
    server.start()
    try:
        with ZmqConnector(
            {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": {"0": endpoint}}
        ) as client:
            start = time.monotonic()
            got = client.get_with_deadline("0", "1", "k", deadline=start + 10)
            took = time.monotonic() - start
            assert got is not None and got[0] == {"ok": 1}
            assert client.health()["errors"] == 0
    finally:
        stop.set()
        server.join(5)
        fake.close(linger=0)
    # The first ask was parked at most ASK_PARK_S; the second went SILENT_S after that park ended.
    assert asked[0][1] == int(ASK_PARK_S * 1000)
    assert ASK_PARK_S + SILENT_S - 0.1 < asked[1][0] - asked[0][0] < ASK_PARK_S + SILENT_S + 1.0
    assert took < ASK_PARK_S + SILENT_S + 1.0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_event_loop_get_asks_again_when_its_fetch_was_lost(zmq_ctx: zmq.Context[Any]) -> None:
    """As the threaded get: the first FETCH lost (as to a server bound anew), the next is asked past its park."""
    fake = zmq_ctx.socket(zmq.ROUTER)
    fake.bind("tcp://127.0.0.1:*")
    endpoint = fake.getsockopt(zmq.LAST_ENDPOINT).decode()
    asked: list[tuple[float, int]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not fake.poll(20):
                continue
            identity, request_frame = fake.recv_multipart()
            _, request, _ = unpack(request_frame)
            asked.append((time.monotonic(), request[4]))
            if len(asked) > 1:
                fake.send_multipart([identity, pack(Kind.FETCH_REPLY, (request[0], True), encode({"ok": 1})[0])])

    server = threading.Thread(target=serve)
    server.start()
    within = 6.0
    try:
        spec = {"name": "ZmqConnector", "extra": {"stage_id": "1", "role": "receiver", "mode": "pull"}}
        async with AsyncConnector.create({**spec, "extra": {**spec["extra"], "endpoints": {"0": endpoint}}}) as conn:
            got = await conn.get("0", "1", "k", timeout=within)
            assert got is not None and got[0] == {"ok": 1}
    finally:
        stop.set()
        server.join(5)
        fake.close(linger=0)
    # The first ask was parked 80 % of the get's timeout; the second went SILENT_S after that park ended.
    park = asked[0][1] / 1000
    assert park == pytest.approx(0.8 * within, abs=0.1)
    assert park + SILENT_S - 0.1 < asked[1][0] - asked[0][0] < park + SILENT_S + 1.0
