"""One put nobody takes beside a stream of puts, over real sockets (ipc, one process).

The stuck item pins its sender's low mark; the stream keeps flowing, every put of it is
delivered once, and the stuck one is delivered exactly once when it is finally taken, also
after a receiver restart (or dropped and reported as ``unclaimed_ttl_s`` says). The pong
limits are made small here, so that the pongs of a short run already repeat only a share
of the consumptions they owe.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import DeliveryError
from zmq_omni.transport import _dedupe

from .conftest import wait_until

STREAM = 3000
CHUNK = 100


@pytest.fixture
def small_pongs() -> Iterator[None]:
    """Pongs that repeat at most 16 older consumptions (and 32 recent ones) each."""
    with ExitStack() as stack:
        for name, value in {"MAX_PONG_REPEATS": 16, "MAX_PONG_RECENT": 32, "MAX_PONG_WALK": 64}.items():
            stack.enter_context(patch.object(_dedupe, name, value))
        yield


def _connector(stack: ExitStack, endpoint: str, **config: Any) -> ZmqConnector:
    common = {"endpoints": {"1": endpoint}, "shm": "off", "heartbeat_s": 0.02, "peer_timeout_s": 1.0}
    return stack.enter_context(ZmqConnector({**common, **config}))


def _stream(sender: ZmqConnector, receiver: ZmqConnector) -> None:
    """Put and take ``STREAM`` items beside the stuck one, each checked and taken once."""
    for base in range(0, STREAM, CHUNK):
        for i in range(base, base + CHUNK):
            assert sender.put("0", "1", f"k{i}", {"i": i})[0], sender.drain_failures()
        for i in range(base, base + CHUNK):
            got = receiver.get_with_deadline("0", "1", f"k{i}", deadline=_soon())
            assert got is not None and got[0] == {"i": i}, f"k{i}"


def _soon(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def test_a_stuck_item_stays_exactly_once_beside_a_stream_and_across_a_restart(
    small_pongs: None, short_tmp: Path
) -> None:
    endpoint = f"ipc://{short_tmp}/stuck.sock"
    with ExitStack() as stack:
        receiver = _connector(stack, endpoint, stage_id="1", role="receiver")
        sender = _connector(stack, endpoint, stage_id="0", role="sender")
        assert sender.put("0", "1", "stuck", {"stuck": True})[0]
        _stream(sender, receiver)
        # Pongs repeated a bounded share of what the stream consumed, and still told the sender all of it:
        # it keeps the stuck item alone.
        assert wait_until(lambda: sender.health()["pending"] == 1, 10), sender.health()
        assert all(receiver.get("0", "1", f"k{i}") is None for i in range(0, STREAM, 97))
        # The receiver restarts: the sender resends only what was never consumed.
        receiver.close()
        reopened = _connector(stack, endpoint, stage_id="1", role="receiver")
        got = reopened.get_with_deadline("0", "1", "stuck", deadline=_soon())
        assert got is not None and got[0] == {"stuck": True}
        assert wait_until(lambda: sender.health()["pending"] == 0, 10), sender.health()
        assert reopened.get("0", "1", "stuck") is None
        assert all(reopened.get("0", "1", f"k{i}") is None for i in range(STREAM)), "a consumed put came again"
        rhealth = reopened.health()
        assert rhealth["mailbox"] == 0 and rhealth["rejected_frames"] == 0
        assert sender.drain_failures() == []


def test_a_stuck_item_taken_late_is_delivered_once_and_one_left_expires_as_documented(
    small_pongs: None, short_tmp: Path
) -> None:
    endpoint = f"ipc://{short_tmp}/late.sock"
    with ExitStack() as stack:
        receiver = _connector(stack, endpoint, stage_id="1", role="receiver", unclaimed_ttl_s=3.0)
        sender = _connector(stack, endpoint, stage_id="0", role="sender")
        assert sender.put("0", "1", "taken-late", {"late": 1})[0]
        assert sender.put("0", "1", "never-taken", {"late": 2})[0]
        _stream(sender, receiver)
        got = receiver.get_with_deadline("0", "1", "taken-late", deadline=_soon())
        assert got is not None and got[0] == {"late": 1}
        assert receiver.get("0", "1", "taken-late") is None
        # The other one waits out unclaimed_ttl_s: dropped, and reported to its sender as a failed put.
        assert wait_until(lambda: sender.health()["receiver_dropped_unclaimed"] == 1, 15), sender.health()
        failures = sender.drain_failures()
        assert [f.key for f in failures] == ["never-taken"]
        assert isinstance(failures[0].error, DeliveryError) and failures[0].error.dropped == "unclaimed"
        assert wait_until(lambda: sender.health()["pending"] == 0, 10), sender.health()
        assert receiver.health()["dropped_unclaimed"] == 1 and receiver.health()["mailbox"] == 0
