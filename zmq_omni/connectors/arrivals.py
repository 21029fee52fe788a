"""Arrival watches: the wake-up hook of connectors for waiters without a thread.

:class:`ArrivalWatch` is a file descriptor an event loop watches (``zmq_omni.aio``
registers it); :class:`WatchSet` is the set of watches a connector (or a shared
mailbox) notifies. A backend's ``watch_arrivals`` makes a watch and registers it
with :meth:`~zmq_omni.connectors.base.OmniConnectorBase._register_watch`, the one
registration path of every connector.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator

__all__ = ["MAX_WATCHED_ARRIVALS", "ArrivalWatch", "Slot", "WatchSet"]

#: An address as the mailboxes hold it: ``(from_stage, to_stage, key)``, all ``str``.
Slot = tuple[str, str, str]

#: Addresses an :class:`ArrivalWatch` keeps between two drains; beyond it, it reports "anything".
MAX_WATCHED_ARRIVALS = 65536


class ArrivalWatch:
    """A file descriptor an event loop can watch: readable once something arrived or changed.

    The wake-up hook for callers that wait without a thread (``zmq_omni.aio``
    registers :meth:`fileno` with its event loop). The connector calls
    :meth:`notify` from whichever thread changes its state (the I/O thread when
    a push receiver's mailbox gets items, a ``put`` of the same namespace, a
    window that frees room, ``close()``); the watcher calls :meth:`drain` on its
    own thread when the descriptor is readable.

    Lock: ``_lock`` guards ``_slots``, ``_anything`` and ``_signalled``. The
    descriptor is written at most once between two drains (``_signalled``), so a
    stream of arrivals costs one syscall per wake-up, not one per arrival; a
    notify that comes after :meth:`drain` cleared the flag writes again, so no
    wake-up is lost.

    Args:
        on_close: called once by :meth:`close` (see :meth:`when_closed`).
    """

    def __init__(self, on_close: Callable[[ArrivalWatch], None] | None = None) -> None:
        self._on_close: list[Callable[[ArrivalWatch], None]] = [] if on_close is None else [on_close]
        self._lock = threading.Lock()
        self._slots: list[Slot] = []
        self._anything = False
        self._room = False
        self._room_wanted = False
        self._signalled = False
        self._closed = False
        self._inline: Callable[[list[Slot]], None] | None = None
        self._inline_thread = 0
        if hasattr(os, "eventfd"):
            self._rfd = self._wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # not Linux: a pipe does the same
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)

    def fileno(self) -> int:
        """The descriptor this process's notifications make readable."""
        return self._rfd

    def filenos(self) -> tuple[int, ...]:
        """Every descriptor to watch for reading (a backend may add its own, e.g. an inotify one)."""
        return (self._rfd,)

    def notify(self, slots: Iterable[Slot] | None = None) -> None:
        """Note that ``slots`` arrived (None: anything may have changed) and make the descriptor readable.

        Any thread; never blocks. On the watcher's thread, while it delivers inline
        (:meth:`deliver_inline`), addresses go straight to its handler instead.
        """
        inline = self._inline
        if inline is not None and slots is not None and threading.get_ident() == self._inline_thread:
            inline(slots if isinstance(slots, list) else list(slots))
            return
        with self._lock:
            if self._closed:
                return
            if slots is None:
                self._anything = True
            elif not self._anything:
                self._slots.extend(slots)
                if len(self._slots) > MAX_WATCHED_ARRIVALS:  # nobody drains: stop remembering, say "anything"
                    self._anything = True
                    self._slots = []
            self._signal()

    def deliver_inline(self, handler: Callable[[list[Slot]], None] | None) -> None:
        """Until called with None, hand addresses notified on this thread straight to ``handler``.

        The watcher's thread only: where that thread is also the one that stores the
        arrivals (a connector driven by the watcher's event loop), they reach its
        waiters at once, without a round through the descriptor. ``handler`` runs
        inside the connector's read and must not raise. Other threads' notices (and
        "anything" notices) still write the descriptor.
        """
        self._inline = handler
        self._inline_thread = threading.get_ident()

    def want_room(self, wanted: bool) -> None:
        """Say whether the watcher has puts waiting for window room; only then does :meth:`notify_room` signal.

        The watcher's thread. A window frees room on most of its receivers'
        replies, and a wake-up for each would cost an idle watcher a round of
        its event loop. Set it before the waiting put's last try: a room notice
        then either finds it set or came before that try, which sees the room.
        """
        self._room_wanted = wanted

    def notify_room(self) -> None:
        """Note that room may have freed in the put window, and make the descriptor readable. Any thread.

        Nothing happens while the watcher wants no room (see :meth:`want_room`).
        """
        if not self._room_wanted:
            return
        with self._lock:
            if self._closed:
                return
            self._room = True
            self._signal()

    def _signal(self) -> None:
        """Make the descriptor readable unless it already is (caller holds ``_lock``)."""
        if not self._signalled:
            self._signalled = True
            # Under the lock: close() cannot release the descriptor (whose number could be reused) meanwhile.
            with contextlib.suppress(OSError):  # the counter saturated, or the pipe is full: readable anyway
                os.write(self._wfd, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    def drain(self) -> tuple[list[Slot] | None, bool]:
        """Read the descriptor; what happened since the last drain.

        The watcher's thread only.

        Returns:
            ``(arrived, room)``: the addresses that arrived (None: anything may
            have, retry every waiting get) and whether room may have freed in
            the put window.
        """
        with contextlib.suppress(OSError):
            os.read(self._rfd, 4096)
        with self._lock:
            slots, anything, room = self._slots, self._anything, self._room
            self._slots, self._anything, self._room, self._signalled = [], False, False, False
        return (None if anything else slots), room

    def when_closed(self, callback: Callable[[ArrivalWatch], None]) -> None:
        """Call ``callback(self)`` once at :meth:`close` (at once when already closed). Any thread."""
        with self._lock:
            if not self._closed:
                self._on_close.append(callback)
                return
        callback(self)

    def close(self) -> None:
        """Stop watching and release the descriptor. Idempotent; the watcher's thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._rfd)
            if self._wfd != self._rfd:
                os.close(self._wfd)
            callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback(self)


class WatchSet:
    """The watches one notifier wakes: a connector's own, or every watch of a shared mailbox.

    Copy-on-write: notifiers (any thread, often the I/O thread) iterate a tuple
    without taking ``_lock``, which guards only the replacement of ``_watches``.
    A watch leaves every set it was added to when it closes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: tuple[ArrivalWatch, ...] = ()

    def add(self, watch: ArrivalWatch) -> None:
        """Notify ``watch`` from now on, until it closes."""
        with self._lock:
            self._watches = (*self._watches, watch)
        watch.when_closed(self.discard)

    def discard(self, watch: ArrivalWatch) -> None:
        """Stop notifying ``watch`` (no error when it is not here)."""
        with self._lock:
            self._watches = tuple(w for w in self._watches if w is not watch)

    def __bool__(self) -> bool:
        return bool(self._watches)

    def __len__(self) -> int:
        return len(self._watches)

    def __iter__(self) -> Iterator[ArrivalWatch]:
        return iter(self._watches)

    def notify(self, slots: Iterable[Slot] | None) -> None:
        """Tell every watch that ``slots`` arrived (None: anything may have changed). Any thread."""
        watches = self._watches
        if watches:
            if slots is not None and len(watches) > 1:
                slots = list(slots)  # an iterator would be used up by the first watch
            for watch in watches:
                watch.notify(slots)

    def notify_room(self) -> None:
        """Tell every watch that room may have freed in the put window. Any thread."""
        for watch in self._watches:
            watch.notify_room()
