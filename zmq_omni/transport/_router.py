"""Receiving one whole message from a ROUTER without trusting its sender."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..metrics import Counters
from ._loop import Driver
from ._security import Curve, watch_refusals
from ._sockets import bind, close_socket, make_socket, malloc_tuned

_TRIM_STEP_BYTES = 32 << 20  # the heap's top handed back a call at a time
_TRIM_PAUSE_S = 0.005  # between those calls: the loop's thread takes the heap's lock meanwhile
_TAKE_BYTES = 8 << 20  # free memory below the heap's top taken out and handed back a block at a time
_TAKE_FLOOR = 256 << 10  # free blocks smaller than this go back in the last malloc_trim
_TAKE_PAUSE_S = 0.002
_PAGE = mmap.PAGESIZE
_CHUNK_HEAD = 32  # bytes at a freed block's start that free() writes (its list links)

__all__ = ["RoutedReader", "open_router", "trim_malloc", "trim_malloc_in_steps", "trim_malloc_later", "trims"]


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

    def give_up(self) -> list[Any]:
        """The frames kept of the message it gave up on (:attr:`overflowed`), for the caller to let go of."""
        frames, self._identity, self._frames = self._frames, None, []
        return frames


def trim_malloc() -> None:
    """Hand the C heap's free pages back to the OS (glibc; elsewhere nothing): after a huge message was freed."""
    libc = _load_libc()
    if libc and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def trim_malloc_in_steps(step_bytes: int = _TRIM_STEP_BYTES, pause_s: float = _TRIM_PAUSE_S) -> None:
    """:func:`trim_malloc` in short steps with pauses between them: for a thread beside an event loop.

    One ``malloc_trim`` holds the heap's lock while it hands every free page back (90-140 ms
    for 640 MB on 2 loaded cores), and an event loop's thread allocates from that heap: it
    waits as long. In steps, no lock is held long. On a heap tuned by
    :func:`~zmq_omni.transport._sockets.tune_malloc` (one heap, no block ``mmap``'d, so every
    block is carved from it) the free memory is taken out of the heap a block of up to 8 MiB
    at a time (``malloc``, a few microseconds under the lock) and, the block being ours, its
    pages are handed back (``madvise(MADV_DONTNEED)``) with no lock held; the blocks are freed
    together at the end. Elsewhere the heap's free top goes back ``step_bytes`` a
    ``malloc_trim`` call (its ``pad`` keeps the rest; 3-7 ms for 32 MB), then a last
    ``malloc_trim(0)`` hands back what is left. On the tuned heap the last ``malloc_trim``
    runs while the taken blocks are still held: it walks only the free blocks under 256 KiB
    left in the heap (tenths of a millisecond under the lock, not the hundreds of MB just
    handed back), and its ``pad`` keeps the heap's top, so the heap's address range is not
    cut back (no ``sbrk`` shrinking it under the kernel's lock on the process's memory map):
    the taken blocks, freed after it, are free address range with no pages behind it, which
    the heap serves again without growing.
    """
    libc = _load_libc()
    if not libc or not hasattr(libc, "malloc_trim"):
        return
    if all(hasattr(libc, name) for name in ("mallinfo2", "madvise", "sbrk")) and malloc_tuned():
        held = _take_free(libc, _TAKE_PAUSE_S if pause_s else 0.0)
        try:
            libc.malloc_trim(ctypes.c_size_t(_mallinfo(libc).keepcost))
        finally:
            _free_all(libc, held)
        return
    pad = _mallinfo(libc).keepcost - step_bytes if hasattr(libc, "mallinfo2") else 0
    while pad > 0:
        libc.malloc_trim(ctypes.c_size_t(pad))
        time.sleep(pause_s)
        pad -= step_bytes
    libc.malloc_trim(0)


def _hand_back_free(libc: Any, pause_s: float) -> None:
    """Hand back the pages of the heap's free memory a block at a time, no lock held meanwhile (see the caller)."""
    _free_all(libc, _take_free(libc, pause_s))


def _free_all(libc: Any, blocks: list[int]) -> None:
    for block in blocks:
        libc.free(block)


def _take_free(libc: Any, pause_s: float) -> list[int]:
    """Take the heap's free memory out a block at a time and hand back each block's pages; the blocks, to free."""
    held: list[int] = []
    size, budget = _TAKE_BYTES, -1
    try:
        while size >= _TAKE_FLOOR:
            info = _mallinfo(libc)
            if budget < 0:
                budget = info.fordblks + _TAKE_BYTES  # never more than was free at the start: the loop ends
            if budget < size or info.fordblks < size:
                size //= 2
                continue
            end = libc.sbrk(0)  # the heap's end
            block = libc.malloc(size)  # the best-fitting free block, else the heap's free top
            if not block:
                break
            held.append(block)
            budget -= size
            # Pages wholly inside the block: its header (and what ``free`` writes past it) stays.
            first = (block + _CHUNK_HEAD + _PAGE - 1) & -_PAGE
            last = (block + size - _CHUNK_HEAD) & -_PAGE
            if last > first:
                libc.madvise(first, last - first, mmap.MADV_DONTNEED)
            if block + size > end:  # the heap grew for it: no free block of this size is left
                size //= 2
            time.sleep(pause_s)  # the heap's lock is free meanwhile: the loop's thread allocates
    except BaseException:
        _free_all(libc, held)
        raise
    return held


def trim_malloc_later(delay_s: float) -> None:
    """:func:`trim_malloc_in_steps` ``delay_s`` from now, on a thread of its own; a burst of calls makes one trim.

    Each call moves the trim to ``delay_s`` after it (a socket's memory is freed a moment after
    its close); a call while a trim runs makes one more after it. Any thread.
    """
    global _trim_due, _trimmer
    with _trim_lock:
        _trim_due = time.monotonic() + delay_s
        if _trimmer is None:
            _trimmer = threading.Thread(target=_trim_when_due, name="zmq-omni-trim", daemon=True)
            _trimmer.start()


def trims() -> int:
    """How many trims :func:`trim_malloc_later` ran in this process."""
    return _trims


def _trim_when_due() -> None:
    global _trim_due, _trimmer, _trims
    while True:
        with _trim_lock:
            if _trim_due is None:
                _trimmer = None
                return
            wait = _trim_due - time.monotonic()
            if wait <= 0:
                _trim_due = None
        if wait > 0:
            time.sleep(wait)
            continue
        trim_malloc_in_steps()
        with _trim_lock:
            _trims += 1


def _forget_trimmer() -> None:
    """In a forked child: the parent's trim thread is not there."""
    global _trim_due, _trimmer, _trim_lock
    _trim_due, _trimmer, _trim_lock = None, None, threading.Lock()


_trim_lock = threading.Lock()
_trim_due: float | None = None  # when the next trim runs (None: none asked for)
_trimmer: threading.Thread | None = None
_trims = 0
os.register_at_fork(after_in_child=_forget_trimmer)


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


def _mallinfo(libc: Any) -> _MallInfo2:
    """The heap's ``mallinfo2()`` (glibc): ``fordblks`` its free bytes, ``keepcost`` its free top."""
    return libc.mallinfo2()  # type: ignore[no-any-return]


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
        if _libc:
            _declare(_libc)
    return _libc


def _declare(libc: Any) -> None:
    """The C signatures the trims call (ctypes would pass and return pointers as 32-bit ints)."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    if hasattr(libc, "madvise"):
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if hasattr(libc, "sbrk"):
        libc.sbrk.restype = ctypes.c_void_p
        libc.sbrk.argtypes = [ctypes.c_ssize_t]
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2


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
