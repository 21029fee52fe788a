"""Sleep until a directory changes: inotify through ctypes, no polling loop.

A waiting receiver must not burn a core (vLLM's spin-then-park readers showed
98 % of a core spent spinning). inotify lets the kernel wake us when a record
is linked into the mailbox directory; ``poll()`` on its descriptor sleeps
without CPU. The watch is armed *before* the caller re-checks the mailbox, so
a record that lands between the check and the sleep still wakes us (no lost
wakeup). Where inotify is unavailable, waits fall back to short sleeps that
back off to 50 ms, still bounded and cheap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import time
from types import TracebackType

__all__ = ["DirWatch"]

_log = logging.getLogger("zmq_omni.shm")

_IN_CREATE = 0x00000100
_IN_MOVED_TO = 0x00000080
_IN_DELETE_SELF = 0x00000400
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.inotify_init1.argtypes = [ctypes.c_int]
    _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
except (OSError, AttributeError):  # not Linux, or no inotify in this libc
    _libc = None


class DirWatch:
    """Wakes :meth:`wait` when an entry is created or moved into ``path``.

    Use as a context manager; the descriptor is closed on exit.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._backoff = 0.001
        if _libc is None:
            return
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            _log.debug("inotify_init1 failed (errno %d); waits will back off", ctypes.get_errno())
            return
        mask = _IN_CREATE | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_ONLYDIR
        if _libc.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
            os.close(fd)
            return
        self._fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    @property
    def active(self) -> bool:
        """True when the kernel will wake us (inotify armed)."""
        return self._fd >= 0

    def wait(self, timeout: float) -> None:
        """Sleep until the directory changes or ``timeout`` seconds pass."""
        if timeout <= 0:
            return
        if self._fd < 0:
            time.sleep(min(timeout, self._backoff))
            self._backoff = min(self._backoff * 2, 0.05)
            return
        if self._poller.poll(timeout * 1000.0):
            try:
                while os.read(self._fd, 65536):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Release the inotify descriptor. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
