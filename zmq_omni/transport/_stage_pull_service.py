"""The binder's side of a shared pull endpoint: the stage's other processes store their puts in its pull server.

In pull mode the *sending* stage binds: its pull server answers the
downstream stage's FETCHes. The processes of a stage on one host name one
endpoint; the holder of the stage lock (:mod:`~zmq_omni.transport._stage_lock`)
binds it with a :class:`~zmq_omni.transport._pull_server.PullServer` and serves
this socket at the stage's service address, on the same driver. The other
processes (:class:`~zmq_omni.transport._stage_pull.StagePull` as clients) hand
it their puts, so any FETCH of any key put by any process of the stage is
answered from one store. The wire is a multipart message
``[verb, msgpack body, *payload frames]``:

==========  ====================================  ==========================================
verb        body                                  meaning
==========  ====================================  ==========================================
``HELLO``   ``[pid, probe]``                      a client (on a new socket after a binder change)
``PING``    ``[]``                                alive; both answered ``PONG [pid, incarnation, shm]``
``PUT``     ``[id, from, to, key, nbytes, wait,   + the encoded payload, or none with ``loc``: store it
            loc]``                                (``wait``: s of room; ``loc``: a slot of the client's)
``FRAMES``  ``[id]``                              its ``loc`` cannot be read here: send the frames
``CANCEL``  ``[id]``                              the put is given up there: drop it
``FORGET``  ``[key, prefix]``                     a cleanup (firm for a key, digits for a prefix)
``STORED``  ``[id]``                              held here: the client's put is confirmed
``FULL``    ``[id]``                              no room by its ``wait``: nothing kept
``FETCHED`` ``[id]``                              its reply was handed to ZeroMQ: the client lets go
``FAILED``  ``[id, reason]``                      expired or given up here (reported by the client)
``GONE``    ``[id]``                              dropped by a cleanup: the client lets go silently
``WHO``     ``[]``                                a verb from a socket that said no hello here: refused
==========  ====================================  ==========================================

A payload at or above the shared-memory threshold crosses as the handle of a
slot in the client's pool, once the binder has read the client's probe (its
``HELLO``) in its own shared-memory directory (``PONG``'s ``shm``): the
binder leases the slot and stores views of it, so nothing is copied through
the socket; a handle is accepted only for a segment of the client's own
process (:meth:`~zmq_omni.transport._shm.ShmReceive.size`).

A binder takes ``PUT``, ``CANCEL`` and ``FORGET`` only from a socket that said
``HELLO`` to it: a client's DEALER reconnects to the next binder by itself, and
what it queued for the dead one must not be stored twice; ``WHO`` tells the
client to follow the new binder (a new socket, its hello, every payload it keeps).

Each stored client payload's owner in the pull server is a :class:`ClientPut`
(it carries the failure back). A client keeps its payload until ``FETCHED``,
``FAILED`` or ``GONE``: when the binder dies, it stores what it still keeps
in the next binder (or in its own server, when it takes the lock), so no
confirmed put is lost; a reply handed to ZeroMQ just before the binder died
may then be stored twice, and the copy nobody fetches expires as a failed put.

Threads: everything here runs on the driver, except :meth:`ClientPut.on_failure`
(any thread: the pull server's close or a holder's release), which hands over
with ``call_soon``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import msgpack
import zmq

from ..errors import ClosedResourceError, DecodeError, ZmqOmniError
from ._loop import Driver
from ._pull_protocol import Slot
from ._pull_server import PullServer
from ._shm import ShmReceive
from ._signal import WouldBlock
from ._stage_service import key_rule

__all__ = ["ClientPut", "StagePullService"]

log = logging.getLogger("zmq_omni.transport")

_RETRY_S = 0.005  # a PUT waiting for room in the store is tried again this often


class ClientPut:
    """The owner, in the binder's pull server, of one payload a local client stored there."""

    __slots__ = ("__weakref__", "client", "put_id", "service", "slot")

    def __init__(self, service: StagePullService, client: bytes, put_id: int, slot: Slot) -> None:
        self.service = service
        self.client = client
        self.put_id = put_id
        self.slot = slot

    def on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        """The pull server gave the payload up (expired, closed): the client reports it (any thread)."""
        service = self.service
        if not service.closing:  # a binder closing hands its clients' puts on: they store them again
            service.loop.call_soon(functools.partial(service.failed, self, reason))


class StagePullService:
    """Store the local clients' puts in ``server`` (see the module docstring).

    Args:
        loop: the driver of the stage endpoint (it owns this service's socket too).
        server: the bound pull server.
        address: the service address (``ipc://...``).
        reader: opens the slots of payloads the clients hand over as handles (None: frames only).
    """

    def __init__(self, loop: Driver, server: PullServer, address: str, reader: ShmReceive | None = None) -> None:
        self.loop = loop
        self._reader = reader
        self._probes: dict[bytes, Any] = {}  # clients whose shared memory this process reads: their probes
        self._hello: set[bytes] = set()  # sockets that said hello to this binder
        self.server = server
        self.address = address
        #: Set before the server closes: its clients' puts are not reported failed, they go to the next binder.
        self.closing = False
        self._puts: dict[tuple[bytes, int], ClientPut] = {}
        self._waiting: list[tuple[ClientPut, list[Any], int, float]] = []  # PUTs waiting for room
        sock = self._sock = loop.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(address)
        self._closed = False
        self.incarnation = os.urandom(8)  # a client that hears another one follows a new binder
        server.on_fetched = self._fetched
        loop.add_reader(sock, self._drive)
        loop.on_stop(self.close)

    def _drive(self) -> None:
        while not self._closed:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 3:
                continue
            try:
                self._handle(frames[0].bytes, frames[1].bytes, msgpack.unpackb(frames[2].bytes), frames[3:])
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                log.warning("a malformed request on %s: %s", self.address, exc)

    def _handle(self, client: bytes, verb: bytes, body: Any, payload: list[Any]) -> None:
        if verb in (b"PUT", b"CANCEL", b"FORGET") and client not in self._hello:
            self._send(client, b"WHO", [])
            return
        if verb == b"PUT":
            put_id, from_stage, to_stage, key, nbytes, wait_s, loc = body
            slot = (str(from_stage), str(to_stage), str(key))
            put = self._puts.get((client, int(put_id)))
            if put is None:
                put = ClientPut(self, client, int(put_id), slot)
            if loc is not None:
                views = self._open(client, bytes(loc))
                if views is None:
                    self._send(client, b"FRAMES", [put.put_id])
                    return
                frames: list[Any] = list(views)
            else:
                # Views of the received frames: the server sends them tracked (a received frame is not trackable).
                frames = [frame.buffer for frame in payload]
            self._store(put, frames, int(nbytes), time.monotonic() + float(wait_s))
        elif verb == b"CANCEL":
            put = self._puts.pop((client, int(body[0])), None)
            self._waiting = [w for w in self._waiting if w[0] is not put]
            if put is not None:
                self.server.drop_owned(put)  # reports nothing: a ClientPut's failure after a cancel is not sent
        elif verb == b"FORGET":
            key, prefix = body
            rule = key_rule(key, prefix, key is not None)
            self.server.forget(rule)
            for ident, put in list(self._puts.items()):
                if rule(put.slot[2]):
                    del self._puts[ident]
                    self._send(put.client, b"GONE", [put.put_id])
            self._waiting = [w for w in self._waiting if not rule(w[0].slot[2])]
        elif verb == b"HELLO":
            self._hello.add(client)
            self._probes.pop(client, None)
            probe = body[1] if len(body) > 1 else None
            if probe is not None and self._reader is not None:
                try:
                    if self._reader.probe(probe):
                        self._probes[client] = probe
                except DecodeError as exc:
                    log.warning("a local client of %s sent a bad probe: %s", self.address, exc)
            self._send(client, b"PONG", [os.getpid(), self.incarnation, client in self._probes])
        elif verb == b"PING":
            self._send(client, b"PONG", [os.getpid(), self.incarnation, client in self._probes])

    def _open(self, client: bytes, loc: bytes) -> list[memoryview] | None:
        """Lease the slot of a client's handle (one of its own segments) and return its views; None: send frames."""
        probe = self._probes.get(client)
        if probe is None or self._reader is None:
            return None
        try:
            ShmReceive.size(loc, probe)
        except DecodeError as exc:
            log.warning("a local client of %s handed over a handle it does not own: %s", self.address, exc)
            return None
        return self._reader.open(loc)

    def _store(self, put: ClientPut, frames: list[Any], nbytes: int, deadline: float) -> None:
        try:
            self.server.store(*put.slot, frames, nbytes, block=False, owner=put)
        except WouldBlock:
            if time.monotonic() >= deadline:
                self._send(put.client, b"FULL", [put.put_id])
            else:
                if not self._waiting:
                    self.loop.call_later(_RETRY_S, self._retry)
                self._waiting.append((put, frames, nbytes, deadline))
            return
        except ClosedResourceError:
            return  # closing: the client stores it with the next binder
        # A re-put of a key another put of ours holds replaced that one: its client lets go.
        for ident, other in list(self._puts.items()):
            if other.slot == put.slot and other is not put:
                del self._puts[ident]
                self._send(other.client, b"GONE", [other.put_id])
        self._puts[(put.client, put.put_id)] = put
        self._send(put.client, b"STORED", [put.put_id])

    def _retry(self) -> None:
        waiting, self._waiting = self._waiting, []
        if self._closed:
            return
        for put, frames, nbytes, deadline in waiting:
            self._store(put, frames, nbytes, deadline)

    def _fetched(self, slot: Slot, owner: Any) -> None:
        """The pull server handed a reply to ZeroMQ (its hook, on the driver, under its lock): tell the owner."""
        mine = isinstance(owner, ClientPut) and owner.service is self
        if mine and self._puts.pop((owner.client, owner.put_id), None) is not None:
            self._send(owner.client, b"FETCHED", [owner.put_id])

    def failed(self, put: ClientPut, reason: str) -> None:
        """The server gave ``put`` up (the driver): its client reports the failure and lets go."""
        if self._puts.pop((put.client, put.put_id), None) is not None:
            self._send(put.client, b"FAILED", [put.put_id, reason])

    def _send(self, client: bytes, verb: bytes, body: list[Any]) -> None:
        if not self._closed:
            self._sock.send_multipart([client, verb, msgpack.packb(body)])

    def close(self) -> None:
        """Close the socket (the driver's, at its stop): the clients store what they keep with the next binder."""
        if self._closed:
            return
        self.closing = self._closed = True
        self._waiting = []
        self.server.on_fetched = None
        self.loop.remove_reader(self._sock)
        self._sock.close(linger=0)
