"""The push sender's lock discipline (issue 13's findings): each race forced with a real socket and a held lock.

The I/O thread's part is played by a helper thread at the exact moment the race needs, so each test is
deterministic; each fails on the sender before the split (it closed a held data socket, and lost an owed PING).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from zmq_omni.metrics import Counters
from zmq_omni.transport import EndpointMap, IoLoop, PushSender


@pytest.fixture
def sender(short_tmp: Path) -> Iterator[tuple[PushSender, Any]]:
    endpoint = f"ipc://{short_tmp}/locks.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)  # a peer, so the data socket's sends are accepted
    loop = IoLoop("test-locks")  # never started: this thread plays the I/O thread
    push = PushSender(
        loop,
        EndpointMap({"1": endpoint}),
        sid="locks",
        put_timeout_s=1.0,
        delivery_timeout_s=5.0,
        heartbeat_s=1.0,
        peer_timeout_s=5.0,
        max_unacked=8,
        max_unacked_bytes=1 << 20,
        hwm=100,
        counters=Counters(),
        on_failure=lambda *args: None,
    )
    try:
        yield push, router
    finally:
        push.close()
        loop.stop()
        router.close(linger=0)
        ctx.term()


def _held_peer(push: PushSender) -> Any:
    """The peer of stage 1 with its data socket open and its ``data_lock`` held by this (the put) thread."""
    with push._lock:
        peer = push._peer("1")
    peer.data_lock.acquire()
    push._open_data(peer)
    return peer


def test_closing_never_closes_a_data_socket_a_put_thread_holds(sender: tuple[PushSender, Any]) -> None:
    push, _ = sender
    peer = _held_peer(push)
    sock = peer.data_sock
    push._close_sockets()  # the I/O thread at stop: the put thread has not let go within its wait
    assert not sock.closed, "the data socket was closed under its holder"
    push._release(peer)  # the holder lets go: it closes the socket itself
    assert sock.closed and peer.data_sock is None
    assert peer.data_lock.acquire(False)
    peer.data_lock.release()


class _RaceAtRelease:
    """A ``data_lock`` whose release lets the I/O thread try the socket just before letting go."""

    def __init__(self, racer: threading.Thread) -> None:
        self._lock = threading.Lock()
        self._racer = racer
        self.armed = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        if self.armed:
            self.armed = False
            self._racer.start()
            self._racer.join(0.3)  # a racer that waits for the holder is let through after the release
        self._lock.release()


def test_a_beat_that_finds_the_socket_held_is_never_lost(sender: tuple[PushSender, Any]) -> None:
    push, router = sender
    with push._lock:
        peer = push._peer("1")
    racer = threading.Thread(target=push._ping, args=(peer,))  # the heartbeat, on the I/O thread
    lock = peer.data_lock = _RaceAtRelease(racer)
    lock.acquire()
    push._open_data(peer)
    lock.armed = True
    push._release(peer)  # the put thread lets go while the beat tries the socket
    racer.join(5.0)
    assert not racer.is_alive()
    assert peer.ping_no == 1 and not peer.ping_owed, "the PING the beat left owed was never sent"
    assert router.poll(5000)
    assert router.recv_multipart()[1][:2] == b"ZT"
