"""Build connectors by name: the registry behind ``ConnectorSpec.name``.

Built-in backends are imported only when first built, so ``import zmq_omni``
stays cheap. Out-of-tree connectors need no registration: a spec named
``"package.module:Class"`` imports that class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..config import ConnectorSpec
from ..config.fields import import_callable
from ..errors import ConfigError
from .base import OmniConnectorBase

__all__ = ["ConnectorConstructor", "OmniConnectorFactory", "create_connector"]

#: Anything that takes the ``extra`` dict and returns a connector.
ConnectorConstructor = Callable[[dict[str, Any]], OmniConnectorBase]

_BUILTIN: dict[str, str] = {
    "InProcConnector": "zmq_omni.connectors.inproc:InProcConnector",
    "SharedMemoryConnector": "zmq_omni.connectors.shm:SharedMemoryConnector",
    "ZmqConnector": "zmq_omni.connectors.zmq:ZmqConnector",
}


def _import_path(path: str) -> ConnectorConstructor:
    ctor: ConnectorConstructor = import_callable(path, "connector")
    return ctor


class OmniConnectorFactory:
    """The connector registry (class-level, like vllm-omni's factory)."""

    _registry: ClassVar[dict[str, ConnectorConstructor | str]] = dict(_BUILTIN)
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def register_connector(cls, name: str, ctor: ConnectorConstructor | str) -> None:
        """Register ``ctor`` (a callable, or a ``"module:Class"`` path) under ``name``.

        Raises:
            ConfigError: ``name`` is already registered (also a ``ValueError``).
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"connector name must be a non-empty string, got {name!r}")
        with cls._lock:
            if name in cls._registry:
                raise ConfigError(f"connector {name!r} is already registered")
            cls._registry[name] = ctor

    @classmethod
    def unregister_connector(cls, name: str) -> None:
        """Forget ``name`` (for tests and plugins that reload); built-ins cannot be removed."""
        if name in _BUILTIN:
            raise ConfigError(f"built-in connector {name!r} cannot be unregistered")
        with cls._lock:
            cls._registry.pop(name, None)

    @classmethod
    def list_registered_connectors(cls) -> list[str]:
        """Every registered name, sorted."""
        with cls._lock:
            return sorted(cls._registry)

    @classmethod
    def constructor(cls, name: str) -> ConnectorConstructor:
        """What builds the connector named ``name`` (a registered name, or a ``module:Class`` path), imported.

        Raises:
            ConfigError: the name is neither registered nor a ``module:Class`` path.
        """
        with cls._lock:
            entry = cls._registry.get(name)
        if entry is None:
            if ":" not in name:
                known = ", ".join(cls.list_registered_connectors())
                raise ConfigError(f"unknown connector {name!r}; registered: {known}")
            entry = name
        return _import_path(entry) if isinstance(entry, str) else entry

    @classmethod
    def create_connector(cls, spec: ConnectorSpec) -> OmniConnectorBase:
        """Build the connector ``spec`` names, passing it a copy of ``spec.extra``.

        Raises:
            ConfigError: the name is neither registered nor a ``module:Class``
                path, or the constructor rejected its config.
        """
        connector = cls.constructor(spec.name)(dict(spec.extra))
        if not isinstance(connector, OmniConnectorBase):
            raise ConfigError(f"connector {spec.name!r} built a {type(connector).__name__}, not an OmniConnectorBase")
        return connector


def create_connector(spec: ConnectorSpec | Mapping[str, Any]) -> OmniConnectorBase:
    """Build a connector from a :class:`ConnectorSpec` or a plain ``{"name", "extra"}`` dict."""
    if not isinstance(spec, ConnectorSpec):
        spec = ConnectorSpec.from_dict(spec)
    return OmniConnectorFactory.create_connector(spec)
