"""A get's take wakes the receiving driver only when no acknowledgement flush is due (real sockets).

One put at a time and its get, as a pipeline stage does: each arrival leaves a flush due
(``ack_delay_s``), and the flush hands over what the gets took meanwhile, so the getter
need not tell the driver of each take (a wake-up of the driver's thread, and the GIL it
takes, beside the getter's next put). The consumptions still reach the sender.
"""

from __future__ import annotations

import time
from pathlib import Path

from zmq_omni.connectors.zmq import ZmqConnector

from .test_zmq_failures import connectors, make

__all__ = ["connectors"]


def test_lone_round_trips_wake_the_driver_for_few_takes_and_every_put_is_confirmed(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    recv = make(connectors, stage_id="1", role="receiver", endpoints={"1": f"ipc://{short_tmp}/r.sock"})
    send = make(connectors, stage_id="0", role="sender", endpoints={"1": recv.endpoint})
    mailbox = recv._bound.receiver.mailbox  # type: ignore[union-attr]
    told: list[bool] = []
    on_left = mailbox._on_left

    def counting(heavy: bool) -> None:
        told.append(heavy)
        on_left(heavy)

    mailbox._on_left = counting
    count = 200
    for i in range(count):
        time.sleep(0.002)  # paced (a stage's chunks): ~20 ack flushes in all
        assert send.put("0", "1", f"k{i}", {"i": i})[0]
        got = recv.get_with_deadline("0", "1", f"k{i}", None, deadline=time.monotonic() + 10)
        assert got is not None and got[0] == {"i": i}
    # Before: the first take after each flush's hand-over told the driver (20-25 here, one a flush). Now only
    # a take that a flush's hand-over (every ack_delay_s) overtook between the store and the take does (0-7).
    assert len(told) <= count // 20, f"{len(told)} takes of {count} woke the driver"
    deadline = time.monotonic() + 10
    while send.health()["pending"] and time.monotonic() < deadline:  # every consumption reaches the sender
        time.sleep(0.01)
    assert send.health()["pending"] == 0


def test_a_stream_paced_just_under_the_ack_delay_is_acknowledged_on_its_arrivals_turns(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    recv = make(connectors, stage_id="1", role="receiver", endpoints={"1": f"ipc://{short_tmp}/r.sock"})
    send = make(connectors, stage_id="0", role="sender", endpoints={"1": recv.endpoint})
    receiver = recv._bound.receiver  # type: ignore[union-attr]
    timed: list[float] = []
    flush_due = receiver._flush_due

    def counting() -> None:
        timed.append(time.monotonic())
        flush_due()

    receiver._flush_due = counting
    count = 40
    for i in range(count):
        time.sleep(0.017)  # each arrival 3 ms before the flush its predecessor left due (ack_delay_s 20 ms)
        assert send.put("0", "1", f"k{i}", {"i": i})[0]
        got = recv.get_with_deadline("0", "1", f"k{i}", None, deadline=time.monotonic() + 10)
        assert got is not None and got[0] == {"i": i}
    # Before: a timer woke the driver to flush 3 ms after every other arrival (~20). Now the arrivals' turns do.
    assert len(timed) <= count // 4, f"{len(timed)} flushes of {count} arrivals woke the driver"
    deadline = time.monotonic() + 10
    while send.health()["pending"] and time.monotonic() < deadline:  # every consumption reaches the sender
        time.sleep(0.01)
    assert send.health()["pending"] == 0
