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
* every seq consumed is reported consumed in every pong until the sender's
  ``low`` passes it (acks can be lost; pongs repeat them), and no later;
* the dedupe set holds no seq below ``low`` after a pong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import DecodeError

__all__ = ["MAX_UNCONFIRMED", "MAX_UNSENT_TRIES", "SourceState"]

#: REPLYs to one sender ZeroMQ could not route, in a row, after which the arrivals and consumptions a
#: REPLY that fails says are given up rather than kept for the next (a sender whose control socket never
#: connects would otherwise make every flush re-send everything it was ever told). Nothing is lost for
#: good: a pong repeats every consumption, and the sender resends what it never heard arrived, which is
#: acknowledged anew. Drop reports are kept whatever happens (see ``SourceState.unsent``).
MAX_UNSENT_TRIES = 4
#: Most puts taken in from a sender no REPLY has ever reached (its control socket never connected):
#: past it, its puts are refused (``rejected_frames``) until one does; it resends them then.
MAX_UNCONFIRMED = 65536


class SourceState:
    """What the receiver knows of one sender: dedupe window and acknowledgements not yet sent."""

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
        "reported",
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
        self.consumed: list[int] = []  # to report consumed in the next REPLY
        self.dropped: dict[int, list[int]] = {}  # why (a DROPPED_* code) -> seqs dropped unconsumed, not yet sent
        self.reported: set[int] = set()  # consumed seqs >= low: repeated in every pong until the sender forgets them
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
            self.reported.update(seqs)
        return dropped

    def ack(self) -> tuple[list[int], list[int]] | None:
        """A plain acknowledgement, ``(arrived, consumed)``; None when there is nothing to say."""
        if not (self.arrived or self.consumed):
            return None
        arrived, consumed = self.arrived, self.consumed
        self.arrived, self.consumed = [], []
        self.reported.update(consumed)
        return arrived, consumed

    def pong(self) -> tuple[list[int], list[int]]:
        """The answer to a PING: ``(arrived, every consumption the sender may not know yet)``.

        Forgets dedupe state below ``low`` first: the sender retains nothing there.
        """
        low = self.low
        reported = self.reported
        reported.update(self.consumed)
        self.consumed = []
        if low > self.pruned_low:
            self.pruned_low = low
            self.seen = {s for s in self.seen if s >= low}
        arrived, self.arrived = self.arrived, []
        if self.unrouted > MAX_UNSENT_TRIES:
            # Its REPLYs find no route: this pong only finds out whether one does now, at a cost that does
            # not grow with what it would repeat (the first pong routed again repeats it all).
            return arrived, []
        if reported and min(reported) < low:  # the sender forgot these: repeating them only grows the pong
            self.reported = reported = {s for s in reported if s >= low}
        return arrived, list(reported)

    def unsent(self, code: int, arrived: Sequence[int], consumed: Sequence[int]) -> int:
        """A REPLY saying ``arrived`` and ``consumed`` (``code`` as sent) could not go out: say it in the next.

        Arrivals go back in front of the next acknowledgement (a pong reports arrivals only
        since the last REPLY, and a sender resends what it never heard arrived); so do a
        plain acknowledgement's consumptions (they are in ``reported`` too, which every pong
        repeats, but the next acknowledgement frees the sender's window sooner). A drop report
        (``code`` below -1) goes back as such, and its seqs leave ``reported`` until it is sent
        (else a pong would call them consumed and the sender would never learn why).

        Arrivals and consumptions go back only while at most :data:`MAX_UNSENT_TRIES` REPLYs
        in a row failed; past that they are given up (a resend is acknowledged anew, a pong
        repeats every consumption), so a sender that is never reachable does not make every
        flush resend all it was ever told. Drop reports are always kept: no later REPLY would
        say them, and they are bounded by the items held for this sender.

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
            self.reported.difference_update(consumed)
            self.dropped.setdefault(code, [])[:0] = consumed
        return given_up

    def last_word(self) -> tuple[list[int], list[int]] | None:
        """What to tell the sender as the receiver closes: arrivals and every unconfirmed consumption."""
        self.reported.update(self.consumed)
        self.consumed = []
        self.drops()
        if not (self.reported or self.arrived):
            return None
        arrived, self.arrived = self.arrived, []
        return arrived, list(self.reported)
