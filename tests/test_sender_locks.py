"""The push sender's data-socket hand-over (:class:`Peer`), driven directly: each race forced with a real socket.

The I/O thread's part is played by a helper thread at the exact moment the race needs, so each test is
deterministic: closing at stop never closes a data socket a put thread holds, and a PING a beat left owed
is sent as the holder lets go.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from zmq_omni.metrics import Counters
from zmq_omni.transport import IoLoop
from zmq_omni.transport._send_window import SendWindow
from zmq_omni.transport._sender_core import Peer, SenderCore
from zmq_omni.transport._sender_io import SenderIo


@pytest.fixture
def sender(short_tmp: Path) -> Iterator[tuple[SenderCore, SenderIo, Peer, Any]]:
    """A sender's shared state, its I/O side and the peer of stage 1, with a ROUTER there to accept sends."""
    endpoint = f"ipc://{short_tmp}/locks.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)  # a peer, so the data socket's sends are accepted
    loop = IoLoop("test-locks")  # never started: this thread plays the I/O thread
    window = SendWindow(max_count=8, max_bytes=1 << 20, delivery_timeout_s=5.0)
    core = SenderCore(
        loop,
        window,
        sid="locks",
        hwm=100,
        counters=Counters(),
        on_failure=lambda *args: None,
        curve=None,
        shm=None,
        batch_max_messages=256,
        batch_item_bytes=4096,
    )
    io = SenderIo(core, heartbeat_s=1.0, peer_timeout_s=5.0, delivery_timeout_s=5.0)
    peer = core.peers["1"] = Peer(core, window.peer("1"), endpoint, None)
    try:
        yield core, io, peer, router
    finally:
        with core.lock:
            core.closed = True
        loop.stop()
        router.close(linger=0)
        ctx.term()


def test_closing_never_closes_a_data_socket_a_put_thread_holds(sender: tuple[SenderCore, SenderIo, Peer, Any]) -> None:
    _, io, peer, _ = sender
    peer.data_lock.acquire()  # this (the put) thread holds the data socket
    sock = peer.socket()
    io.close_sockets()  # the I/O thread at stop: the put thread has not let go within its wait
    assert not sock.closed, "the data socket was closed under its holder"
    peer.release()  # the holder lets go: it closes the socket itself
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

    def locked(self) -> bool:
        return self._lock.locked()

    def release(self) -> None:
        if self.armed:
            self.armed = False
            self._racer.start()
            self._racer.join(0.3)  # a racer that waits for the holder is let through after the release
        self._lock.release()


def test_a_beat_that_finds_the_socket_held_is_never_lost(sender: tuple[SenderCore, SenderIo, Peer, Any]) -> None:
    _, io, peer, router = sender
    racer = threading.Thread(target=io.ping, args=(peer,))  # the heartbeat, on the I/O thread
    lock = _RaceAtRelease(racer)
    peer.data_lock = lock  # type: ignore[assignment]
    lock.acquire()
    peer.socket()
    lock.armed = True
    peer.release()  # the put thread lets go while the beat tries the socket
    racer.join(5.0)
    assert not racer.is_alive()
    assert peer.ping_no == 1 and not peer.ping_owed, "the PING the beat left owed was never sent"
    assert router.poll(5000)
    assert router.recv_multipart()[1][:2] == b"ZT"
