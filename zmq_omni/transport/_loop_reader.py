"""A push receiver's socket read on an event loop's own thread: the reading getter of ``zmq_omni.aio``.

An awaited get that waits would otherwise be fed by the I/O thread: it reads
the message, stores it, writes the watch's eventfd, and the loop thread wakes
and takes the GIL: two thread wake-ups per message, which a lone round trip
pays at each end. A loop with gets waiting instead borrows the socket, as a
threaded reading getter does (see :mod:`~zmq_omni.transport._receiver`):

* :meth:`LoopReader.lend` asks the I/O thread to stop watching the socket; it
  confirms with an empty arrivals notice (the loop's watch wakes);
* the loop polls :meth:`LoopReader.fileno`, a duplicate of ZeroMQ's descriptor,
  and calls :meth:`LoopReader.pump` when it is readable: the receiver's handler
  runs on the loop thread under the socket's owner lock; an arrival a waiting
  get of the loop wants goes straight to it (the pump's ``hand``), and the
  arrivals hook hands the other addresses to the loop's waiters directly
  (:meth:`~zmq_omni.connectors.base.ArrivalWatch.deliver_inline`);
* the I/O thread takes the socket back once nobody read it for a few
  milliseconds, or, while the loop says it has gets waiting (the ``waiting``
  given to :meth:`LoopReader.lend`), once the loop did not read it for a
  second (a blocked loop); the next pump then answers None and the loop stops
  polling. A loop that waits keeps the socket through idle spells: the first
  message after one is read on the loop, and in a flood no second thread
  takes turns with it at the GIL.

The descriptor is a duplicate so that its number stays the loop's until
:meth:`LoopReader.close`, whatever the socket's own lifetime: a number the
loop still polls is never reused by another file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._receiver import Hand, PushReceiver

__all__ = ["LoopReader"]


def _never() -> bool:
    return False


class LoopReader:
    """One event loop's hold on a push receiver's socket (loop thread only, but ``close``).

    Args:
        receiver: the push receiver whose socket the loop reads.
        take: the connector's mailbox-only take (``(from_stage, to_stage, key) -> (obj, nbytes) | None``,
            failures recorded as its ``get`` records them).
    """

    def __init__(self, receiver: PushReceiver, take: Callable[[str, str, str], tuple[Any, int] | None]) -> None:
        self._receiver = receiver
        # The bound take itself, not a method calling it: one call less on each awaited get's look.
        self.take: Callable[[str, str, str], tuple[Any, int] | None] = take
        """The item if it is in the mailbox; never looks at the socket (the loop polls it) and never waits."""
        self._fd = os.dup(receiver.fd)
        self._waiting: Callable[[], bool] = _never
        receiver.add_loop_reader(self)

    def fileno(self) -> int:
        """A descriptor to poll for reading while the socket is lent (-1 once closed)."""
        return self._fd

    def lend(self, waiting: Callable[[], bool] | None = None) -> None:
        """Ask the I/O thread for the socket (it confirms with an empty arrivals notice).

        ``waiting``: whether the loop has gets waiting now (called on the I/O thread, so it must
        only read state, e.g. ``functools.partial(bool, waiters)``); while it says so, the socket
        stays lent through idle spells. Without it, idle spells give the socket back.
        """
        self._waiting = waiting or _never
        self._receiver.lend_to_loop()

    @property
    def lent(self) -> bool:
        """Whether the socket is the loop's now (False once the I/O thread took it back, or closed)."""
        return self._fd >= 0 and not self._receiver._io_watching

    def waiting(self) -> bool:
        """Whether the loop has gets waiting (see :meth:`lend`); False once closed."""
        return self._fd >= 0 and self._waiting()

    def pump(self, rounds: int = 1, *, woken: bool = True, hand: Hand | None = None) -> bool | None:
        """Read what is queued: True when done, False when more may be queued, None when the socket is not lent.

        ``woken``: the descriptor woke the loop (see :meth:`PushReceiver.pump`); a call after False passes False.
        ``hand``: gives an arrival to a waiting get of the loop, True if one took it (see :meth:`PushReceiver.pump`).
        """
        if self._fd < 0:
            return None
        return self._receiver.pump(rounds, woken=woken, hand=hand)

    def close(self) -> None:
        """Release the descriptor and stop counting as a reader. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._receiver.remove_loop_reader(self)
