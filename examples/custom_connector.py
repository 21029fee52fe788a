"""A connector of your own, built by the factory from a ``"module:Class"`` name.

No registration call is needed: a connector spec whose name contains ``:``
imports that class (see ``custom_connector.yaml``)::

    runtime:
      connectors:
        audited: {name: "examples.custom_connector:AuditedConnector", extra: {namespace: demo}}

Alternatively register a short name once at import time::

    OmniConnectorFactory.register_connector("Audited", AuditedConnector)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zmq_omni import InProcConnector


class AuditedConnector(InProcConnector):
    """The in-process connector, plus a per-edge count of puts in ``health()``.

    It accepts the ``extra`` keys of :class:`InProcConnector` plus ``label``.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        self.label = str(config.pop("label", "audited"))
        super().__init__(config)
        self.per_edge: dict[str, int] = {}

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        # vllm-omni's parameter names: its callers pass them by keyword.
        result = super().put(from_stage, to_stage, put_key, data)
        if result[0]:
            edge = f"{from_stage}->{to_stage}"
            self.per_edge[edge] = self.per_edge.get(edge, 0) + 1
        return result

    def health(self) -> dict[str, Any]:
        return {**super().health(), "label": self.label, "puts_per_edge": dict(self.per_edge)}
