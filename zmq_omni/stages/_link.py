"""What a stage worker and the pipeline driver share: a chunk manager over an edge pair, and announcements.

:class:`_Endpoint` assembles a stage's link to its neighbours: the
:class:`~zmq_omni.stages._edge._EdgePair` over its two edges, the
:class:`~zmq_omni.adapters.OmniChunkManager` over that, and the announcements
(:mod:`zmq_omni.stages._announce` says how they work) in both directions. It
owns the writing side of the announcements and runs two helper threads:

- the announcer (``<label>-announce-<stage id>``): puts queued announcements
  in order under fresh keys, with the retry policy, then the head; it alone
  touches the announcement sequence and ``_peer_down``;
- the admitter (``<label>-admit-<stage id>``):
  :func:`~zmq_omni.stages._announce.read_announcements`, registering each
  request with ``load_async`` and handing it to the owner through
  :attr:`_Endpoint.admitted`.

The owner's thread (the worker's main loop, the driver's callers) calls
:meth:`_Endpoint.announce`, :meth:`_Endpoint.hold` and
:meth:`_Endpoint.withdraw`, and reads ``admitted`` and ``announce_failures``.

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
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

from ..adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase, TransferFailure, create_connector
from ..errors import TransportError
from ._announce import ANNOUNCE_PREFIX, HEAD_SUFFIX, read_announcements
from ._edge import _ANNOUNCED_KEYS, _EdgePair

__all__ = ["ANNOUNCE_PREFIX", "ERROR_KEY", "HEAD_SUFFIX", "TRACE_KEY"]

logger = logging.getLogger("zmq_omni.stages")

ERROR_KEY = "_zo_error"
TRACE_KEY = "_zo_trace"
#: Seconds an idle announcer waits before it tries again a head put that failed.
_HEAD_RETRY_S = 1.0


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
                ChunkManagerConfig(
                    stage_id=self.stage_id,
                    upstream_stage_id=self.upstream,
                    downstream_stage_id=self.downstream,
                    retry=retry,
                    stall_timeout_s=stall_timeout_s,
                ),
                self.connector,
            )
        except BaseException:
            self.connector.close()
            raise
        self.stop_event = threading.Event()
        # (request id, None) for a request to serve (its load is registered), or
        # (request id, reason) for one an upstream stage refused or failed before streaming.
        self.admitted: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
        self.announce_failures: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._announce_queue: deque[tuple[str, str | None]] = deque()
        self._announce_cond = threading.Condition()
        self._seq = 0
        # Announcement key -> request id, and the key being put now with the cause
        # found for it (guarded by _announce_lock; written by the announcer, read by
        # whichever thread routes the connectors' failures).
        self._announce_lock = threading.Lock()
        self._announced_keys: OrderedDict[str, tuple[str, bool]] = OrderedDict()  # key -> (request id, streams)
        self._announce_attempt: str | None = None
        self._announce_cause: TransferFailure | None = None
        self.connector.on_announce_failure = self._on_announce_failure
        self._head_key = f"{ANNOUNCE_PREFIX}{self.stage_id}{HEAD_SUFFIX}"
        # The last announcement exhausted the retry policy on a retryable fault (announcer thread only).
        self._peer_down = False
        self._threads = [
            threading.Thread(
                target=self._guard, args=(self._announce_loop,), daemon=True, name=f"{label}-announce-{self.stage_id}"
            ),
            threading.Thread(
                target=self._guard, args=(self._admit_loop,), daemon=True, name=f"{label}-admit-{self.stage_id}"
            ),
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
                self.connector.order.close()  # no announcement will be put: chunks waiting for one stop

    # announcements out ----------------------------------------------------------------------------
    def announce(self, request_id: str, *, error: str | None = None, held: bool = False) -> None:
        """Queue the announcement of a new request to the downstream stage (returns at once).

        Call it before queuing the request's first chunk: its chunks are put
        only once the announcement was (see :class:`~zmq_omni.stages._edge._PutOrder`). ``held``: the
        caller already called :meth:`hold` for it (the announcement ends that hold).

        With ``error``, announce instead that the request failed before any of
        its chunks went downstream (it was refused): the downstream stages
        forward that to the driver, which fails the request with ``error``.
        """
        if error is None and not held:
            self.connector.order.expect(self._chunk_prefix(request_id))
        with self._announce_cond:
            self._announce_queue.append((request_id, error))
            self._announce_cond.notify()

    def hold(self, request_id: str) -> None:
        """Hold the chunks of ``request_id`` until its announcement is put, for a chunk queued before :meth:`announce`.

        Then call ``announce(request_id, held=True)``, or :meth:`withdraw` when
        the chunk could not be queued after all.
        """
        self.connector.order.expect(self._chunk_prefix(request_id))

    def withdraw(self, request_id: str) -> None:
        """End a :meth:`hold` whose chunk was not queued and whose announcement will not be.

        Holds are counted, so an earlier attempt of the same id whose
        announcement is still queued keeps holding (and then releases) its own chunk.
        """
        self.connector.order.release(self._chunk_prefix(request_id))

    def _chunk_prefix(self, request_id: str) -> str:
        """The key prefix of the chunks this endpoint's chunk manager puts for ``request_id``."""
        return f"{request_id}_{self.stage_id}_"

    def _announce_loop(self) -> None:
        head: int | None = None  # the latest seq announced whose head put has not gone yet
        while True:
            with self._announce_cond:
                while not self._announce_queue and not self.stop_event.is_set():
                    if head is None or self._peer_down:
                        self._announce_cond.wait()
                    elif not self._announce_cond.wait(_HEAD_RETRY_S):
                        break  # idle with a head that could not be put: try it again
                if self.stop_event.is_set():
                    return
                item = self._announce_queue.popleft() if self._announce_queue else None
            if item is None:
                head = self._put_head(head)
                continue
            request_id, error = item
            key = f"{ANNOUNCE_PREFIX}{self.stage_id}_{self._seq}"
            self._seq += 1
            if self._put_announcement(key, request_id, error):
                # The head goes after every announcement, before the request's chunks: a
                # receiver behind (restarted, or a new driver) reads neither announcements
                # past its look-ahead nor chunks it was not announced, so only the head,
                # put while the window still has room, lets it catch up (see _put_head).
                head = self._put_head(self._seq - 1)
                if error is None:
                    self.connector.order.announced(self._chunk_prefix(request_id), None)
            else:
                reason = f"could not announce the request to stage {self.downstream} (key {key!r})"
                if error is None:
                    self.connector.order.announced(self._chunk_prefix(request_id), reason)
                self.announce_failures.put((request_id, reason))

    def _put_head(self, head: int | None) -> int | None:
        """Put ``head`` as the latest announced seq; what is still to put (None when it went, or nothing was due).

        One attempt, and none while the downstream is known down: the head only
        helps a receiver that (re)started behind. A re-put replaces the
        unconsumed one, so it holds at most one window slot. One that failed is
        tried again after the next announcement (with a newer seq) or when the
        announcer has been idle for ``_HEAD_RETRY_S``.
        """
        if head is None or self._peer_down or self.stop_event.is_set():
            return head
        ok, _, _ = self.connector.put_control(self.stage_id, self.downstream, self._head_key, {"seq": head})
        return None if ok else head

    def _on_announce_failure(self, failure: TransferFailure) -> None:
        """A failure of an announcement key, routed here by the edge pair (any thread)."""
        if failure.key == self._head_key:
            return  # best effort by design (see _put_head)
        with self._announce_lock:
            if failure.key == self._announce_attempt:
                self._announce_cause = failure  # the cause of the put in progress (maybe retried)
                return
            announced = self._announced_keys.pop(failure.key, None)
        if announced is None:
            logger.warning(
                "%s %s: failure of an unknown announcement: %s [key=%r]",
                self.label,
                self.stage_id,
                failure.reason,
                failure.key,
            )
            return
        # Delivery of an announcement that put accepted failed later: the request
        # can never be started downstream, so its chunks (and a cancel marker) must
        # not take window slots there either.
        request_id, streams = announced
        reason = f"announcing the request to stage {self.downstream} failed: {failure.reason} [key={failure.key!r}]"
        if streams:
            self.connector.order.failed_later(self._chunk_prefix(request_id), reason)
        self.announce_failures.put((request_id, reason))

    def _put_announcement(self, key: str, request_id: str, error: str | None = None) -> bool:
        body: dict[str, str] = (
            {"request_id": request_id} if error is None else {"request_id": request_id, "error": error}
        )

        def attempt() -> None:
            if self.stop_event.is_set():
                raise InterruptedError("stopping")
            with self._announce_lock:
                self._announce_attempt, self._announce_cause = key, None
            # Chunk puts wait only while this put runs (for a window slot included),
            # not through the backoff between attempts: chunks of announced requests
            # drain, so the window frees a slot for the next attempt.
            ok, _, _ = self.connector.put_control(self.stage_id, self.downstream, key, body)
            if ok:
                with self._announce_lock:
                    self._announce_attempt = None
                    self._announced_keys[key] = (request_id, error is None)
                    while len(self._announced_keys) > _ANNOUNCED_KEYS:
                        self._announced_keys.popitem(last=False)
                return
            self.connector.route_failures()
            with self._announce_lock:
                cause, self._announce_attempt, self._announce_cause = self._announce_cause, None, None
            if cause is not None and cause.error is not None:
                raise cause.error
            raise _AnnounceFailed(f"put of {key!r} failed" + (f": {cause.reason}" if cause is not None else ""))

        # Once an announcement exhausted the policy on a retryable fault, the downstream is
        # taken as down and each announcement gets one attempt (as the chunk manager does
        # for chunks), until one goes through.
        policy = self.retry.single_attempt() if self._peer_down else self.retry
        try:
            policy.retrying(stop_event=self.stop_event)(attempt)
        except Exception as exc:
            with self._announce_lock:
                self._announce_attempt = None
            if not self.stop_event.is_set():
                if policy.retryable(exc):
                    self._peer_down = True
                logger.warning("%s %s: announcing %s failed: %s", self.label, self.stage_id, request_id, exc)
            return False
        self._peer_down = False
        return True

    # announcements in -----------------------------------------------------------------------------
    def _admit_loop(self) -> None:
        read_announcements(
            self.connector.inbound,
            upstream=self.upstream,
            stage_id=self.stage_id,
            label=self.label,
            stop_event=self.stop_event,
            admit=self._admit,
        )

    def _admit(self, request_id: str, error: str | None) -> None:
        if error is None:
            self.chunks.load_async(request_id)
        self.admitted.put((request_id, error))

    def close(self) -> None:
        """Stop the helpers, shut the chunk manager down and close both connectors."""
        self.stop_event.set()
        with self._announce_cond:
            self._announce_cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(1.0)
        # Announcements still queued never go: their chunks are refused now, not after the shutdown's
        # grace; chunks of announced requests are still flushed by the shutdown.
        self.connector.order.close()
        self.chunks.shutdown()
        self.connector.close()


class _AnnounceFailed(TransportError):
    """An announcement put returned False without a typed cause (retryable, like any transport fault)."""
