"""The chunk streams' rules (adapters/_streams.py) driven directly: no thread, socket or real clock.

A hypothesis state machine plays the scheduler, the save worker, the upstream
stage and the clock against one ``Streams`` and checks the invariants after
every step. Below it, one test per fix the chunk manager's history records,
each a single transition.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zmq_omni.adapters import ChunkManagerConfig
from zmq_omni.adapters._stream_types import NO_EFFECTS, Effects, RecvPhase, SendPhase
from zmq_omni.adapters._streams import Streams

STALL_S = 5.0
IDLE_S = 50.0
REQUESTS = ("a", "b", "c")


def config(**overrides: object) -> ChunkManagerConfig:
    """A middle stage (receives from 0, sends to 2) with small bounds."""
    values: dict[str, object] = {
        "stage_id": "1",
        "max_queued_chunks": 4,
        "max_ready_chunks": 3,
        "max_ready_bytes": 96,
        "stall_timeout_s": STALL_S,
        "idle_state_timeout_s": IDLE_S,
    }
    values.update(overrides)
    return ChunkManagerConfig(**values)  # type: ignore[arg-type]


def chunk(chunk_id: int, nbytes: int = 0, *, final: bool = False, cancelled: bool = False) -> dict[str, object]:
    """A chunk as it comes off the wire."""
    data = {"x": np.zeros(nbytes, np.uint8)} if nbytes else {}
    return {"meta": {"chunk_id": chunk_id, "final": final, "cancelled": cancelled}, "data": data}


class StreamsMachine(RuleBasedStateMachine):
    """Scheduler, save worker, upstream and clock against one ``Streams``."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.streams = Streams(config(), self.now)
        self.delivered: dict[str, list[tuple[int, bool]]] = defaultdict(list)  # prefix -> (chunk id, final) put
        self.given_up: set[str] = set()  # prefixes the connector was told to give up
        self.receive_failed: set[str] = set()
        self.cleaning: list[Effects] = []  # clean-ups decided, their I/O not yet reported done (the shell's gap)

    def apply(self, effects: Effects) -> None:
        for _key, prefix in effects.give_up:
            self.given_up.add(prefix)
        if effects.cleaned_prefixes:
            self.cleaning.append(effects)
        for request_id, _reason in effects.receive_failures:
            assert self.streams.receiving(request_id) is None, "a failed stream is still registered"
            self.receive_failed.add(request_id)

    # -- the clock -------------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.1, 1.0, STALL_S / 2, STALL_S * 2, IDLE_S]))
    def tick(self, dt: float) -> None:
        self.now += dt

    # -- the scheduler ---------------------------------------------------------------------------
    @rule(request=st.sampled_from(REQUESTS), final=st.booleans())
    def save(self, request: str, final: bool) -> None:
        phase = self.streams.send_phase(request)
        try:
            stream = self.streams.open_send(request, None, self.now)
        except ValueError:
            assert phase in (SendPhase.ENDED, SendPhase.ENDING)
            return
        if stream is None:
            assert phase in (SendPhase.CANCELLING, SendPhase.CANCELLED, SendPhase.FAILED)
            return
        if self.streams.queue_full():
            self.apply(self.streams.refuse(stream, "save queue full"))
            assert self.streams.send_phase(request) is SendPhase.FAILED
            return
        self.streams.queue_chunk(stream, {"n": 1}, final, None, self.now)

    @rule(request=st.sampled_from(REQUESTS), notify=st.sampled_from([None, True, False]))
    def cancel(self, request: str, notify: bool | None) -> None:
        before = self.streams.send_phase(request)
        self.apply(self.streams.cancel(request, notify, self.now))
        after = self.streams.send_phase(request)
        if before is SendPhase.ENDING:
            assert after is SendPhase.ENDING  # the final chunk already queued goes through
        assert self.streams.receiving(request) is None

    @rule(request=st.sampled_from(REQUESTS))
    def release(self, request: str) -> None:
        self.apply(self.streams.release(request, self.now))
        assert self.streams.receiving(request) is None

    @rule()
    def sweep(self) -> None:
        self.apply(self.streams.sweep(self.now))

    # -- the save worker -------------------------------------------------------------------------
    @rule(ok=st.booleans())
    def put_next(self, ok: bool) -> None:
        item = self.streams.queue.take_next()
        if item is None:
            return
        assert self.streams.queue.in_flight is item
        if self.streams.begin_put(item) and ok:
            self.delivered[item.key.rstrip("0123456789")].append((item.chunk_id, item.final))
            self.streams.put_done(item, True, self.now)
        else:
            self.streams.put_done(item, False, self.now)
            if not ok:
                self.apply(self.streams.send_failed(item.request_id))
        assert self.streams.queue.in_flight is None

    # -- the receive side ------------------------------------------------------------------------
    @rule(request=st.sampled_from(REQUESTS), whole=st.booleans())
    def load(self, request: str, whole: bool) -> None:
        effects = self.streams.open_receive(request, None, whole, self.now)
        if effects is None:  # a reused id: the shell waits until its old stream's clean-up is done
            assert self.streams.receiving(request) is None and self.streams.cleaning(f"{request}_0_")
            return
        stream = self.streams.receiving(request)
        assert stream is not None and stream.prefix == f"{request}_0_"
        self.apply(effects)

    @precondition(lambda self: self.cleaning)
    @rule(index=st.integers(0, 7))
    def clean_up_done(self, index: int) -> None:
        effects = self.cleaning.pop(index % len(self.cleaning))
        freed = self.streams.cleaned(effects)
        still = {prefix for pending in self.cleaning for prefix in pending.cleaned_prefixes}
        assert freed == any(prefix not in still for prefix in effects.cleaned_prefixes)

    @rule(
        request=st.sampled_from(REQUESTS),
        nbytes=st.sampled_from([0, 16, 40]),
        final=st.booleans(),
        bad=st.booleans(),
    )
    def arrive(self, request: str, nbytes: int, final: bool, bad: bool) -> None:
        stream = self.streams.receiving(request)
        if stream is None or stream.phase is not RecvPhase.READING or stream not in self.streams.readable(self.now):
            return  # the worker reads only readable streams
        key = stream.next_key
        before = stream.next_chunk_id
        go_on, effects = self.streams.commit(key, chunk(before + 7 if bad else before, nbytes, final=final), self.now)
        self.apply(effects)
        if bad:
            assert not go_on and request in self.receive_failed
        elif final:
            assert not go_on and stream.phase is RecvPhase.ENDED and effects.cleanup == (stream.prefix,)
        else:
            assert go_on and stream.next_chunk_id == before + 1 and stream.last_progress == self.now
        self.apply(self.streams.after_get(key))
        assert self.streams.reads_on(stream) == (go_on and not self.streams.at_bound(stream))

    @rule(request=st.sampled_from(REQUESTS))
    def take(self, request: str) -> None:
        stream = self.streams.receiving(request)
        taken, _resume = self.streams.take(request)
        if taken is not None and taken.final:
            assert self.streams.receiving(request) is None
        if stream is not None and taken is not None:
            assert not stream.ready and stream.ready_bytes == 0

    @rule()
    def scan(self) -> None:
        readable, effects = self.streams.scan(self.now)
        self.apply(effects)
        for stream in readable:
            assert self.now - stream.last_progress <= STALL_S, "a stalled stream was left readable"
            assert not self.streams.at_bound(stream)

    @precondition(lambda self: self.streams.receiving("a") is not None)
    @rule()
    def get_after_give_up(self) -> None:
        stream = self.streams.receiving("a")
        assert stream is not None
        key = stream.next_key
        self.apply(self.streams.cancel("a", False, self.now))
        # The worker's get of ``key`` ran across the cancel: its stream is buried again.
        effects = self.streams.after_get(key)
        assert effects.give_up == ((key, stream.prefix),)
        self.apply(effects)

    @rule(blocking=st.booleans())
    def cancel_while_the_worker_reads(self, blocking: bool) -> None:
        if blocking:
            key = self.streams.next_target(self.now)
            reading = [] if key is None else [key.rstrip("0123456789")]
        else:
            readable, effects = self.streams.scan(self.now)
            self.apply(effects)
            reading = [stream.prefix for stream in readable]
        for prefix in reading:
            request = prefix.split("_")[0]
            self.apply(self.streams.cancel(request, None, self.now))
            assert self.streams.open_receive(request, None, False, self.now) is None  # its keys may be read
        if blocking and key is not None:
            self.apply(self.streams.after_get(key))
        else:
            self.streams.end_pass()

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def no_clean_up_in_flight_reaches_a_live_stream(self) -> None:
        for request in REQUESTS:
            stream = self.streams.receiving(request)
            if stream is not None and stream.phase is not RecvPhase.ENDED:
                assert not self.streams.cleaning(stream.prefix), "a clean-up in flight would drop its chunks"

    @invariant()
    def ready_bytes_add_up(self) -> None:
        total = sum(s.ready_bytes for r in REQUESTS if (s := self.streams.receiving(r)) is not None)
        assert self.streams.ready_bytes == total >= 0

    @invariant()
    def queued_chunks_belong_to_live_streams(self) -> None:
        cancel_markers = 0
        for item in self.streams.queue:
            assert self.streams.send_phase(item.request_id) in (SendPhase.OPEN, SendPhase.ENDING, SendPhase.CANCELLING)
            cancel_markers += item.cancelled
        assert len(self.streams.queue) <= self.streams.config.max_queued_chunks + cancel_markers

    @invariant()
    def each_stream_is_delivered_gapless_and_ends_once(self) -> None:
        for prefix, sent in self.delivered.items():
            ids = [chunk_id for chunk_id, _ in sent]
            assert ids == list(range(len(ids))), (prefix, sent)
            assert all(not final for _, final in sent[:-1]), (prefix, sent)

    @invariant()
    def paused_streams_hold_untaken_chunks(self) -> None:
        for request in REQUESTS:
            stream = self.streams.receiving(request)
            if stream is not None and stream.phase is RecvPhase.PAUSED:
                assert stream.ready and stream.paused_at is not None and stream.paused_at <= self.now


TestStreamsMachine = StreamsMachine.TestCase
TestStreamsMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- one test per fix in the chunk manager's history ------------------------------------------------------------
def test_re_bury_a_stream_given_up_while_its_get_ran() -> None:
    """7ce6e7c: a get lifts the tombstones a cancel laid while it ran; the stream is buried again after it."""
    streams = Streams(config(), 0.0)
    streams.open_receive("r", None, False, 0.0)
    stream = streams.receiving("r")
    assert stream is not None
    key = stream.next_key  # the receive worker chose this key, then its get runs ...
    assert streams.after_get(key) is NO_EFFECTS  # ... (still receiving: nothing to do)
    given_up = streams.cancel("r", None, 0.0)  # ... while the scheduler cancels
    assert given_up.give_up == ((key, "r_0_"),)
    assert streams.after_get(key).give_up == ((key, "r_0_"),)


def test_a_paused_streams_stall_clock_stops() -> None:
    """d0cf36e: time spent at max_ready_chunks (waiting for the scheduler) is not a stall of the upstream."""
    streams = Streams(config(max_ready_chunks=1), 0.0)
    streams.open_receive("r", None, False, 0.0)
    stream = streams.receiving("r")
    assert stream is not None
    streams.commit("r_0_0", chunk(0, 8), 1.0)
    readable, _ = streams.scan(2.0)
    assert readable == [] and stream.phase is RecvPhase.PAUSED and stream.paused_at == 2.0
    readable, effects = streams.scan(2.0 + 10 * STALL_S)  # the scheduler is slow, not the upstream
    assert readable == [] and effects.receive_failures == ()
    taken, resume = streams.take("r")
    assert taken is not None and resume
    readable, effects = streams.scan(2.0 + 10 * STALL_S)
    assert readable == [stream] and stream.phase is RecvPhase.READING and effects is NO_EFFECTS
    assert stream.last_progress == 1.0 + 10 * STALL_S  # moved on by the pause
    _, effects = streams.scan(1.0 + 11 * STALL_S + 0.1)
    assert [rid for rid, _ in effects.receive_failures] == ["r"]


def test_cancel_after_the_final_chunk_lets_it_through() -> None:
    """vllm-omni #6670: a cancel once the final chunk is queued must not lose it (the next stage would hang)."""
    streams = Streams(config(), 0.0)
    stream = streams.open_send("r", None, 0.0)
    assert stream is not None
    streams.queue_chunk(stream, {"n": 0}, False, None, 0.0)
    streams.queue_chunk(stream, {"n": 1}, True, None, 0.0)
    assert streams.cancel("r", None, 0.0) is NO_EFFECTS
    assert streams.send_phase("r") is SendPhase.ENDING
    assert [(item.chunk_id, item.final, item.cancelled) for item in streams.queue] == [
        (0, False, False),
        (1, True, False),
    ]
    # Before the final chunk, a cancel drops what is queued and ends the stream in its place.
    other = streams.open_send("o", None, 0.0)
    assert other is not None
    streams.queue_chunk(other, {"n": 0}, False, None, 0.0)
    streams.queue_chunk(other, {"n": 1}, False, None, 0.0)
    effects = streams.cancel("o", None, 0.0)
    assert len(effects.released) == 2 and effects.queued and effects.room
    marker = streams.queue[-1]
    assert (marker.key, marker.final, marker.cancelled) == ("o_1_0", True, True)
    assert streams.send_phase("o") is SendPhase.CANCELLING


def test_idle_state_ages_out() -> None:
    """b388b9f, 720696b: idle state is forgotten or cancelled; a middle stage still receiving is left alone."""
    streams = Streams(config(), 0.0)
    open_stream = streams.open_send("open", None, 0.0)
    assert open_stream is not None
    streams.queue_chunk(open_stream, {"n": 0}, False, None, 0.0)
    item = streams.queue.take_next()
    assert item is not None and streams.put_done(item, True, 0.0) is False
    failed = streams.open_send("failed", None, 0.0)
    assert failed is not None
    streams.send_failed("failed")
    streams.open_receive("untaken", None, False, 0.0)
    streams.commit("untaken_0_0", chunk(0, 8, final=True), 0.0)
    middle = streams.open_send("middle", None, 0.0)  # a middle stage: sends and still receives the request
    assert middle is not None
    streams.open_receive("middle", None, False, 0.0)
    assert not streams.sweep_due(0.1)
    assert streams.sweep(IDLE_S - 1) is NO_EFFECTS
    effects = streams.sweep(IDLE_S)
    assert [rid for rid, _ in effects.abandoned] == ["open"] and "no chunk queued" in effects.abandoned[0][1]
    assert streams.send_phase("open") is SendPhase.CANCELLING and streams.queue[-1].cancelled
    assert sorted(effects.expired) == ["failed", "untaken"] and effects.expired_received == ("untaken",)
    assert streams.send_phase("failed") is SendPhase.ENDED  # forgotten, its id still used
    assert streams.refusal("failed") is not None
    assert streams.receiving("untaken") is None
    assert streams.send_phase("middle") is SendPhase.OPEN  # bounded by its stall timeout instead


def test_a_reused_id_is_refused() -> None:
    """4c89193: once a request's stream ended (or while it ends), its id cannot start another."""
    streams = Streams(config(), 0.0)
    stream = streams.open_send("r", None, 0.0)
    assert stream is not None and streams.refusal("r") is None
    streams.queue_chunk(stream, {}, True, None, 0.0)
    assert streams.refusal("r") == "request 'r' is ending its stream"
    with pytest.raises(ValueError, match="chunk after the final one"):
        streams.open_send("r", None, 0.0)
    item = streams.queue.take_next()
    assert item is not None and streams.begin_put(item)
    assert streams.put_done(item, True, 1.0) is True
    assert streams.send_phase("r") is SendPhase.ENDED
    assert streams.refusal("r") == "request 'r' already ended its stream"
    with pytest.raises(ValueError, match="already ended its stream"):
        streams.open_send("r", None, 2.0)
    streams.release("released", 0.0)
    assert streams.refusal("released") is None  # nothing was ever streamed under it


def test_giving_up_a_stream_abandons_its_next_key() -> None:
    """3e42d01: a stream given up tells the connector the key it waited for and its prefix."""
    streams = Streams(config(), 0.0)
    streams.open_receive("r", "ext", False, 0.0)
    streams.commit("ext_0_0", chunk(0), 0.0)
    for give_up in (lambda: streams.release("r", 0.0), lambda: streams.scan(STALL_S + 1)[1]):
        streams.open_receive("r", "ext", False, 0.0)
        effects = give_up()
        assert effects.give_up in ((("ext_0_1", "ext_0_"),), (("ext_0_0", "ext_0_"),))
        assert streams.receiving("r") is None
        assert streams.cleaned(effects)


def test_a_reused_id_waits_for_its_old_streams_clean_up() -> None:
    """The shell cleans up a given-up stream's keys after its lock: a new stream under them waits for that."""
    streams = Streams(config(), 0.0)
    streams.open_receive("r", None, False, 0.0)
    streams.commit("r_0_0", chunk(0, 8), 0.0)
    cancelled = streams.cancel("r", None, 1.0)
    assert cancelled.give_up == (("r_0_1", "r_0_"),) and streams.cleaning("r_0_")
    assert streams.open_receive("r", None, False, 1.0) is None  # deferred: nothing registered
    assert streams.receiving("r") is None and streams.is_ready("r")
    assert streams.open_receive("other", None, False, 1.0) is not None  # other prefixes are not held up
    # The worker's get of r_0_1 ran across the cancel: a second clean-up of the same prefix.
    buried = streams.after_get("r_0_1")
    assert streams.cleaned(cancelled) is False  # one still in flight
    assert streams.open_receive("r", None, True, 2.0) is None
    assert streams.cleaned(buried) is True and not streams.cleaning("r_0_")
    assert streams.open_receive("r", None, False, 2.0) is not None
    stream = streams.receiving("r")
    assert stream is not None and stream.next_key == "r_0_0" and stream.phase is RecvPhase.READING
    # A stream that ended normally: its final chunk's clean-up holds a reopen back the same way.
    go_on, ended = streams.commit("r_0_0", chunk(0, final=True), 3.0)
    assert not go_on and ended.cleanup == ("r_0_",)
    taken, _ = streams.take("r")
    assert taken is not None and taken.final
    assert streams.open_receive("r", None, False, 3.0) is None
    assert streams.cleaned(ended)
    assert streams.open_receive("r", None, False, 3.0) is not None


def test_a_reused_id_waits_for_the_receive_worker_to_leave_its_old_keys() -> None:
    """The worker may still get a given-up stream's keys (its pass, its blocking get): a reopen waits for it."""
    streams = Streams(config(), 0.0)
    streams.open_receive("r", None, False, 0.0)
    old = streams.receiving("r")
    readable, _ = streams.scan(0.0)  # the worker's pass reads r_0_0 without the lock ...
    assert readable == [old] and old is not None and streams.reads_on(old)
    cancelled = streams.cancel("r", None, 1.0)
    assert streams.cleaned(cancelled) and not streams.cleaning("r_0_")  # ... its clean-up is done, the pass is not
    assert not streams.reads_on(old)  # the worker reads a given-up stream no further
    assert streams.open_receive("r", None, False, 1.0) is None
    streams.end_pass()  # anything it took meanwhile was put before the reopen
    assert streams.open_receive("r", None, False, 1.0) is not None
    new = streams.receiving("r")
    assert new is not None and new is not old
    # The blocking get after a pass without progress holds the keys the same way, until after_get.
    assert streams.next_target(2.0) == "r_0_0"
    assert streams.cleaned(streams.cancel("r", None, 2.0))
    assert streams.open_receive("r", None, False, 2.0) is None  # the get is still out
    assert streams.cleaned(streams.after_get("r_0_0"))  # back, and the given-up stream buried again
    assert streams.open_receive("r", None, False, 2.0) is not None


def test_a_save_waiting_for_room_stops_when_its_request_does() -> None:
    """720696b / b388b9f: a full queue refuses a chunk after its wait (a stream cannot have a hole)."""
    streams = Streams(config(max_queued_chunks=1), 0.0)
    stream = streams.open_send("r", None, 0.0)
    assert stream is not None
    streams.queue_chunk(stream, {"n": 0}, False, None, 0.0)
    assert streams.queue_full() and streams.may_wait(stream)
    streams.cancel("r", None, 0.0)
    assert not streams.may_wait(stream)
    assert streams.refuse(stream, "full") is NO_EFFECTS  # cancelled meanwhile: nothing more to report
    other = streams.open_send("o", None, 0.0)
    assert other is not None
    effects = streams.refuse(other, "save queue full")
    assert effects.send_failures == (("o", "save queue full"),) and streams.send_phase("o") is SendPhase.FAILED
