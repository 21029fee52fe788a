"""The connector contract (docs/contract.md), run against every kind in ``connector_kinds``."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.connectors.base import OmniConnectorBase
from zmq_omni.errors import EncodeError

from .connector_kinds import KINDS, Pair

WAIT_S = 10.0


@pytest.fixture(params=sorted(KINDS))
def pair(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[Pair]:
    with KINDS[request.param](short_tmp) as made:
        yield made


def wait_get(receiver: OmniConnectorBase, edge: tuple[str, str], key: str) -> tuple[Any, int] | None:
    return receiver.get_with_deadline(edge[0], edge[1], key, deadline=time.monotonic() + WAIT_S)


def flush(sender: OmniConnectorBase, receiver: OmniConnectorBase, edge: tuple[str, str]) -> None:
    """Everything put before this on the edge has arrived (per-edge order holds)."""
    ok, _, _ = sender.put(edge[0], edge[1], "__flush__", b"")
    assert ok
    assert wait_get(receiver, edge, "__flush__") is not None


def test_round_trip_arrays_and_metadata(pair: Pair) -> None:
    sender, receiver, edge = pair
    hidden = np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8)
    payload = {"hidden": hidden, "ids": np.array([1, 2, 3], dtype=np.int64), "meta": {"req": "r1", "final": False}}
    ok, nbytes, _ = sender.put(*edge, "r1_0_0", payload)
    assert ok and nbytes >= hidden.nbytes
    got = wait_get(receiver, edge, "r1_0_0")
    assert got is not None
    obj, got_bytes = got
    assert got_bytes == nbytes
    np.testing.assert_array_equal(obj["hidden"], hidden)
    assert obj["hidden"].dtype == np.float32
    np.testing.assert_array_equal(obj["ids"], payload["ids"])
    assert obj["meta"] == {"req": "r1", "final": False}


def test_missing_key_returns_none_at_once(pair: Pair) -> None:
    _, receiver, edge = pair
    assert receiver.get(*edge, "never-put") is None
    assert receiver.get(*edge, "never-put", metadata={}) is None


def test_each_put_is_consumed_exactly_once(pair: Pair) -> None:
    sender, receiver, edge = pair
    assert sender.put(*edge, "once", {"x": 1})[0]
    assert wait_get(receiver, edge, "once") is not None
    flush(sender, receiver, edge)
    assert receiver.get(*edge, "once") is None


def test_stages_and_keys_that_are_not_str_are_taken_as_their_str(pair: Pair) -> None:
    # Callers pass stage ids as ints and, now and then, a key too: a get must never miss its put over it.
    sender, receiver, edge = pair
    ints = (int(edge[0]), int(edge[1]))
    assert sender.put(*ints, 7, {"n": 7})[0]
    got = receiver.get_with_deadline(*edge, "7", deadline=time.monotonic() + WAIT_S)
    assert got is not None and got[0] == {"n": 7}
    assert sender.put(*edge, "8", {"n": 8})[0]
    got = receiver.get_with_deadline(*ints, 8, deadline=time.monotonic() + WAIT_S)
    assert got is not None and got[0] == {"n": 8}
    assert sender.put(*edge, "9", {"n": 9})[0]
    flush(sender, receiver, edge)
    assert receiver.cleanup(9) | sender.cleanup(9)
    assert receiver.get(*edge, "9") is None
    for key in ("50", "51"):
        assert sender.put(*edge, key, {"k": key})[0]
    flush(sender, receiver, edge)
    assert receiver.cleanup_prefix(5) + sender.cleanup_prefix(5) == 2  # prefix "5": "50" and "51"
    assert receiver.get(*edge, "50") is None and receiver.get(*edge, "51") is None


def test_re_put_of_unconsumed_key_replaces_it(pair: Pair) -> None:
    sender, receiver, edge = pair
    assert sender.put(*edge, "k", "first")[0]
    assert sender.put(*edge, "k", "second")[0]
    flush(sender, receiver, edge)
    got = receiver.get(*edge, "k")
    assert got is not None and got[0] == "second"
    assert receiver.get(*edge, "k") is None


def test_get_with_deadline_times_out_without_data(pair: Pair) -> None:
    _, receiver, edge = pair
    start = time.monotonic()
    assert receiver.get_with_deadline(*edge, "absent", deadline=start + 0.2) is None
    assert time.monotonic() >= start + 0.2 - 0.01  # it waited until the deadline, not less


def test_an_infinite_deadline_waits_until_the_data_arrives_and_a_nan_one_is_refused(pair: Pair) -> None:
    sender, receiver, edge = pair
    timer = threading.Timer(0.2, lambda: sender.put(*edge, "late", {"x": 1}))
    timer.start()
    try:
        got = receiver.get_with_deadline(*edge, "late", deadline=float("inf"))
    finally:
        timer.join()
    assert got is not None and got[0] == {"x": 1}
    with pytest.raises(ValueError, match="NaN"):
        receiver.get_with_deadline(*edge, "late", deadline=float("nan"))


def test_get_with_deadline_wakes_when_data_arrives(pair: Pair) -> None:
    sender, receiver, edge = pair
    timer = threading.Timer(0.2, lambda: sender.put(*edge, "late", [1, 2, 3]))
    timer.start()
    try:
        got = wait_get(receiver, edge, "late")
    finally:
        timer.join()
    assert got is not None and list(got[0]) == [1, 2, 3]


def test_cleanup_drops_an_unconsumed_key(pair: Pair) -> None:
    sender, receiver, edge = pair
    assert sender.put(*edge, "doomed", {"a": np.zeros(10)})[0]
    flush(sender, receiver, edge)
    dropped = receiver.cleanup("doomed") | sender.cleanup("doomed")
    assert dropped
    assert receiver.get(*edge, "doomed") is None
    assert not receiver.cleanup("doomed")


def test_cleanup_drops_the_requests_keys_the_key_rid_underscore_and_underscore_rid(pair: Pair) -> None:
    sender, receiver, edge = pair
    doomed = ["rid", "rid_0_1", "rid_1_0", "kv_rid", "a_b_rid"]
    kept = ["rid2", "xrid", "rid2_0_1", "kv_rid2", "ridx_rid2"]
    for key in doomed + kept:
        assert sender.put(*edge, key, key)[0]
    flush(sender, receiver, edge)
    assert receiver.cleanup("rid") | sender.cleanup("rid")
    for key in doomed:
        assert receiver.get(*edge, key) is None, key
    for key in kept:
        got = receiver.get(*edge, key)
        assert got is not None and got[0] == key


def test_cleanup_prefix_drops_only_digit_suffixed_keys(pair: Pair) -> None:
    sender, receiver, edge = pair
    doomed = [f"req7_0_{i}" for i in range(5)]
    kept = ["req7_0_x", "req7_0_1_tail", "req70_0_1", "req8_0_0"]
    for key in doomed + kept:
        assert sender.put(*edge, key, key)[0]
    flush(sender, receiver, edge)
    assert receiver.cleanup_prefix("req7_0_") + sender.cleanup_prefix("req7_0_") == len(doomed)
    for key in doomed:
        assert receiver.get(*edge, key) is None
    for key in kept:
        got = receiver.get(*edge, key)
        assert got is not None and got[0] == key


def test_caller_may_drop_its_arrays_right_after_put(pair: Pair) -> None:
    sender, receiver, edge = pair
    data = np.random.default_rng(0).standard_normal((512, 512))
    expected = data.copy()
    assert sender.put(*edge, "dropped", {"data": data})[0]
    del data
    gc.collect()
    got = wait_get(receiver, edge, "dropped")
    assert got is not None
    np.testing.assert_array_equal(got[0]["data"], expected)


def test_unsupported_type_is_a_programming_error(pair: Pair) -> None:
    sender, _, edge = pair
    with pytest.raises(EncodeError, match="object"):
        sender.put(*edge, "bad", object())


def test_concurrent_puts_from_threads_all_arrive_once(pair: Pair) -> None:
    sender, receiver, edge = pair
    keys = [f"t{t}_{i}" for t in range(4) for i in range(50)]

    def put_all(thread: int) -> None:
        for i in range(50):
            assert sender.put(*edge, f"t{thread}_{i}", {"t": thread, "i": i})[0]

    threads = [threading.Thread(target=put_all, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in keys:
        got = wait_get(receiver, edge, key)
        assert got is not None, key
        t, i = key[1:].split("_")
        assert got[0] == {"t": int(t), "i": int(i)}
    flush(sender, receiver, edge)
    assert all(receiver.get(*edge, key) is None for key in keys)


def test_health_counts_and_reports_status(pair: Pair) -> None:
    sender, receiver, edge = pair
    assert sender.put(*edge, "h", b"x" * 1000)[0]
    assert wait_get(receiver, edge, "h") is not None
    sent, received = sender.health(), receiver.health()
    assert sent["status"] == "ok" and received["status"] == "ok"
    assert sent["puts"] >= 1 and received["gets"] >= 1
    assert sent["bytes_sent"] >= 1000 and received["bytes_received"] >= 1000
    for snap in (sent, received):
        assert {"errors", "timeouts"} <= set(snap)


def test_close_is_idempotent_and_later_calls_fail_softly(pair: Pair) -> None:
    sender, receiver, edge = pair
    receiver.close()
    receiver.close()
    assert receiver.health()["status"] == "closed"
    assert receiver.get(*edge, "anything") is None
    sender.close()
    sender.close()
    ok, nbytes, meta = sender.put(*edge, "after-close", 1)
    assert (ok, nbytes, meta) == (False, 0, None)
    assert any(f.key == "after-close" for f in sender.drain_failures())


def test_kept_failures_do_not_pin_stack_frames(pair: Pair) -> None:
    """A kept error's traceback would hold the failed put's payload alive."""
    sender, _, edge = pair
    sender.close()
    assert sender.put(*edge, "late", {"x": np.ones(1000)})[0] is False
    failures = sender.drain_failures()
    assert failures and all(f.error is None or f.error.__traceback__ is None for f in failures)


def test_flush_then_close_fails_nothing_that_was_delivered(pair: Pair) -> None:
    sender, receiver, edge = pair
    for i in range(5):
        assert sender.put(*edge, f"f{i}", {"i": i})[0]
    for i in range(5):
        got = wait_get(receiver, edge, f"f{i}")
        assert got is not None and got[0] == {"i": i}
    assert sender.flush(WAIT_S) is True
    sender.close()
    assert sender.drain_failures() == []
