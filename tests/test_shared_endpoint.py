"""Connectors of one process on one endpoint, roles in both directions, put-then-get, cleanup (issue 30).

vllm-omni main builds two connectors from one spec in one stage process (the
scheduler's chunk adapter and the model runner's mixin), gives a middle
stage's connector role ``receiver`` and has it put downstream, and its
connector tests put then get the same key at once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import wait_until
from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors._shared_endpoint import served
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError, DeliveryError

MODES = ["push", "pull"]


@pytest.fixture
def connectors() -> Iterator[list[ZmqConnector]]:
    """Every connector a test makes; closed at its end (in reverse)."""
    made: list[ZmqConnector] = []
    try:
        yield made
    finally:
        for conn in reversed(made):
            conn.close()


def make(made: list[ZmqConnector], **extra: Any) -> ZmqConnector:
    conn = ZmqConnector(extra)
    made.append(conn)
    return conn


def _endpoint(transport: str, short_tmp: Path, name: str) -> str:
    if transport == "ipc":
        return f"ipc://{short_tmp}/{name}"
    from tests.ports import reserve_port

    return f"tcp://127.0.0.1:{reserve_port()}"


def _edges(transport: str, short_tmp: Path) -> dict[str, str]:
    return {str(stage): _endpoint(transport, short_tmp, f"s{stage}") for stage in range(3)}


def _get(conn: ZmqConnector, from_stage: str, to_stage: str, key: str, timeout: float = 10.0) -> Any:
    got = conn.get_with_deadline(from_stage, to_stage, key, deadline=time.monotonic() + timeout)
    assert got is not None, key
    return got[0]


# -- one endpoint, one mailbox, many connectors ------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_two_push_receivers_from_one_spec_share_one_endpoint_and_one_mailbox(
    connectors: list[ZmqConnector], short_tmp: Path, transport: str
) -> None:
    endpoints = _edges(transport, short_tmp)
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints, "codec_chunk_frames": 25}
    scheduler = make(connectors, **spec)
    worker = make(connectors, **spec)  # the second bind of the address in this process joins the first
    assert scheduler.endpoint == worker.endpoint == endpoints["1"]
    upstream = make(connectors, role="sender", from_stage=0, to_stage=1, endpoints=endpoints)
    keys = [f"r{i}" for i in range(40)]
    for key in keys:
        assert upstream.put("0", "1", key, {"k": key})[0]
    # Each key is delivered once, to whichever connector asks for it.
    for i, key in enumerate(keys):
        first, second = (scheduler, worker) if i % 2 else (worker, scheduler)
        assert _get(first, "0", "1", key) == {"k": key}
        assert second.get("0", "1", key) is None
    # Closing one keeps the other working.
    scheduler.close()
    assert upstream.put("0", "1", "after", {"k": "after"})[0]
    assert _get(worker, "0", "1", "after") == {"k": "after"}
    assert worker.health()["status"] == "ok"
    # The last close releases the endpoint: this process binds it afresh.
    worker.close()
    assert served(endpoints["1"]) is None
    again = make(connectors, **spec)
    assert again.endpoint == endpoints["1"]
    assert upstream.put("0", "1", "again", {"k": "again"})[0]
    assert _get(again, "0", "1", "again") == {"k": "again"}


def test_closing_a_holder_wakes_its_own_waiting_get_and_not_the_others(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    endpoints = _edges("ipc", short_tmp)
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}
    closing, staying = make(connectors, **spec), make(connectors, **spec)
    results: dict[str, Any] = {}

    def wait(name: str, conn: ZmqConnector, key: str) -> None:
        results[name] = conn.get_with_deadline("0", "1", key, deadline=float("inf"))

    def watch() -> None:
        results["gen"] = closing.wait_for_change(closing.get_wakeup_generation() or 0, timeout=60)

    threads = [
        threading.Thread(target=wait, args=("closing", closing, "never")),
        threading.Thread(target=wait, args=("staying", staying, "later")),
        threading.Thread(target=watch),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # let them wait
    start = time.monotonic()
    closing.close()
    threads[0].join(5)
    threads[2].join(5)
    assert not threads[0].is_alive() and not threads[2].is_alive()
    assert time.monotonic() - start < 3.0 and results["closing"] is None
    upstream = make(connectors, role="sender", from_stage=0, to_stage=1, endpoints=endpoints)
    assert upstream.put("0", "1", "later", "v")[0]
    threads[1].join(10)
    assert results["staying"] is not None and results["staying"][0] == "v"


def test_another_process_becomes_a_local_client_of_a_shared_endpoint(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    endpoint = f"ipc://{short_tmp}/s1"
    extra = {"stage_id": 1, "role": "receiver", "endpoints": {"1": endpoint}}
    here = make(connectors, **extra)
    make(connectors, **extra)
    code = (
        "import sys, time\n"
        "from zmq_omni.connectors.zmq import ZmqConnector\n"
        f"c = ZmqConnector({extra!r})\n"
        "print(type(c._bound.receiver).__name__, flush=True)\n"
        "got = c.get_with_deadline('0', '1', 'x', deadline=time.monotonic() + 30)\n"
        "print(got and got[0], flush=True)\n"
        "c.close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "StageClient"
        upstream = make(connectors, role="sender", from_stage=0, to_stage=1, endpoints={"1": endpoint})
        assert upstream.put("0", "1", "x", "for the other process")[0]
        assert child.stdout.readline().strip() == "for the other process"
        assert child.wait(timeout=30) == 0
        assert here.get("0", "1", "x") is None  # taken once, by the process that asked
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_connectors_with_other_settings_cannot_share_an_endpoint(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/s1"}
    make(connectors, stage_id=1, role="receiver", endpoints=endpoints)
    with pytest.raises(ConfigError, match=r"other settings \(hwm\)"):
        ZmqConnector({"stage_id": 1, "role": "receiver", "endpoints": endpoints, "hwm": 7})
    # role and stage ids may differ: a stage's sender that gets binds its own stage's endpoint, shared.
    sender = make(connectors, role="sender", from_stage=1, to_stage=2, endpoints=endpoints)
    assert sender.get("0", "1", "nothing") is None and sender.endpoint == endpoints["1"]


def test_tcp_port_zero_binds_are_never_shared(connectors: list[ZmqConnector]) -> None:
    extra = {"stage_id": 1, "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}}
    first, second = make(connectors, **extra), make(connectors, **extra)
    assert first.endpoint != second.endpoint


def test_two_pull_servers_from_one_spec_share_one_store(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoints = {"0": f"ipc://{short_tmp}/s0"}
    spec = {"role": "sender", "mode": "pull", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}
    scheduler, worker = make(connectors, **spec), make(connectors, **spec)
    assert scheduler.endpoint == worker.endpoint == endpoints["0"]
    receiver = make(connectors, role="receiver", mode="pull", from_stage=0, to_stage=1, endpoints=endpoints)
    meta_a = scheduler.put("0", "1", "a", {"k": "a"})[2]
    meta_b = worker.put("0", "1", "b", {"k": "b"})[2]
    assert receiver.get("0", "1", "b", meta_b) == ({"k": "b"}, meta_b["size"])
    assert receiver.get("0", "1", "a", meta_a) == ({"k": "a"}, meta_a["size"])
    # What nobody fetched is reported by the connector that put it, when it closes (its payloads leave with it).
    assert scheduler.put("0", "1", "lost_s", 1)[0] and worker.put("0", "1", "lost_w", 2)[0]
    worker.close_with_linger(0)
    assert [f.key for f in worker.drain_failures() if isinstance(f.error, DeliveryError)] == ["lost_w"]
    assert receiver.get_with_deadline("0", "1", "lost_w", deadline=time.monotonic() + 0.2) is None
    scheduler.close_with_linger(0)
    assert [f.key for f in scheduler.drain_failures() if isinstance(f.error, DeliveryError)] == ["lost_s"]


# -- roles: which side binds, not which direction -----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_middle_stages_receiver_puts_downstream(
    connectors: list[ZmqConnector], short_tmp: Path, shm_dir: str, mode: str
) -> None:
    endpoints = _edges("ipc", short_tmp)
    # get_connectors_config_for_stage(…, 1): from_stage_0 -> role receiver; stage 2's from_stage_1 -> receiver.
    common = {"mode": mode, "endpoints": endpoints, "shm_dir": shm_dir}
    first = make(connectors, role="sender", from_stage=0, to_stage=1, **common)
    middle = make(connectors, role="receiver", from_stage=0, to_stage=1, **common)
    last = make(connectors, role="receiver", from_stage=1, to_stage=2, **common)
    for n, size in enumerate((4, 300_000, 300_000)):  # small, then large ones (the same-host fast path)
        key = f"r{n}"
        ok, _, meta = first.put("0", "1", key, {"x": np.arange(size)})
        assert ok
        got = middle.get_with_deadline("0", "1", key, meta, deadline=time.monotonic() + 10)
        assert got is not None
        ok, _, meta = middle.put("1", "2", key, {"y": got[0]["x"] * 2})
        assert ok, middle.drain_failures()
        got = last.get_with_deadline("1", "2", key, meta, deadline=time.monotonic() + 10)
        assert got is not None and np.array_equal(got[0]["y"], np.arange(size) * 2)
    assert middle.health()["status"] == "ok" and middle.drain_failures() == []
    if mode == "pull":  # the middle stage's puts are served from its own stage's endpoint
        assert middle.endpoint == endpoints["1"]


# -- put then get in one process ----------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_put_then_get_in_one_process_never_misses(
    connectors: list[ZmqConnector], short_tmp: Path, transport: str
) -> None:
    endpoints = _edges(transport, short_tmp)
    conn = make(connectors, stage_id=1, role="dual", endpoints=endpoints)
    missed = 0
    for i in range(1000):
        key = f"req{i}"
        assert conn.put("1", "1", key, {"i": i})[0]
        got = conn.get("1", "1", key, metadata=None)
        missed += got is None or got[0] != {"i": i}
    assert missed == 0
    assert conn.health()["mailbox"] == 0


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_connector_without_a_role_puts_then_gets_before_it_ever_bound(
    connectors: list[ZmqConnector], short_tmp: Path, transport: str
) -> None:
    # vllm-omni main's tests: SharedMemoryConnector({}), put, then get by key; here the first put goes
    # out before the connector bound its endpoint (its first get binds it).
    conn = make(connectors, endpoints=_edges(transport, short_tmp))
    for i in range(200):
        assert conn.put("0", "1", f"k{i}", i)[0]
        got = conn.get("0", "1", f"k{i}")
        assert got is not None and got[0] == i, i


@pytest.mark.parametrize("bound", [True, False])
def test_cleanup_cancels_our_own_puts_still_on_their_way_to_us(
    connectors: list[ZmqConnector], short_tmp: Path, bound: bool
) -> None:
    conn = make(connectors, endpoints=_edges("ipc", short_tmp), metadata_get_timeout_s=30)
    if bound:
        assert conn.get("0", "1", "warm-up") is None  # binds
    for key in ("cleanup_req_42", "req_42_0_1", "req_42", "keep"):
        assert conn.put("0", "1", key, key)[0]
    conn.cleanup("req_42")
    if not bound:
        assert conn.get("0", "1", "warm-up") is None  # binds now
    assert conn.flush(10.0)  # every put arrived: the cancelled ones were dropped there, not kept

    def settled() -> bool:
        health = conn.health()
        return bool(health["mailbox"] == 1 and health["dropped_late"] + health["dropped_cleanup"] == 3)

    assert wait_until(settled, 10.0), conn.health()
    start = time.monotonic()
    for key in ("cleanup_req_42", "req_42_0_1", "req_42"):
        assert conn.get("0", "1", key) is None, key
    assert time.monotonic() - start < 10.0  # nothing cancelled is waited for
    assert _get(conn, "0", "1", "keep") == "keep"


def test_put_by_one_connector_then_get_by_another_of_the_spec(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoints = _edges("ipc", short_tmp)
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}
    scheduler, worker = make(connectors, **spec), make(connectors, **spec)
    for i in range(300):
        assert scheduler.put("0", "1", f"k{i}", i)[0]
        got = worker.get("0", "1", f"k{i}")
        assert got is not None and got[0] == i


def test_a_get_without_a_put_in_flight_still_returns_at_once(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    conn = make(connectors, stage_id=1, role="dual", endpoints=_edges("ipc", short_tmp))
    start = time.monotonic()
    for i in range(100):
        assert conn.get("1", "1", f"none{i}") is None
    assert time.monotonic() - start < 5.0  # no wait per get (a wait would be metadata_get_timeout_s, 5 s, each)


def test_a_put_to_ourselves_that_fails_is_not_waited_for(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    conn = make(connectors, stage_id=1, role="dual", endpoints=_edges("ipc", short_tmp), metadata_get_timeout_s=30)
    assert conn.put("1", "1", "big", b"x" * 2048)[0]
    conn.cleanup("big")  # the key is cancelled: nothing is expected any more
    start = time.monotonic()
    assert conn.get("1", "1", "big") is None
    assert time.monotonic() - start < 10.0


# -- cleanup(request_id): the key, rid_* and *_rid ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_cleanup_drops_the_requests_keys_as_vllm_omni_main_does(
    connectors: list[ZmqConnector], short_tmp: Path, mode: str
) -> None:
    endpoints = _edges("ipc", short_tmp)
    sender = make(connectors, role="sender", mode=mode, from_stage=0, to_stage=1, endpoints=endpoints)
    receiver = make(connectors, role="receiver", mode=mode, from_stage=0, to_stage=1, endpoints=endpoints)
    keys = ["rid", "rid_0_1", "rid_0_2", "kv_rid", "rid2", "xrid", "rid2_0_1", "other_rid2"]
    for key in keys:
        assert sender.put("0", "1", key, key)[0]
    if mode == "push":
        assert sender.flush(10.0)  # every put is in the receiver's mailbox
    side = receiver if mode == "push" else sender  # who holds the items: the push mailbox, or the pull store
    assert side.cleanup("rid") is True
    assert side.cleanup("absent") is False
    for key in ("rid", "rid_0_1", "rid_0_2", "kv_rid"):
        assert receiver.get("0", "1", key) is None, key
    for key in ("rid2", "xrid", "rid2_0_1", "other_rid2"):
        assert _get(receiver, "0", "1", key) == key


# -- a threaded and an asyncio connector on one endpoint ----------------------------------------------------------


def test_a_threaded_and_an_asyncio_connector_share_an_endpoint(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoints = _edges("ipc", short_tmp)
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}
    threaded = make(connectors, **spec)
    looped = make(connectors, **spec)
    upstream = make(connectors, role="sender", from_stage=0, to_stage=1, endpoints=endpoints)

    async def run() -> list[Any]:
        async with AsyncConnector(looped, close_connector=False) as aio:
            waiting = [asyncio.ensure_future(aio.get("0", "1", f"a{i}", timeout=10)) for i in range(20)]
            await asyncio.sleep(0)
            for i in range(20):
                assert upstream.put("0", "1", f"a{i}", i)[0]
                assert upstream.put("0", "1", f"t{i}", i)[0]
            got = await asyncio.gather(*waiting)
            return [None if g is None else g[0] for g in got]

    assert asyncio.run(run()) == list(range(20))
    assert [_get(threaded, "0", "1", f"t{i}") for i in range(20)] == list(range(20))


def test_two_event_loops_share_an_endpoint(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoints = _edges("ipc", short_tmp)
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}
    first, second = make(connectors, **spec), make(connectors, **spec)
    upstream = make(connectors, role="sender", from_stage=0, to_stage=1, endpoints=endpoints)
    got: dict[str, list[Any]] = {}
    waiting = threading.Barrier(3)

    def serve(conn: ZmqConnector, prefix: str) -> None:
        async def run() -> None:
            async with AsyncConnector(conn, close_connector=False) as aio:
                gets = [asyncio.ensure_future(aio.get("0", "1", f"{prefix}{i}", timeout=20)) for i in range(100)]
                await asyncio.sleep(0)
                waiting.wait(10)
                got[prefix] = [None if g is None else g[0] for g in await asyncio.gather(*gets)]

        asyncio.run(run())

    loops = [threading.Thread(target=serve, args=(conn, prefix)) for conn, prefix in ((first, "a"), (second, "b"))]
    for loop in loops:
        loop.start()
    waiting.wait(10)
    for i in range(100):
        assert upstream.put("0", "1", f"a{i}", i)[0] and upstream.put("0", "1", f"b{i}", i)[0]
    for loop in loops:
        loop.join(30)
    assert got == {"a": list(range(100)), "b": list(range(100))}
