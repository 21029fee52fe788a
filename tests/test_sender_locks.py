"""The push sender's data-socket hand-over (:class:`Peer`), driven directly with a real socket.

This thread plays both the put thread and the I/O thread, so the race is deterministic: closing at stop
never closes a data socket a put thread holds.
"""

from __future__ import annotations

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
