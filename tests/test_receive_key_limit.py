"""A key longer than ``max_key_bytes`` is refused and counted; the tombstone lookup is linear in the key.

The lookup is shown by counting the tombstones it asks for (never timed): one per
distinct buried prefix length, not one per trailing digit of the key. The protocol
is fed DATA and BATCH frames with an over-long key directly. Then live sockets: a raw
pyzmq DEALER sends 300,000-character keys under a live prefix tombstone (the state a
streaming stage is in after each stream's end) beside a real sender whose put->get
keeps working, and the refusals are counted.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.conftest import bytes_protocol
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import DecodeError
from zmq_omni.metrics import Counters
from zmq_omni.transport._envelope import DEFAULT_MAX_KEY_BYTES, Kind, check_key, pack
from zmq_omni.transport._receive_protocol import ReceiveProtocol
from zmq_omni.transport._tombstones import Tombstones
from zmq_omni.wire import encode

from .conftest import wait_until

WIRE = encode({"x": 1})[0]


class _CountingDict(dict[tuple[int, str], float]):
    """The tombstones' table, counting the lookups made in it."""

    lookups = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.lookups += 1
        return super().get(key, default)


def test_a_lookup_asks_once_per_distinct_buried_prefix_length() -> None:
    tombs = Tombstones(ttl_s=10.0, max_count=100)
    tombs.bury(0.0, prefix="stream_0_")
    tombs.bury(0.0, prefix="other_1_")  # another length
    tombs.bury(0.0, prefix="again_0_")  # the same length as "other_1_"
    counting = _CountingDict(tombs.entries)
    tombs.entries = counting
    key = "stream_0_" + "7" * 300_000
    assert tombs.covers(key, 1.0)
    assert counting.lookups <= 1 + 2  # the key itself, then at most one per distinct prefix length
    counting.lookups = 0
    assert not tombs.covers("elsewhere_" + "3" * 300_000, 1.0)
    assert counting.lookups <= 1 + 2
    counting.lookups = 0
    assert not tombs.covers("x" * 300_000, 1.0)  # no digit at its end: no prefix is even cut
    assert counting.lookups == 1


def test_the_lookup_follows_the_prefix_rule_at_every_buried_length() -> None:
    tombs = Tombstones(ttl_s=10.0, max_count=100)
    tombs.bury(0.0, prefix="a")
    tombs.bury(0.0, prefix="a1")
    tombs.bury(0.0, prefix="")
    assert tombs.covers("a12", 1.0) and tombs.covers("a1", 1.0) and tombs.covers("123", 1.0)
    assert not tombs.covers("a", 1.0) and not tombs.covers("a1x", 1.0) and not tombs.covers("b1", 1.0)
    tombs.lift("a12")  # a get: every tombstone covering it goes ("a1", "a"; "" does not cover "a12")
    assert not tombs.covers("a12", 1.0) and tombs.buried(1.0) == [(None, "")]
    assert tombs.covers("77", 1.0)


def test_check_key_measures_utf8_bytes() -> None:
    check_key("k" * 64, 64)
    check_key("é" * 32, 64)  # 64 bytes
    with pytest.raises(DecodeError):
        check_key("k" * 65, 64)
    with pytest.raises(DecodeError):
        check_key("é" * 33, 64)  # 33 characters, 66 bytes
    check_key("x" * DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_KEY_BYTES)


def _protocol(counters: Counters, max_key_bytes: int) -> ReceiveProtocol:
    return bytes_protocol(counters, max_key_bytes=max_key_bytes)


def test_the_protocol_refuses_a_long_key_in_a_data_and_alone_in_a_batch() -> None:
    counters = Counters()
    protocol = _protocol(counters, 16)
    protocol.receive(b"ds", [pack(Kind.DATA, ["s", 1, 0, "0", "1", "k" * 17, None], b"x")], True, 0.0)
    assert protocol.arrivals == [] and counters.get("rejected_keys") == 1 and counters.get("rejected_frames") == 1
    protocol.receive(b"ds", [pack(Kind.DATA, ["s", 2, 0, "0", "1", "k" * 16, None], b"x")], True, 0.0)
    assert [slot for slot, _ in protocol.arrivals] == [("0", "1", "k" * 16)]
    protocol.arrivals = []
    batch = pack(Kind.BATCH, ["s", 0, "1", [3, "0", "short", b"a", 4, "0", "é" * 9, b"b", 5, "0", "fine", b"c"]])
    protocol.receive(b"ds", [batch], True, 0.0)
    assert [slot[2] for slot, _ in protocol.arrivals] == ["short", "fine"]
    assert counters.get("rejected_keys") == 2 and counters.get("rejected_frames") == 2


def test_long_keys_from_a_raw_peer_are_refused_while_real_puts_keep_flowing(
    short_tmp: Path, zmq_ctx: zmq.Context[Any]
) -> None:
    common = {"endpoints": {"1": f"ipc://{short_tmp}/keys.sock"}, "shm": "off"}
    with ExitStack() as stack:
        rconn = stack.enter_context(ZmqConnector({"stage_id": "1", "role": "receiver", **common}))
        sconn = stack.enter_context(ZmqConnector({"stage_id": "0", "role": "sender", **common}))
        assert rconn.get("0", "1", "warm") is None  # binds
        assert rconn.endpoint is not None
        rconn.cleanup_prefix("stream_0_")  # a live prefix tombstone, as after a stream's end
        attacker = zmq_ctx.socket(zmq.DEALER)
        stack.callback(attacker.close, 0)
        attacker.connect(rconn.endpoint)
        attacks = 5
        stop = threading.Event()

        def attack() -> None:
            for seq in range(1, attacks + 1):  # its control socket never connects
                key = "stream_0_" + "7" * 300_000
                attacker.send(pack(Kind.DATA, ["attacker", seq, 0, "0", "1", key, None], WIRE))
                if stop.wait(0.05):
                    return

        thread = threading.Thread(target=attack)
        thread.start()
        stack.callback(thread.join, 10)
        stack.callback(stop.set)
        for i in range(40):
            assert sconn.put("0", "1", f"real-{i}", {"i": i})[0]
            got = rconn.get_with_deadline("0", "1", f"real-{i}", deadline=time.monotonic() + 5.0)
            assert got is not None and got[0] == {"i": i}
            time.sleep(0.005)
        thread.join(10)
        assert wait_until(lambda: rconn.health()["rejected_keys"] == attacks)
        health = rconn.health()
        assert health["rejected_frames"] >= attacks and health["mailbox"] == 0
