"""Config: frozen dataclasses built from plain dicts (YAML, JSON, environment).

Unknown or bad keys raise :class:`~zmq_omni.errors.ConfigError` naming the key.
"""

from __future__ import annotations

from .pipeline import (
    ConnectorSpec,
    OmniTransferConfig,
    get_connectors_config_for_stage,
    get_stage_connector_config,
    load_omni_transfer_config,
)
from .zmq import ZmqConnectorConfig

__all__ = [
    "ConnectorSpec",
    "OmniTransferConfig",
    "ZmqConnectorConfig",
    "get_connectors_config_for_stage",
    "get_stage_connector_config",
    "load_omni_transfer_config",
]
