"""Structure-aware fuzz of the transport over real sockets: no mutated message breaks an I/O thread.

Each example is a few messages built from valid templates of every message
kind, with header fields replaced, added or dropped, the kind number and the
payload swapped, extra frames attached and now and then the frame cut short.
They go to a live peer: a push receiver, a pull server, a push sender's
control socket (as if from its receiver) or a pull client (as if from its
server). The peer must reject or handle each one without its I/O loop logging
a handler failure (the sign of an exception other than the ones the protocol
code expects), a pull client's ``get`` must return rather than raise, and
every peer must still serve real traffic afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.shm import SlotHandle
from zmq_omni.transport._envelope import _PREAMBLE, MAGIC, VERSION, Kind, pack, unpack
from zmq_omni.wire import encode

from .conftest import wait_until
from .test_zmq_failures import connectors, make

__all__ = ["connectors"]  # the fixture, imported for pytest

FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    # One live peer serves every example of a test, on purpose: state left by earlier messages is part of the fuzz.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

WIRE = encode({"x": 1})[0]
BIG = encode({"a": np.zeros(8192)})  # frame 0 refers to one out-of-band frame
HANDLE = SlotHandle("zomni-0-0-feed", 7, ((0, 64),)).pack()


def _nested(levels: int) -> Any:
    value: Any = None
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


# Depth and breadth extremes: one past the header depth limit (32) and far past it (msgpack's packer nests at
# most 512 deep; tests/test_hostile_input.py sends 1,000 and 10,000), and wider than any legitimate field.
EXTREMES = [_nested(33), _nested(400), list(range(5000)), {str(i): i for i in range(2000)}]

atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 10**12]),
    st.floats(allow_nan=True),
    st.text(max_size=70),
    st.sampled_from(["", "0", "1", "k", "sid", "x" * 65]),
    st.binary(max_size=64),
    st.sampled_from([WIRE, b"", b"\x00" * 40, HANDLE, HANDLE[:-3]]),
    st.sampled_from(EXTREMES),
)
values = st.recursive(
    atoms,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
# Acknowledged seq runs: mostly valid ``[first, last]`` pairs (so replies get past the range checks into the
# sender's bookkeeping), now and then a malformed or absurd one.
valid_run = st.tuples(st.integers(0, 500), st.integers(0, 20)).map(lambda run: [run[0], run[0] + run[1]])
any_run = st.lists(st.integers(-3, 500) | st.just(10**12), max_size=3)
seq_ranges = st.lists(st.one_of(valid_run, valid_run, valid_run, any_run), max_size=4)


def templates() -> dict[Kind, list[Any]]:
    """A valid header of every kind (fresh lists: the fuzz mutates them)."""
    return {
        Kind.DATA: ["sid", 5, 0, "0", "1", "k", None],
        Kind.BATCH: ["sid", 0, "1", [0, "0", "a", WIRE, 1, "0", "b", WIRE]],
        Kind.PING: ["sid", 1, 0, ["zomni-0-0-feed", b"\x00" * 16]],
        Kind.HEALTH: [],
        Kind.FETCH: [1, "0", "1", "k", 0, False],
        Kind.REPLY: ["inc", -1, [[0, 1]], [], True, 1000],
        Kind.FETCH_REPLY: [1, True, None, HANDLE],
        Kind.HEALTH_REPLY: [{}],
    }


@st.composite
def mutated(draw: st.DrawFn, kinds: list[Kind], header_of: Any = None) -> list[bytes]:
    """One message: a template of one of ``kinds`` with a few fields changed, as ZeroMQ frames."""
    kind = draw(st.sampled_from(kinds))
    header = header_of(draw, kind) if header_of else list(templates()[kind])
    if draw(st.integers(0, 5)) == 0 or not header:
        header = draw(st.lists(values, max_size=8))
    else:
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(header)))
            if i < len(header):
                header[i] = draw(values)
            elif draw(st.booleans()):
                header.append(draw(values))
            else:
                header.pop()
            if not header:
                break
    if kind is Kind.BATCH and len(header) == 4 and isinstance(header[3], list) and header[3] and draw(st.booleans()):
        header[3][draw(st.integers(0, len(header[3]) - 1))] = draw(values)  # one field of one put
    body = msgpack.packb(header, use_bin_type=True)
    kind_no = draw(st.sampled_from([int(kind)] * 8 + [0, 9, 255]))
    payload = draw(st.sampled_from([b"", WIRE, bytes(BIG[0]), b"junk"]))
    frame = _PREAMBLE.pack(MAGIC, VERSION, kind_no, len(body)) + body + payload
    if draw(st.integers(0, 9)) == 0:
        frame = frame[: draw(st.integers(0, len(frame)))]
    extra = draw(st.lists(st.sampled_from([b"", b"x" * 10, bytes(BIG[1])]), max_size=2))
    return [frame, *extra]


class LoopErrors(logging.Handler):
    """Collects what the transport logs at ERROR: an I/O loop's handler failing logs there."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def check(self, what: Any) -> None:
        if self.records:
            record = self.records[0]
            self.records.clear()
            raise AssertionError(f"{record.getMessage()}\n{record.exc_text or ''}\nafter {what!r:.2000}")


@pytest.fixture
def loop_errors() -> Iterator[LoopErrors]:
    handler = LoopErrors()
    logger = logging.getLogger("zmq_omni")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def fuzz_peer(endpoint: str, zmq_ctx: zmq.Context[Any], loop_errors: LoopErrors, sync: bytes, answer: Kind) -> None:
    """Send each example's mutated messages to ``endpoint``, then ``sync``, and wait for its ``answer``.

    The peer answers in order, so once ``answer`` comes, every message before it was handled.
    """
    attacker = zmq_ctx.socket(zmq.DEALER)
    attacker.connect(endpoint)

    @FUZZ
    @given(st.lists(mutated(list(Kind)), min_size=1, max_size=5))
    def run(messages: list[list[bytes]]) -> None:
        for frames in messages:
            attacker.send_multipart(frames)
        attacker.send(sync)
        while True:
            assert attacker.poll(5000), "no answer: the peer's I/O thread is stuck or dead"
            if unpack(attacker.recv_multipart()[0])[0] is answer:
                break
        loop_errors.check(messages)

    run()


def test_push_receiver_survives_mutated_messages(
    connectors: list[ZmqConnector], loop_errors: LoopErrors, zmq_ctx: zmq.Context[Any]
) -> None:
    receiver = make(connectors, stage_id="1", role="receiver", endpoints={"1": "tcp://127.0.0.1:0"})
    assert receiver.endpoint is not None
    fuzz_peer(receiver.endpoint, zmq_ctx, loop_errors, pack(Kind.HEALTH, ()), Kind.HEALTH_REPLY)
    assert receiver.health()["rejected_frames"] > 0 and receiver.health()["status"] == "ok"
    sender = make(connectors, stage_id="0", role="sender", endpoints={"1": receiver.endpoint})
    assert sender.put("0", "1", "after", {"ok": True})[0]
    got = receiver.get_with_deadline("0", "1", "after", deadline=time.monotonic() + 5)
    assert got is not None and got[0] == {"ok": True}


def test_pull_server_survives_mutated_messages(
    connectors: list[ZmqConnector], loop_errors: LoopErrors, zmq_ctx: zmq.Context[Any]
) -> None:
    server = make(connectors, stage_id="0", role="sender", mode="pull", endpoints={"0": "tcp://127.0.0.1:0"})
    assert server.endpoint is not None
    for key in ("k", "a", "b"):
        assert server.put("0", "1", key, {"key": key})[0]
    absent = pack(Kind.FETCH, (2**40, "0", "1", "never-put", 0))  # answered at once: "not found"
    fuzz_peer(server.endpoint, zmq_ctx, loop_errors, absent, Kind.FETCH_REPLY)
    assert server.health()["rejected_frames"] > 0 and server.health()["status"] == "ok"
    assert server.put("0", "1", "after", {"ok": True})[0]
    client = make(connectors, stage_id="1", role="receiver", mode="pull", endpoints={"0": server.endpoint})
    got = client.get_with_deadline("0", "1", "after", deadline=time.monotonic() + 5)
    assert got is not None and got[0] == {"ok": True}


CURRENT = "inc0000000"  # stands for the incarnation the sender knows; same length as every incarnation sent


def incarnation(n: int) -> str:
    return f"inc{n:07d}"


def _reply_header(draw: st.DrawFn, kind: Kind) -> list[Any]:
    """Replies whose acknowledgement ranges name seqs the sender really holds, or none, or absurd ones."""
    header = list(templates()[kind])
    if kind is Kind.REPLY:
        # Mostly the receiver's current incarnation (filled in when sent), now and then a "restarted" receiver.
        header[0] = draw(st.sampled_from([CURRENT, CURRENT, "other"]))
        header[1] = draw(st.sampled_from([-1, 0, 1, 2, 1000]))
        header[2], header[3] = draw(seq_ranges), draw(seq_ranges)
    return header


def fake_peer(zmq_ctx: zmq.Context[Any]) -> tuple[zmq.Socket[bytes], str]:
    """A ROUTER on a random loopback port, standing in for a connector's peer, and its endpoint."""
    sock = zmq_ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises (see send_to) instead of a silent drop
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def send_to(router: zmq.Socket[bytes], frames: list[bytes], timeout_s: float = 10.0) -> None:
    """Send ``frames`` (the peer's identity first) once that peer has connected.

    A connector's sockets connect on their own schedule, late under load; a ROUTER without
    ROUTER_MANDATORY would drop what it sends before then, and the test would wait for an answer in vain.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            router.send_multipart(frames)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_push_sender_survives_mutated_replies(
    connectors: list[ZmqConnector], loop_errors: LoopErrors, zmq_ctx: zmq.Context[Any]
) -> None:
    fake, endpoint = fake_peer(zmq_ctx)  # the receiver: the sender's data and control sockets connect here
    sender = make(
        connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, heartbeat_s=0.05, delivery_timeout_s=60.0
    )
    assert sender.put("0", "1", "first", {"n": 0})[0]
    assert fake.poll(5000)
    data_identity = fake.recv_multipart()[0]
    control = b"c" + data_identity[1:]  # the sender names its two sockets "d<sid>" and "c<sid>"
    marker = [0]

    @FUZZ
    @given(st.lists(mutated([Kind.REPLY] * 6 + [Kind.FETCH_REPLY, Kind.HEALTH_REPLY], _reply_header), max_size=4))
    def run(replies: list[list[bytes]]) -> None:
        marker[0] += 1
        assert sender.put("0", "1", f"m{marker[0]}", {"n": marker[0]})[0]
        current = incarnation(marker[0] - 1).encode()
        for frames in replies:
            send_to(fake, [control, frames[0].replace(CURRENT.encode(), current), *frames[1:]])
        # Control messages are handled in order: once this ack of every put so far is, so were the replies
        # above. Its incarnation is new, so the next example's replies have a known current one to be from.
        ack = pack(Kind.REPLY, (incarnation(marker[0]), -1, [], [[0, marker[0]]], False, 1000))
        send_to(fake, [control, ack])
        assert wait_until(lambda: sender.health()["pending"] == 0, 5), sender.health()
        while fake.poll(0):
            fake.recv_multipart()  # what the sender sent meanwhile (puts, resends, pings)
        loop_errors.check(replies)

    try:
        run()
    finally:
        fake.close(linger=0)
    assert sender.health()["rejected_frames"] > 0 and sender.health()["status"] == "ok"


def test_pull_client_get_returns_whatever_its_server_answers(
    connectors: list[ZmqConnector], loop_errors: LoopErrors, zmq_ctx: zmq.Context[Any]
) -> None:
    # A fake server answers each FETCH with the next mutated reply, carrying the FETCH's own req_id
    # most of the time (a wrong one is ignored, and the get then times out: that path is fuzzed too).
    fake, endpoint = fake_peer(zmq_ctx)
    client = make(
        connectors, stage_id="1", role="receiver", mode="pull", endpoints={"0": endpoint}, fetch_timeout_s=0.2
    )
    answers: list[tuple[bool, list[bytes]]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not fake.poll(20):
                continue
            identity, frame, *_ = fake.recv_multipart()
            _, request, _ = unpack(frame)
            keep_id, frames = answers.pop(0) if answers else (True, [pack(Kind.FETCH_REPLY, (0, False))])
            head = frames[0]
            if keep_id:  # put the real req_id in front of whatever header the fuzz made
                kind, header, payload = unpack(head) if _parses(head) else (None, None, None)
                if kind is Kind.FETCH_REPLY and header:
                    header[0] = request[0]
                    head = pack(Kind.FETCH_REPLY, header, bytes(payload))
            fake.send_multipart([identity, head, *frames[1:]])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:

        @FUZZ
        @given(st.lists(st.tuples(st.integers(0, 9).map(bool), mutated([Kind.FETCH_REPLY])), min_size=1, max_size=3))
        def run(replies: list[tuple[bool, list[bytes]]]) -> None:
            answers[:] = replies
            for _ in replies:
                client.get("0", "1", "k")  # returns (obj, nbytes) or None; raising is the bug
            client.drain_failures()
            loop_errors.check(replies)

        run()
    finally:
        stop.set()
        server.join(5)
        fake.close(linger=0)
    assert not server.is_alive()


def _parses(frame: bytes) -> bool:
    try:
        unpack(frame)
    except Exception:
        return False
    return True
