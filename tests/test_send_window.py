"""The push sender's window and the receiver's dedupe state, driven directly: no sockets, no threads, no clock.

As httpcore tests its connection pool against a mock backend, these tests play
the network themselves: a FIFO of DATA and PING messages that may be delivered
or lost, REPLYs that may be delivered or lost, a receiver that may restart, and
a clock moved by hand. The receiver is the real
:class:`~zmq_omni.transport._dedupe.SourceState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zmq_omni.connectors.base import key_matches_prefix as key_matches
from zmq_omni.transport._batching import STREAM_FLUSH_S, Outbox, batch_end
from zmq_omni.transport._dedupe import SourceState
from zmq_omni.transport._envelope import check_ranges, to_ranges
from zmq_omni.transport._push_protocol import DROPPED_CANCELLED, DROPPED_UNCLAIMED
from zmq_omni.transport._send_window import Out, SendWindow
from zmq_omni.transport._tombstones import Tombstones

MAX_COUNT = 6
MAX_BYTES = 1000
TIMEOUT = 1.0


def _ranges(seqs: list[int]) -> list[range]:
    return check_ranges(to_ranges(seqs), 1 << 20)


def _window(**kw: int | float) -> SendWindow:
    args: dict[str, int | float] = {"max_count": MAX_COUNT, "max_bytes": MAX_BYTES, "delivery_timeout_s": TIMEOUT}
    args.update(kw)
    return SendWindow(**args)  # type: ignore[arg-type]


# -- examples ------------------------------------------------------------------------------------------------
def test_window_admits_up_to_its_bounds_and_one_oversized_put_alone() -> None:
    window = _window()
    win = window.peer("1")
    assert not window.full(5 * MAX_BYTES)  # an empty window admits anything
    window.admit(win, "0", "big", [b""], 5 * MAX_BYTES, None, 0.0)
    assert window.full(1)
    window.apply_reply(win, "r1", -1, _ranges([0]), _ranges([0]), None, 0, 0.1)
    assert window.count == 0 and window.nbytes == 0 and win.low == 1
    for i in range(MAX_COUNT):
        assert not window.full(1)
        window.admit(win, "0", f"k{i}", [b"x"], 1, None, 0.0)
    assert window.full(1) and window.count == MAX_COUNT


def test_pong_resends_only_what_went_out_before_its_ping_and_is_unarrived() -> None:
    window = _window()
    win = window.peer("1")
    a, b, c = (window.admit(win, "0", k, [b"x"], 1, None, 0.0) for k in "abc")
    window.mark_sent([a, b], 0)  # before ping 1
    window.mark_sent([c], 1)  # after ping 1
    result = window.apply_reply(win, "r1", 1, _ranges([a.seq]), [], None, 0, 0.1)
    assert [o.key for o in result.resend] == ["b"]  # a arrived; c went out after the ping answered


def test_restart_resends_everything_unconsumed_and_a_stale_reply_only_frees() -> None:
    window = _window()
    win = window.peer("1")
    outs = [window.admit(win, "0", f"k{i}", [b"x"], 1, None, 0.0) for i in range(3)]
    window.mark_sent(outs, 0)
    window.apply_reply(win, "old", -1, _ranges([0, 1, 2]), _ranges([0]), None, 0, 0.1)
    assert not win.unarrived and set(win.retained) == {1, 2}
    result = window.apply_reply(win, "new", -1, [], [], None, 0, 0.2)
    assert result.restarted and sorted(o.seq for o in result.resend) == [1, 2]
    assert set(win.unarrived) == {1, 2}
    # The old incarnation's last words: consumption counts, its arrivals do not.
    stale = window.apply_reply(win, "old", 5, _ranges([1, 2]), _ranges([1]), None, 0, 0.3)
    assert stale.freed == 1 and not stale.resend and set(win.unarrived) == {2}


def test_expiry_fails_unarrived_puts_in_deadline_order_and_skips_those_still_being_handed_over() -> None:
    window = _window()
    win = window.peer("1")
    sent = window.admit(win, "0", "sent", [b"x"], 1, None, 0.0)
    window.mark_sent([sent], 0)
    handing = window.admit(win, "0", "handing", [b"x"], 1, None, 0.0)
    later = window.admit(win, "0", "later", [b"x"], 1, None, 0.5)
    window.mark_sent([later], 0)
    assert window.expire(TIMEOUT - 0.01) == []
    failed = window.expire(TIMEOUT + 0.01)
    assert [out.key for _, out in failed] == ["sent"]
    assert handing.seq in win.retained  # its own thread reports it
    assert window.withdraw(win, handing) and not window.withdraw(win, handing)
    assert [out.key for _, out in window.expire(TIMEOUT + 0.6)] == ["later"]
    assert window.count == 0 and win.low == win.next_seq


def test_close_takes_every_unconfirmed_put_also_one_still_being_handed_over() -> None:
    window = _window()
    win = window.peer("1")
    sent, arrived, handing, queued = (window.admit(win, "0", k, [b"x"], 1, None, 0.0) for k in "sahq")
    window.mark_sent([sent, arrived], 0)
    window.apply_reply(win, "r1", -1, _ranges([arrived.seq]), [], None, 0, 0.1)
    queued.queued = True
    assert sorted(out.key for _, out in window.close()) == ["h", "q", "s"]  # the receiver holds "a"
    assert not window.withdraw(win, handing)  # its thread finds it gone: close reported it, it raises nothing


def test_silence_makes_delivered_puts_undelivered_again_once() -> None:
    window = _window()
    win = window.peer("1")
    out = window.admit(win, "0", "k", [b"x"], 1, None, 0.0)
    window.mark_sent([out], 0)
    window.apply_reply(win, "r1", -1, _ranges([0]), [], None, 0, 1.0)
    assert window.note_silence(win, 1.5, 2.0) == 0
    assert window.note_silence(win, 3.5, 2.0) == 1 and out.deadline == 3.5 + TIMEOUT
    assert window.note_silence(win, 4.0, 2.0) == 0  # once per silence
    window.apply_reply(win, "r1", -1, _ranges([0]), [], None, 0, 4.1)
    assert not win.suspect and not win.unarrived


def test_a_drop_reply_returns_its_puts_as_disposed_apart_from_consumed_ones() -> None:
    window = _window()
    win = window.peer("1")
    outs = [window.admit(win, "0", f"k{i}", [b"x"], 1, None, 0.0) for i in range(4)]
    window.mark_sent(outs, 0)
    plain = window.apply_reply(win, "r1", -1, _ranges([0, 1, 2, 3]), _ranges([0]), None, 0, 0.1)
    assert plain.freed == 1 and not plain.disposed
    cancelled = window.apply_reply(win, "r1", DROPPED_CANCELLED, [], _ranges([1, 2]), None, 0, 0.2)
    assert [o.key for o in cancelled.disposed] == ["k1", "k2"] and cancelled.freed == 2
    unclaimed = window.apply_reply(win, "r1", DROPPED_UNCLAIMED, [], _ranges([2, 3]), None, 0, 0.3)
    assert [o.key for o in unclaimed.disposed] == ["k3"]  # 2 left the window already: reported once
    pong = window.apply_reply(win, "r1", 1, [], _ranges([0, 1, 2, 3]), None, 0, 0.4)  # pongs repeat drops
    assert not pong.disposed and not pong.freed and window.count == 0


def test_forget_releases_only_what_the_receiver_holds_and_the_rest_once_it_arrives() -> None:
    window = _window()
    win = window.peer("1")
    held, sent, queued, other = (window.admit(win, "0", k, [b"x"], 1, None, 0.0) for k in ("r_1", "r_2", "r_3", "s_1"))
    shm = window.admit(win, "0", "r_4", [], 1, b"slot", 0.0)
    window.mark_sent([held, sent, other, shm], 0)
    queued.queued = True  # still in the outbox: a final chunk put just before its request's cleanup
    window.apply_reply(win, "r1", -1, _ranges([held.seq, shm.seq]), [], None, 0, 0.1)
    released = window.forget(lambda key: key.startswith("r_"))
    assert released == [held]  # the others are still on their way (shm: until read)
    assert set(win.retained) == {sent.seq, queued.seq, other.seq, shm.seq} and queued.queued
    assert queued.forgotten and sent.forgotten and shm.forgotten and not other.forgotten
    # They keep their delivery deadline: one never confirmed is still reported failed.
    window.mark_sent([queued], 0)
    result = window.apply_reply(win, "r1", -1, _ranges([queued.seq, other.seq]), [], None, 0, 0.2)
    assert result.released == [queued] and result.freed == 1 and other.seq in win.retained
    assert [out for _, out in window.expire(0.0 + TIMEOUT)] == [sent]
    window.apply_reply(win, "r1", -1, [], _ranges([shm.seq]), None, 0, 0.3)  # consumed: our slot may go
    assert set(win.retained) == {other.seq}


def test_batch_size_follows_the_receiver_and_our_cap() -> None:
    window = _window(batch_max_bytes=4096)
    win = window.peer("1")
    window.apply_reply(win, "r", -1, [], [], None, 1 << 20, 0.0)
    assert win.batch_bytes == 4096
    window.apply_reply(win, "r", -1, [], [], None, 600, 0.0)  # too small for two puts
    assert win.batch_bytes == 0


# -- the protocol, played at random -------------------------------------------------------------------------
@dataclass
class _Receiver:
    incarnation: str
    source: SourceState = field(default_factory=lambda: SourceState("s", 0.0))
    held: set[int] = field(default_factory=set)  # arrived, not consumed
    accepted: list[int] = field(default_factory=list)


class WindowProtocol(RuleBasedStateMachine):
    """A sender window and a receiver over a lossy FIFO; checks the window's promises after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.window = _window()
        self.win = self.window.peer("1")
        self.now = 0.0
        self.ping_no = 0
        self.net: list[tuple[str, int, int]] = []  # ("data" | "ping", seq or ping number, low)
        self.replies: list[tuple[str, int, list[int], list[int]]] = []
        self.incarnations = 0
        self.receiver = self._new_receiver()
        self.consumed_everywhere: set[int] = set()  # taken by a get, in any incarnation
        self.freed: set[int] = set()  # the sender learned it was consumed
        self.failed: list[int] = []
        self.withdrawn: set[int] = set()
        self.forgotten: set[int] = set()  # released after a cleanup, the receiver holding them
        self.cleaned_up: set[int] = set()  # retained when a cleanup named their key
        self.dropped_by_receiver: set[int] = set()
        self.disposed: set[int] = set()  # the window reported them dropped by the receiver
        self.admitted: set[int] = set()

    def _new_receiver(self) -> _Receiver:
        self.incarnations += 1
        return _Receiver(f"r{self.incarnations}")

    def _send(self, seqs: list[int]) -> None:
        outs = [self.win.retained[s] for s in seqs]
        self.window.mark_sent(outs, self.ping_no)
        self.net.extend(("data", s, self.win.low) for s in seqs)

    # -- sender side --
    @rule(nbytes=st.integers(1, 400), ok=st.booleans())
    def put(self, nbytes: int, ok: bool) -> None:
        if self.window.full(nbytes):
            assert self.window.count >= MAX_COUNT or self.window.nbytes + nbytes > MAX_BYTES
            return
        out = self.window.admit(self.win, "0", f"k{self.win.next_seq % 3}", [b""], nbytes, None, self.now)
        self.admitted.add(out.seq)
        if ok:
            self._send([out.seq])
        else:  # the put's own send failed: it raises to its caller
            assert self.window.withdraw(self.win, out)
            self.withdrawn.add(out.seq)

    @rule()
    def ping(self) -> None:
        self.ping_no += 1
        self.net.append(("ping", self.ping_no, self.win.low))

    @rule(dt=st.floats(0.0, 0.6))
    def tick(self, dt: float) -> None:
        self.now += dt
        failed = self.window.expire(self.now)
        if failed:
            self.net = [m for m in self.net if m[0] != "data"]  # the data socket is reset: its queue dropped
        for _, out in failed:
            assert out.seq not in self.freed
            self.failed.append(out.seq)

    @rule(which=st.integers(0, 2))
    def forget(self, which: int) -> None:
        key = f"k{which}"
        self.cleaned_up.update(o.seq for o in self.win.retained.values() if o.key == key)
        released = self.window.forget(lambda k: k == key)
        for out in released:  # a cleanup releases only what the receiver already holds
            assert out.arrived and out.seq not in self.win.unarrived
        self.forgotten.update(o.seq for o in released)

    @rule()
    def silence(self) -> None:
        self.window.note_silence(self.win, self.now, 0.3)

    # -- the wire --
    @precondition(lambda self: self.net)
    @rule(lose=st.booleans())
    def deliver(self, lose: bool) -> None:
        kind, number, low = self.net.pop(0)
        if lose:
            return
        rx = self.receiver
        rx.source.note(low, self.now)
        if kind == "data":
            if rx.source.is_new(number):
                rx.source.accept(number)
                rx.held.add(number)
                rx.accepted.append(number)
            else:
                rx.source.duplicate(number)
        else:
            arrived, consumed = rx.source.pong()
            rx.source.told(consumed)  # ZeroMQ routes every REPLY here; ``reply`` may lose it on the way
            self.replies.append((rx.incarnation, number, arrived, consumed))

    @precondition(lambda self: self.receiver.held)
    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.receiver.held)))
        self.receiver.held.discard(seq)
        self.receiver.source.consume(seq)
        self.consumed_everywhere.add(seq)

    @precondition(lambda self: self.receiver.held)
    @rule(data=st.data(), code=st.sampled_from([DROPPED_UNCLAIMED, DROPPED_CANCELLED]))
    def drop(self, data: st.DataObject, code: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.receiver.held)))
        self.receiver.held.discard(seq)
        self.receiver.source.drop(seq, code)
        self.dropped_by_receiver.add(seq)

    @rule()
    def ack(self) -> None:
        source = self.receiver.source
        for code, seqs in source.drops():  # as the receiver sends them: a REPLY of their own, before the ack
            source.told(seqs)
            self.replies.append((self.receiver.incarnation, code, [], seqs))
        acks = source.ack()
        if acks is not None:
            source.told(acks[1])
            self.replies.append((self.receiver.incarnation, -1, *acks))

    @precondition(lambda self: self.replies)
    @rule(lose=st.booleans())
    def reply(self, lose: bool) -> None:
        incarnation, ping, arrived, consumed = self.replies.pop(0)
        if lose:
            return
        before = set(self.win.retained)
        result = self.window.apply_reply(
            self.win, incarnation, ping, _ranges(arrived), _ranges(consumed), None, 0, self.now
        )
        released = {o.seq for o in result.released}
        assert released <= self.cleaned_up, "a put released that no cleanup asked for"
        self.forgotten |= released
        self.freed |= before - set(self.win.retained) - released
        for out in result.disposed:
            assert out.seq in self.dropped_by_receiver and out.seq not in self.disposed
            self.disposed.add(out.seq)
        for out in result.resend:
            assert out.seq not in self.freed, "a put the receiver reported consumed was resent"
            assert out.seq in self.win.unarrived
        self._send([o.seq for o in result.resend])

    @rule()
    def restart(self) -> None:
        self.receiver = self._new_receiver()  # what it held unconsumed is gone with it
        self.net = []

    # -- what must always hold --
    @invariant()
    def window_is_bounded_and_consistent(self) -> None:
        window, win = self.window, self.win
        assert window.count <= MAX_COUNT
        assert window.nbytes <= MAX_BYTES or window.count == 1
        assert window.count == len(win.retained)
        assert window.nbytes == sum(o.nbytes for o in win.retained.values())
        assert set(win.unarrived) <= set(win.retained)
        deadlines = [o.deadline for o in win.unarrived.values()]
        assert deadlines == sorted(deadlines)
        assert all(seq >= win.low for seq in win.retained)

    @invariant()
    def each_put_is_accepted_once_per_receiver(self) -> None:
        accepted = self.receiver.accepted
        assert len(accepted) == len(set(accepted))

    def teardown(self) -> None:
        # Let the network settle (pings reveal a restart; resends fill the new receiver), then close.
        for _ in range(6):
            self.ping()
            while self.net:
                self.deliver(lose=False)
            self.ack()
            while self.replies:
                self.reply(lose=False)
        lost = {out.seq for _, out in self.window.close()}
        assert not lost & self.freed
        reported = set(self.failed) | lost
        assert len(self.failed) == len(set(self.failed)), "a put was reported failed twice"
        # Nothing lost is unreported: a put not reported failed, withdrawn or released after a cleanup (the
        # receiver held it) was consumed or is held. A cleanup cancels nothing on its way.
        for seq in self.admitted - reported - self.withdrawn - self.forgotten:
            if seq in self.consumed_everywhere or seq in self.receiver.held:
                continue
            assert seq in self.dropped_by_receiver, f"put {seq} lost silently"
            # Dropped unconsumed: reported disposed, unless that REPLY was lost and only its repeat
            # as consumed (a pong) reached the sender.
            assert seq in self.disposed or seq in self.freed, f"put {seq} dropped silently"
        assert not self.disposed & reported, "a disposed put was also reported failed"
        assert self.window.count == len(self.win.retained)


TestWindowProtocol = WindowProtocol.TestCase
TestWindowProtocol.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


# -- the receiver's dedupe state on its own ------------------------------------------------------------------
def test_source_state_reports_consumption_in_every_pong_until_the_sender_forgets_it() -> None:
    source = SourceState("s", 0.0)
    for seq in range(4):
        assert source.is_new(seq)
        source.accept(seq)
    source.duplicate(1)
    source.consume(0)
    source.consume(1)
    acked = source.ack()
    assert acked == ([0, 1, 2, 3, 1], [0, 1])
    source.told(acked[1])  # routed
    assert source.ack() is None
    said = source.pong()[1]
    assert sorted(said) == [0, 1]  # repeated: the ack may have been lost
    source.told(said)
    source.note(1, 1.0)  # the sender dropped seq 0
    arrived, consumed = source.pong()
    assert arrived == [] and consumed == [1] and source.seen == {1, 2, 3}
    assert not source.is_new(0) and not source.is_new(2) and source.is_new(4)
    source.duplicate(1)  # a resend of a put whose consumption was told: told again
    assert source.ack() == ([1], [1])


def test_source_state_reports_drops_apart_once_then_repeats_them_as_consumed() -> None:
    source = SourceState("s", 0.0)
    for seq in range(3):
        source.accept(seq)
    source.consume(0)
    source.drop(1, -2)
    source.drop(2, -3)
    assert source.drops() == [(-2, [1]), (-3, [2])] and source.drops() == []
    source.told([1])  # the reports were routed
    source.told([2])
    acked = source.ack()
    assert acked == ([0, 1, 2], [0])
    source.told(acked[1])
    said = source.pong()[1]
    assert sorted(said) == [0, 1, 2]  # an ack of a drop may be lost too: pongs repeat it
    source.told(said)
    source.drop(3, -2)
    source.consume(4)
    last = source.last_word()  # the drop report is the caller's to send (drops), first
    assert last is not None and last[1] == [4] and sorted(last[2]) == [0, 1, 2]
    assert source.drops() == [(-2, [3])]


def test_source_state_says_again_what_an_unsent_reply_said() -> None:
    source = SourceState("s", 0.0)
    for seq in range(4):
        source.accept(seq)
    source.consume(0)
    acks = source.ack()
    assert acks == ([0, 1, 2, 3], [0])
    source.unsent(-1, *acks)  # the plain ack could not go out
    source.accept(4)
    assert source.ack() == ([0, 1, 2, 3, 4], [0])  # what it said goes in the next one
    source.unsent(0, [0, 1, 2, 3, 4], [0])  # nor could a pong: its arrivals go in the next, consumptions stay
    arrived, consumed = source.pong()
    assert arrived == [0, 1, 2, 3, 4] and consumed == [0]
    source.told(consumed)  # routed: told once, the next pong says it again
    source.drop(1, -3)
    ((code, seqs),) = source.drops()
    source.unsent(code, [], seqs)  # a drop report that could not go out stays a drop report
    assert source.pong() == ([], [0])  # not called consumed before the report is sent
    assert source.drops() == [(-3, [1])]
    source.told([1])
    assert sorted(source.pong()[1]) == [0, 1]


_SOURCE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("data"), st.integers(0, 30), st.integers(0, 30)),
        st.tuples(st.just("consume"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("ack"), st.just(0), st.just(0)),
        st.tuples(st.just("pong"), st.just(0), st.just(0)),
        st.tuples(st.just("batch"), st.integers(0, 30), st.integers(1, 6)),
        st.tuples(st.just("lost"), st.sampled_from([-1, 0]), st.just(0)),  # a plain ack or a pong not routable
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(ops=_SOURCE_OPS)
def test_source_state_accepts_once_and_reports_what_it_must(ops: list[tuple[str, int, int]]) -> None:
    source = SourceState("s", 0.0)
    accepted: list[int] = []
    held: set[int] = set()
    consumed: set[int] = set()  # consumed, the sender not told past its low yet
    unreported_arrivals: set[int] = set()
    low = 0
    for op, a, b in ops:
        if op == "data":
            low = max(low, min(a, b))  # the sender's low only grows
            source.note(low, 0.0)
            if source.is_new(a):
                source.accept(a)
                accepted.append(a)
                held.add(a)
            else:
                source.duplicate(a)
            unreported_arrivals.add(a)
        elif op == "batch":
            seqs = [a + i for i in range(b)] + [a]  # a repeat inside the batch
            fresh = [s for s in dict.fromkeys(seqs) if source.is_new(s)]
            assert not source.all_new(seqs)
            source.accept_batch(fresh, [s for s in seqs if s not in fresh] + [a] * (a in fresh))
            accepted.extend(fresh)
            held.update(fresh)
            unreported_arrivals.update(seqs)
        elif op == "consume" and a in held:
            held.discard(a)
            source.consume(a)
            consumed.add(a)
        elif op == "ack":
            got = source.ack()
            if got is not None:
                assert set(got[0]) == unreported_arrivals
                unreported_arrivals = set()
                source.told(got[1])
        elif op == "lost":  # the REPLY could not go out: what it said must still reach the sender later
            said = source.ack() if a == -1 else source.pong()
            if said is not None:
                source.unsent(a, *said)
        elif op == "pong":
            arrived, reported = source.pong()
            assert set(arrived) == unreported_arrivals
            unreported_arrivals = set()
            assert set(reported) == {s for s in consumed if s >= low}, "consumption not repeated, or past low"
            source.told(reported)
            assert min(source.seen, default=low) >= low
        assert len(accepted) == len(set(accepted)), "a put was accepted twice"


# -- the batching policy ---------------------------------------------------------------------------------------
def _outs(n: int, nbytes: int = 10) -> list[Out]:
    return [Out(i, "0", f"k{i}", [b"x"], nbytes, 1.0, None) for i in range(n)]


def test_a_lone_put_leaves_at_once_and_a_stream_waits_for_its_batch() -> None:
    box = Outbox()
    a, b, c = _outs(3)
    assert box.add(a, 0.0, 256, 1 << 16)  # idle: no added latency
    assert box.take(1 << 16, "1", 256) == [a] and not a.queued
    box.busy_until = 0.0 + STREAM_FLUSH_S
    assert not box.add(b, 0.0001, 256, 1 << 16)  # busy: rides in the next batch
    assert not box.add(c, 0.0001 + STREAM_FLUSH_S, 256, 1 << 16)  # still busy: the I/O thread's turn flushes
    assert box.add(Out(3, "0", "k3", [b"x"], 10, 1.0, None), 0.0002, 3, 1 << 16)  # full: it leaves now
    box.blocked = True
    assert not box.add(Out(9, "0", "k", [b""], 1, 1.0, None), 1.0, 1, 1)  # never while blocked


def test_take_respects_the_batch_budget_skips_dropped_puts_and_requeue_keeps_order() -> None:
    box = Outbox()
    outs = _outs(6, nbytes=300)
    for out in outs:
        box.add(out, 0.0, 256, 1 << 16)
    outs[1].queued = False  # consumed or expired meanwhile
    budget = 1300
    end = batch_end(outs, 0, budget, "1", 256)
    assert 1 <= end < len(outs)
    first = box.take(budget, "1", 256)
    assert first == [o for o in outs[:end] if o is not outs[1]]
    box.requeue(first)
    assert box.items[: len(first)] == first and all(o.queued for o in first)
    rest = box.take(1 << 20, "1", 256)
    assert rest == [o for o in outs if o is not outs[1]] and box.nbytes == 0 and not box.items
    assert batch_end(outs, 0, 10, "1", 256) == 1  # one put always fits


# -- the receiver's tombstones ---------------------------------------------------------------------------------------
def test_tombstones_cover_a_key_or_a_prefix_plus_digits_renew_on_each_drop_and_lapse() -> None:
    tombs = Tombstones(ttl_s=1.0, max_count=10)
    tombs.bury(0.0, key="req-7", prefix="req-8_1_")
    assert tombs.covers("req-7", 0.5) and not tombs.covers("req-70", 0.5)
    assert tombs.covers("req-8_1_12", 0.5) and not tombs.covers("req-8_1_x", 0.5) and not tombs.covers("req-8_1_", 0.5)
    assert tombs.covers("req-7", 1.4)  # renewed at 0.5: lasts until 1.5
    assert not tombs.covers("req-8_1_3", 1.6)  # renewed at 0.5 too: lapsed at 1.5
    assert tombs.lapse(1.6) == 1 and len(tombs) == 1 and tombs.lapse(2.4) == 1 and len(tombs) == 0
    tombs.bury(2.0, prefix="a")
    tombs.lift("a12")  # a get of a key under it: nobody may drop it any more
    assert not tombs.covers("a12", 2.1) and len(tombs) == 0
    tombs.bury(3.0, key="a12", prefix="a", firm=True)  # a cleanup's: no get lifts it
    tombs.bury(3.1, key="a12")  # renewed without firm: still firm
    tombs.lift("a12")
    assert tombs.covers("a12", 3.2) and tombs.covers("a7", 3.2) and tombs.buried(3.2) == [("a12", None), (None, "a")]


def test_tombstones_past_their_bound_evict_the_one_that_lapses_first() -> None:
    tombs = Tombstones(ttl_s=1.0, max_count=2)
    tombs.bury(0.0, key="a")
    tombs.bury(0.1, prefix="p")
    tombs.bury(0.2, key="b")  # "a" lapses first: it goes
    assert len(tombs) == 2 and tombs.evicted == 1
    assert not tombs.covers("a", 0.3) and tombs.covers("p1", 0.3) and tombs.covers("b", 0.3)


_TOMB_OPS = st.lists(
    st.tuples(
        st.sampled_from(["bury_key", "bury_prefix", "bury_firm_key", "bury_firm_prefix", "arrive", "lift", "lapse"]),
        st.sampled_from(["k", "k1", "k12", "k1x", "1", ""]),
        st.floats(0.0, 0.7),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_TOMB_OPS, max_count=st.integers(1, 4))
def test_tombstones_match_a_model_of_buried_names(ops: list[tuple[str, str, float]], max_count: int) -> None:
    tombs = Tombstones(ttl_s=1.0, max_count=max_count)
    model: dict[tuple[str, str], float] = {}  # (kind, name) -> lapses at
    firm: set[tuple[str, str]] = set()  # those no lift removes
    now = 0.0

    def lay(kind: str, name: str) -> None:
        model.pop((kind, name), None)
        model[(kind, name)] = now + 1.0
        while len(model) > max_count:  # the oldest laid or renewed goes (the first, in insertion order)
            firm.discard(next(iter(model)))
            del model[next(iter(model))]

    def covering(key: str) -> tuple[str, str] | None:
        if model.get(("key", key), -1.0) > now:
            return ("key", key)
        live = [name for (kind, name), t in model.items() if kind == "prefix" and t > now and key_matches(key, name)]
        return ("prefix", max(live, key=len)) if live else None

    for op, name, dt in ops:
        now += dt
        if op == "bury_key":
            tombs.bury(now, key=name)
            lay("key", name)
        elif op == "bury_prefix":
            tombs.bury(now, prefix=name)
            lay("prefix", name)
        elif op.startswith("bury_firm_"):
            kind = op.removeprefix("bury_firm_")
            tombs.bury(now, firm=True, **{kind: name})
            lay(kind, name)
            firm.add((kind, name))
        elif op == "arrive":
            found = covering(name)
            assert tombs.covers(name, now) == (found is not None), (name, model)
            if found is not None:
                lay(*found)
        elif op == "lift":
            tombs.lift(name)
            for entry in [e for e in model if e == ("key", name) or (e[0] == "prefix" and key_matches(name, e[1]))]:
                if entry not in firm:
                    del model[entry]
        else:
            tombs.lapse(now)
            for entry in [e for e, t in model.items() if t <= now]:
                del model[entry]
                firm.discard(entry)
        assert len(tombs) <= max_count
        assert {n: covering(n) is not None for n in ("k", "k1", "k12", "1")} == {
            n: tombs._find(n, now) is not None for n in ("k", "k1", "k12", "1")
        }
