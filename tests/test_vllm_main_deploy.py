"""Main's deploy YAMLs, switched to ZmqConnector, build every connector main would build (issue 30).

The fixtures in ``tests/vllm_main/deploy/`` are the connector sections of all
of vllm-omni main's ``vllm_omni/deploy/*.yaml`` that name a connector
(commit d6240742). The edit a user makes is the one ``switch_to_zmq`` makes:
the connector's ``name`` becomes ``ZmqConnector`` and ``endpoints`` (and
``mode``) are added; the YAML's own keys stay. ``main_loader`` says how main
turns that into each connector's ``extra``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_main.main_loader import (
    MAIN_COMMIT,
    Build,
    builds,
    deploy_files,
    edges,
    load_view,
    processor_config,
    stage_connector_config,
    stage_connector_spec,
    switch_to_zmq,
)
from zmq_omni.connectors.factory import create_connector
from zmq_omni.connectors.shm import SharedMemoryConnector
from zmq_omni.connectors.zmq import ZmqConnector

DEPLOY = deploy_files()


def _ours(view: dict[str, Any], tmp: Path, mode: str) -> dict[str, Any]:
    stage_ids = sorted({str(s["stage_id"]) for s in view["stages"]})
    return {"mode": mode, "endpoints": {sid: f"ipc://{tmp}/s{sid}.sock" for sid in stage_ids}}


def _groups(view: dict[str, Any]) -> Iterator[list[Build]]:
    """The builds of one process at a time: each stage process (scheduler, worker, KV), then the orchestrator."""
    by_process: dict[object, list[Build]] = {}
    for build in builds(view):
        by_process.setdefault(build.stage_id if build.path != "orchestrator" else "orchestrator", []).append(build)
    yield from by_process.values()


def test_the_fixtures_are_mains_deploy_yamls() -> None:
    # 36 deploy YAMLs name a connector, 6 more inherit one through base_config
    assert len(DEPLOY) == 42
    for path in DEPLOY:
        source = load_view(path)["source"]
        assert source["commit"] == MAIN_COMMIT and source["path"] == f"vllm_omni/deploy/{path.name}"


def test_the_extras_carry_keys_for_other_components() -> None:
    """The point of the exercise: main's YAMLs put keys for the stage input processors into the connector's extra."""
    foreign = set()
    for path in DEPLOY:
        for spec in load_view(path)["connectors"].values():
            foreign |= set(spec.get("extra") or {})
    assert {"codec_chunk_frames", "codec_left_context_frames", "initial_codec_chunk_frames"} <= foreign
    assert {"codec_streaming", "connector_get_sleep_s"} & foreign


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("path", DEPLOY, ids=[p.stem for p in DEPLOY])
def test_every_connector_main_builds_constructs_and_reads_back(
    path: Path, mode: str, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="zmq_omni.config")
    view = switch_to_zmq(load_view(path), _ours(load_view(path), short_tmp, mode))
    yaml_extra = {(s, d): spec.extra for (s, d), spec in edges(view).items()}
    built = 0
    for group in _groups(view):
        with ExitStack() as stack:
            for build in group:
                given = dict(build.extra)
                connector = stack.enter_context(create_connector({"name": build.name, "extra": build.extra}))
                built += 1
                expected_cls = ZmqConnector if build.name == "ZmqConnector" else SharedMemoryConnector
                assert isinstance(connector, expected_cls), build
                assert build.extra == given, f"{build.path}: the constructor changed the caller's dict"
                # the read of main's stage input processors sees the extra as it was given
                cfg = processor_config(connector)
                for key, value in given.items():
                    assert key in cfg and cfg[key] == value, (build.path, key, cfg.get(key), value)
                if build.stage_id is not None and build.path.startswith("stage"):
                    assert connector.stage_id == build.stage_id and type(connector.stage_id) is int
    assert built > 0 and yaml_extra
    # main's own keys are not near-misses of ours: building from its YAMLs warns about nothing
    assert [r.getMessage() for r in caplog.records if r.name.startswith("zmq_omni.config")] == []


@pytest.mark.parametrize("path", DEPLOY, ids=[p.stem for p in DEPLOY])
def test_processor_read_returns_the_yamls_values(path: Path, short_tmp: Path) -> None:
    """Each async-chunk stage's two connectors (scheduler's, worker's) answer the processors' read with the YAML."""
    original = load_view(path)
    view = switch_to_zmq(original, _ours(original, short_tmp, "push"))
    all_edges = edges(view)
    async_chunk = bool(view.get("async_chunk", True))
    for stage in view["stages"]:
        sid = int(stage["stage_id"])
        spec = stage_connector_spec(all_edges, sid, async_chunk)
        if not spec or spec["name"] != "ZmqConnector":
            continue
        config = stage_connector_config(spec, sid)
        # which YAML connector this stage's spec came from: compare without what main and we added
        yaml_values = {k: v for k, v in config["extra"].items() if k not in ("role", "stage_id", "mode", "endpoints")}
        with (
            create_connector(dict(config)) as scheduler_side,
            create_connector({"name": config["name"], "extra": dict(config["extra"])}) as worker_side,
        ):
            for connector in (scheduler_side, worker_side):
                cfg = processor_config(connector)
                assert {k: cfg.get(k) for k in yaml_values} == yaml_values
                assert cfg["role"] == config["extra"]["role"] and cfg["stage_id"] == sid


def test_qwen3_omni_codec_frames_reach_the_processor(short_tmp: Path) -> None:
    """qwen3_omni.py's talker->code2wav processor reads initial_codec_chunk_frames: 4 (not its default 0)."""
    original = load_view(Path(__file__).parent / "vllm_main" / "deploy" / "qwen3_omni_moe.yaml")
    view = switch_to_zmq(original, _ours(original, short_tmp, "push"))
    config = stage_connector_config(stage_connector_spec(edges(view), 1, True), 1)
    with create_connector(config) as talker:
        cfg = processor_config(talker)
        assert int(cfg.get("codec_chunk_frames", 25)) == 25
        assert int(cfg.get("codec_left_context_frames", 25)) == 25
        assert int(cfg.get("initial_codec_chunk_frames") or 0) == 4


def test_empty_extra_as_main_auto_adds(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edge no connector names gets ``extra == {}`` in main; the stage adds role and stage_id, nothing else."""
    with SharedMemoryConnector({}) as bare, SharedMemoryConnector({"role": "receiver", "stage_id": 2}) as staged:
        assert processor_config(bare) == {}
        assert processor_config(staged) == {"role": "receiver", "stage_id": 2}
    # ZmqConnector: the endpoint comes from the environment when the extra has none
    monkeypatch.setenv("ZMQ_OMNI_ENDPOINT_2", f"ipc://{short_tmp}/auto-2.sock")
    with ZmqConnector({"role": "receiver", "stage_id": 2}) as receiver, ZmqConnector({}) as orchestrator_side:
        assert processor_config(receiver) == {"role": "receiver", "stage_id": 2}
        assert processor_config(orchestrator_side) == {}
        ok, _, meta = orchestrator_side.put("1", "2", "auto_0", {"x": 1})
        assert ok
        got = receiver.get("1", "2", "auto_0", meta)
        assert got is not None and got[0] == {"x": 1}


def test_no_default_shm_threshold_needed(short_tmp: Path) -> None:
    """Main's loader no longer adds ``default_shm_threshold`` / ``shm_threshold_bytes``: our defaults apply."""
    endpoints = {"1": f"ipc://{short_tmp}/t1.sock"}
    with ZmqConnector({"endpoints": endpoints, "role": "receiver", "stage_id": 1}) as receiver:
        assert "shm_threshold_bytes" not in processor_config(receiver)
        assert "default_shm_threshold" not in processor_config(receiver)


def test_our_own_keys_are_still_validated(short_tmp: Path) -> None:
    from zmq_omni.errors import ConfigError

    endpoints = {"1": f"ipc://{short_tmp}/v1.sock"}
    with pytest.raises(ConfigError, match="hwm"):
        ZmqConnector({"endpoints": endpoints, "hwm": 0, "codec_chunk_frames": 25})
    with pytest.raises(ConfigError, match="mode"):
        ZmqConnector({"endpoints": endpoints, "mode": "sideways", "codec_chunk_frames": 25})


def test_a_near_miss_of_our_key_warns_naming_the_key_we_expected(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="zmq_omni.config")
    endpoints = {"1": f"ipc://{short_tmp}/w1.sock"}
    with ZmqConnector({"endpoints": endpoints, "shm_treshold": 1024}) as connector:
        assert processor_config(connector)["shm_treshold"] == 1024
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("shm_treshold" in m and "shm_threshold" in m for m in warned), warned
