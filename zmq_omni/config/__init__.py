"""Config: frozen dataclasses built from plain dicts (YAML, JSON, environment).

Unknown or bad keys raise :class:`~zmq_omni.errors.ConfigError` naming the key.
"""

from __future__ import annotations

from .pipeline import ConnectorSpec, OmniTransferConfig, load_omni_transfer_config
from .zmq import ZmqConnectorConfig

__all__ = ["ConnectorSpec", "OmniTransferConfig", "ZmqConnectorConfig", "load_omni_transfer_config"]
