"""``AsyncConnector``: awaitable put/get over any zmq_omni connector, without a thread per waiting call.

How a waiting call wakes (nothing polls, no thread waits for it):

* **get, push mode / in-process / shared memory** -- the connector's
  :class:`~zmq_omni.connectors.base.ArrivalWatch` (an eventfd, plus an inotify
  descriptor for shared memory) is registered with the event loop once. Its
  notifications name the addresses that arrived; the loop callback retries the
  non-blocking ``connector.get`` for the waiters of those addresses only, and
  resolves their futures. Thousands of waiting gets are thousands of futures
  in a dict, and one file descriptor.
* **get, ZeroMQ push mode, while gets wait** -- the loop also reads the
  receiver's socket itself (a :class:`~zmq_omni.connectors.base.LoopReader`,
  see :mod:`zmq_omni.transport._loop_reader`): ZeroMQ's descriptor is polled
  by the loop, and what a pump reads reaches the waiters in the same callback,
  without the I/O thread's hand-over (two thread wake-ups per message). The
  watch stays registered: whatever the I/O thread still reads arrives by it.
* **get, ZeroMQ pull mode** -- items never arrive by themselves there: each get
  sends a FETCH that the sender parks until the put (a long poll) on one
  DEALER per sender endpoint (a :class:`~zmq_omni.transport.FetchChannel`),
  whose ZeroMQ descriptor is registered with the loop; replies are matched to
  waiters by request id.
* **put** -- ``connector.try_put`` admits the put without waiting; when the
  window is full the put queues (first come, first served) and is retried
  when the watch reports that room freed.

Cancellation: a get cancelled while it waits takes nothing (the item stays
for a later get). A get whose item was taken for it and that is cancelled
before it resumes hands the item back to this ``AsyncConnector``: the next
get of the same address here returns it (it is not visible to the wrapped
connector's own ``get``). In pull mode a FETCH cannot be called back, so an
item the sender serves after its get was cancelled or timed out is handed
back the same way. A put cancelled while it waits for room is not made.

Who owns what: every field is touched on the event loop's thread only (the
watch's own lock covers its notifications from other threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase, create_connector
from ..connectors.base import MAX_WAIT_S, ArrivalWatch, LoopReadable, LoopReader, Slot
from ._expiry import Deadlines
from ._resume import ResumingFuture, queue, resume

__all__ = ["AsyncConnector"]

log = logging.getLogger("zmq_omni.aio")

T = TypeVar("T")

_LONG_POLL_S = 3600.0  # what a pull-mode FETCH asks the sender to park at most (its own cap)
_REFETCH_S = 0.05  # a FETCH the sender would not park is asked again after this
_HANDED_BACK_MAX = 65_536  # items handed back and not taken again; beyond it the oldest are dropped (logged)

PutResult = tuple[bool, int, "dict[str, Any] | None"]
Metadata = dict[str, Any] | None


@dataclass(eq=False, slots=True)
class _GetWaiter:
    fut: ResumingFuture[tuple[Any, int] | None]
    slot: Slot
    metadata: dict[str, Any] | None


@dataclass(eq=False, slots=True)
class _PutWaiter:
    fut: asyncio.Future[PutResult]
    args: tuple[str, str, str, Any]


@dataclass(eq=False, slots=True)
class _Fetch:
    """A FETCH sent on a channel and not answered yet (its waiter may be gone: then the item is handed back)."""

    slot: Slot
    endpoint: str
    waiter: _GetWaiter | None
    deadline: float | None  # the waiter's (loop time); None: wait as long as it takes
    parked_until: float  # an "absent" answer before this time means the sender did not park the FETCH


@dataclass(eq=False)
class _Channel:
    channel: Any  # a FetchChannel
    fd: int
    fetches: dict[int, _Fetch] = field(default_factory=dict)


class AsyncConnector:
    """The asyncio face of a connector: ``await put(...)``, ``await get(...)``, ``async with``.

    Args:
        connector: any zmq_omni connector whose :meth:`watch_arrivals` gives a
            watch (``ZmqConnector`` in push or pull mode, ``SharedMemoryConnector``,
            ``InProcConnector``, or your own backend implementing it).
        close_connector: :meth:`aclose` also closes ``connector`` (default True).

    The first awaited call binds it to the running loop; use it from that loop
    only. Works on the default asyncio loop and on uvloop.

    Raises:
        TypeError: ``connector`` offers no wake-up hook (``watch_arrivals()`` is None).
    """

    def __init__(self, connector: OmniConnectorBase, *, close_connector: bool = True) -> None:
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: ArrivalWatch | None = None
        self.connector = connector
        self._close_connector = close_connector
        self._gets: dict[Slot, deque[_GetWaiter]] = {}
        self._puts: deque[_PutWaiter] = deque()
        self._handed_back: dict[Slot, deque[tuple[Any, int]]] = {}
        self._handed_back_count = 0
        self._try_put: Callable[..., PutResult | None] | None = getattr(connector, "try_put", None)
        self._pull = bool(getattr(connector, "pull_receiver", False))
        # A pull-mode ZmqConnector (fetch_route, open_fetch_channel, fetch_done), or None.
        self._fetcher: Any = connector if self._pull else None
        self._ctx: Any = None  # the pull channels' ZeroMQ context (ours: closing the connector never closes them)
        # Per sender endpoint, the channels: each holds fewer FETCHes in flight than half the high-water
        # mark, since the sender's ROUTER cannot queue more replies to one DEALER than that (it keeps the
        # payload and the FETCH would go unanswered). 5,000 waiting gets on one sender are ten DEALERs.
        self._channels: dict[str, list[_Channel]] = {}
        self._per_channel = max(1, int(getattr(getattr(connector, "config", None), "hwm", 1000)) // 2)
        # The receiver's socket read on this loop while gets wait (push mode): see _read_lent.
        # A push receiver: its get by key never waits, and with our put's metadata it would (so never passed).
        self._push = isinstance(connector, LoopReadable) and not self._pull
        self._readable = self._push  # ...and this loop reads its socket while gets wait (off after a fault)
        self._reader: LoopReader | None = None
        self._reading = False  # the reader's descriptor is registered with the loop
        # Whether gets wait, asked by the receiver's I/O thread (a dict's truth: read-only, no lock needed).
        self._waiting = functools.partial(bool, self._gets)
        # While reading: the reader's mailbox-only take (the looks of an awaited get), else None.
        self._mailbox: Callable[[str, str, str], tuple[Any, int] | None] | None = None
        self._expiries: Deadlines[_GetWaiter] = Deadlines(self._get_timed_out)  # one loop timer for all gets
        # While a wake-up callback runs (_pump, _on_wake): the gets it resolved, whose tasks it resumes
        # once it is done (see _resume); None otherwise, and a get's result is set the plain way.
        self._held: list[ResumingFuture[Any]] | None = None
        watch = connector.watch_arrivals()
        if watch is None:
            raise TypeError(f"{type(connector).__name__} offers no wake-up hook (watch_arrivals() returned None)")
        self._watch = watch

    @classmethod
    def create(cls, spec: ConnectorSpec | Mapping[str, Any]) -> AsyncConnector:
        """Build the connector of ``spec`` through the factory and wrap it (closed by :meth:`aclose`)."""
        connector = create_connector(spec)
        try:
            return cls(connector)
        except BaseException:
            connector.close()
            raise

    # -- binding to the loop ----------------------------------------------------------
    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return loop
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("this AsyncConnector is bound to another event loop")
        if self._watch is None:
            raise RuntimeError("this AsyncConnector is closed")
        self._loop = loop
        for fd in self._watch.filenos():
            loop.add_reader(fd, self._on_wake)
        return loop

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` (or :meth:`close`) ran, or the wrapped connector was closed."""
        return self._closed or self.connector.closed

    # -- put -----------------------------------------------------------------------------
    async def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any, *, timeout: float | None = None
    ) -> PutResult:
        """Put ``data`` like the connector's ``put``; waiting for window room suspends this task only.

        Args:
            from_stage: the sending stage.
            to_stage: the receiving stage.
            put_key: the key.
            data: the payload (copied or pinned before this returns, as ``put`` does).
            timeout: longest wait for window room; default the connector's
                ``put_timeout_s`` (when it has one). Then the put fails as the
                blocking ``put`` would (``(False, 0, None)``, a timeout kept
                for the adapters).

        Returns:
            ``(ok, nbytes, metadata)``, as the connector's ``put``.
        """
        loop = self._loop
        if loop is None or loop is not asyncio.get_running_loop():
            loop = self._bind()
        try_put = self._try_put
        if try_put is None:  # the backend's put never waits for room
            return self.connector.put(from_stage, to_stage, put_key, data)
        args = (from_stage, to_stage, put_key, data)
        if not self._puts and not self._closed:  # (a closed connector's try_put fails the put as put does)
            got = try_put(*args)
            if got is not None:
                return got
        if self.closed:
            return self.connector.put(*args)  # counted and kept as a failure, as the backend does
        if timeout is None:
            timeout = float(getattr(getattr(self.connector, "config", None), "put_timeout_s", math.inf))
        waiter = _PutWaiter(loop.create_future(), args)
        self._puts.append(waiter)
        if len(self._puts) == 1 and self._watch is not None:
            # Hear of room from now on, then try again: room freed since the first try is not missed.
            self._watch.want_room(True)
            self._serve_puts()
            if waiter.fut.done():
                return waiter.fut.result()
        timer = loop.call_later(min(max(timeout, 0.0), MAX_WAIT_S), self._put_timed_out, waiter)
        try:
            return await waiter.fut
        finally:
            timer.cancel()
            if not waiter.fut.done():
                waiter.fut.cancel()
            with contextlib.suppress(ValueError):
                self._puts.remove(waiter)
            if self._puts:
                self._serve_puts()  # a waiter ahead that left may have been holding the others back

    def _serve_puts(self) -> None:
        """Admit waiting puts in order while the window takes them."""
        try_put = self._try_put
        assert try_put is not None
        puts = self._puts
        while puts:
            waiter = puts[0]
            if waiter.fut.done():
                puts.popleft()
                continue
            try:
                got = try_put(*waiter.args)
            except Exception as exc:  # a programming error of that put (its payload): its caller gets it
                puts.popleft()
                waiter.fut.set_exception(exc)
                continue
            if got is None:
                return
            puts.popleft()
            waiter.fut.set_result(got)

    def _put_timed_out(self, waiter: _PutWaiter) -> None:
        if waiter.fut.done():
            return
        with contextlib.suppress(ValueError):
            self._puts.remove(waiter)
        assert self._try_put is not None
        # One last try that, without room, fails the put as put_timeout_s does in the blocking put.
        try:
            got = self._try_put(*waiter.args, True)
        except Exception as exc:
            waiter.fut.set_exception(exc)
            return
        waiter.fut.set_result(got if got is not None else (False, 0, None))

    # -- get ------------------------------------------------------------------------------
    async def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[Any, int] | None:
        """Take the object put under ``get_key``, waiting (suspended, not blocking) until it arrives.

        Args:
            from_stage: the sending stage.
            to_stage: the receiving stage.
            get_key: the key.
            metadata: what the put returned, when the caller has it (pull mode
                fetches from its endpoint); ignored by backends that find data
                by key alone.
            timeout: seconds to wait; None waits until the data arrives or the
                connector closes; 0 looks once.

        Returns:
            ``(obj, nbytes)``, or None at the timeout or when the connector closes.

        Cancellation never loses an item (see the module docstring).
        """
        loop = self._loop
        if loop is None or loop is not asyncio.get_running_loop():
            loop = self._bind()
        if self._closed:
            return None
        slot = (str(from_stage), str(to_stage), str(get_key))
        if self._handed_back:
            kept = self._take_handed_back(slot)
            if kept is not None:
                return kept
        if not self._pull:  # the common case first: the item is there (a closed connector returns None)
            mailbox = self._mailbox
            got = mailbox(*slot) if mailbox is not None else self._look(slot, metadata)
            if got is not None:
                return got
        if timeout is not None and math.isnan(timeout):
            raise ValueError("timeout is NaN")
        if self.connector.closed or (timeout is not None and timeout <= 0 and not self._pull):
            return None
        deadline = None if timeout is None else loop.time() + min(max(timeout, 0.0), MAX_WAIT_S)
        waiter = _GetWaiter(ResumingFuture(loop=loop), slot, metadata)
        waiters = self._gets.get(slot)
        if waiters is None:
            waiters = self._gets[slot] = deque()
        waiters.append(waiter)
        expiry = deadline
        if self._pull and deadline is not None:
            # A pull-mode look is a round trip (as the blocking get's): give its answer time to come back.
            fetch_s = float(getattr(getattr(self.connector, "config", None), "fetch_timeout_s", 5.0))
            expiry = max(deadline, loop.time() + fetch_s) if timeout == 0 else deadline
        timer = None if expiry is None else self._expiries.add(loop, expiry, waiter)
        if self._readable and not (self._reading and self._reader is not None and self._reader.lent):
            self._read_lent(loop)  # (taken back by the I/O thread after an idle spell: ask again)
        try:
            if self._pull:
                self._fetch(waiter, deadline)
            return await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                got = waiter.fut.result()
                if got is not None:  # taken for us just before the cancellation: keep it for the next get
                    self._hand_back(slot, got)
            raise
        finally:
            if timer is not None:
                self._expiries.discard(timer)
            if not waiter.fut.done():
                waiter.fut.cancel()
            if waiter.slot in self._gets:  # (a resolved waiter is already out)
                self._forget_waiter(waiter)

    def _forget_waiter(self, waiter: _GetWaiter) -> None:
        waiters = self._gets.get(waiter.slot)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            del self._gets[waiter.slot]

    def _get_timed_out(self, waiter: _GetWaiter) -> None:
        if not waiter.fut.done():
            if not self._pull:
                # One last look (at the socket too): an arrival whose wake-up is still on its way is not missed.
                got = self._look(waiter.slot, waiter.metadata, socket_too=True)
                if got is not None:
                    waiter.fut.set_result(got)
                    return
            waiter.fut.set_result(None)

    def _take_handed_back(self, slot: Slot) -> tuple[Any, int] | None:
        kept = self._handed_back.get(slot)
        if not kept:
            return None
        got = kept.popleft()
        self._handed_back_count -= 1
        if not kept:
            del self._handed_back[slot]
        return got

    def _hand_back(self, slot: Slot, got: tuple[Any, int]) -> None:
        """Keep an item taken for a get that is gone; a waiting get of its address takes it at once."""
        if self._deliver(slot, got):
            return
        if self._handed_back_count >= _HANDED_BACK_MAX:
            oldest = next(iter(self._handed_back))
            self._take_handed_back(oldest)
            log.warning("dropped an item of %s handed back by a cancelled get: %d are kept", oldest, _HANDED_BACK_MAX)
        self._handed_back.setdefault(slot, deque()).append(got)
        self._handed_back_count += 1

    def _deliver(self, slot: Slot, got: tuple[Any, int]) -> bool:
        """Give ``got`` to the first live waiter of ``slot`` (it leaves the queue); False when there is none.

        Also the pump's hand-off (:meth:`LoopReader.pump`'s ``hand``): an arrival read on this loop
        goes straight to its waiter, without the mailbox and the watch.
        """
        waiters = self._gets.get(slot)
        if waiters is None:
            return False
        while waiters:
            waiter = waiters.popleft()
            if not waiter.fut.done():
                self._resolve(waiter.fut, got)
                if not waiters:
                    del self._gets[slot]
                return True
        del self._gets[slot]
        return False

    # -- wake-ups (loop thread) --------------------------------------------------------------
    def _resolve(self, fut: ResumingFuture[tuple[Any, int] | None], got: tuple[Any, int] | None) -> None:
        """Give a waiting get its item; inside a wake-up callback its task resumes at that callback's end."""
        held = self._held
        if held is not None:
            fut.hold(got)
            held.append(fut)
        else:
            fut.set_result(got)

    def _resuming(self, callback: Callable[..., T], *args: Any) -> T:
        """Run a wake-up callback; the gets it resolved resume once it returned, before the loop's next turn.

        Their tasks would otherwise wait for that turn (one more ``select`` and ready queue), on each
        hop of a lone message. Nested callbacks (``_on_wake`` pumps) leave it to the outermost.
        """
        if self._held is not None:
            return callback(*args)
        held: list[ResumingFuture[Any]] = []
        self._held = held
        try:
            result = callback(*args)
        except BaseException:
            queue(held)  # they still resume, on the loop's next turn
            raise
        finally:
            self._held = None
        if held:
            resume(held, self._loop) if self._loop is not None else queue(held)
        return result

    def _on_wake(self) -> None:
        self._resuming(self._read_watch)

    def _read_watch(self) -> None:
        watch = self._watch
        if watch is None:
            return
        arrived, room = watch.drain()
        if self.closed:
            self._wake_all()
            return
        if self._readable and self._reader is not None and self._gets:
            if not self._reading:  # the I/O thread confirmed it lent the socket (an empty notice), or took it back
                self._read_lent(self._loop)
            if self._read_socket(True) is False and self._loop is not None:
                self._loop.call_soon(self._pump, False)  # settled once the waiters it took items for resumed
        if arrived is None or arrived:
            self._arrived(arrived)
        if room:
            if self._puts:
                self._serve_puts()
            if not self._puts:  # (set again by the next put that finds no room)
                watch.want_room(False)

    def _arrived(self, arrived: list[Slot] | None) -> None:
        """Resolve the waiters of the addresses that ``arrived`` (None: of every address)."""
        gets = self._gets
        if self._pull or not gets:
            return
        if arrived is None:
            slots: list[Slot] = list(gets)
        elif len(arrived) == 1:  # a lone message (what a round trip waits for)
            slots = arrived
        else:
            slots = [slot for slot in dict.fromkeys(arrived) if slot in gets]
        mailbox = self._mailbox
        for slot in slots:
            waiters = gets.get(slot)
            if waiters is None:
                continue
            while waiters:
                waiter = waiters[0]
                if waiter.fut.done():
                    waiters.popleft()
                    continue
                got = mailbox(*slot) if mailbox is not None else self._look(slot, waiter.metadata)
                if got is None:
                    break
                waiters.popleft()
                self._resolve(waiter.fut, got)
            if not waiters:
                gets.pop(slot, None)

    def _look(self, slot: Slot, metadata: Metadata, *, socket_too: bool = False) -> tuple[Any, int] | None:
        """The connector's non-blocking get, as this wrapper's looks make it (``slot`` is of strings).

        A ZeroMQ push receiver finds items by key alone, and the metadata of one of its puts would
        make its ``get`` wait for that put (blocking the loop): it is never passed there. While the
        loop polls the socket, only the mailbox is looked at (the socket is the loop's to read),
        unless ``socket_too``.
        """
        if not self._push:
            return self.connector.get(*slot, metadata)
        if self._readable and self._mailbox is not None and not socket_too:
            return self._mailbox(*slot)
        assert isinstance(self.connector, LoopReadable)
        return self.connector.get_nowait(*slot)  # a plain get would wait for this process's own put

    def _read_lent(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Poll the receiver's socket on this loop and ask for it (a get is about to wait)."""
        if self._reader is None:
            assert isinstance(self.connector, LoopReadable)
            self._reader = self.connector.loop_reader()
            if self._reader is None:  # not bound yet: the watch alone (asked again by the next waiting get)
                return
        if loop is None:
            return
        if not self._reading:
            loop.add_reader(self._reader.fileno(), self._pump)
        self._reading = True
        self._mailbox = self._reader.take
        self._reader.lend(self._waiting)

    def _pump(self, woken: bool = True) -> None:
        """Read the lent socket on this thread; the waiters of what it reads resume before this returns.

        ``woken``: called by the loop for the descriptor. Such a read stops after the first message
        that brought items; their waiters resume (a lone message's reply is sent), and only then is
        the socket read on until ZeroMQ says it is empty (settled), in this same callback. Past a
        flood's share (one drain), the rest is read by a pump the loop runs after its other callbacks.
        """
        more = self._resuming(self._read_socket, woken)
        if more is False:
            more = self._resuming(self._read_socket, False)
            if more is False and self._loop is not None:
                self._loop.call_soon(self._pump, False)

    def _read_socket(self, woken: bool) -> bool | None:
        """One :meth:`LoopReader.pump` (see :meth:`_pump`); its result, None once the socket is not the loop's."""
        reader, watch = self._reader, self._watch
        if reader is None or watch is None:
            return None
        watch.deliver_inline(self._arrived)
        try:
            more = reader.pump(woken=woken, hand=self._deliver)
        except Exception:  # a bug: give the socket back to the I/O thread rather than fail on every wake-up
            log.exception("reading the connector's socket on the event loop failed; the I/O thread reads it now")
            self._readable = False
            more = None
            self._stop_reading()
            reader.close()  # no longer a reader: the I/O thread takes the socket back at once
            self._reader = None
        finally:
            watch.deliver_inline(None)
        if more is None:  # the I/O thread reads it now (or it closed): its arrivals come by the watch
            self._stop_reading()
        return more

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._mailbox = None
            if self._reader is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._reader.fileno())

    def _wake_all(self) -> None:
        """Closed: every waiting get gets None, every waiting put fails (as a put on a closed connector)."""
        for waiters in list(self._gets.values()):
            for waiter in waiters:
                if not waiter.fut.done():
                    waiter.fut.set_result(None)
        self._gets.clear()
        puts, self._puts = self._puts, deque()
        for put in puts:
            if put.fut.done():
                continue
            try:  # on a closed connector put counts and keeps the failure, as it does for any caller
                put.fut.set_result(self.connector.put(*put.args) if self.connector.closed else (False, 0, None))
            except Exception as exc:
                put.fut.set_exception(exc)

    # -- pull mode -----------------------------------------------------------------------------
    def _fetch(self, waiter: _GetWaiter, deadline: float | None) -> None:
        """Send (or send again) the FETCH of a waiting pull-mode get."""
        assert self._loop is not None
        if waiter.fut.done():
            return
        from_stage, to_stage, key = waiter.slot
        route = self._fetcher.fetch_route(from_stage, to_stage, key, waiter.metadata)
        if route is None:  # refused (a plaintext endpoint off the host): recorded by the connector
            waiter.fut.set_result(None)
            return
        endpoint, server_key = route
        chan = self._channel(endpoint, server_key)
        # The server answers "not found" a little before the deadline, so the reply is in by then.
        wait_s = _LONG_POLL_S if deadline is None else max(0.0, (deadline - self._loop.time()) * 0.8)
        try:
            req_id = chan.channel.send(from_stage, to_stage, key, wait_s)
        except Exception as exc:
            waiter.fut.set_result(self._fetcher.fetch_done(from_stage, to_stage, key, endpoint, exc))
            return
        chan.fetches[req_id] = _Fetch(waiter.slot, endpoint, waiter, deadline, self._loop.time() + wait_s / 2)
        self._on_channel(chan)  # ZeroMQ's descriptor is edge-triggered: look once after each send

    def _channel(self, endpoint: str, server_key: bytes | None) -> _Channel:
        """A channel to ``endpoint`` with room for one more FETCH (opened when all are at their share)."""
        chans = self._channels.setdefault(endpoint, [])
        for chan in chans:
            if len(chan.fetches) < self._per_channel:
                return chan
        if self._ctx is None:
            import zmq

            self._ctx = zmq.Context(io_threads=1)
        channel = self._fetcher.open_fetch_channel(self._ctx, endpoint, server_key)
        chan = _Channel(channel, channel.fileno())
        chans.append(chan)
        assert self._loop is not None
        self._loop.add_reader(chan.fd, self._on_channel, chan)
        return chan

    def _on_channel(self, chan: _Channel) -> None:
        self._resuming(self._read_channel, chan)

    def _read_channel(self, chan: _Channel) -> None:
        for req_id, result in chan.channel.replies():
            fetch = chan.fetches.pop(req_id, None)
            if fetch is None:
                continue  # an answer to a FETCH of a channel reopened since
            got = self._fetcher.fetch_done(*fetch.slot, fetch.endpoint, result)
            waiter = fetch.waiter
            if got is not None:
                if waiter is not None and not waiter.fut.done():
                    self._resolve(waiter.fut, got)
                else:
                    self._hand_back(fetch.slot, got)
            elif waiter is not None and not waiter.fut.done():
                assert self._loop is not None
                now = self._loop.time()
                if result is None and (fetch.deadline is None or fetch.deadline > now):
                    if now < fetch.parked_until:
                        # Answered at once: the sender parks no more FETCHes now. Ask again a little later.
                        self._loop.call_later(_REFETCH_S, self._fetch, waiter, fetch.deadline)
                    else:
                        self._fetch(waiter, fetch.deadline)  # the server's long poll ended first: ask again
                else:
                    self._resolve(waiter.fut, None)

    # -- closing -------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Wake every waiting get with None and every waiting put with a failure, then close.

        Closing the wrapped connector may wait for its I/O thread (about a
        second at most, plus its ``close_timeout_s``): that wait runs in a
        one-shot thread so the loop keeps running; it ends with the close.
        """
        connector = self._shutdown()
        if connector is None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def close() -> None:
            try:
                connector.close()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(finish)

        threading.Thread(target=close, name="zmq-omni-aio-close", daemon=True).start()
        await done

    def close(self) -> None:
        """Synchronous :meth:`aclose` (for code outside the loop, after it ended); blocks while the connector closes."""
        connector = self._shutdown()
        if connector is not None:
            connector.close()

    def _shutdown(self) -> OmniConnectorBase | None:
        """Everything but closing the connector; the connector when the caller must close it."""
        if self._closed:
            return None
        self._closed = True
        self._wake_all()
        loop = self._loop if self._loop is not None and not self._loop.is_closed() else None
        for chans in self._channels.values():
            for chan in chans:
                if loop is not None:
                    loop.remove_reader(chan.fd)
                chan.channel.close()
        self._channels.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._stop_reading()
        if self._reader is not None:
            self._reader.close()
        self._expiries.close()
        watch, self._watch = self._watch, None
        if watch is not None:
            if loop is not None:
                for fd in watch.filenos():
                    loop.remove_reader(fd)
            watch.close()
        self._handed_back.clear()
        return self.connector if self._close_connector else None

    async def __aenter__(self) -> AsyncConnector:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_watch", None) is None:
            return
        warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
        with contextlib.suppress(Exception):
            watch, self._watch = self._watch, None
            if watch is not None:
                watch.close()
            if self._reader is not None:
                self._reader.close()

    def __repr__(self) -> str:
        return f"<AsyncConnector {getattr(self, 'connector', None)!r}>"

    def health(self) -> dict[str, Any]:
        """The connector's ``health()`` plus this wrapper's waiters (``aio_gets_waiting``, ``aio_puts_waiting``)."""
        base = self.connector.health()
        base["aio_gets_waiting"] = sum(len(w) for w in self._gets.values())
        base["aio_puts_waiting"] = len(self._puts)
        base["aio_handed_back"] = self._handed_back_count
        return base
