"""Close seals the receive side: nothing is taken after it, waiting gets wake at once, the address is free after it.

* a sealed mailbox refuses every take (fed directly: no thread interleaving to
  hope for), and records no consumption its last acknowledgements could miss;
* on a shared endpoint, a connector's close wakes its own waiting gets at once,
  while the endpoint stays open for the other connector, whose gets go on;
* a close while the receiver decodes a slow payload returns with the socket closed:
  the address binds again at once, and the process's ZeroMQ context is released;
* a threaded connector that only receives starts no thread besides its endpoint's driver;
* each put is taken exactly once across a dozen restarts of its receiver, each closed at a
  random point while three threads get from it.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport import _sockets
from zmq_omni.transport._mailbox import Mailbox
from zmq_omni.transport._receive_protocol import Item
from zmq_omni.wire import register_type, unregister_type


def _mailbox() -> Mailbox:
    return Mailbox(tombstone_ttl_s=1.0, max_tombstones=8, on_left=lambda heavy: None)


def test_a_sealed_mailbox_refuses_every_take_and_records_no_consumption() -> None:
    mailbox = _mailbox()
    slot = ("0", "1", "k")
    mailbox.store([(slot, Item("payload", 7, "s", 1, None, 0.0))], 0.0)
    mailbox.close()
    assert mailbox.pop(slot) is None
    with mailbox.lock:
        assert mailbox.pop_locked(slot) is None
    consumed, dropped, nbytes = mailbox.handover()
    assert consumed == [] and dropped == [] and nbytes == 0
    assert mailbox.stats()["gets"] == 0


def test_a_take_before_the_seal_is_in_what_the_seal_hands_over() -> None:
    mailbox = _mailbox()
    slot = ("0", "1", "k")
    mailbox.store([(slot, Item("payload", 7, "s", 1, None, 0.0))], 0.0)
    item = mailbox.pop(slot)
    assert item is not None and mailbox.result(item) == ("payload", 7)
    mailbox.close()
    assert mailbox.handover()[0] == [("s", 1)]


def test_a_connector_closing_on_a_shared_endpoint_wakes_its_gets_and_takes_nothing_after(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/shared.sock"}
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints, "shm": "off"}
    keys = [f"k{i}" for i in range(8)]
    with (
        ZmqConnector(spec) as stays,
        ZmqConnector(spec) as sender_side,
        ZmqConnector({"role": "sender", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}) as upstream,
    ):
        closing = ZmqConnector(spec)
        assert closing.endpoint == stays.endpoint  # one endpoint, one mailbox
        results: dict[str, Any] = {}

        def wait_for(key: str) -> None:
            results[key] = closing.get_with_deadline("0", "1", key, deadline=time.monotonic() + 60)

        getters = [threading.Thread(target=wait_for, args=(key,)) for key in keys]
        for getter in getters:
            getter.start()
        time.sleep(0.1)  # the gets wait on the mailbox
        closing.close()
        # Put right after close returned: the closed connector's gets must take none of them.
        for key in keys:
            assert upstream.put("0", "1", key, {"key": key})[0]
        for key in keys:
            got = stays.get_with_deadline("0", "1", key, deadline=time.monotonic() + 10)
            assert got is not None and got[0] == {"key": key}, key
        for getter in getters:
            getter.join(10)
            assert not getter.is_alive()
        assert all(results[key] is None for key in keys)
        assert sender_side.get("0", "1", "none") is None  # the endpoint still serves its other holders


class Slow:
    """A payload whose decode takes 1.6 s (a first CUDA decode, a stalled thread)."""

    decoding = threading.Event()

    def __init__(self, value: int) -> None:
        self.value = value


def _slow_decode(value: int) -> Slow:
    Slow.decoding.set()
    time.sleep(1.6)
    return Slow(value)


def test_close_during_a_slow_decode_returns_with_the_address_free_and_the_context_released(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/slow.sock"
    name = register_type(Slow, name="tests.Slow", encode=lambda s: s.value, decode=_slow_decode)
    Slow.decoding.clear()
    users = _sockets._shared_users
    try:
        spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}, "shm": "off"}
        receiver = ZmqConnector(spec)
        try:
            with ZmqConnector({"role": "sender", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}}) as up:
                got: list[Any] = []
                getter = threading.Thread(
                    target=lambda: got.append(receiver.get_with_deadline("0", "1", "s", deadline=time.monotonic() + 30))
                )
                getter.start()
                assert up.put("0", "1", "s", Slow(7))[0]
                assert Slow.decoding.wait(10)
                receiver.close()
                # The address is free as close returns: a new receiver binds it at once.
                with ZmqConnector(spec) as again:
                    assert again.endpoint == endpoint
                    assert up.put("0", "1", "after", {"ok": 1})[0]
                    after = again.get_with_deadline("0", "1", "after", deadline=time.monotonic() + 10)
                    assert after is not None and after[0] == {"ok": 1}
                getter.join(10)
                assert not getter.is_alive() and got == [None]
        finally:
            receiver.close()
        assert _sockets._shared_users == users  # every connector's hold on the context was released
    finally:
        unregister_type(name)


def test_a_threaded_connector_that_only_receives_starts_one_thread_its_endpoints(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/threads.sock"}
    before = set(threading.enumerate())
    with ZmqConnector({"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}) as receiver:
        assert receiver.get("0", "1", "none") is None
        started = [t for t in threading.enumerate() if t not in before]
        assert len(started) == 1, started  # the bound endpoint's I/O thread: the driver of its socket


def test_each_put_is_taken_once_across_restarts_of_the_receiver_while_gets_race_its_close(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/restart.sock"
    spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}, "shm": "off"}
    rounds, per_round = 12, 20
    taken: dict[str, int] = {}
    lock = threading.Lock()
    rng = random.Random(42)
    outstanding: list[str] = []

    def getter(receiver: ZmqConnector, stop: threading.Event) -> None:
        while not stop.is_set():
            with lock:
                keys = list(outstanding)
            for key in keys:
                got = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 0.002)
                if got is not None:
                    assert got[0] == {"key": key}
                    with lock:
                        taken[key] = taken.get(key, 0) + 1
                        if key in outstanding:
                            outstanding.remove(key)
            if not keys:
                time.sleep(0.001)

    upstream_spec = {"role": "sender", "from_stage": 0, "to_stage": 1, "endpoints": {"1": endpoint}}
    with ZmqConnector({**upstream_spec, "heartbeat_s": 0.05, "delivery_timeout_s": 60}) as upstream:
        for round_no in range(rounds + 1):
            receiver = ZmqConnector(spec)
            stop = threading.Event()
            getters = [threading.Thread(target=getter, args=(receiver, stop)) for _ in range(3)]
            for thread in getters:
                thread.start()
            try:
                if round_no < rounds:
                    for i in range(per_round):
                        key = f"r{round_no}-{i}"
                        with lock:
                            outstanding.append(key)
                        assert upstream.put("0", "1", key, {"key": key})[0]
                    time.sleep(rng.uniform(0.0, 0.03))  # close at a random point of the stream and its gets
                else:  # the last incarnation takes what is left (resent by the sender)
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        with lock:
                            if not outstanding:
                                break
                        time.sleep(0.01)
            finally:
                receiver.close()
                stop.set()
                for thread in getters:
                    thread.join(10)
    assert not outstanding
    assert sorted(taken) == sorted(f"r{r}-{i}" for r in range(rounds) for i in range(per_round))
    assert {count for count in taken.values()} == {1}, {key: n for key, n in taken.items() if n != 1}
