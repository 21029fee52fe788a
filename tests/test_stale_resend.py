"""A resend carries the receiver incarnation it was sent for; any other incarnation drops it.

The window this closes: a put arrives at a receiver, the sender (hearing that incarnation for
the first time) sends it again, and the receiver closes with that resend still queued in the
pipe of the sender's data socket; on reconnect the next incarnation, which holds no dedupe
state for it, would deliver it a second time. Here: the protocol fed tagged DATA and BATCH
directly (dropped and counted, or taken, and a malformed tag refused without raising), and a
real sender against a bare ROUTER playing two incarnations (its resend names the one it heard,
and what that one dropped is sent again once the next is heard). The live close and restart
loop is in tests/test_close_restart_tcp.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tests.conftest import bytes_protocol
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.metrics import Counters
from zmq_omni.transport._envelope import Kind, pack, unpack
from zmq_omni.transport._receive_protocol import ReceiveProtocol

SID = "s1"
IDENTITY = b"d" + SID.encode()
pytestmark = pytest.mark.timeout(60)


def _protocol(counters: Counters) -> ReceiveProtocol:
    return bytes_protocol(counters, endpoint="tcp://test", incarnation="new")


def _data(seq: int, *tag: Any) -> list[bytes]:
    return [pack(Kind.DATA, (SID, seq, 0, "0", "1", f"k{seq}", None, *tag), b"payload")]


def _batch(seqs: list[int], *tag: Any) -> list[bytes]:
    entries: list[Any] = []
    for seq in seqs:
        entries += [seq, "0", f"k{seq}", b"w"]
    return [pack(Kind.BATCH, (SID, 0, "1", entries, *tag))]


def _keys(protocol: ReceiveProtocol) -> list[str]:
    keys = [slot[2] for slot, _ in protocol.arrivals]
    protocol.arrivals = []
    return keys


def test_a_data_resent_for_another_incarnation_is_dropped_and_its_sender_told_this_incarnation() -> None:
    counters = Counters()
    protocol = _protocol(counters)
    assert protocol.receive(IDENTITY, _data(0, "old"), True, 1.0) is None
    assert _keys(protocol) == [] and protocol.sources[SID].is_new(0)
    assert counters.get("stale_resends_dropped") == 1 and counters.get("rejected_frames") == 0
    # Nothing acknowledged, but the sender is told this incarnation at the next flush, so it resends.
    assert protocol.schedule(1.0) is not None
    assert [unpack(reply.frame)[1][:4] for reply in protocol.flush()] == [["new", -1, [], []]]
    assert protocol.flush() == []  # told once
    # The resend the sender makes once it hears this incarnation is taken, once.
    assert protocol.receive(IDENTITY, _data(0, "new"), True, 2.0) == "k0"
    assert protocol.receive(IDENTITY, _data(0, "new"), True, 2.0) == "k0"
    assert _keys(protocol) == ["k0"] and counters.get("duplicates_dropped") == 1


def test_a_first_send_carries_no_incarnation_and_is_taken_by_any() -> None:
    counters = Counters()
    protocol = _protocol(counters)
    assert protocol.receive(IDENTITY, _data(0), True, 1.0) == "k0"
    assert _keys(protocol) == ["k0"]
    assert protocol.receive(IDENTITY, _data(0, "old"), True, 1.0) is None  # a stale resend of it: dropped
    assert _keys(protocol) == [] and counters.get("duplicates_dropped") == 0


def test_a_batch_resent_for_another_incarnation_is_dropped_whole() -> None:
    counters = Counters()
    protocol = _protocol(counters)
    protocol.receive(IDENTITY, _batch([0, 1, 2], "old"), True, 1.0)
    assert _keys(protocol) == [] and counters.get("stale_resends_dropped") == 3
    protocol.receive(IDENTITY, _batch([0, 1, 2], "new"), True, 2.0)
    assert _keys(protocol) == ["k0", "k1", "k2"]
    assert counters.get("rejected_frames") == 0


def test_a_shared_memory_handle_resent_for_another_incarnation_is_dropped_before_it_is_read() -> None:
    counters = Counters()
    protocol = _protocol(counters)  # no shm reader: a handle it read would be refused
    stale = [pack(Kind.DATA, (SID, 0, 0, "0", "1", "k0", b"a slot handle", "old"))]
    assert protocol.receive(IDENTITY, stale, True, 1.0) is None
    assert counters.get("stale_resends_dropped") == 1 and counters.get("rejected_frames") == 0
    current = [pack(Kind.DATA, (SID, 0, 0, "0", "1", "k0", b"a slot handle", "new"))]
    assert protocol.receive(IDENTITY, current, True, 1.0) is None  # read, and refused as before
    assert counters.get("rejected_frames") == 1 and _keys(protocol) == []


@pytest.mark.parametrize("tag", [None, 7, b"new", ["new"], True, {"a": 1}], ids=repr)
def test_a_malformed_incarnation_tag_is_refused_counted_and_never_raises(tag: Any) -> None:
    counters = Counters()
    protocol = _protocol(counters)
    for frames in (_data(0, tag), _batch([0, 1], tag), _data(1, "new", "extra")):
        assert protocol.receive(IDENTITY, frames, True, 1.0) is None
    assert _keys(protocol) == [] and protocol.sources == {}
    assert counters.get("rejected_frames") == 3 and counters.get("stale_resends_dropped") == 0


def test_a_malformed_batch_with_a_foreign_tag_is_refused_as_malformed_not_counted_as_a_stale_resend() -> None:
    counters = Counters()
    protocol = _protocol(counters)
    junk: list[Any] = [b"not a seq", 7, None, "x"] * 2
    frames = [pack(Kind.BATCH, (SID, 0, "1", junk, "old"))]
    assert protocol.receive(IDENTITY, frames, True, 1.0) is None
    assert counters.get("rejected_frames") == 1 and counters.get("stale_resends_dropped") == 0
    assert protocol.sources == {} and protocol.flush() == []  # no sender made up, no REPLY owed


# -- the sender, against a bare ROUTER that plays two receiver incarnations -------------------------------------
@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()
        ctx.term()


def _next_data(sock: zmq.Socket, deadline: float) -> tuple[bytes, list[Any]]:
    """The next DATA the ROUTER reads (PINGs skipped): its sender identity and header."""
    while time.monotonic() < deadline:
        if sock.poll(100):
            identity, *frames = sock.recv_multipart()
            kind, header, _ = unpack(frames[0])
            if kind is Kind.DATA:
                return identity, header
    raise AssertionError("no DATA came")


def _reply(sock: zmq.Socket, ctl: bytes, incarnation: str, arrived: list[list[int]], deadline: float) -> None:
    """Send a plain acknowledgement from ``incarnation`` to the sender's control socket, once it is connected."""
    frame = pack(Kind.REPLY, (incarnation, -1, arrived, [], None, 0))
    while True:
        try:
            sock.send_multipart([ctl, frame])
            return
        except zmq.ZMQError:  # not connected yet: unroutable
            assert time.monotonic() < deadline, "the control socket never connected"
            time.sleep(0.01)


def test_a_resend_names_the_incarnation_it_was_sent_for(router: tuple[zmq.Socket, str]) -> None:
    sock, endpoint = router
    sender = ZmqConnector(
        {
            "role": "sender",
            "from_stage": 0,
            "to_stage": 1,
            "endpoints": {"1": endpoint},
            "shm": "off",
            "heartbeat_s": 0.05,
        }
    )
    deadline = time.monotonic() + 20
    try:
        assert sender.put("0", "1", "k0", {"i": 0})[0]
        identity, first = _next_data(sock, deadline)
        assert len(first) == 7  # a first send: no incarnation
        ctl = b"c" + identity[1:]
        _reply(sock, ctl, "one", [[first[1], first[1]]], deadline)  # arrived at "one", not consumed
        _reply(sock, ctl, "two", [], deadline)  # a restart: everything unconsumed goes again, for "two"
        _, resent = _next_data(sock, deadline)
        assert resent[:7] == first and resent[7:] == ["two"]
        _reply(sock, ctl, "three", [], deadline)  # "two" closed with that resend queued: "three" dropped it
        _, again = _next_data(sock, deadline)
        assert again[:7] == first and again[7:] == ["three"]
        while sender.health()["resends"] < 2:  # counted by the I/O thread just after it sent
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sender.health()["resends"] == 2
    finally:
        sender.close()
