"""Gets of a key this process put to one of its own endpoints (vllm-omni's put-then-get in one process).

A get waits for such a put, bounded by its window; it never waits when another connector of the
same endpoint took the item or when the receiver will drop it, and a put that a receiver would
refuse fails at the put.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import EncodeError
from zmq_omni.wire import DecodeLimits, encode


def _spec(short_tmp: Path, **extra: Any) -> dict[str, Any]:
    return {"endpoints": {str(s): f"ipc://{short_tmp}/s{s}" for s in range(2)}, **extra}


def test_two_bare_connectors_of_one_spec_put_then_get_never_misses(made: list[ZmqConnector], short_tmp: Path) -> None:
    # vllm-omni's two connectors of one spec, no role: A puts before anyone bound; B's first get binds.
    a, b = ZmqConnector(_spec(short_tmp)), ZmqConnector(_spec(short_tmp))
    made += [a, b]
    for n in range(20):
        assert a.put("0", "1", f"k{n}", n)[0]
        got = b.get("0", "1", f"k{n}")
        assert got is not None and got[0] == n, n


def test_a_put_with_no_wait_window_is_still_a_put(made: list[ZmqConnector], short_tmp: Path) -> None:
    # metadata_get_timeout_s=0: nothing to wait for, and nothing kept for a get to wait on.
    conn = ZmqConnector(_spec(short_tmp, metadata_get_timeout_s=0))
    made.append(conn)
    for n in range(3):
        assert conn.put("0", "1", f"k{n}", n)[0]
    got = [conn.get_with_deadline("0", "1", f"k{n}", deadline=time.monotonic() + 5) for n in range(3)]
    assert [g[0] if g else None for g in got] == [0, 1, 2]


def test_a_get_does_not_wait_for_a_put_another_connector_took(made: list[ZmqConnector], short_tmp: Path) -> None:
    spec = _spec(short_tmp, stage_id=1, role="dual", shm="off")
    a, b = ZmqConnector(dict(spec)), ZmqConnector(dict(spec))
    made += [a, b]
    for n in range(3):
        outcome: dict[str, tuple[bool, float]] = {}

        def get(name: str, conn: ZmqConnector, key: str, outcome: dict[str, tuple[bool, float]]) -> None:
            started = time.monotonic()
            found = conn.get("1", "1", key) is not None
            outcome[name] = (found, time.monotonic() - started)

        assert a.put("1", "1", f"k{n}", np.ones(24 << 20, dtype=np.uint8))[0]  # a while on its way
        threads = [threading.Thread(target=get, args=(name, c, f"k{n}", outcome)) for name, c in (("a", a), ("b", b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        assert sorted(found for found, _ in outcome.values()) == [False, True], outcome
        # The one that did not get it stops waiting once the other took it, not at the window's end (5 s).
        assert max(took for _, took in outcome.values()) < 2.5, outcome


def test_a_put_the_receiver_buries_is_not_waited_for(made: list[ZmqConnector], short_tmp: Path) -> None:
    # cleanup(key) on the receiving side leaves a tombstone: our own put of that key is dropped
    # on arrival, so neither a plain get nor an awaited one may wait its window (30 s) for it.
    conn = ZmqConnector(_spec(short_tmp, stage_id=1, role="dual", metadata_get_timeout_s=30))
    made.append(conn)
    conn.cleanup("gone")
    assert conn.put("1", "1", "gone", np.ones(1 << 20, dtype=np.uint8))[0]
    started = time.monotonic()
    assert conn.get("1", "1", "gone") is None
    assert time.monotonic() - started < 2.0


def test_a_tree_a_receiver_would_refuse_fails_at_the_put(made: list[ZmqConnector], short_tmp: Path) -> None:
    deep: Any = 0
    for _ in range(40):
        deep = [deep]
    conn = ZmqConnector(_spec(short_tmp, stage_id=1, role="dual"))
    made.append(conn)
    with pytest.raises(EncodeError, match="deeper than the limit of 32"):
        conn.put("1", "1", "deep", deep)
    shallow: Any = 0
    for _ in range(31):
        shallow = [shallow]
    assert conn.put("1", "1", "ok", shallow)[0]
    assert encode(deep, limits=DecodeLimits(max_depth=64))  # the caller's limits decide
