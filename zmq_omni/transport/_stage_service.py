"""The binder's side of a shared stage endpoint: a ROUTER at the stage's service address, lending mailbox items.

The process holding the stage lock binds the stage endpoint (a
:class:`~zmq_omni.transport._receiver.PushReceiver`) and, next to it, this
service, on the same driver: the driver alone touches both sockets. The other
processes of the stage on the host are its local clients
(:class:`~zmq_omni.transport._stage_client.StageClient`). The bookkeeping is
:class:`~zmq_omni.transport._stage_share.LeaseBook`; the wire is a multipart
message ``[verb, msgpack body, *payload frames]``:

=========  =============================  ==============================================
verb       body                           meaning
=========  =============================  ==============================================
``HELLO``  ``[pid, [[sid, seq], ...]]``   a client (again), its pid: the puts it took
``BYE``    ``[]``                         the client closed: its wants end, its leases come back
``WANT``   ``[from, to, key, timeout_s]`` lend me this key when it is here
``TOOK``   ``[lease]``                    a get took it: count it consumed
``DROP``   ``[lease, code]``              dropped there unconsumed (``DROPPED_*``)
``BACK``   ``[lease]``                    not taken: put it back
``FORGET`` ``[key, prefix, firm]``        a cleanup (as ``PushReceiver.forget``)
``PING``   ``[]``                         alive; answered ``PONG``
``PONG``   ``[pid, incarnation, stamp]``  to a hello or ping: this binder's pid, its incarnation
                                          (a random token of this service) and ``time.monotonic()``
``WHO``    ``[pid, incarnation]``         to any verb but ``HELLO``/``BYE`` from a connection that has
                                          not said hello here: ignored (the client has changed binders)
``LEND``   ``[lease, from, to, key, nbytes, sid, seq, loc]`` + frames: the item
           (``loc``: a shared-memory slot handle, no frames; else the encoded object)
``NONE``   ``[from, to, key]``            not here by the want's deadline
=========  =============================  ==============================================

A client's connection to a binder that died reconnects by itself to the
next one: what it queued for the dead one (its lease ids, its wants) reaches
the next binder, which refuses it (``WHO``) until the client says hello
there; a ``PONG`` or ``WHO`` naming another incarnation tells the client that
its binder changed, even when it heard no silence (the same pid may close and
reopen its endpoint). A lent item leaves the mailbox without being counted consumed: only ``TOOK``
counts it (its sender then hears "consumed"). Death is judged by the
kernel, not by silence: a client's leases go back to the mailbox when its
process (the pid of its hello) is dead, or at its next hello (it gave them up
with its mailbox); a client silent for ``peer_timeout_s`` whose process lives
keeps them, with a warning. A shared-memory item is lent as its slot handle,
which the client maps itself.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ._loop import Driver
from ._mailbox import Mailbox
from ._receive_protocol import Item, Slot
from ._stage_lock import pid_alive
from ._stage_share import LeaseBook

__all__ = ["StageService"]

log = logging.getLogger("zmq_omni.transport")


def key_rule(key: str | None, prefix: str | None, firm: bool) -> Callable[[str], bool]:
    """The keys a forwarded cleanup drops: a prefix and digits; a request's keys (firm); one key."""
    if prefix is not None:
        return lambda k: k.startswith(prefix) and k[len(prefix) :].isdigit()
    assert key is not None
    if firm:  # cleanup(request_id): the key, ``rid_*`` and ``*_rid``
        return lambda k: k == key or k.startswith(key + "_") or k.endswith("_" + key)
    return lambda k: k == key


class StageService:
    """Serve the local clients of a stage endpoint from ``mailbox`` (see the module docstring).

    Args:
        loop: the driver of the stage endpoint (it owns this service's socket too).
        mailbox: the bound receiver's mailbox.
        address: the service address (``ipc://...``).
        encode: an object to frames (items that are not in shared memory are sent encoded).
        peer_timeout_s: silence after which a client's process is looked up (dead: its leases come back).
        lend_after_s: lend nothing for this long (:meth:`hold`): a binder that took over from a dead one
            waits for the other clients' hellos first.
    """

    def __init__(
        self,
        loop: Driver,
        mailbox: Mailbox,
        address: str,
        *,
        encode: Callable[[Any], list[Any]],
        peer_timeout_s: float,
        lend_after_s: float = 0.0,
    ) -> None:
        self._loop = loop
        self._mailbox = mailbox
        self._encode = encode
        self.address = address
        self._book = LeaseBook(peer_timeout_s)
        #: A random token of this service: a client that hears another one knows its binder changed.
        self.incarnation = uuid.uuid4().hex
        sock = self._sock = loop.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(address)
        self._closed = False
        self._lend_from = 0.0  # nothing is lent before this time (hold)
        mailbox.on_lendable = self._arrived
        loop.add_reader(sock, self._drive)
        loop.every(max(0.05, peer_timeout_s / 4), self._tick)
        loop.on_stop(self.close)
        if lend_after_s > 0:
            self.hold(lend_after_s)

    def _drive(self) -> None:
        """Read every queued request (the socket's handler)."""
        while not self._closed:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 3:
                continue
            client, verb, body = frames[0], frames[1], msgpack.unpackb(frames[2])
            self._handle(client, verb, body, time.monotonic())

    def _handle(self, client: bytes, verb: bytes, body: Any, now: float) -> None:
        book = self._book
        if verb == b"BYE":
            for held in book.bye(client):
                self._mailbox.restore(held.slot, held.item)
            return
        if verb != b"HELLO" and not book.knows(client):  # sent to a binder before this one: refused
            self._send(client, b"WHO", [os.getpid(), self.incarnation])
            return
        book.heard(client, now)
        if verb == b"WANT":
            from_stage, to_stage, key, timeout_s = body
            slot = (from_stage, to_stage, key)
            book.want(client, slot, now + float(timeout_s), now)
            self._offer([slot])
        elif verb == b"TOOK":
            lease = book.settle(client, int(body[0]))
            if lease is not None:
                self._mailbox.settle(lease.item)
        elif verb == b"DROP":
            lease = book.settle(client, int(body[0]))
            if lease is not None:
                self._mailbox.settle_dropped(lease.item, int(body[1]))
        elif verb == b"BACK":
            lease = book.give_back(client, int(body[0]))
            if lease is not None:
                self._mailbox.restore(lease.slot, lease.item)
        elif verb == b"PING":
            self._send(client, b"PONG", [os.getpid(), self.incarnation, time.monotonic()])
        elif verb == b"HELLO":
            pid, taken = body
            counted, stale = book.hello(client, now, [(str(sid), int(seq)) for sid, seq in taken], int(pid))
            self._mailbox.consumed_elsewhere(counted)
            for lease in stale:
                self._mailbox.restore(lease.slot, lease.item)
            self._send(client, b"PONG", [os.getpid(), self.incarnation, time.monotonic()])
        elif verb == b"FORGET":
            key, prefix, firm = body
            rule = key_rule(key, prefix, bool(firm))
            self._mailbox.forget(rule, key=key, prefix=prefix, firm=bool(firm))
            for asker, slot in book.forget(rule):
                self._send(asker, b"NONE", list(slot))

    def _arrived(self, slots: list[Slot]) -> None:
        """Items reached the mailbox (or came back): lend those a client waits for."""
        if not self._closed and self._book.waits():
            self._offer(slots)

    def hold(self, seconds: float) -> None:
        """Lend nothing for ``seconds`` (a client that binds after its binder died: see _stage_client.py)."""
        self._lend_from = time.monotonic() + seconds
        self._loop.call_later(seconds, lambda: self._arrived(self._book.wanted()))

    def _offer(self, slots: list[Slot]) -> None:
        if time.monotonic() < self._lend_from:
            return
        for slot in slots:
            client = self._book.first_wanting(slot)
            if client is None:
                continue
            item = self._mailbox.lend(slot)
            if item is None:
                continue
            self._lend(client, slot, item)

    def _lend(self, client: bytes, slot: Slot, item: Item) -> None:
        lease = self._book.lend(client, slot, item)
        head = [lease.lease, *slot, item.nbytes, item.sid, item.seq, item.loc]
        frames: list[Any] = [] if item.loc is not None else self._encode(item.obj)
        self._send(client, b"LEND", head, frames)

    def _tick(self) -> None:
        """Wants past their deadline are answered; dead clients' leases go back to the mailbox."""
        if self._closed:
            return
        expired = self._book.tick(time.monotonic(), pid_alive)
        for client, slot in expired.wants:
            self._send(client, b"NONE", list(slot))
        for _client in expired.stalled:
            log.warning(
                "a local client of %s is silent for over %.1f s but its process lives: its leases stay with it",
                self.address,
                self._book.peer_timeout_s,
            )
        for lease in expired.returned:
            log.warning("a local client of %s died: its lease of %r goes back", self.address, lease.slot[2])
            self._mailbox.restore(lease.slot, lease.item)

    def _send(self, client: bytes, verb: bytes, body: list[Any], frames: list[Any] | None = None) -> None:
        self._sock.send_multipart([client, verb, msgpack.packb(body), *(frames or [])], copy=False)

    def close(self) -> None:
        """Close the socket (the driver's, at its stop); leases out stay uncounted: their senders resend them."""
        if self._closed:
            return
        self._closed = True
        self._mailbox.on_lendable = None
        self._loop.remove_reader(self._sock)
        self._sock.close(linger=0)
