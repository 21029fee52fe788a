"""Push mode, receiving half: one sender's de-duplication and acknowledgement state (no sockets, no threads).

:class:`SourceState` decides whether a put is new or a resend, and what the
next REPLY to its sender says; :class:`~zmq_omni.transport._receiver.PushReceiver`
sends it. Every method runs in whichever thread holds the receiver's socket
(its ``_owner`` lock: the I/O thread, or a get reading the socket itself),
which alone owns these objects (no lock of their own: other threads hand
consumed seqs over through the receiver's ``_taken`` list, under its ``_lock``). Nothing here reads a
clock (``now`` is passed in).

The invariants the tests check after any sequence of calls:

* a put is accepted at most once per ``seq`` (resends and repeats are duplicates);
* every seq accepted or found duplicate is reported arrived in the next REPLY;
* every seq consumed is reported consumed in the first routed pong after the
  acknowledgement that first said it (when among the :data:`MAX_PONG_RECENT` newest said
  since the pong before), then again within every ``ceil(n / MAX_PONG_REPEATS)`` pongs
  (``n`` the entries of the repeat queue) until the sender's ``low`` passes it (acks can
  be lost; pongs repeat them), and never below ``low``;
* one pong names the consumptions not told yet, at most :data:`MAX_PONG_RECENT` told since
  the previous pong and at most :data:`MAX_PONG_REPEATS` older ones, and looks at most at
  :data:`MAX_PONG_WALK` older entries to find them, whatever the history;
* the dedupe set holds no seq below ``low`` after a pong.

Why pongs repeat consumptions, and why they repeat a bounded share: see :class:`SourceState`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import DecodeError

__all__ = ["MAX_PONG_RECENT", "MAX_PONG_REPEATS", "MAX_PONG_WALK", "MAX_UNCONFIRMED", "MAX_UNSENT_TRIES", "SourceState"]

#: REPLYs to one sender ZeroMQ could not route, in a row, after which the arrivals and consumptions a
#: REPLY that fails says are given up rather than kept for the next (a sender whose control socket never
#: connects would otherwise make every flush re-send everything it was ever told). Nothing is lost for
#: good: a pong repeats every consumption, and the sender resends what it never heard arrived, which is
#: acknowledged anew. Drop reports are kept whatever happens (see ``SourceState.unsent``).
MAX_UNSENT_TRIES = 4
#: Most puts taken in from a sender no REPLY has ever reached (its control socket never connected):
#: past it, its puts are refused (``rejected_frames``) until one does; it resends them then.
MAX_UNCONFIRMED = 65536
#: Most older consumptions (said in an earlier pong already) one pong repeats; the rest wait their
#: turn (see :class:`SourceState`). Eight REPLYs' worth of seqs: at a heartbeat of 0.5 s, pongs go round
#: 16,000 seqs a second, more than a sender streaming 10,000 puts/s adds.
MAX_PONG_REPEATS = 8192
#: Most consumptions told since the previous pong (by acknowledgements and drop reports) that one pong
#: repeats, the newest first in line; the older of them join the rotation (a sender pings every
#: ``heartbeat_s``, so this is more than its window frees between two pings in any honest stream).
MAX_PONG_RECENT = 2 * MAX_PONG_REPEATS
#: Most entries of the repeat queue one pong looks at: those it repeats, and those it finds gone (below
#: ``low``, or said twice) and drops; more of those wait for the next pong.
MAX_PONG_WALK = 8 * MAX_PONG_REPEATS


class SourceState:
    """What the receiver knows of one sender: dedupe window and acknowledgements not yet sent.

    **Why pongs repeat consumptions.** A REPLY can be lost without anyone noticing: one
    that ZeroMQ had queued on a connection that then broke (one that finds no route is
    kept and said again, :meth:`unsent`). A sender that never hears a consumption keeps
    that put, and resends it to a restarted receiver, which would deliver it a second
    time. So every consumption the sender may not know yet is repeated in pongs until the
    sender's ``low`` (it retains nothing below) passes it. The receiver cannot tell which
    of them the sender heard, since the sender names only ``low``; and one item waiting
    unclaimed pins ``low``, so every put consumed meanwhile stays among those "the sender
    may not know yet": 3 million seqs in the 300 s of ``unclaimed_ttl_s`` at 10,000
    puts/s. Repeating all of them in every pong would make each pong, and so each
    sender's wait for room, cost time and bytes in proportion to that history.

    **What a pong says instead.** The arrivals and consumptions not yet told; the
    consumptions told since the previous pong (by a plain acknowledgement or a drop
    report), once more, the newest :data:`MAX_PONG_RECENT` of them: what a broken
    connection swallows is what was said last, and the pong follows it within a
    heartbeat; then at most :data:`MAX_PONG_REPEATS` of the older ones, in rotation, those
    repeated longest ago first (``rotation``). Each pong therefore costs time linear in
    what it names, and names a bounded number of already-told seqs whatever the history.

    **Why exactly-once still holds.** De-duplication (``seen``, ``low``) is untouched, so a
    resend after a reconnect or a silence is still recognised; and every consumption is
    still repeated, again and again, until ``low`` passes it, so a consumption lost with a
    connection still reaches the sender. The one thing that changes is how soon a
    consumption lost twice (in the acknowledgement that said it and in the pong after it)
    is said again: within ``ceil(n / MAX_PONG_REPEATS)`` pongs, ``n`` the consumptions
    awaiting repetition, instead of at the next pong. Only a receiver restart in that
    interval, while the sender still retains the put because it never heard the
    consumption, would have the put delivered again. ``n`` is at most the sender's window
    (10,000 puts by default: two pongs) unless an item pins ``low``. Naming what the sender still retains in
    its PING would bound ``n`` by its window in every case; receivers refuse a PING with
    more fields than they know, so that needs the sender to learn first that its
    receiver accepts one (see docs/delivery.md). Nothing of this changes the wire format
    or the sender.
    """

    __slots__ = (
        "arrived",
        "confirmed",
        "consumed",
        "ctl",
        "dropped",
        "last_heard",
        "low",
        "probe",
        "pruned_low",
        "recent",
        "reported",
        "rotation",
        "seen",
        "shm",
        "unrouted",
        "withheld",
    )

    def __init__(self, sid: str, now: float) -> None:
        self.ctl = b"c" + sid.encode()  # the routing identity of the sender's control socket
        self.low = 0  # the sender retains nothing below this: seqs under it are duplicates
        self.pruned_low = 0
        self.seen: set[int] = set()  # accepted seqs >= low (pruned at pongs)
        self.arrived: list[int] = []  # to report arrived in the next REPLY
        self.consumed: list[int] = []  # to report consumed in the next REPLY
        self.dropped: dict[int, list[int]] = {}  # why (a DROPPED_* code) -> seqs dropped unconsumed, not yet sent
        self.reported: set[int] = set()  # consumed seqs said at least once: repeated until low passes them
        self.recent: list[int] = []  # of those, said since the last pong: the next pong repeats them (the newest)
        self.rotation: deque[int] = deque()  # the others, repeated longest ago first (and some below low)
        self.withheld: set[int] = set()  # of those, in a drop report that found no route: not called consumed
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
        """A resend of something we have (or had): acknowledge it again, keep one copy."""
        self.arrived.append(seq)

    def all_new(self, seqs: Sequence[int]) -> bool:
        """True when every seq of a batch is new and none repeats (the common case, one C pass each)."""
        return min(seqs) >= self.low and self.seen.isdisjoint(seqs) and len(set(seqs)) == len(seqs)

    def accept_batch(self, accepted: Sequence[int], duplicates: Sequence[int]) -> None:
        """A batch's outcome: ``accepted`` taken into the mailbox, ``duplicates`` acknowledged again."""
        self.seen.update(accepted)
        self.arrived.extend(accepted)
        self.arrived.extend(duplicates)

    def consume(self, seq: int) -> None:
        """``get`` took ``seq`` (or a re-put or cleanup dropped it): to be reported consumed."""
        self.consumed.append(seq)

    def drop(self, seq: int, code: int) -> None:
        """``seq`` was dropped unconsumed for the reason ``code``: to be reported in a REPLY of its own."""
        self.dropped.setdefault(code, []).append(seq)

    def drops(self) -> list[tuple[int, list[int]]]:
        """The seqs dropped since the last call, per reason code; from now on pongs repeat them as consumed."""
        if not self.dropped:
            return []
        dropped, self.dropped = list(self.dropped.items()), {}
        for _, seqs in dropped:
            self._said(seqs)
            if self.withheld:
                self.withheld.difference_update(seqs)
        return dropped

    def ack(self) -> tuple[list[int], list[int]] | None:
        """A plain acknowledgement, ``(arrived, consumed)``; None when there is nothing to say."""
        if not (self.arrived or self.consumed):
            return None
        arrived, consumed = self.arrived, self.consumed
        self.arrived, self.consumed = [], []
        self._said(consumed)
        return arrived, consumed

    def _said(self, seqs: Iterable[int]) -> None:
        """``seqs`` were told consumed (by an acknowledgement or a drop report): pongs repeat them from now on."""
        reported, recent = self.reported, self.recent
        for seq in seqs:
            if seq not in reported:
                reported.add(seq)
                recent.append(seq)

    def pong(self) -> tuple[list[int], list[int]]:
        """The answer to a PING: ``(arrived, consumptions to say)``, bounded as the class docstring says.

        The consumptions are those not told yet, the newest :data:`MAX_PONG_RECENT` of those
        told since the previous pong, and at most :data:`MAX_PONG_REPEATS` older ones (the
        rotation's front, which go to its back). Forgets dedupe state below ``low`` first:
        the sender retains nothing there.
        """
        low = self.low
        if low > self.pruned_low:
            self.pruned_low = low
            self.seen = {s for s in self.seen if s >= low}
        arrived, self.arrived = self.arrived, []
        new, self.consumed = self.consumed, []
        if self.unrouted > MAX_UNSENT_TRIES:
            # Its REPLYs find no route: this pong only finds out whether one does now, at a cost that does
            # not grow with what it would repeat (what it would say waits in ``recent`` and the rotation).
            self._said(new)
            return arrived, []
        reported, rotation, withheld = self.reported, self.rotation, self.withheld
        older = len(rotation)  # the entries this pong may repeat; what it appends waits for the next ones
        said: list[int] = []
        repeated: set[int] = set()
        for seq in new:  # not told yet (or told by a REPLY that found no route): all of them
            if seq >= low and seq not in repeated:
                repeated.add(seq)
                said.append(seq)
                if seq not in reported:
                    reported.add(seq)
                    rotation.append(seq)
        recent, self.recent = self.recent, []
        if len(recent) > MAX_PONG_RECENT:  # told once already: the older of them wait their turn in rotation
            rotation.extend(recent[:-MAX_PONG_RECENT])
            recent = recent[-MAX_PONG_RECENT:]
        for seq in recent:
            if seq < low:
                reported.discard(seq)
                continue
            rotation.append(seq)
            if seq not in repeated and not (withheld and seq in withheld):
                repeated.add(seq)
                said.append(seq)
        # Each older entry is looked at once per pong at most (``walk``); those below ``low`` (the sender
        # forgot them) leave for good, the others go to the back, said or not.
        budget, walk = MAX_PONG_REPEATS, min(MAX_PONG_WALK, older)
        while budget and walk:
            seq = rotation.popleft()
            walk -= 1
            if seq < low:
                reported.discard(seq)
                continue
            rotation.append(seq)
            if seq not in repeated and not (withheld and seq in withheld):
                repeated.add(seq)
                said.append(seq)
                budget -= 1
        return arrived, said

    def unsent(self, code: int, arrived: Sequence[int], consumed: Sequence[int]) -> int:
        """A REPLY saying ``arrived`` and ``consumed`` (``code`` as sent) could not go out: say it in the next.

        Arrivals go back in front of the next acknowledgement (a pong reports arrivals only
        since the last REPLY, and a sender resends what it never heard arrived); so do a
        plain acknowledgement's consumptions (pongs would repeat them in their turn, but the
        next acknowledgement frees the sender's window sooner), and so do a pong's. A drop
        report (``code`` below -1) goes back as such, and pongs leave its seqs out
        (``withheld``) until it is sent (else a pong would call them consumed and the sender
        would never learn why).

        Arrivals and consumptions go back only while at most :data:`MAX_UNSENT_TRIES` REPLYs
        in a row failed; past that they are given up (a resend is acknowledged anew, and
        pongs keep repeating every consumption in rotation), so a sender that is never
        reachable does not make every flush resend all it was ever told. Drop reports are
        always kept: no later REPLY would say them, and they are bounded by the items held
        for this sender.

        Returns:
            How many seqs were given up (0 while tries remain).
        """
        given_up = 0
        keep = self.unrouted <= MAX_UNSENT_TRIES
        if arrived:
            if keep:
                self.arrived[:0] = arrived
            else:
                given_up += len(arrived)
        if code == -1 and consumed:
            if keep:
                self.consumed[:0] = consumed
            else:
                given_up += len(consumed)
        elif code < -1 and consumed:
            self.withheld.update(consumed)  # until it is sent, no pong may call these consumed
            self.dropped.setdefault(code, [])[:0] = consumed
        elif code >= 0 and consumed:  # a pong's: the next acknowledgement says them, not only their turn
            if not keep:
                given_up += len(consumed)
            elif self.withheld:  # (a drop report sent with this pong failed first: it says those)
                self.consumed[:0] = [s for s in consumed if s not in self.withheld]
            else:
                self.consumed[:0] = consumed
        return given_up

    def last_word(self) -> tuple[list[int], list[int]] | None:
        """What to tell the sender as the receiver closes: arrivals and every unconfirmed consumption."""
        self._said(self.consumed)
        self.consumed = []
        self.drops()
        low = self.low
        reported = [s for s in self.reported if s >= low]
        if not (reported or self.arrived):
            return None
        arrived, self.arrived = self.arrived, []
        return arrived, reported
