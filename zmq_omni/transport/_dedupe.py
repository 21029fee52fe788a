"""Push mode, receiving half: one sender's de-duplication and acknowledgement state (no sockets, no threads).

:class:`SourceState` decides whether a put is new or a resend, and what the
next REPLY to its sender says; :class:`~zmq_omni.transport._receiver.PushReceiver`
sends it. Every method runs on the receiver's driver (its I/O thread or event
loop), which alone owns these objects (no lock of their own: gets hand their
consumptions over through the mailbox, under its lock). Nothing here reads a
clock (``now`` is passed in).

The invariants the tests check after any sequence of calls:

* a put is accepted at most once per ``seq`` (resends and repeats are duplicates);
* every seq accepted or found duplicate is reported arrived in the next REPLY;
* a REPLY ZeroMQ refused moves nothing on: what it said is said again (see ``SourceState.unsent``);
* every seq consumed is said by the next acknowledgement or pong, and again after each that
  is refused (by pongs only, past :data:`MAX_UNSENT_TRIES` refusals in a row), until one is
  routed; once a routed REPLY said it, by every pong until one saying it is routed (at most :data:`MAX_PONG_RECENT`
  such a pong, those told longest ago first); then within every ``ceil(n / MAX_PONG_REPEATS)``
  pongs (``n`` the entries of the repeat queue) until the sender's ``low`` passes it (a routed
  REPLY can still be lost with its connection; pongs repeat them), and never below ``low``;
* a seq dropped unconsumed is called consumed by no REPLY before its drop report is routed;
* one pong names the consumptions not told yet, at most :data:`MAX_PONG_RECENT` told once
  and at most :data:`MAX_PONG_REPEATS` told twice, and looks at most at
  :data:`MAX_PONG_WALK` of those told twice to find them, whatever the history;
* the dedupe set holds no seq below ``low`` after a pong.

Why pongs repeat consumptions, and why they repeat a bounded share: see :class:`SourceState`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import DecodeError

__all__ = ["MAX_PONG_RECENT", "MAX_PONG_REPEATS", "MAX_PONG_WALK", "MAX_UNCONFIRMED", "MAX_UNSENT_TRIES", "SourceState"]

#: REPLYs to one sender ZeroMQ could not route, in a row, after which the arrivals a REPLY that fails says
#: are given up rather than kept for the next, and its untold consumptions wait for the next pong rather
#: than the next acknowledgement (a sender whose control socket never connects would otherwise make every
#: flush re-send everything it was ever told). Nothing is lost for good: the sender resends what it never
#: heard arrived, which is acknowledged anew, and pongs say every consumption. Drop reports are kept
#: whatever happens (see ``SourceState.unsent``).
MAX_UNSENT_TRIES = 4
#: Most puts taken in from a sender no REPLY has ever reached (its control socket never connected):
#: past it, its puts are refused (``rejected_frames``) until one does; it resends them then.
MAX_UNCONFIRMED = 65536
#: Most consumptions told twice (by two routed REPLYs) one pong repeats; the rest wait their
#: turn (see :class:`SourceState`). Eight REPLYs' worth of seqs: at a heartbeat of 0.5 s, pongs go round
#: 16,000 seqs a second, more than a sender streaming 10,000 puts/s adds.
MAX_PONG_REPEATS = 8192
#: Most consumptions told once (by one routed acknowledgement, drop report or pong) that one pong repeats,
#: those told longest ago first; the others wait for the next pong, still told once (a sender pings every
#: ``heartbeat_s``, so this is more than its window frees between two pings in any honest stream).
MAX_PONG_RECENT = 2 * MAX_PONG_REPEATS
#: Most entries of the repeat queue one pong looks at: those it repeats, and those it finds gone (below
#: ``low``, or said twice) and drops; more of those wait for the next pong.
MAX_PONG_WALK = 8 * MAX_PONG_REPEATS


class SourceState:
    """What the receiver knows of one sender: dedupe window and acknowledgements not yet sent.

    **Why pongs repeat consumptions.** A REPLY that ZeroMQ accepted can still be lost: on a
    live connection it cannot (the ROUTER refuses, rather than drops, what finds no route
    or no room: :meth:`unsent` keeps that), but the REPLYs queued on a connection when it
    is torn down go with it (the connection breaks, or the sender's control socket
    reconnects and ``ROUTER_HANDOVER`` drops the old pipe's queue). A sender that never
    hears a consumption keeps that put, and resends it to a restarted receiver, which would
    deliver it a second time. So every consumption the sender may not know yet is repeated
    in pongs until the sender's ``low`` (it retains nothing below) passes it. The receiver
    cannot tell which of them the sender heard, since the sender names only ``low``; and
    one item waiting unclaimed pins ``low``, so every put consumed meanwhile stays among
    those "the sender may not know yet": 3 million seqs in the 300 s of ``unclaimed_ttl_s``
    at 10,000 puts/s. Repeating all of them in every pong would make each pong, and so each
    sender's wait for room, cost time and bytes in proportion to that history.

    **What a pong says instead.** A consumption goes through three stages, moved on only by
    REPLYs ZeroMQ routed (:meth:`told`; a refused one changes nothing):

    * *untold* (``consumed``, and ``owed`` for those a sender out of reach made us give up
      saying in acknowledgements): the next acknowledgement or pong says it;
    * *told once* (``recent``): one routed REPLY said it; every pong says it again until one
      that says it is routed, at most :data:`MAX_PONG_RECENT` a pong, those told longest ago
      first (the others wait, still told once);
    * *told twice* (``reported``, queued in ``rotation``): at most :data:`MAX_PONG_REPEATS`
      of them a pong, those repeated longest ago first, until ``low`` passes them.

    Each pong therefore costs time linear in what it names, and names a bounded number of
    seqs the sender most likely heard, whatever the history.

    **Why exactly-once still holds.** De-duplication (``seen``, ``low``) is untouched, so a
    resend after a reconnect or a silence is still recognised (and a resend of a put whose
    consumption was told is told consumed again: :meth:`duplicate`); a refused REPLY counts
    for nothing; and every consumption is repeated, again and again, until ``low`` passes
    it. The one thing that changes is how soon a consumption is said again once two routed
    REPLYs said it (the acknowledgement and the pong after it, or two pongs), and both were
    lost: within ``ceil(n / MAX_PONG_REPEATS)`` pongs, ``n`` the consumptions awaiting
    repetition, instead of at the next pong. Both are lost together only when one
    connection is torn down with both queued on it. Only a receiver restart in that
    interval, while the sender still retains the put because it never heard the
    consumption, would have the put delivered again. ``n`` is at most the sender's window
    (10,000 puts by default: two pongs) unless an item pins ``low``. Naming what the sender
    still retains in its PING would bound ``n`` by its window in every case; receivers
    refuse a PING with more fields than they know, so that needs the sender to learn first
    that its receiver accepts one (see docs/delivery.md). Nothing of this changes the wire
    format or the sender.
    """

    __slots__ = (
        "arrived",
        "confirmed",
        "consumed",
        "ctl",
        "dropped",
        "last_heard",
        "low",
        "owed",
        "probe",
        "pruned_low",
        "recent",
        "reported",
        "rotation",
        "seen",
        "shm",
        "unrouted",
    )

    def __init__(self, sid: str, now: float) -> None:
        self.ctl = b"c" + sid.encode()  # the routing identity of the sender's control socket
        self.low = 0  # the sender retains nothing below this: seqs under it are duplicates
        self.pruned_low = 0
        self.seen: set[int] = set()  # accepted seqs >= low (pruned at pongs)
        self.arrived: list[int] = []  # to report arrived in the next REPLY
        self.consumed: list[int] = []  # untold: to report consumed in the next REPLY
        self.owed: list[int] = []  # untold, given up by acknowledgements (see unsent): the next pong says them
        self.dropped: dict[int, list[int]] = {}  # why (a DROPPED_* code) -> seqs dropped unconsumed, not yet sent
        self.recent: dict[int, None] = {}  # told once (by one routed REPLY), in that order: pongs say them again
        self.reported: set[int] = set()  # told twice or more: in the rotation until low passes them
        self.rotation: deque[int] = deque()  # those, repeated longest ago first (and some below low)
        self.last_heard = now
        self.probe: list[Any] | None = None  # the last probe answered
        self.shm: bool | None = None  # its verdict: may this sender send slot handles?
        self.confirmed = False  # a REPLY to it was routed at least once
        self.unrouted = 0  # REPLYs to it that could not be routed since the last one that could

    def note(self, low: int, now: float) -> None:
        """A message from this sender, naming its ``low`` mark."""
        self.last_heard = now
        self.low = max(self.low, low)

    def check_room(self, puts: int = 1) -> None:
        """Refuse ``puts`` more puts from a sender no REPLY ever reached, past :data:`MAX_UNCONFIRMED`.

        Raises:
            DecodeError: the sender is unconfirmed and holds its share already.
        """
        if not self.confirmed and len(self.seen) + puts > MAX_UNCONFIRMED:
            raise DecodeError(
                f"{len(self.seen)} puts taken in from a sender no REPLY has reached (its control socket "
                "never connected): refused until one does"
            )

    def replied(self, routed: bool) -> None:
        """A REPLY to this sender was sent (``routed``) or refused by ZeroMQ (unroutable or full)."""
        if routed:
            self.confirmed = True
            self.unrouted = 0
        else:
            self.unrouted += 1

    def is_new(self, seq: int) -> bool:
        """True when ``seq`` was never accepted (and the sender still retains it)."""
        return seq >= self.low and seq not in self.seen

    def accept(self, seq: int) -> None:
        """``seq`` is taken into the mailbox: remember it, and acknowledge its arrival."""
        self.seen.add(seq)
        self.arrived.append(seq)

    def duplicate(self, seq: int) -> None:
        """A resend of something we have (or had): acknowledge it again, keep one copy.

        A resend of a put whose consumption was told already means the sender may not
        have heard it: the next acknowledgement tells it again (the sender then frees the
        put at once rather than at the consumption's turn in the rotation).
        """
        self.arrived.append(seq)
        if seq >= self.low and (seq in self.recent or seq in self.reported):
            self.consumed.append(seq)

    def all_new(self, seqs: Sequence[int]) -> bool:
        """True when every seq of a batch is new and none repeats (the common case, one C pass each)."""
        return min(seqs) >= self.low and self.seen.isdisjoint(seqs) and len(set(seqs)) == len(seqs)

    def accept_batch(self, accepted: Sequence[int], duplicates: Sequence[int]) -> None:
        """A batch's outcome: ``accepted`` taken into the mailbox, ``duplicates`` acknowledged again."""
        self.seen.update(accepted)
        self.arrived.extend(accepted)
        for seq in duplicates:
            self.duplicate(seq)

    def consume(self, seq: int) -> None:
        """``get`` took ``seq`` (or a re-put or cleanup dropped it): to be reported consumed."""
        self.consumed.append(seq)

    def drop(self, seq: int, code: int) -> None:
        """``seq`` was dropped unconsumed for the reason ``code``: to be reported in a REPLY of its own."""
        self.dropped.setdefault(code, []).append(seq)

    def drops(self) -> list[tuple[int, list[int]]]:
        """The seqs dropped since the last call, per reason code.

        Once a report is routed (:meth:`told`), pongs repeat its seqs as consumed; before
        that no pong names them (the sender would never learn why they went).
        """
        if not self.dropped:
            return []
        dropped, self.dropped = list(self.dropped.items()), {}
        return dropped

    def ack(self) -> tuple[list[int], list[int]] | None:
        """A plain acknowledgement, ``(arrived, consumed)``; None when there is nothing to say."""
        if not (self.arrived or self.consumed):
            return None
        arrived, consumed = self.arrived, self.consumed
        self.arrived, self.consumed = [], []
        return arrived, consumed

    def told(self, consumed: Iterable[int]) -> None:
        """A REPLY naming ``consumed`` (or dropped) seqs was routed: each moves one stage on.

        Untold becomes told once (in ``recent``: the next pongs say it again); told once
        becomes told twice (in the rotation).
        """
        recent, reported, rotation = self.recent, self.reported, self.rotation
        moved = False
        for seq in consumed:
            if seq in reported:
                continue
            if seq in recent:
                del recent[seq]
                reported.add(seq)
                rotation.append(seq)
                moved = True
            else:
                recent[seq] = None
        if moved and not recent:
            self.recent = {}  # a fresh table: one emptied by deletions is walked over its old size

    def pong(self) -> tuple[list[int], list[int]]:
        """The answer to a PING: ``(arrived, consumptions to say)``, bounded as the class docstring says.

        The consumptions are the untold ones, at most :data:`MAX_PONG_RECENT` told once (those
        told longest ago), and at most :data:`MAX_PONG_REPEATS` told twice (the rotation's
        front, which goes to its back). Forgets dedupe state below ``low`` first: the sender
        retains nothing there.
        """
        low = self.low
        if low > self.pruned_low:
            self.pruned_low = low
            self.seen = {s for s in self.seen if s >= low}
        arrived, self.arrived = self.arrived, []
        if self.unrouted > MAX_UNSENT_TRIES:
            # Its REPLYs find no route: this pong only finds out whether one does now, at a cost that does
            # not grow with what it would say (which waits, untold or told once, for a pong that is routed).
            return arrived, []
        new, self.consumed = self.consumed, []
        if self.owed:
            new += self.owed
            self.owed = []
        said: list[int] = []
        repeated: set[int] = set()
        for seq in new:  # untold (or told by a REPLY that found no route): all of them
            if seq >= low and seq not in repeated:
                repeated.add(seq)
                said.append(seq)
        recent = self.recent
        if recent:
            gone: list[int] = []
            budget = MAX_PONG_RECENT
            for seq in recent:
                if seq < low:
                    gone.append(seq)
                elif seq not in repeated:
                    repeated.add(seq)
                    said.append(seq)
                    budget -= 1
                    if not budget:
                        break
            for seq in gone:
                del recent[seq]
        # Each older entry is looked at once per pong at most (``walk``); those below ``low`` (the sender
        # forgot them) leave for good, the others go to the back, said or not.
        rotation, reported = self.rotation, self.reported
        budget, walk = MAX_PONG_REPEATS, min(MAX_PONG_WALK, len(rotation))
        while budget and walk:
            seq = rotation.popleft()
            walk -= 1
            if seq < low:
                reported.discard(seq)
                continue
            rotation.append(seq)
            if seq not in repeated:
                repeated.add(seq)
                said.append(seq)
                budget -= 1
        return arrived, said

    def unsent(self, code: int, arrived: Sequence[int], consumed: Sequence[int]) -> int:
        """A REPLY saying ``arrived`` and ``consumed`` (``code`` as sent) could not go out: say it in the next.

        Arrivals go back in front of the next acknowledgement (a pong reports arrivals only
        since the last REPLY, and a sender resends what it never heard arrived). A drop
        report (``code`` below -1) goes back as such: no pong calls its seqs consumed until
        it is routed. Of the consumptions an acknowledgement or a pong said, those no routed
        REPLY told yet go back untold, in front of the next acknowledgement (those told once
        or twice are where they were: pongs say them again).

        While at most :data:`MAX_UNSENT_TRIES` REPLYs in a row failed, that is all; past
        that, arrivals are given up (a resend is acknowledged anew), and untold consumptions
        wait for the next pong (``owed``) rather than the next acknowledgement, so a sender
        that is never reachable does not make every flush resend all it was ever told
        (pongs to it only probe, and say nothing, until one is routed). Drop reports are
        always kept: bounded by the items held for this sender.

        Returns:
            How many arrivals were given up (0 while tries remain).
        """
        given_up = 0
        keep = self.unrouted <= MAX_UNSENT_TRIES
        if arrived:
            if keep:
                self.arrived[:0] = arrived
            else:
                given_up += len(arrived)
        if code < -1:
            if consumed:
                self.dropped.setdefault(code, [])[:0] = consumed
        elif consumed:
            recent, reported = self.recent, self.reported
            untold = [s for s in consumed if s not in recent and s not in reported]
            if keep:
                self.consumed[:0] = untold
            else:
                self.owed += untold
        return given_up

    def last_word(self) -> tuple[list[int], list[int], list[int]] | None:
        """What to tell the sender as the receiver closes: ``(arrived, urgent, rest)``.

        ``urgent``: the consumptions untold or told once (those the sender most likely has
        not heard); ``rest``: those told twice, in rotation order. Both at or above ``low``.
        Drop reports are the caller's to send first (:meth:`drops`).
        """
        low = self.low
        urgent = list(dict.fromkeys(s for s in (*self.consumed, *self.owed, *self.recent) if s >= low))
        self.consumed, self.owed = [], []
        rest = [s for s in self.rotation if s >= low]
        if not (urgent or rest or self.arrived):
            return None
        arrived, self.arrived = self.arrived, []
        return arrived, urgent, rest
