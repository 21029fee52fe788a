"""Pull mode's same-host fast path, and flushing puts that lie in shared memory, with real processes."""

from __future__ import annotations

import gc
import os
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import numpy as np
import zmq

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport._envelope import Kind, pack, unpack

from ._shm_workers import dead_process_segment
from .test_zmq_shm import MiB, digest, ours, receiver_proc, start
from .zmq_peers import SPAWN


def pull_configs(short_tmp: Path, shm_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    base = {"mode": "pull", "endpoints": {"0": f"ipc://{short_tmp}/s0"}, "shm_dir": shm_dir, "shm_min_free_bytes": 0}
    return {**base, "stage_id": "0", "role": "sender"}, {**base, "stage_id": "1", "role": "receiver"}


def fetch_in_another_process(rcfg: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    out = SPAWN.Queue()
    proc = start(receiver_proc, rcfg, keys, out)
    result: dict[str, Any] = out.get(timeout=60)
    proc.join(10)
    return result


def test_pull_fetches_after_the_first_come_through_shared_memory_without_a_copy(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = pull_configs(short_tmp, shm_dir)
    data = [np.random.default_rng(i).standard_normal(MiB // 8) for i in range(4)]  # 1 MiB each
    keys = [f"k{i}" for i in range(4)]
    with ZmqConnector(scfg) as sender:
        for key, arr in zip(keys, data, strict=True):
            assert sender.put("0", "1", key, {"data": arr})[0]
        result = fetch_in_another_process(rcfg, keys)
        assert sender.flush(10.0) is True
        health = sender.health()
        assert health["shm_puts"] == 3 and health["pending"] == 0 and health["fetched"] == 4
    assert sender.drain_failures() == []
    for i, key in enumerate(keys):
        dtype, shape, sha, mapped, owndata = result[key]["data"]
        assert [dtype, shape, sha] == digest(data[i])
        in_shm = mapped is not None and Path(mapped).parent == Path(shm_dir) and Path(mapped).name.startswith("zomni_")
        # The first fetch learns the server's probe (frames); every later one maps the server's slot.
        assert in_shm is (i > 0) and owndata is False, (key, mapped)
    assert ours(shm_dir) == []


def test_pull_receiver_that_cannot_read_the_servers_shm_gets_frames(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = pull_configs(short_tmp, shm_dir)
    elsewhere = tempfile.mkdtemp(prefix="zo-elsewhere-", dir="/dev/shm")  # another tmpfs view: the probe fails
    try:
        data = np.arange(MiB // 4, dtype=np.float32)
        with ZmqConnector(scfg) as sender:
            for i in range(3):
                assert sender.put("0", "1", f"k{i}", {"data": data})[0]
            result = fetch_in_another_process({**rcfg, "shm_dir": elsewhere}, ["k0", "k1", "k2"])
            assert sender.flush(10.0) is True
            assert sender.health()["shm_puts"] == 0
        for i in range(3):
            dtype, shape, sha, mapped, _ = result[f"k{i}"]["data"]
            assert [dtype, shape, sha] == digest(data)
            assert mapped is None or not Path(mapped).name.startswith("zomni_")
        assert ours(shm_dir) == [] and ours(elsewhere) == []
    finally:
        Path(elsewhere).rmdir()


def test_pull_receiver_with_shm_on_reports_a_server_whose_shm_it_cannot_read(short_tmp: Path, shm_dir: str) -> None:
    scfg, rcfg = pull_configs(short_tmp, shm_dir)
    server = scfg["endpoints"]["0"]
    elsewhere = tempfile.mkdtemp(prefix="zo-elsewhere-", dir="/dev/shm")  # another tmpfs view: the probe fails
    try:
        with (
            ZmqConnector(scfg) as sender,
            ZmqConnector({**rcfg, "shm": "on", "shm_dir": elsewhere}) as blind,
            ZmqConnector({**rcfg, "shm": "on"}) as seeing,
            ZmqConnector({**rcfg, "shm_dir": elsewhere}) as blind_but_auto,
        ):
            for i, conn in enumerate((blind, seeing, blind_but_auto)):
                assert sender.put("0", "1", f"k{i}", {"x": i})[0]
                assert conn.get("0", "1", f"k{i}") == ({"x": i}, ANY)
            health = blind.health()
            assert health["status"] == "degraded" and health["shm_servers"] == {server: False}
            assert server in health["shm_problems"][0]
            health = seeing.health()
            assert health["status"] == "ok" and health["shm_servers"] == {server: True}
            health = blind_but_auto.health()  # auto: frames are the expected fallback, not a problem
            assert health["status"] == "ok" and health["shm_servers"] == {server: False}
        assert ours(shm_dir) == [] and ours(elsewhere) == []
    finally:
        Path(elsewhere).rmdir()


def test_push_flush_waits_until_a_put_in_shared_memory_is_consumed(short_tmp: Path, shm_dir: str) -> None:
    # close() unlinks the sender's slots, so a handle that arrived but was never opened would die with it.
    endpoints = {"1": f"ipc://{short_tmp}/r1"}
    common = {"endpoints": endpoints, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "heartbeat_s": 0.1}
    with (
        ZmqConnector({**common, "stage_id": "1", "role": "receiver"}) as receiver,
        ZmqConnector({**common, "stage_id": "0", "role": "sender", "shm": "on"}) as sender,
    ):
        data = np.ones(MiB, dtype=np.uint8)
        assert sender.put("0", "1", "big", {"data": data})[0]
        assert sender.health()["shm_puts"] == 1
        deadline = time.monotonic() + 10
        while sender.health()["undelivered"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.health()["undelivered"] == 0  # it arrived...
        assert sender.flush(0.3) is False  # ...but its slot was not opened yet
        got = receiver.get_with_deadline("0", "1", "big", deadline=time.monotonic() + 10)
        assert got is not None and np.array_equal(got[0]["data"], data)
        assert sender.flush(10.0) is True


def test_push_close_reports_a_put_in_shared_memory_that_was_never_consumed(short_tmp: Path, shm_dir: str) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/r1"}
    common = {"endpoints": endpoints, "shm_dir": shm_dir, "shm_min_free_bytes": 0, "heartbeat_s": 0.1}
    with ZmqConnector({**common, "stage_id": "1", "role": "receiver"}) as receiver:
        sender = ZmqConnector({**common, "stage_id": "0", "role": "sender", "shm": "on"})
        try:
            assert sender.put("0", "1", "big", {"data": np.ones(MiB, dtype=np.uint8)})[0]
            deadline = time.monotonic() + 10
            while sender.health()["undelivered"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sender.health()["undelivered"] == 0
        finally:
            sender.close()  # unlinks the slot the receiver has not opened
        failures = sender.drain_failures()
        assert [f.key for f in failures] == ["big"] and "confirmed delivery" in failures[0].reason
        assert receiver.get("0", "1", "big") is None  # its handle is stale now: reported there too
        assert [f.key for f in receiver.drain_failures()] == ["big"]
    assert ours(shm_dir) == []


def test_pull_server_answers_a_client_of_the_previous_version_in_its_own_format(
    short_tmp: Path, shm_dir: str, zmq_ctx: zmq.Context[Any]
) -> None:
    scfg, _ = pull_configs(short_tmp, shm_dir)
    with ZmqConnector(scfg) as sender:
        assert sender.put("0", "1", "k", {"data": np.ones(MiB, dtype=np.uint8)})[0]
        sock = zmq_ctx.socket(zmq.DEALER)
        sock.connect(scfg["endpoints"]["0"])

        def ask(*fields: Any) -> list[Any]:
            sock.send(pack(Kind.FETCH, fields))
            assert sock.poll(10_000)
            frames = sock.recv_multipart()
            kind, header, _ = unpack(frames[0])
            assert kind is Kind.FETCH_REPLY
            return header

        assert ask(1, "0", "1", "absent", 0) == [1, False]  # five fields in, two out
        header = ask(2, "0", "1", "absent", 0, False)  # the flag asks for the probe
        assert header[:2] == [2, False] and isinstance(header[2], list) and len(header[2]) == 2
        assert ask(3, "0", "1", "k", 0)[:2] == [3, True]  # an old client gets frames, in the old shape
        sock.close(linger=0)


def test_a_pull_connector_closed_while_its_reply_waits_in_shared_memory_is_collectable(
    short_tmp: Path, shm_dir: str, zmq_ctx: zmq.Context[Any]
) -> None:
    # A fetcher that said it reads our shared memory and never opens the slot keeps that reply leaving
    # (the slot waits READY for it). The connector that put it closes meanwhile, another one of the
    # process keeps the server: the reply still leaving holds nothing of the closed connector.
    scfg, _ = pull_configs(short_tmp, shm_dir)
    scfg = {**scfg, "close_timeout_s": 0.1}
    with ZmqConnector(scfg) as keeper:
        owner = ZmqConnector(scfg)
        assert owner.put("0", "1", "k", {"data": np.ones(MiB, dtype=np.uint8)})[0]
        sock = zmq_ctx.socket(zmq.DEALER)
        sock.connect(scfg["endpoints"]["0"])
        sock.send(pack(Kind.FETCH, (1, "0", "1", "k", 0, True)))
        assert sock.poll(10_000)
        kind, header, _ = unpack(sock.recv_multipart()[0])
        assert kind is Kind.FETCH_REPLY and header[1] is True and len(header) == 4  # a handle, not frames
        assert keeper.health()["pending"] == 1  # its reply has not left: nobody opened the slot
        owner.close()
        gone = weakref.ref(owner)
        del owner
        gc.collect()
        assert gone() is None
        sock.close(linger=0)


def test_a_pull_server_that_starts_sweeps_what_killed_processes_left(short_tmp: Path, shm_dir: str) -> None:
    name = dead_process_segment(shm_dir)
    scfg, _ = pull_configs(short_tmp, shm_dir)
    with ZmqConnector({**scfg, "shm": "on"}):
        assert name not in os.listdir(shm_dir)
