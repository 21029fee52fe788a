"""Lazy acknowledgements, prompt when asked, and one ZeroMQ context per process (issue 14).

A receiver holds its acknowledgements back for ``ack_delay_s`` (20 ms by
default) so that a stream of lone messages does not wake the sender's I/O
thread every few messages; a sender that needs them sooner (its window full,
a ``flush()`` waiting) pings, and a ping is answered at once. These tests set
``ack_delay_s`` far beyond their timeouts, so they pass only through the
prompt path: a sender that waited for the lazy acks would time out. Real
sockets over ipc, in one process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.aio import AsyncConnector
from zmq_omni.config import ZmqConnectorConfig
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError

from .conftest import wait_until

# Lazier than every timeout below: only an ack the sender asked for can arrive in time.
_LAZY = 10.0


@contextmanager
def _edge(short_tmp: Path, ack_delay_s: float = _LAZY, **sender: Any) -> Iterator[tuple[ZmqConnector, ZmqConnector]]:
    """A lazy-acking push receiver (stage 1) and a sender (stage 0) with heartbeats an hour apart."""
    common = {
        "endpoints": {"1": f"ipc://{short_tmp}/edge.sock"},
        "shm": "off",
        "heartbeat_s": 3600.0,
        "peer_timeout_s": 7200.0,
    }
    with ExitStack() as stack:
        lazy = {"stage_id": "1", "role": "receiver", "ack_delay_s": ack_delay_s, **common}
        receiver = stack.enter_context(ZmqConnector(lazy))
        sender_conn = stack.enter_context(ZmqConnector({"stage_id": "0", "role": "sender", **common, **sender}))
        yield receiver, sender_conn


def _unconfirmed(sender: ZmqConnector) -> int:
    """Puts the sender still keeps (not yet acknowledged as consumed)."""
    return int(sender.health()["pending"])


def _connect(receiver: ZmqConnector, sender: ZmqConnector) -> None:
    """Put, get and confirm a warm-up item: the sender's control connection is up afterwards.

    A REPLY to a sender whose control socket has not connected yet is unroutable and dropped
    (acks_dropped; a later pong repeats it), which under load could be the very ack a test waits for.
    """
    assert sender.put("0", "1", "warm-up", 1)[0]
    assert receiver.get_with_deadline("0", "1", "warm-up", deadline=time.monotonic() + 10) is not None
    assert sender.flush(10)


def test_acks_are_lazy_and_flush_asks_for_them(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, sender):
        assert sender.put("0", "1", "k", {"i": 1})[0]
        got = receiver.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 10)
        assert got is not None and got[0] == {"i": 1}
        # Nothing asked for the acks yet, and they are 10 s away: the sender still keeps the put.
        time.sleep(0.3)
        assert _unconfirmed(sender) == 1
        # flush() pings the receiver, which answers at once with the arrival and the consumption.
        assert sender.flush(5.0)
        assert wait_until(lambda: _unconfirmed(sender) == 0, 5)


def test_flush_after_the_getters_left_is_answered(short_tmp: Path) -> None:
    # The socket stays with the getters after the last get; the I/O thread takes it back within
    # 20 ms, whatever ack_delay_s says, so the ping that flush() sends is read.
    with _edge(short_tmp) as (receiver, sender):
        for i in range(5):
            assert sender.put("0", "1", f"k{i}", i)[0]
            assert receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 10) is not None
        time.sleep(0.2)
        assert sender.flush(5.0)


def test_acks_armed_by_a_getter_go_out_after_the_socket_went_back(short_tmp: Path) -> None:
    # A getter reads the socket and arms the ack flush; 20 ms after it left, the I/O thread takes
    # the socket back, before the flush is due (ack_delay_s 0.5 s): the flush must still go out
    # then, on the I/O thread's timer, with nobody asking (heartbeats an hour apart, no flush()).
    with _edge(short_tmp, ack_delay_s=0.5) as (receiver, sender):
        assert sender.put("0", "1", "k", 1)[0]
        assert receiver.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 10) is not None
        assert wait_until(lambda: _unconfirmed(sender) == 0, 10)


def test_a_full_window_asks_for_acks(short_tmp: Path) -> None:
    # A window of 2 and 30 puts, each put waiting at most 5 s: they go through only if the
    # puts that find the window full get it freed by asking, not after ack_delay_s (10 s).
    keys = [f"k{i}" for i in range(30)]
    got: list[Any] = []

    with _edge(short_tmp, max_unacked=2, put_timeout_s=5.0) as (receiver, sender):

        def consume() -> None:
            for key in keys:
                item = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 20)
                got.append(None if item is None else item[0])

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        for i, key in enumerate(keys):
            ok, _, _ = sender.put("0", "1", key, {"i": i})
            assert ok, sender.drain_failures()
        consumer.join(30)
        assert not consumer.is_alive()
        assert got == [{"i": i} for i in range(30)]
        assert sender.drain_failures() == []


def test_a_getter_whose_read_crosses_the_ack_mark_acknowledges_at_once(short_tmp: Path) -> None:
    # Two 1 MiB puts queue in ZeroMQ before any get; the getter of the second reads the 2nd MiB and
    # returns with it. Its acks must go then: no later read would send them (the next is up to the caller).
    payload = np.zeros(1 << 20, dtype=np.uint8)
    with _edge(short_tmp) as (receiver, sender):
        _connect(receiver, sender)
        for key in ("k0", "k1"):
            assert sender.put("0", "1", key, payload)[0]
        for key in ("k0", "k1"):
            got = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 10)
            assert got is not None and got[0].nbytes == payload.nbytes
        assert wait_until(lambda: _unconfirmed(sender) == 0, 5), (_unconfirmed(sender), receiver.health())


def test_large_items_the_io_thread_read_are_acknowledged_once_taken(short_tmp: Path) -> None:
    # Two 1 MiB puts reach the mailbox before any get (the I/O thread read them, and its REPLY
    # acknowledged their arrival); taking them is 2 MiB consumed, acknowledged at once, not
    # ack_delay_s later: the sender keeps each put until its consumption is acknowledged.
    payload = np.zeros(1 << 20, dtype=np.uint8)
    with _edge(short_tmp) as (receiver, sender):
        _connect(receiver, sender)
        for key in ("k0", "k1"):
            assert sender.put("0", "1", key, payload)[0]
        assert wait_until(lambda: receiver.health()["mailbox"] == 2, 10)
        for key in ("k0", "k1"):
            got = receiver.get("0", "1", key)
            assert got is not None and got[0].nbytes == payload.nbytes
        assert wait_until(lambda: _unconfirmed(sender) == 0, 5), (_unconfirmed(sender), receiver.health())


def test_an_awaited_put_on_a_full_window_asks_for_acks(short_tmp: Path) -> None:
    # The non-blocking put behind AsyncConnector.put asks too, before it reports "no room".
    with _edge(short_tmp, max_unacked=2, put_timeout_s=5.0) as (receiver, sender):

        async def run() -> list[Any]:
            async with AsyncConnector(receiver) as rx, AsyncConnector(sender) as tx:

                async def consume() -> list[Any]:
                    out = []
                    for i in range(20):
                        item = await rx.get("0", "1", f"k{i}", timeout=20)
                        out.append(None if item is None else item[0])
                    return out

                consumer = asyncio.ensure_future(consume())
                for i in range(20):
                    ok, _, _ = await asyncio.wait_for(tx.put("0", "1", f"k{i}", i), 5)
                    assert ok
                return await asyncio.wait_for(consumer, 30)

        assert asyncio.run(run()) == list(range(20))


def test_large_payloads_are_acknowledged_every_few_mib(short_tmp: Path) -> None:
    # A sender keeps each put until it is acknowledged; 1 MiB puts are acknowledged after 2 MiB of
    # them arrived, so the sender stops keeping them long before ack_delay_s.
    payload = np.zeros(1 << 20, dtype=np.uint8)
    with _edge(short_tmp) as (receiver, sender):
        _connect(receiver, sender)  # else the very ack this test waits for could be unroutable
        for i in range(4):
            assert sender.put("0", "1", f"k{i}", payload)[0]
            got = receiver.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 10)
            assert got is not None and got[0].nbytes == payload.nbytes
        # The acks of the first puts went with the arrival of the later ones (no ping: heartbeats
        # are an hour apart and nobody flushes).
        assert wait_until(lambda: _unconfirmed(sender) <= 2, 5), (_unconfirmed(sender), receiver.health())


def test_ack_delay_s_is_a_config_key() -> None:
    assert ZmqConnectorConfig.from_dict({}).ack_delay_s == 0.02
    assert ZmqConnectorConfig.from_dict({"ack_delay_s": 0.005}).ack_delay_s == 0.005
    for bad in (0, -1, 11, "soon", True):
        with pytest.raises(ConfigError, match="ack_delay_s"):
            ZmqConnectorConfig.from_dict({"ack_delay_s": bad})


def test_connectors_of_a_process_share_one_context(short_tmp: Path) -> None:
    with _edge(short_tmp) as (receiver, sender):
        assert receiver.driver is not None and sender.driver is not None
        ctx = receiver.driver.ctx
        assert sender.driver.ctx is ctx
        receiver.close()  # the other connector's context stays open, and it still works
        assert not ctx.closed
        assert sender.put("0", "1", "k", 1)[0]
    assert ctx.closed  # the last one to close terminated it


def test_a_connector_with_an_allow_list_has_a_context_of_its_own(short_tmp: Path) -> None:
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, _ = zmq.curve_keypair()
    endpoint = f"ipc://{short_tmp}/curve.sock"
    guarded = ZmqConnector(
        {
            "stage_id": "1",
            "role": "receiver",
            "endpoints": {"1": endpoint},
            "shm": "off",
            "curve_secret_key": server_secret.decode(),
            "curve_public_key": server_public.decode(),
            "curve_allowed_clients": [client_public.decode()],
        }
    )
    plain = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"2": f"ipc://{short_tmp}/x.sock"}})
    try:
        assert guarded.driver is not None and plain.driver is not None
        assert guarded.driver.ctx is not plain.driver.ctx
    finally:
        guarded.close()
        plain.close()


def test_a_get_between_a_flush_s_hand_over_and_its_end_makes_acks_due_again(short_tmp: Path) -> None:
    # A get between a flush's hand-over and the end of that flush is not in it: it must make acks due again
    # (no arrival follows, nobody asks), although gets while a flush is due wake no one.
    with _edge(short_tmp, ack_delay_s=0.05) as (receiver, sender):
        _connect(receiver, sender)
        part = receiver._bound.receiver
        assert part is not None
        sock = part._rs
        assert sender.put("0", "1", "a", 1)[0] and sender.put("0", "1", "b", 2)[0]
        time.sleep(0.3)  # both arrived, their arrival acknowledged
        inner = sock.hand_over
        got: list[Any] = []

        def hand_over_then_get(*, still_pending: bool = False) -> None:
            inner(still_pending=still_pending)
            if not got:
                taker = threading.Thread(target=lambda: got.append(receiver.get("0", "1", "b")))
                taker.start()
                taker.join(10)

        sock.hand_over = hand_over_then_get  # type: ignore[method-assign]
        assert receiver.get_with_deadline("0", "1", "a", deadline=time.monotonic() + 10) is not None
        assert wait_until(lambda: bool(got), 10) and got[0] is not None
        assert wait_until(lambda: _unconfirmed(sender) == 0, 5)
