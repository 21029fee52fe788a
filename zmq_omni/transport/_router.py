"""Receiving one whole message from a ROUTER without trusting its sender."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any

import zmq

__all__ = ["RoutedReader", "recv_routed", "trim_malloc"]


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


class RoutedReader:
    """Reads routed messages across turns: each call stops at a time limit, even inside one message.

    libzmq queues a multipart message whole before its first frame can be read, and a
    message has no frame-count bound, so one message may take a million ``recv`` calls.
    :meth:`read` takes frames until its ``until`` (``time.monotonic()``) and carries a
    message it is in the middle of to the next call (a skip state): a turn of an event
    loop stays bounded. Frames past ``keep`` are read and dropped (the message comes back
    with ``ok=False``); past ``max_frames`` the reader gives up on the socket
    (:attr:`overflowed`): only closing it frees the rest of that message, and reading it
    to its end would keep every other peer waiting.

    Used by the socket's driver only, as the socket is.
    """

    __slots__ = ("_count", "_frames", "_identity", "_ok", "keep", "max_frames", "overflowed", "sock")

    _LOOK_EVERY = 64  # frames read between looks at the clock

    def __init__(self, sock: Any, keep: int, max_frames: int) -> None:
        self.sock = sock
        self.keep = keep
        self.max_frames = max_frames
        self.overflowed = False
        self._identity: bytes | None = None  # of the message being read across calls
        self._frames: list[Any] = []
        self._ok = True
        self._count = 0

    def read(self, until: float) -> tuple[bytes, list[Any], bool] | None:
        """The next whole message ``(identity, frames, ok)``; None when nothing more is queued, or at ``until``.

        Frame 0 is copied (``bytes``), later frames are ``zmq.Frame`` objects.
        """
        sock = self.sock
        if self._identity is None:
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            head = sock.recv(copy=False)
            if not head.more:
                return identity, [head.bytes], True
            self._identity, self._frames, self._ok, self._count = identity, [head.bytes], True, 1
        frames, keep, limit, look = self._frames, self.keep, self.max_frames, self._LOOK_EVERY
        while True:
            frame = sock.recv(copy=False)
            self._count += 1
            if len(frames) < keep:
                frames.append(frame)
            else:
                self._ok = False
            if not frame.more:
                break
            if self._count > limit:
                self.overflowed = True
                return None
            if not self._count % look and time.monotonic() > until:
                return None
        message = (self._identity, frames, self._ok)
        self._identity, self._frames = None, []
        return message


def trim_malloc() -> None:
    """Hand the C heap's free pages back to the OS (glibc; elsewhere nothing): after a huge message was freed."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


_libc: Any = None
