"""OmniChunkManager: stream a request's data to the next stage in chunks.

Keys and order:
    The sender puts chunk ``n`` of a request under ``{external_req_id}_{stage_id}_{n}``;
    the receiver reads ``{external_req_id}_{upstream_stage_id}_{n}`` for n = 0, 1, 2, ...
    Chunk ids are assigned by ``save_async`` in call order, and the save thread
    sends them in that order. The receiver reads each key once, in order, so it
    never sees a chunk twice and never out of order.

On the wire, a chunk is ``{"meta": {"chunk_id", "final", "cancelled"}, "data": {...}}``.
``final`` is the in-band end of stream. ``data`` is the caller's payload (a
dict of arrays and metadata); see :func:`~zmq_omni.adapters.assemble_chunks`
for how received chunks become the next stage's inputs (arrays concatenated
along ``concat_axis``, metadata merged).

Layers: the rules of every stream are :mod:`~zmq_omni.adapters._streams` (no I/O);
:class:`~zmq_omni.adapters._chunk_shell.ChunkShell` runs them under the manager's
lock and does their I/O after releasing it (no connector call under the lock);
this module is the public face; the scheduler hooks are
:class:`~zmq_omni.adapters.scheduling.ChunkHooks` over the manager's public reads.

Ownership: ``save_async`` returns before the put happens, so the payload's
arrays belong to the manager from then on; do not write into them afterwards
(pass a copy when a buffer is reused).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, MutableSequence
from typing import Any

from ..connectors import OmniConnectorBase
from ..errors import ConfigError, format_seconds
from ._chunk_config import ChunkManagerConfig
from ._chunk_shell import ChunkShell
from ._stream_types import NO_EFFECTS, RecvPhase, RecvStream, SaveItem, SendStream
from .scheduling import ChunkHooks, ChunkInputs, R, SchedulerOutputLike

__all__ = ["ChunkInputs", "ChunkManagerConfig", "OmniChunkManager"]


class OmniChunkManager(ChunkShell):
    """The chunk transfer adapter: asynchronous chunk streams between two stages.

    Sender side (this stage produces): :meth:`save_async` per chunk, the last one
    with ``is_final=True``; :meth:`save` waits for the put. Receiver side (this
    stage consumes): :meth:`load_async` registers a request; its chunks are
    fetched in the background and assembled by :meth:`take_inputs`, or by the
    scheduler hooks :meth:`process_pending_chunks`, :meth:`restore_queues` and
    :meth:`filter_scheduler_output`; :meth:`load` waits for a whole stream.

    The scheduler drains :meth:`collect_failed_send_request_ids` (a chunk that
    could not be delivered) and :meth:`collect_failed_receive_request_ids`
    (upstream silent for ``stall_timeout_s``, or a bad chunk) every step, and
    calls :meth:`release` when a request is done or :meth:`cancel` to abort it.
    """

    def __init__(self, config: ChunkManagerConfig | Mapping[str, Any], connector: OmniConnectorBase | None = None):
        cfg = config if isinstance(config, ChunkManagerConfig) else ChunkManagerConfig.from_dict(config)
        super().__init__(cfg, connector)
        self._hooks = ChunkHooks(self, cfg.stage_id)
        self._start_workers()

    # -- keys --------------------------------------------------------------------------
    def send_key(self, external_req_id: str, chunk_id: int) -> str:
        """The key chunk ``chunk_id`` of a request is put under by this stage."""
        return f"{external_req_id}_{self.stage_id}_{chunk_id}"

    def recv_key(self, external_req_id: str, chunk_id: int) -> str:
        """The key chunk ``chunk_id`` of a request is read from (upstream stage id)."""
        return f"{external_req_id}_{self.config.upstream_stage_id}_{chunk_id}"

    # -- sender side -----------------------------------------------------------------------
    def save_async(
        self,
        request_id: str,
        payload: Mapping[str, Any] | None = None,
        *,
        is_final: bool = False,
        external_req_id: str | None = None,
    ) -> int | None:
        """Queue the next chunk of ``request_id`` and return its chunk id at once.

        Args:
            request_id: the scheduler's id; failures are reported under it.
            payload: a dict of arrays and metadata (``None`` or ``{}`` for an
                end-of-stream marker without data). Not copied: do not
                modify its arrays afterwards.
            is_final: this is the last chunk (in-band end of stream).
            external_req_id: the id shared by all stages, used in keys
                (default ``request_id``); fixed by the first chunk.

        Returns:
            The chunk id, or ``None`` when the request was cancelled or already
            failed to send (its failure is, or was, reported).

        Raises:
            ValueError: a chunk after the final one.
            ConfigError: this stage has no downstream stage.
            ClosedResourceError: the manager is shut down (or its workers stopped).
        """
        item = self._queue_chunk(request_id, payload, is_final, external_req_id, None)
        return None if item is None else item.chunk_id

    def save(
        self,
        request_id: str,
        payload: Mapping[str, Any] | None = None,
        *,
        is_final: bool = True,
        external_req_id: str | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Send one chunk (by default the whole, final payload) and wait until it is put.

        Returns True when the put succeeded; False when it failed (reported as a
        send failure), ``timeout_s`` passed first (the chunk stays queued) or
        the manager shut down first (reported as a send failure). With
        ``timeout_s=None`` it still returns by the end of :meth:`shutdown`.

        Raises:
            ClosedResourceError: the manager is shut down (or its workers stopped).
        """
        done = threading.Event()
        item = self._queue_chunk(request_id, payload, is_final, external_req_id, done)
        if item is None:
            return False
        done.wait(timeout_s)
        return item.ok

    def _queue_chunk(
        self,
        request_id: str,
        payload: Mapping[str, Any] | None,
        is_final: bool,
        external_req_id: str | None,
        done: threading.Event | None,
    ) -> SaveItem | None:
        if self.config.downstream_stage_id is None:
            raise ConfigError(f"stage {self.stage_id} has no downstream_stage_id to send to")
        if payload is not None and not isinstance(payload, Mapping):
            raise TypeError(f"chunk payload must be a mapping, got {type(payload).__name__}")
        item: SaveItem | None = None
        effects = NO_EFFECTS
        with self._lock:
            self._check_open()
            now = time.monotonic()
            sweep = self._streams.sweep_due(now)
            stream = self._streams.open_send(request_id, external_req_id, now)
            if stream is not None and self._streams.queue_full() and not self._wait_for_room(stream):
                effects = self._streams.refuse(
                    stream,
                    f"save queue full: {len(self._streams.queue)} chunks queued (max_queued_chunks) "
                    f"and no room within {self.config.queue_full_timeout_s:g}s",
                )
                self._settle_locked(effects)
            elif stream is not None:
                item = self._streams.queue_chunk(stream, payload or {}, is_final, done, time.monotonic())
                self._save_cond.notify()
        self._perform(effects)
        if sweep:
            self._sweep_idle()
        return item

    def _wait_for_room(self, stream: SendStream) -> bool:
        """Wait (lock held) up to ``queue_full_timeout_s`` for room in the save queue; True when there is.

        Ends early, False, when the request stopped meanwhile; raises once the manager stops.
        """
        deadline = time.monotonic() + self.config.queue_full_timeout_s
        while self._streams.queue_full():
            self._check_open()
            if not self._streams.may_wait(stream):
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._room_cond.wait(remaining)
        return True

    def stream_refusal(self, request_id: str) -> str | None:
        """Why this stage could not stream ``request_id`` downstream, or None when it can.

        A request id names one stream per stage: once its stream ended (its
        final chunk was put, or the request was released), or while its final
        chunk is queued, :meth:`save_async` refuses it. A stage worker asks
        this when a request is announced, to refuse a reused id at once.
        """
        with self._lock:
            return self._streams.refusal(request_id)

    # -- receiver side --------------------------------------------------------------------
    def load_async(self, request_id: str, *, external_req_id: str | None = None) -> None:
        """Start receiving the chunk stream of ``request_id``; returns at once, idempotent.

        A no-op on a stage without an upstream stage (stage 0).

        Raises:
            ClosedResourceError: the manager is shut down (or its workers stopped).
        """
        self._register(request_id, external_req_id, whole=False)

    def _register(self, request_id: str, external_req_id: str | None, *, whole: bool) -> RecvStream | None:
        if self.config.upstream_stage_id is None:
            return None
        with self._lock:
            while True:
                self._check_open()
                now = time.monotonic()
                effects = self._streams.open_receive(request_id, external_req_id, whole, now)
                if effects is not None:
                    break
                # A reused id: its previous stream's keys are still being cleaned up or read on another thread.
                self._reopens_waiting += 1
                try:
                    self._cleaned_cond.wait()
                finally:
                    self._reopens_waiting -= 1
            sweep = self._streams.sweep_due(now)
            self._settle_locked(effects)
            stream = self._streams.receiving(request_id)
        if sweep:
            self._sweep_idle()
        return stream

    def load(
        self, request_id: str, *, external_req_id: str | None = None, timeout_s: float | None = None
    ) -> ChunkInputs | None:
        """Receive the whole stream of ``request_id`` and return it assembled.

        Waits until the final chunk arrives, the request fails (stall, bad
        chunk, cancel) or ``timeout_s`` (default ``stall_timeout_s``) passes
        without a chunk; a timeout is reported as a receive failure. Returns
        None on failure.
        """
        limit = self.config.stall_timeout_s if timeout_s is None else timeout_s
        stream = self._register(request_id, external_req_id, whole=True)
        if stream is None:
            raise ConfigError(f"stage {self.stage_id} has no upstream_stage_id to load from")
        effects = NO_EFFECTS
        with self._loaded_cond:
            while (
                self._streams.receiving(request_id) is stream
                and stream.phase is not RecvPhase.ENDED
                and not self.stop_event.is_set()
            ):
                remaining = stream.last_progress + limit - time.monotonic()
                if remaining <= 0:
                    effects = self._streams.fail_receiving(
                        stream,
                        f"load timed out: no chunk from stage {self.config.upstream_stage_id} "
                        f"for {format_seconds(limit)} (waiting for chunk {stream.next_chunk_id})",
                    )
                    self._settle_locked(effects)
                    break
                self._loaded_cond.wait(remaining)
            taken = self._streams.take_whole(request_id, stream)
        self._perform(effects)
        if taken is None:
            return None
        with self._failures_lock:
            self._finished_loaded.add(request_id)
        return self._assemble(request_id, taken)

    # -- taking inputs (scheduler thread) -------------------------------------------------------
    def is_ready(self, request_id: str) -> bool:
        """True unless ``request_id`` is receiving and has no new chunk yet."""
        with self._lock:
            return self._streams.is_ready(request_id)

    def is_receiving(self, request_id: str) -> bool:
        """True while ``request_id`` has a registered, unfinished incoming stream."""
        with self._lock:
            return self._streams.receiving(request_id) is not None

    def waiting_for_chunks(self, request_ids: Iterable[str]) -> set[str]:
        """The ids among ``request_ids`` receiving a stream that has no new chunk yet (one consistent read)."""
        with self._lock:
            return self._streams.waiting_for_chunks(request_ids)

    def take_inputs(self, request_id: str) -> ChunkInputs | None:
        """Assemble and hand over the chunks received for ``request_id`` since the last take.

        Returns None when nothing new arrived. After the final inputs are taken,
        the request's receiving state is released.
        """
        with self._lock:
            taken, resume = self._streams.take(request_id)
            if resume:
                self._kick_recv()
        return None if taken is None else self._assemble(request_id, taken)

    # -- cancellation and release ---------------------------------------------------------------
    def cancel(self, request_id: str, *, notify_downstream: bool | None = None) -> None:
        """Abort ``request_id`` on both sides; never waits for I/O.

        Sender side: queued chunks are dropped and the downstream stage gets an
        in-band final chunk marked ``cancelled``, so it finishes the request
        instead of stalling. When the final chunk is already queued it is left
        to go through, with the chunks before it (vllm-omni #6670: a terminal
        chunk lost at cleanup hangs the next stage). Receiver side: the stream
        stops, chunks not taken are dropped, a get in progress is not committed,
        and what the connector holds for the stream is cleaned up.

        Args:
            request_id: the request.
            notify_downstream: send the cancelled final chunk. By default only
                when this stage already sent or queued chunks of the request;
                True also when it sent nothing yet (a middle stage forwarding
                an upstream cancellation), False never.
        """
        with self._lock:
            effects = self._streams.cancel(request_id, notify_downstream, time.monotonic())
            self._settle_locked(effects)
        self._perform(effects)

    def release(self, request_id: str) -> None:
        """Forget every state of a finished request (idempotent).

        A request still streaming is cancelled first, so nothing of it leaks.
        """
        with self._lock:
            effects = self._streams.release(request_id, time.monotonic())
            self._settle_locked(effects)
        self._perform(effects)

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        """Drain ``{request_id: reason}`` of requests whose send gave up (also ages out idle state)."""
        self._sweep_idle()
        return super().collect_failed_send_request_ids()

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        """Drain ``{request_id: reason}`` of requests whose data will never arrive (also ages out idle state)."""
        self._sweep_idle()
        return super().collect_failed_receive_request_ids()

    def pending_state(self) -> dict[str, int]:
        """Sizes of the internal state (for tests, health and leak checks)."""
        self._sweep_idle()
        with self._lock:
            sizes = self._streams.sizes()
        return {**sizes, "parked": self._hooks.parked()}

    def health(self) -> dict[str, Any]:
        """Base health plus :meth:`pending_state`.

        ``status`` is ``degraded``, with ``reasons``, while the save queue is
        at least three quarters full (saves are about to wait, then fail) or
        the connector itself does not report ``ok``; ``ok`` again once that
        clears.
        """
        health = {**super().health(), **self.pending_state()}
        with self._lock:
            health["ready_chunks"] = self._streams.ready_chunks()
            health["ready_bytes"] = self._streams.ready_bytes
        reasons: list[str] = []
        limit = self.config.max_queued_chunks
        if health["queued"] * 4 >= limit * 3:
            reasons.append(f"save queue {health['queued']}/{limit} full")
        connector = health.get("connector")
        connector_status = connector.get("status") if isinstance(connector, Mapping) else None
        if connector_status not in (None, "ok"):
            reasons.append(f"connector {connector_status}")
        if reasons and health["status"] == "ok":
            health["status"] = "degraded"
            health["reasons"] = reasons
        return health

    # -- scheduler hooks (vllm-omni's names; ChunkHooks over the reads above) -----------------------
    def process_pending_chunks(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        """Before scheduling: park requests whose next chunk has not arrived.

        Parked requests are taken out of ``waiting`` / ``running`` (so the
        scheduler cannot pick them) and remembered with their place;
        requests with new chunks, finished streams, or no incoming stream stay.
        Call :meth:`restore_queues` after scheduling.
        """
        self._hooks.process_pending_chunks(waiting, running)

    def restore_queues(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        """After scheduling: put parked requests back where they were.

        Each goes right after the nearest request that preceded it before
        parking and is still in the queue (or to the front when none is), so
        the order of the queue is kept around what the scheduler changed.
        """
        self._hooks.restore_queues(waiting, running)

    def filter_scheduler_output(self, scheduler_output: SchedulerOutputLike) -> None:
        """After scheduling: attach assembled inputs, drop scheduled requests that are not ready.

        Each scheduled request with new chunks gets ``scheduler_output.chunk_inputs[request_id]``;
        a receiving request with nothing new is removed from
        ``scheduler_output.scheduled_request_ids``; others pass untouched.
        """
        self._hooks.filter_scheduler_output(scheduler_output)
