"""The stage worker API: run one pipeline stage, or drive a pipeline, in a few lines.

A **stage worker** owns the connectors of its two edges (inbound from the
upstream stage, outbound to the downstream stage) and an
:class:`~zmq_omni.adapters.OmniChunkManager`, and calls a user function per
received chunk::

    def talker(request_id, payload, is_final):
        return {"codes": make_codes(payload["hidden"])}   # or a list / generator of chunks, or None

    with StageWorker.from_pipeline("pipeline.yaml", "talker", fn=talker) as worker:
        worker.run()            # until worker.stop() (from a signal handler or another thread)

A **pipeline driver** (:class:`PipelineDriver`) submits requests to the first
stage and collects the last stage's chunks; every request ends as completed
or failed (stalled upstream, dead stage, request timeout), never waits forever.

How a downstream stage learns about a new request:
    chunk keys are ``{request_id}_{stage_id}_{n}`` (the chunk manager's keys),
    so a receiver must know a request id before it can read its chunks. For
    every new request a worker therefore also puts a small *announcement*
    ``{"request_id": ...}`` under ``_zo_req_{stage_id}_{seq}`` (``seq`` = 0, 1,
    2, ... per sending process); the downstream stage reads announcements in
    order and registers each request with ``load_async``. Announcements are
    read with a look-ahead window, so one lost announcement does not block the
    ones behind it, and a restarted upstream (whose ``seq`` starts again at 0)
    is picked up. A restarted *downstream* stage does not learn about requests
    announced before it came back: restart a pipeline from its last stage.

Reserved payload keys (removed before the user function sees the payload):
    ``_zo_error``: a request failed upstream; the worker forwards the error to
    the next stage at once instead of calling the function, so the driver
    learns of the failure without waiting for a stall timeout.
    ``_zo_trace``: ``{stage_id: [t_received, t_sent]}`` wall-clock stamps of
    each hop, used for per-hop latency figures.

The pipeline YAML format read by :func:`load_pipeline_config` is documented in
``docs/configuration.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from ..config import ConnectorSpec, OmniTransferConfig, load_omni_transfer_config
from ..config._fields import check_known_keys, import_callable, read_float, read_mapping, read_str
from ..config.pipeline import read_config_document
from ..connectors import OmniConnectorBase, TransferFailure, create_connector
from ..errors import ConfigError, TransportError
from ..transport._endpoints import check_endpoint, env_name
from .chunk import ChunkInputs, ChunkManagerConfig, OmniChunkManager
from .retry import RetryPolicy

__all__ = [
    "ChunkFunction",
    "DriverEvent",
    "PipelineConfig",
    "PipelineDriver",
    "StageSpec",
    "StageWorker",
    "load_pipeline_config",
]

logger = logging.getLogger("zmq_omni.adapters")

#: ``fn(request_id, payload, is_final)`` -> an outgoing chunk (a dict), several (a list or
#: generator of dicts), or None (nothing to send for this input).
ChunkFunction = Callable[[str, dict[str, Any], bool], Any]

ERROR_KEY = "_zo_error"
TRACE_KEY = "_zo_trace"
ANNOUNCE_PREFIX = "_zo_req_"
#: How far past the next expected announcement a receiver looks for later ones.
_ANNOUNCE_WINDOW = 16
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
    """

    name: str
    stages: tuple[StageSpec, ...]
    driver: StageSpec
    transfer: OmniTransferConfig
    stall_timeout_s: float = 10.0
    request_timeout_s: float = 120.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

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
                    f"stage {peer.name!r} has no endpoint: set pipeline.stages[].endpoint or "
                    f"{env_name(peer.stage_id)}"
                )
            extra["endpoints"] = endpoints
            if role == "receiver" and me.bind and "bind" not in extra:
                extra["bind"] = me.bind
        return ConnectorSpec(base.name, extra)


_STAGE_KEYS = ("name", "stage_id", "function", "params", "endpoint", "bind")
_PIPELINE_KEYS = ("name", "stages", "driver", "stall_timeout_s", "request_timeout_s", "retry")


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
    return StageSpec(name=name, stage_id=stage_id, function=function,
                     params=None if params is None else MappingProxyType(dict(params)),
                     endpoint=endpoint, bind=bind)


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
    laptop and a container deployment.

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
    return PipelineConfig(
        name=read_str(section, "name", "pipeline", "pipeline"),
        stages=stages,
        driver=driver,
        transfer=load_omni_transfer_config(data),
        stall_timeout_s=read_float(section, "stall_timeout_s", 10.0, "pipeline", minimum=0.001),
        request_timeout_s=read_float(section, "request_timeout_s", 120.0, "pipeline", minimum=0.001),
        retry=RetryPolicy.from_dict(read_mapping(section, "retry", {}, "pipeline"), "pipeline.retry"),
    )


# -- one connector for two edges ------------------------------------------------------------------
class _EdgePair(OmniConnectorBase):
    """Puts go to the outbound connector, gets come from the inbound one.

    The chunk manager works over one connector; a stage has two edges, each
    with its own backend (chosen per edge in YAML), so this routes between them.
    """

    def __init__(self, inbound: OmniConnectorBase, outbound: OmniConnectorBase) -> None:
        super().__init__()
        self.inbound = inbound
        self.outbound = outbound
        # The adapter waits on these when the backend offers them (fewer wakeups).
        for name in ("get_wakeup_generation", "wait_for_change"):
            method = getattr(inbound, name, None)
            if callable(method):
                setattr(self, name, method)

    def put(self, from_stage: str, to_stage: str, key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Put through the outbound connector."""
        return self.outbound.put(from_stage, to_stage, key, data)

    def get(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Get from the inbound connector."""
        return self.inbound.get(from_stage, to_stage, key, metadata)

    def get_with_deadline(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None = None, *, deadline: float
    ) -> tuple[Any, int] | None:
        """Wait on the inbound connector."""
        return self.inbound.get_with_deadline(from_stage, to_stage, key, metadata, deadline=deadline)

    def cleanup(self, key: str) -> bool:
        """Clean up on both edges."""
        return bool(self.inbound.cleanup(key)) | bool(self.outbound.cleanup(key))

    def cleanup_prefix(self, prefix: str) -> int:
        """Clean up on both edges."""
        return self.inbound.cleanup_prefix(prefix) + self.outbound.cleanup_prefix(prefix)

    def drain_failures(self) -> list[TransferFailure]:
        """Failures of both edges."""
        return self.inbound.drain_failures() + self.outbound.drain_failures()

    def health(self) -> dict[str, Any]:
        """Status plus each edge's health."""
        inbound, outbound = self.inbound.health(), self.outbound.health()
        ok = not self._closed and inbound.get("status") == "ok" and outbound.get("status") == "ok"
        return {"status": "ok" if ok else ("closed" if self._closed else "degraded"),
                "inbound": inbound, "outbound": outbound}

    def close(self) -> None:
        """Close both edges (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in (self.outbound, self.inbound):
            try:
                conn.close()
            except Exception:
                logger.exception("closing connector %r failed", conn)


def _build(spec: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase) -> OmniConnectorBase:
    return spec if isinstance(spec, OmniConnectorBase) else create_connector(spec)


# -- what a worker and the driver share -------------------------------------------------------------
class _Endpoint:
    """A chunk manager over an edge pair, plus announcements in both directions.

    Runs two helper threads: the announcer (puts announcements in order, with
    the retry policy) and the admitter (reads the upstream's announcements and
    registers each request with ``load_async``).
    """

    def __init__(
        self,
        *,
        stage_id: str,
        upstream_stage_id: str,
        downstream_stage_id: str,
        inbound: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase,
        outbound: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase,
        stall_timeout_s: float,
        retry: RetryPolicy,
        label: str,
    ) -> None:
        self.stage_id = str(stage_id)
        self.upstream = str(upstream_stage_id)
        self.downstream = str(downstream_stage_id)
        self.label = label
        self.retry = retry
        in_conn = _build(inbound)
        try:
            out_conn = _build(outbound)
        except BaseException:
            in_conn.close()
            raise
        self.connector = _EdgePair(in_conn, out_conn)
        try:
            self.chunks = OmniChunkManager(
                ChunkManagerConfig(stage_id=self.stage_id, upstream_stage_id=self.upstream,
                                   downstream_stage_id=self.downstream, retry=retry,
                                   stall_timeout_s=stall_timeout_s),
                self.connector,
            )
        except BaseException:
            self.connector.close()
            raise
        self.stop_event = threading.Event()
        self.admitted: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.announce_failures: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._announce_queue: deque[str] = deque()
        self._announce_cond = threading.Condition()
        self._seq = 0
        self._threads = [
            threading.Thread(target=self._guard, args=(self._announce_loop,), daemon=True,
                             name=f"{label}-announce-{self.stage_id}"),
            threading.Thread(target=self._guard, args=(self._admit_loop,), daemon=True,
                             name=f"{label}-admit-{self.stage_id}"),
        ]
        for thread in self._threads:
            thread.start()

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception:
            if not self.stop_event.is_set():
                logger.exception("%s %s: helper thread crashed", self.label, self.stage_id)
                self.stop_event.set()

    # announcements out ----------------------------------------------------------------------------
    def announce(self, request_id: str) -> None:
        """Queue the announcement of a new request to the downstream stage (returns at once)."""
        with self._announce_cond:
            self._announce_queue.append(request_id)
            self._announce_cond.notify()

    def _announce_loop(self) -> None:
        while True:
            with self._announce_cond:
                while not self._announce_queue and not self.stop_event.is_set():
                    self._announce_cond.wait()
                if self.stop_event.is_set():
                    return
                request_id = self._announce_queue.popleft()
            key = f"{ANNOUNCE_PREFIX}{self.stage_id}_{self._seq}"
            self._seq += 1
            if not self._put_announcement(key, request_id):
                self.announce_failures.put((request_id, f"could not announce the request to stage "
                                                        f"{self.downstream} (key {key!r})"))

    def _put_announcement(self, key: str, request_id: str) -> bool:
        def attempt() -> None:
            if self.stop_event.is_set():
                raise InterruptedError("stopping")
            ok, _, _ = self.connector.outbound.put(self.stage_id, self.downstream, key, {"request_id": request_id})
            if not ok:
                failures = [f for f in self.connector.outbound.drain_failures() if f.key == key]
                if failures and failures[-1].error is not None:
                    raise failures[-1].error
                raise _AnnounceFailed(f"put of {key!r} failed")

        try:
            self.retry.retrying(stop_event=self.stop_event)(attempt)
        except Exception as exc:
            if not self.stop_event.is_set():
                logger.warning("%s %s: announcing %s failed: %s", self.label, self.stage_id, request_id, exc)
            return False
        return True

    # announcements in -----------------------------------------------------------------------------
    def _admit_loop(self) -> None:
        inbound = self.connector.inbound
        next_seq = 0
        taken_ahead: set[int] = set()

        def key(seq: int) -> str:
            return f"{ANNOUNCE_PREFIX}{self.upstream}_{seq}"

        def admit(obj: Any) -> None:
            request_id = obj.get("request_id") if isinstance(obj, Mapping) else None
            if not isinstance(request_id, str):
                logger.warning("%s %s: ignoring a malformed announcement %r", self.label, self.stage_id, obj)
                return
            self.chunks.load_async(request_id)
            self.admitted.put(request_id)

        while not self.stop_event.is_set():
            deadline = time.monotonic() + 0.2
            got = inbound.get_with_deadline(self.upstream, self.stage_id, key(next_seq), deadline=deadline)
            if self.stop_event.is_set():
                return
            if got is not None:
                admit(got[0])
                next_seq += 1
                while next_seq in taken_ahead:
                    taken_ahead.discard(next_seq)
                    next_seq += 1
                continue
            # Nothing at next_seq: look past a lost announcement, and at the start
            # of the sequence for an upstream that restarted.
            restart = range(0, min(_ANNOUNCE_WINDOW, next_seq))
            for seq in (*range(next_seq + 1, next_seq + _ANNOUNCE_WINDOW), *restart):
                if seq in taken_ahead:
                    continue
                found = inbound.get(self.upstream, self.stage_id, key(seq))
                if found is None:
                    continue
                admit(found[0])
                if seq < next_seq:
                    logger.info("%s %s: stage %s restarted its announcements", self.label, self.stage_id,
                                self.upstream)
                    next_seq, taken_ahead = seq + 1, set()
                else:
                    taken_ahead.add(seq)

    def close(self) -> None:
        """Stop the helpers, shut the chunk manager down and close both connectors."""
        self.stop_event.set()
        with self._announce_cond:
            self._announce_cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(1.0)
        self.chunks.shutdown()
        self.connector.close()


class _AnnounceFailed(TransportError):
    """An announcement put returned False without a typed cause (retryable, like any transport fault)."""


# -- the stage worker -----------------------------------------------------------------------------------
class StageWorker:
    """One pipeline stage: receive chunks, call ``fn`` per chunk, stream the results on.

    ``fn(request_id, payload, is_final)`` gets the chunks received since its
    last call for that request (assembled into one dict, arrays concatenated
    along axis 0; usually exactly one chunk) and returns what to send
    downstream: a dict (one chunk), a list or generator of dicts (several,
    each sent as soon as it is produced), or None. When ``is_final`` is True
    the request's stream ends after what ``fn`` returns. An exception in
    ``fn`` fails that request only: the error travels downstream in-band.

    Threads: :meth:`run` is the worker's loop (the "scheduler" thread); the
    chunk manager's two workers and two announcement helpers run beside it.

    Args:
        fn: the per-chunk function.
        stage_id: this stage's id (used in chunk keys).
        upstream_stage_id: the stage (or driver) it receives from.
        downstream_stage_id: the stage (or driver) it sends to.
        inbound: connector spec (or a connector) of the upstream edge; it receives.
        outbound: connector spec (or a connector) of the downstream edge; it sends.
        stall_timeout_s: an upstream silent this long fails the request.
        retry: the send retry policy.
        name: a label for logs (default the stage id).
        trace: add per-hop timestamps (``_zo_trace``) to outgoing chunks.
    """

    def __init__(
        self,
        fn: ChunkFunction,
        *,
        stage_id: str,
        upstream_stage_id: str,
        downstream_stage_id: str,
        inbound: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase,
        outbound: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase,
        stall_timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        name: str | None = None,
        trace: bool = True,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self.fn = fn
        self.name = name or str(stage_id)
        self.trace = trace
        self._link = _Endpoint(stage_id=str(stage_id), upstream_stage_id=str(upstream_stage_id),
                               downstream_stage_id=str(downstream_stage_id), inbound=inbound, outbound=outbound,
                               stall_timeout_s=stall_timeout_s, retry=retry or RetryPolicy(), label="stage")
        self.stage_id = self._link.stage_id
        self._active: dict[str, float] = {}
        # Requests announced downstream whose stream has not ended (run thread only).
        self._announced: set[str] = set()
        # Generators returned by fn, advanced one chunk per pass (run thread only).
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "completed": 0, "failed": 0, "chunks_in": 0, "chunks_out": 0}

    @classmethod
    def from_pipeline(
        cls,
        config: PipelineConfig | str | Path | Mapping[str, Any],
        stage: str,
        *,
        fn: ChunkFunction | None = None,
        trace: bool = True,
    ) -> StageWorker:
        """Build the worker of stage ``stage`` (by name) of a pipeline config.

        ``fn`` defaults to the stage's ``function`` from the config.
        """
        pipeline = config if isinstance(config, PipelineConfig) else load_pipeline_config(config)
        spec = pipeline.stage(stage)
        if spec == pipeline.driver:
            raise ConfigError(f"{stage!r} is the pipeline's driver, not a stage")
        # The function first: a bad path fails before any socket is bound.
        fn = fn if fn is not None else spec.load_function()
        upstream, downstream = pipeline.neighbours(spec)
        inbound, outbound = pipeline.edge_specs(spec)
        return cls(fn, stage_id=spec.stage_id,
                   upstream_stage_id=upstream.stage_id, downstream_stage_id=downstream.stage_id,
                   inbound=inbound, outbound=outbound, stall_timeout_s=pipeline.stall_timeout_s,
                   retry=pipeline.retry, name=spec.name, trace=trace)

    # -- lifecycle -------------------------------------------------------------------------------------
    def run(self, *, idle_wait_s: float = 0.1) -> None:
        """Serve requests until :meth:`stop` is called (or a transfer worker dies).

        Each pass takes the inputs that arrived, calls ``fn`` on them, and
        advances every generator ``fn`` returned by one chunk, so several
        requests stream side by side (like one decode step of a batch) instead
        of one long request holding the stage.
        """
        chunks = self._link.chunks
        logger.info("stage %s (%s) running", self.name, self.stage_id)
        while not self._stop.is_set() and not self._link.stop_event.is_set() \
                and not chunks.stop_event.is_set():
            self._admit()
            for request_id in list(self._active):
                if request_id in self._running:
                    continue  # the previous inputs' generator goes first, to keep the order
                inputs = chunks.take_inputs(request_id)
                if inputs is not None:
                    self._handle(inputs)
            for request_id in list(self._running):
                self._step(request_id)
            self._handle_failures()
            chunks.get_finished_requests()  # drained so the set does not grow; state is released per request
            if self._running or not self._link.admitted.empty():
                continue
            chunks.wait_for_progress(idle_wait_s)
        if (self._link.stop_event.is_set() or chunks.stop_event.is_set()) and not self._stop.is_set():
            logger.error("stage %s: a transfer worker stopped; leaving the run loop", self.name)

    def start(self) -> None:
        """Run :meth:`run` in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name=f"stage-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler or another thread)."""
        self._stop.set()

    def close(self) -> None:
        """Stop, shut the chunk manager down and close both connectors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        self._link.close()

    def __enter__(self) -> StageWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> dict[str, Any]:
        """The worker's counters, the chunk manager's health and both edges' health."""
        return {"stage": self.name, "stage_id": self.stage_id, "active_requests": len(self._active),
                **self.stats, "chunks": self._link.chunks.health()}

    # -- the loop's steps ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        while True:
            try:
                request_id = self._link.admitted.get_nowait()
            except queue.Empty:
                return
            if request_id not in self._active:
                self._active[request_id] = time.time()
                self.stats["requests"] += 1

    def _handle(self, inputs: ChunkInputs) -> None:
        request_id = inputs.request_id
        received = time.time()
        data = dict(inputs.data)
        error = data.pop(ERROR_KEY, None)
        trace = data.pop(TRACE_KEY, None)
        trace = dict(trace) if isinstance(trace, Mapping) else {}
        self.stats["chunks_in"] += inputs.num_chunks
        if inputs.cancelled:
            self._finish(request_id, failed=True)
            self._link.chunks.cancel(request_id)
            return
        if error is not None:
            self._fail(request_id, str(error), trace)
            return
        try:
            out = self.fn(request_id, data, inputs.is_final)
            if out is None or isinstance(out, (Mapping, list, tuple)):
                items = [] if out is None else [out] if isinstance(out, Mapping) else list(out)
                for index, item in enumerate(items):
                    self._save(request_id, _chunk(item), inputs.is_final and index == len(items) - 1, trace, received)
                if inputs.is_final:
                    if not items:
                        self._save(request_id, {}, True, trace, received)
                    self._finish(request_id, failed=False)
                return
            if not isinstance(out, Iterable):
                raise TypeError(f"fn returned {type(out).__name__}; expected a dict, a list/generator of dicts, "
                                "or None")
        except Exception as exc:
            logger.exception("stage %s: fn failed for request %s", self.name, request_id)
            self._fail(request_id, f"stage {self.name}: {type(exc).__name__}: {exc}", trace)
            return
        self._running[request_id] = _Running(iter(out), inputs.is_final, trace, received)

    def _step(self, request_id: str) -> None:
        """Send the next chunk of a running generator; end the stream when it is exhausted."""
        running = self._running[request_id]
        try:
            item = next(running.outputs, _DONE)
            if item is not _DONE:
                self._save(request_id, _chunk(item), False, running.trace, running.received)
                return
        except Exception as exc:
            del self._running[request_id]
            logger.exception("stage %s: fn failed for request %s", self.name, request_id)
            self._fail(request_id, f"stage {self.name}: {type(exc).__name__}: {exc}", running.trace)
            return
        del self._running[request_id]
        if running.is_final:
            self._save(request_id, {}, True, running.trace, running.received)
            self._finish(request_id, failed=False)

    def _save(self, request_id: str, payload: Mapping[str, Any], final: bool, trace: dict[str, Any],
              received: float) -> None:
        chunk = dict(payload)
        if self.trace:
            chunk[TRACE_KEY] = {**trace, self.stage_id: [received, time.time()]}
        if request_id not in self._announced:
            self._announced.add(request_id)
            self._link.announce(request_id)
        self._link.chunks.save_async(request_id, chunk, is_final=final)
        self.stats["chunks_out"] += 1

    def _fail(self, request_id: str, reason: str, trace: dict[str, Any]) -> None:
        """Forward the failure downstream in-band and stop receiving for the request."""
        with contextlib.suppress(ValueError):  # the final chunk was already queued
            self._save(request_id, {ERROR_KEY: reason}, True, trace, time.time())
        self._link.chunks.cancel(request_id)  # the queued error chunk still goes through (#6670)
        self._finish(request_id, failed=True)

    def _finish(self, request_id: str, *, failed: bool) -> None:
        self._running.pop(request_id, None)
        if self._active.pop(request_id, None) is not None:
            self.stats["failed" if failed else "completed"] += 1
        self._announced.discard(request_id)

    def _handle_failures(self) -> None:
        chunks = self._link.chunks
        for request_id, reason in chunks.collect_failed_receive_request_ids().items():
            if request_id in self._active:
                self._fail(request_id, f"stage {self.name}: {reason}", {})
        for request_id, reason in chunks.collect_failed_send_request_ids().items():
            logger.warning("stage %s: request %s failed downstream: %s", self.name, request_id, reason)
            chunks.release(request_id)
            self._finish(request_id, failed=True)
        while True:
            try:
                request_id, reason = self._link.announce_failures.get_nowait()
            except queue.Empty:
                break
            logger.warning("stage %s: %s", self.name, reason)
            chunks.release(request_id)
            self._finish(request_id, failed=True)


_DONE = object()


@dataclass
class _Running:
    """A generator returned by ``fn`` and what its chunks need."""

    outputs: Iterator[Any]
    is_final: bool
    trace: dict[str, Any]
    received: float


def _chunk(item: Any) -> Mapping[str, Any]:
    if not isinstance(item, Mapping):
        raise TypeError(f"fn produced a {type(item).__name__}; each chunk must be a dict")
    return item


# -- the driver -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DriverEvent:
    """Something that happened to a submitted request, as returned by :meth:`PipelineDriver.poll`.

    Attributes:
        request_id: the request.
        kind: ``"chunk"`` (output arrived; ``data`` holds it), ``"completed"``
            (the stream ended; ``data`` holds the last output, maybe empty) or
            ``"failed"`` (``reason`` says why; nothing more will come).
        data: the output chunk(s) received, reserved keys removed.
        reason: why the request failed.
        trace: ``{stage_id: [t_received, t_sent]}`` of the hops this output took.
        at: ``time.time()`` when the driver took the event.
    """

    request_id: str
    kind: Literal["chunk", "completed", "failed"]
    data: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    trace: Mapping[str, Any] = field(default_factory=dict)
    at: float = 0.0


class PipelineDriver:
    """Submit requests to a pipeline's first stage and collect the last stage's output.

    Every submitted request ends with exactly one ``completed`` or ``failed``
    event: failures come from a stage (in-band errors), from the transfer
    (undeliverable sends, an upstream silent for ``stall_timeout_s``) or from
    ``request_timeout_s`` passing, so no request waits forever.

    Args:
        stage_id: the driver's id in the pipeline (``"driver"`` by default).
        first_stage_id: the stage requests are sent to.
        last_stage_id: the stage outputs come from.
        inbound: connector spec (or connector) of the last stage -> driver edge.
        outbound: connector spec (or connector) of the driver -> first stage edge.
        stall_timeout_s: an output stream silent this long fails its request.
        request_timeout_s: a request not completed this long after submission fails.
        retry: the send retry policy.
        first_output_timeout_s: a request the last stage has not started (announced)
            this long after submission fails; it catches a dead middle stage, which
            no downstream stall timer can see. Default: ``stall_timeout_s`` per hop
            of a three-stage pipeline (``from_pipeline`` uses the real hop count).
    """

    def __init__(
        self,
        *,
        stage_id: str = "driver",
        first_stage_id: str,
        last_stage_id: str,
        inbound: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase,
        outbound: ConnectorSpec | Mapping[str, Any] | OmniConnectorBase,
        stall_timeout_s: float = 10.0,
        request_timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        first_output_timeout_s: float | None = None,
    ) -> None:
        self._link = _Endpoint(stage_id=str(stage_id), upstream_stage_id=str(last_stage_id),
                               downstream_stage_id=str(first_stage_id), inbound=inbound, outbound=outbound,
                               stall_timeout_s=stall_timeout_s, retry=retry or RetryPolicy(), label="driver")
        self.stage_id = self._link.stage_id
        self.request_timeout_s = request_timeout_s
        self.first_output_timeout_s = (
            first_output_timeout_s if first_output_timeout_s is not None else 4 * stall_timeout_s
        )
        self._submitted: dict[str, float] = {}
        self._streaming: set[str] = set()
        self._closed = False

    @classmethod
    def from_pipeline(cls, config: PipelineConfig | str | Path | Mapping[str, Any]) -> PipelineDriver:
        """Build the driver of a pipeline config (its ``pipeline.driver`` section)."""
        pipeline = config if isinstance(config, PipelineConfig) else load_pipeline_config(config)
        inbound, outbound = pipeline.edge_specs(pipeline.driver)
        return cls(stage_id=pipeline.driver.stage_id, first_stage_id=pipeline.stages[0].stage_id,
                   last_stage_id=pipeline.stages[-1].stage_id, inbound=inbound, outbound=outbound,
                   stall_timeout_s=pipeline.stall_timeout_s, request_timeout_s=pipeline.request_timeout_s,
                   retry=pipeline.retry,
                   first_output_timeout_s=pipeline.stall_timeout_s * (len(pipeline.stages) + 1))

    @property
    def pending(self) -> int:
        """How many submitted requests have not completed or failed yet."""
        return len(self._submitted)

    def submit(self, request_id: str, payload: Mapping[str, Any]) -> None:
        """Send a request (one chunk, the whole input) to the first stage; returns at once.

        Raises:
            ValueError: ``request_id`` is already in flight.
        """
        if request_id in self._submitted:
            raise ValueError(f"request {request_id!r} is already in flight")
        now = time.time()
        self._submitted[request_id] = now
        self._link.announce(request_id)
        self._link.chunks.save_async(request_id, {**payload, TRACE_KEY: {self.stage_id: [now, now]}}, is_final=True)

    def poll(self, timeout: float = 0.1) -> list[DriverEvent]:
        """Wait up to ``timeout`` for progress and return what happened since the last call."""
        chunks = self._link.chunks
        events: list[DriverEvent] = []
        while True:
            try:
                request_id = self._link.admitted.get_nowait()
            except queue.Empty:
                break
            if request_id in self._submitted:
                self._streaming.add(request_id)
            else:
                logger.warning("driver: stage %s announced unknown request %s", self._link.upstream, request_id)
                chunks.cancel(request_id)
        if not any(chunks.is_receiving(rid) and chunks.is_ready(rid) for rid in self._streaming):
            chunks.wait_for_progress(timeout)
        now = time.time()
        for request_id in list(self._streaming):
            inputs = chunks.take_inputs(request_id)
            if inputs is None:
                continue
            data = dict(inputs.data)
            error = data.pop(ERROR_KEY, None)
            trace = data.pop(TRACE_KEY, None)
            trace = dict(trace) if isinstance(trace, Mapping) else {}
            if error is not None or inputs.cancelled:
                events.append(self._failed(request_id, str(error or "cancelled upstream"), now))
            elif inputs.is_final:
                events.append(DriverEvent(request_id, "completed", data, trace=trace, at=now))
                self._forget(request_id)
            else:
                events.append(DriverEvent(request_id, "chunk", data, trace=trace, at=now))
        for request_id, reason in chunks.collect_failed_receive_request_ids().items():
            if request_id in self._submitted:
                events.append(self._failed(request_id, reason, now))
        for request_id, reason in chunks.collect_failed_send_request_ids().items():
            if request_id in self._submitted:
                events.append(self._failed(request_id, reason, now))
        while True:
            try:
                request_id, reason = self._link.announce_failures.get_nowait()
            except queue.Empty:
                break
            if request_id in self._submitted:
                events.append(self._failed(request_id, reason, now))
        for request_id, submitted in list(self._submitted.items()):
            if now - submitted > self.request_timeout_s:
                events.append(self._failed(request_id, f"not completed within {self.request_timeout_s:g}s", now))
            elif request_id not in self._streaming and now - submitted > self.first_output_timeout_s:
                reason = (f"stage {self._link.upstream} never started it within {self.first_output_timeout_s:g}s "
                          "(a stage before it is down or stalled)")
                events.append(self._failed(request_id, reason, now))
        if self._link.stop_event.is_set() or chunks.stop_event.is_set():
            for request_id in list(self._submitted):
                events.append(self._failed(request_id, "the driver's transfer workers stopped", now))
        chunks.get_finished_requests()
        return events

    def _failed(self, request_id: str, reason: str, now: float) -> DriverEvent:
        self._link.chunks.release(request_id)
        self._forget(request_id)
        return DriverEvent(request_id, "failed", reason=reason, at=now)

    def _forget(self, request_id: str) -> None:
        self._submitted.pop(request_id, None)
        self._streaming.discard(request_id)

    def fail_all(self, reason: str) -> list[DriverEvent]:
        """Fail every request still in flight (for example when a stage process died)."""
        now = time.time()
        return [self._failed(request_id, reason, now) for request_id in list(self._submitted)]

    def health(self) -> dict[str, Any]:
        """Requests in flight plus the chunk manager's and both edges' health."""
        return {"pending": len(self._submitted), "chunks": self._link.chunks.health()}

    def close(self) -> None:
        """Shut the chunk manager down and close both connectors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._link.close()

    def __enter__(self) -> PipelineDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
