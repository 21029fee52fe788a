"""A local client of a shared stage endpoint: gets answered by the binder's mailbox, in this process's own mailbox.

A process of a stage that finds the stage lock held by another live process of
the stage (:mod:`~zmq_omni.transport._stage_lock`) does not bind: its receiving
part is a :class:`StageClient`, a DEALER to the binder's service
(:mod:`~zmq_omni.transport._stage_service`). A get that does not find its key
here tells the binder it *wants* it (once per key and window, not at every
poll); the binder lends the item when it is there; it lands in this process's
own :class:`~zmq_omni.transport._mailbox.Mailbox`, where gets take it as from
a bound receiver's; what gets took goes back to the binder as ``TOOK`` (batched
by the same acknowledgement delay), so the binder counts it consumed only then;
what is dropped here unconsumed (unclaimed, cleaned up) goes back as ``DROP``
with its code, so its sender hears it dropped.
A shared-memory item arrives as its slot handle and is mapped here.

A binder change is seen two ways: silence (the binder's pongs stop: the stage
lock then says whether it died), or a ``PONG``/``WHO`` naming another binder
incarnation (the DEALER reconnected by itself to the next binder, or the same
process reopened its endpoint). Either way the mailbox of the old binder's
lends is sealed and emptied (their senders resend them), and the next binder
hears, in this client's hello, what gets here took. A pong's stamp is the
binder's ``time.monotonic()`` (one clock on one host): a pong queued before a
binder died does not make it look alive. Lends that arrive, and gets that
would take a lent item, while the binder was last heard over half the peer
timeout ago wait until it is heard again (or the change is seen): a client
stalled across its binder's death does not hand out the dead binder's lends.
A client that binds after its binder died hands out nothing (to its own gets
or as lends) for one peer timeout: the resends of puts that other clients
took through the dead binder arrive then, and those clients' hellos name
them (they hear the silence, or the next binder's ``WHO``, within that time).

It is a :class:`~zmq_omni.transport._receiver.PushReceiver` to the connector
(the same gets, watches, cleanups and close), with no stage socket of its own.

Where a get waits in time slices, and why: a get's wait for its key is the
mailbox's take (woken by the arrival, the seal or the close, never sliced).
Three waits around it are short sleeps, each bounded by the get's deadline and
ended by this client's close or the get's stop test: :meth:`StageClient._wait_open`
waits for the clock (the quiet peer timeout after a binder died: 10 ms steps);
:meth:`StageClient._confirm` waits for the binder to be heard again while it is
unsure of it, and :meth:`StageClient._swapped` for the driver to put the next
binder's mailbox in place after a change (5 ms steps). The last two stand in
for events the driver produces (a pong read, the mailbox swap); they run only
while the binder is silent past half the peer timeout or changing, never on a
get's ordinary path, so they are kept as slices rather than another condition
shared with the driver.

Threads: the DEALER and ``_leases`` are the driver's (the endpoint's I/O
thread); the mailbox is under its own lock; ``_asked`` (key -> until when the
binder has been asked) is written by getting threads and the driver, one dict
operation at a time.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ..metrics import Counters
from ._loop import Driver
from ._mailbox import Mailbox
from ._receive_protocol import Item, Slot
from ._receiver import DEFAULT_ACK_DELAY_S, PushReceiver
from ._shm import ShmReceive
from ._stage_lock import StageLock, pid_alive
from ._stage_share import WantBook

__all__ = ["StageClient"]

log = logging.getLogger("zmq_omni.transport")

#: How long a polling get's want stays open at the binder (renewed by a poll once half of it passed).
POLL_WANT_S = 2.0


class StageClient(PushReceiver):
    """The receiving part of a process that is a local client of its stage's binder (see the module docstring).

    Args:
        loop: the driver that owns the DEALER.
        endpoint: the stage endpoint (what health reports).
        service: the binder's service address.
        decode: frames (or a mapped slot's views) to the object.
        counters: the endpoint's counters.
        heartbeat_s: interval of pings to the binder.
        peer_timeout_s: silence after which the stage lock is tried: the binder is gone only when it is free
            or held by another process (a stalled binder that lives is only reported).
        ack_delay_s: most a consumption waits before the binder hears it.
        unclaimed_ttl_s: a lent item no get took within this long is dropped here.
        tombstone_ttl_s: how long a cleanup's tombstone drops late lends.
        max_tombstones: most tombstones held.
        shm: the shared-memory reader for items lent as slot handles.
        lock: the stage lock, tried again when the binder goes silent.
        become_binder: binds the stage endpoint on ``loop`` (and serves it, lending nothing for the
            seconds it is given) once ``lock`` is held: this process is the binder from then on.
    """

    def __init__(
        self,
        loop: Driver,
        endpoint: str,
        service: str,
        *,
        decode: Callable[[list[Any]], Any],
        counters: Counters,
        heartbeat_s: float,
        peer_timeout_s: float,
        ack_delay_s: float = DEFAULT_ACK_DELAY_S,
        unclaimed_ttl_s: float = 300.0,
        tombstone_ttl_s: float = 60.0,
        max_tombstones: int = 65536,
        shm: ShmReceive | None = None,
        lock: StageLock | None = None,
        become_binder: Callable[[StageLock, float], PushReceiver] | None = None,
    ) -> None:
        # Not PushReceiver.__init__: no stage socket here; the fields its gets and expiry use are set below.
        self._loop = loop  # type: ignore[assignment]
        self.incarnation = uuid.uuid4().hex[:16]
        self.endpoint = endpoint
        self.service = service
        self._counters = counters
        self._decode = decode
        self._unclaimed_ttl = unclaimed_ttl_s
        self._peer_timeout = peer_timeout_s
        self._ack_delay = ack_delay_s
        self._settle_at: float | None = None  # when the next TOOK batch is timed (driver's)
        self._new_mailbox = functools.partial(
            Mailbox,
            tombstone_ttl_s=tombstone_ttl_s,
            max_tombstones=max_tombstones,
            on_left=self._left_mailbox,
            shm=shm,
            decode=decode,
            counters=counters,
        )
        self._mailbox = self._new_mailbox()
        self._lock = lock
        self._become_binder = become_binder
        #: The stage endpoint this process binds since its binder died (its mailbox is ``_mailbox`` then).
        self._inner: PushReceiver | None = None
        self._open_at = 0.0  # when this process, binding since its binder died, hands out items
        self._shut = False
        self._closing = False  # set before the shutdown seals the mailbox: a get woken then returns
        self._asked: dict[Slot, float] = {}
        self._leases: dict[tuple[str, int], int] = {}  # (sid, seq) -> lease (driver's)
        self._taken = WantBook()  # the puts gets here took, for the next binder (driver's)
        self._heard = time.monotonic()  # the binder's clock at its last pong (driver's)
        self._gone_reported = False
        self._binder_pid = lock.holder() if lock is not None else None  # its PONG to our hello says for sure
        self._binder_token: str | None = None  # the binder's incarnation (its PONG to our hello says)
        self._held: list[tuple[Slot, Item]] = []  # lends that came while the binder was not heard lately
        sock = self._sock = loop.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(service)
        loop.add_reader(sock, self._drive)
        loop.every(heartbeat_s, self._ping)
        loop.every(min(1.0, unclaimed_ttl_s / 4, tombstone_ttl_s / 4), self._expire_unclaimed)
        loop.on_stop(self._shutdown)
        loop.call_soon(functools.partial(self._send, b"HELLO", [os.getpid(), []]))

    @property
    def binds(self) -> bool:
        """Whether this process binds the stage endpoint now (its binder died and it took the stage lock)."""
        return self._inner is not None

    # -- gets (any thread) ------------------------------------------------------------------
    def take(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        deadline: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[Any, int] | None:
        """As :meth:`PushReceiver.take`; a key not here is asked of the binder (once per window)."""
        slot = (from_stage, to_stage, key)
        while True:
            if self._inner is not None:
                if time.monotonic() < self._open_at and not self._wait_open(deadline, stop):
                    return None
                return super().take(from_stage, to_stage, key, deadline, stop)
            mailbox = self._mailbox
            unsure = self._unsure()
            item = None if unsure else mailbox.pop(slot)
            if unsure and deadline is not None and self._confirm(mailbox, deadline, stop):
                continue  # heard again (or the binder changed): look again
            if item is None:
                now = time.monotonic()
                waits = deadline is not None and deadline > now
                until = deadline if waits and deadline is not None else now + POLL_WANT_S
                known = self._asked.get(slot)
                if known is None or known < min(until, now + POLL_WANT_S / 2):
                    self._asked[slot] = until
                    self._loop.call_soon(functools.partial(self._send, b"WANT", [*slot, until - now]))
                if waits and deadline is not None:
                    if self._loop.in_loop():
                        raise RuntimeError(
                            "a blocking get on the thread that drives the connector would wait for itself"
                        )
                    item = mailbox.take(slot, deadline, stop)
                    if item is None and self._swapped(mailbox, deadline, stop):
                        continue  # the binder changed: ask the next one (or this process, binding now)
            return None if item is None else mailbox.result(item)

    def _wait_open(self, deadline: float | None, stop: Callable[[], bool] | None) -> bool:
        """Wait for :attr:`_open_at` (a blocking get, until ``deadline``); whether the get may take now."""
        while (now := time.monotonic()) < self._open_at:
            if deadline is None or now >= deadline or self._closing or (stop is not None and stop()):
                return False
            time.sleep(min(0.01, self._open_at - now))
        return True

    def _unsure(self) -> bool:
        """Whether the binder was last heard over half the peer timeout ago (a stall here, or its death)."""
        return time.monotonic() - self._heard > self._peer_timeout / 2

    def _confirm(self, mailbox: Mailbox, deadline: float, stop: Callable[[], bool] | None) -> bool:
        """Wait (until ``deadline``) for the binder to be heard again or replaced; whether a get looks again."""
        while time.monotonic() < deadline and not self._closing and not (stop is not None and stop()):
            if not self._unsure() or mailbox is not self._mailbox or self._inner is not None:
                return True
            time.sleep(0.005)
        return False

    def _swapped(self, mailbox: Mailbox, deadline: float, stop: Callable[[], bool] | None) -> bool:
        """Whether a get woken empty-handed from ``mailbox`` waits again: the binder changed and time is left.

        A binder leaving seals the mailbox before the next one is in place; this waits (briefly) for it.
        """
        while mailbox.closed and not self._closing and not (stop is not None and stop()):
            if mailbox is not self._mailbox or self._inner is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return False

    def forget(
        self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None, firm: bool = False
    ) -> int:
        """As :meth:`PushReceiver.forget`, here and at the binder (its tombstones and wants too)."""
        dropped = self._mailbox.forget(match, key=key, prefix=prefix, firm=firm)
        if self._inner is None and (key is not None or prefix is not None):
            self._loop.call_soon(functools.partial(self._send, b"FORGET", [key, prefix, firm]))
        return dropped

    def stats(self) -> dict[str, Any]:
        """The mailbox's counters, and the binder this process gets from."""
        if self._inner is not None:
            return self._inner.stats()
        return {**self._mailbox.stats(), "batches_received": 0, "stage_binder": self.service}

    # -- the driver -------------------------------------------------------------------------
    def _drive(self) -> None:
        while not self._shut:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            verb, body = frames[0], msgpack.unpackb(frames[1])
            if verb == b"LEND":
                lease, from_stage, to_stage, key, nbytes, sid, seq, loc = body
                slot = (from_stage, to_stage, key)
                self._asked.pop(slot, None)
                obj = None if loc is not None else self._decode(frames[2:])
                self._leases[(sid, seq)] = lease
                item = Item(obj, nbytes, sid, seq, loc, now)
                if self._unsure():  # after a stall: stored once the binder is heard again
                    self._held.append((slot, item))
                else:
                    self._mailbox.store([(slot, item)], now)
            elif verb == b"NONE":
                self._asked.pop(tuple(body), None)  # type: ignore[call-overload]
            elif verb in {b"PONG", b"WHO"}:
                pid, token = int(body[0]), str(body[1])
                if verb == b"PONG" and self._binder_token is None:
                    self._binder_token = token  # the answer to our hello
                if token != self._binder_token:
                    log.warning("the binder of %s changed (now pid %d): asking it", self.endpoint, pid)
                    self._binder_pid = pid
                    self._binder_gone(token)
                elif verb == b"PONG":
                    self._binder_pid = pid
                    self._heard = max(self._heard, float(body[2]))
                    self._gone_reported = False
                    if self._held and not self._unsure():
                        held, self._held = self._held, []
                        self._mailbox.store(held, now)

    def _left_mailbox(self, heavy: bool) -> None:
        """A get took something (the mailbox calls this under its lock, from any thread): only schedule."""
        self._loop.call_soon(functools.partial(self._time_settle, 0.0 if heavy else self._ack_delay))

    def _time_settle(self, delay: float) -> None:
        """Tell the binder what gets took within ``delay`` (driver's): TOOKs are batched like acknowledgements."""
        due = time.monotonic() + delay
        if self._settle_at is None or due < self._settle_at:
            self._settle_at = due
            self._loop.call_later(delay, self._settle_due)

    def _settle_due(self) -> None:
        if self._settle_at is not None and self._settle_at <= time.monotonic() and not self._shut:
            self._settle_at = None
            if self._inner is None:
                self._settle()

    def _settle(self, tell: bool = True) -> None:
        """Send the binder TOOK/DROP for what left the mailbox; remember the puts (``tell`` False: only that)."""
        consumed, dropped, _ = self._mailbox.handover()
        for pair in consumed:
            lease = self._leases.pop(pair, None)
            if lease is not None:
                if tell:
                    self._send(b"TOOK", [lease])
                self._taken.took(*pair)
        for sid, seq, code in dropped:  # unclaimed or cleaned up here: the binder reports it dropped
            lease = self._leases.pop((sid, seq), None)
            if lease is not None:
                if tell:
                    self._send(b"DROP", [lease, code])
                self._taken.took(sid, seq)  # not delivered again by the next binder either

    def _ping(self) -> None:
        if self._shut or self._inner is not None:
            return
        self._send(b"PING", [])
        silent = time.monotonic() - self._heard
        if silent <= self._peer_timeout:
            return
        if self._binder_left():
            self._binder_gone()
        elif not self._gone_reported:
            self._gone_reported = True
            log.warning(
                "the binder of %s (pid %s) is silent for %.1f s but lives and holds the stage lock: "
                "what it lent here stays here; waiting for it",
                self.endpoint,
                self._binder_pid,
                silent,
            )

    def _binder_left(self) -> bool:
        """Whether the binder is gone, as the kernel says: the stage lock is free, or another process holds it."""
        if self._lock is None:
            return True
        if self._lock.try_acquire():
            return True
        holder = self._lock.holder()
        if holder is None:  # the next holder is writing its pid
            return False
        return holder != self._binder_pid or not pid_alive(holder)

    def _binder_gone(self, token: str | None = None) -> None:
        """The binder is gone: drop its leases (their senders resend them), then bind here or ask the next one.

        What it lent and no get here took was never counted consumed, so it comes back through the
        next binder. Whoever of the stage's processes takes the stage lock first binds; the others
        ask it again for what their gets want. ``token``: the next binder's incarnation, when it
        answered already (it holds the stage lock: this process does not try it).
        """
        old = self._mailbox
        old.close()  # sealed first: no get takes a lend from now on; shared-memory items being mapped are noted
        withdrawn = old.withdraw()
        self._settle(tell=False)  # what gets took: the next binder hears it in the hello, not as TOOKs
        self._leases.clear()
        self._asked.clear()
        self._held.clear()
        hook = old.on_arrivals
        binds = token is None and self._lock is not None and self._become_binder is not None
        if binds and self._lock is not None and self._become_binder is not None and self._lock.try_acquire():
            try:
                # Its service lends nothing for a peer timeout: the other clients' hellos come first.
                inner = self._become_binder(self._lock, self._peer_timeout)
            except Exception:
                self._lock.release()
                log.exception("the binder of %s is gone and binding it here failed", self.endpoint)
            else:
                self._loop.remove_reader(self._sock)
                self._sock.close(linger=0)
                inner.on_arrivals = hook
                inner.mailbox.consumed_elsewhere(self._taken.taken_since())
                self._open_at = time.monotonic() + self._peer_timeout  # the other clients' hellos first
                self._mailbox = inner.mailbox  # before _inner: a get that sees _inner finds its mailbox
                self._inner = inner
                log.warning(
                    "the binder of %s is gone: this process binds it now (%d items lent back to their senders)",
                    self.endpoint,
                    withdrawn,
                )
                return
        if not self._gone_reported and token is None:
            self._gone_reported = True
            log.warning("the binder of %s (%s) does not answer; waiting for the next", self.endpoint, self.service)
        self._mailbox = self._new_mailbox()
        self._mailbox.on_arrivals = hook
        self._heard = time.monotonic()
        self._binder_token = token  # None: the next binder's PONG to the hello names it
        if self._lock is not None and token is None:
            self._binder_pid = self._lock.holder()  # the next binder (its PONG confirms)
        self._send(b"HELLO", [os.getpid(), [list(pair) for pair in self._taken.taken_since()]])

    def _send(self, verb: bytes, body: list[Any]) -> None:
        if not self._shut and self._inner is None:  # a call queued before this process became the binder
            self._sock.send_multipart([verb, msgpack.packb(body)])

    def _expire_sources(self) -> None:
        """No senders here (they talk to the binder)."""

    def _shutdown(self) -> None:
        """The driver's last word: seal, tell the binder what was taken, give the rest back, close the DEALER."""
        self._closing = True
        self._mailbox.close()
        if self._shut or self._inner is not None:  # a binder now: its receiver shuts itself down
            self._shut = True
            return
        self._settle()
        for lease in self._leases.values():
            self._send(b"BACK", [lease])
        self._leases.clear()
        self._send(b"BYE", [])  # the binder forgets this client and its wants
        self._shut = True
        self._loop.remove_reader(self._sock)
        self._sock.close(linger=100)

    def __repr__(self) -> str:
        state = " (binds it now)" if self._inner is not None else ""
        return f"<StageClient {self.endpoint} via {self.service}{state}{' closed' if self._shut else ''}>"
