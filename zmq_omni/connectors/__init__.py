"""Connectors: the put/get backends and the factory that builds them by name.

Backends are imported lazily by the factory; importing this package does not
import pyzmq sockets or shared-memory code.
"""

from __future__ import annotations

from .base import (
    FailureSource,
    Flushable,
    Lingering,
    OmniConnectorBase,
    TransferFailure,
    WakeupSource,
    bounded_timeout,
    key_matches_prefix,
)
from .factory import OmniConnectorFactory, create_connector

__all__ = [
    "FailureSource",
    "Flushable",
    "Lingering",
    "OmniConnectorBase",
    "OmniConnectorFactory",
    "TransferFailure",
    "WakeupSource",
    "bounded_timeout",
    "create_connector",
    "key_matches_prefix",
]
