"""Config: frozen dataclasses built from plain dicts (YAML, JSON, environment).

A bad value, or an unknown key where only ours belong (pipeline files, adapter
configs), raises :class:`~zmq_omni.errors.ConfigError` naming the key. A
connector's ``extra`` is the exception: it may carry keys for other components
(vllm-omni's stage input processors), which are kept and exposed as
``connector.config`` (a :class:`ConnectorExtra`); a near-miss of one of our keys
is logged as a warning. Each config declares its keys once, on its dataclass
fields; :mod:`zmq_omni.config.reader` reads them.
"""

from __future__ import annotations

from .extra import ConnectorExtra
from .pipeline import (
    ConnectorSpec,
    OmniTransferConfig,
    get_connectors_config_for_stage,
    get_stage_connector_config,
    load_omni_transfer_config,
)
from .zmq import ZmqConnectorConfig

__all__ = [
    "ConnectorExtra",
    "ConnectorSpec",
    "OmniTransferConfig",
    "ZmqConnectorConfig",
    "get_connectors_config_for_stage",
    "get_stage_connector_config",
    "load_omni_transfer_config",
]
