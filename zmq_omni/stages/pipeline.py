"""The pipeline YAML model and loader: :class:`PipelineConfig`, :class:`StageSpec` and :func:`load_pipeline_config`.

The pipeline YAML format read by :func:`load_pipeline_config` is documented in
``docs/configuration.md``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..adapters import RetryPolicy
from ..config import ConnectorSpec, OmniTransferConfig, load_omni_transfer_config
from ..config.fields import check_known_keys, import_callable, read_mapping, read_str
from ..config.pipeline import read_config_document
from ..config.reader import read_fields, setting
from ..errors import ConfigError
from ..transport import check_endpoint, env_name
from .keys import ENV_KEYS_DIR, HEALTH_PROBER, KeyFile, Party

__all__ = [
    "ChunkFunction",
    "PipelineConfig",
    "StageSpec",
    "load_pipeline_config",
    "name_stages",
]

#: ``fn(request_id, payload, is_final)`` -> an outgoing chunk (a dict), several (a list or
#: generator of dicts), or None (nothing to send for this input).
ChunkFunction = Callable[[str, dict[str, Any], bool], Any]

# "stage 2", "stage '2'": how the layers that know only ids name a stage in a message.
_STAGE_BY_ID = re.compile(r"\bstage (['\"]?)([\w.-]+)\1(?![\w.-])")


def name_stages(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each "stage <id>" that ``names`` knows written as "stage '<name>'".

    The transfer layers below a pipeline know stages by id only; the pipeline's
    YAML names them, and a person reads those names ("vocoder", not "2").
    """

    def named(match: re.Match[str]) -> str:
        name = names.get(match.group(2))
        return match.group(0) if name is None or name == match.group(2) else f"stage {name!r}"

    return _STAGE_BY_ID.sub(named, text)


#: Connector names that get ``endpoints`` / ``bind`` from the pipeline section.
_ENDPOINT_CONNECTORS = ("ZmqConnector",)


# -- the pipeline YAML ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage of a pipeline (or the driver) as declared in the ``pipeline`` section.

    Attributes:
        name: the stage's name (``zmq-omni stage --stage NAME``).
        stage_id: the id used in chunk keys and edges (``stage_args[].stage_id``).
        function: ``"module:function"`` called per chunk; None for the driver.
        params: when given, ``function`` is a factory called as ``function(**params)``
            that returns the per-chunk function.
        endpoint: the address peers connect to for this stage (after the
            ``ZMQ_OMNI_ENDPOINT_<STAGE_ID>`` environment override).
        bind: the address this stage binds when it differs from ``endpoint``.
    """

    name: str
    stage_id: str
    function: str | None = None
    params: Mapping[str, Any] | None = None
    endpoint: str | None = None
    bind: str | None = None

    def load_function(self) -> ChunkFunction:
        """Import ``function`` (and call it with ``params`` when given).

        Raises:
            ConfigError: no function, a bad path, or the import failed.
        """
        if not self.function:
            raise ConfigError(f"stage {self.name!r} names no 'function'")
        target = import_callable(self.function, f"stage {self.name!r}: function")
        if self.params is not None:
            try:
                target = target(**dict(self.params))
            except TypeError as exc:
                raise ConfigError(f"stage {self.name!r}: params do not fit {self.function!r}: {exc}") from exc
            if not callable(target):
                raise ConfigError(f"stage {self.name!r}: {self.function!r}(**params) did not return a callable")
        fn: ChunkFunction = target
        return fn


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """A linear pipeline: driver -> stages[0] -> ... -> stages[-1] -> driver.

    Attributes:
        name: a label for logs.
        stages: the stages in pipeline order.
        driver: the driver's pseudo-stage (it sends to the first stage and
            receives from the last).
        transfer: the connector chosen for each edge (vllm-omni
            ``stage_args`` / ``runtime`` sections).
        stall_timeout_s: a request whose upstream sends nothing for this long fails.
        request_timeout_s: the driver fails a request that has not completed
            this long after it was submitted.
        retry: the send retry policy of every stage.
        keys_dir: the directory of the CURVE key files (``zmq-omni keygen``);
            ``ZMQ_OMNI_KEYS_DIR`` overrides ``pipeline.keys_dir``. With it, every
            ZeroMQ edge of a stage uses that stage's ``<name>.keys``.
        insecure: explicit opt-out: ZeroMQ edges may use plaintext TCP off the
            host (``insecure: true`` on each of them; see ``docs/security.md``).
    """

    name: str = "pipeline"
    stages: tuple[StageSpec, ...]
    driver: StageSpec
    transfer: OmniTransferConfig
    stall_timeout_s: float = setting(10.0, minimum=0.001)
    request_timeout_s: float = setting(120.0, minimum=0.001)
    retry: RetryPolicy = setting(default_factory=RetryPolicy, read=RetryPolicy.read)
    keys_dir: str | None = None
    insecure: bool = False

    def key_file(self, name: str) -> KeyFile | None:
        """The CURVE key file of party ``name`` (a stage, the driver, ``health``); None without ``keys_dir``.

        Raises:
            ConfigError: ``keys_dir`` is set but the file is missing or malformed.
        """
        if self.keys_dir is None:
            return None
        path = KeyFile.path_in(self.keys_dir, name)
        if not path.exists():
            raise ConfigError(
                f"no CURVE key file for {name!r} in keys_dir {self.keys_dir!r}: run "
                f"'zmq-omni keygen --config PIPELINE.yaml --out-dir {self.keys_dir}'"
            )
        return KeyFile.load(path)

    def probe_keys(self, prober: str, target: StageSpec) -> dict[str, str]:
        """``probe()`` keyword arguments for ``prober`` (a party name) probing ``target``; {} without keys.

        Raises:
            ConfigError: the prober's key file does not know ``target``'s public key.
        """
        keys = self.key_file(prober)
        if keys is None:
            return {}
        server = keys.servers.get(target.stage_id)
        if server is None:
            raise ConfigError(f"CURVE key file of {prober!r} has no public key of stage {target.name!r}")
        return {"server_key": server, "public_key": keys.public_key, "secret_key": keys.secret_key}

    def stage(self, name: str) -> StageSpec:
        """The stage called ``name`` (or the driver, by its name).

        Raises:
            ConfigError: no such stage (the message lists the known names).
        """
        for spec in (*self.stages, self.driver):
            if spec.name == name:
                return spec
        known = ", ".join(spec.name for spec in self.stages)
        raise ConfigError(f"pipeline {self.name!r} has no stage {name!r} (stages: {known})")

    def neighbours(self, spec: StageSpec) -> tuple[StageSpec, StageSpec]:
        """``(upstream, downstream)`` of a stage; the driver closes the loop at both ends."""
        if spec == self.driver:
            return self.stages[-1], self.stages[0]
        index = self.stages.index(spec)
        upstream = self.stages[index - 1] if index > 0 else self.driver
        downstream = self.stages[index + 1] if index + 1 < len(self.stages) else self.driver
        return upstream, downstream

    def trust(self) -> tuple[Party, ...]:
        """Who trusts whom, from the topology: every party of the CURVE key files (``zmq-omni keygen``).

        Each stage admits its neighbours, the driver (it probes every stage before
        driving), the health prober and itself (a healthcheck beside the stage probes
        it with the stage's own key), and knows the public keys of its neighbours
        (push mode connects downstream, pull mode upstream). The driver knows every
        stage's key; the health prober knows every key and admits nobody.

        Raises:
            ConfigError: a stage is called ``health`` (the health prober's name).
        """
        parties = (*self.stages, self.driver)
        if any(spec.name == HEALTH_PROBER for spec in parties):
            raise ConfigError(f"a stage may not be called {HEALTH_PROBER!r}: that is the health prober's key file")
        trusted: list[Party] = []
        for spec in parties:
            peers = tuple(dict.fromkeys(self.neighbours(spec)))
            known = parties if spec == self.driver else peers
            servers = tuple(other.name for other in known if other != spec)
            clients = (*dict.fromkeys(other.name for other in (spec, *peers, self.driver)), HEALTH_PROBER)
            trusted.append(Party(spec.name, spec.stage_id, servers=servers, clients=clients))
        trusted.append(Party(HEALTH_PROBER, None, servers=tuple(spec.name for spec in parties)))
        return tuple(trusted)

    def stage_names(self) -> dict[str, str]:
        """Stage id -> name, for every stage and the driver (for messages people read)."""
        return {spec.stage_id: spec.name for spec in (*self.stages, self.driver)}

    def endpoints(self) -> dict[str, str]:
        """Stage id -> endpoint, for every stage (and the driver) that declares one."""
        return {spec.stage_id: spec.endpoint for spec in (*self.stages, self.driver) if spec.endpoint}

    def edge_specs(self, spec: StageSpec) -> tuple[ConnectorSpec, ConnectorSpec]:
        """``(inbound, outbound)`` connector specs of a stage, ready for the factory.

        Each is the spec chosen for the edge in ``stage_args`` / ``runtime``
        (``ZmqConnector`` when neither configures the edge and the receiving
        stage has an endpoint) with ``stage_id`` and ``role`` filled in (as
        vllm-omni does); ZeroMQ
        connectors also get ``endpoints`` from the pipeline section and, on the
        inbound side, ``bind``.
        """
        upstream, downstream = self.neighbours(spec)
        inbound = self._edge(upstream, spec)
        outbound = self._edge(spec, downstream)
        return (
            self._fill(inbound, spec, "receiver", spec),
            self._fill(outbound, spec, "sender", downstream),
        )

    def _edge(self, sender: StageSpec, receiver: StageSpec) -> ConnectorSpec:
        """The edge's spec; an edge nobody configured between stages with endpoints uses ZmqConnector."""
        try:
            return self.transfer.get_connector_for_edge(sender.stage_id, receiver.stage_id)
        except ConfigError:
            if receiver.endpoint:
                return ConnectorSpec("ZmqConnector")
            raise

    def _fill(self, base: ConnectorSpec, me: StageSpec, role: str, peer: StageSpec) -> ConnectorSpec:
        extra = dict(base.extra)
        extra.setdefault("stage_id", me.stage_id)
        extra["role"] = role
        if base.name in _ENDPOINT_CONNECTORS or "endpoints" in extra:
            endpoints = {str(k): v for k, v in dict(extra.get("endpoints") or {}).items()}
            if peer.endpoint:
                endpoints[peer.stage_id] = peer.endpoint
            if not endpoints.get(peer.stage_id):
                raise ConfigError(
                    f"stage {peer.name!r} has no endpoint: set pipeline.stages[].endpoint or {env_name(peer.stage_id)}"
                )
            extra["endpoints"] = endpoints
            if role == "receiver" and me.bind and "bind" not in extra:
                extra["bind"] = me.bind
        if base.name in _ENDPOINT_CONNECTORS:
            keys = self.key_file(me.name)
            # Keys written into the connector's own extra win over the pipeline's key files.
            if keys is not None and "curve_secret_key" not in extra:
                extra.update(keys.curve_extra())
            if self.insecure:
                extra.setdefault("insecure", True)
        return ConnectorSpec(base.name, extra)


_STAGE_KEYS = ("name", "stage_id", "function", "params", "endpoint", "bind")
_PIPELINE_KEYS = tuple(name for name in PipelineConfig.__dataclass_fields__ if name != "transfer")
#: The fields of PipelineConfig that load_pipeline_config reads itself (the others are read by their declarations).
_READ_HERE = ("stages", "driver", "transfer", "keys_dir")


def _read_stage(data: Any, path: str, *, driver: bool, environ: Mapping[str, str]) -> StageSpec:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must be a mapping")
    check_known_keys(data, _STAGE_KEYS, path)
    stage_id = read_str(data, "stage_id", "driver" if driver else None, path)
    if stage_id is None:
        raise ConfigError(f"missing required config key '{path}.stage_id'")
    name = read_str(data, "name", stage_id if driver else None, path)
    if name is None:
        raise ConfigError(f"missing required config key '{path}.name'")
    function = read_str(data, "function", None, path)
    if not driver and not function:
        raise ConfigError(f"missing required config key '{path}.function' (\"package.module:function\")")
    params = data.get("params")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"config key '{path}.params' must be a mapping, got {params!r}")
    endpoint = environ.get(env_name(stage_id)) or read_str(data, "endpoint", None, path)
    where = f"{env_name(stage_id)}" if environ.get(env_name(stage_id)) else f"{path}.endpoint"
    if endpoint is not None:
        check_endpoint(endpoint, where)
    bind = read_str(data, "bind", None, path)
    if bind is not None:
        check_endpoint(bind, f"{path}.bind")
    return StageSpec(
        name=name,
        stage_id=stage_id,
        function=function,
        params=None if params is None else MappingProxyType(dict(params)),
        endpoint=endpoint,
        bind=bind,
    )


def load_pipeline_config(
    source: str | Path | Mapping[str, Any], *, environ: Mapping[str, str] | None = None
) -> PipelineConfig:
    """Load a pipeline from a YAML/JSON file or a dict.

    The ``pipeline`` section names the stages in order (``name``,
    ``stage_id``, ``function``, ``endpoint``...) and the driver; the
    vllm-omni sections ``stage_args`` and ``runtime`` choose the connector of
    each edge (:func:`~zmq_omni.config.load_omni_transfer_config`). An edge
    that no stage declares uses ``runtime.default_connector``.

    ``ZMQ_OMNI_ENDPOINT_<STAGE_ID>`` environment variables override endpoints
    (the same variables :class:`ZmqConnector` reads), so one file serves a
    laptop and a container deployment. ``pipeline.keys_dir`` (or
    ``ZMQ_OMNI_KEYS_DIR``) turns CURVE on for every ZeroMQ edge; a relative
    path is relative to the YAML file.

    Raises:
        ConfigError: a key is missing, unknown or malformed (the message names it).
    """
    env = os.environ if environ is None else environ
    data = read_config_document(source, "pipeline config")
    section = read_mapping(data, "pipeline", None, "")
    if section is None:
        raise ConfigError("missing required config key 'pipeline' (the stages of the pipeline)")
    check_known_keys(section, _PIPELINE_KEYS, "pipeline")
    raw_stages = section.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise ConfigError("config key 'pipeline.stages' must be a non-empty list of stages")
    stages = tuple(
        _read_stage(raw, f"pipeline.stages[{i}]", driver=False, environ=env) for i, raw in enumerate(raw_stages)
    )
    driver = _read_stage(read_mapping(section, "driver", {}, "pipeline"), "pipeline.driver", driver=True, environ=env)
    for label in ("name", "stage_id"):
        values = [getattr(spec, label) for spec in (*stages, driver)]
        duplicates = sorted({value for value in values if values.count(value) > 1})
        if duplicates:
            raise ConfigError(f"pipeline: duplicate stage {label} {duplicates[0]!r} (the driver counts too)")
    # Two stages at one address: one of them cannot bind it, and senders could not tell them apart.
    owner: dict[str, StageSpec] = {}
    for spec in (*stages, driver):
        if not spec.endpoint:
            continue
        first = owner.setdefault(spec.endpoint, spec)
        if first is not spec:
            raise ConfigError(
                f"pipeline: stages {first.name!r} and {spec.name!r} have the same endpoint "
                f"{spec.endpoint!r}; each stage needs its own"
            )
    transfer = load_omni_transfer_config(data)
    assert transfer is not None  # a document was given
    keys_dir = env.get(ENV_KEYS_DIR) or read_str(section, "keys_dir", None, "pipeline")
    if keys_dir and not isinstance(source, Mapping) and not env.get(ENV_KEYS_DIR):
        keys_dir = str(Path(source).parent / keys_dir)  # an absolute keys_dir stays as it is
    return PipelineConfig(
        stages=stages,
        driver=driver,
        transfer=transfer,
        keys_dir=keys_dir or None,
        **read_fields(PipelineConfig, section, "pipeline", skip=_READ_HERE),
    )
