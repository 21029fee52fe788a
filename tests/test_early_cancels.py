"""Cleanups before the bind are kept once: in the endpoint's record until it binds, then in its receiver's."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from zmq_omni.connectors._expected_puts import ExpectedPuts, adopt, cancel_early, expect, release
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import Tombstones
from zmq_omni.transport._mailbox import Mailbox
from zmq_omni.transport._receive_protocol import Item


def _endpoint() -> str:
    return f"ipc:///tmp/cancels-{uuid.uuid4().hex[:12]}"


def test_absorbed_tombstones_keep_their_lapse_times_and_firmness() -> None:
    mine, early = Tombstones(10.0, 8), Tombstones(100.0, 8)
    mine.bury(0.0, key="a")
    early.bury(0.0, key="b", firm=True)
    early.bury(0.0, prefix="req_", firm=True)
    early.bury(-200.0, key="lapsed")
    mine.absorb(early, 1.0)
    assert mine.covers("b", 50.0) and mine.covers("req_12", 50.0)
    assert not mine.covers("lapsed", 1.0)
    mine.lift("b")  # a get asks for it again: a firm tombstone stays
    assert mine.covers("b", 50.0)
    assert mine.lapse(11.0) == 1 and len(mine) == 2  # "a" lapsed first
    assert not mine.covers("a", 11.0) and mine.covers("b", 11.0)


def test_a_mailbox_taking_over_cleanups_drops_what_they_cover_now_and_later() -> None:
    dropped: list[bool] = []
    mailbox = Mailbox(tombstone_ttl_s=1.0, max_tombstones=8, on_left=dropped.append)
    now = time.monotonic()
    mailbox.store(
        [(("0", "1", "req_1"), Item("x", 1, "s", 1, None, now)), (("0", "1", "k"), Item("y", 1, "s", 2, None, now))],
        now,
    )
    early = Tombstones(60.0, 8)
    early.bury(now, prefix="req_", firm=True)
    assert mailbox.bury_all(early) == 1
    assert mailbox.pop(("0", "1", "req_1")) is None  # dropped, and a get lifts nothing firm
    assert mailbox.buries("req_2")
    mailbox.store([(("0", "1", "req_2"), Item("z", 1, "s", 3, None, now))], time.monotonic())
    assert mailbox.pop(("0", "1", "req_2")) is None
    got = mailbox.pop(("0", "1", "k"))
    assert got is not None
    assert [seq for _, seq, _ in mailbox.handover()[1]] == [1, 3]  # both dropped as cancelled


def test_cleanups_before_the_bind_live_in_the_record_and_leave_it_at_the_bind() -> None:
    endpoint = _endpoint()
    now = time.monotonic()
    record = expect(endpoint, ("0", "1", "r1_0"), now + 30, unbound=True)
    assert record is not None
    assert cancel_early(lambda k: k.startswith("r1"), [endpoint], key="r1", prefix=None, ttl_s=30) == []
    assert record.cancelled is not None and not record.slots
    assert record.cancelled.covers("r1_0", now) and record.cancelled.covers("r1", now)
    assert expect(endpoint, ("0", "1", "r1"), now + 30, unbound=True) is None  # cancelled: not expected
    # The bind: its part takes them over (here a part that is no push receiver: nothing to bury) and the
    # record keeps none; a cleanup from then on is handed back to apply at the bound part itself.
    shared = cast(Any, SimpleNamespace(part=None))
    adopted = adopt([endpoint], ExpectedPuts(), shared)
    assert adopted is record and record.bound is shared and record.cancelled is None
    assert cancel_early(lambda k: k == "r2", [endpoint], key="r2", prefix=None, ttl_s=30) == []
    assert record.cancelled is None
    assert expect(endpoint, ("0", "1", "r1"), now + 30, unbound=False) is record  # bound: expected there
    release([endpoint], record)
    assert record.bound is None


def test_a_binding_receiver_takes_the_cleanups_over_and_the_record_keeps_none(
    made: list[ZmqConnector], short_tmp: Path
) -> None:
    conn = ZmqConnector({"endpoints": {"0": f"ipc://{short_tmp}/s0", "1": f"ipc://{short_tmp}/s1"}})
    made.append(conn)
    assert conn.cleanup_prefix("req_") == 0  # not bound yet: kept in the endpoint's record
    assert conn.get("0", "1", "other") is None  # its first get binds
    shared, receiver = conn._bound.shared, conn._bound.receiver
    assert shared is not None and receiver is not None
    assert shared.expected.cancelled is None and shared.expected.bound is shared
    assert receiver.buries("req_7") and not receiver.buries("other")
