"""A pull endpoint shared by the processes of a stage on one host: one binds and serves, the others store there.

In pull mode the sending stage binds the endpoint downstream stages FETCH
from. Every process of the stage (its replicas, its EngineCore and TP workers)
names that one endpoint, and a FETCH may reach any of them for a key any of
them put. So, as push mode's receive endpoint
(:mod:`~zmq_omni.transport._stage_client`), the holder of the stage lock
(:mod:`~zmq_omni.transport._stage_lock`) binds it with a
:class:`~zmq_omni.transport._pull_server.PullServer` and a service socket
(:class:`~zmq_omni.transport._stage_pull_service.StagePullService`); every
other process of the stage on the host is its **local client**: its puts go
over the service socket into the binder's store (``PUT``), and a put is
confirmed only once the binder holds it (``STORED``). A payload at or above
the shared-memory threshold is written into a slot of this process's pool and
only its handle crosses, once the binder said it reads this process's memory.

A :class:`StagePull` is the pull part of a connector in either role: it
stands in for the :class:`PullServer` (the same ``store``, ``forget``,
``wait_fetched``, ``drop_owned``, ``close``), delegating to its own server
while this process binds.

A client keeps each payload until the binder says it was fetched (its reply
handed to ZeroMQ), given up (``FAILED``: reported as the put's failure) or
cleaned up. The binder's death is judged by the kernel: the stage lock is
free (this process takes it, binds, and stores what it keeps in its own
server), or another process holds it, or the binder's service answers as a
new incarnation (this process stores what it keeps there, on a new socket).
So no confirmed put is lost with the binder; one whose reply was handed to
ZeroMQ just before the binder died may be stored twice, and the copy nobody
fetches expires as a failed put after ``pull_ttl_s``.

Threads: put threads call :meth:`StagePull.store`, :meth:`~StagePull.forget`,
:meth:`~StagePull.wait_fetched`, :meth:`~StagePull.drop_owned` and
:meth:`~StagePull.close`; the driver runs the rest and alone touches the
DEALER. ``_puts``, ``_inner`` and the counts are guarded by ``_cv``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ..errors import ClosedResourceError, DeliveryError, TransportTimeoutError, ZmqOmniError
from ..metrics import Counters
from ._loop import Driver
from ._pull_protocol import Slot
from ._pull_server import OwnedFailureCallback, PullServer
from ._shm import ShmReceive, ShmSend
from ._signal import NotifyingCondition, WouldBlock
from ._stage_lock import StageLock
from ._stage_pull_service import StagePullService

__all__ = ["StagePull"]

log = logging.getLogger("zmq_omni.transport")

_WAIT, _STORED, _FULL = 0, 1, 2
_MARGIN_S = 0.05  # a PUT asks the binder to wait for room this much less than the put does


class _Put:
    """A payload this process handed to the binder, kept until it was fetched there."""

    __slots__ = ("frames", "loc", "nbytes", "owner", "put_id", "slot", "state")

    def __init__(self, put_id: int, slot: Slot, frames: list[Any], nbytes: int, owner: Any, loc: bytes | None) -> None:
        self.put_id = put_id
        self.loc = loc  # its slot in this process's pool, while the binder was handed the handle
        self.slot = slot
        self.frames = frames
        self.nbytes = nbytes
        self.owner = owner
        self.state = _WAIT


class StagePull(PullServer):
    """The pull part of one process of a stage: the binder's server, or a client of it (see the module docstring).

    Args:
        loop: the driver of the endpoint (its I/O thread).
        endpoint: the stage endpoint, as FETCHes name it (what ``put``'s metadata carries).
        lock: the stage lock of the endpoint (taken here when free).
        build_server: binds the stage endpoint's :class:`PullServer` on ``loop`` (when this process binds).
        counters: the endpoint's counters.
        on_failure: a payload's failure, with its owner first (as :class:`PullServer`'s).
        put_timeout_s: longest a put waits for the binder's confirmation (and its room).
        heartbeat_s: how often the binder is pinged and the stage lock looked at.
        shm: this process's slot pool (large payloads go to the binder as handles), or None.
        reader: opens the clients' handles while this process binds, or None.
    """

    def __init__(
        self,
        loop: Driver,
        endpoint: str,
        *,
        lock: StageLock,
        build_server: Callable[[], PullServer],
        counters: Counters,
        on_failure: OwnedFailureCallback,
        put_timeout_s: float,
        heartbeat_s: float,
        shm: ShmSend | None = None,
        reader: ShmReceive | None = None,
    ) -> None:
        # Not PullServer.__init__: the server, when this process binds, is ``_inner``.
        self._loop = loop
        self.endpoint = endpoint
        self._stage_lock = lock
        self._build = build_server
        self._counters = counters
        self._on_failure = on_failure
        self._put_timeout = put_timeout_s
        self._shm = shm
        self._reader = reader
        self._shm_ok = False  # the binder reads this process's shared memory (its PONG says)
        self._cv = NotifyingCondition()
        self._kept: dict[int, _Put] = {}
        self._bytes = 0
        self._next_id = 0
        self._kept_done = 0
        self._bytes_sent = 0
        self._closed = False
        self._shut = False
        self._cancels: list[int] = []  # put ids to cancel at the binder as the driver stops
        self._inner: PullServer | None = None
        self._service: StagePullService | None = None
        self._sock: Any = None
        self._binder_pid: int | None = None
        self._incarnation: bytes | None = None  # the binder's service, as its first PONG names it
        if lock.try_acquire():
            self._bind()
        else:
            self._connect()
        loop.every(heartbeat_s, self._beat)
        loop.on_stop(self._shutdown)

    @property
    def binds(self) -> bool:
        """Whether this process binds the stage endpoint now."""
        return self._inner is not None

    # -- put threads ------------------------------------------------------------------
    def on_window_change(self, listener: Callable[[], None] | None) -> None:
        """As :meth:`PullServer.on_window_change` (here: a put was fetched, given up or cleaned up)."""
        with self._cv:
            self._cv.listener = listener
            inner = self._inner
        if inner is not None:
            inner.on_window_change(listener)

    def store(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        frames: list[Any],
        nbytes: int,
        *,
        block: bool = True,
        owner: Any = None,
    ) -> dict[str, Any]:
        """As :meth:`PullServer.store`; a client's put returns once the binder holds it.

        Raises:
            TransportTimeoutError: no room at the binder, or no confirmation, within ``put_timeout_s``.
            ClosedResourceError: closed.
            WouldBlock: ``block=False`` and the binder's store is full (nothing kept).
        """
        slot = (from_stage, to_stage, key)
        shm = self._shm
        loc = None
        if shm is not None and self._shm_ok and self._inner is None and nbytes >= shm.threshold:
            loc = shm.write(frames)  # one copy into our slot; only its handle crosses
            self._counters.add("shm_fallbacks" if loc is None else "shm_puts")
        with self._cv:
            inner = self._inner
            if inner is None:
                if self._closed:
                    raise ClosedResourceError("connector closed", endpoint=self.endpoint)
                self._next_id += 1
                put = _Put(self._next_id, slot, frames, nbytes, owner, loc)
                self._kept[put.put_id] = put
                self._bytes += nbytes
        if inner is not None:
            self._discard(loc)
            return inner.store(from_stage, to_stage, key, frames, nbytes, block=block, owner=owner)
        deadline = time.monotonic() + self._put_timeout
        wait_s = max(0.0, self._put_timeout - _MARGIN_S) if block else 0.0
        self._loop.call_soon(functools.partial(self._send_put, put, wait_s))
        with self._cv:
            while put.state == _WAIT and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            if put.state == _STORED:
                self._kept_done += 1
                self._bytes_sent += nbytes
                return {"endpoint": self.endpoint, "from_stage": from_stage, "to_stage": to_stage, "key": key,
                        "size": nbytes}  # fmt: skip
            if self._kept.pop(put.put_id, None) is not None:
                self._bytes -= nbytes
            state, closed = put.state, self._closed
        self._discard(put.loc)  # unless the binder opened it
        if closed:
            raise ClosedResourceError("connector closed", endpoint=self.endpoint)
        if state == _FULL:
            if not block:
                raise WouldBlock
            raise TransportTimeoutError("the stage's pull store stayed full", endpoint=self.endpoint)
        self._loop.call_soon(functools.partial(self._send, b"CANCEL", [put.put_id]))
        raise TransportTimeoutError(
            f"the binder of stage endpoint {self.endpoint} did not confirm the put within {self._put_timeout}s",
            endpoint=self.endpoint,
        )

    def forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        """As :meth:`PullServer.forget`, here and at the binder (which drops every process's matching payloads)."""
        with self._cv:
            inner = self._inner
            if inner is None:
                gone = [put for put in self._kept.values() if match(put.slot[2])]
                self._drop(gone)
        if inner is not None:
            return inner.forget(match)
        if key is not None or prefix is not None:
            self._loop.call_soon(functools.partial(self._send, b"FORGET", [key, prefix]))
        return len(gone)

    def stats(self) -> dict[str, Any]:
        """Occupancy: the server's while this process binds, else the payloads kept until fetched at the binder."""
        with self._cv:
            inner = self._inner
            if inner is None:
                return {
                    "puts": self._kept_done,
                    "bytes_sent": self._bytes_sent,
                    "pending": len(self._kept),
                    "pending_bytes": self._bytes,
                    "window_full": False,
                    "endpoint": self.endpoint,
                    "stage_binder": self._stage_lock.paths.service,
                }
        return inner.stats()

    def wait_fetched(self, timeout_s: float, owner: Any = None) -> bool:
        """As :meth:`PullServer.wait_fetched`, also across this process becoming the binder."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._inner is None and not self._closed:
                if not any(owner is None or put.owner is owner for put in self._kept.values()):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
            inner = self._inner
        if inner is None:
            return False
        return inner.wait_fetched(max(0.0, deadline - time.monotonic()), owner=owner)

    def drop_owned(self, owner: Any) -> list[str]:
        """As :meth:`PullServer.drop_owned`: ``owner``'s payloads not fetched are cancelled and reported lost."""
        with self._cv:
            inner = self._inner
            if inner is None:
                mine = [put for put in self._kept.values() if put.owner is owner]
                self._drop(mine, cancel=True)
        if inner is not None:
            return inner.drop_owned(owner)
        return self._lost(mine, "connector closed before stage {to} fetched the payload")

    def close(self) -> list[str]:
        """As :meth:`PullServer.close`. A binder's clients store what they keep with the next binder."""
        with self._cv:
            self._closed = True
            inner, service = self._inner, self._service
            kept = list(self._kept.values())
            if inner is None:
                self._drop(kept, cancel=True)
            self._cv.notify_all()
        if inner is not None:
            if service is not None:
                service.closing = True
            return inner.close()
        return self._lost(kept, "connector closed before stage {to} fetched the payload")

    def _discard(self, loc: bytes | None) -> None:
        """Free a slot of ours the binder never opened (a no-op once it leased it)."""
        if loc is not None and self._shm is not None:
            self._shm.discard(loc)

    def _drop(self, puts: list[_Put], *, cancel: bool = False) -> None:
        """Forget ``puts`` (caller holds ``_cv``); with ``cancel``, the binder drops them too."""
        for put in puts:
            if self._kept.pop(put.put_id, None) is not None:
                self._bytes -= put.nbytes
                self._discard(put.loc)
                if cancel:
                    self._cancels.append(put.put_id)
        if self._cancels:
            self._loop.call_soon(self._send_cancels)
        if puts:
            self._cv.notify_all()

    def _lost(self, puts: list[_Put], why: str) -> list[str]:
        for put in puts:
            self._counters.add("delivery_failures")
            reason = why.format(to=repr(put.slot[1]))
            self._on_failure(put.owner, "put", *put.slot, reason, DeliveryError(reason, key=put.slot[2]))
        return [put.slot[2] for put in puts]

    # -- the driver ----------------------------------------------------------------------
    def _bind(self) -> None:
        """Bind, holding the stage lock: bind the endpoint and serve the stage's other processes."""
        server = self._build()
        service = StagePullService(self._loop, server, self._stage_lock.paths.service, self._reader)
        self._loop.on_term(self._stage_lock.release)
        with self._cv:
            self._inner, self._service = server, service
            listener = self._cv.listener
        if listener is not None:
            server.on_window_change(listener)

    def _connect(self) -> None:
        """A DEALER to the binder's service (a new one after a binder change): hello, then every put kept."""
        sock = self._sock = self._loop.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._stage_lock.paths.service)
        self._loop.add_reader(sock, self._drive)
        self._binder_pid = self._stage_lock.holder()
        self._incarnation = None
        self._shm_ok = False  # until the new binder's PONG says it reads our memory
        self._send(b"HELLO", [os.getpid(), None if self._shm is None else self._shm.probe])
        with self._cv:
            kept = sorted(self._kept.values(), key=lambda put: put.put_id)
        for put in kept:
            self._discard(put.loc)  # the last binder's lease, if any, is reclaimed when its process is gone
            put.loc = None
            self._send_put(put, self._put_timeout)

    def _send_put(self, put: _Put, wait_s: float) -> None:
        if self._sock is None or self._kept.get(put.put_id) is not put:
            return  # stored in this process's own server since, or given up
        body = [put.put_id, *put.slot, put.nbytes, wait_s, put.loc]
        frames = put.frames if put.loc is None else []
        self._sock.send_multipart([b"PUT", msgpack.packb(body), *frames], copy=False)

    def _send(self, verb: bytes, body: list[Any]) -> None:
        if self._sock is not None and not self._shut:
            self._sock.send_multipart([verb, msgpack.packb(body)])

    def _send_cancels(self) -> None:
        with self._cv:
            cancels, self._cancels = self._cancels, []
        for put_id in cancels:
            self._send(b"CANCEL", [put_id])

    def _drive(self) -> None:
        while self._sock is not None and not self._shut:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            verb, body = frames[0], msgpack.unpackb(frames[1])
            if verb == b"PONG":
                self._ponged(int(body[0]), bytes(body[1]))
                self._shm_ok = bool(body[2]) if len(body) > 2 else False
                continue
            if verb == b"WHO":  # a binder this socket said no hello to: the binder changed
                self._moved("a new binder asks who this is")
                return
            if verb == b"FRAMES":  # the binder cannot read that slot: the payload goes as frames
                put = self._kept.get(int(body[0]))
                if put is not None and put.loc is not None:
                    self._discard(put.loc)
                    put.loc = None
                    self._send_put(put, self._put_timeout)
                continue
            failed: _Put | None = None
            with self._cv:
                put = self._kept.get(int(body[0]))
                if put is None:
                    continue
                if verb == b"STORED":
                    put.state = _STORED if put.state == _WAIT else put.state
                elif verb == b"FULL":
                    if put.state == _WAIT:
                        put.state = _FULL
                        self._discard(put.loc)
                else:  # FETCHED, FAILED, GONE: the binder let go of it
                    del self._kept[put.put_id]
                    self._bytes -= put.nbytes
                    put.state = _STORED if put.state == _WAIT else put.state
                    if verb == b"FAILED":
                        failed = put
                self._cv.notify_all()
            if failed is not None:
                self._lost([failed], str(body[1]) if len(body) > 1 else "given up by the stage's binder")

    def _ponged(self, pid: int, incarnation: bytes) -> None:
        if self._incarnation is not None and incarnation != self._incarnation:
            self._moved(f"its service answers anew, from process {pid}")
            return
        self._binder_pid, self._incarnation = pid, incarnation

    def _beat(self) -> None:
        """Ping the binder; take the stage lock when free (bind here), or follow the next binder."""
        if self._shut or self._inner is not None or self._closed:
            return
        if self._stage_lock.try_acquire():
            self._take_over()
            return
        self._send(b"PING", [])
        holder = self._stage_lock.holder()
        if holder is not None and self._binder_pid is not None and holder != self._binder_pid:
            self._moved(f"process {holder} holds the stage lock")

    def _moved(self, why: str) -> None:
        """Another process binds now: store what this one keeps there, on a new socket (stale messages die)."""
        log.warning("the binder of %s changed (%s): storing %d puts there", self.endpoint, why, len(self._kept))
        self._loop.remove_reader(self._sock)
        self._sock.close(linger=0)
        self._sock = None
        self._connect()

    def _take_over(self) -> None:
        """The binder is gone and this process holds the stage lock: bind, and store what it keeps here."""
        try:
            server = self._build()
        except Exception:
            self._stage_lock.release()
            log.exception("the binder of %s is gone and binding it here failed", self.endpoint)
            return
        service = StagePullService(self._loop, server, self._stage_lock.paths.service, self._reader)
        self._loop.on_term(self._stage_lock.release)
        if self._sock is not None:
            self._loop.remove_reader(self._sock)
            self._sock.close(linger=0)
            self._sock = None
        lost: list[tuple[_Put, ZmqOmniError]] = []
        full = TransportTimeoutError("the new binder's pull store is full", endpoint=self.endpoint)
        with self._cv:
            kept = sorted(self._kept.values(), key=lambda put: put.put_id)
            for put in kept:
                self._discard(put.loc)
                try:
                    server.store(*put.slot, put.frames, put.nbytes, block=False, owner=put.owner)
                except WouldBlock:
                    lost.append((put, full))
                except ZmqOmniError as exc:
                    lost.append((put, exc))
                put.state = _STORED if put.state == _WAIT else put.state
            self._kept.clear()
            self._bytes = 0
            self._inner, self._service = server, service
            listener = self._cv.listener
            self._cv.notify_all()
        if listener is not None:
            server.on_window_change(listener)
        log.warning("the binder of %s is gone: this process binds it now (%d puts kept)", self.endpoint, len(kept))
        for put, error in lost:
            self._on_failure(put.owner, "put", *put.slot, f"not stored after a binder change: {error}", error)

    def _shutdown(self) -> None:
        """The driver's last word: cancel what close gave up at the binder, close the DEALER."""
        self._send_cancels()
        self._shut = True
        if self._sock is not None:
            self._loop.remove_reader(self._sock)
            self._sock.close(linger=100)
            self._sock = None

    def __repr__(self) -> str:
        role = "binds it" if self._inner is not None else f"via {self._stage_lock.paths.service}"
        return f"<StagePull {self.endpoint} {role}{' closed' if self._closed else ''}>"
