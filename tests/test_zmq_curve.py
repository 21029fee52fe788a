"""CURVE: encrypted links, refused keys, client allow-lists."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import AuthenticationError, ConfigError, DeliveryError
from zmq_omni.transport import probe


def pair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


@pytest.fixture
def conns() -> Iterator[list[ZmqConnector]]:
    made: list[ZmqConnector] = []
    yield made
    for conn in made:
        conn.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("zmq-omni") or "auth" in t.name.lower()]


def build(made: list[ZmqConnector], **config: Any) -> ZmqConnector:
    conn = ZmqConnector(config)
    made.append(conn)
    return conn


def drain_until(conn: ZmqConnector, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        failures = conn.drain_failures()
        if failures:
            return failures
        time.sleep(0.02)
    return []


def test_allowed_client_talks_and_others_are_refused(conns: list[ZmqConnector]) -> None:
    server_pub, server_sec = pair()
    good_pub, good_sec = pair()
    bad_pub, bad_sec = pair()
    receiver = build(
        conns,
        stage_id="1",
        role="receiver",
        endpoints={"1": "tcp://127.0.0.1:0"},
        curve_public_key=server_pub,
        curve_secret_key=server_sec,
        curve_allowed_clients=[good_pub],
    )
    endpoint = receiver.endpoint
    assert endpoint is not None
    common = {
        "stage_id": "0",
        "role": "sender",
        "endpoints": {"1": endpoint},
        "delivery_timeout_s": 1.0,
        "heartbeat_s": 0.1,
        "peer_timeout_s": 0.5,
    }
    good = build(conns, **common, curve_public_key=good_pub, curve_secret_key=good_sec, curve_server_key=server_pub)
    intruder = build(conns, **common, curve_public_key=bad_pub, curve_secret_key=bad_sec, curve_server_key=server_pub)
    wrong_server = build(
        conns, **common, curve_public_key=good_pub, curve_secret_key=good_sec, curve_server_key=bad_pub
    )
    plaintext = build(conns, **common)

    assert good.put("0", "1", "secret", {"v": 1})[0]
    got = receiver.get_with_deadline("0", "1", "secret", deadline=time.monotonic() + 5)
    assert got is not None and got[0] == {"v": 1}

    for name, sender in (("intruder", intruder), ("wrong-server", wrong_server), ("plaintext", plaintext)):
        assert sender.put("0", "1", name, {"v": name})[0]
    for name, sender in (("intruder", intruder), ("wrong-server", wrong_server), ("plaintext", plaintext)):
        failures = drain_until(sender, 4)
        assert [f.key for f in failures] == [name] and isinstance(failures[0].error, DeliveryError)
        assert receiver.get("0", "1", name) is None


def test_probe_speaks_curve(conns: list[ZmqConnector]) -> None:
    server_pub, server_sec = pair()
    receiver = build(
        conns,
        stage_id="1",
        role="receiver",
        endpoints={"1": "tcp://127.0.0.1:0"},
        curve_public_key=server_pub,
        curve_secret_key=server_sec,
    )
    assert receiver.endpoint is not None
    assert probe(receiver.endpoint, server_key=server_pub)["stage_id"] == "1"
    with pytest.raises(AuthenticationError, match="requires authentication"):
        probe(receiver.endpoint, timeout_s=30)  # plaintext probe of a CURVE server: refused, not a hang


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"curve_secret_key": "x" * 40}, "curve_public_key"),
        ({"curve_secret_key": "short", "curve_public_key": "short"}, "curve_public_key"),
        ({"curve_allowed_clients": "not-a-list"}, "curve_allowed_clients"),
    ],
)
def test_bad_curve_config_names_the_key(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ZmqConnector({"stage_id": "0", "role": "sender", **extra})


def test_a_sender_meets_no_stage_over_curve_before_putting_to_it(conns: list[ZmqConnector]) -> None:
    """Stage 2's allow-list leaves stage 0 out, and stage 0 never puts to it: it never knocks there."""
    server_pub, server_sec = pair()
    zero_pub, zero_sec = pair()
    one_pub, _ = pair()
    keys = {"curve_public_key": server_pub, "curve_secret_key": server_sec, "role": "receiver"}
    near = build(conns, stage_id="1", endpoints={"1": "tcp://127.0.0.1:0"}, curve_allowed_clients=[zero_pub], **keys)
    far = build(conns, stage_id="2", endpoints={"2": "tcp://127.0.0.1:0"}, curve_allowed_clients=[one_pub], **keys)
    assert near.endpoint is not None and far.endpoint is not None
    sender = build(
        conns,
        stage_id="0",
        role="sender",
        endpoints={"1": near.endpoint, "2": far.endpoint},
        curve_public_key=zero_pub,
        curve_secret_key=zero_sec,
        curve_server_key=server_pub,
    )
    assert sender.health().get("peers", {}) == {}  # nobody met as it was built (shm: auto)
    assert sender.put("0", "1", "k", {"v": 1})[0]
    got = near.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 10)
    assert got is not None and got[0] == {"v": 1}
    assert set(sender.health()["peers"]) == {"1"}
    assert far.health()["curve_refused"] == 0
