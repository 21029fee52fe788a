"""The reading getter: a lone ``get_with_deadline`` reads the push receiver's socket itself (issue 14).

While a getter holds the socket, the I/O thread neither polls it nor sends on it:
what it must still do (acknowledge consumptions, answer pings, expire sources)
rides with the getter, other getters are fed by it, and after it leaves the
socket goes back to the I/O thread. Real sockets over ipc, in one process.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import zmq

from zmq_omni.connectors.zmq import ZmqConnector

from .conftest import wait_until


@contextmanager
def _edge(short_tmp: Path, heartbeat_s: float = 0.05, **sender: Any) -> Iterator[tuple[ZmqConnector, ZmqConnector]]:
    """A push receiver (stage 1) and a sender (stage 0) over ipc, both closed at the end."""
    common = {"endpoints": {"1": f"ipc://{short_tmp}/edge.sock"}, "shm": "off", "heartbeat_s": heartbeat_s}
    common["peer_timeout_s"] = max(3.0, 2 * heartbeat_s)
    with ExitStack() as stack:
        receiver = stack.enter_context(ZmqConnector({"stage_id": "1", "role": "receiver", **common}))
        sender_conn = stack.enter_context(ZmqConnector({"stage_id": "0", "role": "sender", **common, **sender}))
        yield receiver, sender_conn


class _Getter(threading.Thread):
    """A thread in one ``get_with_deadline``; ``result`` holds what it returned."""

    def __init__(self, conn: ZmqConnector, key: str, wait_s: float) -> None:
        super().__init__(daemon=True)
        self.conn, self.key, self.wait_s = conn, key, wait_s
        self.result: Any = "not returned"

    def run(self) -> None:
        self.result = self.conn.get_with_deadline("0", "1", self.key, deadline=time.monotonic() + self.wait_s)


def _reading(receiver: ZmqConnector) -> bool:
    """True while a getter holds the receiver's socket."""
    part = receiver._receiver
    assert part is not None
    return part._owner.locked() and not part._io_watching


def test_consumptions_are_acknowledged_while_a_getter_waits_for_something_else(short_tmp: Path) -> None:
    # A window of 4 puts: 40 puts go through only if the consumptions of the first ones are
    # acknowledged, which the reading getter (waiting for a key that never comes) must do for the I/O thread.
    # Heartbeats an hour apart: their pongs, which repeat consumptions, must not be what frees the window.
    with _edge(short_tmp, heartbeat_s=3600.0, max_unacked=4, put_timeout_s=10.0) as (
        receiver,
        sender,
    ):
        waiter = _Getter(receiver, "never", 60.0)
        waiter.start()
        assert wait_until(lambda: _reading(receiver), 10)
        for i in range(40):
            ok, _, _ = sender.put("0", "1", f"k{i}", {"i": i})
            assert ok, sender.drain_failures()
            got = receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 10)
            assert got is not None and got[0] == {"i": i}
        assert waiter.is_alive() and _reading(receiver)
        assert sender.flush(10.0)
        receiver.close()  # wakes the reading getter: it returns None at once
        waiter.join(5)
        assert not waiter.is_alive() and waiter.result is None


def test_close_wakes_a_reading_getter(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, _):
        waiter = _Getter(receiver, "never", 60.0)
        waiter.start()
        assert wait_until(lambda: _reading(receiver), 10)
        receiver.close()
        waiter.join(5)
        assert not waiter.is_alive() and waiter.result is None


def test_a_getter_that_timed_out_leaves_the_socket_to_the_next_and_to_the_io_thread(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, sender):
        assert receiver.get_with_deadline("0", "1", "late", deadline=time.monotonic() + 0.1) is None
        assert sender.put("0", "1", "late", {"v": 1})[0]
        # Nobody waits now: the I/O thread takes the socket back and acknowledges the arrival.
        assert wait_until(lambda: receiver.health()["mailbox"] == 1, 10)
        got = receiver.get("0", "1", "late")
        assert got is not None and got[0] == {"v": 1}
        assert sender.flush(10.0)


def test_wait_for_change_sees_arrivals_after_a_getter_borrowed_the_socket(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, sender):
        assert sender.put("0", "1", "first", {"v": 0})[0]
        assert receiver.get_with_deadline("0", "1", "first", deadline=time.monotonic() + 10) is not None
        generation = receiver.get_wakeup_generation()
        assert generation is not None
        assert sender.put("0", "1", "second", {"v": 1})[0]
        deadline = time.monotonic() + 10
        while receiver.get_wakeup_generation() == generation and time.monotonic() < deadline:
            receiver.wait_for_change(generation, timeout=1.0)
        assert receiver.get_wakeup_generation() != generation
        got = receiver.get("0", "1", "second")
        assert got is not None and got[0] == {"v": 1}


def test_many_getters_on_many_threads_receive_everything_once(short_tmp: Path) -> None:
    # Getters come and go on 8 threads, each waiting for its own keys in a random order while the
    # puts arrive in another: the socket passes between reading getters and the I/O thread all the time.
    keys = [f"k{i}" for i in range(800)]
    with _edge(short_tmp, max_unacked=1024) as (receiver, sender):  # room for all: any order
        got: dict[str, Any] = {}
        lock = threading.Lock()
        threads_before = threading.active_count()

        def consume(mine: list[str]) -> None:
            for key in mine:
                value = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 60)
                with lock:
                    got[key] = None if value is None else value[0]

        shuffled = random.Random(7).sample(keys, len(keys))
        consumers = [threading.Thread(target=consume, args=(shuffled[i::8],), daemon=True) for i in range(8)]
        for thread in consumers:
            thread.start()
        for i, key in enumerate(keys):
            ok, _, _ = sender.put("0", "1", key, {"i": i})
            assert ok, sender.drain_failures()
        for thread in consumers:
            thread.join(90)
        assert not any(thread.is_alive() for thread in consumers)
        assert got == {key: {"i": i} for i, key in enumerate(keys)}
        assert threading.active_count() == threads_before
        assert sender.flush(10.0)
        assert receiver.health()["mailbox"] == 0


def test_a_reading_getter_stops_at_its_item_and_the_io_thread_reads_what_queued_behind_it(short_tmp: Path) -> None:
    # The reading getter's drain stops once its own DATA is in (it does not ask ZeroMQ whether more is
    # queued, a call on every lone message's path); what queued behind must still reach the mailbox
    # once the getter leaves, read by the I/O thread, and be acknowledged. Driven by hand, as a
    # getter holding the socket would, so that all three puts are queued in ZeroMQ before the read.
    with _edge(short_tmp, heartbeat_s=3600.0) as (receiver, sender):
        part = receiver._receiver
        assert part is not None
        assert part._owner.acquire(timeout=10)
        try:
            part._loop.call_soon(part._unwatch)
            assert wait_until(lambda: not part._io_watching, 10)
            for key in ("a", "b", "c"):
                assert sender.put("0", "1", key, {"k": key})[0]
            assert wait_until(lambda: part._sock.get(zmq.EVENTS) & zmq.POLLIN, 10)
            time.sleep(0.3)  # the rest of the puts reach ZeroMQ's queue too
            part._on_readable("a")
            assert receiver.health()["mailbox"] == 1  # only "a": "b" and "c" wait in ZeroMQ's queue
        finally:
            part._release_owner()
        assert wait_until(lambda: receiver.health()["mailbox"] == 3, 10)  # the I/O thread took the rest in
        for key in ("a", "b", "c"):
            got = receiver.get("0", "1", key)
            assert got is not None and got[0] == {"k": key}
        assert sender.flush(10.0)
