"""Receiving one whole message from a ROUTER without trusting its sender."""

from __future__ import annotations

from typing import Any

import zmq

__all__ = ["recv_routed"]


def recv_routed(sock: Any, max_frames: int) -> tuple[bytes, list[Any], bool] | None:
    """Read ``(identity, frames, ok)`` without blocking, or None when nothing is queued.

    Frame 0 (the small transport header) is copied, which is the cheap path for
    small messages; later frames come as zero-copy ``zmq.Frame`` objects. A
    message with more than ``max_frames`` frames is drained and returned with
    ``ok=False`` so one hostile message cannot desynchronise the socket.
    """
    try:
        identity = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    # A routed message always has a frame after the identity. Received as a Frame, whose ``more``
    # is read from the message itself: ``getsockopt(RCVMORE)`` is a call into ZeroMQ (~0.4 us more).
    head = sock.recv(copy=False)
    frames: list[Any] = [head.bytes]
    ok = True
    more = head.more
    while more:
        frame = sock.recv(copy=False)
        more = frame.more
        if len(frames) > max_frames:
            ok = False
        else:
            frames.append(frame)
    return identity, frames, ok
