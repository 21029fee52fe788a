"""A get run by a signal handler while the same thread's get sleeps (real sockets, the main thread).

Both waits are the thread's: the handler's get must not break the one it interrupted, and the
item the interrupted get waits for, arriving meanwhile, must still end its wait.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from zmq_omni.connectors.zmq import ZmqConnector

from .test_zmq_failures import connectors, make

__all__ = ["connectors"]


@pytest.mark.timeout(30)
def test_a_get_in_a_signal_handler_leaves_the_interrupted_get_working(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    outer = make(connectors, stage_id="1", role="receiver", endpoints={"1": f"ipc://{short_tmp}/a.sock"})
    inner = make(connectors, stage_id="2", role="receiver", endpoints={"2": f"ipc://{short_tmp}/b.sock"})
    send = make(connectors, stage_id="0", role="sender", endpoints={"1": outer.endpoint, "2": inner.endpoint})
    put = threading.Timer(0.1, lambda: send.put("0", "1", "outer", {"x": 1}))

    def handler(signum: int, frame: object) -> None:  # its get sleeps while the outer get's item arrives
        put.start()
        inner.get_with_deadline("0", "2", "never", None, deadline=time.monotonic() + 0.4)

    previous = signal.signal(signal.SIGUSR1, handler)
    kick = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    try:
        kick.start()
        start = time.monotonic()
        got = outer.get_with_deadline("0", "1", "outer", None, deadline=start + 10.0)
        waited = time.monotonic() - start
    finally:
        kick.join()
        put.join()
        signal.signal(signal.SIGUSR1, previous)
    assert got is not None and got[0] == {"x": 1}
    assert waited < 5.0, f"the interrupted get slept {waited:.1f} s past its item's arrival"
