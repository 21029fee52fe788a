"""A ``ZmqConnector`` driven by its event loop (``AsyncConnector.create``): real sockets, real processes.

Its sockets belong to the loop: no I/O thread, arrivals read and handed to the
waiting gets on the loop's thread, and nothing blocks the loop on I/O the loop
must do. Behaviour only: what the public API returns, raises, logs and counts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from tests.test_aio import peer
from tests.test_hostile_input import LIMIT, Ticker, _attack, hostile
from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError, DeliveryError, TransportTimeoutError
from zmq_omni.transport._envelope import Kind, pack

LOOPS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def spec(**extra: Any) -> dict[str, Any]:
    return {"name": "ZmqConnector", "extra": extra}


def payload(i: int) -> dict[str, Any]:
    """Mostly small; every 20th large enough for the same-host fast path (shared memory)."""
    return {"i": i, "x": np.arange(50_000 if i % 20 == 0 else i % 40, dtype=np.int32)}


# -- round trips across two processes ----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("face", ["loop", "threaded"])
async def test_awaited_round_trips_with_a_peer_process(short_tmp: Path, mode: str, face: str) -> None:
    n = 120
    endpoints = {"a": f"ipc://{short_tmp}/a.sock", "b": f"ipc://{short_tmp}/b.sock"}

    def extra(stage: str) -> dict[str, Any]:
        return {"stage_id": stage, "role": "dual", "mode": mode, "endpoints": endpoints}

    with peer("echo", config=extra("b"), n=n, face=face) as echo:
        echo.event("ready")
        async with AsyncConnector.create(spec(**extra("a"))) as conn:
            for i in range(n):
                ok, _, _ = await conn.put("a", "b", f"p{i}", payload(i))
                assert ok, conn.connector.drain_failures()
                got = await conn.get("b", "a", f"q{i}", timeout=60)
                assert got is not None, f"q{i} never came back"
                assert got[0]["i"] == i and np.array_equal(got[0]["x"], payload(i)["x"])
            # The peer's last puts wait for our acknowledgements: the loop runs while we wait for it.
            echoed = await asyncio.to_thread(echo.event, "echoed")
            assert echoed == {"event": "echoed", "delivered": True}, echoed
            assert conn.connector.drain_failures() == []


@pytest.mark.anyio
async def test_a_message_read_on_the_loop_hands_the_driver_no_call(short_tmp: Path) -> None:
    # The read budget of a driver turn ends with the turn (the driver counts its callbacks), not with a call
    # queued per message read: a lone round trip costs the loop no callback beyond the read and the get's task.
    n = 40
    endpoints = {"a": f"ipc://{short_tmp}/a.sock", "b": f"ipc://{short_tmp}/b.sock"}
    with peer("echo", config={"stage_id": "b", "role": "dual", "endpoints": endpoints}, n=n, face="threaded") as echo:
        echo.event("ready")
        async with AsyncConnector.create(spec(stage_id="a", role="dual", endpoints=endpoints)) as conn:
            driver = conn.connector.driver
            assert (await conn.put("a", "b", "p0", {"i": 0}))[0]  # connections made, first calls run
            assert await conn.get("b", "a", "q0", timeout=60) is not None
            runs = 0
            run_calls = driver._run_calls

            def counted() -> None:
                nonlocal runs
                runs += 1
                run_calls()

            driver._run_calls = counted
            turn = driver.turn
            for i in range(1, n):
                assert (await conn.put("a", "b", f"p{i}", {"i": i}))[0]
                assert await conn.get("b", "a", f"q{i}", timeout=60) is not None
            assert driver.turn - turn >= n - 1  # each message read in a turn of the driver's
            assert runs < n // 4, f"{runs} calls run for {n - 1} messages read"
            await asyncio.to_thread(echo.event, "echoed")


@pytest.mark.anyio
async def test_create_starts_no_thread(short_tmp: Path) -> None:
    # The ZeroMQ context's own I/O threads are C threads: threading does not list them.
    endpoints = {"a": f"ipc://{short_tmp}/a.sock", "b": f"ipc://{short_tmp}/b.sock"}
    with peer("echo", config={"stage_id": "b", "role": "dual", "endpoints": endpoints}, n=3, face="threaded") as echo:
        echo.event("ready")
        before = set(threading.enumerate())
        conn = AsyncConnector.create(spec(stage_id="a", role="dual", endpoints=endpoints))
        try:
            for i in range(3):
                assert (await conn.put("a", "b", f"p{i}", {"i": i}))[0]
                got = await conn.get("b", "a", f"q{i}", timeout=60)
                assert got is not None and got[0] == {"i": i}
            started = set(threading.enumerate()) - before
            assert started == set(), f"threads started: {started}"
            await asyncio.to_thread(echo.event, "echoed")
        finally:
            await conn.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_5000_concurrent_awaited_gets_each_resolved(short_tmp: Path, mode: str) -> None:
    n = 5000
    if mode == "push":
        endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
        receiver = {"stage_id": "1", "role": "receiver", "endpoints": endpoints}
        sender = {"stage_id": "0", "role": "sender", "endpoints": endpoints}
    else:
        endpoints = {"0": f"ipc://{short_tmp}/s.sock"}
        receiver = {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": endpoints}
        sender = {"stage_id": "0", "role": "sender", "mode": "pull", "endpoints": endpoints, "max_unacked": n}
    async with AsyncConnector.create(spec(**receiver)) as conn:
        with peer("putter", config=sender, n=n) as putter:
            putter.event("ready")
            tasks = [asyncio.create_task(conn.get("0", "1", f"k{i}", timeout=120)) for i in range(n)]
            while conn.health()["aio_gets_waiting"] < n:
                await asyncio.sleep(0.01)
            putter.send("go")
            results = await asyncio.gather(*tasks)
            sent = await asyncio.to_thread(putter.event, "sent")
        assert sent["bad"] == [] and sent["failures"] == [], sent
    assert [i for i, got in enumerate(results) if got is None] == []


# -- nothing blocks the loop -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_hostile_flood_on_the_loops_receiver_never_stalls_the_loop(
    short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/edge.sock"}
    frames = hostile(LIMIT + 1) + hostile(1000) + hostile(10_000)
    async with AsyncConnector.create(spec(stage_id="1", role="receiver", endpoints=endpoints, shm="off")) as conn:
        endpoint = conn.connector.endpoint
        assert endpoint is not None
        before = conn.health()["rejected_frames"]
        with Ticker() as ticker:
            waiting = asyncio.ensure_future(conn.get("0", "1", "after", timeout=30))
            await asyncio.sleep(0.05)
            await asyncio.to_thread(_attack, endpoint, zmq_ctx, frames, pack(Kind.HEALTH, ()), Kind.HEALTH_REPLY)
            for _ in range(500):
                if conn.health()["rejected_frames"] - before == len(frames):
                    break
                await asyncio.sleep(0.01)
            assert conn.health()["rejected_frames"] - before == len(frames)
            assert not waiting.done()
            # The sender lives on another thread: its construction, put and close are not the loop's work.
            assert await asyncio.to_thread(_put_once, endpoints, "after", {"ok": True})
            got = await waiting
            assert got is not None and got[0] == {"ok": True}
            await asyncio.sleep(0.02)
        assert ticker.worst < 0.1, (
            f"the loop stalled {ticker.worst * 1000:.0f} ms ({ticker.worst_wall * 1000:.0f} ms by the clock)"
        )


def _put_once(endpoints: dict[str, str], key: str, value: Any) -> bool:
    """Put ``value`` from a sender of its own and close it (which waits for the put's confirmation)."""
    with ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints, "shm": "off"}) as sender:
        ok: bool = sender.put("0", "1", key, value)[0]
        return ok


@pytest.mark.anyio
async def test_on_its_loops_thread_nothing_waits_and_what_would_wait_says_how(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    async with (
        AsyncConnector.create(spec(stage_id="1", role="receiver", endpoints=endpoints)) as rx,
        AsyncConnector.create(spec(stage_id="0", role="sender", endpoints=endpoints, max_unacked=1)) as tx,
    ):
        ok, _, meta = await tx.put("0", "1", "a", 1)
        assert ok and meta is not None
        # The window is full: the contract's put, on the loop's thread, fails at once with a reason.
        assert tx.connector.put("0", "1", "b", 2) == (False, 0, None)
        failures = tx.connector.drain_failures()
        assert [(f.key, type(f.error)) for f in failures] == [("b", TransportTimeoutError)]
        assert "cannot wait" in failures[0].reason
        # A get with a put's metadata looks once (the awaited get waits); nothing is recorded.
        assert rx.connector.get("0", "1", "later", {**meta, "key": "later"}) is None
        assert rx.connector.drain_failures() == []
        for call in (
            lambda: rx.connector.get_with_deadline("0", "1", "a", deadline=time.monotonic() + 5),
            lambda: rx.connector.wait_for_change(0, timeout=1.0),
            lambda: tx.connector.flush(1.0),
        ):
            with pytest.raises(RuntimeError, match=r"use .*(AsyncConnector|awaited)"):
                call()
        assert tx.connector.flush(0) in (True, False)  # a look is fine
        # From another thread: a get waits on the mailbox while the loop reads; a put would use the loop's sockets.
        got = await asyncio.to_thread(rx.connector.get_with_deadline, "0", "1", "a", deadline=time.monotonic() + 10)
        assert got is not None and got[0] == 1
        with pytest.raises(RuntimeError, match="driven by an event loop"):
            await asyncio.to_thread(tx.connector.put, "0", "1", "c", 3)
        assert (await tx.put("0", "1", "c", 3, timeout=10))[0]  # the room the get freed
        got = await rx.get("0", "1", "c", timeout=10)
        assert got is not None and got[0] == 3


@pytest.mark.anyio
async def test_a_pull_get_on_its_loops_thread_says_to_await_it(short_tmp: Path) -> None:
    endpoints = {"0": f"ipc://{short_tmp}/s.sock"}
    async with (
        AsyncConnector.create(spec(stage_id="0", role="sender", mode="pull", endpoints=endpoints)) as tx,
        AsyncConnector.create(spec(stage_id="1", role="receiver", mode="pull", endpoints=endpoints)) as rx,
    ):
        ok, _, meta = await tx.put("0", "1", "a", {"v": 1})
        assert ok
        with pytest.raises(RuntimeError, match=r"await AsyncConnector\.get"):
            rx.connector.get("0", "1", "a", meta)
        got = await rx.get("0", "1", "a", meta, timeout=10)
        assert got is not None and got[0] == {"v": 1}


# -- close ------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_aclose_waits_for_acknowledgements_on_the_loop(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}) as receiver:
        tx = AsyncConnector.create(spec(stage_id="0", role="sender", endpoints=endpoints))
        for i in range(200):
            assert (await tx.put("0", "1", f"k{i}", payload(i)))[0]
        await tx.aclose()  # right after the last put: what is unconfirmed is waited for
        assert tx.connector.drain_failures() == []
        for i in range(200):
            got = await asyncio.to_thread(receiver.get_with_deadline, "0", "1", f"k{i}", deadline=time.monotonic() + 10)
            assert got is not None and got[0]["i"] == i


@pytest.mark.anyio
async def test_aclose_reports_each_put_it_could_not_confirm(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/nobody.sock"}  # nobody receives
    tx = AsyncConnector.create(spec(stage_id="0", role="sender", endpoints=endpoints, close_timeout_s=0.3))
    for key in ("a", "b"):
        assert (await tx.put("0", "1", key, {"k": key}))[0]
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    with caplog.at_level(logging.WARNING, logger="zmq_omni"):
        await tx.aclose()
    ticker.cancel()
    assert ticks >= 5, "the loop was blocked while aclose waited for acknowledgements"
    failures = tx.connector.drain_failures()
    assert sorted(f.key for f in failures) == ["a", "b"]
    assert all(isinstance(f.error, DeliveryError) for f in failures)
    warned = [r.getMessage() for r in caplog.records if "unconfirmed" in r.getMessage()]
    assert len(warned) == 1 and "'a'" in warned[0] and "'b'" in warned[0], warned


@pytest.mark.anyio
async def test_closed_from_another_thread_while_its_loop_runs(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    async with AsyncConnector.create(spec(stage_id="1", role="receiver", endpoints=endpoints)) as rx:
        waiting = [asyncio.create_task(rx.get("0", "1", f"never-{i}", timeout=30)) for i in range(20)]
        while rx.health()["aio_gets_waiting"] < 20:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(rx.connector.close)
        assert await asyncio.wait_for(asyncio.gather(*waiting), 10) == [None] * 20
        assert rx.connector.closed and rx.connector.health()["status"] == "closed"


def test_closed_after_its_loop_ended(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r.sock"}
    rx = AsyncConnector.create(spec(stage_id="1", role="receiver", endpoints=endpoints))
    with ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints}) as tx:

        async def main() -> Any:
            assert tx.put("0", "1", "k", {"v": 1})[0]
            return await rx.get("0", "1", "k", timeout=10)

        got = asyncio.run(main())
        assert got is not None and got[0] == {"v": 1}
        rx.close()  # no loop runs it any more: it closes here
        assert rx.connector.closed


# -- one socket, one owner --------------------------------------------------------------------------------


def test_threads_and_a_loop_never_share_a_bound_endpoint(short_tmp: Path) -> None:
    address = f"ipc://{short_tmp}/r.sock"
    extra = {"stage_id": "1", "role": "receiver", "endpoints": {"1": address}}
    with ZmqConnector(dict(extra)):
        with pytest.raises(ConfigError, match="cannot be driven by both threads and an event loop") as refused:
            AsyncConnector.create(spec(**extra))
        assert address in str(refused.value)
    looped = AsyncConnector.create(spec(**extra))
    try:
        with pytest.raises(ConfigError, match="cannot be driven by both threads and an event loop") as refused:
            ZmqConnector(dict(extra))
        assert address in str(refused.value)
        with pytest.raises(ConfigError, match="belongs to that connector's loop alone"):
            AsyncConnector.create(spec(**extra))
    finally:
        looped.close()
    with ZmqConnector(dict(extra)) as threaded:  # once closed, the address is free again
        assert threaded.endpoint == address


@pytest.mark.anyio
async def test_a_loop_driven_curve_receiver_serves_its_allow_list_only() -> None:
    server_pub, server_sec = (key.decode() for key in zmq.curve_keypair())
    good_pub, good_sec = (key.decode() for key in zmq.curve_keypair())
    bad_pub, bad_sec = (key.decode() for key in zmq.curve_keypair())
    receiver = spec(
        stage_id="1",
        role="receiver",
        endpoints={"1": "tcp://127.0.0.1:0"},
        curve_public_key=server_pub,
        curve_secret_key=server_sec,
        curve_allowed_clients=[good_pub],
    )
    async with AsyncConnector.create(receiver) as rx:
        endpoint = rx.connector.endpoint
        assert endpoint is not None
        common = {"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}, "curve_server_key": server_pub}
        common["close_timeout_s"] = 0.1  # the intruder's put is never confirmed
        with (
            ZmqConnector({**common, "curve_public_key": good_pub, "curve_secret_key": good_sec}) as good,
            ZmqConnector({**common, "curve_public_key": bad_pub, "curve_secret_key": bad_sec}) as intruder,
        ):
            assert intruder.put("0", "1", "sneaky", {"v": 0})[0]  # handed to ZeroMQ; its handshake fails
            assert good.put("0", "1", "secret", {"v": 1})[0]
            got = await rx.get("0", "1", "secret", timeout=10)
            assert got is not None and got[0] == {"v": 1}
            for _ in range(500):
                if rx.health().get("curve_refused", 0) > 0:
                    break
                await asyncio.sleep(0.01)
            assert rx.health()["curve_refused"] > 0
            assert await rx.get("0", "1", "sneaky", timeout=0.2) is None
