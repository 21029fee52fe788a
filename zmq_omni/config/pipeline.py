"""Connector specs and vllm-omni-style stage configs.

A stage config names connector specs once, under ``runtime.connectors``, and
each stage picks one per edge::

    stage_args:
      - stage_id: 0
        output_connectors: {to_stage_1: fast}
      - stage_id: 1
        input_connectors: {from_stage_0: fast}
    runtime:
      connectors:
        fast: {name: ZmqConnector, extra: {endpoints: {"1": "ipc:///tmp/s1"}}}

:func:`load_omni_transfer_config` turns that (a dict, or a YAML/JSON file)
into an :class:`OmniTransferConfig` whose :meth:`~OmniTransferConfig.get_connector_for_edge`
answers "which connector moves data from stage A to stage B".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError
from .fields import check_known_keys, read_mapping, read_str

__all__ = [
    "ConnectorSpec",
    "OmniTransferConfig",
    "get_connectors_config_for_stage",
    "get_stage_connector_config",
    "load_omni_transfer_config",
    "read_config_document",
    "read_connector_spec",
]

#: The connector an edge gets when it is declared but names none (vllm-omni's default).
DEFAULT_EDGE_CONNECTOR = "SharedMemoryConnector"
#: vllm-omni's ``default_shm_threshold``: written as ``shm_threshold_bytes`` into those edges.
DEFAULT_SHM_THRESHOLD = 65536


@dataclass(frozen=True)
class ConnectorSpec:
    """Which connector to build (``name``) and the dict its constructor takes (``extra``)."""

    name: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"connector spec 'name' must be a non-empty string, got {self.name!r}")
        if not isinstance(self.extra, Mapping):
            raise ConfigError(f"connector spec 'extra' must be a mapping, got {type(self.extra).__name__}")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "connector") -> ConnectorSpec:
        """Build from ``{"name": ..., "extra": {...}}``; other keys raise ``ConfigError``."""
        check_known_keys(data, ("name", "extra"), path)
        return cls(read_str(data, "name", path=path), dict(read_mapping(data, "extra", {}, path)))

    def to_dict(self) -> dict[str, Any]:
        """The plain-dict form (what :meth:`from_dict` reads)."""
        return {"name": self.name, "extra": dict(self.extra)}


def read_connector_spec(data: Mapping[str, Any], key: str, path: str) -> ConnectorSpec:
    """The spec under ``data[key]``: a :class:`ConnectorSpec`, or its dict form (errors name ``path.key``).

    A :func:`~zmq_omni.config.reader.setting` reader for a config's ``connector`` field.
    """
    value = data[key]
    return (
        value if isinstance(value, ConnectorSpec) else ConnectorSpec.from_dict(value, f"{path}.{key}" if path else key)
    )


@dataclass(frozen=True)
class OmniTransferConfig:
    """The connector chosen for each edge ``(from_stage, to_stage)`` of a pipeline."""

    connectors: Mapping[tuple[str, str], ConnectorSpec]
    default_connector: ConnectorSpec | None = None

    def get_connector_for_edge(self, from_stage: str | int, to_stage: str | int) -> ConnectorSpec:
        """The spec for the edge, else the default; ``ConfigError`` when there is neither."""
        edge = (str(from_stage), str(to_stage))
        spec = self.connectors.get(edge, self.default_connector)
        if spec is None:
            known = ", ".join(f"{a}->{b}" for a, b in sorted(self.connectors)) or "none"
            raise ConfigError(f"no connector configured for edge {edge[0]}->{edge[1]} (edges: {known})")
        return spec

    def has_connector_for_edge(self, from_stage: str | int, to_stage: str | int) -> bool:
        """True when :meth:`get_connector_for_edge` has an answer (vllm-omni's helper of the same name)."""
        return (str(from_stage), str(to_stage)) in self.connectors or self.default_connector is not None

    def edges(self) -> list[tuple[str, str]]:
        """Every configured edge, sorted."""
        return sorted(self.connectors)


def read_config_document(source: str | Path | Mapping[str, Any], what: str = "config file") -> Mapping[str, Any]:
    """A config mapping from a dict (returned as is), a ``.json`` file, or a YAML file.

    Raises:
        ConfigError: the file cannot be read or parsed, or its top level is not a mapping.
    """
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from exc
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON: {exc}") from exc
    else:
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("reading YAML needs PyYAML, a dependency of zmq-omni: pip install PyYAML") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def _spec_ref(value: Any, named: Mapping[str, ConnectorSpec], where: str) -> ConnectorSpec:
    """A per-edge choice: the name of a ``runtime.connectors`` entry, or an inline spec."""
    if isinstance(value, str):
        if value not in named:
            known = ", ".join(sorted(named)) or "none"
            raise ConfigError(f"{where}: unknown connector {value!r} (runtime.connectors has: {known})")
        return named[value]
    if isinstance(value, Mapping):
        return ConnectorSpec.from_dict(value, where)
    raise ConfigError(f"{where}: expected a connector name or {{name, extra}}, got {value!r}")


def _edge_stage(key: str, prefix: str, where: str) -> str:
    if not isinstance(key, str) or not key.startswith(prefix) or not key[len(prefix) :]:
        raise ConfigError(f"{where}: edge key {key!r} must look like '{prefix}<stage_id>'")
    return key[len(prefix) :]


def load_omni_transfer_config(
    config_path: str | Path | Mapping[str, Any] | None = None,
    config_dict: Mapping[str, Any] | None = None,
    default_shm_threshold: int = DEFAULT_SHM_THRESHOLD,
) -> OmniTransferConfig | None:
    """Load a vllm-omni-style stage config from a YAML/JSON file or a dict; None when given neither.

    The call forms are vllm-omni's (``load_omni_transfer_config(path)``,
    ``load_omni_transfer_config(config_dict=d, default_shm_threshold=n)``);
    a dict may also come as the first argument.

    Reads ``runtime.connectors`` (named specs), each stage's
    ``input_connectors`` (``from_stage_X``) and ``output_connectors``
    (``to_stage_Y``), and declared edges without a connector
    (``runtime.edges`` entries, ``engine_input_source``), which get
    ``runtime.default_connector``, else ``SharedMemoryConnector`` with
    ``shm_threshold_bytes: default_shm_threshold`` as vllm-omni does. A
    top-level ``stages``/``connectors``/``edges`` document is read as
    ``stage_args``/``runtime.connectors``/``runtime.edges``.

    Raises:
        ConfigError: a key is missing or malformed, a connector name is
            unknown, or the two ends of an edge choose different connectors.
    """
    if config_path is None and config_dict is None:
        return None
    source = config_path if config_path is not None else config_dict
    assert source is not None
    return _load_transfer_config(source, default_shm_threshold)


def _normalise_stages_schema(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """vllm-omni's newer top-level ``connectors``/``edges``/``stages`` document as ``runtime`` + ``stage_args``."""
    if "stages" not in data or "stage_args" in data:
        return data
    out = dict(data)
    runtime = dict(read_mapping(out, "runtime", {}, ""))
    for key in ("connectors", "edges"):
        if key in out and key not in runtime:
            runtime[key] = out.pop(key)
    out["runtime"] = runtime
    out["stage_args"] = out.pop("stages")
    return out


def _load_transfer_config(source: str | Path | Mapping[str, Any], default_shm_threshold: int) -> OmniTransferConfig:
    data = _normalise_stages_schema(read_config_document(source))
    runtime = read_mapping(data, "runtime", {}, "")
    raw_named = read_mapping(runtime, "connectors", {}, "runtime")
    named = {
        str(name): ConnectorSpec.from_dict(spec, f"runtime.connectors.{name}")
        if isinstance(spec, Mapping)
        else _spec_ref(spec, {}, f"runtime.connectors.{name}")
        for name, spec in raw_named.items()
    }
    default_raw = runtime.get("default_connector")
    default = (
        _spec_ref(default_raw, named, "runtime.default_connector")
        if default_raw is not None
        else ConnectorSpec(DEFAULT_EDGE_CONNECTOR, {"shm_threshold_bytes": default_shm_threshold})
    )

    chosen: dict[tuple[str, str], tuple[ConnectorSpec, str]] = {}

    def choose(edge: tuple[str, str], spec: ConnectorSpec, where: str) -> None:
        if edge in chosen and chosen[edge][0] != spec:
            raise ConfigError(
                f"{where}: edge {edge[0]}->{edge[1]} uses {spec.name!r} here but {chosen[edge][0].name!r} "
                f"at {chosen[edge][1]}"
            )
        chosen[edge] = (spec, where)

    stages = data.get("stage_args", [])
    if not isinstance(stages, list):
        raise ConfigError("stage_args must be a list of stages")
    implicit: list[tuple[str, str]] = []
    for index, stage in enumerate(stages):
        where = f"stage_args[{index}]"
        if not isinstance(stage, Mapping):
            raise ConfigError(f"{where} must be a mapping")
        stage_id = read_str(stage, "stage_id", path=where)
        for key, value in read_mapping(stage, "input_connectors", {}, where).items():
            from_stage = _edge_stage(key, "from_stage_", f"{where}.input_connectors")
            choose((from_stage, stage_id), _spec_ref(value, named, f"{where}.input_connectors.{key}"), where)
        for key, value in read_mapping(stage, "output_connectors", {}, where).items():
            to_stage = _edge_stage(key, "to_stage_", f"{where}.output_connectors")
            choose((stage_id, to_stage), _spec_ref(value, named, f"{where}.output_connectors.{key}"), where)
        sources = stage.get("engine_input_source") or []
        if not isinstance(sources, list):
            raise ConfigError(f"{where}.engine_input_source must be a list of stage ids")
        implicit.extend((str(src), stage_id) for src in sources)

    edges = runtime.get("edges") or []
    if not isinstance(edges, list):
        raise ConfigError("runtime.edges must be a list of {from, to}")
    for index, edge in enumerate(edges):
        where = f"runtime.edges[{index}]"
        if not isinstance(edge, Mapping):
            raise ConfigError(f"{where} must be a mapping with 'from' and 'to'")
        implicit.append((read_str(edge, "from", path=where), read_str(edge, "to", path=where)))

    connectors = {edge: spec for edge, (spec, _) in chosen.items()}
    for edge in implicit:
        connectors.setdefault(edge, default)
    return OmniTransferConfig(MappingProxyType(connectors), default if default_raw is not None else None)


def get_connectors_config_for_stage(transfer_config: OmniTransferConfig | None, stage_id: str | int) -> dict[str, Any]:
    """The connector specs one stage worker needs, in vllm-omni's shape (its function of the same name).

    Returns ``{"from_stage_X": {"spec": {"name", "extra"}}}`` for each inbound
    edge, with ``role: receiver`` (unless set) and ``from_stage``/``to_stage``
    as ints where they are numeric; stage ``0`` also gets ``to_stage_Y``
    entries for its outbound edges with ``role: sender``. ``{}`` for no config.
    """
    if transfer_config is None:
        return {}
    target = str(stage_id)
    out: dict[str, Any] = {}
    for (from_stage, to_stage), spec in transfer_config.connectors.items():
        if to_stage == target:
            name, role = f"from_stage_{from_stage}", "receiver"
        elif from_stage == target and target == "0":
            name, role = f"to_stage_{to_stage}", "sender"
        else:
            continue
        extra = dict(spec.extra)
        extra.setdefault("role", role)
        extra["from_stage"] = _as_int(from_stage)
        extra["to_stage"] = _as_int(to_stage)
        out[name] = {"spec": {"name": spec.name, "extra": extra}}
    return out


def get_stage_connector_config(transfer_config: OmniTransferConfig | None, stage_id: int | str) -> dict[str, Any]:
    """vllm-omni's wrapper of :func:`get_connectors_config_for_stage` (``{}`` for no config)."""
    return get_connectors_config_for_stage(transfer_config, stage_id)


def _as_int(stage: str) -> str | int:
    # vllm-omni injects int(from_stage); our stage ids may also be names, which stay strings.
    return int(stage) if stage.isdigit() else stage
