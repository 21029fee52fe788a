"""Thread-safe counters whose reads are immutable snapshots, and their Prometheus exposition (a leaf room).

Every connector and adapter keeps a :class:`Counters`; ``health()`` returns
``counters.snapshot()`` merged with its status. Counting is cheap (one lock,
one dict update) because it sits on the put/get hot path.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["Counters", "PrometheusExporter", "flatten_health"]


class Counters:
    """A set of named integer counters, safe to bump from any thread."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {name: 0 for name in names}

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` (created at zero if new)."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def set(self, name: str, value: int) -> None:
        """Set a gauge-like counter (for example ``pending``) to ``value``."""
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> int:
        """Current value of ``name`` (0 when never counted)."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> Mapping[str, int]:
        """A read-only copy of every counter at this instant."""
        with self._lock:
            return MappingProxyType(dict(self._values))


_METRIC_NAME = re.compile(r"[^a-zA-Z0-9_]")


def flatten_health(health: Mapping[str, Any], prefix: str = "zmq_omni") -> dict[str, float]:
    """Numeric leaves of a (nested) ``health()`` dict as ``{metric_name: value}``.

    Nested keys join with ``_``; booleans become 0/1; ``status`` becomes
    ``<prefix>_up`` (1 when ``"ok"``); other strings are dropped.
    """
    out: dict[str, float] = {}

    def walk(node: Mapping[str, Any], path: str) -> None:
        for key, value in node.items():
            name = f"{path}_{_METRIC_NAME.sub('_', str(key))}"
            if isinstance(value, Mapping):
                walk(value, name)
            elif key == "status" and isinstance(value, str):
                out[f"{path}_up"] = 1.0 if value == "ok" else 0.0
            elif isinstance(value, (bool, int, float)):
                out[name] = float(value)

    walk(health, prefix)
    return out


class PrometheusExporter:
    """Serve a ``health()`` callable as Prometheus gauges on ``http://addr:port/metrics``.

    Needs the ``metrics`` extra (``pip install 'zmq-omni[metrics]'``). The
    health function is called on each scrape, from the server's thread.
    """

    def __init__(
        self,
        health: Callable[[], Mapping[str, Any]],
        *,
        port: int,
        addr: str = "127.0.0.1",
        prefix: str = "zmq_omni",
    ) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
            from prometheus_client.core import GaugeMetricFamily
        except ImportError as exc:
            raise ImportError("Prometheus metrics need prometheus-client: pip install 'zmq-omni[metrics]'") from exc

        class _Collector:
            def collect(self) -> Iterator[Any]:
                for name, value in sorted(flatten_health(health(), prefix).items()):
                    yield GaugeMetricFamily(name, f"zmq_omni health value {name}", value=value)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector())  # type: ignore[arg-type]
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.port: int = self._server.server_port
        self.addr = addr

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
