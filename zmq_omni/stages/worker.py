"""The stage worker API: run one pipeline stage, or drive a pipeline, in a few lines.

A **stage worker** owns the connectors of its two edges (inbound from the
upstream stage, outbound to the downstream stage) and an
:class:`~zmq_omni.adapters.OmniChunkManager`, and calls a user function per
received chunk::

    def talker(request_id, payload, is_final):
        return {"codes": make_codes(payload["hidden"])}   # or a list / generator of chunks, or None

    with StageWorker.from_pipeline("pipeline.yaml", "talker", fn=talker) as worker:
        worker.run()            # until worker.stop() (from a signal handler or another thread)

The pipeline driver is :class:`~zmq_omni.stages.driver.PipelineDriver`; the
pipeline YAML model is in :mod:`zmq_omni.stages.pipeline`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..adapters import ChunkInputs, RetryPolicy, WarningBurst
from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase
from ..errors import ConfigError
from ._link import ERROR_KEY, TRACE_KEY, _Endpoint
from .pipeline import ChunkFunction, PipelineConfig, load_pipeline_config, name_stages

__all__ = ["StageWorker"]

logger = logging.getLogger("zmq_omni.stages")

#: How many completed requests a worker remembers, so that a send failure reported after
#: its final chunk went out (a delivery deadline, a put the downstream dropped) recounts it as failed.
_RECENT_COMPLETED = 4096


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
        stage_names: stage id -> name, so that failure reasons name stages as the
            pipeline does ("stage 'vocoder'", not "stage 2"); ``from_pipeline``
            passes the pipeline's.
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
        stage_names: Mapping[str, str] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self.fn = fn
        self.name = name or str(stage_id)
        self.trace = trace
        self._stage_names = dict(stage_names or {})
        self._link = _Endpoint(
            stage_id=str(stage_id),
            upstream_stage_id=str(upstream_stage_id),
            downstream_stage_id=str(downstream_stage_id),
            inbound=inbound,
            outbound=outbound,
            stall_timeout_s=stall_timeout_s,
            retry=retry or RetryPolicy(),
            label="stage",
        )
        self.stage_id = self._link.stage_id
        self._active: dict[str, float] = {}
        # Requests announced downstream whose stream has not ended (run thread only).
        self._announced: set[str] = set()
        # Generators returned by fn, advanced one chunk per pass (run thread only).
        self._running: dict[str, _Running] = {}
        # Refused requests whose inbound stream is read and dropped (run thread only;
        # each leaves at its final chunk or when its stall timeout fails it).
        self._refused: set[str] = set()
        # Cancellations asked for by cancel() (any thread), applied by the run thread.
        self._cancels: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        # Requests whose final chunk is queued but not yet put (run thread only): counted
        # completed once the chunk manager reports the put, failed on a send failure.
        self._closing: OrderedDict[str, None] = OrderedDict()
        # The last completed requests (run thread only, bounded): a later send failure recounts one as failed.
        self._recent_completed: OrderedDict[str, None] = OrderedDict()
        self._stop = threading.Event()
        self._closed = False
        # Run thread only (then close): a stopped downstream fails every request at once, one line per interval.
        self._downstream_warnings = WarningBurst()
        self._thread: threading.Thread | None = None
        self.stats = {
            "requests": 0,
            "completed": 0,
            "failed": 0,
            "cancelled": 0,
            "refused": 0,
            "chunks_in": 0,
            "chunks_out": 0,
        }

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
        return cls(
            fn,
            stage_id=spec.stage_id,
            upstream_stage_id=upstream.stage_id,
            downstream_stage_id=downstream.stage_id,
            inbound=inbound,
            outbound=outbound,
            stall_timeout_s=pipeline.stall_timeout_s,
            retry=pipeline.retry,
            name=spec.name,
            trace=trace,
            stage_names=pipeline.stage_names(),
        )

    @property
    def connectors(self) -> tuple[OmniConnectorBase, OmniConnectorBase]:
        """The ``(inbound, outbound)`` connectors of the worker's two edges; the worker owns and closes them."""
        pair = self._link.connector
        return pair.inbound, pair.outbound

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
        while not self._stop.is_set() and not self._link.stop_event.is_set() and not chunks.stop_event.is_set():
            self._admit()
            self._apply_cancels()
            for request_id in list(self._active):
                if request_id in self._running:
                    continue  # the previous inputs' generator goes first, to keep the order
                inputs = chunks.take_inputs(request_id)
                if inputs is not None:
                    self._handle(inputs)
            for request_id in list(self._running):
                self._step(request_id)
            self._drain_refused()
            self._handle_failures()
            self._count_sent(chunks.get_finished_requests().saved)
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

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel ``request_id`` at this stage, mid-stream (safe from any thread, ``fn`` included).

        The run thread applies it on its next pass: the stage stops receiving
        the request (what its upstream still sends for it is dropped by the
        transport), drops its unsent outputs, and ends its stream downstream
        with ``reason`` (``"stage <name>: cancelled: <reason>"``), so the driver
        fails the request with that reason. Counted in ``stats["cancelled"]``.
        A request this stage is not serving (unknown or already ended) is ignored.
        """
        self._cancels.put((request_id, reason))

    def stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler or another thread)."""
        self._stop.set()

    def close(self) -> None:
        """Stop, shut the chunk manager down and close both connectors (idempotent).

        Then ``stats`` are final: a request whose final chunk was queued counts as
        completed only if its puts went through (the shutdown flushes what is in
        flight); one still unsent, or failed meanwhile, counts as failed.
        """
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        self._link.close()
        chunks = self._link.chunks
        self._count_sent(chunks.get_finished_requests().saved)
        for request_id in chunks.collect_failed_send_request_ids():
            self._count_send_failure(request_id)
        for request_id in list(self._closing):
            self._count_send_failure(request_id)  # never confirmed: not delivered as far as this stage knows
        summary = self._downstream_warnings.flush()
        if summary:
            logger.warning("stage %s: requests failed downstream: %s", self.name, summary)

    def __enter__(self) -> StageWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> dict[str, Any]:
        """The worker's counters, the chunk manager's health and both edges' health."""
        return {
            "stage": self.name,
            "stage_id": self.stage_id,
            "active_requests": len(self._active),
            "running_generators": len(self._running),
            "refused_draining": len(self._refused),
            "closing_requests": len(self._closing),
            **self.stats,
            "chunks": self._link.chunks.health(),
        }

    # -- the loop's steps ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        while True:
            try:
                request_id, error = self._link.admitted.get_nowait()
            except queue.Empty:
                return
            if error is not None:
                # Refused (or failed) before it streamed, upstream: pass the reason on to the driver.
                self._link.announce(request_id, error=error)
                continue
            refusal = (
                f"request {request_id!r} is already in flight"
                if request_id in self._active
                else self._link.chunks.stream_refusal(request_id)
            )
            if refusal is not None:
                self._refuse(request_id, refusal)
                continue
            self._active[request_id] = time.time()
            self.stats["requests"] += 1

    def _apply_cancels(self) -> None:
        while True:
            try:
                request_id, reason = self._cancels.get_nowait()
            except queue.Empty:
                return
            if request_id not in self._active:
                continue
            logger.info("stage %s: cancelling request %s: %s", self.name, request_id, reason)
            self.stats["cancelled"] += 1
            self._fail(request_id, f"stage {self.name}: cancelled: {reason}", {}, counted=False)

    def _cancelled_meanwhile(self, request_id: str) -> bool:
        """Apply the cancellations asked for while ``fn`` ran; True when ``request_id`` was one.

        A cancel from ``fn`` itself (or another thread during the call) wins over what
        the call returned, even on the final input: its outputs are dropped.
        """
        self._apply_cancels()
        return request_id not in self._active

    def _refuse(self, request_id: str, reason: str) -> None:
        """Tell the driver at once (an error announcement) that this stage will not serve ``request_id``.

        A reused id cannot stream: the keys of its stream were used (and the
        downstream stage may still hold late chunks under them). The request
        is not started; what its upstream sends for it is read and dropped
        (so it does not sit in the inbound connector), and the stage goes on
        serving the others.
        """
        logger.warning("stage %s: refusing request %s: %s", self.name, request_id, reason)
        self.stats["refused"] += 1
        self._link.announce(request_id, error=f"stage {self.name}: {reason}")
        if request_id not in self._active:
            self._refused.add(request_id)

    def _drain_refused(self) -> None:
        chunks = self._link.chunks
        for request_id in list(self._refused):
            inputs = chunks.take_inputs(request_id)
            if not chunks.is_receiving(request_id) or (inputs is not None and inputs.is_final):
                self._refused.discard(request_id)

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
            if self._cancelled_meanwhile(request_id):
                return
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
                raise TypeError(
                    f"fn returned {type(out).__name__}; expected a dict, a list/generator of dicts, or None"
                )
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
            if self._cancelled_meanwhile(request_id):
                return
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

    def _save(
        self, request_id: str, payload: Mapping[str, Any], final: bool, trace: dict[str, Any], received: float
    ) -> None:
        chunk = dict(payload)
        if self.trace:
            chunk[TRACE_KEY] = {**trace, self.stage_id: [received, time.time()]}
        if request_id not in self._announced:
            self._announced.add(request_id)
            self._link.announce(request_id)
        self._link.chunks.save_async(request_id, chunk, is_final=final)
        self.stats["chunks_out"] += 1

    def _fail(self, request_id: str, reason: str, trace: dict[str, Any], *, counted: bool = True) -> None:
        """Forward the failure downstream in-band and stop receiving for the request.

        ``counted``: count it in ``stats["failed"]`` (a cancellation is counted apart).
        """
        reason = name_stages(reason, self._stage_names)
        with contextlib.suppress(ValueError):  # the final chunk was already queued
            self._save(request_id, {ERROR_KEY: reason}, True, trace, time.time())
        self._link.chunks.cancel(request_id)  # the queued error chunk still goes through (#6670)
        self._finish(request_id, failed=True, counted=counted)

    def _finish(self, request_id: str, *, failed: bool, counted: bool = True) -> None:
        self._running.pop(request_id, None)
        if self._active.pop(request_id, None) is not None:
            if failed:
                if counted:
                    self.stats["failed"] += 1
            else:
                # Its final chunk is only queued: completed once it is put (_count_sent).
                self._closing[request_id] = None
        elif failed:
            self._count_send_failure(request_id)
        self._announced.discard(request_id)

    def _count_sent(self, request_ids: Iterable[str]) -> None:
        """Count as completed the closing requests whose final chunk the chunk manager put."""
        for request_id in request_ids:
            if self._closing.pop(request_id, 0) is None:
                self.stats["completed"] += 1
                self._recent_completed[request_id] = None
                while len(self._recent_completed) > _RECENT_COMPLETED:
                    self._recent_completed.popitem(last=False)

    def _count_send_failure(self, request_id: str) -> None:
        """A send failure of a request already finished here: it failed, whether closing or counted completed."""
        if self._closing.pop(request_id, 0) is None:
            self.stats["failed"] += 1
        elif self._recent_completed.pop(request_id, 0) is None:
            self.stats["completed"] -= 1
            self.stats["failed"] += 1

    def _handle_failures(self) -> None:
        chunks = self._link.chunks
        for request_id, reason in chunks.collect_failed_receive_request_ids().items():
            if request_id in self._active:
                self._fail(request_id, f"stage {self.name}: {reason}", {})
        for request_id, raw_reason in chunks.collect_failed_send_request_ids().items():
            reason = name_stages(raw_reason, self._stage_names)
            full, summary = self._downstream_warnings.note(request_id, reason, time.monotonic())
            if summary:
                logger.warning("stage %s: requests failed downstream: %s", self.name, summary)
            if full:
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
