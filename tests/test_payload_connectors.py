"""Every payload type through real connectors: ZmqConnector push over ipc with shared memory on, across
processes (the receiver registers the record classes or not), and SharedMemoryConnector."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.connectors.shm import SharedMemoryConnector
from zmq_omni.connectors.zmq import ZmqConnector

from . import payload_cases as cases
from .zmq_peers import expect, spawned


def receive_and_check(config: dict[str, Any], register: str, out: Any) -> None:
    """Spawned receiver: register what ``register`` says, get key "p", report its differences from the payload."""
    if register in ("records", "all"):
        cases.register_records()
    if register in ("custom", "all"):
        cases.register_custom()
    with ZmqConnector(config) as conn:
        out.put(("ready",))
        got = conn.get_with_deadline("0", "1", "p", deadline=time.monotonic() + 30)
        failures = [f"{f.reason}" for f in conn.drain_failures()]
        if got is None:
            out.put(("done", None, failures))
            return
        want = cases.expected(cases.build_payload(), registered=register == "all")
        out.put(("done", cases.differences(got[0], want), failures))


@pytest.fixture
def custom_registered() -> Iterator[None]:
    cases.register_custom()  # the sender needs it to encode Celsius at all
    try:
        yield
    finally:
        cases.unregister_all()


def _configs(short_tmp: Path, shm_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    base = {
        "endpoints": {"1": f"ipc://{short_tmp}/r1"},
        "shm_dir": shm_dir,
        "shm_min_free_bytes": 0,
        "heartbeat_s": 0.1,
    }
    return (
        {**base, "stage_id": "0", "role": "sender", "shm": "on"},
        {**base, "stage_id": "1", "role": "receiver", "decode_device": "cpu"},
    )


@pytest.mark.parametrize("register", ["all", "custom"], ids=["receiver-registered", "receiver-unregistered"])
def test_zmq_push_ipc_shm_carries_every_payload_type_across_processes(
    short_tmp: Path, shm_dir: str, custom_registered: None, register: str
) -> None:
    send_cfg, recv_cfg = _configs(short_tmp, shm_dir)
    with spawned(receive_and_check, recv_cfg, register) as (_, queue):
        expect(queue, "ready")
        with ZmqConnector(send_cfg) as sender:
            ok, nbytes, _ = sender.put("0", "1", "p", cases.build_payload())
            assert ok and nbytes > 1 << 20
            diffs, failures = expect(queue, "done")
            assert sender.health()["shm_puts"] == 1  # the large payload took shared memory
    assert failures == [] and diffs == []


def test_zmq_receiver_without_a_registered_custom_type_fails_the_get_with_a_clear_reason(
    short_tmp: Path, shm_dir: str, custom_registered: None
) -> None:
    send_cfg, recv_cfg = _configs(short_tmp, shm_dir)
    with spawned(receive_and_check, recv_cfg, "records") as (_, queue):
        expect(queue, "ready")
        with ZmqConnector(send_cfg) as sender:
            assert sender.put("0", "1", "p", cases.build_payload())[0]
            got, failures = expect(queue, "done")
    assert got is None
    assert any("unknown registered type 'test.Celsius'" in reason for reason in failures), failures


@pytest.mark.parametrize("register", [True, False], ids=["registered", "unregistered"])
def test_shared_memory_connector_carries_every_payload_type(shm_dir: str, register: bool) -> None:
    config = {"namespace": f"p{os.getpid()}", "shm_dir": shm_dir, "decode_device": "cpu"}
    cases.register_custom()
    if register:
        cases.register_records()
    try:
        with SharedMemoryConnector(config) as sender, SharedMemoryConnector(config) as receiver:
            payload = cases.build_payload()
            assert sender.put("0", "1", "p", payload)[0]
            got = receiver.get("0", "1", "p")
            assert got is not None, receiver.drain_failures()
            assert cases.differences(got[0], cases.expected(payload, registered=register)) == []
            del got
    finally:
        cases.unregister_all()
