"""Blocking gets on a push receiver, alone and many at once: what reaches them and what their senders hear.

A lone ``get_with_deadline`` may read the receiver's socket itself; whoever reads,
other getters are fed, consumptions are acknowledged, what arrives while nobody
waits reaches the mailbox, and close wakes every getter. Real sockets over ipc,
in one process.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport._signal import thread_sleeper

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
        time.sleep(0.2)  # (it waits now, reading the socket or not: what follows holds either way)
        for i in range(40):
            ok, _, _ = sender.put("0", "1", f"k{i}", {"i": i})
            assert ok, sender.drain_failures()
            got = receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 10)
            assert got is not None and got[0] == {"i": i}
        assert waiter.is_alive()
        assert sender.flush(10.0)
        receiver.close()  # wakes the reading getter: it returns None at once
        waiter.join(5)
        assert not waiter.is_alive() and waiter.result is None


def test_close_wakes_a_reading_getter(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, _):
        waiter = _Getter(receiver, "never", 60.0)
        waiter.start()
        time.sleep(0.2)
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


def test_what_queued_behind_a_getters_item_reaches_the_mailbox_and_is_acknowledged(short_tmp: Path) -> None:
    # Three puts queue before any get; a getter of the first one reads the socket and returns with it.
    # The two behind it must still reach the mailbox with nobody waiting for them, and be acknowledged.
    with _edge(short_tmp, heartbeat_s=3600.0) as (receiver, sender):
        for round_no in range(20):
            keys = [f"{round_no}-{name}" for name in ("a", "b", "c")]
            for key in keys:
                assert sender.put("0", "1", key, {"k": key})[0]
            got = receiver.get_with_deadline("0", "1", keys[0], deadline=time.monotonic() + 10)
            assert got is not None and got[0] == {"k": keys[0]}
            assert wait_until(lambda: receiver.health()["mailbox"] == 2, 10), receiver.health()
            for key in keys[1:]:
                got = receiver.get("0", "1", key)
                assert got is not None and got[0] == {"k": key}
        assert sender.flush(10.0)


def test_a_forked_child_waits_on_a_sleeper_of_its_own() -> None:
    # A wake meant for the parent's thread must not be read by a wait in the child (they would share an eventfd).
    parent = thread_sleeper()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        child = thread_sleeper()
        parent.wake()  # (the parent's eventfd, inherited): the child's wait must not see it
        start = time.monotonic()
        child.wait(0.05)
        os._exit(0 if child is not parent and child.fd != parent.fd and time.monotonic() - start >= 0.04 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    parent.wait(0.0)  # what the child wrote to the parent's eventfd is read: it ends at once
    start = time.monotonic()
    parent.wait(0.05)  # and the next wait sleeps its time
    assert time.monotonic() - start >= 0.04
