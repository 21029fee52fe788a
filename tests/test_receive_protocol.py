"""The receiving end of push mode without I/O: ReceiveProtocol fed real frames, played at random.

A sender model sends DATA, BATCH and PING frames (new puts and resends, in any
order), a mailbox model takes what arrived, and REPLYs are routed or refused
at random. After every step the protocol's promises are checked: a put is
delivered at most once; once a flush is routed, every put delivered or resent
is reported arrived; every consumption is repeated in each routed pong until
the sender's low mark passes it; hostile frames never raise.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zmq_omni.metrics import Counters
from zmq_omni.transport._dedupe import MAX_UNSENT_TRIES
from zmq_omni.transport._envelope import Kind, from_ranges, pack, unpack
from zmq_omni.transport._receive_protocol import ReceiveProtocol, Reply

SID = "s1"
IDENTITY = b"d" + SID.encode()


def _protocol(counters: Counters) -> ReceiveProtocol:
    return ReceiveProtocol(
        endpoint="ipc://test",
        incarnation="r1",
        decode=lambda parts: bytes(parts[0]),
        decode_each=lambda wires: [bytes(w) for w in wires],
        max_message_bytes=1 << 20,
        max_frames=8,
        counters=counters,
        health=dict,
        shm=None,
    )


class ReceiveMachine(RuleBasedStateMachine):
    """A sender and a mailbox around one ReceiveProtocol; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = Counters()
        self.protocol = _protocol(self.counters)
        self.now = 0.0
        self.next_seq = 0
        self.low = 0  # the sender's low mark: it retains nothing below
        self.sent: set[int] = set()  # retained by the sender (>= low)
        self.delivered: dict[int, int] = {}  # seq -> times the protocol delivered it
        self.held: list[int] = []  # delivered, not yet taken
        self.consumed: set[int] = set()
        self.heard_arrived: set[int] = set()
        self.heard_consumed: set[int] = set()
        self.unrouted_in_a_row = 0
        self.ping_no = 0

    # -- the sender --
    def _feed(self, frames: list[Any]) -> None:
        self.now += 0.001
        self.protocol.receive(IDENTITY, frames, True, self.now)
        for slot, item in self.protocol.arrivals:
            assert slot == ("0", "1", f"k{item.seq}")
            self.delivered[item.seq] = self.delivered.get(item.seq, 0) + 1
            self.held.append(item.seq)
        self.protocol.arrivals = []
        replies, self.protocol.replies = self.protocol.replies, []
        self._route(replies, True)

    def _seq(self, resend: bool, pick: int) -> int:
        if resend and self.sent:
            return sorted(self.sent)[pick % len(self.sent)]
        seq = self.next_seq
        self.next_seq += 1
        self.sent.add(seq)
        return seq

    @rule(resend=st.booleans(), pick=st.integers(0, 1000))
    def data(self, resend: bool, pick: int) -> None:
        seq = self._seq(resend, pick)
        self._feed([pack(Kind.DATA, (SID, seq, self.low, "0", "1", f"k{seq}", None), f"v{seq}".encode())])

    @rule(picks=st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), min_size=2, max_size=6))
    def batch(self, picks: list[tuple[bool, int]]) -> None:
        entries: list[Any] = []
        for resend, pick in picks:
            seq = self._seq(resend, pick)
            entries += [seq, "0", f"k{seq}", f"v{seq}".encode()]
        self._feed([pack(Kind.BATCH, (SID, self.low, "1", entries))])

    @rule(routed=st.booleans())
    def ping(self, routed: bool) -> None:
        self.ping_no += 1
        self.now += 0.001
        self.protocol.receive(IDENTITY, [pack(Kind.PING, (SID, self.ping_no, self.low))], True, self.now)
        replies, self.protocol.replies = self.protocol.replies, []
        trusted = self.unrouted_in_a_row <= MAX_UNSENT_TRIES
        pong = self._route(replies, routed)
        if routed and trusted and pong is not None:
            # Every consumption the sender may not know yet (>= its low mark) is repeated.
            missing = {s for s in self.consumed if s >= self.low} - pong
            assert not missing, f"pong forgot consumptions {sorted(missing)}"

    @precondition(lambda self: self.sent)
    @rule()
    def sender_forgets_what_it_heard_consumed(self) -> None:
        """The sender's low mark moves past what it heard consumed (it retains nothing there)."""
        while self.low in self.heard_consumed or (self.low < self.next_seq and self.low not in self.sent):
            self.sent.discard(self.low)
            self.low += 1

    # -- the mailbox --
    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 1000), drop=st.booleans())
    def take(self, pick: int, drop: bool) -> None:
        seq = self.held.pop(pick % len(self.held))
        self.consumed.add(seq)
        if drop:
            self.protocol.taken([], [(SID, seq, -3)], 0)
        else:
            self.protocol.taken([(SID, seq)], [], 10)

    @rule(routed=st.booleans())
    def flush(self, routed: bool) -> None:
        trusted = self.unrouted_in_a_row == 0
        self._route(self.protocol.flush(), routed)
        if routed and trusted and self.counters.snapshot().get("acks_given_up", 0) == 0:
            unheard = set(self.delivered) - self.heard_arrived
            assert not unheard, f"delivered puts never reported arrived: {sorted(unheard)}"

    @rule(junk=st.binary(max_size=64), kind=st.sampled_from(list(Kind)))
    def hostile(self, junk: bytes, kind: Kind) -> None:
        self.now += 0.001
        for frames in ([junk], [pack(kind, [junk, -1, None]), junk], [pack(Kind.DATA, (SID, "x", 0, 1, 2, 3, 4))]):
            self.protocol.receive(IDENTITY, frames, True, self.now)  # never raises
        self.protocol.receive(IDENTITY, [junk], False, self.now)
        self.protocol.arrivals = []
        self.protocol.replies = []

    def _route(self, replies: list[Reply], routed: bool) -> set[int] | None:
        """Send ``replies`` (each routed or refused); the consumed set of the pong among them, if any."""
        pong = None
        for reply in replies:
            self.protocol.sent(reply, routed)
            if reply.source is None:
                continue
            self.unrouted_in_a_row = 0 if routed else self.unrouted_in_a_row + 1
            if not routed:
                continue
            kind, header, _ = unpack(reply.frame)
            assert kind is Kind.REPLY and header[0] == "r1"
            arrived, consumed = set(from_ranges(header[2], 1 << 30)), set(from_ranges(header[3], 1 << 30))
            self.heard_arrived |= arrived
            self.heard_consumed |= consumed
            assert consumed <= self.consumed, "a REPLY called something consumed that was not"
            if header[1] == self.ping_no and header[1] > 0:
                pong = (pong or set()) | consumed
            elif header[1] == -1 and pong is not None:
                pong |= consumed
        return pong

    @invariant()
    def delivered_at_most_once(self) -> None:
        twice = [seq for seq, n in self.delivered.items() if n > 1]
        assert not twice, f"puts delivered twice: {twice}"


TestReceiveProtocol = ReceiveMachine.TestCase
TestReceiveProtocol.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize(
    "frames",
    [
        [pack(Kind.DATA, (SID, 0, 0, "0", "1", "k", b"not a handle"))],
        [pack(Kind.BATCH, (SID, 0, "1", [0, "0", "k", b"x"]))],  # one put: a batch holds two or more
        [pack(Kind.PING, ("", 1, 0))],  # no sender id
        [pack(Kind.PING, ("x" * 65, 1, 0))],  # a sender id too long
        [pack(Kind.REPLY, ("r", -1, [], [], None, 0))],  # a kind a receiver never takes
    ],
)
def test_malformed_messages_are_counted_not_raised(frames: list[Any]) -> None:
    counters = Counters()
    protocol = _protocol(counters)
    assert protocol.receive(IDENTITY, frames, True, 1.0) is None
    assert protocol.arrivals == [] and counters.snapshot()["rejected_frames"] == 1
