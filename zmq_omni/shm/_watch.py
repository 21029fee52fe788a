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
import struct
import time
from types import TracebackType

__all__ = ["DirEvents", "DirWatch"]

_log = logging.getLogger("zmq_omni.shm")

_IN_CREATE = 0x00000100
_IN_MOVED_TO = 0x00000080
_IN_DELETE_SELF = 0x00000400
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name
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


class DirEvents:
    """A non-blocking inotify descriptor on a directory, for an event loop to watch.

    Unlike :class:`DirWatch` it stays armed across waits and reports the names
    that were created or moved in. When the directory is removed (another
    process removes an empty mailbox directory) it is made again and watched
    anew, and :meth:`read` says that anything may have changed.

    Raises:
        OSError: inotify is not available (not Linux) or the watch cannot be added.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if _libc is None:
            raise OSError("inotify is not available on this system")
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._fd = fd
        try:
            self._arm()
        except BaseException:
            os.close(fd)
            raise

    def _arm(self) -> None:
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        assert _libc is not None
        mask = _IN_CREATE | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_ONLYDIR
        if _libc.inotify_add_watch(self._fd, os.fsencode(self.path), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch on {self.path} failed")

    def fileno(self) -> int:
        """The descriptor (readable when events wait)."""
        return int(self._fd)

    def read(self, rearm: bool = True) -> list[str] | None:
        """The names created or moved in since the last read (never blocks); None when anything may have changed.

        Args:
            rearm: when the directory was removed, make it again and watch it (False: just report "anything").
        """
        names: list[str] = []
        anything = rearmed = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            pos = 0
            while pos + _EVENT.size <= len(data):
                _, mask, _, length = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
                pos += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    anything = True
                elif mask & (_IN_DELETE_SELF | _IN_IGNORED):
                    # Its directory was removed: watch the one a later put makes (made now, so none is missed).
                    if rearm and not rearmed:
                        rearmed = True
                        try:
                            self._arm()
                        except OSError as exc:
                            _log.warning("cannot re-arm the watch of %s: %s", self.path, exc)
                    anything = True
                elif name:
                    names.append(os.fsdecode(name))
        return None if anything else names

    def close(self) -> None:
        """Release the descriptor. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
