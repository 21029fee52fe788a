"""What drives a connector's sockets: :class:`Driver`, and :class:`IoLoop`, the driver that is one I/O thread.

A transport part (``PushSender``, ``PushReceiver``, ``PullServer``) does its
I/O through a :class:`Driver`: it registers its sockets' handlers and timers,
and other threads hand it work with :meth:`Driver.call_soon`. Two drivers
implement it:

* :class:`IoLoop` (here): one I/O thread per connector, which owns its sockets
  and wakes on them, on an eventfd, or on a timer. Other threads never touch
  the loop's sockets; they hand work over with :meth:`IoLoop.call_soon` (or
  just :meth:`IoLoop.wake` after updating shared state), which writes to an
  eventfd the poller watches. Nothing sleep-polls.
* ``zmq_omni.aio``'s ``LoopDriver``: an asyncio event loop, whose thread alone
  uses the sockets (no I/O thread at all).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from threading import get_ident
from typing import Any, ClassVar

import zmq

from ._sockets import release_context, use_context

__all__ = ["Driver", "IoLoop", "Timer"]

log = logging.getLogger("zmq_omni.transport")


class _Periodic:
    __slots__ = ("due", "fn", "interval")

    def __init__(self, interval: float, fn: Callable[[], None]) -> None:
        self.interval = interval
        self.fn = fn
        self.due = time.monotonic() + interval


class Timer(ABC):
    """A one-shot timer :meth:`Driver.call_later` set; ``due``: when it runs (``time.monotonic()``)."""

    __slots__ = ()
    due: float

    @abstractmethod
    def cancel(self) -> None:
        """Never run it (nothing if it ran already); on the driver's thread, or before the driver started.

        A cancelled timer wakes nothing: the driver does not wait for its due time.
        """


class _Later(Timer):
    __slots__ = ("cancelled", "due", "fn")

    def __init__(self, due: float, fn: Callable[[], None]) -> None:
        self.due = due
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Driver(ABC):
    """Runs the handlers and timers of a connector's transport parts, on the thread that owns their sockets.

    Who calls what: the parts register handlers (:meth:`add_reader`), timers
    (:meth:`call_later`, :meth:`every`) and close hooks (:meth:`on_stop`,
    :meth:`on_term`) from the driver's thread, or before it started; any thread
    hands work to that thread with :meth:`call_soon` or :meth:`wake`. A handler
    must drain what it can without blocking; one that raises is logged and the
    driver goes on. :meth:`stop` runs the close hooks on the driver's thread,
    then releases the ZeroMQ context.

    Args:
        name: a name for logs (and the thread, where there is one).
        private_context: use a ZeroMQ context of its own rather than the
            process's shared one (a ZAP authenticator answers for a whole context).
    """

    #: True when put and get threads may use the parts' sockets beside the driver (the transport's
    #: locks decide who, one at a time); False when the driver's thread alone uses them.
    threaded: ClassVar[bool] = True
    #: A number that changes between the driver's turns (each handler call, round of queued calls, timer
    #: call and the stop is one): a part's per-turn state (a read budget) is keyed by it.
    turn: int = 0

    def __init__(self, name: str, *, private_context: bool = False) -> None:
        self._name = name
        # The process's shared context, or one of its own (for a ZAP authenticator, which serves a whole context).
        self.ctx = use_context(private=private_context)

    @abstractmethod
    def start(self) -> None:
        """Start driving (what was registered before runs from now on)."""

    @property
    @abstractmethod
    def started(self) -> bool:
        """True once :meth:`start` (or :meth:`stop`) ran: sockets are then added on the driver's thread only."""

    @abstractmethod
    def wake(self) -> None:
        """Make the driver run its calls and handlers soon (cheap, any thread)."""

    @abstractmethod
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the driver's thread as soon as possible (any thread)."""

    @abstractmethod
    def in_loop(self) -> bool:
        """True when called from the driver's thread."""

    @abstractmethod
    def stop(self, timeout: float = 1.0) -> bool:
        """Run the on-stop hooks on the driver's thread, end it, release the context; True when done in ``timeout``."""

    @abstractmethod
    def add_reader(self, sock: Any, handler: Callable[[], None]) -> None:
        """Call ``handler`` whenever ``sock`` (a ZeroMQ socket, or a plain descriptor) is readable.

        The handler uses no registered ZeroMQ socket but ``sock``: an event-loop driver looks at
        ``sock`` alone after it (other uses of a socket belong in timers and calls).
        """

    @abstractmethod
    def remove_reader(self, sock: Any) -> None:
        """Stop watching ``sock`` (before closing it)."""

    @abstractmethod
    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Call ``fn`` once, ``delay`` seconds from now, unless the timer returned is cancelled (driver's thread)."""

    @abstractmethod
    def every(self, interval: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` every ``interval`` seconds."""

    @abstractmethod
    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the driver's thread as it stops (flush, close sockets)."""

    @abstractmethod
    def on_term(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after the on-stop hooks, before the context is released."""

    def may_wait_here(self) -> bool:
        """Whether the calling thread may block on I/O this driver does (False on the driver's own thread)."""
        return not self.in_loop()

    def may_use_sockets_here(self) -> bool:
        """Whether the calling thread may use the parts' sockets itself (a put's send, a pull get's fetch)."""
        return True

    @abstractmethod
    def owns_sockets_here(self) -> bool:
        """True on the driver's own thread, or while nothing drives it (not started yet, or ended).

        A bound socket is used only where this holds (its owner, from bind to close).
        """

    def _release_context(self, *, wait: bool = True) -> None:
        """Let go of the context (every socket of the parts closed); ``wait=False`` terminates it in a thread."""
        release_context(self.ctx, wait=wait)

    def _guard(self, fn: Callable[[], None]) -> None:
        # A bug in one handler must not stop the driver that every transfer depends on.
        try:
            fn()
        except Exception:
            log.exception("%s: handler %r failed", self._name, fn)


class IoLoop(Driver):
    """A poller thread with thread-safe wake-ups, deferred calls and periodic timers.

    Each handler call, each round of queued calls and each timer call is one of its turns, counted in
    :attr:`turn` (a part's read budget is a turn's: every read of the turn shares it). A round runs the
    calls queued before it; a call queued meanwhile runs in the next round, after a poll.
    """

    def __init__(self, name: str, *, private_context: bool = False) -> None:
        super().__init__(name, private_context=private_context)
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[], None]] = {}
        self._calls: deque[Callable[[], None]] = deque()
        self._timers: list[_Periodic] = []
        self._timers_due = math.inf  # the earliest due time of the periodic timers
        self._later: list[tuple[float, int, _Later]] = []  # cancelled ones too, till they reach the top
        self._later_ids = 0
        self._on_stop: list[Callable[[], None]] = []
        self._on_term: list[Callable[[], None]] = []
        self._stopping = False
        self._started = False
        # Whoever comes second of the thread's end and a stop() that gave up waiting for it finishes the stop.
        self._end_lock = threading.Lock()
        self._ended = False  # the thread ran its on-stop hooks
        self._orphaned = False  # stop() gave up waiting: the thread finishes the stop as it ends
        self._finished = False
        self._wake_lock = threading.Lock()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ident: int | None = None  # the loop thread's, once it runs

    # -- any thread ----------------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._started = True
        self._thread.start()

    @property
    def started(self) -> bool:
        """True once :meth:`start` (or :meth:`stop`) ran: sockets are then added on the loop thread only."""
        return self._started

    def wake(self) -> None:
        """Make the loop run its calls and handlers now (cheap, any thread; nothing once stopped)."""
        # Under the lock that closes it: a number closed and reused by another file is never written.
        with self._wake_lock:
            if self._wake_fd >= 0:
                with contextlib.suppress(OSError):  # the counter saturated: the loop is awake anyway
                    os.eventfd_write(self._wake_fd, 1)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread as soon as possible.

        From the loop thread itself nothing is written to the eventfd: the loop runs the calls
        queued before it polls again (and polls without waiting while any is left).
        """
        self._calls.append(fn)
        if get_ident() != self._ident:
            self.wake()

    def in_loop(self) -> bool:
        """True when called from the loop thread."""
        return get_ident() == self._ident

    def owns_sockets_here(self) -> bool:
        """True on the loop thread, or while it does not run (before :meth:`start`, or after it ended)."""
        return get_ident() == self._ident or not self._thread.is_alive()

    def stop(self, timeout: float = 1.0) -> bool:
        """Run the on-stop callbacks on the loop thread, end it, terminate the context.

        A thread still busy after ``timeout`` (a handler that takes long) finishes the stop itself as
        it ends: the on-term hooks run and the context is released on every path.

        Returns:
            True when the thread ended within ``timeout`` (the context is then terminated).
        """
        self._stopping = True
        if not self._started:
            # Never started (a constructor failed half-way): release what was set up, here.
            self._started = True
            for fn in self._on_stop:
                self._guard(fn)
        if self._thread.is_alive():
            self.wake()
            self._thread.join(timeout)
        with self._end_lock:
            alive = self._thread.is_alive() and not self._ended
            self._orphaned = alive
        if not alive:
            self._finish()
        return not alive

    def _finish(self, *, wait: bool = True) -> None:
        """After the on-stop hooks: close the wake-up descriptor, run the on-term hooks, release the context."""
        with self._end_lock:
            if self._finished:
                return
            self._finished = True
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.close(self._wake_fd)
                self._wake_fd = -1
        for fn in self._on_term:
            self._guard(fn)
        # Every socket of ours is closed by now; the last user's term() waits at most
        # their linger for last acks to leave.
        self._release_context(wait=wait)

    # -- loop thread (or before start) ---------------------------------------
    def add_reader(self, sock: Any, handler: Callable[[], None]) -> None:
        """Call ``handler`` whenever ``sock`` is readable; it must drain without blocking."""
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_reader(self, sock: Any) -> None:
        """Stop watching ``sock`` (before closing it)."""
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Call ``fn`` once, ``delay`` seconds from now, unless the timer returned is cancelled (loop thread only)."""
        self._later_ids += 1
        timer = _Later(time.monotonic() + delay, fn)
        heapq.heappush(self._later, (timer.due, self._later_ids, timer))
        return timer

    def every(self, interval: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` every ``interval`` seconds."""
        timer = _Periodic(interval, fn)
        self._timers.append(timer)
        self._timers_due = min(self._timers_due, timer.due)

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the loop thread just before it ends (flush, close sockets)."""
        self._on_stop.append(fn)

    def on_term(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` in the stopping thread after the loop ended, before the context terminates."""
        self._on_term.append(fn)

    def _run(self) -> None:
        self._ident = get_ident()
        # Read once: each message's turn runs this loop, and the thread that waits for it runs after it.
        calls, later, timers, handlers = self._calls, self._later, self._timers, self._handlers
        poll, wake_fd, monotonic = self._poller.poll, self._wake_fd, time.monotonic
        try:
            while not self._stopping:
                if calls:
                    timeout = 0
                else:
                    due = self._timers_due
                    while later and later[0][2].cancelled:  # (a cancelled timer sets no timeout)
                        heapq.heappop(later)
                    if later and later[0][0] < due:
                        due = later[0][0]
                    wait_ms = (due - monotonic()) * 1000.0
                    timeout = 0 if wait_ms <= 0.0 else 1000 if wait_ms >= 1000.0 else math.ceil(wait_ms)
                for sock, _ in poll(timeout):
                    if sock == wake_fd:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(wake_fd)
                        continue
                    handler = handlers.get(sock)
                    if handler is not None:
                        self.turn += 1
                        try:
                            handler()
                        except Exception:
                            log.exception("%s: handler %r failed", self._name, handler)
                if calls:  # a round: the calls queued before it (those it queues run on the next, after a poll)
                    self.turn += 1
                    for _ in range(len(calls)):
                        self._guard(calls.popleft())
                now = monotonic()
                while later and later[0][0] <= now:
                    once = heapq.heappop(later)[2]
                    if not once.cancelled:
                        once.cancelled = True  # (ran: a cancel now does nothing)
                        self.turn += 1
                        self._guard(once.fn)
                if self._timers_due <= now:
                    for timer in timers:
                        if timer.due <= now:
                            timer.due = now + timer.interval
                            self.turn += 1
                            self._guard(timer.fn)
                    self._timers_due = min(timer.due for timer in timers)
        finally:
            self.turn += 1  # (the stop is a turn of its own: what it runs reads on a budget of its own)
            while self._calls:
                self._guard(self._calls.popleft())
            for fn in self._on_stop:
                self._guard(fn)
            with self._end_lock:
                self._ended = True
                orphaned = self._orphaned
            if orphaned:
                log.warning("%s: its stop ran late (after a long handler); its sockets are closed now", self._name)
                self._finish(wait=False)
            self._ident = None  # (a thread started later may get the same number)
