"""Closing a ZmqConnector with puts in flight: flushed on request, reported otherwise, never dropped silently."""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import DeliveryError
from zmq_omni.transport._envelope import Kind, pack

from .conftest import wait_until
from .test_zmq_failures import connectors, make, zmq_threads
from .test_zmq_shm import MiB, start
from .zmq_peers import SPAWN, expect, expected_digest, get_main, make_payload, spawned

__all__ = ["connectors"]  # the fixture, imported for pytest


def test_close_reports_every_put_whose_delivery_was_not_confirmed(
    connectors: list[ZmqConnector], short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sender = make(
        connectors,
        stage_id="0",
        role="sender",
        endpoints={"1": f"ipc://{short_tmp}/nobody.sock"},
        close_timeout_s=0.3,
    )
    keys = [f"k{i}" for i in range(12)]
    for key in keys:
        assert sender.put("0", "1", key, {"n": key})[0]
    with caplog.at_level(logging.WARNING, logger="zmq_omni"):
        sender.close()  # lingers its 0.3 s for a receiver that never comes, then reports
    # One WARNING names the keys (the first ten and how many more): a caller who reads no
    # drain_failures() still sees the loss in its log.
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "12 put(s) unconfirmed after a linger of 0.3 s" in warning and "'k0'" in warning and "and 2 more" in warning
    failures = sender.drain_failures()
    assert sorted(f.key for f in failures) == sorted(keys)
    assert all(f.op == "put" and f.to_stage == "1" and isinstance(f.error, DeliveryError) for f in failures)
    assert all("closed before stage '1' confirmed delivery" in f.reason for f in failures)
    health = sender.health()
    assert health["delivery_failures"] == 12 and health["pending"] == 0 and health["status"] == "closed"


def test_close_with_the_default_linger_loses_nothing_a_live_receiver_can_take(
    connectors: list[ZmqConnector], short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Default settings: close right after the puts returned ok waits for their confirmation.
    endpoint = f"ipc://{short_tmp}/linger.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint})
    keys = [f"k{i}" for i in range(200)]
    for key in keys:
        assert sender.put("0", "1", key, {"n": key, "pad": np.zeros(4096, np.uint8)})[0]
    with caplog.at_level(logging.WARNING, logger="zmq_omni"):
        sender.close()
    assert sender.drain_failures() == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    got = [receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 5) for key in keys]
    assert [g[0]["n"] if g else None for g in got] == keys


def test_flush_waits_for_a_late_receiver_and_close_then_loses_nothing(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    # The sender outlives nothing: it puts before the receiver is up, flushes, closes, and the receiver
    # (started late, as a next stage often is) still gets every item.
    endpoint = f"ipc://{short_tmp}/late.sock"
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, heartbeat_s=0.05)
    keys = [f"k{i}" for i in range(50)]
    for key in keys:
        assert sender.put("0", "1", key, {"n": key, "pad": b"x" * 3000})[0]
    assert sender.flush(0.2) is False  # nobody there yet: bounded, and says so
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    assert sender.flush(10.0) is True
    assert sender.health()["undelivered"] == 0
    sender.close()
    assert sender.drain_failures() == []
    got = [receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 5) for key in keys]
    assert [g[0]["n"] if g else None for g in got] == keys


def test_close_timeout_makes_close_flush_first(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/grace.sock"
    sender = make(
        connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, heartbeat_s=0.05, close_timeout_s=10.0
    )
    for i in range(20):
        assert sender.put("0", "1", f"k{i}", i)[0]
    late = threading.Timer(0.3, lambda: make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint}))
    late.start()
    sender.close()  # waits for the late receiver to confirm every put
    late.join()
    assert sender.drain_failures() == []
    receiver = connectors[-1]
    got = [receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 5) for i in range(20)]
    assert [g[0] if g else None for g in got] == list(range(20))


def test_pull_mode_close_reports_payloads_nobody_fetched(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoints = {"0": f"ipc://{short_tmp}/pull.sock"}
    sender = make(connectors, stage_id="0", role="sender", mode="pull", endpoints=endpoints, close_timeout_s=0)
    receiver = make(connectors, stage_id="1", role="receiver", mode="pull", endpoints=endpoints)
    metadata = {key: sender.put("0", "1", key, key)[2] for key in ("a", "b", "c")}
    assert receiver.get("0", "1", "a", metadata["a"]) is not None
    assert sender.flush(0.2) is False
    sender.close()
    failures = sender.drain_failures()
    assert sorted(f.key for f in failures) == ["b", "c"]
    assert all(isinstance(f.error, DeliveryError) and "fetched" in f.reason for f in failures)


def stalled_fetcher(endpoint: str, ready: Any) -> None:
    """Ask for key ``big`` with a tiny receive buffer, then freeze this whole process mid-reply."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVBUF, 4096)  # the reply trickles in: it is still streaming when we stop
    sock.connect(endpoint)
    sock.send(pack(Kind.FETCH, (1, "0", "1", "big", 0)))
    ready.set()
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGSTOP)  # the kernel buffers fill and the server's send stalls


def test_pull_mode_close_reports_a_reply_that_was_still_leaving(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    sender = make(connectors, stage_id="0", role="sender", mode="pull", shm="off", close_timeout_s=0,
                  endpoints={"0": "tcp://127.0.0.1:0"})  # fmt: skip
    assert sender.endpoint is not None
    big = np.ones(128 * MiB, dtype=np.uint8)
    assert sender.put("0", "1", "big", {"data": big})[0]
    ready = SPAWN.Event()
    proc = start(stalled_fetcher, sender.endpoint, ready)
    try:
        assert ready.wait(60)
        deadline = time.monotonic() + 30
        while sender.health().get("fetched", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.health().get("fetched") == 1
        # Handed to ZeroMQ is not delivered: the payload stays pending while its reply is stuck.
        assert sender.flush(0.3) is False and sender.health()["pending"] == 1
        started = time.monotonic()
        sender.close()
        assert time.monotonic() - started < 2.0
    finally:
        proc.kill()
        proc.join(10)
    failures = sender.drain_failures()
    assert [f.key for f in failures] == ["big"]
    assert isinstance(failures[0].error, DeliveryError) and "still leaving" in failures[0].reason


def _busy_loop(stop: Any) -> None:
    """A CPU hog: spins until told to stop."""
    while not stop.is_set():
        pass


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_close_right_after_large_puts_delivers_them_all_or_names_the_missing(
    connectors: list[ZmqConnector], short_tmp: Path, caplog: pytest.LogCaptureFixture, shm: str
) -> None:
    # Default settings, a busy-loop process per core, and close() right after eight 64 MiB puts
    # returned ok: every item reaches the receiver, or its key is reported (log and drain_failures).
    stop = SPAWN.Event()
    hogs = [SPAWN.Process(target=_busy_loop, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for hog in hogs:
        hog.start()
    try:
        for attempt in range(3):
            endpoint = f"ipc://{short_tmp}/big-{attempt}.sock"
            keys = [f"big{attempt}-{n}" for n in range(8)]
            wants = [("0", key, None) for key in keys]
            with spawned(get_main, {"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}}, wants) as (
                _,
                queue,
            ):
                expect(queue, "ready")
                sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, shm=shm)
                for n, key in enumerate(keys):
                    assert sender.put("0", "1", key, make_payload(64 * MiB, n))[0]
                with caplog.at_level(logging.WARNING, logger="zmq_omni"):
                    sender.close()
                reported = {f.key for f in sender.drain_failures()}
                results, _ = expect(queue, "done", timeout=90)
            missing = {key for key, got in results.items() if got is None}
            assert missing <= reported, f"attempt {attempt}: lost without a trace: {sorted(missing - reported)}"
            warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
            assert all(repr(key) in warned for key in reported)
            assert [results[key] for key in keys if key not in missing] == [
                expected_digest(64 * MiB, n) for n, key in enumerate(keys) if key not in missing
            ]
    finally:
        stop.set()
        for hog in hogs:
            hog.join(5)


def _dawdle(frame: Any, event: str, arg: Any) -> None:
    """A profile hook: pause at random function calls, so close() lands anywhere in a put."""
    if event == "call" and random.random() < 0.5:
        time.sleep(0.0002)


def _put_until_refused(sender: ZmqConnector, prefix: str, ok: list[str], start: threading.Event) -> None:
    """Put small items until a put fails (the sender closed under it); ``ok``: the keys of puts that returned ok."""
    start.wait(10)
    sys.setprofile(_dawdle)
    try:
        for n in range(100_000):
            key = f"{prefix}{n}"
            if not sender.put("0", "1", key, {"n": n})[0]:
                return
            ok.append(key)
    finally:
        sys.setprofile(None)


def test_a_put_racing_close_is_delivered_or_reported(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    # Three threads put small items (alone, in batches, directly) while close() runs without a linger; the put
    # threads pause at random calls. Each put that returned ok reaches the receiver or is in drain_failures(),
    # and the sender's I/O thread ends.
    endpoint = f"ipc://{short_tmp}/race.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    for attempt in range(60):
        sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, close_timeout_s=0)
        assert sender.put("0", "1", f"warm{attempt}", 0)[0]  # its receiver answered: small puts may batch
        assert receiver.get_with_deadline("0", "1", f"warm{attempt}", deadline=time.monotonic() + 10)
        start = threading.Event()
        oks: list[list[str]] = [[] for _ in range(3)]
        threads = [
            threading.Thread(target=_put_until_refused, args=(sender, f"a{attempt}t{i}-", oks[i], start))
            for i in range(3)
        ]
        for thread in threads:
            thread.start()
        start.set()
        time.sleep(0.001 * (1 + attempt % 5))
        sender.close()
        for thread in threads:
            thread.join(30)
        alive = [t.name for t in zmq_threads()]
        assert "zmq-omni-0" not in alive, f"attempt {attempt}: the sender's I/O thread outlived close()"
        reported = {f.key for f in sender.drain_failures()}
        unreported = [key for ok in oks for key in ok if key not in reported]
        deadline = time.monotonic() + 5
        lost = [key for key in unreported if receiver.get_with_deadline("0", "1", key, deadline=deadline) is None]
        assert lost == [], f"attempt {attempt}: {len(lost)} put(s) returned ok, never arrived, never reported"
        receiver.cleanup_prefix(f"a{attempt}")


def test_a_flush_racing_close_says_what_close_could_not_confirm(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    sender = make(
        connectors, stage_id="0", role="sender", endpoints={"1": f"ipc://{short_tmp}/nobody.sock"}, close_timeout_s=0
    )
    for i in range(5):
        assert sender.put("0", "1", f"k{i}", i)[0]
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(sender.flush(30.0)))
    flusher.start()
    assert wait_until(lambda: sender.health()["undelivered"] == 5)
    time.sleep(0.05)  # the flush is waiting
    sender.close()
    flusher.join(10)
    assert flushed == [False]  # close() reported the five: the flush did not see them delivered
    assert sorted(f.key for f in sender.drain_failures()) == [f"k{i}" for i in range(5)]
    assert sender.flush(0.1) is False


def test_calls_on_a_closed_connector_write_to_no_file_that_reuses_its_descriptors(short_tmp: Path) -> None:
    # A closed connector's descriptors (the I/O threads' wake-ups) are closed; files opened afterwards
    # take their numbers. Calls on the closed connector must not write into those files.
    receiver = ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": f"ipc://{short_tmp}/r.sock"}})
    receiver.close()
    files = [open(short_tmp / f"f{i}", "wb+") for i in range(64)]  # noqa: SIM115 (closed below)
    try:
        watch = receiver.watch_arrivals()
        watch.close()
        assert receiver.get("0", "1", "k") is None
        receiver.cleanup("k")
        time.sleep(0.05)
        for f in files:
            f.seek(0)
            assert f.read() == b"", f"{f.name} was written to"
    finally:
        for f in files:
            f.close()


def test_last_acknowledgements_without_a_route_at_close_are_logged(
    connectors: list[ZmqConnector], short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"ipc://{short_tmp}/refused.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, close_timeout_s=5)
    assert sender.put("0", "1", "k", {"v": 1})[0]
    assert sender.flush(5)  # arrived (the receiver confirmed it)
    sender.close()
    time.sleep(0.2)  # libzmq's I/O thread drops the sender's route: its consumption can no longer be told
    assert receiver.get("0", "1", "k") is not None
    with caplog.at_level(logging.INFO, logger="zmq_omni.transport"):
        receiver.close()
    # A gone sender needs no acknowledgement (it reported its own unconfirmed puts): said, not warned.
    found = [
        r for r in caplog.records if re.search(rf"{endpoint} closed: [1-9]\d* of its last acknowledgement", r.message)
    ]
    assert [r.levelname for r in found] == ["INFO"], caplog.text
