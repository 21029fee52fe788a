"""Signals for callers that wait on an event loop instead of a thread (``zmq_omni.aio``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["NotifyingCondition", "WouldBlock"]


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
