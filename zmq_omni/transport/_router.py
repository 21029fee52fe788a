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
    # A routed message always has a frame after the identity; getsockopt is cheaper than .rcvmore.
    frames: list[Any] = [sock.recv()]
    ok = True
    while sock.getsockopt(zmq.RCVMORE):
        if len(frames) > max_frames:
            sock.recv(copy=False)
            ok = False
        else:
            frames.append(sock.recv(copy=False))
    return identity, frames, ok
