"""An IoLoop's turns: a call that a call queues runs on a later turn (real loop thread).

The receive socket's and the pull router's read budget is a turn's; the receiver hands a
flood's rest to the driver's next turn by queueing ``_drive`` again, so that call must read
on a budget of its own, not on the spent one of the call that queued it.
"""

from __future__ import annotations

import threading

import pytest

from zmq_omni.transport import IoLoop


@pytest.mark.timeout(30)
def test_a_call_queued_by_a_call_runs_on_a_later_turn() -> None:
    loop = IoLoop("test-turns")
    turns: list[int | None] = []
    done = threading.Event()

    def second() -> None:
        turns.append(loop.turn)
        done.set()

    def first() -> None:
        turns.append(loop.turn)
        loop.call_soon(second)  # (a flood's rest: "on the driver's next turn")

    loop.start()
    try:
        loop.call_soon(first)
        assert done.wait(5)
    finally:
        loop.stop()
    assert turns[0] != turns[1], f"both calls ran on turn {turns[0]}: the second reads on the first's spent budget"
