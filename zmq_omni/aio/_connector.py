"""``AsyncConnector``: awaitable put/get over any zmq_omni connector, without a thread per waiting call.

Two ways a ZeroMQ connector's sockets are driven (see ``docs/asyncio.md``):

* **by the event loop** -- :meth:`AsyncConnector.create` builds the
  ``ZmqConnector`` with a :class:`~zmq_omni.aio._driver.LoopDriver`, attached
  to the loop at the first await: every socket of the connector belongs to the
  loop, and no I/O thread exists. Arrivals are read on the loop's thread, and
  the watch hands their addresses to the waiting gets in that same callback
  (:meth:`~zmq_omni.connectors.base.ArrivalWatch.deliver_inline`).
* **by threads** -- ``AsyncConnector(connector)`` wraps a connector built
  otherwise (a threaded ``ZmqConnector``, ``SharedMemoryConnector``,
  ``InProcConnector``, ...): its own threads read its sockets, and the loop
  waits on its :class:`~zmq_omni.connectors.base.ArrivalWatch`.

How a waiting call wakes (nothing polls, no thread waits for it):

* **get, push mode / in-process / shared memory** -- the watch's descriptors (an eventfd, plus
  inotify for shared memory) are registered with the loop once; its notifications name the
  addresses that arrived, and the callback retries the non-blocking get for their waiters only.
  Thousands of waiting gets are thousands of futures in a dict, and one file descriptor.
* **get, ZeroMQ pull mode** -- each get sends a FETCH that the sender parks until the put (a
  long poll), on a channel whose ZeroMQ descriptor is registered with the loop (``_fetches``).
* **put** -- ``connector.try_put`` admits the put without waiting; with the window full the put
  queues (first come, first served), retried when the watch reports room.

Cancellation: a get cancelled while it waits takes nothing. A get whose item was taken for it
and that is cancelled before it resumes hands the item back to this ``AsyncConnector``: the next
get of the address here returns it (not the wrapped connector's ``get``); one no get took by
:meth:`AsyncConnector.aclose`, or handed back after it, is reported (:meth:`AsyncConnector.drain_failures`,
a WARNING). In pull mode an item served after its get was gone is handed back the same way (a
FETCH cannot be called back). A put cancelled while it waits for room is not made.

Who owns what: every field is touched on the event loop's thread only (the
watch's own lock covers its notifications from other threads). The waiting
calls' bookkeeping is in ``_waiters``, awaited flushes in ``_flushes``, closing the wrapped
connector in ``_closing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase, OmniConnectorFactory, create_connector
from ..connectors.base import MAX_WAIT_S, ArrivalWatch, Slot, TransferFailure, bounded_timeout
from ._closing import address_freed, close_in_thread, close_without_linger, running_loop
from ._driver import LoopDriver
from ._expiry import Deadlines
from ._fetches import Fetches
from ._flushes import Flushes
from ._waiters import GetWaiter, GetWaiters, HandedBack, Metadata, PutLine, PutResult, PutWaiter

__all__ = ["AsyncConnector"]

log = logging.getLogger("zmq_omni.aio")


class AsyncConnector:
    """The asyncio face of a connector: ``await put(...)``, ``await get(...)``, ``async with``.

    Args:
        connector: any zmq_omni connector whose :meth:`watch_arrivals` gives a
            watch (``ZmqConnector`` in push or pull mode, driven by threads or by an
            event loop, ``SharedMemoryConnector``, ``InProcConnector``, or your own
            backend implementing it).
        close_connector: :meth:`aclose` also closes ``connector`` (default True).

    The first awaited call binds it to the running loop (and attaches a
    ``ZmqConnector`` driven by an event loop to it); use it from that loop
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
        self._handed_back = HandedBack()
        self._lost: list[TransferFailure] = []  # items handed back and never taken again (aclose)
        self._try_put: Callable[..., PutResult | None] | None = getattr(connector, "try_put", None)
        self._puts = PutLine(self._try_put)
        self._pull = bool(getattr(connector, "pull_receiver", False))
        # Pull mode's FETCH channels, per sender: each holds fewer FETCHes than half the high-water mark, as
        # the sender's ROUTER queues no more replies to one DEALER (5,000 waiting gets on one sender: ten DEALERs).
        per_channel = max(1, int(getattr(getattr(connector, "config", None), "hwm", 1000)) // 2)
        self._fetches = Fetches(connector, per_channel, self._hand_back) if self._pull else None
        # A ZmqConnector's get by key that never waits (its get would, for a put of this process on its
        # way there): the look of every awaited get. None: the backend's get never waits by key.
        self._nowait: Callable[..., tuple[Any, int] | None] | None = getattr(connector, "get_nowait", None)
        self._nowait = None if self._pull else self._nowait
        self._gets = GetWaiters(self._look)
        # The connector's sockets belong to this loop (a ZmqConnector built with a LoopDriver).
        driver = getattr(connector, "driver", None)
        self._driver: LoopDriver | None = driver if isinstance(driver, LoopDriver) else None
        self._expiries: Deadlines[GetWaiter] = Deadlines(self._get_timed_out)  # one loop timer for all gets
        self._flushes = Flushes(connector, pull=self._pull, puts_wait=lambda: bool(self._puts))
        watch = connector.watch_arrivals()
        if watch is None:
            raise TypeError(f"{type(connector).__name__} offers no wake-up hook (watch_arrivals() returned None)")
        self._watch = watch

    @classmethod
    def create(cls, spec: ConnectorSpec | Mapping[str, Any]) -> AsyncConnector:
        """Build the connector of ``spec`` and wrap it (closed by :meth:`aclose`).

        A ``ZmqConnector`` (or a subclass) is built driven by the event loop: its sockets
        belong to the loop running here (called outside a loop: the loop of the first
        await), and it runs no I/O thread. Any other backend is built through the
        factory, as ``create_connector`` does.

        Raises:
            ConfigError: as the connector's constructor (and, for a ``ZmqConnector``, a bind at
                an address another connector of this process holds: see ``docs/asyncio.md``).
        """
        from ..connectors.zmq import ZmqConnector  # (the factory imports its backends when first built)

        if not isinstance(spec, ConnectorSpec):
            spec = ConnectorSpec.from_dict(spec)
        ctor = OmniConnectorFactory.constructor(spec.name)
        if isinstance(ctor, type) and issubclass(ctor, ZmqConnector):
            connector: OmniConnectorBase = ctor(dict(spec.extra), driver=LoopDriver)
        else:
            connector = create_connector(spec)
        try:
            wrapper = cls(connector)
        except BaseException:
            connector.close()
            raise
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop runs here: the first await binds it
            return wrapper
        wrapper._bind()
        return wrapper

    # -- binding to the loop ----------------------------------------------------------
    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return loop
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("this AsyncConnector is bound to another event loop")
        if self._watch is None:
            raise RuntimeError("this AsyncConnector is closed")
        if self._driver is not None and not self.connector.closed:
            self._driver.attach(loop)  # the connector's sockets are this loop's from now on
            # Arrivals are stored on this thread, inside the driver's callbacks: straight to the waiters.
            self._watch.deliver_inline(self._arrived_inline)
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
            if self.connector.closed:
                return self.connector.put(*args)  # counted and kept as a failure, as the backend does
            return (False, 0, None)  # this wrapper closes (aclose lingers): the put is not made
        if timeout is None:
            timeout = float(getattr(getattr(self.connector, "config", None), "put_timeout_s", math.inf))
        waiter = PutWaiter(loop.create_future(), args)
        self._puts.add(waiter)
        if len(self._puts) == 1 and self._watch is not None:
            # Hear of room from now on, then try again: room freed since the first try is not missed.
            self._watch.want_room(True)
            self._puts.serve()
            if waiter.fut.done():
                return waiter.fut.result()
        timer = loop.call_later(min(max(timeout, 0.0), MAX_WAIT_S), self._puts.timed_out, waiter)
        try:
            return await waiter.fut
        finally:
            timer.cancel()
            if not waiter.fut.done():
                waiter.fut.cancel()
            self._puts.remove(waiter)
            if self._puts:
                self._puts.serve()  # a waiter ahead that left may have been holding the others back

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
        if self._handed_back.count:
            kept = self._handed_back.take(slot)
            if kept is not None:
                return kept
        if not self._pull:  # the common case first: the item is there (a closed connector returns None)
            got = self._look(slot, metadata)
            if got is not None:
                return got
        if timeout is not None and math.isnan(timeout):
            raise ValueError("timeout is NaN")
        if self.connector.closed or (timeout is not None and timeout <= 0 and not self._pull):
            return None
        deadline = None if timeout is None else loop.time() + min(max(timeout, 0.0), MAX_WAIT_S)
        waiter = GetWaiter(loop.create_future(), slot, metadata)
        self._gets.add(waiter)
        expiry = deadline
        if self._pull and deadline is not None:
            # A pull-mode look is a round trip (as the blocking get's): give its answer time to come back.
            fetch_s = float(getattr(getattr(self.connector, "config", None), "fetch_timeout_s", 5.0))
            expiry = max(deadline, loop.time() + fetch_s) if timeout == 0 else deadline
        timer = None if expiry is None else self._expiries.add(loop, expiry, waiter)
        try:
            if self._fetches is not None:
                self._fetches.fetch(loop, waiter, deadline)
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
            if self._gets.waits(slot):  # (a resolved waiter is already out)
                self._gets.forget(waiter)

    def _get_timed_out(self, waiter: GetWaiter) -> None:
        if not waiter.fut.done():
            if not self._pull:
                # One last look: an arrival whose wake-up is still on its way is not missed.
                got = self._look(waiter.slot, waiter.metadata)
                if got is not None:
                    waiter.fut.set_result(got)
                    return
            waiter.fut.set_result(None)

    def _hand_back(self, slot: Slot, got: tuple[Any, int]) -> None:
        """Keep an item taken for a get that is gone; a waiting get of its address takes it at once."""
        if not self._gets.deliver(slot, got):
            self._lost += self._handed_back.keep(slot, got)  # (after aclose, or over the limit: reported)

    # -- wake-ups (loop thread) --------------------------------------------------------------
    def _on_wake(self) -> None:
        watch = self._watch
        if watch is None:
            return
        arrived, room = watch.drain()
        if self._flushes and (room or self.closed):  # an awaited flush (aclose's too) looks again
            self._flushes.wake()
        if self.closed:
            self._wake_all()
            return
        if (arrived is None or arrived) and not self._pull:  # (pull mode: nothing arrives by itself)
            self._gets.resolve(arrived)
        if room:
            if self._puts:
                self._puts.serve()
            if not self._puts and not self._flushes:  # (set again by the next put that finds no room)
                watch.want_room(False)

    def _arrived_inline(self, arrived: list[Slot]) -> None:
        """Arrivals stored on this loop's thread (the connector's driver is this loop): resolve their waiters.

        Called inside the connector's read: a failure here is logged, never raised into it.
        """
        try:
            if not self._pull:
                self._gets.resolve(arrived)
        except Exception:
            log.exception("handing arrivals to the waiting gets failed")

    def _look(self, slot: Slot, metadata: Metadata) -> tuple[Any, int] | None:
        """The connector's non-blocking get, as this wrapper's looks make it (``slot`` is of strings).

        A ZeroMQ push receiver's ``get`` would wait for the metadata's put (blocking the loop): ``get_nowait`` looks.
        """
        nowait = self._nowait
        if nowait is not None:
            return nowait(*slot)
        return self.connector.get(*slot, metadata)

    def _wake_all(self) -> None:
        """Closed: every waiting get gets None, every waiting put fails (as a put on a closed connector)."""
        self._gets.wake_all()
        # On a closed connector put counts and keeps the failure, as it does for any caller.
        self._puts.fail_all(self.connector.put if self.connector.closed else None)

    # -- flushing and closing -------------------------------------------------------------------
    async def flush(self, timeout_s: float) -> bool:
        """Wait (suspended, not blocking) up to ``timeout_s`` until every put so far is safe without the connector.

        The connector's ``flush``, awaited: push mode, each put's arrival was confirmed
        (and its consumption, for one in shared memory); pull mode, each payload was
        fetched. The loop runs on meanwhile.

        Returns:
            True when nothing is left unconfirmed; False after ``timeout_s``, or once the
            connector is closed with puts unconfirmed.
        """
        loop = self._loop
        if loop is None or loop is not asyncio.get_running_loop():
            self._bind()
        return await self._flushes.wait(self._watch, bounded_timeout(timeout_s))

    async def aclose(self) -> None:
        """Wake every waiting get with None and every waiting put with a failure, then close the connector.

        A connector driven by this loop is given up to its ``close_timeout_s`` for the
        acknowledgements of its puts first, awaited (the loop runs on), and then closes here,
        on the loop; each put still unconfirmed is reported as a threaded close reports it (a
        WARNING naming the keys, ``drain_failures()``), and its address is awaited free. A connector
        driven by threads closes in a one-shot thread (it may wait for its I/O thread); what it raises, this raises.
        Cancelled in its linger, it still closes the connector (without the linger's rest).

        Raises:
            RuntimeError: awaited on a loop other than the running loop this wrapper is bound to.
        """
        owner = self._loop
        if not self._closed and owner is not None and owner.is_running() and owner is not running_loop():
            raise RuntimeError("aclose() of an AsyncConnector bound to another running event loop: await it there")
        if self._closed:
            return
        self._closed = True
        self._wake_all()
        linger = 0.0
        if self._driver is not None and self._close_connector and not self.connector.closed:
            linger = float(getattr(getattr(self.connector, "config", None), "close_timeout_s", 0.0))
            try:
                self._bind()  # a connector never awaited before: its loop drives the last acknowledgements
            except RuntimeError:  # bound to another loop, stopped, which alone could do them: no linger
                linger = 0.0
        try:
            if linger > 0:
                await self._flushes.wait(self._watch, bounded_timeout(linger))
        finally:  # (cancelled in its linger too: the connector closes, without the rest of it)
            connector = self._release()
            if connector is not None and self._driver is not None:
                close_without_linger(connector)  # here: the driver stops on this loop's thread
        if connector is not None and self._driver is not None:
            await address_freed(getattr(connector, "endpoint", None))  # (its listener closes a moment later)
        elif connector is not None:
            await close_in_thread(connector)

    def close(self) -> None:
        """Synchronous :meth:`aclose` (for code outside the loop, after it ended); blocks while the connector closes.

        A connector driven by an event loop closes without a linger then (no loop runs to do it).
        """
        if self._closed:
            return
        self._closed = True
        self._wake_all()
        connector = self._release()
        if connector is not None:
            connector.close()

    def _release(self) -> OmniConnectorBase | None:
        """Let go of this wrapper's own resources; the connector when the caller must close it."""
        loop = self._loop if self._loop is not None and not self._loop.is_closed() else None
        if self._fetches is not None:
            self._fetches.close(loop)
        self._expiries.close()
        watch, self._watch = self._watch, None
        if watch is not None:
            if loop is not None:
                for fd in watch.filenos():
                    loop.remove_reader(fd)
            watch.close()
        self._lost += self._handed_back.abandon()
        return self.connector if self._close_connector else None

    async def __aenter__(self) -> AsyncConnector:
        if not self._closed:
            self._bind()
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

    def __repr__(self) -> str:
        return f"<AsyncConnector {getattr(self, 'connector', None)!r}>"

    def drain_failures(self) -> list[TransferFailure]:
        """The connector's failures, and the items taken for cancelled gets that no get took before :meth:`aclose`."""
        lost, self._lost = self._lost, []
        return lost + self.connector.drain_failures()

    def health(self) -> dict[str, Any]:
        """The connector's ``health()`` plus this wrapper's waiters (``aio_gets_waiting``, ``aio_puts_waiting``)."""
        base = self.connector.health()
        base["aio_gets_waiting"] = self._gets.count()
        base["aio_puts_waiting"] = len(self._puts)
        base["aio_handed_back"] = self._handed_back.count
        return base
