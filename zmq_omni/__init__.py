"""zmq_omni: move tensors and metadata between inference-pipeline stages over ZeroMQ.

The public surface is re-exported here; backends and adapters are imported
lazily on first use so ``import zmq_omni`` stays cheap.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from .config import (
    ConnectorSpec,
    OmniTransferConfig,
    get_connectors_config_for_stage,
    get_stage_connector_config,
    load_omni_transfer_config,
)
from .connectors import (
    FailureSource,
    Flushable,
    Lingering,
    OmniConnectorBase,
    OmniConnectorFactory,
    TransferFailure,
    WakeupSource,
    create_connector,
)
from .errors import (
    AuthenticationError,
    ClosedResourceError,
    CodecError,
    ConfigError,
    DecodeError,
    DeliveryError,
    EncodeError,
    MessageTooLargeError,
    PeerGoneError,
    ShmError,
    ShmSpaceError,
    TransportError,
    TransportTimeoutError,
    ZmqOmniError,
)

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# name -> module that defines it; imported on first attribute access.
_LAZY: dict[str, str] = {
    "AsyncChunkSender": "zmq_omni.aio",
    "AsyncChunkStream": "zmq_omni.aio",
    "AsyncConnector": "zmq_omni.aio",
    "ChunkInputs": "zmq_omni.adapters",
    "DriverEvent": "zmq_omni.stages",
    "InProcConnector": "zmq_omni.connectors.inproc",
    "KVTransferManager": "zmq_omni.adapters",
    "OmniChunkManager": "zmq_omni.adapters",
    "OmniTransferAdapterBase": "zmq_omni.adapters",
    "PipelineConfig": "zmq_omni.stages",
    "PipelineDriver": "zmq_omni.stages",
    "ReferenceScheduler": "zmq_omni.adapters",
    "RetryPolicy": "zmq_omni.adapters",
    "SharedMemoryConnector": "zmq_omni.connectors.shm",
    "StageSpec": "zmq_omni.stages",
    "StageWorker": "zmq_omni.stages",
    "ZmqConnector": "zmq_omni.connectors.zmq",
    "decode": "zmq_omni.wire",
    "encode": "zmq_omni.wire",
    "load_pipeline_config": "zmq_omni.stages",
    "register_type": "zmq_omni.wire",
    "unregister_type": "zmq_omni.wire",
}

__all__ = [
    "AsyncChunkSender",
    "AsyncChunkStream",
    "AsyncConnector",
    "AuthenticationError",
    "ChunkInputs",
    "ClosedResourceError",
    "CodecError",
    "ConfigError",
    "ConnectorSpec",
    "DecodeError",
    "DeliveryError",
    "DriverEvent",
    "EncodeError",
    "FailureSource",
    "Flushable",
    "InProcConnector",
    "KVTransferManager",
    "Lingering",
    "MessageTooLargeError",
    "OmniChunkManager",
    "OmniConnectorBase",
    "OmniConnectorFactory",
    "OmniTransferAdapterBase",
    "OmniTransferConfig",
    "PeerGoneError",
    "PipelineConfig",
    "PipelineDriver",
    "ReferenceScheduler",
    "RetryPolicy",
    "SharedMemoryConnector",
    "ShmError",
    "ShmSpaceError",
    "StageSpec",
    "StageWorker",
    "TransferFailure",
    "TransportError",
    "TransportTimeoutError",
    "WakeupSource",
    "ZmqConnector",
    "ZmqOmniError",
    "__version__",
    "create_connector",
    "decode",
    "encode",
    "get_connectors_config_for_stage",
    "get_stage_connector_config",
    "load_omni_transfer_config",
    "load_pipeline_config",
    "register_type",
    "unregister_type",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zmq_omni' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
