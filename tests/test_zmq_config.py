"""ZmqConnector configuration: every bad key named, environment overrides, bind failures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zmq_omni.config.zmq import ZmqConnectorConfig
from zmq_omni.connectors.factory import create_connector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError, TransportError
from zmq_omni.transport import EndpointMap, env_name


def test_defaults_are_bounded() -> None:
    cfg = ZmqConnectorConfig.from_dict({"stage_id": 3})
    assert cfg.stage_id == "3" and cfg.role is None and cfg.mode == "push"  # no role: binds lazily
    assert cfg.hwm > 0 and cfg.max_unacked > 0 and cfg.max_unacked_bytes > 0


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"stage_id": True}, "stage_id"),  # optional (vllm-omni may not inject it), but typed
        ({"stage_id": "0", "role": "boss"}, "role"),
        ({"stage_id": "0", "mode": "shove"}, "mode"),
        ({"stage_id": "0", "hwm": 0}, "hwm"),
        ({"stage_id": "0", "hwm": 2**31}, "hwm"),
        ({"stage_id": "0", "max_message_bytes": 2**63}, "max_message_bytes"),
        ({"stage_id": "0", "put_timeout_s": "soon"}, "put_timeout_s"),
        ({"stage_id": "0", "put_timeout_s": float("nan")}, "put_timeout_s"),
        ({"stage_id": "0", "delivery_timeout_s": float("inf")}, "delivery_timeout_s"),
        ({"stage_id": "0", "endpoints": {"1": 5555}}, "endpoints.1"),
        ({"stage_id": "0", "copy_on_put": "yes"}, "copy_on_put"),
        ({"stage_id": "0", "heartbeat_s": 2.0, "peer_timeout_s": 1.0}, "peer_timeout_s"),
    ],
)
def test_bad_config_names_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        ZmqConnectorConfig.from_dict(extra)


@pytest.mark.parametrize("endpoint", ["tcp://host", "udp://x:1", "ipc://", "tcp://h:99999", "inproc://x"])
def test_bad_endpoints_are_config_errors(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"endpoints\.1"):
        ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}})


def test_environment_overrides_endpoints_and_bind(short_tmp: Path) -> None:
    env = {env_name("talker-1"): "tcp://talker:5555", "ZMQ_OMNI_BIND": "tcp://0.0.0.0:5555"}
    endpoints = EndpointMap({"talker-1": "tcp://127.0.0.1:1", "vocoder": "ipc:///tmp/v"}, env)
    assert env_name("talker-1") == "ZMQ_OMNI_ENDPOINT_TALKER_1"
    assert endpoints.get("talker-1") == "tcp://talker:5555"
    assert endpoints.get("vocoder") == "ipc:///tmp/v"
    assert endpoints.env_bind == "tcp://0.0.0.0:5555"
    with pytest.raises(ConfigError, match="ZMQ_OMNI_ENDPOINT_NOPE"):
        endpoints.require("nope")


def test_receiver_binds_the_bind_key_and_advertises_the_endpoint(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = f"ipc://{short_tmp}/bound.sock"
    monkeypatch.setenv(env_name("1"), "tcp://stage-one:7000")
    with ZmqConnector({"stage_id": "1", "role": "receiver", "bind": path}) as conn:
        assert conn.endpoint == path
        assert (short_tmp / "bound.sock").exists()


def test_a_failed_bind_raises_naming_the_endpoint() -> None:
    with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}}) as first:
        taken = first.endpoint
        assert taken is not None
        with pytest.raises(TransportError, match=taken.replace(".", r"\.")):
            ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": taken}})


def test_a_receiver_without_an_endpoint_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"endpoints\.1"):
        ZmqConnector({"stage_id": "1", "role": "receiver"})


def test_the_factory_builds_it_by_name(short_tmp: Path) -> None:
    conn = create_connector({"name": "ZmqConnector", "extra": {"stage_id": "0", "role": "sender"}})
    try:
        assert isinstance(conn, ZmqConnector) and conn.health()["role"] == "sender"
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("tp_rank", "local_rank_env", "rank", "placed"),
    [
        (1, "0", 1, "1"),  # a TP worker: vLLM's TP rank, whatever LOCAL_RANK says
        (0, None, 0, "0"),
        (None, None, None, "engine"),  # the EngineCore of a TP stage: no rank, not rank 0
        (None, "3", 3, "3"),  # vLLM loaded, no TP group, torchrun's LOCAL_RANK: main's fallback
        ("absent", "2", 2, "2"),  # no vLLM in the process
        ("absent", None, None, "engine"),
    ],
)
def test_rank_is_vllms_tp_rank_and_a_non_worker_has_none(
    tp_rank: int | str | None,
    local_rank_env: str | None,
    rank: int | None,
    placed: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.vllm_main.vllm_state import MODULE, parallel_state

    if tp_rank == "absent":
        monkeypatch.delitem(sys.modules, MODULE, raising=False)
    else:
        assert not isinstance(tp_rank, str)
        monkeypatch.setitem(sys.modules, MODULE, parallel_state(tp_rank, 2))
    if local_rank_env is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank_env)
    cfg = ZmqConnectorConfig.from_dict({"endpoints": {"1": "ipc:///tmp/s1-t{rank}"}, "bind": "ipc:///tmp/b{rank}"})
    assert cfg.local_rank == rank
    assert cfg.endpoints["1"] == f"ipc:///tmp/s1-t{placed}" and cfg.bind == f"ipc:///tmp/b{placed}"
    # the key given wins over everything
    given = ZmqConnectorConfig.from_dict({"endpoints": {"1": "ipc:///tmp/s1-t{rank}"}, "local_rank": 5})
    assert given.local_rank == 5 and given.endpoints["1"] == "ipc:///tmp/s1-t5"
