from __future__ import annotations

import json
from pathlib import Path

import pytest

from zmq_omni.config import ConnectorSpec, load_omni_transfer_config
from zmq_omni.errors import ConfigError

VLLM_STYLE = """
async_chunk: true
stage_args:
  - stage_id: 0
    output_connectors: {to_stage_1: zmq_fast}
  - stage_id: 1
    engine_input_source: [0]
    input_connectors: {from_stage_0: zmq_fast}
    output_connectors:
      to_stage_2: {name: InProcConnector, extra: {namespace: demo}}
  - stage_id: 2
    engine_input_source: [1]
runtime:
  connectors:
    zmq_fast: {name: ZmqConnector, extra: {endpoints: {"1": "ipc:///tmp/zo-s1"}}}
  edges: [{from: 0, to: 1, window_size: -1}, {from: 2, to: 3}]
"""


def test_yaml_stage_config_gives_a_spec_per_edge(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(VLLM_STYLE)
    cfg = load_omni_transfer_config(path)
    assert cfg.get_connector_for_edge(0, 1) == ConnectorSpec("ZmqConnector", {"endpoints": {"1": "ipc:///tmp/zo-s1"}})
    assert cfg.get_connector_for_edge("1", "2").name == "InProcConnector"
    # declared edges without a choice get vllm-omni's default
    assert cfg.get_connector_for_edge(2, 3).name == "SharedMemoryConnector"
    assert cfg.edges() == [("0", "1"), ("1", "2"), ("2", "3")]


def test_json_file_and_dict_load_the_same(tmp_path: Path) -> None:
    import yaml

    data = yaml.safe_load(VLLM_STYLE)
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(data))
    assert load_omni_transfer_config(path) == load_omni_transfer_config(data)


def test_missing_edge_raises_naming_it() -> None:
    cfg = load_omni_transfer_config({"runtime": {"connectors": {}}})
    with pytest.raises(ConfigError, match="0->1"):
        cfg.get_connector_for_edge(0, 1)


def test_default_connector_applies_to_every_edge() -> None:
    cfg = load_omni_transfer_config(
        {"runtime": {"connectors": {"c": {"name": "InProcConnector"}}, "default_connector": "c"}}
    )
    assert cfg.get_connector_for_edge(5, 6).name == "InProcConnector"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"stage_args": [{"stage_id": 0, "output_connectors": {"to_stage_1": "nope"}}]}, "nope"),
        ({"stage_args": [{"output_connectors": {}}]}, "stage_id"),
        ({"stage_args": [{"stage_id": 0, "output_connectors": {"stage_1": {"name": "X"}}}]}, "to_stage_"),
        ({"runtime": {"connectors": {"c": {"name": "X", "extras": {}}}}}, "runtime.connectors.c.extras"),
        ({"runtime": {"connectors": {"c": {"extra": {}}}}}, "runtime.connectors.c.name"),
        ({"runtime": {"edges": [{"from": 0}]}}, "runtime.edges[0].to"),
        ({"stage_args": "x"}, "stage_args"),
    ],
)
def test_bad_config_names_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_omni_transfer_config(data)
    assert needle in str(info.value)


def test_edge_ends_that_disagree_raise() -> None:
    data = {
        "stage_args": [
            {"stage_id": 0, "output_connectors": {"to_stage_1": {"name": "A"}}},
            {"stage_id": 1, "input_connectors": {"from_stage_0": {"name": "B"}}},
        ]
    }
    with pytest.raises(ConfigError, match="0->1"):
        load_omni_transfer_config(data)


def test_unreadable_and_invalid_files_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_omni_transfer_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_omni_transfer_config(bad)


def test_spec_is_frozen_and_extra_read_only() -> None:
    spec = ConnectorSpec("InProcConnector", {"namespace": "x"})
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.extra["namespace"] = "y"  # type: ignore[index]
    assert ConnectorSpec.from_dict(spec.to_dict()) == spec
