"""ZmqConnector between real processes: tcp and ipc, push and pull, few bytes to 256 MiB, fan-in, fan-out."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .zmq_peers import Item, expect, expected_digest, get_main, io_paused, put_main, spawned

SIZES = [7, 4095, 65536, 3 << 20]


def endpoint_for(transport: str, tmp: Path, name: str) -> str:
    return f"ipc://{tmp}/{name}.sock" if transport == "ipc" else "tcp://127.0.0.1:0"


def base(stage: str, role: str, mode: str = "push", **extra: Any) -> dict[str, Any]:
    return {"stage_id": stage, "role": role, "mode": mode, "delivery_timeout_s": 30.0, **extra}


def assert_all_exact(results: dict[str, str | None], items: list[Item]) -> None:
    for _, key, size, seed in items:
        assert results[key] == expected_digest(size, seed), f"{key} ({size} B) not bit-exact"


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_push_between_processes_is_bit_exact(transport: str, short_tmp: Path) -> None:
    items: list[Item] = [("1", f"k{size}", size, i) for i, size in enumerate(SIZES)]
    recv_cfg = base("1", "receiver", endpoints={"1": endpoint_for(transport, short_tmp, "s1")})
    wants = [("0", key, None) for _, key, _, _ in items]
    with spawned(get_main, recv_cfg, wants) as (_, rq):
        (endpoint,) = expect(rq, "ready")
        with spawned(put_main, base("0", "sender", endpoints={"1": endpoint}), items) as (_, sq):
            expect(sq, "ready")
            (sent,) = expect(sq, "sent")
            assert all(ok for ok, _, _ in sent.values())
            results, rhealth = expect(rq, "done")
            failures, shealth = expect(sq, "done")
    assert_all_exact(results, items)
    assert failures == []
    assert shealth["pending"] == 0 and shealth["puts"] == len(items)
    assert rhealth["gets"] == len(items) and rhealth["rejected_frames"] == 0
    assert rhealth["bytes_received"] == sum(nbytes for _, nbytes, _ in sent.values())


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_pull_between_processes_by_metadata_and_by_key(transport: str, short_tmp: Path) -> None:
    items: list[Item] = [("1", f"k{size}", size, i) for i, size in enumerate(SIZES)]
    send_cfg = base("0", "sender", "pull", endpoints={"0": endpoint_for(transport, short_tmp, "s0")})
    with spawned(put_main, send_cfg, items) as (_, sq):
        (endpoint,) = expect(sq, "ready")
        (sent,) = expect(sq, "sent")
        # Half the keys are fetched with put's metadata, half by key alone via endpoints[from_stage].
        wants = [("0", key, sent[key][2] if i % 2 else None) for i, (_, key, _, _) in enumerate(items)]
        assert all(sent[key][2]["endpoint"] == endpoint for _, key, _ in wants)
        recv_cfg = base("1", "receiver", "pull", endpoints={"0": endpoint})
        with spawned(get_main, recv_cfg, wants) as (_, rq):
            expect(rq, "ready")
            results, rhealth = expect(rq, "done")
        failures, shealth = expect(sq, "done")
    assert_all_exact(results, items)
    assert failures == [] and shealth["pending"] == 0
    assert rhealth["gets"] == len(items)


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "mode"), [("tcp", "push"), ("ipc", "pull")])
def test_256_mib_payload_is_bit_exact(transport: str, mode: str, short_tmp: Path) -> None:
    size = 256 << 20
    items: list[Item] = [("1", "big", size, 42)]
    if mode == "push":
        recv_cfg = base("1", "receiver", endpoints={"1": endpoint_for(transport, short_tmp, "s1")})
        with spawned(get_main, recv_cfg, [("0", "big", None)]) as (_, rq):
            (endpoint,) = expect(rq, "ready")
            with spawned(put_main, base("0", "sender", endpoints={"1": endpoint}), items) as (_, sq):
                expect(sq, "ready")
                expect(sq, "sent")
                results, _ = expect(rq, "done", timeout=90)
                failures, _ = expect(sq, "done", timeout=90)
    else:
        send_cfg = base("0", "sender", mode, endpoints={"0": endpoint_for(transport, short_tmp, "s0")})
        with spawned(put_main, send_cfg, items) as (_, sq):
            (endpoint,) = expect(sq, "ready")
            (sent,) = expect(sq, "sent")
            recv_cfg = base("1", "receiver", mode, endpoints={"0": endpoint})
            with spawned(get_main, recv_cfg, [("0", "big", sent["big"][2])]) as (_, rq):
                expect(rq, "ready")
                results, rhealth = expect(rq, "done", timeout=90)
            failures, shealth = expect(sq, "done", timeout=90)
            assert results["big"] is not None, str(rhealth) + str(shealth)
    assert results["big"] == expected_digest(size, 42)
    assert failures == []


def test_fan_in_two_sender_processes_one_receiver(short_tmp: Path) -> None:
    per_sender = 60
    plan = {
        stage: [("2", f"s{stage}_{i}", 100 + 997 * i, 1000 * int(stage) + i) for i in range(per_sender)]
        for stage in ("0", "1")
    }
    wants = [(stage, key, None) for stage, items in plan.items() for _, key, _, _ in items]
    recv_cfg = base("2", "receiver", endpoints={"2": f"ipc://{short_tmp}/s2.sock"})
    with spawned(get_main, recv_cfg, wants, "2") as (_, rq):
        (endpoint,) = expect(rq, "ready")
        cfg = {stage: base(stage, "sender", endpoints={"2": endpoint}) for stage in plan}
        with (
            spawned(put_main, cfg["0"], plan["0"], 3, "0") as (_, q0),
            spawned(put_main, cfg["1"], plan["1"], 3, "1") as (_, q1),
        ):
            for queue in (q0, q1):
                expect(queue, "ready")
                (sent,) = expect(queue, "sent")
                assert all(ok for ok, _, _ in sent.values())
            results, _ = expect(rq, "done")
            outcomes = [expect(queue, "done") for queue in (q0, q1)]
    for items in plan.values():
        assert_all_exact(results, items)
    assert all(failures == [] and health["pending"] == 0 for failures, health in outcomes)


def test_fan_out_one_sender_two_receiver_stages(short_tmp: Path) -> None:
    items: list[Item] = [(stage, f"to{stage}_{i}", 50 + 4099 * i, i) for i in range(40) for stage in ("1", "2")]
    with (
        spawned(
            get_main,
            base("1", "receiver", endpoints={"1": "tcp://127.0.0.1:0"}),
            [("0", key, None) for st, key, _, _ in items if st == "1"],
            "1",
        ) as (_, r1),
        spawned(
            get_main,
            base("2", "receiver", endpoints={"2": f"ipc://{short_tmp}/s2.sock"}),
            [("0", key, None) for st, key, _, _ in items if st == "2"],
            "2",
        ) as (_, r2),
    ):
        endpoints = {"1": expect(r1, "ready")[0], "2": expect(r2, "ready")[0]}
        with spawned(put_main, base("0", "sender", endpoints=endpoints), items, 4) as (_, sq):
            expect(sq, "ready")
            expect(sq, "sent")
            results = {**expect(r1, "done")[0], **expect(r2, "done")[0]}
            failures, health = expect(sq, "done")
    assert_all_exact(results, items)
    assert failures == [] and health["pending"] == 0 and len(health["peers"]) == 2


def test_no_thread_outlives_a_test_of_this_module() -> None:
    # The peers run in other processes; this process must not have grown any zmq_omni thread.
    assert not [t for t in threading.enumerate() if t.name.startswith("zmq-omni")]


def test_a_lone_put_is_sent_at_once_and_a_burst_is_batched(short_tmp: Path) -> None:
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoint = f"ipc://{short_tmp}/lone.sock"
    with (
        ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}}) as receiver,
        ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}}) as sender,
    ):
        assert sender.put("0", "1", "hello", 1)[0]  # the receiver's first ack announces its batch limit
        assert receiver.get_with_deadline("0", "1", "hello", deadline=time.monotonic() + 5) is not None
        assert wait_for_empty(sender)  # its REPLY, which announces the batch limit, has been read
        with io_paused(sender):  # a burst: puts arrive while the I/O thread is busy, so they queue
            for i in range(2000):
                assert sender.put("0", "1", f"b{i}", {"i": i})[0]
        for i in range(2000):
            got = receiver.get_with_deadline("0", "1", f"b{i}", deadline=time.monotonic() + 10)
            assert got is not None and got[0] == {"i": i}
        assert sender.health()["batches_sent"] > 0 and receiver.health()["batches_received"] > 0
        for n in range(3):
            time.sleep(0.2)  # idle: nothing in progress or queued
            start = time.monotonic()
            assert sender.put("0", "1", f"lone{n}", {"n": n})[0]
            got = receiver.get_with_deadline("0", "1", f"lone{n}", deadline=start + 5)
            # Generous bound: a lone put must not wait for a batch to fill or a timer to fire.
            assert got is not None and got[0] == {"n": n}
            assert time.monotonic() - start < 0.5


def test_wait_for_change_wakes_on_arrival_and_times_out_otherwise(short_tmp: Path) -> None:
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoint = f"ipc://{short_tmp}/wake.sock"
    with (
        ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}}) as receiver,
        ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}}) as sender,
    ):
        assert sender.get_wakeup_generation() is None  # nothing arrives at a sender: no wakeups offered
        gen = receiver.get_wakeup_generation()
        assert isinstance(gen, int)
        start = time.monotonic()
        assert receiver.wait_for_change(gen, timeout=0.2) == gen  # nothing arrived
        assert time.monotonic() - start >= 0.19
        woken: list[tuple[int, float]] = []
        waiter = threading.Thread(
            target=lambda: woken.append((receiver.wait_for_change(gen, timeout=10.0), time.monotonic()))
        )
        waiter.start()
        time.sleep(0.1)
        put_at = time.monotonic()
        assert sender.put("0", "1", "k", "v")[0]
        waiter.join(10)
        assert not waiter.is_alive()
        (new_gen, woke_at) = woken[0]
        assert new_gen != gen and woke_at - put_at < 5.0  # woken by the arrival, not the 10 s timeout
        got = receiver.get("0", "1", "k")
        assert got is not None and got[0] == "v"
        # A generation taken after the arrival does not report it again.
        assert receiver.wait_for_change(receiver.get_wakeup_generation(), timeout=0.05) == new_gen
        closer = threading.Timer(0.1, receiver.close)
        closer.start()
        start = time.monotonic()
        receiver.wait_for_change(new_gen, timeout=10.0)  # close() ends the wait
        assert time.monotonic() - start < 5.0
        closer.join()


def test_puts_queued_while_a_flush_is_armed_ride_along_without_waking_the_io_thread(short_tmp: Path) -> None:
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoint = f"ipc://{short_tmp}/stream.sock"
    with (
        ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}}) as receiver,
        ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}}) as sender,
    ):
        assert sender.put("0", "1", "hello", 1)[0]  # the receiver's first ack announces its batch limit
        assert receiver.get_with_deadline("0", "1", "hello", deadline=time.monotonic() + 5) is not None
        assert wait_for_empty(sender)
        loop = sender.driver
        assert loop is not None
        wakes = [0]
        wake = loop.wake

        def counting_wake() -> None:
            wakes[0] += 1
            wake()

        n = 3000
        # While the I/O thread is busy, the flush the first queued put armed stays armed: whatever the
        # scheduling (a put may still leave alone, or fill a batch and send it itself), no later put of the
        # burst wakes the I/O thread again. (Timing-free: counting wake-ups of a free-running stream
        # measured the machine's load, and failed on a busy CI runner.)
        with io_paused(sender):
            loop.wake = counting_wake  # type: ignore[method-assign]
            for i in range(n):
                assert sender.put("0", "1", f"s{i}", {"i": i, "pad": b"x" * 100})[0]
            during_burst = wakes[0]
            loop.wake = wake  # type: ignore[method-assign]
        assert during_burst <= 1, during_burst
        for i in range(n):
            got = receiver.get_with_deadline("0", "1", f"s{i}", deadline=time.monotonic() + 10)
            assert got is not None and got[0]["i"] == i
        assert sender.health()["batches_sent"] < n // 2
        assert sender.health()["pending"] == 0 or wait_for_empty(sender)


def wait_for_empty(sender: Any) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sender.health()["pending"] == 0:
            return True
        time.sleep(0.02)
    return False
