"""The protocol alone decides when acks go out and leaves I/O to the driver as requests (fed directly).

The protocol is fed DATA frames, hand-overs and the clock; :meth:`ReceiveProtocol.schedule` and
``flush_due`` say when the batched acknowledgements are due. The mailbox is fed items and takes: it
only signals that something left it (once until the next hand-over, and at each ``ACK_BYTES`` taken),
replaces a re-put, and expires what nobody took. A PING or a HEALTH waits in ``asked`` until the
driver answers it with what the answer needs (the hand-over, probe verdicts, the health dict).
"""

from __future__ import annotations

from typing import Any

from tests.conftest import bytes_protocol
from zmq_omni.metrics import Counters
from zmq_omni.transport._envelope import Kind, pack
from zmq_omni.transport._mailbox import Mailbox
from zmq_omni.transport._receive_protocol import ACK_BATCH, ACK_BYTES, Item, ReceiveProtocol

DELAY = 0.02


def _protocol(counters: Counters | None = None) -> ReceiveProtocol:
    return bytes_protocol(counters, max_message_bytes=1 << 30, ack_delay_s=DELAY)


def _data(protocol: ReceiveProtocol, seq: int, now: float, payload: bytes = b"x") -> None:
    protocol.receive(b"ds", [pack(Kind.DATA, ["s", seq, 0, "0", "1", f"k{seq}", None], payload)], True, now)


def test_an_arrival_is_acknowledged_one_delay_later_and_a_flush_clears_it() -> None:
    protocol = _protocol()
    assert protocol.schedule(0.0) is None  # nothing owed
    _data(protocol, 1, 1.0)
    assert protocol.schedule(1.0) == 1.0 + DELAY
    _data(protocol, 2, 1.01)
    assert protocol.schedule(1.01) == 1.0 + DELAY  # the first owed one sets the time
    replies = protocol.flush()
    assert replies and protocol.flush_due is None and protocol.schedule(1.02) is None


def test_a_batch_of_messages_or_bytes_is_acknowledged_at_once() -> None:
    protocol = _protocol()
    for seq in range(1, ACK_BATCH + 1):
        _data(protocol, seq, 2.0)
    assert protocol.schedule(2.0) == 2.0
    protocol.flush()
    _data(protocol, ACK_BATCH + 1, 3.0, b"y" * ACK_BYTES)
    assert protocol.schedule(3.0) == 3.0


def test_taken_bytes_past_ack_bytes_are_acknowledged_at_once_across_flushes() -> None:
    protocol = _protocol()
    _data(protocol, 1, 0.0)
    _data(protocol, 2, 0.0)
    half = ACK_BYTES // 2
    protocol.taken([("s", 1)], [], half)
    protocol.flush()  # a regular flush in between
    assert protocol.left_mailbox(0.5) == 0.5 + DELAY
    protocol.taken([("s", 2)], [], half)
    assert protocol.schedule(0.5) == 0.5  # ACK_BYTES taken since the last prompt flush: now
    protocol.flush()
    protocol.taken([], [], 1)
    assert protocol.schedule(0.6) is None  # the count started again (and nothing is owed)


def test_a_take_without_a_hand_over_is_acknowledged_within_the_delay_keeping_an_earlier_time() -> None:
    protocol = _protocol()
    assert protocol.left_mailbox(1.0) == 1.0 + DELAY
    assert protocol.left_mailbox(1.015) == 1.0 + DELAY


def _mailbox(signals: list[bool]) -> Mailbox:
    return Mailbox(tombstone_ttl_s=1.0, max_tombstones=8, on_left=signals.append)


def _item(seq: int, nbytes: int = 10, arrived: float = 0.0) -> Item:
    return Item(f"v{seq}", nbytes, "s", seq, None, arrived)


def test_the_mailbox_tells_the_driver_once_until_its_hand_over_and_at_each_ack_bytes() -> None:
    signals: list[bool] = []
    mailbox = _mailbox(signals)
    slots: list[Any] = [("0", "1", f"k{i}") for i in range(4)]
    mailbox.store([(slot, _item(i)) for i, slot in enumerate(slots[:3])], 0.0)
    assert mailbox.pop(slots[0]) is not None and mailbox.pop(slots[1]) is not None
    assert signals == [False]  # once until the driver hands over
    assert mailbox.handover() == ([("s", 0), ("s", 1)], [], 20)
    mailbox.store([(slots[3], _item(3, ACK_BYTES))], 0.0)
    assert mailbox.pop(slots[3]) is not None
    assert signals == [False, True]  # ACK_BYTES taken: the protocol decides on them now
    assert mailbox.pop(slots[2]) is not None and signals == [False, True]  # told since the hand-over


def test_a_take_while_a_flush_is_due_tells_the_driver_nothing_and_the_flush_hands_it_over() -> None:
    signals: list[bool] = []
    mailbox = _mailbox(signals)
    slots: list[Any] = [("0", "1", f"k{i}") for i in range(2)]
    mailbox.store([(slot, _item(i)) for i, slot in enumerate(slots)], 0.0)
    mailbox.flush_pending = True  # the driver has acknowledgements due (it set a flush timer)
    assert mailbox.pop(slots[0]) is not None
    assert signals == []  # no wake-up: the due flush hands it over
    assert mailbox.handover() == ([("s", 0)], [], 10) and not mailbox.flush_pending
    assert mailbox.pop(slots[1]) is not None and signals == [False]  # no flush due: the driver is told


def test_a_re_put_replaces_and_counts_as_consumed_and_expiry_drops_what_nobody_took() -> None:
    signals: list[bool] = []
    mailbox = _mailbox(signals)
    slot = ("0", "1", "k")
    mailbox.store([(slot, _item(1, arrived=0.0))], 0.0)
    mailbox.store([(slot, _item(2, arrived=5.0))], 5.0)
    consumed, dropped, _ = mailbox.handover()
    assert consumed == [("s", 1)] and dropped == []
    assert mailbox.expire(6.0, unclaimed_ttl_s=2.0) == 0
    assert mailbox.expire(8.0, unclaimed_ttl_s=2.0) == 1 and signals == [False]
    consumed, dropped, _ = mailbox.handover()
    assert consumed == [] and [(sid, seq) for sid, seq, _ in dropped] == [("s", 2)]
    assert mailbox.pop(slot) is None


def test_a_ping_waits_for_the_driver_and_its_pong_tells_what_was_handed_over() -> None:
    protocol = _protocol()
    _data(protocol, 1, 0.0)
    probe = ["zomni-probe", b"\x01" * 16]
    protocol.receive(b"ds", [pack(Kind.PING, ["s", 7, 0, probe])], True, 0.1)
    protocol.receive(b"dh", [pack(Kind.HEALTH, [])], True, 0.1)
    assert protocol.replies == [] and len(protocol.asked) == 2  # nothing answered without the driver
    assert protocol.probes() == [probe] and protocol.wants_health()
    protocol.taken([("s", 1)], [], 1)  # the driver hands over what left the mailbox first
    protocol.answer({("zomni-probe", b"\x01" * 16): True}, {"status": "ok"})
    pong = next(reply for reply in protocol.replies if reply.ping == 7)
    assert pong.consumed == [1] and pong.source is not None and pong.source.shm is True
    health = next(reply for reply in protocol.replies if reply.source is None)
    assert health.identity == b"dh" and b"status" in health.frame
    assert protocol.asked == [] and protocol.probes() == []
    protocol.receive(b"ds", [pack(Kind.PING, ["s", 8, 0, probe])], True, 0.2)
    assert protocol.probes() == []  # this probe's verdict is known


def test_a_malformed_probe_is_refused_before_anything_maps_it() -> None:
    counters = Counters()
    protocol = _protocol(counters)
    protocol.receive(b"ds", [pack(Kind.PING, ["s", 1, 0, ["../etc", b"short"]])], True, 0.0)
    assert protocol.asked == [] and counters.get("rejected_frames") == 1
