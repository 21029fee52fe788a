"""Who may touch a receiver's ZeroMQ socket now: one holder at a time, said and asserted.

A ZeroMQ socket is not thread-safe: a poll reads its state as a receive does.
:class:`SocketOwner` is the socket's one right of use. Its holder is the
**driver** (the connector's I/O thread, or the event loop that drives an async
connector) running a handler or a timer, or a **getter**: a thread in a
blocking ``get`` that found nothing and nobody reading, and reads the socket
itself until its item comes (handing each message from an I/O thread to a
waiting thread costs two thread wake-ups, about as much again as ZeroMQ's
whole round trip).

The driver never polls the socket itself, only its descriptor (``zmq.FD``),
which any thread may poll without touching the socket. When the descriptor
wakes the driver while a getter holds the socket, the driver *parks* (stops
watching the descriptor, so it does not spin) and leaves the socket to the
getters; it resumes watching once the socket was idle for a moment, or at once
when someone waits for arrivals without reading (see the receiver).

The rule every holder keeps: before :meth:`SocketOwner.release`, leave nothing
queued behind the descriptor's back (a receive or a send on the socket may
spend the signal of a message that arrived meanwhile), unless the next holder
is sure to look: read until ``zmq.EVENTS`` shows nothing, or hand the rest to
the driver with an explicit call.
"""

from __future__ import annotations

import enum
import threading
import time

__all__ = ["Holder", "SocketOwner"]


class Holder(enum.Enum):
    """Who holds a socket."""

    NOBODY = "nobody"
    DRIVER = "driver"  # the I/O thread, or the event loop driving an async connector
    GETTER = "getter"  # a thread in a blocking get, reading for itself


class SocketOwner:
    """The right to use one socket (see the module docstring).

    Lock order: :meth:`try_take` without a timeout may be called under the receiver's mailbox
    lock (it never waits then); a holder may take the mailbox lock. A take that waits is never
    made under it.
    """

    __slots__ = ("_lock", "_thread", "holder", "last_release", "parked")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread = 0
        self.holder = Holder.NOBODY  # written only by the thread holding _lock
        #: The driver stopped watching the descriptor, leaving the socket to getters (driver's thread writes it).
        self.parked = False
        #: When a getter last released the socket (the driver resumes watching after an idle moment).
        self.last_release = 0.0

    def try_take(self, who: Holder, timeout: float = 0.0) -> bool:
        """Take the socket for ``who`` if nobody holds it, waiting at most ``timeout`` for its holder to release it."""
        if not self._lock.acquire(True, timeout):
            return False
        assert self.holder is Holder.NOBODY, f"socket taken by {who.value} while {self.holder.value} holds it"
        self.holder = who
        self._thread = threading.get_ident()
        return True

    def release(self, who: Holder) -> None:
        """Give the socket back; only its holder, on the thread that took it, may."""
        assert self.holder is who and self._thread == threading.get_ident(), (
            f"{who.value} releases a socket held by {self.holder.value}"
        )
        if who is Holder.GETTER:
            self.last_release = time.monotonic()
        self.holder = Holder.NOBODY
        self._thread = 0
        self._lock.release()
