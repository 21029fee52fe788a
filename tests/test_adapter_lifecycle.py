"""The adapters over weeks: nothing hangs past shutdown, no failure reaches the wrong owner, state is bounded.

Real in-process connectors and real threads (issue 13, adapters side).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.adapter_helpers import FAST_RETRY, FlakyConnector, chunk_pair, rid
from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ClosedResourceError
from zmq_omni.stages._link import _Endpoint


def _join(thread: threading.Thread, timeout: float) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


# -- 1. save() never hangs past shutdown(); nothing is accepted after it -----------------------------------------
def test_save_without_timeout_returns_when_the_manager_shuts_down() -> None:
    with chunk_pair(flaky=True) as ((sender, _), (conn0, _)):
        request = rid()
        conn0.gate.clear()  # the link stalls: chunk 0 is inside put, the rest stay queued
        try:
            assert sender.save_async(request, {"n": [0]}) == 0
            results: dict[str, bool] = {}

            def blocking_save(name: str, final: bool) -> None:
                results[name] = sender.save(request, {"n": [1]}, is_final=final, timeout_s=None)

            waiters = [threading.Thread(target=blocking_save, args=("queued", False), daemon=True)]
            waiters[0].start()
            while sender.pending_state()["queued"] < 1:
                time.sleep(0.01)
            waiters.append(threading.Thread(target=blocking_save, args=("final", True), daemon=True))
            waiters[1].start()
            while sender.pending_state()["queued"] < 2:
                time.sleep(0.01)
            sender.shutdown()
            # Every pending save completes or fails once shutdown() returned: none is left waiting.
            assert all(_join(t, 3.0) for t in waiters), "save(timeout_s=None) still waiting after shutdown()"
            assert results == {"queued": False, "final": False}
            assert sender.pending_state()["queued"] == 0
            # ...and the scheduler learns why.
            failed = sender.collect_failed_send_request_ids()
            assert "shut down" in failed[request]
        finally:
            conn0.gate.set()


def test_the_save_in_flight_at_shutdown_is_released_too() -> None:
    with chunk_pair(flaky=True) as ((sender, _), (conn0, _)):
        conn0.gate.clear()  # the put inside the save thread blocks (up to 10 s) past the shutdown grace
        try:
            result: list[bool] = []
            waiter = threading.Thread(target=lambda: result.append(sender.save(rid(), {"n": [0]})), daemon=True)
            waiter.start()
            while not conn0.put_calls and sender.pending_state()["queued"]:
                time.sleep(0.01)
            time.sleep(0.05)
            sender.shutdown()
            assert _join(waiter, 3.0), "save() of the chunk being put still waiting after shutdown()"
            assert result == [False]
        finally:
            conn0.gate.set()


class ExplodingGets(FlakyConnector):
    """A connector whose get raises a programming error: the receive worker dies on it."""

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None) -> Any:
        raise RuntimeError("a connector bug")


def test_a_crashed_worker_releases_every_waiting_save_at_once() -> None:
    conn = ExplodingGets({"namespace": f"crash-{uuid.uuid4().hex}", "stage_id": "1"})
    manager = OmniChunkManager(ChunkManagerConfig(stage_id="1", retry=FAST_RETRY), conn)
    try:
        conn.gate.clear()
        request = rid()
        assert manager.save_async(request, {"n": [0]}) == 0
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(manager.save(request, {"n": [1]})), daemon=True)
        waiter.start()
        while manager.pending_state()["queued"] < 1:
            time.sleep(0.01)
        manager.load_async(rid())  # the receive worker calls get and dies
        assert _join(waiter, 3.0), "save() still waiting after the adapter's worker crashed"
        assert result == [False]
        assert "crashed" in manager.collect_failed_send_request_ids()[request]
        with pytest.raises(ClosedResourceError):
            manager.save_async(rid(), {"n": [0]})
    finally:
        conn.gate.set()
        manager.shutdown()
        conn.close()


def test_nothing_is_accepted_after_shutdown() -> None:
    with chunk_pair() as ((sender, receiver), _):
        sender.shutdown()
        receiver.shutdown()
        with pytest.raises(ClosedResourceError):
            sender.save_async(rid(), {"n": [0]})
        with pytest.raises(ClosedResourceError):
            sender.save(rid(), {"n": [0]}, timeout_s=None)
        with pytest.raises(ClosedResourceError):
            receiver.load_async(rid())
        assert sender.pending_state() == {"sending": 0, "receiving": 0, "queued": 0, "parked": 0}
        assert receiver.pending_state() == {"sending": 0, "receiving": 0, "queued": 0, "parked": 0}


# -- 2. a connector failure reaches the owner of its key, whichever consumer drains the connector first ----------
@pytest.fixture
def endpoint() -> Iterator[tuple[_Endpoint, FlakyConnector]]:
    namespace = f"link-{uuid.uuid4().hex}"
    inbound = InProcConnector({"namespace": namespace, "stage_id": "0"})
    outbound = FlakyConnector({"namespace": namespace, "stage_id": "0"})
    link = _Endpoint(
        stage_id="0",
        upstream_stage_id="driver",
        downstream_stage_id="1",
        inbound=inbound,
        outbound=outbound,
        stall_timeout_s=5.0,
        retry=FAST_RETRY,
        label="test",
    )
    try:
        yield link, outbound
    finally:
        link.close()


def _announce_failure(link: _Endpoint, timeout: float = 5.0) -> tuple[str, str]:
    return link.announce_failures.get(timeout=timeout)


def test_an_announcement_failure_does_not_swallow_another_requests_delivery_failure(
    endpoint: tuple[_Endpoint, FlakyConnector],
) -> None:
    link, outbound = endpoint
    streaming, unannounced = rid(), rid()
    # The chunk of one request is "put" but its delivery is never confirmed: the
    # connector keeps a DeliveryError-like failure for that key...
    outbound.lost.add(link.chunks.send_key(streaming, 0))
    assert link.chunks.save(streaming, {"n": [0]}, is_final=True, timeout_s=5.0)
    # ...then the announcement of another request fails, and the announcer looks
    # at the connector's failures for its own key.
    outbound.fail_puts["_zo_req_0_0"] = 100
    link.announce(unannounced)
    assert _announce_failure(link)[0] == unannounced
    # The first request's failure still reaches its owner, the chunk manager.
    failed = link.chunks.collect_failed_send_request_ids()
    assert streaming in failed and "delivery never confirmed" in failed[streaming]
    assert unannounced not in failed


def test_a_late_announcement_failure_reaches_the_announcer_not_the_chunk_manager(
    endpoint: tuple[_Endpoint, FlakyConnector],
) -> None:
    link, outbound = endpoint
    request = rid()
    outbound.lost.add("_zo_req_0_0")  # put returns ok, delivery fails later
    link.announce(request)
    deadline = time.monotonic() + 5.0
    while "_zo_req_0_0" not in outbound.put_calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The chunk manager drains the connector every scheduler step: the announcement's
    # failure must come back as that request's announcement failure, not as an
    # unattributed send failure.
    failed = link.chunks.collect_failed_send_request_ids()
    assert failed == {}
    assert link.chunks.counters.snapshot().get("unattributed_send_failures", 0) == 0
    failed_request, reason = _announce_failure(link)
    assert failed_request == request and "delivery never confirmed" in reason


# -- 3. the save queue is bounded; per-request state ages out ---------------------------------------------------
def _manager(conn: InProcConnector, stage: str, **config: Any) -> OmniChunkManager:
    return OmniChunkManager(ChunkManagerConfig(stage_id=stage, retry=FAST_RETRY, **config), conn)


@pytest.fixture
def namespace_pair() -> Iterator[tuple[FlakyConnector, InProcConnector]]:
    namespace = f"bound-{uuid.uuid4().hex}"
    conn0 = FlakyConnector({"namespace": namespace, "stage_id": "0"})
    conn1 = InProcConnector({"namespace": namespace, "stage_id": "1"})
    try:
        yield conn0, conn1
    finally:
        conn0.gate.set()
        conn0.close()
        conn1.close()


def test_a_full_save_queue_pushes_back_then_fails_the_request_it_cannot_take(
    namespace_pair: tuple[FlakyConnector, InProcConnector],
) -> None:
    conn0, _ = namespace_pair
    sender = _manager(conn0, "0", max_queued_chunks=4, queue_full_timeout_s=0.5)

    def fill(request: str) -> None:
        conn0.gate.clear()  # the link stalls: chunk 0 is inside put, the next four fill the queue
        assert sender.save_async(request, {"n": [0]}) == 0
        while sender.pending_state()["queued"]:
            time.sleep(0.01)
        for n in range(1, 5):
            assert sender.save_async(request, {"n": [n]}) == n
        assert sender.pending_state()["queued"] == 4

    try:
        # Room made while a save_async waits is taken: the call is backpressure, not a failure.
        streaming = rid()
        fill(streaming)
        opener = threading.Timer(0.1, conn0.gate.set)
        opener.start()
        assert sender.save_async(streaming, {"n": [5]}, is_final=True) == 5
        opener.join()
        deadline = time.monotonic() + 5.0
        while sender.pending_state()["sending"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # No room in time: the chunk is refused and its request fails (a stream cannot
        # have a hole); the queue never grew past the bound.
        stuck = rid()
        fill(stuck)
        assert sender.save_async(stuck, {"n": [5]}) is None
        assert sender.pending_state()["queued"] <= 4
        failed = sender.collect_failed_send_request_ids()
        assert "save queue full" in failed[stuck] and streaming not in failed
    finally:
        conn0.gate.set()
        sender.shutdown()


def test_health_is_degraded_while_the_save_queue_is_nearly_full(
    namespace_pair: tuple[FlakyConnector, InProcConnector],
) -> None:
    conn0, _ = namespace_pair
    sender = _manager(conn0, "0", max_queued_chunks=4)
    try:
        assert sender.health()["status"] == "ok"
        conn0.gate.clear()
        request = rid()
        assert sender.save_async(request, {"n": [0]}) == 0
        while sender.pending_state()["queued"]:
            time.sleep(0.01)
        for n in range(1, 4):
            sender.save_async(request, {"n": [n]}, is_final=n == 3)
        health = sender.health()
        assert health["status"] == "degraded" and health["reasons"] == ["save queue 3/4 full"]
        conn0.gate.set()
        deadline = time.monotonic() + 5.0
        while sender.pending_state()["sending"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sender.health()["status"] == "ok"
    finally:
        conn0.gate.set()
        sender.shutdown()


def test_a_save_waiting_for_room_ends_when_its_request_is_cancelled_or_the_manager_stops(
    namespace_pair: tuple[FlakyConnector, InProcConnector],
) -> None:
    conn0, _ = namespace_pair
    sender = _manager(conn0, "0", max_queued_chunks=2, queue_full_timeout_s=60.0)
    try:
        conn0.gate.clear()
        cancelled, stopped = rid(), rid()
        assert sender.save_async(cancelled, {"n": [0]}) == 0
        while sender.pending_state()["queued"]:
            time.sleep(0.01)
        assert sender.save_async(cancelled, {"n": [1]}) == 1
        assert sender.save_async(stopped, {"n": [0]}) == 0
        results: dict[str, Any] = {}

        def wait_for_room(request: str) -> None:
            try:
                results[request] = sender.save_async(request, {"n": [9]})
            except ClosedResourceError as exc:
                results[request] = exc

        waiters = {r: threading.Thread(target=wait_for_room, args=(r,), daemon=True) for r in (cancelled, stopped)}
        for waiter in waiters.values():
            waiter.start()
        time.sleep(0.1)
        assert not results  # both wait: the queue is full
        sender.cancel(cancelled)
        assert _join(waiters[cancelled], 5.0) and results[cancelled] is None
        sender.shutdown()
        assert _join(waiters[stopped], 5.0) and isinstance(results[stopped], ClosedResourceError)
    finally:
        conn0.gate.set()
        sender.shutdown()


def test_a_stream_the_scheduler_abandoned_ages_out_and_is_reported(
    namespace_pair: tuple[FlakyConnector, InProcConnector],
) -> None:
    conn0, conn1 = namespace_pair
    sender = _manager(conn0, "0", idle_state_timeout_s=0.3)
    receiver = _manager(conn1, "1", idle_state_timeout_s=0.3)
    try:
        abandoned = rid()
        receiver.load_async(abandoned)
        assert sender.save(abandoned, {"n": [0]}, is_final=False, timeout_s=5.0)
        # Nothing more is ever queued and release() is never called.
        deadline = time.monotonic() + 5.0
        failed: dict[str, str] = {}
        while abandoned not in failed:
            assert time.monotonic() < deadline, "the abandoned stream never aged out"
            time.sleep(0.05)
            failed.update(sender.collect_failed_send_request_ids())
        assert "no chunk queued for" in failed[abandoned]
        # The next stage is told (a cancelled end of stream), not left to stall.
        deadline = time.monotonic() + 5.0
        inputs = receiver.take_inputs(abandoned)
        while inputs is None or not inputs.is_final:
            assert time.monotonic() < deadline, "the receiver never got the end of the abandoned stream"
            time.sleep(0.02)
            inputs = receiver.take_inputs(abandoned)
        assert inputs.cancelled
        while sender.pending_state()["sending"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
            sender.collect_failed_send_request_ids()
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_failed_and_finished_but_untaken_state_ages_out_without_release(
    namespace_pair: tuple[FlakyConnector, InProcConnector],
) -> None:
    conn0, conn1 = namespace_pair
    sender = _manager(conn0, "0", idle_state_timeout_s=0.3)
    receiver = _manager(conn1, "1", idle_state_timeout_s=0.3)
    try:
        dead, untaken = rid(), rid()
        conn0.fail_puts[sender.send_key(dead, 0)] = 100
        assert not sender.save(dead, {"n": [0]}, timeout_s=5.0)
        assert dead in sender.collect_failed_send_request_ids()  # the scheduler never calls release()
        receiver.load_async(untaken)
        assert sender.save(untaken, {"n": [1]}, timeout_s=5.0)  # final; its inputs are never taken
        deadline = time.monotonic() + 5.0
        while sender.pending_state()["sending"] or receiver.pending_state()["receiving"]:
            assert time.monotonic() < deadline, (sender.pending_state(), receiver.pending_state())
            time.sleep(0.05)
            sender.collect_failed_send_request_ids()
            receiver.collect_failed_receive_request_ids()
        assert receiver.health()["expired_states"] >= 1
        # An aged-out id stays a used id.
        assert sender.stream_refusal(dead) is not None
    finally:
        sender.shutdown()
        receiver.shutdown()


# -- 5. a receiving stage that gives a request up tells the connector, so late chunks can be released -------------
class RecordingConnector(InProcConnector):
    """An InProcConnector that records the release hooks the adapters call."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.abandoned: list[str] = []
        self.cleaned: list[str] = []

    def abandon_get(self, get_key: str) -> None:
        self.abandoned.append(get_key)
        super().abandon_get(get_key)

    def cleanup_prefix(self, prefix: str) -> int:
        self.cleaned.append(prefix)
        return super().cleanup_prefix(prefix)


@pytest.mark.parametrize("how", ["cancel", "stall", "release", "expire"])
def test_giving_up_a_receiving_stream_abandons_its_next_key_and_cleans_its_prefix(how: str) -> None:
    namespace = f"give-up-{uuid.uuid4().hex}"
    conn0 = InProcConnector({"namespace": namespace, "stage_id": "0"})
    conn1 = RecordingConnector({"namespace": namespace, "stage_id": "1"})
    sender = _manager(conn0, "0")
    receiver = _manager(
        conn1,
        "1",
        stall_timeout_s=0.3 if how == "stall" else 5.0,
        idle_state_timeout_s=0.3 if how == "expire" else 600.0,
    )
    try:
        request = rid()
        receiver.load_async(request)
        assert sender.save(request, {"n": [0]}, is_final=how == "expire", timeout_s=5.0)
        deadline = time.monotonic() + 5.0
        while receiver.take_inputs(request) is None:  # chunk 0 is in: the stream waits for chunk 1
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if how == "cancel":
            receiver.cancel(request)
        elif how == "release":
            receiver.release(request)
        elif how == "stall":
            while request not in receiver.collect_failed_receive_request_ids():
                assert time.monotonic() < deadline
                time.sleep(0.02)
        next_key = receiver.recv_key(request, 1)
        prefix = receiver.recv_key(request, 0)[:-1]
        if how == "expire":
            # A finished stream nobody took: nothing more will come, but its keys are given up too.
            while receiver.pending_state()["receiving"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert next_key in conn1.abandoned or how == "expire"
        assert prefix in conn1.cleaned
    finally:
        sender.shutdown()
        receiver.shutdown()
        conn0.close()
        conn1.close()


def test_fifty_cancelled_streams_do_not_fill_a_window_of_fifty(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/edge.sock"
    common = {"endpoints": {"1": endpoint}, "shm": "off", "heartbeat_s": 0.2}
    once = RetryPolicy(attempts=1, deadline_s=5.0)
    with (
        ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as rconn,
        ZmqConnector({"stage_id": "0", "role": "sender", "max_unacked": 50, "put_timeout_s": 1.0, **common}) as sconn,
    ):
        sender = OmniChunkManager(ChunkManagerConfig(stage_id="0", retry=once), sconn)
        receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1", retry=once), rconn)
        try:
            # The receiving stage gives up fifty requests (cancel, stall, a function that raised)
            # before their chunks arrive; the upstream stage sends them anyway.
            for i in range(50):
                receiver.load_async(f"gone-{i}")
                receiver.cancel(f"gone-{i}")
            for i in range(50):
                assert sender.save(f"gone-{i}", {"x": np.full(8, i)}, timeout_s=10.0)
            # Later requests on the same edge must still go through.
            for i in range(10):
                request = f"live-{i}"
                receiver.load_async(request)
                assert sender.save(request, {"x": np.full(8, i)}, timeout_s=10.0), (
                    sender.collect_failed_send_request_ids()
                )
                inputs = receiver.load(request, timeout_s=5.0)
                assert inputs is not None and inputs.is_final
        finally:
            sender.shutdown()
            receiver.shutdown()


# -- a receiver that starts after its upstream announced many requests still finds the new ones --------------------
def test_a_restarted_downstream_finds_announcements_far_past_the_look_ahead_window() -> None:
    namespace = f"head-{uuid.uuid4().hex}"
    conns = [InProcConnector({"namespace": namespace, "stage_id": sid}) for sid in ("0", "0", "1", "1", "1", "1")]

    def link(stage: str, up: str, down: str, inbound: InProcConnector, outbound: InProcConnector) -> _Endpoint:
        return _Endpoint(
            stage_id=stage,
            upstream_stage_id=up,
            downstream_stage_id=down,
            inbound=inbound,
            outbound=outbound,
            stall_timeout_s=5.0,
            retry=FAST_RETRY,
            label="test",
        )

    def admitted(endpoint: _Endpoint, count: int) -> list[str]:
        got: list[str] = []
        deadline = time.monotonic() + 5.0
        while len(got) < count:
            assert time.monotonic() < deadline, f"admitted {got}, expected {count}"
            with contextlib.suppress(queue.Empty):
                got.append(endpoint.admitted.get(timeout=0.05)[0])
        return got

    upstream = link("0", "x", "1", conns[0], conns[1])
    first = link("1", "0", "2", conns[2], conns[3])
    try:
        # The upstream stage (or a driver's last stage) has announced 40 requests to a first incarnation...
        for i in range(40):
            upstream.announce(f"old-{i}")
        assert admitted(first, 40) == [f"old-{i}" for i in range(40)]
        first.close()
        # ...and a fresh one (a second `zmq-omni drive`, a restarted stage) must still learn of new requests.
        second = link("1", "0", "2", conns[4], conns[5])
        try:
            for i in range(3):
                upstream.announce(f"new-{i}")
            assert admitted(second, 3) == [f"new-{i}" for i in range(3)]
        finally:
            second.close()
    finally:
        upstream.close()
        first.close()
