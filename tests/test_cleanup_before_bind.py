"""``cleanup`` on a push receiver that has not bound its endpoint yet (it binds at its first ``get``).

What a cleanup cancels is never delivered afterwards, whenever it arrives, for ``tombstone_ttl_s``:
neither the binding ``get`` of the same key nor any later one brings it back, whether the put came
from another connector (a sender of another stage) or from this process before anything bound.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.connectors.zmq import ZmqConnector

from .conftest import wait_until


def _spec(short_tmp: Path, **extra: Any) -> dict[str, Any]:
    return {"endpoints": {"1": f"ipc://{short_tmp}/s1"}, "shm": "off", "heartbeat_s": 0.05, **extra}


def _dropped(conn: ZmqConnector) -> int:
    """What ``conn``'s receiver dropped as cancelled: on arrival, or already in at the bind."""
    health = conn.health()
    return int(health["dropped_late"] + health["dropped_cleanup"])


def _cancel(conn: ZmqConnector, how: str) -> str:
    """Clean up request ``rid`` on ``conn`` as ``how`` says; the key that cleanup cancels."""
    if how == "cleanup":
        conn.cleanup("rid")
        return "rid"
    conn.cleanup_prefix("rid_0_")
    return "rid_0_3"


@pytest.mark.parametrize("how", ["cleanup", "cleanup_prefix"])
@pytest.mark.parametrize("putter", ["another stage's sender", "a bare connector of this process"])
def test_a_put_cleaned_up_before_the_bind_is_never_delivered(
    made: list[ZmqConnector], short_tmp: Path, how: str, putter: str
) -> None:
    receiver = ZmqConnector(_spec(short_tmp))  # no role: binds at its first get
    if putter == "another stage's sender":
        sender = ZmqConnector(_spec(short_tmp, stage_id="0", role="sender"))
    else:
        sender = ZmqConnector(_spec(short_tmp))
    made += [receiver, sender]
    key = "rid" if how == "cleanup" else "rid_0_3"
    assert sender.put("0", "1", key, 7)[0]  # on its way to an endpoint nobody bound yet
    assert _cancel(receiver, how) == key
    assert receiver.get("0", "1", key) is None  # binds; the put arrives after this
    # It arrives and is dropped as cancelled: no later get returns it.
    assert wait_until(lambda: _dropped(receiver) == 1), receiver.health()
    assert receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 0.3) is None
    assert receiver.health()["mailbox"] == 0
    assert wait_until(lambda: sender.health()["receiver_dropped_cancelled"] == 1), sender.health()


def test_a_put_made_after_a_cleanup_before_the_bind_is_not_waited_for(
    made: list[ZmqConnector], short_tmp: Path
) -> None:
    # Two bare connectors of one spec in one process: the cleanup comes first, then our own put
    # of that key. The binding get must neither wait its window (30 s) for it nor deliver it.
    receiver = ZmqConnector(_spec(short_tmp, metadata_get_timeout_s=30))
    sender = ZmqConnector(_spec(short_tmp, metadata_get_timeout_s=30))
    made += [receiver, sender]
    receiver.cleanup("rid")
    assert sender.put("0", "1", "rid", 1)[0]
    started = time.monotonic()
    assert receiver.get("0", "1", "rid") is None
    assert time.monotonic() - started < 10.0
    assert wait_until(lambda: _dropped(receiver) == 1), receiver.health()
    assert receiver.get("0", "1", "rid") is None


def test_a_cleanup_on_a_connector_not_yet_bound_reaches_the_endpoint_another_one_bound(
    made: list[ZmqConnector], short_tmp: Path
) -> None:
    # Two connectors of one spec in one process: one receives already, the other has not bound yet.
    bound = ZmqConnector(_spec(short_tmp))
    assert bound.get("0", "1", "warm") is None  # binds
    unbound = ZmqConnector(_spec(short_tmp))
    sender = ZmqConnector(_spec(short_tmp, stage_id="0", role="sender"))
    made += [bound, unbound, sender]
    unbound.cleanup_prefix("rid_0_")
    assert sender.put("0", "1", "rid_0_1", 1)[0]
    assert bound.get("0", "1", "rid_0_1") is None
    assert wait_until(lambda: bound.health()["dropped_late"] == 1), bound.health()
    assert bound.get("0", "1", "rid_0_1") is None


@pytest.mark.parametrize("how", ["cleanup", "cleanup_prefix"])
def test_a_get_after_a_cleanup_does_not_bring_a_late_put_back(
    made: list[ZmqConnector], short_tmp: Path, how: str
) -> None:
    receiver = ZmqConnector(_spec(short_tmp, stage_id="1", role="receiver"))
    sender = ZmqConnector(_spec(short_tmp, stage_id="0", role="sender"))
    made += [receiver, sender]
    key = _cancel(receiver, how)
    assert receiver.get("0", "1", key) is None  # asked for after the cleanup, before the put arrives
    assert sender.put("0", "1", key, 3)[0]
    assert wait_until(lambda: receiver.health()["dropped_late"] == 1), receiver.health()
    assert receiver.get("0", "1", key) is None
    # abandon_get is the caller giving up its wait: a get of that key asks for it again.
    receiver.abandon_get("other")
    assert receiver.get("0", "1", "other") is None
    assert sender.put("0", "1", "other", 4)[0]
    got = receiver.get_with_deadline("0", "1", "other", deadline=time.monotonic() + 5)
    assert got is not None and got[0] == 4
