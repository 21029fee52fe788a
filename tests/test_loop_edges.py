"""The I/O loop watches a ZeroMQ socket by its edge-triggered ZMQ_FD: nothing queued is left unread (real sockets).

libzmq's descriptor signals a change, not a state: once a wake-up was spent, messages
already queued raise no new edge. The loop reads each socket's ZMQ_EVENTS (``zmq_poll``)
on every pass, so a handler that reads one message a call is called again until the socket
holds nothing, with no new arrival; a wake-up that brought no message calls no handler.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from zmq_omni.transport._loop import IoLoop


@pytest.fixture
def pair() -> Iterator[tuple[IoLoop, zmq.Socket[bytes], zmq.Socket[bytes]]]:
    loop = IoLoop("test-edges")
    pull = loop.ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = loop.ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield loop, pull, push
    finally:
        loop.stop()
        push.close()
        pull.close()


def _wait(cond: threading.Event, timeout: float = 5.0) -> bool:
    return cond.wait(timeout)


def test_a_burst_read_one_message_a_call_is_all_read_without_a_new_arrival(
    pair: tuple[IoLoop, zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    loop, pull, push = pair
    count = 50
    got: list[bytes] = []
    done = threading.Event()

    def one() -> None:  # reads one message a call: the rest raise no new edge
        try:
            got.append(pull.recv(zmq.NOBLOCK))
        except zmq.Again:
            return
        if len(got) == count:
            done.set()

    for i in range(count):  # all queued before the loop first waits on the descriptor
        push.send(b"%d" % i)
    deadline = time.monotonic() + 5
    while not pull.poll(0) and time.monotonic() < deadline:
        time.sleep(0.001)
    loop.add_reader(pull, one)
    loop.start()
    assert _wait(done), f"{len(got)} of {count} read"
    assert got == [b"%d" % i for i in range(count)]


def test_a_spent_edge_does_not_hide_a_message_and_an_empty_wake_calls_no_handler(
    pair: tuple[IoLoop, zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    loop, pull, push = pair
    got: list[bytes] = []
    calls = [0]
    arrived = threading.Event()

    def drain() -> None:
        calls[0] += 1
        while True:
            try:
                got.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        if got:
            arrived.set()

    loop.add_reader(pull, drain)
    loop.start()
    for _ in range(20):  # wake-ups with no message: the handler is not called for them
        loop.wake()
    time.sleep(0.05)
    assert calls[0] == 0
    push.send(b"x")
    assert _wait(arrived)
    assert got == [b"x"]
    # The next message after the loop went back to waiting wakes it too.
    arrived.clear()
    got.clear()
    push.send(b"y")
    assert _wait(arrived)
    assert got == [b"y"]


def test_each_handler_call_and_each_round_of_calls_is_a_turn_of_its_own(
    pair: tuple[IoLoop, zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    # A part's read budget is a turn's: it ends with the turn, with no call queued to end it.
    loop, pull, push = pair
    turns: list[tuple[str, int]] = []

    def one() -> None:
        try:
            pull.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        turns.append(("read", loop.turn))
        loop.call_soon(lambda: turns.append(("call", loop.turn)))

    loop.add_reader(pull, one)
    loop.start()
    for i in range(3):
        push.send(b"%d" % i)
        deadline = time.monotonic() + 5
        while len(turns) < 2 * (i + 1) and time.monotonic() < deadline:
            time.sleep(0.001)
    numbers = [turn for _, turn in turns]
    assert [kind for kind, _ in turns] == ["read", "call"] * 3
    assert numbers == sorted(numbers) and len(set(numbers)) == 6, turns
