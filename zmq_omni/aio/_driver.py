"""``LoopDriver``: a connector's sockets driven by an asyncio event loop, with no I/O thread.

A ``ZmqConnector`` built with ``driver=LoopDriver`` (what
:meth:`~zmq_omni.aio.AsyncConnector.create` builds) hands its transport parts
this driver instead of an I/O thread. Their sockets then belong to the event
loop outright, as a ``zmq.asyncio`` socket does: the loop's thread reads them,
writes them and closes them, and no other thread touches them.

ZeroMQ's descriptor (``zmq.FD``) is edge-triggered: it signals that the
socket's state changed, and any use of the socket (a send, a receive, a look
at ``zmq.EVENTS``) may spend that signal while a message waits. So:

* a ZeroMQ socket given to :meth:`LoopDriver.add_reader` is watched through
  its descriptor, and its handler runs when ``zmq.EVENTS`` says POLLIN;
* the driver looks at ``zmq.EVENTS`` of a registered socket after each
  callback that may have used it: after a socket's handler, at that socket;
  after a timer or a :meth:`~LoopDriver.call_soon` call, at every registered
  socket. The handler of each that holds messages runs on the loop's next
  turn: a handler that drains a bounded batch and leaves the rest is called
  again then, after the loop's other callbacks (fairness), never in a tight
  loop. So a handler uses no registered socket but its own (the parts' sockets
  are each used by one part, whose other uses run in timers and calls);
* a plain descriptor (an ``int``) given to :meth:`~LoopDriver.add_reader` is
  watched as it is (level-triggered); its handler keeps the rule above itself,
  and uses no registered ZeroMQ socket either.

Each callback of the driver's own (a handler, a timer, a round of calls, the stop) is one of its turns,
counted in :attr:`LoopDriver.turn`: a part's read budget is a turn's (every read of the turn shares
it), with no call queued to end it.

The driver may be built before the loop runs: until :meth:`LoopDriver.attach`
(the ``AsyncConnector``'s first await), readers, timers and calls are
recorded, and installed when it attaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import zmq

from ..transport import Driver, Timer

__all__ = ["LoopDriver"]

log = logging.getLogger("zmq_omni.aio")

# Plain ints: ``sock.get(zmq.EVENTS) & zmq.POLLIN`` goes through enum.IntFlag, ~1 us a look.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_FD = int(zmq.FD)
# A foreign thread's stop() waits for the loop to run the stop handed to it (an event: the loop sets it), and
# looks this often whether that loop still runs. The clock is the only event there: asyncio signals nothing when
# a loop stops running (``loop.stop()``, ``run_until_complete`` returning) with calls still queued.
_LOOP_END_LOOK_S = 0.05
_FAILED_RETRY_S = 0.05  # a handler that raised is served again after this, not at once


class _Reader:
    """A registered descriptor: a ZeroMQ socket (``sock``) or a plain descriptor (``sock`` None)."""

    __slots__ = ("fd", "handler", "queued", "sock")

    def __init__(self, fd: int, sock: Any, handler: Callable[[], None]) -> None:
        self.fd = fd
        self.sock = sock
        self.handler = handler
        self.queued = False  # its handler is due on the loop's next turn


class _Timer(Timer):
    """A one-shot or periodic timer (``interval`` None: one shot), kept in ``pending`` to move it to a new loop."""

    __slots__ = ("due", "fn", "handle", "interval", "pending")

    def __init__(self, due: float, fn: Callable[[], None], interval: float | None, pending: set[_Timer]) -> None:
        self.due = due  # time.monotonic() based (the loops' clock too)
        self.fn = fn
        self.interval = interval
        self.handle: asyncio.TimerHandle | None = None
        self.pending = pending

    def cancel(self) -> None:
        self.pending.discard(self)
        if self.handle is not None:
            self.handle.cancel()


class LoopDriver(Driver):
    """Drives a connector's transport parts on an asyncio event loop (the default loop or uvloop).

    Who owns what: once attached, the loop's thread alone uses the parts'
    sockets, and runs every handler, timer and call. Before it is attached
    nothing drives them: the thread that builds and first uses the connector
    does, alone. Thread-safe: :meth:`call_soon` and :meth:`wake` (they hand
    work to the loop), :meth:`stop` (from another thread it hands the stop to
    the loop and waits for it, or, once the loop stopped running, stops here),
    and the read-only :meth:`in_loop`, :meth:`may_wait_here`,
    :meth:`may_use_sockets_here`. Everything else runs on the loop's thread
    (or before the driver is attached).

    A handler that raises is logged; the loop and the other handlers go on.

    Args:
        name: a name for logs.
        private_context: use a ZeroMQ context of its own (see :class:`~zmq_omni.transport.Driver`).
    """

    threaded: ClassVar[bool] = False

    def __init__(self, name: str, *, private_context: bool = False) -> None:
        super().__init__(name, private_context=private_context)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0  # the attached loop's thread
        self._started = False
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._readers: dict[Any, _Reader] = {}  # what add_reader was given -> its entry
        self._sockets: list[_Reader] = []  # the ZeroMQ sockets among them (looked at after each timer and call)
        self._calls: deque[Callable[[], None]] = deque()
        self._calls_armed = False  # a _run_calls is queued on the loop (loop thread's flag)
        self._timers: set[_Timer] = set()  # pending one-shot timers and every periodic one
        self._on_stop: list[Callable[[], None]] = []
        self._on_term: list[Callable[[], None]] = []

    # -- binding to the loop (loop thread) ----------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drive from ``loop``'s thread from now on: install what was registered. Call on that thread.

        Attaching to a new loop after the previous one closed moves the readers and timers there.

        Raises:
            RuntimeError: attached to another loop that is not closed, or stopped.
        """
        if self._loop is loop:
            return
        if self._stopped:
            raise RuntimeError(f"{self._name}: the connector's driver was stopped (the connector is closed)")
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError(f"{self._name}: the connector is driven by another event loop")
        self._loop = loop
        self._thread = threading.get_ident()
        for reader in self._readers.values():
            reader.queued = False
            loop.add_reader(reader.fd, self._on_readable, reader)
        for timer in self._timers:
            self._schedule(timer)
        self._calls_armed = True
        loop.call_soon(self._run_calls)  # what was handed over meanwhile, and a first look at every socket

    @property
    def attached(self) -> bool:
        """True while an open event loop drives it."""
        return self._loop is not None and not self._loop.is_closed()

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Mark it started; it drives once attached to a loop (see :meth:`attach`)."""
        self._started = True

    @property
    def started(self) -> bool:
        """True once :meth:`start` (or :meth:`stop`) ran."""
        return self._started

    def wake(self) -> None:
        """Have the loop run the calls handed over and look at every socket, on its next turn."""
        self.call_soon(_nothing)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread on its next turn (any thread; before attaching: once attached).

        Nothing once stopped: what it would have done went with the sockets.
        """
        if self._stopped:
            return
        self._calls.append(fn)
        loop = self._loop
        if loop is None or self._stopped:
            return
        # RuntimeError: the loop closed; what is left runs at stop(), or on the loop attached next.
        with contextlib.suppress(RuntimeError):
            if threading.get_ident() != self._thread:
                loop.call_soon_threadsafe(self._run_calls)
            elif not self._calls_armed:
                loop.call_soon(self._run_calls)
                self._calls_armed = True

    def in_loop(self) -> bool:
        """True on the thread of the attached loop (while it is open)."""
        return threading.get_ident() == self._thread and self.attached

    def may_wait_here(self) -> bool:
        """True on a thread other than the loop's while the loop runs: a blocking wait there is served."""
        loop = self._loop
        return loop is not None and threading.get_ident() != self._thread and loop.is_running() and not self._stopped

    def may_use_sockets_here(self) -> bool:
        """True on the loop's thread, or anywhere while no open loop drives it (before attaching, or after)."""
        return threading.get_ident() == self._thread or not self.attached or self._stopped

    def owns_sockets_here(self) -> bool:
        """True on the loop's thread, or while no open loop drives it (before attaching, or after)."""
        return self.may_use_sockets_here()

    def stop(self, timeout: float = 1.0) -> bool:
        """Run the on-stop hooks (they close the sockets) on the loop's thread, then on-term, then release the context.

        On the loop's thread (or where no loop runs it any more) it all happens here, and the
        context is terminated in a short-lived thread, so the loop never waits for a linger. From
        another thread while the loop runs, the stop is handed to the loop and waited for: it returns
        as the loop runs it; should the loop stop running first, the stop runs here, seen within
        ``_LOOP_END_LOOK_S`` (asyncio signals no loop's end). A loop still busy after ``timeout`` is
        logged (an ERROR: the sockets stay open, the address bound), and the stop runs when the loop
        next runs, or, should it stop first, on a watching thread.

        Returns:
            True when it stopped within ``timeout``.
        """
        loop = self._loop
        if loop is None or self.in_loop() or not loop.is_running():
            self._stop_here()
            return True
        done = threading.Event()

        def on_loop() -> None:
            self._stop_here()
            done.set()

        try:
            loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # closed meanwhile: nobody drives it any more
            self._stop_here()
            return True
        deadline = time.monotonic() + timeout
        while not done.wait(_LOOP_END_LOOK_S):
            if not loop.is_running():  # it ended before our call ran: the sockets are ours to close
                self._stop_here()
                return True
            if time.monotonic() >= deadline:
                log.error(
                    "%s: its event loop is busy %.1f s after a close: its sockets stay open (the address bound) "
                    "until the loop runs again or stops",
                    self._name,
                    timeout,
                )
                watcher = threading.Thread(target=self._stop_once_idle, args=(loop, done), daemon=True)
                watcher.start()
                return False
        return True

    def _stop_once_idle(self, loop: asyncio.AbstractEventLoop, done: threading.Event) -> None:
        """After a stop that timed out: stop here if the loop ends before it runs the stop handed to it."""
        while not done.wait(_LOOP_END_LOOK_S):
            if not loop.is_running():
                self._stop_here()
                return

    def _stop_here(self) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self._started = True
            self.turn += 1  # (the stop is a turn of its own: what it runs reads on a budget of its own)
            calls = self._calls
            while calls:  # handed over before the stop: they may open what the hooks close
                self._guard(calls.popleft())
            for fn in self._on_stop:
                self._guard(fn)
            loop = self._loop
            if loop is not None and not loop.is_closed():
                for reader in self._readers.values():
                    loop.remove_reader(reader.fd)
                for timer in self._timers:
                    if timer.handle is not None:
                        timer.handle.cancel()
            self._readers.clear()
            self._sockets.clear()
            self._timers.clear()
            for fn in self._on_term:
                self._guard(fn)
            # Every socket of ours is closed: terminating the context may still wait a linger for
            # last acks to leave, in a thread of its own rather than on the loop.
            self._release_context(wait=False)

    # -- the loop's thread (or before attaching) -----------------------------------------------
    def add_reader(self, sock: Any, handler: Callable[[], None]) -> None:
        """Call ``handler`` when ``sock`` has messages (a ZeroMQ socket) or is readable (an ``int`` descriptor)."""
        self.remove_reader(sock)
        is_socket = not isinstance(sock, int)
        reader = _Reader(sock.getsockopt(_FD) if is_socket else sock, sock if is_socket else None, handler)
        self._readers[sock] = reader
        if is_socket:
            self._sockets.append(reader)
        if self.attached and not self._stopped:
            assert self._loop is not None
            self._loop.add_reader(reader.fd, self._on_readable, reader)
            if is_socket:  # messages may be queued already, their signal spent
                self._queue(reader)

    def remove_reader(self, sock: Any) -> None:
        """Stop watching ``sock`` (before closing it)."""
        reader = self._readers.pop(sock, None)
        if reader is None:
            return
        if reader.sock is not None:
            self._sockets.remove(reader)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(reader.fd)

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Call ``fn`` once, ``delay`` seconds from now, unless the timer returned is cancelled."""
        timer = _Timer(time.monotonic() + delay, fn, None, self._timers)
        self._add_timer(timer)
        return timer

    def every(self, interval: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` every ``interval`` seconds (the first time ``interval`` from now)."""
        self._add_timer(_Timer(time.monotonic() + interval, fn, interval, self._timers))

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` as the driver stops, on the loop's thread (flush, close sockets)."""
        self._on_stop.append(fn)

    def on_term(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after the on-stop hooks, before the context is released."""
        self._on_term.append(fn)

    # -- running callbacks ------------------------------------------------------------------------
    def _add_timer(self, timer: _Timer) -> None:
        if self._stopped:
            return
        self._timers.add(timer)
        if self.attached:
            self._schedule(timer)

    def _schedule(self, timer: _Timer) -> None:
        assert self._loop is not None
        timer.handle = self._loop.call_later(max(0.0, timer.due - time.monotonic()), self._on_timer, timer)

    def _on_timer(self, timer: _Timer) -> None:
        if self._stopped:
            return
        self.turn += 1
        if timer.interval is None:
            self._timers.discard(timer)
        else:
            timer.due = time.monotonic() + timer.interval
            self._schedule(timer)
        self._run(timer.fn)

    def _run_calls(self) -> None:
        """Run the calls handed over so far; those they hand over run on the next turn."""
        self._calls_armed = False
        if self._stopped:
            return
        self.turn += 1
        calls = self._calls
        for _ in range(len(calls)):
            self._guard(calls.popleft())
        self._look_at_sockets()

    def _on_readable(self, reader: _Reader) -> None:
        """The loop saw ``reader``'s descriptor readable."""
        if self._stopped or self._readers.get(reader.sock if reader.sock is not None else reader.fd) is not reader:
            return
        self.turn += 1
        sock = reader.sock
        if sock is None or self._holds_messages(sock):  # (the look also resets ZeroMQ's descriptor)
            try:
                reader.handler()
            except Exception:
                log.exception(
                    "%s: handler %r failed; its descriptor is looked at again in %ss",
                    self._name,
                    reader.handler,
                    _FAILED_RETRY_S,
                )
                self._back_off(reader)
            # A handler uses its own socket alone (see the module docstring): look at that one.
            if sock is not None and not reader.queued and self._holds_messages(sock):
                self._queue(reader)

    def _back_off(self, reader: _Reader) -> None:
        """A handler failed with its descriptor still readable: serving it again at once would spin the loop."""
        assert self._loop is not None
        reader.queued = True  # (no look re-queues it meanwhile)
        self._loop.remove_reader(reader.fd)
        self._loop.call_later(_FAILED_RETRY_S, self._resume_reader, reader)

    def _resume_reader(self, reader: _Reader) -> None:
        reader.queued = False
        key = reader.sock if reader.sock is not None else reader.fd
        if self._stopped or self._loop is None or self._readers.get(key) is not reader:
            return
        self._loop.add_reader(reader.fd, self._on_readable, reader)
        self._on_readable(reader)

    def _run(self, fn: Callable[[], None]) -> None:
        """Run a timer's callback, then look at every socket it may have used (see the module docstring)."""
        self._guard(fn)
        if self._sockets:
            self._look_at_sockets()

    def _look_at_sockets(self) -> None:
        """Queue, for the loop's next turn, the handler of every socket that holds messages."""
        for reader in self._sockets:
            if not reader.queued and self._holds_messages(reader.sock):
                self._queue(reader)

    def _queue(self, reader: _Reader) -> None:
        assert self._loop is not None
        reader.queued = True
        self._loop.call_soon(self._serve, reader)

    def _serve(self, reader: _Reader) -> None:
        reader.queued = False
        self._on_readable(reader)

    @staticmethod
    def _holds_messages(sock: Any) -> bool:
        if sock.closed:
            return False
        try:
            return bool(sock.get(_EVENTS) & _POLLIN)
        except zmq.ZMQError:  # closed under us (its owner's close hook ran): nothing to read
            return False

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "attached" if self._loop is not None else "unattached"
        return f"<LoopDriver {self._name} {state}>"


def _nothing() -> None:
    """A call that only makes the loop look at its sockets (:meth:`LoopDriver.wake`)."""
