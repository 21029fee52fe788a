"""The receiving end of push mode without I/O: ReceiveProtocol fed real frames, played at random.

A sender model sends DATA, BATCH and PING frames (new puts and resends, in any
order), a mailbox model takes what arrived, and REPLYs are routed or refused
at random. After every step the protocol's promises are checked: a put is
delivered at most once; once a flush is routed, every put delivered or resent
is reported arrived; every consumption is repeated in each routed pong until
the sender's low mark passes it; hostile frames never raise.

Below it, what one pong costs whatever the history (counted, never timed: the seqs
and REPLYs it names, how REPLY lists are cut), that every consumption still comes
round with the pong limits made small, and a send window joined to the protocol by
hand keeping an item nobody takes exactly-once across lost REPLYs, a reconnect and a
receiver restart.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zmq_omni.metrics import Counters
from zmq_omni.transport import _dedupe
from zmq_omni.transport._dedupe import MAX_PONG_RECENT, MAX_PONG_REPEATS, MAX_UNSENT_TRIES, SourceState
from zmq_omni.transport._envelope import Kind, check_ranges, from_ranges, pack, unpack
from zmq_omni.transport._receive_protocol import ReceiveProtocol, Reply
from zmq_omni.transport._send_window import Out, SendWindow

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


# -- what one pong costs, whatever the history -------------------------------------------------------------------
def _route_all(protocol: ReceiveProtocol, replies: list[Reply]) -> list[tuple[int, list[int], list[int]]]:
    """Route ``replies``; each one's ``(n, arrived, consumed)`` as the sender reads it."""
    said = []
    for reply in replies:
        protocol.sent(reply, True)
        _, header, _ = unpack(reply.frame)
        said.append((header[1], from_ranges(header[2], 1 << 30), from_ranges(header[3], 1 << 30)))
    return said


def _re_puts(protocol: ReceiveProtocol, count: int, low: int = 0) -> list[int]:
    """``count`` puts under one key, each replacing (consuming) the one before, acknowledged as they go.

    The sender's low mark stays at ``low``: a hostile sender, or one whose oldest put waits unclaimed.
    Returns the seqs consumed.
    """
    consumed: list[int] = []
    prev: int | None = None
    for base in range(low, low + count, 1000):
        entries: list[Any] = []
        for seq in range(base, base + 1000):
            entries += [seq, "0", "one-key", b"v"]
        protocol.receive(IDENTITY, [pack(Kind.BATCH, (SID, low, "1", entries))], True, 1.0)
        taken = []
        for _, item in protocol.arrivals:
            if prev is not None:
                taken.append((SID, prev))
                consumed.append(prev)
            prev = item.seq
        protocol.arrivals = []
        protocol.taken(taken, [], 0)
        _route_all(protocol, protocol.flush())
    return consumed


def _pong(protocol: ReceiveProtocol, ping: int, low: int = 0) -> list[tuple[int, list[int], list[int]]]:
    protocol.receive(IDENTITY, [pack(Kind.PING, (SID, ping, low))], True, 2.0)
    replies, protocol.replies = protocol.replies, []
    return _route_all(protocol, replies)


def test_one_pong_names_a_bounded_number_of_seqs_whatever_the_history() -> None:
    protocol = _protocol(Counters())
    consumed = _re_puts(protocol, 60_000)  # more than MAX_PONG_RECENT + MAX_PONG_REPEATS
    first = _pong(protocol, 1)
    named = [seq for _, _, con in first for seq in con]
    # Every consumption was told by an acknowledgement; this first pong repeats the newest of them (the
    # others wait in rotation), in REPLYs of at most 1,024 seqs per list, the answer to the ping last.
    assert len(named) == len(set(named)) == MAX_PONG_RECENT
    assert set(named) == set(consumed[-MAX_PONG_RECENT:])
    assert len(first) == -(-len(named) // 1024)
    assert [n for n, _, _ in first] == [-1] * (len(first) - 1) + [1]
    assert all(len(arr) <= 1024 and len(con) <= 1024 for _, arr, con in first)
    heard = set(named)
    ping = 1
    while heard != set(consumed):
        ping += 1
        assert ping < 2 + -(-len(consumed) // MAX_PONG_REPEATS), "a consumption never came round again"
        later = _pong(protocol, ping)
        again = [seq for _, _, con in later for seq in con]
        assert len(again) == len(set(again)) == MAX_PONG_REPEATS  # no more, however long the history
        assert len(later) == MAX_PONG_REPEATS // 1024
        heard |= set(again)
    # Once the sender's low passes them, they are said no more, and the queue drains.
    assert [con for _, _, con in _pong(protocol, ping + 1, low=consumed[-1] + 1)] == [[]]
    assert _pong(protocol, ping + 2, low=consumed[-1] + 1) == [(ping + 2, [], [])]


def test_reply_splitting_cuts_each_list_once() -> None:
    protocol = _protocol(Counters())
    protocol.receive(IDENTITY, [pack(Kind.PING, (SID, 1, 0))], True, 1.0)
    source = protocol.sources[SID]
    arrived = [*range(10_000, 0, -1), 5, 6, 7]  # unsorted, repeats
    consumed = list(range(0, 50_000, 2))  # 25,000 seqs, 25,000 runs
    for code in (7, -1, -3):
        parts = protocol._reply(source, code, arrived, consumed)
        assert len(parts) == -(-25_000 // 1024)
        assert [r.ping for r in parts] == [min(code, -1)] * (len(parts) - 1) + [code]
        cons = [seq for r in parts for seq in r.consumed]
        arrs = [seq for r in parts for seq in r.arrived]
        assert cons == sorted(set(consumed)) and arrs == sorted(set(arrived))  # each seq in one part, once
        assert all(len(r.arrived) <= 1024 and len(r.consumed) <= 1024 for r in parts)
        for reply in parts:  # what each part says is what it keeps for a resend
            _, header, _ = unpack(reply.frame)
            assert from_ranges(header[3], 1 << 20) == reply.consumed
    assert len(protocol._reply(source, 3, [1, 2], [3])) == 1


_SMALL = {"MAX_PONG_REPEATS": 3, "MAX_PONG_RECENT": 4, "MAX_PONG_WALK": 6}


def _small_limits() -> ExitStack:
    """Pong limits small enough for a few dozen steps to reach them."""
    stack = ExitStack()
    for name, value in _SMALL.items():
        stack.enter_context(patch.object(_dedupe, name, value))
    return stack


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "consume", "drop", "ack", "lost_ack", "pong", "lost_pong", "lost_drop", "low"]),
            st.integers(0, 1000),
        ),
        max_size=120,
    )
)
def test_pongs_stay_bounded_and_every_consumption_comes_round(ops: list[tuple[str, int]]) -> None:
    with _small_limits():
        source = SourceState("s", 0.0)
        source.replied(True)
        next_seq = low = 0
        held: list[int] = []
        consumed: set[int] = set()
        withheld: set[int] = set()  # in a drop report that found no route
        for op, x in ops:
            if op == "put":
                source.accept(next_seq)
                held.append(next_seq)
                next_seq += 1
            elif op in ("consume", "drop") and held:
                seq = held.pop(x % len(held))
                consumed.add(seq)
                source.consume(seq) if op == "consume" else source.drop(seq, -3)
            elif op == "ack":
                source.ack()
            elif op == "lost_ack":
                said = source.ack()
                if said is not None:
                    source.unsent(-1, *said)
            elif op == "lost_drop":
                for code, seqs in source.drops():
                    source.unsent(code, [], seqs)
                    withheld.update(seqs)
            elif op == "low":  # the sender forgot what it heard consumed below x
                low = max(low, min(x % (next_seq + 1), min(held, default=next_seq)))
                source.note(low, 0.0)
            elif op in ("pong", "lost_pong"):
                withheld -= {seq for _, seqs in source.drops() for seq in seqs}
                untold = set(source.consumed)
                _, said = source.pong()
                assert len(said) == len(set(said)), "a pong names a seq twice"
                assert len(said) <= len(untold) + _SMALL["MAX_PONG_RECENT"] + _SMALL["MAX_PONG_REPEATS"]
                assert set(said) <= consumed - withheld and min(said, default=low) >= low
                assert {s for s in untold if s >= low} <= set(said), "a consumption never told is left out"
                if op == "lost_pong":
                    source.replied(False)
                    source.unsent(0, [], said)
                else:
                    source.replied(True)
        # Liveness: nothing new, every pong routed: each consumption at or above low comes round again.
        withheld -= {seq for _, seqs in source.drops() for seq in seqs}
        source.replied(True)
        owed = {s for s in consumed if s >= low}
        heard: set[int] = set()
        rounds = 2 + (len(source.recent) + len(source.rotation) + len(source.consumed)) // _SMALL["MAX_PONG_REPEATS"]
        for _ in range(rounds):
            heard |= set(source.pong()[1])
        assert heard == owed, f"never repeated: {sorted(owed - heard)}"


class _Link:
    """A SendWindow and a ReceiveProtocol joined by hand: frames go straight from one to the other (no sockets).

    ``lose`` decides for each REPLY whether it is lost on the way (a broken connection swallowing it).
    """

    def __init__(self, lose: Any) -> None:
        self.window = SendWindow(max_count=100_000, max_bytes=1 << 40, delivery_timeout_s=1000.0)
        self.win = self.window.peer("1")
        self.lose = lose
        self.ping_no = 0
        self.now = 0.0
        self.incarnation = 0
        self.delivered: dict[str, int] = {}
        self.restart()

    def restart(self) -> None:
        """A new receiver process: an empty mailbox, a new incarnation."""
        self.incarnation += 1
        self.protocol = _protocol(Counters())
        self.protocol.incarnation = f"r{self.incarnation}"
        self.mailbox: dict[str, Any] = {}

    def put(self, key: str) -> None:
        self._send(self.window.admit(self.win, "0", key, [b"v"], 1, None, self.now))

    def _send(self, out: Out) -> None:
        self.now += 0.001
        self.window.mark_sent([out], self.ping_no)
        frame = pack(Kind.DATA, (SID, out.seq, self.win.low, "0", "1", out.key, None), b"v")
        self.protocol.receive(IDENTITY, [frame], True, self.now)
        for (_, _, key), item in self.protocol.arrivals:
            assert key not in self.mailbox
            self.mailbox[key] = item
        self.protocol.arrivals = []

    def get(self, key: str) -> None:
        item = self.mailbox.pop(key)
        self.delivered[key] = self.delivered.get(key, 0) + 1
        self.protocol.taken([(SID, item.seq)], [], 1)

    def _deliver(self, replies: list[Reply]) -> list[int]:
        named = []
        for reply in replies:
            self.protocol.sent(reply, True)
            if self.lose():
                continue
            _, header, _ = unpack(reply.frame)
            arrived, consumed = check_ranges(header[2], 1 << 30), check_ranges(header[3], 1 << 30)
            named += [seq for run in consumed for seq in run]
            result = self.window.apply_reply(
                self.win, header[0], header[1], arrived, consumed, header[4], header[5], self.now
            )
            for out in result.resend:
                self._send(out)
        return named

    def flush(self) -> None:
        self._deliver(self.protocol.flush())

    def ping(self) -> list[int]:
        self.ping_no += 1
        self.protocol.receive(IDENTITY, [pack(Kind.PING, (SID, self.ping_no, self.win.low))], True, self.now)
        replies, self.protocol.replies = self.protocol.replies, []
        return self._deliver(replies)


@pytest.mark.parametrize("seed", range(6))
def test_a_stuck_item_stays_exactly_once_across_a_reconnect_and_a_restart(seed: int) -> None:
    rng = random.Random(seed)
    losing = [True]
    link = _Link(lambda: losing[0] and rng.random() < 0.3)
    with _small_limits():
        link.put("stuck")
        link.flush()
        keys = []
        for burst in range(40):  # a stream beside the stuck item; a third of the REPLYs lost
            batch = [f"k{burst}-{i}" for i in range(rng.randint(1, 12))]
            for key in batch:
                link.put(key)
            link.flush()
            for key in batch:
                link.get(key)
            keys += batch
            link.flush()
            named = link.ping()
            assert len(named) <= len(batch) + _SMALL["MAX_PONG_RECENT"] + _SMALL["MAX_PONG_REPEATS"]
        # The connection heals: within a bounded number of pongs the sender hears every consumption.
        losing[0] = False
        for _ in range(2 + len(keys) // _SMALL["MAX_PONG_REPEATS"]):
            link.ping()
        assert [out.key for out in link.win.retained.values()] == ["stuck"]
        # A reconnect after a silence: the sender resends what it cannot vouch for; the receiver keeps one copy.
        before = link.protocol._counters.snapshot().get("duplicates_dropped", 0)
        assert link.window.note_silence(link.win, link.now + 10.0, 1.0) == 1
        link.ping()
        assert link.protocol._counters.snapshot()["duplicates_dropped"] == before + 1
        assert list(link.mailbox) == ["stuck"]
        # The receiver restarts: only the stuck item comes again (nothing consumed is resent), once.
        link.restart()
        link.ping()
        assert list(link.mailbox) == ["stuck"]
        link.get("stuck")
        link.flush()
        link.ping()
        assert not link.win.retained and link.win.low == link.win.next_seq
    assert link.delivered == dict.fromkeys(["stuck", *keys], 1)
