"""Push mode, sending half: the window of unconsumed puts as a pure state machine (no sockets, no threads).

:class:`SendWindow` decides; :class:`~zmq_omni.transport._sender.PushSender` does
the I/O it decides on. Every method here runs on whichever thread calls it, and
every call is made with the sender's lock (``SenderCore.lock``) held: that one lock guards every
field of :class:`SendWindow`, :class:`PeerWindow` and :class:`Out`. Nothing here
blocks, sleeps, reads a clock or touches a socket (``now`` is passed in), so the
delivery protocol of :mod:`zmq_omni.transport._push_protocol` can be tested
directly, step by step.

The invariants the tests check after any sequence of calls:

* the window holds at most ``max_count`` puts (and ``max_bytes``, save for a
  single put larger than that, admitted into an empty window);
* ``count``/``nbytes`` are the sums over every peer's ``retained``;
  ``unarrived`` is a subset of ``retained``, in deadline order;
* a put the receiver reported consumed is never resent and never reported lost;
* a put the receiver reported dropped unconsumed (a REPLY whose ping number is a
  ``DROPPED_*`` code) is returned as ``disposed``, once, apart from the consumed ones;
* every put that leaves the window other than by consumption, withdrawal or
  release after :meth:`SendWindow.forget` is returned to the caller as failed
  (expired, lost at close, or disposed by the receiver), exactly once;
* :meth:`SendWindow.forget` never cancels a put still on its way: it releases
  only puts the receiver already holds; the others keep their delivery deadline
  and are released when their arrival is confirmed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._push_protocol import _BATCH_OVERHEAD, DROP_COUNTERS

__all__ = ["Out", "PeerWindow", "ReplyOutcome", "SendWindow"]


class Out:
    """One put kept by the sender until its receiver consumed it.

    ``sent_ping`` is the number of the last PING sent before this put went out
    (None: not handed to ZeroMQ yet); ``queued``: waiting in its peer's outbox;
    ``forgotten``: its request was cleaned up here, so it is released as soon as
    it is safe without us.
    """

    __slots__ = (
        "arrived",
        "deadline",
        "forgotten",
        "frames",
        "from_stage",
        "key",
        "loc",
        "nbytes",
        "queued",
        "sent_ping",
        "seq",
    )

    def __init__(
        self, seq: int, from_stage: str, key: str, frames: list[Any], nbytes: int, deadline: float, loc: bytes | None
    ) -> None:
        self.seq = seq
        self.from_stage = from_stage
        self.key = key
        self.frames = frames  # empty when the payload lies in shared memory (``loc``)
        self.loc = loc
        self.nbytes = nbytes
        self.deadline = deadline
        self.arrived = False
        self.queued = False
        self.forgotten = False
        self.sent_ping: int | None = None


class PeerWindow:
    """The window's state for one receiving stage (guarded by the sender's lock)."""

    __slots__ = (
        "batch_bytes",
        "incarnation",
        "last_heard",
        "low",
        "next_seq",
        "old_incarnations",
        "retained",
        "shm",
        "suspect",
        "to_stage",
        "unarrived",
    )

    def __init__(self, to_stage: str) -> None:
        self.to_stage = to_stage
        self.next_seq = 0
        self.low = 0  # smallest seq still retained (or next_seq): the receiver forgets dedup state below it
        self.retained: dict[int, Out] = {}
        self.unarrived: dict[int, Out] = {}  # in deadline order: puts enter at the end, re-armed ones move there
        self.incarnation: str | None = None
        self.old_incarnations: deque[str] = deque(maxlen=16)
        self.last_heard = 0.0
        self.suspect = False
        self.shm: bool | None = None  # the receiver's probe verdict; None = not answered yet
        self.batch_bytes = 0  # largest BATCH frame the receiver said it accepts; 0 = do not batch

    def advance_low(self) -> None:
        """Move ``low`` past every seq no longer retained."""
        retained, low, end = self.retained, self.low, self.next_seq
        while low < end and low not in retained:
            low += 1
        self.low = low


@dataclass
class ReplyOutcome:
    """What applying one REPLY decided: the I/O the caller does next, and whom to wake."""

    resend: list[Out] = field(default_factory=list)  # unarrived puts sent before the answered ping (or a restart)
    freed: int = 0  # puts that left the window (consumed, disposed or released): room for waiting puts
    disposed: list[Out] = field(default_factory=list)  # consumed seqs of a DROPPED_* REPLY: dropped unconsumed
    released: list[Out] = field(default_factory=list)  # forgotten puts let go now their arrival is confirmed
    arrived: bool = False  # arrivals were confirmed (wakes flush/wait_delivered)
    changed: bool = False  # a new incarnation or shm verdict (wakes reads_shm)
    restarted: bool = False  # the receiver restarted: everything unconsumed is in ``resend``


class SendWindow:
    """Admission, retention and failure of puts across every peer; see the module docstring.

    Args:
        max_count: most puts unconsumed at once.
        max_bytes: most bytes unconsumed at once (a larger single put is admitted into an empty window).
        delivery_timeout_s: how long a put may stay unarrived before it is reported failed.
        batch_max_bytes: our cap on a BATCH frame (the receiver's announced size is capped by it).
        batch_max_messages: our cap on puts per BATCH; 1 turns batching off.
    """

    def __init__(
        self,
        *,
        max_count: int,
        max_bytes: int,
        delivery_timeout_s: float,
        batch_max_bytes: int = 64 << 10,
        batch_max_messages: int = 256,
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.delivery_timeout = delivery_timeout_s
        self.batch_max_bytes = batch_max_bytes
        self.batch_max_messages = batch_max_messages
        self.peers: dict[str, PeerWindow] = {}
        self.count = 0
        self.nbytes = 0

    def peer(self, to_stage: str) -> PeerWindow:
        """The window of ``to_stage``, created on first use."""
        win = self.peers.get(to_stage)
        if win is None:
            win = self.peers[to_stage] = PeerWindow(to_stage)
        return win

    def full(self, nbytes: int) -> bool:
        """True when a put of ``nbytes`` must wait for room (an empty window admits anything)."""
        return bool(self.count) and (self.count >= self.max_count or self.nbytes + nbytes > self.max_bytes)

    def admit(
        self,
        win: PeerWindow,
        from_stage: str,
        key: str,
        frames: list[Any],
        nbytes: int,
        loc: bytes | None,
        now: float,
    ) -> Out:
        """Take a put into the window (the caller checked :meth:`full`); it is unarrived until a REPLY says so."""
        seq = win.next_seq
        out = Out(seq, from_stage, key, [] if loc else frames, nbytes, now + self.delivery_timeout, loc)
        win.next_seq = seq + 1
        win.retained[seq] = out
        win.unarrived[seq] = out
        self.count += 1
        self.nbytes += nbytes
        return out

    def withdraw(self, win: PeerWindow, out: Out) -> bool:
        """Take back a put whose own send failed (the caller reports it); False when it already left the window."""
        if win.retained.get(out.seq) is not out:
            return False
        self._drop(win, out)
        win.advance_low()
        return True

    def mark_sent(self, outs: Iterable[Out], ping: int) -> None:
        """Record that ``outs`` went out after PING ``ping`` (what a later pong is compared with)."""
        for out in outs:
            out.sent_ping = ping

    def apply_reply(
        self,
        win: PeerWindow,
        incarnation: str,
        ping: int,
        arrived: Sequence[range],
        consumed: Sequence[range],
        shm: bool | None,
        batch_bytes: int,
        now: float,
    ) -> ReplyOutcome:
        """Apply one REPLY: ``arrived``/``consumed`` are runs of seqs, walked in place (never expanded).

        A REPLY of an incarnation we saw replaced (stale) only frees what it
        reports consumed, since consumption is final whichever incarnation says it.
        When ``ping`` is a ``DROPPED_*`` code the receiver dropped the consumed
        seqs unconsumed: those still retained are returned in ``disposed`` (the
        caller reports each as a failed put), not merely freed.
        """
        result = ReplyOutcome()
        win.last_heard = now
        win.suspect = False
        stale = incarnation in win.old_incarnations
        if not stale:
            if incarnation != win.incarnation:
                if win.incarnation is not None:
                    # A new receiver holds nothing of ours: everything unconsumed goes again.
                    win.old_incarnations.append(win.incarnation)
                    self.unarrive(win, list(win.retained.values()), now)
                    result.restarted = True
                win.incarnation = incarnation
                win.shm = None  # a new receiver may not share our /dev/shm: ask again
                result.changed = True
            # Too small a limit leaves no room for two puts: send DATA messages only.
            fits = self.batch_max_messages > 1 and batch_bytes >= 2 * _BATCH_OVERHEAD
            win.batch_bytes = min(self.batch_max_bytes, batch_bytes) if fits else 0
            if shm is not None and shm != win.shm:
                win.shm = shm
                result.changed = True
        freed = freed_bytes = 0
        retained_pop, unarrived_pop = win.retained.pop, win.unarrived.pop
        disposed = result.disposed if ping in DROP_COUNTERS else None
        for run in consumed:
            for seq in run:
                out = retained_pop(seq, None)
                if out is not None:
                    unarrived_pop(seq, None)
                    out.queued = False  # still in the outbox: the next batch skips it
                    freed += 1
                    freed_bytes += out.nbytes
                    if disposed is not None:
                        disposed.append(out)
        self.count -= freed
        self.nbytes -= freed_bytes
        result.freed = freed
        if freed:
            win.advance_low()
        if stale:
            return result
        released = result.released
        for run in arrived:
            for seq in run:
                out = unarrived_pop(seq, None)
                if out is not None:
                    out.arrived = True
                    result.arrived = True
                    if out.forgotten and out.loc is None:
                        released.append(out)
        if released:
            # Their request was cleaned up here: now that the receiver holds them, our copies only served
            # a resend to a restarted receiver, which that cleanup gave up.
            for out in released:
                self._drop(win, out)
            result.freed += len(released)
            win.advance_low()
        if result.restarted:
            result.resend = [o for o in win.unarrived.values() if o.sent_ping is not None]
        elif ping >= 0:
            result.resend = [o for o in win.unarrived.values() if o.sent_ping is not None and o.sent_ping < ping]
        return result

    def unarrive(self, win: PeerWindow, outs: Iterable[Out], now: float) -> None:
        """Mark puts undelivered again with a fresh deadline (moved to the end: deadline order holds)."""
        for out in outs:
            out.arrived = False
            win.unarrived.pop(out.seq, None)
            win.unarrived[out.seq] = out
            out.deadline = now + self.delivery_timeout

    def note_silence(self, win: PeerWindow, now: float, peer_timeout_s: float) -> int:
        """A beat: a receiver silent past ``peer_timeout_s`` is presumed gone; how many delivered puts it risks.

        Those become undelivered again (a fresh deadline), once per silence.
        """
        if not win.last_heard or now - win.last_heard <= peer_timeout_s or win.suspect:
            return 0
        win.suspect = True
        held = [o for o in win.retained.values() if o.arrived]
        self.unarrive(win, held, now)
        return len(held)

    def expire(self, now: float) -> list[tuple[PeerWindow, Out]]:
        """Remove and return every put undelivered past its deadline.

        A put whose own thread is still handing it to ZeroMQ (neither sent nor
        queued) is left to that thread, which reports its own timeout.
        """
        failed: list[tuple[PeerWindow, Out]] = []
        for win in self.peers.values():
            expired = []
            for out in win.unarrived.values():  # deadline order: the expired ones are a prefix
                if out.deadline > now:
                    break
                if out.sent_ping is not None or out.queued:
                    expired.append(out)
            for out in expired:
                self._drop(win, out)
                failed.append((win, out))
            if expired:
                win.advance_low()
        return failed

    def close(self) -> list[tuple[PeerWindow, Out]]:
        """Remove and return every put no one can vouch for once the sender is gone.

        That is each put not confirmed arrived, and each one in shared memory (closing
        unlinks it), also one whose own thread is still handing it over: that thread
        finds the sender closed (or its put gone, :meth:`withdraw` returning False) and
        leaves the report to the caller of this, so each put is reported once.
        """
        lost: list[tuple[PeerWindow, Out]] = []
        for win in self.peers.values():
            gone = [out for out in win.retained.values() if out.seq in win.unarrived or out.loc is not None]
            for out in gone:
                self._drop(win, out)
                lost.append((win, out))
        return lost

    def forget(self, match: Callable[[str], bool]) -> list[Out]:
        """Stop retaining puts whose key matches (their request was cleaned up here); return those released now.

        A cleanup never cancels a put already accepted (vllm-omni #6670: a final
        chunk queued just before its request is cleaned up must still arrive).
        Released now: each matching put the receiver holds (arrived, its payload
        in the message). Every other matching put stays, marked ``forgotten``: it
        keeps its delivery deadline and failure report, and is released when its
        arrival is confirmed (a put in our shared memory when it is consumed,
        since our slot must live until the receiver read it).
        """
        dropped: list[Out] = []
        for win in self.peers.values():
            doomed = []
            for out in win.retained.values():
                if match(out.key):
                    if out.arrived and out.loc is None:
                        doomed.append(out)
                    else:
                        out.forgotten = True
            for out in doomed:
                self._drop(win, out)
            dropped.extend(doomed)
            if doomed:
                win.advance_low()
        return dropped

    def undelivered(self) -> int:
        """Puts not yet safe without this sender: unarrived, or in our shared memory and not consumed."""
        return sum(
            len(win.unarrived) + sum(1 for out in win.retained.values() if out.loc is not None)
            for win in self.peers.values()
        )

    def _drop(self, win: PeerWindow, out: Out) -> None:
        del win.retained[out.seq]
        win.unarrived.pop(out.seq, None)
        out.queued = False  # still in the outbox (never sent): the next batch skips it
        self.count -= 1
        self.nbytes -= out.nbytes
