"""The receiving end of push mode without I/O: ReceiveProtocol fed real frames, played at random.

A sender model sends DATA, BATCH and PING frames (new puts and resends, in any
order), a mailbox model takes what arrived, and REPLYs are routed or refused
at random. After every step the protocol's promises are checked: a put is
delivered at most once; once a flush is routed, every put delivered or resent
is reported arrived; every consumption is repeated in each routed pong until
the sender's low mark passes it; no REPLY calls a seq consumed before its drop
report was routed; hostile frames never raise.

Below it, what one pong costs whatever the history (counted, never timed: the seqs
and REPLYs it names, how REPLY lists are cut), that no consumption reaches the
rotation before two routed REPLYs said it and every one still comes round with the
pong limits made small, and a send window joined to the protocol by hand: an item
nobody takes stays exactly-once across lost REPLYs, a reconnect and a receiver
restart; REPLYs refused many times in a row, or refused and then one lost, leave no
consumption to the rotation; an acknowledgement and its pong lost together (the one
window left) duplicate a put only on a restart before its turn, which comes within
``ceil(n / MAX_PONG_REPEATS)`` pongs; with REPLYs refused and lost at random and the
receiver killed now and then, a put comes again only as those windows allow; last words
send what the sender has not heard first.
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

from tests.conftest import bytes_protocol
from zmq_omni.metrics import Counters
from zmq_omni.transport import _dedupe
from zmq_omni.transport._dedupe import MAX_PONG_RECENT, MAX_PONG_REPEATS, MAX_UNSENT_TRIES, SourceState
from zmq_omni.transport._envelope import Kind, check_ranges, from_ranges, pack, unpack
from zmq_omni.transport._receive_protocol import ReceiveProtocol, Reply
from zmq_omni.transport._send_window import Out, SendWindow

SID = "s1"
IDENTITY = b"d" + SID.encode()


def _protocol(counters: Counters) -> ReceiveProtocol:
    return bytes_protocol(counters)


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
        self.unreported_drops: set[int] = set()  # dropped, no drop report routed yet: no REPLY may name them

    # -- the sender --
    def _feed(self, frames: list[Any]) -> None:
        self.now += 0.001
        self.protocol.receive(IDENTITY, frames, True, self.now)
        self.protocol.answer()  # the PINGs it holds
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
        self.protocol.answer()  # the PINGs it holds
        replies, self.protocol.replies = self.protocol.replies, []
        trusted = self.unrouted_in_a_row <= MAX_UNSENT_TRIES
        unreported = set(self.unreported_drops)  # a pong names them only once their drop report was routed
        pong = self._route(replies, routed)
        if routed and trusted and pong is not None:
            # Every consumption the sender may not know yet (>= its low mark) is repeated.
            missing = {s for s in self.consumed if s >= self.low} - pong - unreported
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
            self.unreported_drops.add(seq)
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
            self.protocol.answer()  # the PINGs it holds
        self.protocol.receive(IDENTITY, [junk], False, self.now)
        self.protocol.answer()  # the PINGs it holds
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
            if header[1] < -1:
                self.unreported_drops -= consumed
            else:
                assert not consumed & self.unreported_drops, "called consumed before its drop report was routed"
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
    protocol.answer()  # the PINGs it holds
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
        protocol.answer()  # the PINGs it holds
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
    protocol.answer()  # the PINGs it holds
    replies, protocol.replies = protocol.replies, []
    return _route_all(protocol, replies)


def test_one_pong_names_a_bounded_number_of_seqs_whatever_the_history() -> None:
    protocol = _protocol(Counters())
    consumed = _re_puts(protocol, 60_000)  # more than MAX_PONG_RECENT + MAX_PONG_REPEATS
    first = _pong(protocol, 1)
    named = [seq for _, _, con in first for seq in con]
    # Every consumption was told once by a routed acknowledgement; this first pong repeats those told
    # longest ago (the others wait, told once), in REPLYs of at most 1,024 seqs per list, the answer last.
    assert len(named) == len(set(named)) == MAX_PONG_RECENT
    assert set(named) == set(consumed[:MAX_PONG_RECENT])
    assert len(first) == -(-len(named) // 1024)
    assert [n for n, _, _ in first] == [-1] * (len(first) - 1) + [1]
    assert all(len(arr) <= 1024 and len(con) <= 1024 for _, arr, con in first)
    heard = set(named)
    ping = 1
    while heard != set(consumed):  # each told once is said once more, then they come round in rotation
        ping += 1
        assert ping < 2 + -(-len(consumed) // MAX_PONG_RECENT), "a consumption told once was not said again"
        again = [seq for _, _, con in _pong(protocol, ping) for seq in con]
        assert len(again) == len(set(again)) <= MAX_PONG_RECENT + MAX_PONG_REPEATS
        heard |= set(again)
    for _ in range(2):  # all told twice now: each pong repeats a bounded share, however long the history
        ping += 1
        later = _pong(protocol, ping)
        again = [seq for _, _, con in later for seq in con]
        assert len(again) == len(set(again)) == MAX_PONG_REPEATS
        assert len(later) == MAX_PONG_REPEATS // 1024
    # Once the sender's low passes them, they are said no more, and the queue drains.
    assert [con for _, _, con in _pong(protocol, ping + 1, low=consumed[-1] + 1)] == [[]]
    assert _pong(protocol, ping + 2, low=consumed[-1] + 1) == [(ping + 2, [], [])]


def test_reply_splitting_cuts_each_list_once() -> None:
    protocol = _protocol(Counters())
    protocol.receive(IDENTITY, [pack(Kind.PING, (SID, 1, 0))], True, 1.0)
    protocol.answer()  # the PINGs it holds
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
            st.sampled_from(
                ["put", "consume", "drop", "ack", "refused_ack", "pong", "refused_pong", "refused_drop", "low", "cut"]
            ),
            st.integers(0, 1000),
        ),
        max_size=120,
    )
)
def test_pongs_stay_bounded_and_every_consumption_comes_round(ops: list[tuple[str, int]]) -> None:
    """A REPLY is routed or refused (``refused_*``); ``cut`` makes the next ``x % 4`` refused in a row.

    Whether a routed REPLY then reaches the sender does not change what the receiver knows: what is
    checked is that no consumption reaches the rotation before two routed REPLYs said it.
    """
    with _small_limits():
        source = SourceState("s", 0.0)
        source.replied(True)
        next_seq = low = refuse = 0
        held: list[int] = []
        consumed: set[int] = set()
        unreported: set[int] = set()  # dropped, no drop report routed yet: no REPLY may call them consumed
        carriers: dict[int, int] = {}  # routed REPLYs that named each consumption

        def outcome(code: int, arrived: list[int], said: list[int], refused: bool) -> None:
            nonlocal refuse
            if refuse:
                refuse -= 1
                refused = True
            source.replied(not refused)
            if refused:
                source.unsent(code, arrived, said)
                return
            assert not (set(said) & unreported) or code < -1, "called consumed before its drop report was routed"
            if code < -1:
                unreported.difference_update(said)
            for seq in said:
                carriers[seq] = carriers.get(seq, 0) + 1
            source.told(said)

        for op, x in ops:
            if op == "put":
                source.accept(next_seq)
                held.append(next_seq)
                next_seq += 1
            elif op in ("consume", "drop") and held:
                seq = held.pop(x % len(held))
                consumed.add(seq)
                if op == "consume":
                    source.consume(seq)
                else:
                    source.drop(seq, -3)
                    unreported.add(seq)
            elif op in ("ack", "refused_ack"):
                said = source.ack()
                if said is not None:
                    outcome(-1, *said, op != "ack")
            elif op == "refused_drop":
                for code, seqs in source.drops():
                    outcome(code, [], seqs, True)
            elif op == "cut":
                refuse = x % 4
            elif op == "low":  # the sender forgot what it heard consumed below x
                low = max(low, min(x % (next_seq + 1), min(held, default=next_seq)))
                source.note(low, 0.0)
            elif op in ("pong", "refused_pong"):
                for code, seqs in source.drops():
                    outcome(code, [], seqs, False)
                untold = {*source.consumed, *source.owed} if source.unrouted <= MAX_UNSENT_TRIES else set()
                arrived, said = source.pong()
                assert len(said) == len(set(said)), "a pong names a seq twice"
                assert len(said) <= len(untold) + _SMALL["MAX_PONG_RECENT"] + _SMALL["MAX_PONG_REPEATS"]
                assert set(said) <= consumed - unreported and min(said, default=low) >= low
                assert {s for s in untold if s >= low} <= set(said), "a consumption never told is left out"
                outcome(0, arrived, said, op != "pong")
            # Nothing reaches the rotation before two routed REPLYs named it, nor told once before one did.
            assert all(carriers.get(s, 0) >= 2 for s in source.reported), "in rotation after fewer than two"
            assert all(carriers.get(s, 0) == 1 for s in source.recent if s >= low)
            assert not any(carriers.get(s, 0) for s in (*source.consumed, *source.owed))
        # Liveness: nothing new, every REPLY routed: each consumption at or above low comes round again.
        for _, seqs in source.drops():
            source.told(seqs)
        source.replied(True)
        owed = {s for s in consumed if s >= low}
        heard: set[int] = set()
        told = len(source.recent) + len(source.consumed) + len(source.owed)
        rounds = 2 + told // _SMALL["MAX_PONG_RECENT"] + (told + len(source.rotation)) // _SMALL["MAX_PONG_REPEATS"]
        for _ in range(rounds):
            said = source.pong()[1]
            source.told(said)
            heard |= set(said)
        assert heard == owed, f"never repeated: {sorted(owed - heard)}"


class _Link:
    """A SendWindow and a ReceiveProtocol joined by hand: frames go straight from one to the other (no sockets).

    ``refuse`` decides for each REPLY whether ZeroMQ refuses it (no route, or the pipe full: the
    receiver knows); ``lose`` whether one it routed is lost on the way (a connection torn down with
    it queued: nobody knows). ``heard`` is what reached the sender: ``(code, arrived, consumed)``.
    """

    def __init__(self, lose: Any, refuse: Any = lambda: False) -> None:
        self.window = SendWindow(max_count=100_000, max_bytes=1 << 40, delivery_timeout_s=1000.0)
        self.win = self.window.peer("1")
        self.lose = lose
        self.refuse = refuse
        self.heard: list[tuple[int, list[int], list[int]]] = []
        self.routed: list[tuple[bool, set[int], bool]] = []  # this incarnation's routed REPLYs: (pong, named, lost)
        self.taken_at: dict[int, int] = {}  # seq -> len(routed) when a get took it
        self.ping_no = 0
        self.now = 0.0
        self.incarnation = 0
        self.delivered: dict[str, int] = {}
        self.restart()

    def restart(self) -> None:
        """A new receiver process: an empty mailbox, a new incarnation."""
        self.incarnation += 1
        self.routed = []
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
        self.protocol.answer()  # the PINGs it holds
        for (_, _, key), item in self.protocol.arrivals:
            assert key not in self.mailbox
            self.mailbox[key] = item
        self.protocol.arrivals = []

    def get(self, key: str) -> None:
        item = self.mailbox.pop(key)
        self.taken_at[item.seq] = len(self.routed)
        self.delivered[key] = self.delivered.get(key, 0) + 1
        self.protocol.taken([(SID, item.seq)], [], 1)

    def _deliver(self, replies: list[Reply]) -> list[int]:
        named = []
        for reply in replies:
            routed = not self.refuse()
            self.protocol.sent(reply, routed)
            lost = routed and self.lose()
            if routed:
                self.routed.append((reply.ping >= 0, set(reply.consumed), lost))
            if not routed or lost:
                continue
            _, header, _ = unpack(reply.frame)
            arrived, consumed = check_ranges(header[2], 1 << 30), check_ranges(header[3], 1 << 30)
            named += [seq for run in consumed for seq in run]
            self.heard.append((header[1], [s for r in arrived for s in r], [s for r in consumed for s in r]))
            result = self.window.apply_reply(
                self.win, header[0], header[1], arrived, consumed, header[4], header[5], self.now
            )
            for out in result.resend:
                self._send(out)
        return named

    def flush(self) -> None:
        self._deliver(self.protocol.flush())

    def retained(self) -> list[str]:
        """The keys the sender still retains (it never heard them consumed)."""
        return [out.key for out in self.win.retained.values()]

    def stream(self, count: int) -> None:
        """``count`` puts, each taken, every REPLY of them routed and heard (a healthy stream)."""
        for i in range(count):
            self.put(f"k{i}")
            self.flush()
            self.get(f"k{i}")
            self.flush()
            self.ping()

    def ping(self) -> list[int]:
        self.ping_no += 1
        self.protocol.receive(IDENTITY, [pack(Kind.PING, (SID, self.ping_no, self.win.low))], True, self.now)
        self.protocol.answer()  # the PINGs it holds
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


def _script(*outcomes: bool) -> Any:
    """A decider that answers ``outcomes`` one REPLY at a time, then False."""
    queue = list(outcomes)
    return lambda: queue.pop(0) if queue else False


def test_refused_replies_leave_no_consumption_to_the_rotation() -> None:
    """Nothing lost, only refused (the sender's control pipe full, or its socket reconnecting) many times
    in a row: the consumption is still said by the first pong routed, so a restart right after it finds
    the sender no longer retains it."""
    refusing = [False]
    link = _Link(lambda: False, refuse=lambda: refusing[0])
    with _small_limits():
        link.put("stuck")
        link.flush()
        link.stream(60)  # a long rotation beside the stuck item: a consumption's turn there is far off
        link.put("c")
        link.flush()
        refusing[0] = True
        link.get("c")
        link.ping()  # the pong saying c is refused ...
        for i in range(MAX_UNSENT_TRIES + 1):  # ... and so are the flushes after it, past the tries kept
            link.put(f"x{i}")
            link.flush()
        refusing[0] = False
        link.flush()
        link.ping()  # a probe (its REPLYs found no route): says nothing, and is routed
        link.ping()
        assert "c" not in link.retained()
        link.restart()
        link.ping()
        assert "c" not in link.mailbox
        assert sorted(link.mailbox) == ["stuck", *(f"x{i}" for i in range(MAX_UNSENT_TRIES + 1))]
    assert link.delivered["c"] == 1


def test_one_lost_reply_never_leaves_a_consumption_to_the_rotation() -> None:
    """The acknowledgement refused, the pong refused, the next acknowledgement routed and lost with its
    connection: the pong after it still says the consumption (one loss, not two)."""
    refuse: list[bool] = []
    lose: list[bool] = []
    link = _Link(lambda: lose.pop(0) if lose else False, refuse=lambda: refuse.pop(0) if refuse else False)
    with _small_limits():
        link.put("stuck")
        link.flush()
        link.stream(60)
        link.put("c")
        link.flush()
        link.get("c")
        refuse += [True]
        link.flush()  # refused: kept
        refuse += [True]
        link.ping()  # refused: kept
        link.put("y")  # (a refused acknowledgement is said again by the next flush that has news)
        refuse += [False]
        lose += [True]
        link.flush()  # routed, then lost with its connection
        said = link.ping()
        assert "c" not in link.retained(), f"the pong after a lost acknowledgement left c out: {said}"
        link.restart()
        link.ping()
        assert "c" not in link.mailbox
    assert link.delivered["c"] == 1


@pytest.mark.parametrize("restart_after", [0, 1, 3, 100])
def test_an_ack_and_its_pong_lost_together_is_the_one_window(restart_after: int) -> None:
    """The documented window: one connection torn down with the acknowledgement and the pong after it
    queued. The sender then hears the consumption at its turn in the rotation, within
    ``ceil(n / MAX_PONG_REPEATS)`` pongs; a receiver restart before that delivers the put again, after
    it never."""
    losing = [False]
    link = _Link(lambda: losing[0])
    with _small_limits():
        link.put("stuck")
        link.flush()
        link.stream(60)
        link.put("c")
        link.flush()
        link.get("c")
        source = link.protocol.sources[SID]
        losing[0] = True
        link.flush()  # both routed, both lost
        link.ping()
        losing[0] = False
        n = len(source.rotation)
        bound = -(-n // _SMALL["MAX_PONG_REPEATS"])
        pongs = 0
        while "c" in link.retained():
            pongs += 1
            assert pongs <= bound, f"c not said again within {bound} pongs"
            if pongs > restart_after:
                break
            link.ping()
        heard = "c" not in link.retained()
        link.restart()
        link.ping()
        if "c" in link.mailbox:
            link.get("c")
    assert heard or restart_after < bound
    assert link.delivered["c"] == (1 if heard else 2)
    if restart_after >= bound:
        assert link.delivered["c"] == 1


@pytest.mark.parametrize("pong_refused", [False, True])
def test_a_pong_never_calls_consumed_what_an_unrouted_drop_report_says(pong_refused: bool) -> None:
    """A drop report refused beside a pong (one in parts, routed or refused too) and the acknowledgement
    after: no REPLY the sender hears calls the dropped seq consumed before its drop report reached it."""
    refuse: list[bool] = []
    link = _Link(lambda: False, refuse=lambda: refuse.pop(0) if refuse else False)
    link.put("stuck")  # pins the sender's low mark
    link.put("d")  # a low seq: in the first part of a pong in parts
    for i in range(3000):  # told once each: the next pong says them in three parts
        link.put(f"k{i}")
    link.flush()
    for i in range(3000):
        link.get(f"k{i}")
    link.flush()
    seq = link.mailbox.pop("d").seq
    link.protocol.taken([], [(SID, seq, -3)], 0)  # dropped unconsumed (a TTL): reported apart
    refuse += [True, *[pong_refused] * 3]  # the drop report, and every part of the pong
    link.ping()
    assert not refuse
    link.put("e")
    link.flush()  # a refused pong's consumptions go back in front of this acknowledgement
    link.ping()
    link.flush()
    reported = [i for i, (code, _, con) in enumerate(link.heard) if code == -3 and seq in con]
    consumed = [i for i, (code, _, con) in enumerate(link.heard) if code != -3 and seq in con]
    assert reported and all(i > reported[0] for i in consumed), "called consumed before its drop report"
    assert "d" not in link.retained()


def test_last_words_send_what_the_sender_has_not_heard_first() -> None:
    """A receiver closing tells what the sender most likely has not heard before the long tail a slow
    sender's pipe may refuse: drop reports, then untold and told-once consumptions, then the rest."""
    protocol = _protocol(Counters())
    consumed = _re_puts(protocol, 20_000)  # told once each
    for ping in range(1, 4):
        _pong(protocol, ping)  # told twice: in the rotation
    source = protocol.sources[SID]
    assert not source.recent
    last = consumed[-1] + 1
    protocol.taken([(SID, last)], [(SID, last + 1, -3)], 0)
    source.accept(last + 2)
    source.consume(last + 2)
    replies = protocol.last_words()
    said = [(r.ping, r.consumed) for r in replies]
    assert said[0] == (-3, [last + 1])
    assert said[1] == (-1, [last, last + 2]) and replies[1].arrived == [last + 2]
    rest = [seq for _, con in said[2:] for seq in con]
    assert sorted(rest) == sorted(consumed) and len(rest) == len(set(rest))
    assert all(len(con) <= 1024 for _, con in said)


def test_a_resend_of_a_put_whose_consumption_was_lost_is_told_consumed_again() -> None:
    """After the one window (an acknowledgement and its pong lost together), a sender that resends the put
    (a silence, a reconnect) hears it consumed in the next acknowledgement, not only at its turn."""
    losing = [False]
    link = _Link(lambda: losing[0])
    with _small_limits():
        link.put("stuck")
        link.flush()
        link.stream(60)
        link.put("c")
        link.flush()
        link.get("c")
        losing[0] = True
        link.flush()
        link.ping()
        losing[0] = False
        assert link.retained() == ["stuck", "c"]
        assert link.window.note_silence(link.win, link.now + 10.0, 1.0) == 2
        assert "c" not in link.ping()  # its answer makes the sender resend both: duplicates; c's turn is far
        link.flush()
        assert link.retained() == ["stuck"]
    assert link.delivered["c"] == 1


def _may_come_again(routed: list[tuple[bool, set[int], bool]], since: int, seq: int) -> bool:
    """Whether a receiver killed now may have left ``seq``'s consumption unheard, as the windows allow.

    ``routed`` is that receiver's routed REPLYs, the get having taken ``seq`` when ``since`` had been sent.
    Allowed: no REPLY naming it reached the sender, and either two or more named it (all lost), or it
    had no time to be named again: no routed pong after the one REPLY that named it (lost), or at most one
    (a probe, which names nothing) after the get when none named it.
    """
    after = routed[since:]
    naming = [i for i, (_, named, _) in enumerate(after) if seq in named]
    if any(after[i][2] is False for i in naming):
        return False
    if len(naming) >= 2:
        return True
    if naming:
        return not any(pong for pong, _, _ in after[naming[0] + 1 :])
    return sum(pong for pong, _, _ in after) <= 1


@pytest.mark.parametrize("seed", range(8))
def test_refusals_losses_and_restarts_duplicate_only_within_the_windows(seed: int) -> None:
    """REPLYs refused and lost at random, the receiver killed now and then: a put comes again only as the
    windows allow (see ``_may_come_again``), never when one REPLY naming its consumption was lost and a
    routed pong came after it, nor when a REPLY naming it reached the sender."""
    rng = random.Random(seed)
    link = _Link(lambda: rng.random() < 0.25, refuse=lambda: rng.random() < 0.25)
    taken: dict[int, tuple[list[tuple[bool, set[int], bool]], int]] = {}  # seq -> (that receiver's log, when)
    with _small_limits(), patch.object(_dedupe, "MAX_PONG_RECENT", 1000):  # told once: all said by each pong
        link.put("stuck")
        link.flush()
        for burst in range(80):
            batch = [f"k{burst}-{i}" for i in range(rng.randint(1, 6))]
            for key in batch:
                link.put(key)
            link.flush()
            for key in [k for k in link.mailbox if k != "stuck"]:
                seq = link.mailbox[key].seq
                if seq in taken:  # delivered before, by a receiver since killed
                    assert _may_come_again(*taken[seq], seq), (key, taken[seq][0][taken[seq][1] :])
                link.get(key)
                taken[seq] = (link.routed, link.taken_at[seq])
            link.flush()
            link.ping()
            if rng.random() < 0.2:
                link.restart()  # the killed receiver's log stays as it was
                link.ping()
