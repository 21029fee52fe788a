"""Signals for waiting callers: a thread's own sleeper, and conditions an event loop can hear (``zmq_omni.aio``)."""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
from collections.abc import Callable

__all__ = ["NotifyingCondition", "Sleeper", "WouldBlock", "thread_sleeper"]

_LONGEST_SLEEP_S = 86400.0  # one wait's longest sleep (poll takes milliseconds in a C int); callers wait again


class WouldBlock(Exception):
    """A non-blocking attempt found no room (the send window or the pull store is full); nothing was done."""


class NotifyingCondition(threading.Condition):
    """A condition whose :meth:`notify_all` also calls :attr:`listener` (with the lock held).

    The send window and the pull store call ``notify_all`` wherever room may
    have freed; the listener lets a waiter on an event loop hear it too (it
    must be quick and must not take the lock: it writes an eventfd).
    """

    listener: Callable[[], None] | None = None

    def notify_all(self) -> None:
        """Wake every thread waiting on the condition, then the listener."""
        super().notify_all()
        listener = self.listener
        if listener is not None:
            listener()


class Sleeper:
    """What a thread waits on in a mailbox's take: an eventfd, one per thread (:func:`thread_sleeper`).

    Writing an eventfd lets go of the GIL (releasing a lock does not): the thread woken takes the GIL at
    once instead of waking only to wait for it, one thread switch there and one back less a wake-up.
    """

    __slots__ = ("fd", "in_use", "poll")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.poll = select.poll()
        self.poll.register(self.fd, select.POLLIN)
        self.in_use = False  # listed by a waiter (:func:`thread_sleeper` hands it out again once that one clears it)

    def wait(self, timeout: float) -> None:
        """Sleep until woken or ``timeout`` seconds passed, at most a day (a late wake ends the next wait early)."""
        if self.poll.poll(math.ceil(min(max(timeout, 0.0), _LONGEST_SLEEP_S) * 1000.0)):
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self.fd)

    def wake(self) -> None:
        """End its wait, or its next one (any thread; the GIL is let go meanwhile)."""
        os.eventfd_write(self.fd, 1)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, TypeError):  # (TypeError: at interpreter exit, os may be gone)
            os.close(self.fd)


_local = threading.local()


def _forget_sleepers() -> None:
    # A forked child shares its parent's eventfds: a wake there could be read here. It makes its own.
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_forget_sleepers)


def thread_sleeper() -> Sleeper:
    """The calling thread's sleeper (made at its first wait), marked in use; the caller clears ``in_use``.

    While it is in use (a signal handler's wait interrupting the thread's own), a sleeper of its own:
    the interrupted wait's wake must stay where that wait looks for it.
    """
    try:
        sleeper: Sleeper = _local.sleeper
    except AttributeError:
        sleeper = _local.sleeper = Sleeper()
    if sleeper.in_use:
        sleeper = Sleeper()
    sleeper.in_use = True
    return sleeper
