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

Ownership: ``save_async`` returns before the put happens, so the payload's
arrays belong to the manager from then on; do not write into them afterwards
(pass a copy when a buffer is reused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..connectors import OmniConnectorBase
from ..errors import ClosedResourceError, ConfigError, format_seconds
from ._assemble import assemble_chunks
from ._chunk_config import ChunkManagerConfig
from .base import OmniTransferAdapterBase, RecvTarget
from .scheduling import SchedulableRequest, SchedulerOutputLike

__all__ = ["ChunkInputs", "ChunkManagerConfig", "OmniChunkManager"]

R = TypeVar("R", bound=SchedulableRequest)

logger = logging.getLogger("zmq_omni.adapters")

#: How many finished requests the manager remembers (to attribute late failures
#: and to refuse a second stream under a used id); older ones are forgotten.
_REMEMBERED = 65_536


def _payload_nbytes(data: Mapping[str, Any]) -> int:
    """Bytes a received chunk holds: its arrays' ``nbytes`` plus ``bytes``/``str`` lengths (for max_ready_bytes)."""
    total = 0
    for value in data.values():
        nbytes = getattr(value, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
        elif isinstance(value, (bytes, bytearray, str)):
            total += len(value)
    return total


@dataclass(frozen=True)
class ChunkInputs:
    """The assembled inputs of one request for one scheduling step.

    Attributes:
        request_id: the request.
        data: the chunks received since the last take, assembled.
        first_chunk_id: id of the oldest chunk in ``data``.
        num_chunks: how many chunks ``data`` holds (empty keep-alive chunks excluded).
        is_final: the upstream stream ended with these inputs; nothing more comes.
        cancelled: the upstream cancelled the request; ``data`` may be incomplete.
    """

    request_id: str
    data: dict[str, Any]
    first_chunk_id: int
    num_chunks: int
    is_final: bool
    cancelled: bool = False


@dataclass
class _SaveItem:
    request_id: str
    key: str
    chunk_id: int
    data: Mapping[str, Any]
    final: bool
    cancelled: bool = False
    done: threading.Event | None = None
    ok: bool = False


@dataclass
class _SendState:
    request_id: str
    prefix: str
    next_chunk_id: int = 0
    terminal_queued: bool = False
    cancelled: bool = False
    failed: bool = False
    last_activity: float = field(default_factory=time.monotonic)


@dataclass
class _RecvState:
    request_id: str
    prefix: str
    last_progress: float
    next_chunk_id: int = 0
    ready: list[Mapping[str, Any]] = field(default_factory=list)
    first_ready_id: int = 0
    final: bool = False
    cancelled_upstream: bool = False
    all_chunks: list[Mapping[str, Any]] | None = None  # kept for a synchronous load()
    ready_bytes: int = 0  # payload bytes of ``ready`` (0 for a load(): it is not bounded)
    paused_at: float | None = None  # when the receive worker found it at a bound (its stall timer stops)


class OmniChunkManager(OmniTransferAdapterBase):
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
        super().__init__(
            cfg,
            connector,
            stage_id=cfg.stage_id,
            retry=cfg.retry,
            recv_wait_s=cfg.recv_wait_s,
            shutdown_grace_s=cfg.shutdown_grace_s,
            name="chunks",
        )
        self.config: ChunkManagerConfig = cfg
        self._save_queue: deque[_SaveItem] = deque()
        self._send: dict[str, _SendState] = {}
        self._recv: dict[str, _RecvState] = {}
        self._ready_bytes = 0  # sum of ready_bytes over _recv (guarded by self._lock)
        self._rotation = 0
        # key prefix -> request id, for failures reported by key (bounded, LRU).
        self._send_owner: OrderedDict[str, str] = OrderedDict()
        self._recv_owner: OrderedDict[str, str] = OrderedDict()
        self._ended_streams: OrderedDict[str, None] = OrderedDict()
        self._progress = threading.Event()
        self._loaded_cond = threading.Condition(self._lock)
        self._sent_cond = threading.Condition(self._lock)
        self._parked: dict[str, tuple[list[str], list[Any]]] = {}
        # Signalled (under self._lock) whenever the save queue shrinks or the manager stops.
        self._room_cond = threading.Condition(self._lock)
        self._last_sweep = time.monotonic()
        self.counters.add("expired_states", 0)
        self._start_workers()

    # -- keys --------------------------------------------------------------------------
    def send_key(self, external_req_id: str, chunk_id: int) -> str:
        """The key chunk ``chunk_id`` of a request is put under by this stage."""
        return f"{external_req_id}_{self.stage_id}_{chunk_id}"

    def recv_key(self, external_req_id: str, chunk_id: int) -> str:
        """The key chunk ``chunk_id`` of a request is read from (upstream stage id)."""
        return f"{external_req_id}_{self.config.upstream_stage_id}_{chunk_id}"

    @staticmethod
    def _remember(book: OrderedDict[str, Any], key: str, value: Any) -> None:
        book[key] = value
        book.move_to_end(key)
        while len(book) > _REMEMBERED:
            book.popitem(last=False)

    def _check_open(self) -> None:
        """Refuse new work once stopping (call with ``self._lock`` held): it could never be served."""
        if self.stop_event.is_set():
            raise ClosedResourceError(f"the chunk manager of stage {self.stage_id} is shut down")

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
        _save_item = self._queue_chunk(request_id, payload, is_final, external_req_id, None)
        return None if _save_item is None else _save_item.chunk_id

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
    ) -> _SaveItem | None:
        if self.config.downstream_stage_id is None:
            raise ConfigError(f"stage {self.stage_id} has no downstream_stage_id to send to")
        if payload is not None and not isinstance(payload, Mapping):
            raise TypeError(f"chunk payload must be a mapping, got {type(payload).__name__}")
        with self._lock:
            self._check_open()
            state = self._send.get(request_id)
            if state is None:
                if request_id in self._ended_streams:
                    raise ValueError(f"request {request_id!r} already ended its stream")
                prefix = f"{external_req_id or request_id}_{self.stage_id}_"
                state = self._send[request_id] = _SendState(request_id, prefix)
                self._remember(self._send_owner, prefix, request_id)
            if state.cancelled or state.failed:
                return None
            if state.terminal_queued:
                raise ValueError(f"request {request_id!r}: chunk after the final one")
            if len(self._save_queue) >= self.config.max_queued_chunks and not self._wait_for_room(state):
                if not (state.cancelled or state.failed):
                    self.record_send_failure(
                        request_id,
                        f"save queue full: {len(self._save_queue)} chunks queued (max_queued_chunks) "
                        f"and no room within {self.config.queue_full_timeout_s:g}s",
                    )
                return None
            state.last_activity = time.monotonic()
            item = _SaveItem(
                request_id,
                f"{state.prefix}{state.next_chunk_id}",
                state.next_chunk_id,
                payload or {},
                is_final,
                done=done,
            )
            state.next_chunk_id += 1
            state.terminal_queued = is_final
            self._save_queue.append(item)
            self._save_cond.notify()
        self._sweep_idle()
        return item

    def _wait_for_room(self, state: _SendState) -> bool:
        """Wait (lock held) up to ``queue_full_timeout_s`` for room in the save queue; True when there is.

        Ends early, False, when the request stopped meanwhile; raises once the manager stops.
        """
        deadline = time.monotonic() + self.config.queue_full_timeout_s
        while len(self._save_queue) >= self.config.max_queued_chunks:
            self._check_open()
            if state.cancelled or state.failed or self._send.get(state.request_id) is not state:
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._room_cond.wait(remaining)
        return True

    def _next_save_item(self) -> _SaveItem | None:
        if not self._save_queue:
            return None
        self._room_cond.notify_all()
        return self._save_queue.popleft()

    def _drain_save_queue(self) -> list[Any]:
        unsent, self._save_queue = list(self._save_queue), deque()
        self._room_cond.notify_all()
        return unsent

    def _on_stopping(self) -> None:
        self._room_cond.notify_all()

    def _sweep_idle(self, *, force: bool = False) -> None:
        """Forget the state of requests idle for ``idle_state_timeout_s`` (see :class:`ChunkManagerConfig`).

        Runs at most a few times per timeout, from the calls that add state
        (``save_async``, ``load_async``) and those the scheduler makes every
        step (``collect_failed_*``, ``pending_state``), so state cannot grow
        without a sweep; each sweep is one pass over the requests.
        """
        ttl = self.config.idle_state_timeout_s
        now = time.monotonic()
        if not force and now - self._last_sweep < min(1.0, ttl / 4):
            return
        self._last_sweep = now
        abandoned: list[str] = []
        with self._lock:
            busy = {item.request_id for item in self._save_queue}
            if isinstance(self._save_in_flight, _SaveItem):
                busy.add(self._save_in_flight.request_id)
            for request_id, state in list(self._send.items()):
                receiving = self._recv.get(request_id)
                if (
                    request_id in busy
                    or now - state.last_activity < ttl
                    or (receiving is not None and not receiving.final)
                ):
                    # A middle stage still receiving the request is bounded by stall_timeout_s.
                    continue
                if state.failed or state.cancelled or state.terminal_queued:
                    del self._send[request_id]
                    self._remember(self._ended_streams, request_id, None)
                    self.counters.add("expired_states")
                else:
                    abandoned.append(request_id)
            for request_id, recv in list(self._recv.items()):
                # Unfinished streams are bounded by stall_timeout_s already; a finished
                # one whose inputs nobody takes would stay forever.
                if recv.final and recv.all_chunks is None and now - recv.last_progress >= ttl:
                    self._drop_recv_locked(request_id)
                    self.counters.add("expired_states")
                    logger.warning(
                        "stage %s: dropping the received stream of %s: not taken for %.0fs",
                        self.stage_id,
                        request_id,
                        ttl,
                    )
        for request_id in abandoned:
            # A stream left open: end it for the next stage (cancelled) and tell the scheduler.
            self.cancel(request_id, notify_downstream=True)
            self.counters.add("send_failures")
            logger.warning("stage %s: request %s abandoned: no chunk queued for %.0fs", self.stage_id, request_id, ttl)
            with self._failures_lock:
                self._failed_send.setdefault(
                    request_id, f"abandoned: no chunk queued for {ttl:g}s (idle_state_timeout_s); stream cancelled"
                )
            self._progress.set()

    def _request_id_of_item(self, item: Any) -> str | None:
        return item.request_id if isinstance(item, _SaveItem) else None

    def _send_item(self, item: Any) -> None:
        assert isinstance(item, _SaveItem)
        with self._lock:
            state = self._send.get(item.request_id)
            if state is None or state.failed:
                return
        wire = {
            "meta": {"chunk_id": item.chunk_id, "final": item.final, "cancelled": item.cancelled},
            "data": item.data,
        }
        downstream = self.config.downstream_stage_id
        assert downstream is not None
        item.ok = self._put_with_retry(item.request_id, downstream, item.key, wire)
        state.last_activity = time.monotonic()
        if item.ok and item.final:
            with self._lock:
                if self._send.get(item.request_id) is state:
                    del self._send[item.request_id]
                self._remember(self._ended_streams, item.request_id, None)
            with self._failures_lock:
                self._finished_saved.add(item.request_id)

    def _save_item_done(self, item: Any) -> None:
        if isinstance(item, _SaveItem) and item.done is not None:
            item.done.set()

    def _on_send_failure(self, request_id: str) -> None:
        with self._lock:
            state = self._send.get(request_id)
            if state is not None:
                state.failed = True
                self._drop_queued(request_id)
                self._room_cond.notify_all()  # a save of this request waiting for room gives up now
        self._progress.set()

    def _drop_queued(self, request_id: str) -> list[_SaveItem]:
        """Remove and return the queued items of ``request_id`` (lock held)."""
        dropped = [item for item in self._save_queue if item.request_id == request_id]
        if dropped:
            self._save_queue = deque(item for item in self._save_queue if item.request_id != request_id)
            self._room_cond.notify_all()
            for item in dropped:
                if item.done is not None:
                    item.done.set()
        return dropped

    def stream_refusal(self, request_id: str) -> str | None:
        """Why this stage could not stream ``request_id`` downstream, or None when it can.

        A request id names one stream per stage: once its stream ended (its
        final chunk was put, or the request was released), or while its final
        chunk is queued, :meth:`save_async` refuses it. A stage worker asks
        this when a request is announced, to refuse a reused id at once.
        """
        with self._lock:
            if request_id in self._ended_streams:
                return f"request {request_id!r} already ended its stream"
            state = self._send.get(request_id)
            if state is not None and state.terminal_queued:
                return f"request {request_id!r} is ending its stream"
            return None

    # -- receiver side --------------------------------------------------------------------
    def load_async(self, request_id: str, *, external_req_id: str | None = None) -> None:
        """Start receiving the chunk stream of ``request_id``; returns at once, idempotent.

        A no-op on a stage without an upstream stage (stage 0).

        Raises:
            ClosedResourceError: the manager is shut down (or its workers stopped).
        """
        self._register(request_id, external_req_id, keep_all=False)

    def _register(self, request_id: str, external_req_id: str | None, *, keep_all: bool) -> _RecvState | None:
        if self.config.upstream_stage_id is None:
            return None
        with self._lock:
            self._check_open()
            state = self._recv.get(request_id)
            if state is None:
                prefix = f"{external_req_id or request_id}_{self.config.upstream_stage_id}_"
                state = self._recv[request_id] = _RecvState(request_id, prefix, time.monotonic())
                self._remember(self._recv_owner, prefix, request_id)
                self._kick_recv()
            if keep_all and state.all_chunks is None:
                state.all_chunks = list(state.ready)
                # A load() returns the whole stream: its chunks do not count against max_ready_bytes.
                self._ready_bytes -= state.ready_bytes
                state.ready_bytes = 0
        self._sweep_idle()
        return state

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
        state = self._register(request_id, external_req_id, keep_all=True)
        if state is None:
            raise ConfigError(f"stage {self.stage_id} has no upstream_stage_id to load from")
        with self._loaded_cond:
            while self._recv.get(request_id) is state and not state.final and not self.stop_event.is_set():
                remaining = state.last_progress + limit - time.monotonic()
                if remaining <= 0:
                    self._fail_receiving_locked(
                        state,
                        f"load timed out: no chunk from stage {self.config.upstream_stage_id} "
                        f"for {format_seconds(limit)} (waiting for chunk {state.next_chunk_id})",
                    )
                    return None
                self._loaded_cond.wait(remaining)
            if self._recv.get(request_id) is not state or not state.final:
                return None
            chunks = state.all_chunks or []
            self._drop_recv_locked(request_id)
        with self._failures_lock:
            self._finished_loaded.add(request_id)
        return ChunkInputs(
            request_id, assemble_chunks(chunks, self.config.concat_axis), 0, len(chunks), True, state.cancelled_upstream
        )

    def _has_pending_loads(self) -> bool:
        return any(not state.final and not self._paused_locked(state) for state in self._recv.values())

    def _paused_locked(self, state: _RecvState) -> bool:
        """True while the receive worker must not read ``state``'s stream: it is at a bound (lock held).

        A stream with no untaken chunk is never paused, so every request can progress.
        """
        return (
            bool(state.ready)
            and state.all_chunks is None
            and (len(state.ready) >= self.config.max_ready_chunks or self._ready_bytes >= self.config.max_ready_bytes)
        )

    def _readable_locked(self, now: float) -> list[_RecvState]:
        """The unfinished streams the receive worker may read now (lock held).

        Notes when each stream pauses at a bound and, when it resumes, moves its
        stall timer on by the pause: only time spent waiting for the upstream counts.
        """
        readable: list[_RecvState] = []
        for state in self._recv.values():
            if state.final:
                continue
            if self._paused_locked(state):
                if state.paused_at is None:
                    state.paused_at = now
                continue
            if state.paused_at is not None:
                state.last_progress += now - state.paused_at
                state.paused_at = None
            readable.append(state)
        return readable

    def _drop_recv_locked(self, request_id: str) -> _RecvState | None:
        """Remove a receiving state and its untaken bytes (lock held); wake the receive worker if that frees room."""
        state = self._recv.pop(request_id, None)
        if state is not None and state.ready_bytes:
            at_bound = self._ready_bytes >= self.config.max_ready_bytes
            self._ready_bytes -= state.ready_bytes
            state.ready_bytes = 0
            if at_bound:
                self._kick_recv()
        return state

    def _recv_pass(self) -> bool:
        now = time.monotonic()
        stalled: list[_RecvState] = []
        with self._lock:
            active = self._readable_locked(now)
            for state in active:
                if now - state.last_progress > self.config.stall_timeout_s:
                    stalled.append(state)
        for state in stalled:
            with self._lock:
                if self._recv.get(state.request_id) is state and not state.final:
                    self._fail_receiving_locked(
                        state,
                        f"stalled: no chunk from stage {self.config.upstream_stage_id} for "
                        f"{format_seconds(self.config.stall_timeout_s)} "
                        f"(waiting for chunk {state.next_chunk_id})",
                    )
        progressed = False
        upstream = self.config.upstream_stage_id
        assert upstream is not None or not active
        for state in active:
            if state in stalled:
                continue
            while not self.stop_event.is_set():
                key = f"{state.prefix}{state.next_chunk_id}"
                got = self.connector.get(str(upstream), self.stage_id, key)
                self._recv_after_get(RecvTarget(str(upstream), self.stage_id, key))
                if got is None:
                    break
                self.counters.add("gets")
                progressed = True
                if not self._recv_commit(RecvTarget(str(upstream), self.stage_id, key), got[0], state):
                    break
                with self._lock:
                    if self._paused_locked(state):
                        break  # the rest stays in the connector until the scheduler takes these
        return progressed

    def _recv_target(self) -> RecvTarget | None:
        with self._lock:
            active = self._readable_locked(time.monotonic())
            if not active:
                return None
            self._rotation = (self._rotation + 1) % len(active)
            state = active[self._rotation]
            return RecvTarget(str(self.config.upstream_stage_id), self.stage_id, f"{state.prefix}{state.next_chunk_id}")

    def _recv_commit(self, target: RecvTarget, obj: Any, state: _RecvState | None = None) -> bool:
        """Apply a received chunk; False when the stream of its request stopped."""
        with self._lock:
            if state is None:
                prefix = target.key.rstrip("0123456789")
                request_id = self._recv_owner.get(prefix)
                state = self._recv.get(request_id) if request_id is not None else None
            # The request may have been cancelled or released while the get ran
            # (cleanup is a barrier): then the chunk is dropped, never committed.
            if state is None or self._recv.get(state.request_id) is not state or state.final:
                return False
            if target.key != f"{state.prefix}{state.next_chunk_id}":
                return False
            meta = obj.get("meta") if isinstance(obj, Mapping) else None
            data = obj.get("data") if isinstance(obj, Mapping) else None
            if (
                not isinstance(meta, Mapping)
                or not isinstance(data, Mapping)
                or meta.get("chunk_id") != state.next_chunk_id
            ):
                self._fail_receiving_locked(state, f"bad chunk under {target.key!r}: not a chunk of this stream")
                return False
            state.next_chunk_id += 1
            state.last_progress = time.monotonic()
            final = bool(meta.get("final"))
            if data or final:
                if not state.ready:
                    state.first_ready_id = state.next_chunk_id - 1
                state.ready.append(data)
                if state.all_chunks is not None:
                    state.all_chunks.append(data)
                else:
                    nbytes = _payload_nbytes(data)
                    state.ready_bytes += nbytes
                    self._ready_bytes += nbytes
            if final:
                state.final = True
                state.cancelled_upstream = bool(meta.get("cancelled"))
                with self._failures_lock:
                    if state.all_chunks is None:
                        self._finished_loaded.add(state.request_id)
            self._loaded_cond.notify_all()
        self._progress.set()
        if final:
            # Drop anything a retried put may have left behind for this stream.
            self.connector.cleanup_prefix(state.prefix)
        return not final

    def _recv_after_get(self, target: RecvTarget) -> None:
        """Bury the stream of ``target`` again when it was given up while the get of ``target`` ran.

        A get may lift the connector's tombstones covering its key (someone wants
        it again; ``ZmqConnector`` lifts ``abandon_get``'s, never those of
        ``cleanup_prefix``). A cancel, release or failure that gave the stream up
        between this worker choosing the key and its get returning laid those
        tombstones first, so a connector whose get lifted them would leave the
        stream's later chunks waiting unclaimed until its ``unclaimed_ttl_s``
        instead of dropping them as cancelled.
        """
        prefix = target.key.rstrip("0123456789")
        with self._lock:
            request_id = self._recv_owner.get(prefix)
            state = self._recv.get(request_id) if request_id is not None else None
            if state is not None and state.prefix == prefix:
                return  # still receiving (or ended normally: its final chunk's cleanup buries it)
        self._give_up_stream(prefix, int(target.key[len(prefix) :] or 0))

    def _fail_receiving_locked(self, state: _RecvState, reason: str) -> None:
        self._drop_recv_locked(state.request_id)
        self._loaded_cond.notify_all()
        self.record_receive_failure(state.request_id, reason)
        self._progress.set()
        self._give_up_stream(state.prefix, state.next_chunk_id)

    def _give_up_stream(self, prefix: str, next_chunk_id: int) -> None:
        """Tell the connector nobody will read this stream any more, so it can release what comes for it.

        ``abandon_get`` names the key a get was (or would next be) waiting on;
        ``cleanup_prefix`` drops what is held under the stream's keys now. A
        connector that keeps a tombstone for either drops late chunks at once.
        """
        self.connector.abandon_get(f"{prefix}{next_chunk_id}")
        self.connector.cleanup_prefix(prefix)

    def _request_id_for_key(self, key: str, op: str) -> str | None:
        prefix = key.rstrip("0123456789")
        with self._lock:
            book = self._send_owner if op == "put" else self._recv_owner
            return book.get(prefix)

    # -- taking inputs (scheduler thread) -------------------------------------------------------
    def is_ready(self, request_id: str) -> bool:
        """True unless ``request_id`` is receiving and has no new chunk yet."""
        with self._lock:
            state = self._recv.get(request_id)
            return state is None or bool(state.ready) or state.final

    def is_receiving(self, request_id: str) -> bool:
        """True while ``request_id`` has a registered, unfinished incoming stream."""
        with self._lock:
            return request_id in self._recv

    def take_inputs(self, request_id: str) -> ChunkInputs | None:
        """Assemble and hand over the chunks received for ``request_id`` since the last take.

        Returns None when nothing new arrived. After the final inputs are taken,
        the request's receiving state is released.
        """
        with self._lock:
            return self._take_locked(request_id)

    def _take_locked(self, request_id: str) -> ChunkInputs | None:
        state = self._recv.get(request_id)
        if state is None or not (state.ready or state.final):
            return None
        chunks, state.ready = state.ready, []
        # Taking frees room: a stream paused at a bound (this one, or any at the byte bound) reads on.
        resume = state.paused_at is not None or self._ready_bytes >= self.config.max_ready_bytes
        self._ready_bytes -= state.ready_bytes
        state.ready_bytes = 0
        if state.final:
            del self._recv[request_id]
        if resume:
            self._kick_recv()
        return ChunkInputs(
            request_id,
            assemble_chunks(chunks, self.config.concat_axis),
            state.first_ready_id,
            len(chunks),
            state.final,
            state.cancelled_upstream,
        )

    def wait_for_progress(self, timeout: float | None = None) -> bool:
        """Block until a chunk arrived, a stream ended or a failure was recorded.

        For a stage worker's loop: ``wait_for_progress(0.1)`` then schedule.
        Returns False on timeout.
        """
        happened = self._progress.wait(timeout)
        self._progress.clear()
        return happened

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """Note that data for ``request_id`` will never arrive (also wakes :meth:`wait_for_progress`)."""
        super().record_receive_failure(request_id, reason)
        self._progress.set()

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
        prefix: str | None = None
        with self._lock:
            state = self._send.get(request_id)
            if (
                state is None
                and notify_downstream
                and self.config.downstream_stage_id is not None
                and request_id not in self._ended_streams
            ):
                ext = request_id
                recv = self._recv.get(request_id)
                if recv is not None:
                    ext = recv.prefix[: -len(f"_{self.config.upstream_stage_id}_")]
                state = self._send[request_id] = _SendState(request_id, f"{ext}_{self.stage_id}_")
                self._remember(self._send_owner, state.prefix, request_id)
            if state is not None and not state.cancelled and not state.failed and not state.terminal_queued:
                dropped = self._drop_queued(request_id)
                if dropped:
                    state.next_chunk_id = min(item.chunk_id for item in dropped)
                state.cancelled = True
                self._room_cond.notify_all()  # a save of this request waiting for room gives up now
                if notify_downstream is not False:
                    item = _SaveItem(
                        request_id,
                        f"{state.prefix}{state.next_chunk_id}",
                        state.next_chunk_id,
                        {},
                        True,
                        cancelled=True,
                    )
                    state.next_chunk_id += 1
                    state.terminal_queued = True
                    self._save_queue.append(item)
                    self._save_cond.notify()
            recv = self._drop_recv_locked(request_id)
            if recv is not None:
                prefix = recv.prefix
                self._loaded_cond.notify_all()
        if recv is not None and prefix is not None:
            self._give_up_stream(prefix, recv.next_chunk_id)

    def release(self, request_id: str) -> None:
        """Forget every state of a finished request (idempotent).

        A request still streaming is cancelled first, so nothing of it leaks.
        """
        with self._lock:
            state = self._send.get(request_id)
            streaming = (
                state is not None and not state.terminal_queued and not state.failed
            ) or request_id in self._recv
        if streaming:
            self.cancel(request_id)
        with self._lock:
            state = self._send.get(request_id)
            if state is not None and (
                state.failed or not any(item.request_id == request_id for item in self._save_queue)
            ):
                del self._send[request_id]
                self._remember(self._ended_streams, request_id, None)

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
            return {
                "sending": len(self._send),
                "receiving": len(self._recv),
                "queued": len(self._save_queue),
                "parked": sum(len(p[1]) for p in self._parked.values()),
            }

    def health(self) -> dict[str, Any]:
        """Base health plus :meth:`pending_state`.

        ``status`` is ``degraded``, with ``reasons``, while the save queue is
        at least three quarters full (saves are about to wait, then fail) or
        the connector itself does not report ``ok``; ``ok`` again once that
        clears.
        """
        health = {**super().health(), **self.pending_state()}
        with self._lock:
            health["ready_chunks"] = sum(len(state.ready) for state in self._recv.values())
            health["ready_bytes"] = self._ready_bytes
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

    # -- scheduler hooks ----------------------------------------------------------------------------
    def process_pending_chunks(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        """Before scheduling: park requests whose next chunk has not arrived.

        Parked requests are taken out of ``waiting`` / ``running`` (so the
        scheduler cannot pick them) and remembered with their place;
        requests with new chunks, finished streams, or no incoming stream stay.
        Call :meth:`restore_queues` after scheduling.
        """
        with self._lock:
            if any(parked for _, parked in self._parked.values()):
                # restore_queues was skipped: put the previous step's requests back first.
                logger.warning("stage %s: process_pending_chunks called twice without restore_queues", self.stage_id)
                self._restore_locked(waiting, running)
            for name, queue in (("waiting", waiting), ("running", running)):
                parked: list[R] = []
                keep: list[R] = []
                for request in queue:
                    state = self._recv.get(request.request_id)
                    if state is not None and not state.ready and not state.final:
                        parked.append(request)
                    else:
                        keep.append(request)
                if parked:
                    order = [request.request_id for request in queue]
                    queue.clear()
                    queue.extend(keep)
                    self._parked[name] = (order, parked)

    def restore_queues(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        """After scheduling: put parked requests back where they were.

        Each goes right after the nearest request that preceded it before
        parking and is still in the queue (or to the front when none is), so
        the order of the queue is kept around what the scheduler changed.
        """
        with self._lock:
            self._restore_locked(waiting, running)

    def _restore_locked(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        for name, queue in (("waiting", waiting), ("running", running)):
            entry = self._parked.pop(name, None)
            if entry is None:
                continue
            order, parked = entry
            result = list(queue)
            ids = [request.request_id for request in result]
            present = set(ids)
            position = {rid: i for i, rid in enumerate(order)}
            for request in parked:
                rid = request.request_id
                if rid in present:
                    continue
                at = 0
                for earlier in reversed(order[: position[rid]]):
                    if earlier in present:
                        at = ids.index(earlier) + 1
                        break
                result.insert(at, request)
                ids.insert(at, rid)
                present.add(rid)
            queue.clear()
            queue.extend(result)

    def filter_scheduler_output(self, scheduler_output: SchedulerOutputLike) -> None:
        """After scheduling: attach assembled inputs, drop scheduled requests that are not ready.

        Each scheduled request with new chunks gets ``scheduler_output.chunk_inputs[request_id]``;
        a receiving request with nothing new is removed from
        ``scheduler_output.scheduled_request_ids``; others pass untouched.
        """
        kept: list[str] = []
        with self._lock:
            for request_id in scheduler_output.scheduled_request_ids:
                if request_id not in self._recv:
                    kept.append(request_id)
                    continue
                inputs = self._take_locked(request_id)
                if inputs is not None:
                    scheduler_output.chunk_inputs[request_id] = inputs
                    kept.append(request_id)
        scheduler_output.scheduled_request_ids[:] = kept
