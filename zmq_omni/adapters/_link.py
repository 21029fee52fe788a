"""What a stage worker and the pipeline driver share: one connector over two edges, and announcements.

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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase, TransferFailure, WakeupSource, bounded_timeout, create_connector
from ..errors import TransportError
from .chunk import ChunkManagerConfig, OmniChunkManager
from .retry import RetryPolicy

logger = logging.getLogger("zmq_omni.adapters")

ERROR_KEY = "_zo_error"
TRACE_KEY = "_zo_trace"
ANNOUNCE_PREFIX = "_zo_req_"
#: How far past the next expected announcement a receiver looks for later ones.
_ANNOUNCE_WINDOW = 16


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

    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Put through the outbound connector."""
        return self.outbound.put(from_stage, to_stage, put_key, data)

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Get from the inbound connector."""
        return self.inbound.get(from_stage, to_stage, get_key, metadata)

    def get_with_deadline(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None, *, deadline: float
    ) -> tuple[Any, int] | None:
        """Wait on the inbound connector."""
        return self.inbound.get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=deadline)

    def get_wakeup_generation(self) -> int | None:
        """The inbound connector's arrival counter; None when it announces no arrivals."""
        inbound = self.inbound
        return inbound.get_wakeup_generation() if isinstance(inbound, WakeupSource) else None

    def wait_for_change(self, gen: int, *, timeout: float) -> int:
        """Wait on the inbound connector (callers first check the generation is not None)."""
        inbound = self.inbound
        if isinstance(inbound, WakeupSource):
            return inbound.wait_for_change(gen, timeout=timeout)
        time.sleep(bounded_timeout(timeout))  # never reached by the adapters: they saw a None generation
        return gen

    def abandon_get(self, get_key: str) -> None:
        """Tell the inbound connector."""
        self.inbound.abandon_get(get_key)

    def reap_consumed(self) -> None:
        """Reap on the outbound connector."""
        self.outbound.reap_consumed()

    def cleanup(self, request_id: str) -> bool:
        """Clean up on both edges."""
        return bool(self.inbound.cleanup(request_id)) | bool(self.outbound.cleanup(request_id))

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
