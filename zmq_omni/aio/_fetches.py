"""Pull-mode gets of an ``AsyncConnector``: FETCHes on channels the event loop watches.

Items never arrive by themselves in pull mode: each waiting get sends a FETCH
that the sender parks until the put (a long poll), on one DEALER per sender
endpoint (a :class:`~zmq_omni.transport.FetchChannel`, opened through the
connector's ``open_fetch_channel`` on a ZeroMQ context of our own), whose
ZeroMQ descriptor is registered with the loop; replies are matched to waiters
by request id. A reply whose get is gone is handed back to the
``AsyncConnector`` (a FETCH cannot be called back). A FETCH unanswered
:data:`~zmq_omni.transport._pull_client.SILENT_S` past its park is taken as lost
(the server's socket was bound anew, which drops what it held) and asked again.

Who owns what: a :class:`Fetches` belongs to one ``AsyncConnector`` and is
touched on its event loop's thread only; its channels and context are its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..connectors.base import Slot
from ..transport import MAX_PARK_S, SILENT_S
from ._waiters import GetWaiter

_LONG_POLL_S = MAX_PARK_S  # what a pull-mode FETCH asks the sender to park at most (the server's own cap)
_REFETCH_S = 0.05  # a FETCH the sender would not park is asked again after this


@dataclass(eq=False, slots=True)
class _Fetch:
    """A FETCH sent on a channel and not answered yet (its waiter may be gone: then the item is handed back)."""

    slot: Slot
    endpoint: str
    waiter: GetWaiter | None
    deadline: float | None  # the waiter's (loop time); None: wait as long as it takes
    parked_until: float  # an "absent" answer before this time means the sender did not park the FETCH
    lost: asyncio.TimerHandle | None = None  # asks again if no answer came SILENT_S past the park


@dataclass(eq=False)
class _Channel:
    channel: Any  # a FetchChannel
    fd: int
    fetches: dict[int, _Fetch] = field(default_factory=dict)


class Fetches:
    """The FETCH channels of one ``AsyncConnector`` over a pull-mode ``ZmqConnector`` (see the module docstring).

    Args:
        fetcher: the connector (its ``fetch_route``, ``open_fetch_channel`` and ``fetch_done``).
        per_channel: most FETCHes in flight on one channel.
        hand_back: keeps an item whose get was gone when it came.
    """

    def __init__(self, fetcher: Any, per_channel: int, hand_back: Callable[[Slot, tuple[Any, int]], None]) -> None:
        self._fetcher = fetcher
        self._per_channel = per_channel
        self._hand_back = hand_back
        self._ctx: Any = None  # the channels' ZeroMQ context (ours: closing the connector never closes them)
        self._channels: dict[str, list[_Channel]] = {}

    def fetch(self, loop: asyncio.AbstractEventLoop, waiter: GetWaiter, deadline: float | None) -> None:
        """Send (or send again) the FETCH of a waiting pull-mode get."""
        if waiter.fut.done():
            return
        from_stage, to_stage, key = waiter.slot
        route = self._fetcher.fetch_route(from_stage, to_stage, key, waiter.metadata)
        if route is None:  # refused (a plaintext endpoint off the host): recorded by the connector
            waiter.fut.set_result(None)
            return
        endpoint, server_key = route
        chan = self._channel(loop, endpoint, server_key)
        # The server answers "not found" a little before the deadline, so the reply is in by then.
        wait_s = _LONG_POLL_S if deadline is None else min(_LONG_POLL_S, max(0.0, (deadline - loop.time()) * 0.8))
        try:
            req_id = chan.channel.send(from_stage, to_stage, key, wait_s)
        except Exception as exc:
            waiter.fut.set_result(self._fetcher.fetch_done(from_stage, to_stage, key, endpoint, exc))
            return
        fetch = chan.fetches[req_id] = _Fetch(waiter.slot, endpoint, waiter, deadline, loop.time() + wait_s / 2)
        fetch.lost = loop.call_later(wait_s + SILENT_S, self._lost, loop, chan, req_id)
        self._on_channel(loop, chan)  # ZeroMQ's descriptor is edge-triggered: look once after each send

    def _channel(self, loop: asyncio.AbstractEventLoop, endpoint: str, server_key: bytes | None) -> _Channel:
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
        loop.add_reader(chan.fd, self._on_channel, loop, chan)
        return chan

    def _on_channel(self, loop: asyncio.AbstractEventLoop, chan: _Channel) -> None:
        for req_id, result in chan.channel.replies():
            fetch = chan.fetches.pop(req_id, None)
            if fetch is None:
                continue  # an answer to a FETCH of a channel reopened since, or taken as lost
            if fetch.lost is not None:
                fetch.lost.cancel()
            got = self._fetcher.fetch_done(*fetch.slot, fetch.endpoint, result)
            waiter = fetch.waiter
            if got is not None:
                if waiter is not None and not waiter.fut.done():
                    waiter.fut.set_result(got)
                else:
                    self._hand_back(fetch.slot, got)
            elif waiter is not None and not waiter.fut.done():
                now = loop.time()
                if result is None and (fetch.deadline is None or fetch.deadline > now):
                    if now < fetch.parked_until:
                        # Answered at once: the sender parks no more FETCHes now. Ask again a little later.
                        loop.call_later(_REFETCH_S, self.fetch, loop, waiter, fetch.deadline)
                    else:
                        self.fetch(loop, waiter, fetch.deadline)  # the server's long poll ended first: ask again
                else:
                    waiter.fut.set_result(None)

    def _lost(self, loop: asyncio.AbstractEventLoop, chan: _Channel, req_id: int) -> None:
        """No answer ``SILENT_S`` past the FETCH's park: the server dropped it (bound anew). Ask again."""
        fetch = chan.fetches.pop(req_id, None)
        if fetch is None or fetch.waiter is None or fetch.waiter.fut.done():
            return
        if fetch.deadline is not None and fetch.deadline <= loop.time():
            fetch.waiter.fut.set_result(None)
        else:
            self.fetch(loop, fetch.waiter, fetch.deadline)

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Close every channel (unregistered from ``loop``, unless None: closed) and the context."""
        for chans in self._channels.values():
            for chan in chans:
                for fetch in chan.fetches.values():
                    if fetch.lost is not None:
                        fetch.lost.cancel()
                if loop is not None:
                    loop.remove_reader(chan.fd)
                chan.channel.close()
        self._channels.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
