"""The pull server's ROUTER: bound, read within a time budget a turn, and bound anew past ``max_frames``.

A request is one frame. A peer's message of many frames is read across turns
(:class:`~zmq_omni.transport._router.RoutedReader`) within :data:`READ_BUDGET_S`
a driver turn, shared by every read the turn runs (the first read of a turn sets
the deadline, a call on the driver's next turn clears it); a message past ``max_frames`` closes the
socket, which is the only way to make libzmq let go of the rest of it (it queues
a message whole, and reading a million frames one ``recv`` each would keep every
other peer waiting), and a new one is bound on the same endpoint. Peers
reconnect by themselves; what they had in flight is lost (clients ask again).
A second later the C heap's free pages go back to the OS in short steps on a
thread of their own (:func:`~zmq_omni.transport._router.trim_malloc_later`, one
trim for a burst of rebinds).

Used by the server's driver only (the endpoint's I/O thread, or its event loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import ZmqOmniError
from ..metrics import Counters
from ._loop import Driver
from ._router import RoutedReader, open_router, trim_malloc_later
from ._security import Curve
from ._sockets import close_bound, close_socket

__all__ = ["READ_BUDGET_S", "PullRouter"]

log = logging.getLogger("zmq_omni.transport")

#: A turn of the read loop ends after this long, whatever the messages cost (the rest is read next turn).
READ_BUDGET_S = 0.01
_LINGER_MS = 500  # replies still leaving when the socket is bound anew go on leaving this long
_REBIND_S = 5.0  # how long a rebind tries to bind the endpoint again
_TRIM_AFTER_S = 1.0  # a dropped message's memory goes back to the OS this long after its socket closed (and lingered)

#: What the server does with one message: ``(identity, frames, ok)`` (``ok`` False: more than one frame).
OnMessage = Callable[[bytes, list[Any], bool], None]


class PullRouter:
    """A bound ROUTER whose messages go to ``on_message`` (see the module docstring).

    ``on_rebind`` runs after the old socket closed (its peers' parked requests cannot be answered).

    Raises:
        TransportError: the bind failed (the endpoint is named).
    """

    def __init__(
        self,
        loop: Driver,
        endpoint: str,
        *,
        hwm: int,
        max_frames: int,
        counters: Counters,
        curve: Curve | None,
        on_message: OnMessage,
        on_rebind: Callable[[], None],
    ) -> None:
        self._loop, self._hwm, self._curve, self._counters = loop, hwm, curve, counters
        self._on_message, self._on_rebind = on_message, on_rebind
        self._stop_refusals: Callable[[], None] | None = None
        self._closed = False
        counters.add("rebinds", 0)
        #: The socket: for the driver only; replaced when bound anew.
        self.sock = self._open(endpoint)
        self.bound: str = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._reader = RoutedReader(self.sock, 1, max_frames)
        self._turn_until = 0.0  # the read deadline every read of this driver turn shares
        self._budget_turn = -1  # the driver's turn that ``_turn_until`` is of
        loop.add_reader(self.sock, self._on_readable)

    def _open(self, endpoint: str) -> Any:
        # FETCH requests are tiny; a peer sending more is hostile.
        sock, self._stop_refusals = open_router(
            self._loop, endpoint, hwm=self._hwm, max_message_bytes=1 << 20, curve=self._curve, counters=self._counters
        )
        return sock

    def _stop_watching(self) -> None:
        if self._stop_refusals is not None:
            self._stop_refusals()
            self._stop_refusals = None

    def _on_readable(self) -> None:
        reader, until, on_message = self._reader, self._read_until(), self._on_message
        while True:
            message = reader.read(until)
            if message is None:
                if reader.overflowed:
                    self._rebind()
                return
            on_message(*message)
            if time.monotonic() > until:  # costly requests: the rest next turn
                return

    def _read_until(self) -> float:
        """When reading stops: one budget for every read of a driver turn on its thread (elsewhere: each read)."""
        now, loop = time.monotonic(), self._loop
        if not loop.in_loop():
            return now + READ_BUDGET_S
        if loop.turn != self._budget_turn:
            self._budget_turn, self._turn_until = loop.turn, now + READ_BUDGET_S
        return self._turn_until

    def _rebind(self) -> None:
        self._counters.add("rebinds")
        log.warning(
            "pull server %s: a peer sent a message of more than %d frames; the socket is bound anew",
            self.bound,
            self._reader.max_frames,
        )
        self._loop.remove_reader(self.sock)
        self._stop_watching()
        close_socket(self.sock, linger_ms=_LINGER_MS)  # the held message goes with it
        # Off the driver's thread and in short steps (an event loop's thread allocates from the same heap), once for a
        # burst of rebinds: the ~640 MB libzmq held for a message of 10M frames go back to the OS.
        trim_malloc_later(_TRIM_AFTER_S)
        self._on_rebind()
        self._reopen(time.monotonic() + _REBIND_S)

    def _reopen(self, give_up_at: float) -> None:
        """Bind the new ROUTER once the old listener is gone (libzmq closes it a moment after ``close``)."""
        if self._closed:
            return
        try:
            self.sock = self._open(self.bound)
        except ZmqOmniError as exc:
            if time.monotonic() < give_up_at:
                self._loop.call_later(0.005, lambda: self._reopen(give_up_at))
                return
            log.error("pull server %s: could not bind again: %s", self.bound, exc)
            return
        self._reader = RoutedReader(self.sock, 1, self._reader.max_frames)
        self._loop.add_reader(self.sock, self._on_readable)

    def stop_reading(self) -> None:
        """Stop watching the socket (the first step of closing)."""
        self._closed = True
        self._loop.remove_reader(self.sock)
        self._stop_watching()

    def close(self) -> None:
        """Close the socket and wait (bounded) until nothing listens on its endpoint."""
        self.stop_reading()
        close_bound(self.sock, self.bound)
