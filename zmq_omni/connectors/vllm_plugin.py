"""Registration of our connectors in vllm-omni's ``OmniConnectorFactory``.

Installed as a ``vllm.general_plugins`` entry point (``pyproject.toml``), so
every process in which vLLM loads its general plugins registers them
automatically once both packages are installed; elsewhere call
:func:`register` yourself (one line, idempotent). The names never clash with
vllm-omni's built-ins: its own ``SharedMemoryConnector`` keeps its name and
ours is ``ZmqOmniSharedMemoryConnector``. See ``docs/vllm-omni.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["VLLM_OMNI_NAMES", "register"]

log = logging.getLogger("zmq_omni.connectors")

#: The name each of our connectors gets in vllm-omni's factory -> ``module:Class`` of ours.
VLLM_OMNI_NAMES: dict[str, str] = {
    "ZmqConnector": "zmq_omni.connectors.zmq:ZmqConnector",
    "ZmqOmniSharedMemoryConnector": "zmq_omni.connectors.shm:SharedMemoryConnector",
    "ZmqOmniInProcConnector": "zmq_omni.connectors.inproc:InProcConnector",
}

_FACTORY_MODULE = "vllm_omni.distributed.omni_connectors.factory"


def _constructor(path: str) -> Callable[[dict[str, Any]], Any]:
    """A constructor that imports our class only when vllm-omni first builds that connector."""

    def build(config: dict[str, Any]) -> Any:
        from ..config.fields import import_callable

        return import_callable(path, "connector")(config)

    build.__qualname__ = build.__name__ = f"zmq_omni:{path.rpartition(':')[2]}"
    build.zmq_omni_target = path  # type: ignore[attr-defined]  # marks the constructor as ours
    return build


def register(factory: Any = None) -> list[str]:
    """Register our connectors in vllm-omni's factory; return the names registered by this call.

    Safe to call any number of times and in any process: a name already
    registered is left as it is (ours from an earlier call, or someone
    else's, which is logged). Without vllm-omni installed it does nothing.

    Args:
        factory: the factory class; default vllm-omni's ``OmniConnectorFactory``.
    """
    if factory is None:
        try:
            import importlib

            factory = importlib.import_module(_FACTORY_MODULE).OmniConnectorFactory
        except ImportError:
            log.debug("vllm-omni is not installed: no connector registered")
            return []
    registered: list[str] = []
    for name, path in VLLM_OMNI_NAMES.items():
        if name in factory.list_registered_connectors():
            current = getattr(factory, "_registry", {}).get(name)
            if getattr(current, "zmq_omni_target", None) != path:
                log.warning("vllm-omni already has a connector named %r; ours is not registered under it", name)
            continue
        ctor = _constructor(path)
        try:
            # Our connectors send and receive through one instance, so vllm-omni may merge a stage's
            # inbound and outbound edges into one role="dual" connector.
            factory.register_connector(name, ctor, supports_dual=True)
        except TypeError:  # a factory older than the supports_dual keyword
            factory.register_connector(name, ctor)
        except ValueError:  # registered concurrently by another thread
            continue
        registered.append(name)
    if registered:
        log.info("registered %s in vllm-omni's connector factory", ", ".join(registered))
    return registered
