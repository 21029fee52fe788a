"""ZmqConnector failure modes: killed and restarted receivers, gone peers, slow peers, hostile and oversized frames."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import DeliveryError, MessageTooLargeError, PeerGoneError, TransportTimeoutError
from zmq_omni.transport import probe
from zmq_omni.wire import encode

from .conftest import wait_until
from .zmq_peers import Item, expect, expected_digest, get_main, io_paused, put_main, resume_main, spawned

FAST = {"heartbeat_s": 0.1, "peer_timeout_s": 0.5}


def zmq_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("zmq-omni")]


@pytest.fixture
def connectors() -> Iterator[list[ZmqConnector]]:
    """Connectors made by a test; all closed at teardown, and no I/O thread may survive."""
    made: list[ZmqConnector] = []
    try:
        yield made
    finally:
        for conn in made:
            conn.close()
        assert zmq_threads() == []


def make(made: list[ZmqConnector], **config: Any) -> ZmqConnector:
    conn = ZmqConnector(config)
    made.append(conn)
    return conn


def test_receiver_killed_mid_stream_and_restarted_loses_nothing(short_tmp: Path) -> None:
    keys = [f"m{i}" for i in range(1000)]
    items: list[Item] = [("1", key, 2048, i) for i, key in enumerate(keys)]
    log_path = short_tmp / "consumed.log"
    recv_cfg = {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}}
    wants = [("0", key, None) for key in keys]
    with spawned(get_main, recv_cfg, wants, "1", 60.0, str(log_path), 0.002) as (victim, rq):
        (endpoint,) = expect(rq, "ready")
        send_cfg = {"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}, "delivery_timeout_s": 30.0, **FAST}
        with spawned(put_main, send_cfg, items, 1, "0", 45.0) as (_, sq):
            expect(sq, "ready")
            assert wait_until(lambda: log_path.exists() and len(log_path.read_text().split()) >= 300, 30)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            before = log_path.read_text().split()
            assert 300 <= len(before) < len(keys), "the kill must land mid-stream"
            restart_cfg = {**recv_cfg, "endpoints": {"1": endpoint}}
            with spawned(resume_main, restart_cfg, keys, before) as (_, rq2):
                expect(rq2, "ready")
                got, rhealth = expect(rq2, "done", timeout=90)
            assert rhealth["rejected_frames"] == 0
            (sent,) = expect(sq, "sent")
            failures, shealth = expect(sq, "done", timeout=90)
    assert all(ok for ok, _, _ in sent.values())
    assert set(got) | set(before) == set(keys), "every message arrives"
    for key, value in got.items():
        assert value == expected_digest(2048, int(key[1:]))
    duplicates = set(got) & set(before)
    # Only items the old receiver consumed in the instant before the kill may come twice.
    assert duplicates <= set(before[-50:]), sorted(duplicates)
    assert failures == [] and shealth["pending"] == 0
    assert shealth["resends"] > 0
    # The burst of 1,000 small puts coalesced: the loss-free restart above held for batched puts.
    assert shealth["batches_sent"] > 0 and rhealth["batches_received"] > 0


def test_receiver_closed_and_reopened_in_process_gets_each_message_once(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    endpoint = f"ipc://{short_tmp}/r.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, **FAST)
    keys = [f"k{i}" for i in range(200)]
    for i, key in enumerate(keys):
        assert sender.put("0", "1", key, {"i": i, "blob": np.full(100, i, dtype=np.int32)})[0]
    first = {}
    for key in keys[:100]:
        got = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 10)
        assert got is not None, key
        first[key] = got[0]["i"]
    receiver.close()
    reopened = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    second: dict[str, int] = {}

    def collect() -> bool:
        for key in keys:
            got = reopened.get("0", "1", key)
            if got is not None:
                assert key not in second, f"{key} delivered twice to the reopened receiver"
                second[key] = got[0]["i"]
        return set(second) >= set(keys[100:])

    assert wait_until(collect, 15), sorted(set(keys[100:]) - set(second))
    time.sleep(0.5)  # several heartbeats: a wrong resend of a consumed item would show up now
    collect()
    assert not set(second) & set(first), "consumed before close, delivered again after reopen"
    assert {**first, **second} == {key: i for i, key in enumerate(keys)}
    assert wait_until(lambda: sender.health()["pending"] == 0, 5)
    assert sender.drain_failures() == []


def test_receiver_that_never_comes_back_fails_every_outstanding_put(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    endpoint = f"ipc://{short_tmp}/gone.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, delivery_timeout_s=1.0, **FAST)
    keys = [f"k{i}" for i in range(20)]
    for key in keys:
        assert sender.put("0", "1", key, key)[0]
    for key in keys[:5]:
        assert receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 5) is not None
    assert wait_until(lambda: sender.health()["pending"] == 15, 5)
    receiver.close()  # gone for good, holding 15 unconsumed items
    start = time.monotonic()
    late = [f"late{i}" for i in range(5)]  # put while nobody listens
    for key in late:
        assert sender.put("0", "1", key, key)[0]
    failures: list[Any] = []
    bound = FAST["peer_timeout_s"] + 1.0 + 1.0  # silence detection + delivery_timeout_s + slack
    assert wait_until(lambda: bool(failures.extend(sender.drain_failures())) or len(failures) >= 20, bound + 2)
    elapsed = time.monotonic() - start
    assert sorted(f.key for f in failures) == sorted(keys[5:] + late)
    assert all(isinstance(f.error, DeliveryError) and f.op == "put" and f.to_stage == "1" for f in failures)
    assert elapsed <= bound + 1.0
    health = sender.health()
    assert health["pending"] == 0 and health["delivery_failures"] == 20 and health["errors"] == 20


def test_slow_receiver_bounds_the_window_and_put_times_out(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/slow.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    sender = make(
        connectors,
        stage_id="0",
        role="sender",
        endpoints={"1": endpoint},
        max_unacked=1000,
        max_unacked_bytes=8 << 20,
        put_timeout_s=0.3,
    )
    block = np.ones(1 << 20, dtype=np.uint8)
    results = [sender.put("0", "1", f"b{i}", {"block": block}) for i in range(12)]
    accepted = [r for r in results if r[0]]
    assert 1 <= len(accepted) <= 8, "the byte window admits at most 8 MiB of unconsumed puts"
    assert all(r == (False, 0, None) for r in results[len(accepted) :])
    health = sender.health()
    assert health["pending_bytes"] <= 8 << 20 + 4096
    assert health["timeouts"] == 12 - len(accepted) and health["errors"] == 0
    assert all(isinstance(f.error, TransportTimeoutError) for f in sender.drain_failures())
    # Consuming frees the window: the next put goes through.
    assert receiver.get_with_deadline("0", "1", "b0", deadline=time.monotonic() + 5) is not None
    assert wait_until(lambda: sender.put("0", "1", "again", {"block": block})[0], 5)


def test_close_with_peer_gone_is_prompt_and_leaves_no_thread(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    # Without its linger (close_timeout_s=0): what is left of close must be prompt.
    nobody = {"1": f"ipc://{short_tmp}/nobody.sock"}
    sender = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": nobody, "close_timeout_s": 0})
    for i in range(50):
        assert sender.put("0", "1", f"k{i}", np.zeros(100_000))[0]
    receiver = ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}})
    waiter_result: list[Any] = ["unset"]
    waiter = threading.Thread(
        target=lambda: waiter_result.__setitem__(
            0, receiver.get_with_deadline("0", "1", "never", deadline=time.monotonic() + 30)
        )
    )
    waiter.start()
    time.sleep(0.1)
    start = time.monotonic()
    sender.close()
    receiver.close()
    waiter.join(2)
    assert time.monotonic() - start < 1.0
    assert not waiter.is_alive() and waiter_result == [None]
    assert zmq_threads() == []


def test_hostile_frames_are_rejected_and_counted(
    connectors: list[ZmqConnector], short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    endpoint = f"ipc://{short_tmp}/h.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    from zmq_omni.transport._envelope import Kind, pack

    good_wire = encode({"x": 1})[0]
    hostile: list[list[bytes]] = [
        [b""],
        [b"garbage"],
        [b"ZT\x01\x01\xff\xff\xff\xff"],  # header length beyond the frame
        [b"XX" + pack(Kind.PING, ("s", 1, 0))[2:]],  # bad magic
        [pack(Kind.PING, ("s", 1, 0))[:3] + b"\x63" + pack(Kind.PING, ("s", 1, 0))[4:]],  # unknown kind 99
        [pack(Kind.PING, ("s", 1, 0))[:2] + b"\x09" + pack(Kind.PING, ("s", 1, 0))[3:]],  # unknown version 9
        [pack(Kind.DATA, ("sid", "not-int", 0, "0", "1", "k", None), good_wire)],  # wrong field type
        [pack(Kind.DATA, ("sid", 0, 0, "0", "1", "k", None), b"\x00" * 40)],  # not a wire encoding
        [pack(Kind.DATA, ("sid", 1, 0, "0", "1", "k", {"shm": 1}), good_wire)],  # unknown location table
        [pack(Kind.DATA, ("x" * 500, 2, 0, "0", "1", "k", None), good_wire)],  # absurd sender id
        [pack(Kind.REPLY, ("inc", -1, [], []))],  # a kind the receiver never accepts
        [pack(Kind.DATA, ("sid", 3, 0, "0", "1", "k", None), encode({"a": np.zeros(8192)})[0])],  # frame missing
    ]
    attacker = zmq_ctx.socket(zmq.DEALER)
    attacker.connect(endpoint)
    for frames in hostile:
        attacker.send_multipart(frames)
    attacker.close(linger=1000)
    assert wait_until(lambda: receiver.health()["rejected_frames"] == len(hostile), 5), receiver.health()
    assert receiver.get("0", "1", "k") is None
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint})
    assert sender.put("0", "1", "fine", {"ok": True})[0]
    got = receiver.get_with_deadline("0", "1", "fine", deadline=time.monotonic() + 5)
    assert got is not None and got[0] == {"ok": True}
    assert probe(endpoint)["rejected_frames"] == len(hostile)


def test_an_ack_to_a_sender_not_yet_routable_is_said_again_in_the_next_reply(
    connectors: list[ZmqConnector], short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    """A sender's first REPLY can go out before its control socket connected: its arrivals must not vanish.

    A pong reports arrivals only since the last REPLY, and a sender resends whatever it never heard
    arrived: a dropped arrival ack would cost a resend of every such put (all of a large payload).
    Raw sockets speak the protocol here, so the control socket connects exactly when the test says.
    """
    from zmq_omni.transport._envelope import Kind, pack, unpack

    endpoint = f"ipc://{short_tmp}/a.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint}, ack_delay_s=0.001)
    data = zmq_ctx.socket(zmq.DEALER)  # the sender's data socket; its control socket is not there yet
    data.connect(endpoint)
    data.send(pack(Kind.DATA, ("x", 0, 0, "0", "1", "k0", None), encode({"v": 1})[0]))
    assert wait_until(lambda: receiver.health()["acks_dropped"] >= 1, 10), receiver.health()  # the arrival ack
    assert receiver.health()["mailbox"] == 1
    ctl = zmq_ctx.socket(zmq.DEALER)
    ctl.setsockopt(zmq.ROUTING_ID, b"cx")  # the routing identity a sender's control socket has
    ctl.connect(endpoint)
    pong: list[Any] | None = None
    deadline = time.monotonic() + 10
    ping = 0
    while pong is None and time.monotonic() < deadline:  # pings until the control socket is routable
        ping += 1
        data.send(pack(Kind.PING, ("x", ping, 0)))
        while ctl.poll(100):
            kind, header, _ = unpack(ctl.recv())
            if kind is Kind.REPLY and header[1] >= 0:
                pong = header
    assert pong is not None, receiver.health()
    assert pong[2] == [[0, 0]], pong  # the dropped ack's arrival, in the first REPLY that could go out
    got = receiver.get("0", "1", "k0")
    assert got is not None and got[0] == {"v": 1}
    for sock in (data, ctl):
        sock.close(linger=0)


def test_oversized_messages_are_rejected_and_reported(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/o.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint}, max_message_bytes=64 << 10)
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, delivery_timeout_s=1.0, **FAST)
    small = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, max_message_bytes=64 << 10)
    # The sender's own bound: refused at once.
    assert small.put("0", "1", "big", np.zeros(1 << 20, dtype=np.uint8)) == (False, 0, None)
    (failure,) = small.drain_failures()
    assert isinstance(failure.error, MessageTooLargeError)
    # The receiver's bound (MAXMSGSIZE): never delivered, reported by the delivery deadline.
    assert sender.put("0", "1", "big", np.zeros(1 << 20, dtype=np.uint8))[0]
    failures: list[Any] = []
    assert wait_until(lambda: bool(failures.extend(sender.drain_failures())) or bool(failures), 5)
    assert [f.key for f in failures] == ["big"] and isinstance(failures[0].error, DeliveryError)
    assert receiver.get("0", "1", "big") is None
    assert sender.put("0", "1", "after", b"small")[0]
    got = receiver.get_with_deadline("0", "1", "after", deadline=time.monotonic() + 5)
    assert got is not None and got[0] == b"small"


def test_probe_answers_with_health_and_reports_a_missing_stage(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": "tcp://127.0.0.1:0"})
    assert receiver.endpoint is not None
    health = probe(receiver.endpoint)
    assert health["stage_id"] == "1" and health["status"] == "ok"
    with pytest.raises(PeerGoneError, match="nothing is listening"):
        probe(f"ipc://{short_tmp}/absent.sock", timeout_s=0.3)


def test_malformed_batches_are_rejected_one_by_one_and_the_receiver_keeps_working(
    connectors: list[ZmqConnector], short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    endpoint = f"ipc://{short_tmp}/b.sock"
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": endpoint})
    from zmq_omni.transport._envelope import Kind, pack

    wire = encode({"x": 1})[0]
    entry = [0, "0", "k", wire]
    whole: list[bytes] = [  # each rejected as a whole: nothing of it reaches the mailbox
        pack(Kind.BATCH, ("sid", 0, "1", entry)),  # one put is not a batch
        pack(Kind.BATCH, ("sid", 0, "1", [*entry, 1, "0", "k2"])),  # not whole entries
        pack(Kind.BATCH, ("sid", 0, "1", [*entry, "1", "0", "k2", wire])),  # seq is not an int
        pack(Kind.BATCH, ("sid", 0, "1", [*entry, 1, "0", "k2", "not-bytes"])),  # wire is not bin
        pack(Kind.BATCH, ("sid", 0, "1", [*entry, 1, "0", "k2", wire]), b"trailing"),  # payload after header
        pack(Kind.BATCH, ("sid", 0, 1, [*entry, 1, "0", "k2", wire])),  # to_stage is not a str
        pack(Kind.BATCH, ("x" * 500, 0, "1", [*entry, 1, "0", "k2", wire])),  # absurd sender id
        pack(Kind.BATCH, ("sid", 0, "1", {"entries": 1})),  # not a list
    ]
    # Well-formed, but its middle put is not a wire encoding: only that put is rejected.
    mixed = pack(Kind.BATCH, ("sid", 0, "1", [0, "0", "a", wire, 1, "0", "bad", b"\x00" * 40, 2, "0", "c", wire]))
    attacker = zmq_ctx.socket(zmq.DEALER)
    attacker.connect(endpoint)
    for frame in whole:
        attacker.send(frame)
    attacker.send(mixed)
    attacker.close(linger=1000)
    assert wait_until(lambda: receiver.health()["rejected_frames"] == len(whole) + 1, 5), receiver.health()
    assert receiver.get("0", "1", "k") is None and receiver.get("0", "1", "k2") is None
    assert receiver.get("0", "1", "bad") is None
    assert receiver.get("0", "1", "a") == ({"x": 1}, len(wire))
    assert receiver.get("0", "1", "c") == ({"x": 1}, len(wire))
    # The I/O thread survived: a real sender's batched burst still arrives, every put exactly once.
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint})
    assert sender.put("0", "1", "first", 0)[0]
    assert receiver.get_with_deadline("0", "1", "first", deadline=time.monotonic() + 5) is not None
    assert wait_until(lambda: sender.health()["pending"] == 0, 5)  # the receiver's REPLY (batch limit) is in
    with io_paused(sender):  # the burst queues up, so it must leave in batches whatever the scheduling
        for i in range(500):
            assert sender.put("0", "1", f"n{i}", {"i": i})[0]
    for i in range(500):
        got = receiver.get_with_deadline("0", "1", f"n{i}", deadline=time.monotonic() + 5)
        assert got is not None and got[0] == {"i": i}
    assert wait_until(lambda: sender.health()["pending"] == 0, 5)
    assert sender.health()["batches_sent"] > 0
    assert receiver.health()["rejected_frames"] == len(whole) + 1 and receiver.health()["mailbox"] == 0


def test_ack_ranges_are_validated_without_expanding_them() -> None:
    from zmq_omni.errors import DecodeError
    from zmq_omni.transport._envelope import check_ranges, from_ranges, to_ranges

    assert check_ranges([[0, 2], [5, 5]], 4) == [range(0, 3), range(5, 6)]
    assert from_ranges(to_ranges([7, 1, 2, 3, 9]), 5) == [1, 2, 3, 7, 9]
    huge = [[0, 10**12]]  # a hostile ack naming a trillion seqs is refused before anything is built
    for bad in (huge, [[3, 1]], [[-1, 2]], [[0, True]], [[0]], "x", [[0, 1], [2, 3]]):
        with pytest.raises(DecodeError):
            check_ranges(bad, 3)


def test_pull_server_bounds_the_long_polls_it_parks(
    connectors: list[ZmqConnector], short_tmp: Path, zmq_ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fetcher flooding long polls for keys that never come (a bug, or an attack) gets "not found" at once
    # beyond the bound, instead of making the server hold every one of them for up to an hour.
    from zmq_omni.transport import _pull_server
    from zmq_omni.transport._envelope import Kind, pack, unpack

    monkeypatch.setattr(_pull_server, "_MAX_PARKED", 100)
    endpoints = {"0": f"ipc://{short_tmp}/park.sock"}
    sender = make(connectors, stage_id="0", role="sender", mode="pull", endpoints=endpoints)
    flooder = zmq_ctx.socket(zmq.DEALER)
    flooder.connect(endpoints["0"])
    try:
        for i in range(150):
            flooder.send(pack(Kind.FETCH, (i, "0", "1", f"never{i}", 3_600_000)))
        answered = []
        while len(answered) < 50 and flooder.poll(10_000):
            kind, header, _ = unpack(flooder.recv())
            assert kind is Kind.FETCH_REPLY and header[1] is False
            answered.append(header[0])
        assert sorted(answered) == list(range(100, 150))  # the first 100 are parked, the rest refused
        assert not flooder.poll(200)
        assert sender.health()["fetches_not_parked"] == 50
        # The parked ones are still served: a put of one of their keys answers it.
        assert sender.put("0", "1", "never7", {"n": 7})[0]
        assert flooder.poll(10_000)
        frames = flooder.recv_multipart()
        kind, header, _ = unpack(frames[0])
        assert kind is Kind.FETCH_REPLY and header[:2] == [7, True]
        # Room again: one more long poll is parked, not refused.
        flooder.send(pack(Kind.FETCH, (999, "0", "1", "later", 3_600_000)))
        assert not flooder.poll(300)
        assert sender.health()["fetches_not_parked"] == 50
    finally:
        flooder.close(linger=0)


@pytest.mark.parametrize("how", ["try_put", "timeout"])
def test_a_pull_connector_whose_stores_failed_is_collectable_once_closed(
    connectors: list[ZmqConnector], short_tmp: Path, how: str
) -> None:
    # Two connectors of one process share one pull server; the store is full, so the second one's puts fail.
    # The server keeps nothing of a store that failed: once closed, that connector is garbage (no registry
    # entry of the server's, nor of the endpoint the other connector still holds, pins it).
    spec = {
        "stage_id": "0",
        "role": "sender",
        "mode": "pull",
        "endpoints": {"0": f"ipc://{short_tmp}/owners.sock"},
        "max_unacked": 1,
        "put_timeout_s": 0.05,
        "close_timeout_s": 0.1,
    }
    keeper = make(connectors, **spec)
    assert keeper.put("0", "1", "held", {"n": 0})[0]
    failing = ZmqConnector(spec)
    for i in range(200):
        if how == "try_put":
            assert failing.try_put("0", "1", f"k{i}", {"n": i}) is None
        elif i < 3:  # each one waits put_timeout_s
            assert failing.put("0", "1", f"k{i}", {"n": i})[0] is False
    assert keeper.health()["pending"] == 1  # the failed stores kept nothing
    failing.close()
    gone = weakref.ref(failing)
    del failing
    gc.collect()
    assert gone() is None
    # The server still serves the payload of the connector that holds it.
    receiver = make(connectors, stage_id="1", role="receiver", mode="pull", endpoints=spec["endpoints"])
    got = receiver.get_with_deadline("0", "1", "held", deadline=time.monotonic() + 10)
    assert got is not None and got[0] == {"n": 0}
