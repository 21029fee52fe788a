"""Stages that run for weeks: nothing unclaimed pins a window, every per-peer structure is bounded (issue 13).

Real sockets over ipc, in one process: a push receiver that never takes what
arrives, a cancelled request whose chunks arrive late, an orphan that pins the
sender's low-water mark, a pull server answering many fetches, and
``health()`` saying so while it lasts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, default_retryable
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import DeliveryError

from .conftest import wait_until


@contextmanager
def _edge(short_tmp: Path, receiver: dict[str, Any] | None = None, **sender: Any) -> Iterator[tuple[Any, Any]]:
    """A push receiver (stage 1) and a sender (stage 0) over ipc, both closed at the end."""
    common = {"endpoints": {"1": f"ipc://{short_tmp}/edge.sock"}, "shm": "off", "heartbeat_s": 0.05}
    with ExitStack() as stack:
        rconn = stack.enter_context(ZmqConnector({"stage_id": "1", "role": "receiver", **common, **(receiver or {})}))
        sconn = stack.enter_context(ZmqConnector({"stage_id": "0", "role": "sender", **common, **sender}))
        yield rconn, sconn


def _put(conn: ZmqConnector, key: str, value: int = 0) -> None:
    ok, _, _ = conn.put("0", "1", key, {"x": np.full(4, value)})
    assert ok, conn.drain_failures()


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


# -- 1. nothing unclaimed lives forever ----------------------------------------------------------------------------
def test_unclaimed_items_expire_and_free_the_senders_window(short_tmp: Path) -> None:
    with _edge(short_tmp, {"unclaimed_ttl_s": 0.3}, max_unacked=4, put_timeout_s=0.2) as (rconn, sconn):
        for i in range(4):
            _put(sconn, f"orphan-{i}")
        # Nobody takes them: after the ttl they are dropped, acknowledged, and the window frees.
        assert wait_until(lambda: rconn.health()["dropped_unclaimed"] == 4, timeout=10.0)
        assert rconn.health()["mailbox"] == 0
        assert wait_until(lambda: sconn.health()["pending"] == 0)
        assert wait_until(lambda: sconn.health()["receiver_dropped_unclaimed"] == 4)
        for i in range(4):
            _put(sconn, f"live-{i}", i)
            got = rconn.get_with_deadline("0", "1", f"live-{i}", None, deadline=_soon())
            assert got is not None and int(got[0]["x"][0]) == i
        assert rconn.get("0", "1", "orphan-0") is None


@pytest.mark.parametrize("how", ["cleanup", "cleanup_prefix", "abandon_get"])
def test_a_late_arrival_under_a_tombstone_is_dropped_at_once(short_tmp: Path, how: str) -> None:
    with _edge(short_tmp, max_unacked=2, put_timeout_s=0.5) as (rconn, sconn):
        assert rconn.get("0", "1", "warm") is None  # binds; nothing there
        if how == "cleanup":
            rconn.cleanup("req-7")
            keys = ["req-7", "req-7"]
        elif how == "cleanup_prefix":
            rconn.cleanup_prefix("req-7_1_")
            keys = [f"req-7_1_{i}" for i in range(6)]
        else:
            rconn.abandon_get("req-7_1_3")
            keys = ["req-7_1_3"] * 3
        # More late puts than the window holds: each must be dropped and its slot freed, not kept.
        for key in keys:
            _put(sconn, key)
        assert wait_until(lambda: sconn.health()["pending"] == 0)
        health = rconn.health()
        assert health["mailbox"] == 0 and health["dropped_late"] == len(keys) and health["tombstones"] == 1
        # The sender learns why its window freed: dropped unconsumed, cancelled downstream.
        assert wait_until(lambda: sconn.health()["receiver_dropped_cancelled"] == len(keys))
        assert sconn.health()["receiver_dropped_unclaimed"] == 0
        # Other keys are untouched; a prefix tombstone spares keys that are not prefix + digits.
        for key in ("req-70", "req-7_1_x", "other"):
            _put(sconn, key, 5)
            got = rconn.get_with_deadline("0", "1", key, None, deadline=_soon())
            assert got is not None, key
        # A get of a key abandon_get buried lifts its tombstone: a key asked for again is delivered again.
        # A cleanup's tombstone stays: what the request put is never delivered within the ttl.
        assert rconn.get("0", "1", keys[0]) is None
        _put(sconn, keys[0], 9)
        if how == "abandon_get":
            got = rconn.get_with_deadline("0", "1", keys[0], None, deadline=_soon())
            assert got is not None and int(got[0]["x"][0]) == 9
        else:
            assert wait_until(lambda: rconn.health()["dropped_late"] == len(keys) + 1)
            assert rconn.get("0", "1", keys[0]) is None


def test_a_put_the_receiver_dropped_under_a_cleanup_is_reported_failed_to_its_sender(short_tmp: Path) -> None:
    with _edge(short_tmp, put_timeout_s=0.5) as (rconn, sconn):
        assert rconn.get("0", "1", "warm") is None  # binds; nothing there
        _put(sconn, "req-9_0_0")
        assert rconn.get_with_deadline("0", "1", "req-9_0_0", None, deadline=_soon()) is not None
        rconn.cleanup_prefix("req-9_0_")  # the receiver gives the request up
        _put(sconn, "req-9_0_1")  # a late final chunk: put returns ok, but nobody will ever read it
        assert wait_until(lambda: sconn.health()["receiver_dropped_cancelled"] == 1)
        failures = sconn.drain_failures()
        assert [(f.op, f.key, f.to_stage) for f in failures] == [("put", "req-9_0_1", "1")], failures
        error = failures[0].error
        assert isinstance(error, DeliveryError) and error.dropped == "cancelled" and error.key == "req-9_0_1"
        assert "dropped it: its request had ended or was cancelled there" in failures[0].reason
        assert not default_retryable(error)  # a re-put would be dropped again
        # Cancelled downstream says nothing about the link: the sender stays healthy.
        assert sconn.health()["status"] == "ok", sconn.health()


def test_a_put_dropped_unclaimed_is_reported_failed_to_its_sender(short_tmp: Path) -> None:
    with _edge(short_tmp, {"unclaimed_ttl_s": 0.3}) as (_rconn, sconn):
        _put(sconn, "orphan")
        assert wait_until(lambda: sconn.health()["receiver_dropped_unclaimed"] == 1, timeout=10.0)
        failures = sconn.drain_failures()
        assert [f.key for f in failures] == ["orphan"], failures
        error = failures[0].error
        assert isinstance(error, DeliveryError) and error.dropped == "unclaimed"
        assert "unclaimed" in failures[0].reason


def test_a_sender_cleanup_never_cancels_puts_on_their_way(short_tmp: Path) -> None:
    # vllm-omni #6670: a final chunk put just before its request is cleaned up on the sender must still arrive.
    common = {"endpoints": {"1": f"ipc://{short_tmp}/edge.sock"}, "shm": "off", "heartbeat_s": 0.05}
    receiver = {"stage_id": "1", "role": "receiver", **common}
    with ZmqConnector({"stage_id": "0", "role": "sender", **common}) as sconn:
        with ZmqConnector(receiver) as rconn:
            _put(sconn, "warm")  # the receiver's first REPLY says it takes batches
            assert rconn.get_with_deadline("0", "1", "warm", None, deadline=_soon()) is not None
            # Its consumption acknowledged before the receiver goes (a loaded machine can be slower than close).
            assert wait_until(lambda: sconn.health()["pending"] == 0)
        # The receiver is away: small puts wait in the sender's outbox (ZeroMQ has no peer to queue them for).
        keys = [f"req-3_0_{i}" for i in range(5)]
        for i, key in enumerate(keys):
            ok, _, _ = sconn.put("0", "1", key, i)
            assert ok
        sconn.cleanup_prefix("req-3_0_")  # the request finished here: its puts were accepted all the same
        assert sconn.health()["pending"] == len(keys)
        with ZmqConnector(receiver) as rconn:
            for i, key in enumerate(keys):
                got = rconn.get_with_deadline("0", "1", key, None, deadline=_soon())
                assert got is not None and got[0] == i, key
            assert wait_until(lambda: sconn.health()["pending"] == 0)  # released once they arrived
        assert not sconn.drain_failures()


def test_abandon_get_drops_an_item_already_there(short_tmp: Path) -> None:
    with _edge(short_tmp, max_unacked=1, put_timeout_s=0.5) as (rconn, sconn):
        assert rconn.get("0", "1", "warm") is None
        _put(sconn, "k")
        assert wait_until(lambda: rconn.health()["mailbox"] == 1)
        rconn.abandon_get("k")
        assert rconn.health()["mailbox"] == 0 and rconn.health()["dropped_cleanup"] == 1
        assert wait_until(lambda: sconn.health()["pending"] == 0)
        _put(sconn, "next")  # the window of one has room again


def test_tombstones_are_bounded_and_lapse(short_tmp: Path) -> None:
    receiver = {"max_tombstones": 3, "tombstone_ttl_s": 2.0}
    with _edge(short_tmp, receiver) as (rconn, sconn):
        assert rconn.get("0", "1", "warm") is None
        for i in range(10):
            rconn.abandon_get(f"gone-{i}")
        health = rconn.health()
        assert health["tombstones"] == 3 and health["tombstones_evicted"] == 7
        _put(sconn, "gone-0", 1)  # evicted: delivered
        assert rconn.get_with_deadline("0", "1", "gone-0", None, deadline=_soon()) is not None
        assert wait_until(lambda: rconn.health()["tombstones"] == 0, timeout=10.0)  # the rest lapse
        _put(sconn, "gone-9", 2)
        assert rconn.get_with_deadline("0", "1", "gone-9", None, deadline=_soon()) is not None


def test_dropped_items_release_their_shared_memory_slots(short_tmp: Path, shm_dir: str) -> None:
    common = {"shm": "on", "shm_dir": shm_dir, "shm_threshold": 1024}
    with _edge(short_tmp, {"unclaimed_ttl_s": 0.3, **common}, **common) as (rconn, sconn):
        assert rconn.get("0", "1", "warm") is None
        rconn.cleanup_prefix("late_")
        big = np.ones(64 << 10, dtype=np.uint8)
        for key in ("late_0", "late_1", "orphan"):
            ok, _, _ = sconn.put("0", "1", key, {"x": big})
            assert ok
        assert sconn.health()["shm_puts"] == 3

        def settled() -> bool:
            r, s = rconn.health(), sconn.health()
            return r["dropped_late"] == 2 and r["dropped_unclaimed"] == 1 and s["pending"] == 0

        assert wait_until(settled, timeout=5.0), (rconn.health(), sconn.health())
        assert wait_until(lambda: sconn.health()["shm_slots_ready"] + sconn.health()["shm_slots_leased"] == 0)


class _CancelBeforeGet(ZmqConnector):
    """A receiver whose next get of ``race_key`` first runs ``race`` (a cancel landing just before the get)."""

    race_key = ""
    race: Callable[[], None] | None = None

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        race, self.race = (self.race, None) if get_key == self.race_key else (None, self.race)
        if race is not None:
            race()
        return super().get(from_stage, to_stage, get_key, metadata)


def test_a_stream_cancelled_while_the_receive_worker_gets_it_stays_buried(short_tmp: Path) -> None:
    # The receive worker picked chunk 1's key, the stage cancelled the request (tombstones laid),
    # then the worker's get of that key lifted them: the later chunks must still be dropped as
    # cancelled at once, not left waiting unclaimed for unclaimed_ttl_s (the soak's steady-run failure).
    common = {"endpoints": {"1": f"ipc://{short_tmp}/edge.sock"}, "shm": "off", "heartbeat_s": 0.05}
    request = "req-5"
    with ExitStack() as stack:
        rconn = _CancelBeforeGet({"stage_id": "1", "role": "receiver", **common})
        stack.enter_context(rconn)
        sconn = ZmqConnector({"stage_id": "0", "role": "sender", **common})
        stack.enter_context(sconn)
        receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1", stall_timeout_s=30.0), rconn)
        stack.callback(receiver.shutdown)
        sender = OmniChunkManager(ChunkManagerConfig(stage_id="0", stall_timeout_s=30.0), sconn)
        stack.callback(sender.shutdown)
        rconn.race_key = f"{request}_0_1"
        rconn.race = lambda: receiver.cancel(request)
        receiver.load_async(request)
        sender.save_async(request, {"x": np.array([0])})
        assert wait_until(lambda: rconn.race is None)  # the worker went for chunk 1: cancelled, then its get ran
        assert receiver.pending_state()["receiving"] == 0
        for i in range(1, 5):  # what the upstream still sends for it (raw puts: the receiver drops them unread)
            _put(sconn, f"{request}_0_{i}", i)
        assert wait_until(lambda: rconn.health()["dropped_late"] == 4)
        assert rconn.health()["mailbox"] == 0
        assert wait_until(lambda: sconn.health()["receiver_dropped_cancelled"] == 4)
        assert sconn.health()["receiver_dropped_unclaimed"] == 0


# -- 2. a pong never exceeds what the sender accepts ----------------------------------------------------------------
def test_an_orphan_pinning_the_low_mark_does_not_make_pongs_too_large(short_tmp: Path) -> None:
    # A sender with max_unacked=50 refuses a REPLY list naming more than 4 * 50 + 1024 seqs. While an
    # unclaimed item pins its low mark, every later consumption is repeated in every pong.
    with _edge(short_tmp, max_unacked=50) as (rconn, sconn):
        _put(sconn, "orphan")
        for i in range(1400):
            _put(sconn, f"k{i}")
            assert rconn.get_with_deadline("0", "1", f"k{i}", None, deadline=_soon()) is not None
        resends = sconn.health()["resends"]
        assert wait_until(lambda: sconn.health()["pending"] == 1)
        # A few heartbeats later: no reply was refused, and the window still works.
        time.sleep(0.4)
        assert sconn.health()["rejected_frames"] == 0, sconn.health()
        assert sconn.health()["resends"] == resends  # nothing was taken for lost
        _put(sconn, "after")
        assert rconn.get_with_deadline("0", "1", "after", None, deadline=_soon()) is not None
        assert rconn.get("0", "1", "orphan") is not None
        assert wait_until(lambda: sconn.health()["pending"] == 0)


# -- pull mode: the server's copy of what a receiver abandoned ------------------------------------------------------
def test_pull_receiver_cleanup_leaves_the_server_copy_to_pull_ttl(short_tmp: Path) -> None:
    common = {"endpoints": {"0": f"ipc://{short_tmp}/pull.sock"}, "mode": "pull", "shm": "off"}
    with (
        ZmqConnector({"stage_id": "0", "role": "sender", "pull_ttl_s": 0.3, **common}) as server,
        ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as client,
    ):
        ok, _, _ = server.put("0", "1", "req-1", {"x": np.ones(4)})
        assert ok and server.health()["pending"] == 1
        client.abandon_get("req-1")
        client.cleanup("req-1")
        assert server.health()["pending"] == 1  # the receiver holds nothing of it, and tells the server nothing
        assert wait_until(lambda: server.health()["pending"] == 0, timeout=5.0)
        assert server.health()["expired"] == 1
        assert [f.key for f in server.drain_failures()] == ["req-1"]


def test_pull_server_forgets_replies_that_left_without_being_asked(short_tmp: Path) -> None:
    common = {"endpoints": {"0": f"ipc://{short_tmp}/pull.sock"}, "mode": "pull", "shm": "off"}
    with (
        ZmqConnector({"stage_id": "0", "role": "sender", **common}) as server,
        ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as client,
    ):
        for i in range(300):
            ok, _, meta = server.put("0", "1", f"k{i}", {"x": np.full(4, i)})
            assert ok
            assert client.get("0", "1", f"k{i}", meta) is not None
        part = server._bound.server
        part = getattr(part, "_inner", part)  # the stage's pull part: this process binds its server
        assert part is not None
        # Nobody calls stats(), wait_fetched() or health(): the I/O thread prunes as replies leave.
        assert wait_until(lambda: len(part._leaving) == 0, timeout=5.0), len(part._leaving)


# -- 3. health() tells the truth, both ways ---------------------------------------------------------------------------
def _problems(conn: ZmqConnector) -> str:
    health = conn.health()
    assert (health["status"] == "degraded") == bool(health.get("reasons")), health
    return " | ".join(health.get("reasons", []))


def test_health_is_degraded_while_the_send_window_is_full_or_stays_nearly_full(short_tmp: Path) -> None:
    with _edge(short_tmp, max_unacked=10) as (rconn, sconn):
        assert sconn.health()["status"] == "ok"
        for i in range(9):  # 90 %: nearly full, not full
            _put(sconn, f"k{i}")
        assert wait_until(lambda: "send window nearly full" in _problems(sconn), timeout=5.0)
        _put(sconn, "k9")
        assert "send window full (10 puts" in _problems(sconn)
        for i in range(10):
            assert rconn.get_with_deadline("0", "1", f"k{i}", None, deadline=_soon()) is not None
        assert wait_until(lambda: sconn.health()["status"] == "ok", timeout=5.0), sconn.health()


def test_health_is_degraded_while_puts_keep_failing_and_ok_once_one_succeeds(short_tmp: Path) -> None:
    with _edge(short_tmp, max_unacked=1, put_timeout_s=0.05) as (rconn, sconn):
        _put(sconn, "a")
        assert not sconn.put("0", "1", "b", {"x": 1})[0]  # the window of one is full
        assert "put of 'b' to stage '1' failed" in _problems(sconn)
        assert rconn.get_with_deadline("0", "1", "a", None, deadline=_soon()) is not None
        assert wait_until(lambda: sconn.health()["pending"] == 0)
        assert "failed" in _problems(sconn)  # no put succeeded since
        _put(sconn, "c")
        assert "failed" not in _problems(sconn)


def test_health_is_degraded_while_items_wait_unclaimed_and_after_they_are_dropped(short_tmp: Path) -> None:
    with _edge(short_tmp, {"unclaimed_ttl_s": 1.0, "degraded_hold_s": 0.5}) as (rconn, sconn):
        _put(sconn, "orphan")
        assert wait_until(lambda: rconn.health()["mailbox"] == 1)
        assert wait_until(lambda: "waits unclaimed" in _problems(rconn), timeout=5.0)
        assert wait_until(lambda: "1 items dropped unclaimed" in _problems(rconn), timeout=5.0)
        assert wait_until(lambda: rconn.health()["status"] == "ok", timeout=5.0), rconn.health()
        assert rconn.health()["dropped_unclaimed"] == 1


def test_pull_client_keeps_sockets_and_verdicts_for_a_bounded_number_of_servers(
    short_tmp: Path, shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Restarted pull servers on fresh ports name new endpoints in their metadata, for weeks.
    from zmq_omni.transport import _pull_client

    monkeypatch.setattr(_pull_client, "MAX_SERVERS", 2)
    common = {"mode": "pull", "shm": "auto", "shm_dir": shm_dir}
    with ExitStack() as stack:
        client = stack.enter_context(ZmqConnector({"stage_id": "1", "role": "receiver", **common}))
        for n in range(4):
            endpoint = f"ipc://{short_tmp}/s{n}.sock"
            server = stack.enter_context(
                ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"0": endpoint}, **common})
            )
            for i in range(2):  # the second fetch learned the probe from the first reply
                ok, _, meta = server.put("0", "1", f"k{i}", {"x": np.ones(4)})
                assert ok and client.get_with_deadline("0", "1", f"k{i}", meta, deadline=_soon()) is not None
        assert client._fetching.client is not None
        idle = client._fetching.client.idle_sockets()
        assert list(idle) == [f"ipc://{short_tmp}/s{n}.sock" for n in (2, 3)] and all(v == 1 for v in idle.values())
        assert len(client.health()["shm_servers"]) == 2


def test_a_drop_report_longer_than_one_reply_keeps_its_reason(short_tmp: Path) -> None:
    with _edge(short_tmp) as (rconn, sconn):
        for i in range(1100):
            _put(sconn, f"p_{i}")
        assert wait_until(lambda: rconn.health()["mailbox"] == 1100, timeout=10.0)
        assert rconn.cleanup_prefix("p_") == 1100
        assert wait_until(lambda: sconn.health()["receiver_dropped_cancelled"] == 1100, timeout=10.0), sconn.health()
        assert sconn.health()["pending"] == 0 and sconn.health()["rejected_frames"] == 0
