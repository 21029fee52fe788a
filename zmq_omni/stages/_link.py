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
    is picked up. After every announcement (before the request's chunks) the
    sender also puts its ``seq`` under ``_zo_req_{stage_id}_head`` (one
    attempt; a re-put replaces an unconsumed one, so it holds one window slot
    at most; one that failed is put again after the next announcement or after
    a second idle): a receiver that finds nothing at its next ``seq`` while the
    head is at or past it reads what is left up to the head and goes on after
    it, so a receiver that (re)started after its upstream announced many
    requests (a second ``zmq-omni drive`` against running stages, a restarted
    stage), or a gap of lost announcements wider than the look-ahead, costs a
    wait for the next head, not the requests after it. A receiver still does
    not learn about requests announced before it came back: restart a
    pipeline from its last stage.

Announcements go ahead of chunks:
    they share the sender's window with the chunks, so a stage puts a
    request's chunks only once its announcement was put, and holds its chunk
    puts while an announcement is being put (:class:`_PutOrder`). A window
    smaller than what a stage has in flight then slows it down and never
    fails a request.

Refusals travel as announcements too:
    a stage that cannot serve an announced request (its id was already used:
    the stream under it ended, or it is in flight) announces
    ``{"request_id": ..., "error": reason}`` instead of streaming it; every
    stage after it forwards such an announcement at once, so the driver fails
    the request with the real reason within a few hops' latency. Announcement
    keys are fresh per announcement, so a reused request id cannot block them.

Reserved payload keys (removed before the user function sees the payload):
    ``_zo_error``: a request failed upstream; the worker forwards the error to
    the next stage at once instead of calling the function, so the driver
    learns of the failure without waiting for a stall timeout.
    ``_zo_trace``: ``{stage_id: [t_received, t_sent]}`` wall-clock stamps of
    each hop, used for per-hop latency figures.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
from ..config import ConnectorSpec
from ..connectors import OmniConnectorBase, TransferFailure, WakeupSource, bounded_timeout, create_connector
from ..errors import TransportError, ZmqOmniError

logger = logging.getLogger("zmq_omni.stages")

ERROR_KEY = "_zo_error"
TRACE_KEY = "_zo_trace"
ANNOUNCE_PREFIX = "_zo_req_"
#: How far past the next expected announcement a receiver looks for later ones.
_ANNOUNCE_WINDOW = 16
#: The key (after ``_zo_req_{stage_id}``) of the sequence number of a stage's latest announcement.
HEAD_SUFFIX = "_head"
#: How many announcements before the head a receiver that jumps to it still reads.
_CATCH_UP = 1024
#: Failures of chunk keys held for the chunk manager until it drains them.
_HELD_FAILURES = 65_536
#: Announcement keys remembered to attribute a failure reported after the put returned
#: (and streams whose announcement failed, to refuse their chunks).
_ANNOUNCED_KEYS = 65_536
#: Seconds an idle announcer waits before it tries again a head put that failed.
_HEAD_RETRY_S = 1.0


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
        only once the announcement was (see :class:`_PutOrder`). ``held``: the
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
        inbound = self.connector.inbound
        next_seq = 0
        taken_ahead: set[int] = set()

        head_key = f"{ANNOUNCE_PREFIX}{self.upstream}{HEAD_SUFFIX}"

        def key(seq: int) -> str:
            return f"{ANNOUNCE_PREFIX}{self.upstream}_{seq}"

        def admit(obj: Any) -> None:
            request_id = obj.get("request_id") if isinstance(obj, Mapping) else None
            error = obj.get("error") if isinstance(obj, Mapping) else None
            if not isinstance(request_id, str) or not isinstance(error, (str, type(None))):
                logger.warning("%s %s: ignoring a malformed announcement %r", self.label, self.stage_id, obj)
                return
            if error is None:
                self.chunks.load_async(request_id)
            self.admitted.put((request_id, error))

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
                    logger.info("%s %s: stage %s restarted its announcements", self.label, self.stage_id, self.upstream)
                    next_seq, taken_ahead = seq + 1, set()
                else:
                    taken_ahead.add(seq)
            if next_seq in taken_ahead:
                # What was read ahead (after a restart: from its seq 1 on) is behind us now.
                while next_seq in taken_ahead:
                    taken_ahead.discard(next_seq)
                    next_seq += 1
                continue
            # Still nothing at next_seq while the upstream's head says it announced
            # it (or later): those announcements went to an earlier incarnation of
            # this stage (a driver run before this one, a stage since restarted)
            # or were given up. Read what is still there, then go on after the head.
            head = inbound.get(self.upstream, self.stage_id, head_key)
            latest = head[0].get("seq") if head is not None and isinstance(head[0], Mapping) else None
            if not isinstance(latest, int) or latest < next_seq:
                continue
            for seq in range(max(next_seq, latest - _CATCH_UP + 1), latest + 1):
                if seq not in taken_ahead and (found := inbound.get(self.upstream, self.stage_id, key(seq))):
                    admit(found[0])
            logger.info(
                "%s %s: announcements %d..%d of stage %s were not for this incarnation; going on at %d",
                self.label,
                self.stage_id,
                next_seq,
                latest,
                self.upstream,
                latest + 1,
            )
            next_seq, taken_ahead = latest + 1, {seq for seq in taken_ahead if seq > latest}
            while next_seq in taken_ahead:
                taken_ahead.discard(next_seq)
                next_seq += 1

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


class _Unannounced(ZmqOmniError):
    """A chunk put refused because its request was never announced downstream (not retryable)."""
