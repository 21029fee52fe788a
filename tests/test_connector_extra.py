"""A connector's ``extra``: keys of other components kept, ours validated, near-misses warned, ``config`` a dict."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.config import ConnectorExtra
from zmq_omni.config.zmq import ZmqConnectorConfig
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.connectors.shm import SharedMemoryConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError

# What qwen3_omni_moe.yaml's connector carries for its stage input processors, plus what the loader injects.
_QWEN3_EXTRA = {
    "initial_codec_chunk_frames": 4,
    "codec_chunk_frames": 25,
    "codec_left_context_frames": 25,
    "role": "receiver",
}


def _processor_read(connector: Any) -> dict[str, Any]:
    """How vllm-omni main's stage input processors read their keys (qwen3_omni.py, minicpmo_4_5_omni.py)."""
    raw = getattr(connector, "config", {}) or {}
    cfg = raw.get("extra", raw) if isinstance(raw, dict) else {}
    return dict(cfg)


def _zmq_extra(short_tmp: Path, **more: Any) -> dict[str, Any]:
    return {**_QWEN3_EXTRA, "stage_id": 1, "endpoints": {"1": f"ipc://{short_tmp}/s1"}, **more}


def test_zmq_connector_keeps_foreign_keys_and_reads_like_vllm_omni(short_tmp: Path) -> None:
    extra = _zmq_extra(short_tmp)
    with ZmqConnector(extra) as conn:
        assert isinstance(conn.config, dict) and isinstance(conn.config, ConnectorExtra)
        assert conn.config == extra and conn.config is not extra
        got = _processor_read(conn)
        assert got["initial_codec_chunk_frames"] == 4 and got["codec_chunk_frames"] == 25
        assert isinstance(conn.settings, ZmqConnectorConfig) and conn.settings.role == "receiver"
        assert conn.config.mode == "push"  # attribute reads reach the typed settings
        with pytest.raises(AttributeError):
            _ = conn.config.codec_chunk_frames  # not a setting of ours: a key of the mapping only


def test_shm_and_inproc_connectors_keep_foreign_keys(shm_dir: str) -> None:
    with SharedMemoryConnector({**_QWEN3_EXTRA, "shm_dir": shm_dir}) as shm:
        assert _processor_read(shm)["initial_codec_chunk_frames"] == 4
        assert shm.settings.shm_dir == shm_dir
    with InProcConnector(dict(_QWEN3_EXTRA)) as inproc:
        assert _processor_read(inproc)["codec_left_context_frames"] == 25


def test_empty_extra_builds_every_connector(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZMQ_OMNI_SHM_DIR", shm_dir)
    for cls in (ZmqConnector, SharedMemoryConnector, InProcConnector):
        with cls({}) as conn:
            assert conn.config == {} and _processor_read(conn) == {}


@pytest.mark.parametrize(
    ("cls", "typo", "expected"),
    [
        (ZmqConnector, "shm_treshold", "shm_threshold"),
        (ZmqConnector, "put_timeout", "put_timeout_s"),
        (SharedMemoryConnector, "inline_max_byte", "inline_max_bytes"),
        (InProcConnector, "namespac", "namespace"),
    ],
)
def test_a_near_miss_of_our_key_is_a_warning_naming_it(
    cls: Any, typo: str, expected: str, shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    extra: dict[str, Any] = {typo: 1}
    if cls is SharedMemoryConnector:
        extra["shm_dir"] = shm_dir
    with caplog.at_level(logging.WARNING, logger="zmq_omni.config"), cls(extra) as conn:
        assert conn.config[typo] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and typo in warned[0] and f"'{expected}'" in warned[0]


def test_foreign_keys_are_not_warned_about(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    extra = _zmq_extra(short_tmp, connector_get_sleep_s=0.01, codec_streaming=True, latent_chunk_size=8)
    with caplog.at_level(logging.WARNING, logger="zmq_omni.config"), ZmqConnector(extra):
        pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"hwm": 0, "codec_chunk_frames": 25}, "hwm"),
        ({"mode": "shove", "latent_chunk_size": 8}, "mode"),
        ({"put_timeout_s": "soon"}, "put_timeout_s"),
    ],
)
def test_our_own_keys_are_still_validated(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ZmqConnector(extra)


def test_a_non_string_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="strings"):
        ZmqConnectorConfig.from_dict({1: "x"})  # type: ignore[dict-item]
