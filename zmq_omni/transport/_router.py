"""Receiving one whole message from a ROUTER without trusting its sender."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..metrics import Counters
from ._loop import Driver
from ._security import Curve, watch_refusals
from ._sockets import bind, close_socket, make_socket

_TRIM_STEP_BYTES = 32 << 20  # the heap's top handed back a call at a time
_TRIM_PAUSE_S = 0.005  # between those calls: the loop's thread takes the heap's lock meanwhile

__all__ = ["RoutedReader", "open_router", "trim_malloc", "trim_malloc_in_steps"]


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

    @property
    def reading(self) -> bool:
        """True while a message read in part waits for its next call."""
        return self._identity is not None

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
    libc = _load_libc()
    if libc and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def trim_malloc_in_steps(step_bytes: int = _TRIM_STEP_BYTES, pause_s: float = _TRIM_PAUSE_S) -> None:
    """:func:`trim_malloc` a slice at a time, pausing between slices: for a thread beside an event loop.

    ``malloc_trim`` holds the main heap's lock while it hands pages back (~60-130 ms for
    640 MB on 2 loaded cores), and the loop's thread allocates from that heap: it waits
    as long. Trimming the heap's free top ``step_bytes`` at a time (the ``pad`` of
    ``malloc_trim`` keeps the rest), with ``pause_s`` between calls, makes each wait short
    (3-7 ms for 32 MB). Free memory below a live block goes back in the last call, whole.
    """
    libc = _load_libc()
    if not libc or not hasattr(libc, "malloc_trim"):
        return
    top = _releasable_top(libc)
    pad = top - step_bytes
    while pad > 0:
        libc.malloc_trim(ctypes.c_size_t(pad))
        time.sleep(pause_s)
        pad -= step_bytes
    libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _releasable_top(libc: Any) -> int:
    """The main heap's free top (``mallinfo2().keepcost``), or 0 where glibc has no ``mallinfo2``."""
    if not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().keepcost)


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    return _libc


_libc: Any = None


def open_router(
    loop: Driver, endpoint: str, *, hwm: int, max_message_bytes: int, curve: Curve | None, counters: Counters
) -> tuple[Any, Callable[[], None] | None]:
    """A bound ROUTER at ``endpoint`` (a CURVE server when ``curve`` is given) and how to stop watching it.

    With CURVE its refusals are counted in ``counters`` by a monitor the returned stop ends; whoever
    closes the socket calls it first, on the driver (the monitor is the socket's too). A failed bind
    closes both and raises.
    """
    sock = make_socket(loop.ctx, zmq.ROUTER, hwm=hwm, max_message_bytes=max_message_bytes)
    stop_refusals: Callable[[], None] | None = None
    try:
        if curve is not None:
            curve.make_server(sock)
            stop_refusals = watch_refusals(loop, sock, counters, stop_on_stop=False)
        bind(sock, endpoint)
    except BaseException:
        if stop_refusals is not None:
            stop_refusals()
        close_socket(sock)
        raise
    return sock, stop_refusals
