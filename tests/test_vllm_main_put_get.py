"""Put-then-get in one process, connectors from one spec in one process, and main's cleanup rule (issue 30).

vllm-omni main's own connector tests put a key and get it right back by key
alone (``get(..., metadata=None)``) on the same connector; its stage
processes build two connectors from one spec (scheduler and model runner);
its ``SharedMemoryConnector.cleanup(request_id)`` drops the key itself and
every key ``request_id_*`` or ``*_request_id``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.connectors.zmq import ZmqConnector

ROUNDS = 1000


def _endpoints(tmp: Path) -> dict[str, str]:
    return {s: f"ipc://{tmp}/pg-{s}.sock" for s in ("0", "1", "2")}


# Who puts and who gets, all in one process:
#   "bare": one connector built from an extra without role or stage id (main's tests: SharedMemoryConnector({})),
#   "pair": stage 0's connector (role sender) puts, stage 1's (role receiver) gets,
#   "twin": stage 0's puts; stage 1's scheduler and model runner, two connectors from one spec, get in turn.
FORMS = ["bare", "pair", "twin"]


def _pair(form: str, mode: str, tmp: Path, stack: ExitStack) -> tuple[Any, list[Any]]:
    base: dict[str, Any] = {"mode": mode, "endpoints": _endpoints(tmp)}
    if form == "bare":
        one = stack.enter_context(ZmqConnector(dict(base)))
        return one, [one]
    putter = stack.enter_context(ZmqConnector({**base, "role": "sender", "stage_id": 0}))
    stage1 = {**base, "role": "receiver", "stage_id": 1}
    getters = [stack.enter_context(ZmqConnector(stage1)) for _ in range(1 if form == "pair" else 2)]
    return putter, getters


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as opened:
        yield opened


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_put_then_get_by_key_never_misses(form: str, mode: str, short_tmp: Path, stack: ExitStack) -> None:
    putter, getters = _pair(form, mode, short_tmp, stack)
    misses = []
    for n in range(ROUNDS):
        getter = getters[n % len(getters)]
        key = f"req-{n}_0_{n % 7}"
        data = {"n": n, "codes": np.full(16, n, dtype=np.int64)}
        ok, _, _ = putter.put("0", "1", key, data)
        assert ok, key
        got = getter.get("0", "1", key, metadata=None)
        if got is None:
            misses.append(key)
            continue
        assert got[0]["n"] == n and np.array_equal(got[0]["codes"], data["codes"])
    assert misses == [], f"{len(misses)} of {ROUNDS} gets right after their put missed, e.g. {misses[:5]}"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_put_then_get_with_the_puts_metadata(mode: str, short_tmp: Path, stack: ExitStack) -> None:
    """Main's shm test: the metadata the put returned, as is or wrapped as ``{key: metadata}``, finds the data."""
    putter, getters = _pair("twin", mode, short_tmp, stack)
    for n in range(50):
        getter = getters[n % 2]
        key = f"meta-{n}"
        ok, size, meta = putter.put("0", "1", key, {"n": n})
        assert ok and size > 0
        got = getter.get("0", "1", key, meta if n % 2 else {key: meta})
        assert got is not None and got[0] == {"n": n}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_two_connectors_from_one_spec_deliver_each_key_once(mode: str, short_tmp: Path) -> None:
    """Scheduler and model runner poll the same keys: each arrives once, to whichever asks; none is lost."""
    endpoints = _endpoints(short_tmp)
    spec = {"mode": mode, "endpoints": endpoints, "role": "receiver", "stage_id": 1}
    keys = [f"race-{n}_0_0" for n in range(300)]
    taken: dict[str, list[str]] = {"scheduler": [], "worker": []}
    with (
        ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "sender", "stage_id": 0}) as upstream,
        ZmqConnector(spec) as scheduler_side,
        ZmqConnector(spec) as worker_side,
    ):
        for key in keys:
            assert upstream.put("0", "1", key, {"key": key})[0]

        def poll(name: str, connector: Any) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with lock:
                    pending = [k for k in keys if k not in done]
                if not pending:
                    return
                for key in pending:
                    got = connector.get("0", "1", key)
                    if got is not None:
                        assert got[0] == {"key": key}
                        with lock:
                            taken[name].append(key)
                            done.add(key)

        lock = threading.Lock()
        done: set[str] = set()
        sides = (("scheduler", scheduler_side), ("worker", worker_side))
        threads = [threading.Thread(target=poll, args=side) for side in sides]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    everything = taken["scheduler"] + taken["worker"]
    assert sorted(everything) == sorted(keys), "each key delivered exactly once across the two connectors"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_closing_one_of_two_keeps_the_other_working(mode: str, short_tmp: Path) -> None:
    endpoints = _endpoints(short_tmp)
    spec = {"mode": mode, "endpoints": endpoints, "role": "receiver", "stage_id": 1}
    with ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "sender", "stage_id": 0}) as upstream:
        first = ZmqConnector(spec)
        with ZmqConnector(spec) as second:
            first.close()
            for n in range(20):
                key = f"after-close-{n}"
                ok, _, meta = upstream.put("0", "1", key, {"n": n})
                assert ok
                got = second.get("0", "1", key, meta)
                assert got is not None and got[0] == {"n": n}
        # the last close released the endpoint: a new receiver binds it again
        with ZmqConnector(spec) as third:
            ok, _, meta = upstream.put("0", "1", "rebound", {"n": -1})
            assert ok
            got = third.get("0", "1", "rebound", meta)
            assert got is not None and got[0] == {"n": -1}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_middle_stage_receives_and_sends_with_role_receiver(mode: str, short_tmp: Path) -> None:
    """Main gives the talker's connector role receiver; it puts to code2wav all the same."""
    endpoints = _endpoints(short_tmp)
    with (
        ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "sender", "stage_id": 0}) as thinker,
        ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "receiver", "stage_id": 1}) as talker,
        ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "receiver", "stage_id": 2}) as code2wav,
    ):
        for n in range(20):
            ok, _, meta = thinker.put("0", "1", f"r_0_{n}", {"n": n})
            assert ok
            got = talker.get("0", "1", f"r_0_{n}", meta)
            assert got is not None
            ok, _, meta = talker.put(from_stage="1", to_stage="2", put_key=f"r_1_{n}", data={"codes": n})
            assert ok, "a role-receiver connector puts downstream"
            got = code2wav.get("1", "2", f"r_1_{n}", meta)
            assert got is not None and got[0] == {"codes": n}


# -- cleanup: main's SharedMemoryConnector.cleanup rule ------------------------------------------------------------

RID = "chatcmpl-7"
DROPPED = [RID, f"{RID}_0_0", f"{RID}_1_12", f"{RID}_", f"cleanup_{RID}", f"kv_0_1_{RID}"]
KEPT = [f"{RID}2_0_0", f"x{RID}", f"{RID}x", f"a_{RID}_b", "chatcmpl-70_0_0", "other_0_0"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_cleanup_drops_the_key_and_the_keys_derived_from_the_request_id(
    mode: str, short_tmp: Path, stack: ExitStack
) -> None:
    endpoints = _endpoints(short_tmp)
    sender = stack.enter_context(ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "sender", "stage_id": 0}))
    receiver = stack.enter_context(
        ZmqConnector({"mode": mode, "endpoints": endpoints, "role": "receiver", "stage_id": 1})
    )
    for key in [*DROPPED, *KEPT]:
        assert sender.put("0", "1", key, {"key": key})[0]
    # one connection keeps order: once the last put is here, every earlier one is too
    ok, _, meta = sender.put("0", "1", "barrier", {"key": "barrier"})
    assert ok and receiver.get("0", "1", "barrier", meta) is not None
    # main calls cleanup on whichever connector it holds; the data sits at the receiver (push) or the sender (pull)
    sender.cleanup(RID)
    receiver.cleanup(RID)
    for key in DROPPED:
        assert receiver.get("0", "1", key) is None, f"{key} should be gone after cleanup({RID!r})"
    for key in KEPT:
        got = receiver.get("0", "1", key)
        assert got is not None and got[0] == {"key": key}, f"{key} must survive cleanup({RID!r})"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_cleanup_of_an_unknown_or_consumed_request_is_harmless(mode: str, short_tmp: Path, stack: ExitStack) -> None:
    putter, (getter, other) = _pair("twin", mode, short_tmp, stack)
    ok, _, meta = putter.put("0", "1", "consumed_req_99", {"consumed": True})
    assert ok and getter.get("0", "1", "consumed_req_99", meta) is not None
    for connector in (putter, getter, other):
        connector.cleanup("req_99")
        connector.cleanup("never-seen")
    ok, _, meta = putter.put("0", "1", "req_100_0_0", {"fresh": True})
    assert ok
    got = getter.get("0", "1", "req_100_0_0", meta)
    assert got is not None and got[0] == {"fresh": True}, "a put after cleanup is delivered"
