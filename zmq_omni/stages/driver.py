"""The pipeline driver: submit requests to a pipeline and collect its output.

A **pipeline driver** (:class:`PipelineDriver`) submits requests to the first
stage and collects the last stage's chunks; every request ends as completed
or failed (stalled upstream, dead stage, request timeout), never waits forever.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..adapters import RetryPolicy
from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase
from ..errors import DROPPED_ENDED, format_seconds
from ._link import ERROR_KEY, TRACE_KEY, _Endpoint
from .pipeline import PipelineConfig, load_pipeline_config, name_stages

__all__ = ["DriverEvent", "PipelineDriver"]

logger = logging.getLogger("zmq_omni.stages")

#: How long a request whose input a stage dropped under a tombstone waits for that stage's refusal, which
#: says why (a reused id: "already ended its stream"), before it fails with the drop itself as the reason.
DROPPED_GRACE_S = 2.0


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
        stage_names: stage id -> name, so that failure reasons name stages as the
            pipeline does ("stage 'vocoder'", not "stage 2"); ``from_pipeline``
            passes the pipeline's.
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
        stage_names: Mapping[str, str] | None = None,
    ) -> None:
        self._link = _Endpoint(
            stage_id=str(stage_id),
            upstream_stage_id=str(last_stage_id),
            downstream_stage_id=str(first_stage_id),
            inbound=inbound,
            outbound=outbound,
            stall_timeout_s=stall_timeout_s,
            retry=retry or RetryPolicy(),
            label="driver",
        )
        self.stage_id = self._link.stage_id
        self.request_timeout_s = request_timeout_s
        self.first_output_timeout_s = (
            first_output_timeout_s if first_output_timeout_s is not None else 4 * stall_timeout_s
        )
        self._stage_names = dict(stage_names or {})
        self._submitted: dict[str, float] = {}
        self._streaming: set[str] = set()
        # Requests whose input a stage dropped as ended there: their reason and when to stop waiting for a refusal.
        self._dropped: dict[str, tuple[str, float]] = {}
        self._closed = False

    @classmethod
    def from_pipeline(cls, config: PipelineConfig | str | Path | Mapping[str, Any]) -> PipelineDriver:
        """Build the driver of a pipeline config (its ``pipeline.driver`` section)."""
        pipeline = config if isinstance(config, PipelineConfig) else load_pipeline_config(config)
        inbound, outbound = pipeline.edge_specs(pipeline.driver)
        return cls(
            stage_id=pipeline.driver.stage_id,
            first_stage_id=pipeline.stages[0].stage_id,
            last_stage_id=pipeline.stages[-1].stage_id,
            inbound=inbound,
            outbound=outbound,
            stall_timeout_s=pipeline.stall_timeout_s,
            request_timeout_s=pipeline.request_timeout_s,
            retry=pipeline.retry,
            first_output_timeout_s=pipeline.stall_timeout_s * (len(pipeline.stages) + 1),
            stage_names=pipeline.stage_names(),
        )

    @property
    def pending(self) -> int:
        """How many submitted requests have not completed or failed yet."""
        return len(self._submitted)

    def submit(self, request_id: str, payload: Mapping[str, Any]) -> None:
        """Send a request (one chunk, the whole input) to the first stage; returns at once.

        Raises:
            ValueError: ``request_id`` is already in flight (or this driver already ended it).
            ClosedResourceError: the driver is closed.
        """
        if request_id in self._submitted:
            raise ValueError(f"request {request_id!r} is already in flight")
        now = time.time()
        # The chunk is queued first, so that a driver that is shut down (or an id it already ended) refuses it
        # before anything is announced; it is put only once the announcement was (held until then).
        self._link.hold(request_id)
        try:
            self._link.chunks.save_async(request_id, {**payload, TRACE_KEY: {self.stage_id: [now, now]}}, is_final=True)
        except BaseException:
            self._link.withdraw(request_id)
            raise
        self._submitted[request_id] = now
        self._link.announce(request_id, held=True)

    def poll(self, timeout: float = 0.1) -> list[DriverEvent]:
        """Wait up to ``timeout`` for progress and return what happened since the last call."""
        chunks = self._link.chunks
        events: list[DriverEvent] = []
        while True:
            try:
                request_id, error = self._link.admitted.get_nowait()
            except queue.Empty:
                break
            if error is not None:
                # A stage refused it (a reused id) or failed it before it streamed.
                if request_id in self._submitted:
                    events.append(self._failed(request_id, error, time.time()))
                else:
                    logger.warning(
                        "driver: stage %s failed unknown request %s: %s", self._link.upstream, request_id, error
                    )
            elif request_id in self._submitted:
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
            if request_id not in self._submitted:
                continue
            if DROPPED_ENDED in reason and request_id not in self._dropped:
                # The stage had ended or cancelled this id (a reused id): its refusal, with the real cause,
                # comes down the pipeline a moment later and wins; the drop is the reason only without one.
                self._dropped[request_id] = (reason, now + DROPPED_GRACE_S)
            else:
                events.append(self._failed(request_id, reason, now))
        for request_id, (reason, until) in list(self._dropped.items()):
            if request_id not in self._submitted:
                del self._dropped[request_id]
            elif now >= until:
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
                events.append(
                    self._failed(request_id, f"not completed within {format_seconds(self.request_timeout_s)}", now)
                )
            elif request_id not in self._streaming and now - submitted > self.first_output_timeout_s:
                reason = (
                    f"stage {self._link.upstream} never started it within "
                    f"{format_seconds(self.first_output_timeout_s)} (a stage before it is down or stalled)"
                )
                events.append(self._failed(request_id, reason, now))
        if self._link.stop_event.is_set() or chunks.stop_event.is_set():
            for request_id in list(self._submitted):
                events.append(self._failed(request_id, "the driver's transfer workers stopped", now))
        chunks.get_finished_requests()
        return events

    def _failed(self, request_id: str, reason: str, now: float) -> DriverEvent:
        self._link.chunks.release(request_id)
        self._forget(request_id)
        return DriverEvent(request_id, "failed", reason=name_stages(reason, self._stage_names), at=now)

    def _forget(self, request_id: str) -> None:
        self._submitted.pop(request_id, None)
        self._dropped.pop(request_id, None)
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
