"""A shared endpoint's bind and close racing other connectors, pull-mode ownership, which settings holders share.

Real sockets and real threads: a connector built while the last holder of its
address is closing, a slow bind at one address next to binds at others, a pull
connector closing next to another one's unfetched payloads, fan-in edges whose
specs differ in send-side settings.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ports import reserve_port
from zmq_omni.config.zmq import ZmqConnectorConfig
from zmq_omni.connectors._shared_endpoint import SharedEndpoint, acquire
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError, DeliveryError, ZmqOmniError
from zmq_omni.transport import IoLoop


@pytest.fixture
def connectors() -> Iterator[list[ZmqConnector]]:
    """Every connector a test makes; closed at its end (in reverse)."""
    made: list[ZmqConnector] = []
    try:
        yield made
    finally:
        for conn in reversed(made):
            conn.close_with_linger(0)


def make(made: list[ZmqConnector], **extra: Any) -> ZmqConnector:
    conn = ZmqConnector(extra)
    made.append(conn)
    return conn


class _Holder:
    """A stand-in holder for :func:`acquire` (what a connector gives it)."""

    def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    def on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        pass


# -- bind and close of one address ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_connector_built_while_the_last_holder_closes_binds_once_the_old_socket_is_closed(
    short_tmp: Path, transport: str
) -> None:
    failures: list[str] = []
    for n in range(24):
        bind = f"ipc://{short_tmp}/r{n}" if transport == "ipc" else f"tcp://127.0.0.1:{reserve_port()}"
        spec = {"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": {"1": bind}, "close_timeout_s": 0}
        first = ZmqConnector(dict(spec))
        go = threading.Event()
        closer = threading.Thread(target=lambda c=first, g=go: (g.wait(), c.close()))
        closer.start()
        go.set()
        time.sleep(0.0005 * (n % 4))  # the new bind lands at various points of the close
        try:
            ZmqConnector(dict(spec)).close()
        except ZmqOmniError as exc:
            failures.append(str(exc))
        closer.join(10)
        assert not closer.is_alive()
    assert failures == []


def _endpoint_built_after(gate: threading.Event, address: str, fail: bool = False) -> SharedEndpoint:
    """A build that waits for ``gate`` (a slow bind), then fails or gives an endpoint with a started I/O thread."""
    assert gate.wait(10)
    if fail:
        raise ZmqOmniError(f"bind of {address} failed")
    loop = IoLoop("test-slow-bind")
    loop.start()
    return SharedEndpoint(address, {}, loop)


def test_a_slow_bind_holds_up_that_address_only(connectors: list[ZmqConnector], short_tmp: Path) -> None:
    slow_at = f"ipc://{short_tmp}/slow"
    gate = threading.Event()
    got: list[SharedEndpoint] = []
    holders = [_Holder(), _Holder()]

    def bind_slow(holder: _Holder) -> None:
        got.append(acquire(slow_at, {}, holder, lambda: _endpoint_built_after(gate, slow_at)))

    first = threading.Thread(target=bind_slow, args=(holders[0],))
    first.start()
    try:
        time.sleep(0.05)  # the first bind of slow_at is under way (its build waits for the gate)
        second = threading.Thread(target=bind_slow, args=(holders[1],))
        second.start()
        # Meanwhile a bind at another address of this process goes through.
        other = make(connectors, role="receiver", from_stage=0, to_stage=1, endpoints={"1": f"ipc://{short_tmp}/o"})
        assert other.endpoint == f"ipc://{short_tmp}/o"
        assert got == [] and second.is_alive()  # the second bind of slow_at waits for the first
    finally:
        gate.set()
        first.join(10)
    second.join(10)
    assert len(got) == 2 and got[0] is got[1] and got[0].holders == 2
    for holder in holders:
        got[0].release(holder)


def test_a_failed_bind_wakes_those_waiting_for_the_address(short_tmp: Path) -> None:
    address = f"ipc://{short_tmp}/fails"
    gate = threading.Event()
    errors: list[ZmqOmniError] = []
    got: list[SharedEndpoint] = []
    holder = _Holder()

    def bind_failing() -> None:
        try:
            acquire(address, {}, _Holder(), lambda: _endpoint_built_after(gate, address, fail=True))
        except ZmqOmniError as exc:
            errors.append(exc)

    failing = threading.Thread(target=bind_failing)
    failing.start()
    time.sleep(0.05)
    waiting = threading.Thread(
        target=lambda: got.append(acquire(address, {}, holder, lambda: _endpoint_built_after(gate, address)))
    )
    waiting.start()
    gate.set()
    failing.join(10)
    waiting.join(10)
    assert len(errors) == 1 and len(got) == 1  # the waiting one built its own once the failed one gave up
    got[0].release(holder)


# -- pull mode: each connector's own payloads ----------------------------------------------------------------------


def _pull_pair(made: list[ZmqConnector], short_tmp: Path) -> tuple[ZmqConnector, ZmqConnector, ZmqConnector]:
    endpoints = {"0": f"ipc://{short_tmp}/s0"}
    spec = {"mode": "pull", "role": "sender", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}
    first, second = make(made, **spec), make(made, **spec)
    assert first.endpoint == second.endpoint
    receiver = make(made, mode="pull", role="receiver", from_stage=0, to_stage=1, endpoints=endpoints)
    return first, second, receiver


def test_a_pull_connectors_flush_waits_for_its_own_payloads_only(
    connectors: list[ZmqConnector], short_tmp: Path
) -> None:
    first, second, receiver = _pull_pair(connectors, short_tmp)
    assert second.put("0", "1", "second-key", 1)[0]  # nobody fetches it here
    assert first.flush(10.0)  # first stored nothing: nothing of its own is unfetched
    ok, _, meta = first.put("0", "1", "first-key", 2)
    assert ok and not first.flush(0.1)
    assert receiver.get("0", "1", "first-key", meta) is not None
    assert first.flush(10.0) and not second.flush(0.1)
    first.close()  # the default linger: nothing of its own to wait for
    assert first.drain_failures() == []
    assert receiver.get("0", "1", "second-key", {"endpoint": second.endpoint, "key": "second-key"}) is not None


def test_a_pull_connector_that_leaves_reports_its_own_unfetched_payloads(
    connectors: list[ZmqConnector], short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second, receiver = _pull_pair(connectors, short_tmp)
    assert first.put("0", "1", "first-key", 1)[0]
    assert second.put("0", "1", "second-key", 2)[0]
    with caplog.at_level(logging.WARNING, logger="zmq_omni.connectors"):
        first.close_with_linger(0)
    assert [f.key for f in first.drain_failures() if isinstance(f.error, DeliveryError)] == ["first-key"]
    assert any("'first-key'" in r.getMessage() and "unconfirmed" in r.getMessage() for r in caplog.records)
    assert second.drain_failures() == []
    # second's payload is still served; first's left with it.
    assert receiver.get("0", "1", "second-key", {"endpoint": second.endpoint, "key": "second-key"}) is not None
    deadline = time.monotonic() + 0.2
    assert receiver.get_with_deadline("0", "1", "first-key", deadline=deadline) is None
    second.close_with_linger(0)
    assert second.drain_failures() == []


# -- which settings holders share -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_fan_in_edges_differing_in_send_side_settings_share_the_endpoint(
    connectors: list[ZmqConnector], short_tmp: Path, mode: str
) -> None:
    own = f"ipc://{short_tmp}/s2"
    if mode == "push":  # stage 2 receives from stages 0 and 1, one spec per edge
        first = make(connectors, role="receiver", from_stage=0, to_stage=2, endpoints={"2": own})
        second = make(
            connectors,
            role="receiver",
            from_stage=1,
            to_stage=2,
            endpoints={"2": own, "0": f"ipc://{short_tmp}/s0"},
            put_timeout_s=9,
            delivery_timeout_s=7,
            curve_server_key=None,
        )
    else:  # stage 2 serves stages 3 and 4
        spec = {"mode": "pull", "role": "sender", "from_stage": 2}
        first = make(connectors, **spec, to_stage=3, endpoints={"2": own}, fetch_timeout_s=2)
        second = make(connectors, **spec, to_stage=4, endpoints={"2": own, "3": f"ipc://{short_tmp}/s3"})
    assert first.endpoint == second.endpoint == own


@pytest.mark.parametrize(
    ("mode", "setting", "value"),
    [("push", "max_tombstones", 7), ("push", "unclaimed_ttl_s", 9.0), ("pull", "put_timeout_s", 9.0)],
)
def test_a_differing_bound_setting_is_refused_naming_it(
    connectors: list[ZmqConnector], short_tmp: Path, mode: str, setting: str, value: Any
) -> None:
    spec = {"mode": mode, "stage_id": 1, "role": "receiver" if mode == "push" else "sender"}
    spec["endpoints"] = {"1": f"ipc://{short_tmp}/s1"}
    make(connectors, **spec)
    with pytest.raises(ConfigError, match=rf"other settings \({setting}\)"):
        ZmqConnector({**spec, setting: value})


def test_no_config_key_hides_a_dict_attribute() -> None:
    # connector.config is a dict whose keys read as attributes too: a key named like a dict method would be shadowed.
    names = {field.name for field in dataclasses.fields(ZmqConnectorConfig)}
    assert names & set(dir(dict)) == set()
