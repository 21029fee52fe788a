from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from zmq_omni import ConnectorSpec, OmniConnectorFactory, create_connector
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.errors import ConfigError


def test_builtins_are_listed() -> None:
    names = OmniConnectorFactory.list_registered_connectors()
    assert {"InProcConnector", "ZmqConnector", "SharedMemoryConnector"} <= set(names)
    assert names == sorted(names)


def test_create_from_spec_and_from_dict() -> None:
    with create_connector(ConnectorSpec("InProcConnector", {"namespace": "f1"})) as a:
        assert isinstance(a, InProcConnector) and a.namespace == "f1"
    with create_connector({"name": "InProcConnector", "extra": {"namespace": "f2"}}) as b:
        assert isinstance(b, InProcConnector) and b.namespace == "f2"


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        create_connector({"name": "NoSuchConnector"})
    assert "NoSuchConnector" in str(info.value) and "InProcConnector" in str(info.value)
    assert isinstance(info.value, ValueError)  # vllm-omni callers catch ValueError


def test_register_custom_and_duplicate_raises() -> None:
    def make(extra: dict[str, Any]) -> InProcConnector:
        return InProcConnector({"namespace": "custom"})

    OmniConnectorFactory.register_connector("TestCustomConnector", make)
    try:
        with pytest.raises(ConfigError, match="already registered"):
            OmniConnectorFactory.register_connector("TestCustomConnector", make)
        with create_connector({"name": "TestCustomConnector"}) as conn:
            assert conn.namespace == "custom"  # type: ignore[attr-defined]
    finally:
        OmniConnectorFactory.unregister_connector("TestCustomConnector")
    with pytest.raises(ConfigError):
        OmniConnectorFactory.register_connector("ZmqConnector", make)


def test_module_class_path_for_out_of_tree_connectors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_plugin_conn.py").write_text(
        "from zmq_omni.connectors.inproc import InProcConnector\n"
        "class PluginConnector(InProcConnector):\n"
        "    '''A plugin.'''\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with create_connector({"name": "my_plugin_conn:PluginConnector", "extra": {"namespace": "p"}}) as conn:
            assert type(conn).__name__ == "PluginConnector"
        with pytest.raises(ConfigError, match="no attribute"):
            create_connector({"name": "my_plugin_conn:Missing"})
        with pytest.raises(ConfigError, match="cannot import"):
            create_connector({"name": "no_such_module_xyz:Thing"})
    finally:
        sys.modules.pop("my_plugin_conn", None)


def test_non_connector_results_are_rejected() -> None:
    OmniConnectorFactory.register_connector("TestNotAConnector", lambda extra: object())  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(ConfigError, match="not an OmniConnectorBase"):
            create_connector({"name": "TestNotAConnector"})
    finally:
        OmniConnectorFactory.unregister_connector("TestNotAConnector")


def test_bad_extra_raises_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="stage_id"):
        create_connector({"name": "InProcConnector", "extra": {"stage_id": 1.5}})
