"""One connector over a stage's two edges, and the order of its puts: announcements ahead of chunks.

Announcements go ahead of chunks:
    they share the sender's window with the chunks, so a stage puts a
    request's chunks only once its announcement was put, and holds its chunk
    puts while an announcement is being put (:class:`_PutOrder`). A window
    smaller than what a stage has in flight then slows it down and never
    fails a request.

This module owns :class:`_EdgePair` (the connector the chunk manager works
over: puts go out, gets come in, each edge's failures routed to whoever owns
the key) and :class:`_PutOrder` (which outbound put may go now). Which thread
calls what: the chunk manager's save thread puts chunks (:meth:`_EdgePair.put`,
waiting in :meth:`_PutOrder.before_chunk`); the announcer thread puts
announcements and heads (:meth:`_EdgePair.put_control`); whichever thread
collects failures (the chunk manager's, the announcer) routes both edges'
failures under one lock (:meth:`_EdgePair.route_failures`); the thread that queues an announcement holds the
request's chunks (:meth:`_PutOrder.expect`). No thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

from ..connectors import OmniConnectorBase, TransferFailure, WakeupSource, bounded_timeout
from ..errors import ZmqOmniError
from ._announce import ANNOUNCE_PREFIX

logger = logging.getLogger("zmq_omni.stages")

#: Failures of chunk keys held for the chunk manager until it drains them.
_HELD_FAILURES = 65_536
#: Announcement keys remembered to attribute a failure reported after the put returned
#: (and streams whose announcement failed, to refuse their chunks).
_ANNOUNCED_KEYS = 65_536


# -- the order of a sender's puts: announcements first ------------------------------------------------
class _PutOrder:
    """Which of a stage's outbound puts may go now: announcements before chunks.

    An announcement (and a refusal, and the head) shares the sender's window
    (``max_unacked`` / ``max_unacked_bytes``) with the chunks, and a window
    slot frees only when the next stage consumes what holds it. Two rules keep
    an announcement from ever waiting behind chunks that nobody will consume:

    - **Chunks follow their announcement.** A request's chunk puts wait until
      its announcement's put returned (:meth:`expect` at ``announce``,
      :meth:`announced` when the put ended). Every chunk in the window then
      belongs to a request the next stage has been announced, so the next
      stage reads it and the window drains. A request whose announcement
      failed never puts a chunk (nor any more once the announcement's
      delivery is reported failed after its put returned, :meth:`failed_later`):
      :meth:`before_chunk` says why instead.
    - **Announcements go first.** While a control put is in progress
      (:meth:`control`, around each attempt of an announcement and each head
      put, waiting for a window slot included; not the backoff between
      attempts), no chunk put starts. A chunk put that already started and is
      waiting for a slot inside the connector still competes with it for the
      next one, so an announcement waits for a slot or two to free.

    With both, a window smaller than what a stage has in flight only slows the
    stage down: announcements wait at most for a slot or two to free, chunks
    for the next stage to consume. A separate window for control keys would
    need the transport's help; a second connector per edge would need a
    second set of sockets and threads per stage, and exists only for the
    backends that can be built twice; this order needs neither and holds for
    every backend.

    Thread safety: everything under ``_cond``'s lock. The announcer thread
    calls :meth:`control` and :meth:`announced`; the thread that queues an
    announcement calls :meth:`expect` before it queues the request's first
    chunk; the chunk manager's save thread calls :meth:`before_chunk`; any
    thread may call :meth:`close`.
    """

    def __init__(self, *, remembered: int = _ANNOUNCED_KEYS) -> None:
        self._cond = threading.Condition()
        self._controls = 0  # control puts in progress
        # Chunk prefix -> how many holds on it (announcements queued or being put, driver holds).
        self._pending: dict[str, int] = {}
        self._failed: OrderedDict[str, str] = OrderedDict()  # chunk prefix -> why its announcement failed
        self._remembered = remembered
        self._closed = False

    def expect(self, prefix: str) -> None:
        """Hold the chunk puts of the stream ``prefix`` (``{request_id}_{stage_id}_``) until its announcement ends.

        Holds are counted: each :meth:`expect` is ended by one :meth:`announced` or :meth:`release`.
        """
        with self._cond:
            self._failed.pop(prefix, None)
            self._pending[prefix] = self._pending.get(prefix, 0) + 1

    def announced(self, prefix: str, failure: str | None) -> None:
        """The announcement of ``prefix`` was put (``failure`` None) or given up (``failure`` says why)."""
        with self._cond:
            self._unhold(prefix)
            if failure is None:
                self._failed.pop(prefix, None)
            else:
                self._remember(prefix, failure)
            self._cond.notify_all()

    def release(self, prefix: str) -> None:
        """End a hold whose announcement will not be queued (nothing of it was queued either)."""
        with self._cond:
            self._unhold(prefix)
            self._cond.notify_all()

    def failed_later(self, prefix: str, failure: str) -> None:
        """The announcement of ``prefix`` was put, but its delivery failed: refuse the stream's chunks from now on."""
        with self._cond:
            self._remember(prefix, failure)
            self._cond.notify_all()

    def _unhold(self, prefix: str) -> None:
        left = self._pending.get(prefix, 0) - 1
        if left > 0:
            self._pending[prefix] = left
        else:
            self._pending.pop(prefix, None)

    def _remember(self, prefix: str, failure: str) -> None:
        self._failed[prefix] = failure
        self._failed.move_to_end(prefix)
        while len(self._failed) > self._remembered:
            self._failed.popitem(last=False)

    @contextlib.contextmanager
    def control(self) -> Iterator[None]:
        """Chunk puts wait while the body (a control put) runs."""
        with self._cond:
            self._controls += 1
        try:
            yield
        finally:
            with self._cond:
                self._controls -= 1
                if not self._controls:
                    self._cond.notify_all()

    def before_chunk(self, key: str) -> str | None:
        """Wait until the chunk ``key`` may be put: None to put it, or why it must not be.

        Waits while a control put is in progress or the stream's announcement
        has not ended; each is bounded (an announcement by its retry policy),
        and :meth:`close` ends every wait.
        """
        prefix = key[: key.rfind("_") + 1]  # chunk keys end in _<chunk id>
        with self._cond:
            while not self._closed and (self._controls or prefix in self._pending):
                self._cond.wait()
            if prefix in self._pending:
                # Closing: the announcement will never be put, so neither may its chunks. (Chunks of
                # announced requests still go: a shutdown flushes what is in flight.)
                return "the request was never announced downstream (the stage is closing)"
            return self._failed.get(prefix)

    def close(self) -> None:
        """End every wait: no announcement will be put any more (idempotent).

        Chunks of announced requests may still be put after it; those whose
        announcement never went are refused.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# -- one connector for two edges ------------------------------------------------------------------
class _EdgePair(OmniConnectorBase):
    """Puts go to the outbound connector, gets come from the inbound one.

    The chunk manager works over one connector; a stage has two edges, each
    with its own backend (chosen per edge in YAML), so this routes between them.
    Its puts are the chunk manager's, which wait their turn (``order``, see
    :class:`_PutOrder`); announcements go through :meth:`put_control`.
    """

    def __init__(self, inbound: OmniConnectorBase, outbound: OmniConnectorBase) -> None:
        super().__init__()
        self.inbound = inbound
        self.outbound = outbound
        # Two consumers read the connectors' failures (the chunk manager and the
        # announcer); whichever drains first routes each failure to the owner of
        # its key, so neither can swallow the other's. Guarded by _route_lock.
        self._route_lock = threading.Lock()
        self._chunk_failures: deque[TransferFailure] = deque(maxlen=_HELD_FAILURES)
        self.on_announce_failure: Callable[[TransferFailure], None] | None = None
        self.order = _PutOrder()

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Put a chunk through the outbound connector once :class:`_PutOrder` lets it go.

        A chunk whose request's announcement failed is not put: the put fails,
        its cause (not retryable) held for :meth:`drain_failures`.
        """
        refusal = self.order.before_chunk(put_key)
        if refusal is not None:
            failure = TransferFailure(put_key, from_stage, to_stage, "put", refusal, _Unannounced(refusal), time.time())
            with self._route_lock:
                self._hold_failure(failure)
            return False, 0, None
        return self.outbound.put(from_stage, to_stage, put_key, data)

    def put_control(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Put an announcement (or the head) through the outbound connector, ahead of any chunk."""
        with self.order.control():
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

    def route_failures(self) -> None:
        """Take both edges' failures: announcements' go to ``on_announce_failure``, the rest are held.

        Held failures (chunk keys) wait for :meth:`drain_failures`; at most
        ``_HELD_FAILURES`` are held, the oldest dropped first (with a warning).
        """
        with self._route_lock:
            pulled = self.inbound.drain_failures() + self.outbound.drain_failures()
            announcements: list[TransferFailure] = []
            for failure in pulled:
                if failure.key.startswith(ANNOUNCE_PREFIX) and self.on_announce_failure is not None:
                    announcements.append(failure)
                else:
                    self._hold_failure(failure)
            sink = self.on_announce_failure
        if sink is not None:
            for failure in announcements:
                sink(failure)

    def _hold_failure(self, failure: TransferFailure) -> None:
        """Hold a chunk key's failure for :meth:`drain_failures` (call with ``_route_lock`` held)."""
        if len(self._chunk_failures) == self._chunk_failures.maxlen:
            logger.warning(
                "dropping an uncollected transfer failure: %s [key=%r]",
                self._chunk_failures[0].reason,
                self._chunk_failures[0].key,
            )
        self._chunk_failures.append(failure)

    def drain_failures(self) -> list[TransferFailure]:
        """Failures of both edges, announcement keys excepted (those go to the announcer)."""
        self.route_failures()
        with self._route_lock:
            out = list(self._chunk_failures)
            self._chunk_failures.clear()
        return out

    def health(self) -> dict[str, Any]:
        """Status plus each edge's health."""
        inbound, outbound = self.inbound.health(), self.outbound.health()
        ok = not self._closed and inbound.get("status") == "ok" and outbound.get("status") == "ok"
        return {
            "status": "ok" if ok else ("closed" if self._closed else "degraded"),
            "inbound": inbound,
            "outbound": outbound,
        }

    def close(self) -> None:
        """Close both edges (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.order.close()
        for conn in (self.outbound, self.inbound):
            try:
                conn.close()
            except Exception:
                logger.exception("closing connector %r failed", conn)


class _Unannounced(ZmqOmniError):
    """A chunk put refused because its request was never announced downstream (not retryable)."""
