"""The threaded shell of :class:`~zmq_omni.adapters.OmniChunkManager` around its stream rules.

Who touches what:

* every stream's state is one :class:`~zmq_omni.adapters._streams.Streams`, read
  and changed only under ``self._lock`` (the adapter's one lock);
* each call decides under the lock (a transition of the streams, which answers
  with :class:`~zmq_omni.adapters._stream_types.Effects`), wakes the waiters the
  transition names while still holding it (:meth:`ChunkShell._settle_locked`),
  then releases it and does the rest (:meth:`ChunkShell._perform`): failure
  books, waiters of dropped saves, and every connector call. No connector call
  runs under the lock. A clean-up of a stream's keys stays booked in the
  streams until :meth:`ChunkShell._perform` reports it done (under the lock
  again); a load of a reused id waits for it, and for the receive worker to be
  done with the old stream's keys, on ``self._cleaned_cond``.
* the save worker (``save_loop``) pops an item under the lock and puts it
  without it; the receive worker (``recv_loop``) reads the streams' next keys
  without it (only it moves them, in :meth:`ChunkShell._recv_commit`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..connectors import OmniConnectorBase
from ..errors import ClosedResourceError
from ._assemble import assemble_chunks
from ._chunk_config import ChunkManagerConfig
from ._stream_types import NO_EFFECTS, Effects, RecvStream, SaveItem, Taken
from ._streams import Streams
from .base import OmniTransferAdapterBase, RecvTarget
from .scheduling import ChunkInputs

__all__ = ["ChunkShell"]

logger = logging.getLogger("zmq_omni.adapters")


class ChunkShell(OmniTransferAdapterBase):
    """The workers' side of the chunk manager: the base's hooks over :class:`Streams`, and the I/O it asks for.

    A subclass adds the public calls and calls :meth:`_start_workers` at the end of its ``__init__``.
    """

    def __init__(self, cfg: ChunkManagerConfig, connector: OmniConnectorBase | None) -> None:
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
        self._streams = Streams(cfg, time.monotonic())  # guarded by self._lock
        self._progress = threading.Event()
        self._loaded_cond = threading.Condition(self._lock)
        # Signalled (under self._lock) whenever the save queue shrinks, a stream stops or the manager stops.
        self._room_cond = threading.Condition(self._lock)
        # Signalled (under self._lock) when a clean-up of a key prefix is done, or the manager stops.
        self._cleaned_cond = threading.Condition(self._lock)
        self._reopens_waiting = 0  # loads of a reused id waiting on it (guarded by self._lock)
        self.counters.add("expired_states", 0)

    # -- deciding under the lock, doing after it -------------------------------------------
    def _check_open(self) -> None:
        """Refuse new work once stopping (call with ``self._lock`` held): it could never be served."""
        if self.stop_event.is_set():
            raise ClosedResourceError(f"the chunk manager of stage {self.stage_id} is shut down")

    def _settle_locked(self, effects: Effects) -> None:
        """The part of ``effects`` done under ``self._lock``: wake its waiters, book finished loads."""
        if effects is NO_EFFECTS:
            return
        if effects.queued:
            self._save_cond.notify()
        if effects.room:
            self._room_cond.notify_all()
        if effects.resume:
            self._kick_recv()
        if effects.changed:
            self._loaded_cond.notify_all()
        if effects.finished_loaded:
            with self._failures_lock:
                self._finished_loaded.update(effects.finished_loaded)

    def _perform(self, effects: Effects) -> None:
        """Do the I/O ``effects`` asks for (never under ``self._lock``): books, waiters, connector calls.

        Its clean-ups are reported done afterwards, even when one raised, so a load waiting on them goes on.
        """
        if effects is NO_EFFECTS:
            return
        try:
            self._perform_io(effects)
        finally:
            if effects.cleaned_prefixes:
                with self._lock:
                    if self._streams.cleaned(effects):
                        self._wake_reopens()

    def _perform_io(self, effects: Effects) -> None:
        for item in effects.released:
            if item.done is not None:
                item.done.set()
        for request_id, reason in effects.send_failures:
            self.record_send_failure(request_id, reason)
        for request_id, reason in effects.abandoned:
            # Not record_send_failure: that would fail the cancelled end of stream queued for the next stage.
            self.counters.add("send_failures")
            logger.warning("stage %s: request %s %s", self.stage_id, request_id, reason)
            with self._failures_lock:
                self._failed_send.setdefault(request_id, reason)
        for request_id, reason in effects.receive_failures:
            self.record_receive_failure(request_id, reason)
        if effects.expired:
            self.counters.add("expired_states", len(effects.expired))
        for request_id in effects.expired_received:
            logger.warning(
                "stage %s: dropping the received stream of %s: not taken for %.0fs",
                self.stage_id,
                request_id,
                self.config.idle_state_timeout_s,
            )
        for key, prefix in effects.give_up:
            # A connector that tombstones either drops late chunks of the stream at once.
            self.connector.abandon_get(key)
            self.connector.cleanup_prefix(prefix)
        for prefix in effects.cleanup:
            self.connector.cleanup_prefix(prefix)
        if effects.changed or effects.abandoned:
            self._progress.set()

    # -- the save worker -------------------------------------------------------------------
    def _next_save_item(self) -> SaveItem | None:
        item = self._streams.queue.take_next()
        if item is not None:
            self._room_cond.notify_all()
        return item

    def _drain_save_queue(self) -> list[Any]:
        unsent = self._streams.queue.take_all()
        self._room_cond.notify_all()
        return unsent

    def _on_stopping(self) -> None:
        self._room_cond.notify_all()
        self._cleaned_cond.notify_all()

    def _request_id_of_item(self, item: Any) -> str | None:
        return item.request_id if isinstance(item, SaveItem) else None

    def _send_item(self, item: Any) -> None:
        assert isinstance(item, SaveItem)
        try:
            with self._lock:
                if not self._streams.begin_put(item):
                    return
            wire = {
                "meta": {"chunk_id": item.chunk_id, "final": item.final, "cancelled": item.cancelled},
                "data": item.data,
            }
            downstream = self.config.downstream_stage_id
            assert downstream is not None
            item.ok = self._put_with_retry(item.request_id, downstream, item.key, wire)
        finally:
            with self._lock:
                ended = self._streams.put_done(item, item.ok, time.monotonic())
            if ended:
                with self._failures_lock:
                    self._finished_saved.add(item.request_id)

    def _save_item_done(self, item: Any) -> None:
        if isinstance(item, SaveItem) and item.done is not None:
            item.done.set()

    def _on_send_failure(self, request_id: str) -> None:
        with self._lock:
            effects = self._streams.send_failed(request_id)
            self._settle_locked(effects)
        self._perform(effects)
        self._progress.set()

    # -- the receive worker ------------------------------------------------------------------
    def _assemble(self, request_id: str, taken: Taken) -> ChunkInputs:
        data = assemble_chunks(taken.chunks, self.config.concat_axis)
        return ChunkInputs(request_id, data, taken.first_chunk_id, len(taken.chunks), taken.final, taken.cancelled)

    def _has_pending_loads(self) -> bool:
        return self._streams.has_readable()

    def _recv_pass(self) -> bool:
        with self._lock:
            active, effects = self._streams.scan(time.monotonic())
            self._settle_locked(effects)
        self._perform(effects)
        progressed = False
        upstream = str(self.config.upstream_stage_id)
        for stream in active:
            while not self.stop_event.is_set():
                # next_key moves only in _recv_commit, on this thread.
                target = RecvTarget(upstream, self.stage_id, stream.next_key)
                got = self.connector.get(upstream, self.stage_id, target.key)
                self._recv_after_get(target)
                if got is None:
                    break
                self.counters.add("gets")
                progressed = True
                if not self._recv_commit(target, got[0], stream):
                    break
                with self._lock:
                    if not self._streams.reads_on(stream):
                        break  # given up, or at a bound: the rest stays in the connector until these are taken
        with self._lock:
            self._streams.end_pass()
            self._wake_reopens()
        return progressed

    def _recv_target(self) -> RecvTarget | None:
        with self._lock:
            key = self._streams.next_target(time.monotonic())
        return None if key is None else RecvTarget(str(self.config.upstream_stage_id), self.stage_id, key)

    def _recv_commit(self, target: RecvTarget, obj: Any, stream: RecvStream | None = None) -> bool:
        """Apply a received chunk; False when the stream of its request stopped or ended."""
        with self._lock:
            go_on, effects = self._streams.commit(target.key, obj, time.monotonic(), stream)
            self._settle_locked(effects)
        self._perform(effects)
        return go_on

    def _recv_after_get(self, target: RecvTarget) -> None:
        """Bury the stream of ``target`` again when it was given up while the get of ``target`` ran.

        A get may lift the connector's tombstones covering its key (``ZmqConnector``
        lifts ``abandon_get``'s, never those of ``cleanup_prefix``); see
        :meth:`~zmq_omni.adapters._streams.Streams.after_get`.
        """
        with self._lock:
            effects = self._streams.after_get(target.key)
            self._wake_reopens()
        self._perform(effects)

    def _wake_reopens(self) -> None:
        """Wake the loads of reused ids waiting for the receive worker (call with ``self._lock`` held)."""
        if self._reopens_waiting:
            self._cleaned_cond.notify_all()

    def _request_id_for_key(self, key: str, op: str) -> str | None:
        with self._lock:
            return self._streams.owner(key, op)

    def _sweep_idle(self) -> None:
        """Forget the state of requests idle for ``idle_state_timeout_s`` (see :class:`ChunkManagerConfig`).

        Runs at most a few times per timeout, from the calls that add state
        (``save_async``, ``load_async``) and those the scheduler makes every
        step (``collect_failed_*``, ``pending_state``), so state cannot grow
        without a sweep; each sweep is one pass over the requests.
        """
        with self._lock:
            now = time.monotonic()
            if not self._streams.sweep_due(now):
                return
            effects = self._streams.sweep(now)
            self._settle_locked(effects)
        self._perform(effects)

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
