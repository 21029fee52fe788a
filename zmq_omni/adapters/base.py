"""The transfer adapter base: two worker threads beside a scheduler.

Who calls what, and from which thread:

* the **scheduler thread** registers work with ``load_async`` / ``save_async``
  (they return at once), reads results with ``get_finished_requests()`` and the
  subclass's accessors, and drains failures with
  ``collect_failed_send_request_ids()`` / ``collect_failed_receive_request_ids()``
  once per step, failing those requests instead of waiting for them;
* the **save thread** (``save_loop``) sleeps on a condition until work is
  queued or the adapter stops, then puts each item with the retry policy;
* the **receive thread** (``recv_loop``) makes one non-blocking pass over the
  pending loads; when a pass made no progress it blocks in the connector's
  ``get_with_deadline`` on one pending key for at most ``recv_wait_s`` (or in
  the connector's ``wait_for_change`` when the connector offers one), and when
  nothing is pending it sleeps on a condition until ``load_async`` or
  ``shutdown`` wakes it. An idle adapter therefore never runs.

Why a bounded ``get_with_deadline`` rather than a wakeup per key: the connector
contract can wait on one key only, and a stage waits on many (one per
request). Blocking on one of them for a bounded slice wakes the thread at once
for that key and within ``recv_wait_s`` for any other, costs nothing when no
load is pending, and a few non-blocking ``get`` calls per slice otherwise;
vllm-omni's 1 ms polling costs a thousand passes a second instead.

The failures and finished requests an adapter reports to its scheduler are
booked by :class:`~zmq_omni.adapters._failure_book.FailureBook`, which this
base extends; this module re-exports their public names.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConnectorSpec
from ..connectors import (
    Flushable,
    Lingering,
    OmniConnectorBase,
    TransferFailure,
    WakeupSource,
    create_connector,
)
from ..errors import ClosedResourceError, ConfigError, TransportError
from ..metrics import Counters
from ._failure_book import FailureBook, FinishedRequests
from ._warning_burst import WARNING_INTERVAL_S, WarningBurst  # noqa: F401 - WARNING_INTERVAL_S is importable from here too
from .retry import RetryPolicy

__all__ = ["FinishedRequests", "OmniTransferAdapterBase", "RecvTarget", "WarningBurst"]

logger = logging.getLogger("zmq_omni.adapters")


@dataclass(frozen=True)
class RecvTarget:
    """One key the receive thread may block on: ``(from_stage, to_stage, key)``."""

    from_stage: str
    to_stage: str
    key: str


class _AttemptFailed(TransportError):
    """A put returned False and the connector kept no typed cause."""


class OmniTransferAdapterBase(FailureBook, ABC):
    """Base of the transfer adapters: two daemon workers, retries and failure reporting.

    Subclasses implement the data handling (chunks, KV blocks) through the
    hooks ``_recv_pass``, ``_recv_target``, ``_recv_commit``,
    ``_has_pending_loads``, ``_send_item`` and ``_request_id_for_key``, and call
    :meth:`_start_workers` at the end of their ``__init__``.

    Attributes:
        config: the subclass's config object, as given.
        connector: the connector every put/get goes through.
        recv_thread: the receive worker (``recv_loop``).
        save_thread: the save worker (``save_loop``).
        stop_event: set by :meth:`shutdown`; every wait of both workers ends on it.
    """

    def __init__(
        self,
        config: Any,
        connector: OmniConnectorBase | None = None,
        *,
        stage_id: str,
        retry: RetryPolicy | None = None,
        recv_wait_s: float = 0.01,
        shutdown_grace_s: float = 0.5,
        name: str = "adapter",
    ) -> None:
        if recv_wait_s <= 0:
            raise ConfigError(f"'recv_wait_s' must be > 0, got {recv_wait_s}")
        self.config = config
        self.stage_id = str(stage_id)
        self.retry_policy = retry if retry is not None else RetryPolicy()
        self.recv_wait_s = recv_wait_s
        self.shutdown_grace_s = shutdown_grace_s
        self.stop_event = threading.Event()
        self.counters = Counters(("puts", "put_retries", "gets", "send_failures", "receive_failures"))
        # One lock guards every piece of request state, so cancellation can touch
        # both sides atomically; the conditions let each worker sleep on it.
        self._lock = threading.RLock()
        self._save_cond = threading.Condition(self._lock)
        self._recv_cond = threading.Condition(self._lock)
        self._failures_lock = threading.Lock()
        # Guarded by _failures_lock: a burst of failures (a stopped downstream) logs one line per interval.
        self._send_warnings = WarningBurst()
        self._recv_warnings = WarningBurst()
        self._failed_send: dict[str, str] = {}
        self._failed_recv: dict[str, str] = {}
        self._finished_saved: set[str] = set()
        self._finished_loaded: set[str] = set()
        # The key the save thread is putting right now: a connector failure for it
        # is the cause of that attempt (maybe retried), not a final send failure.
        self._attempt_key: str | None = None
        self._attempt_cause: TransferFailure | None = None
        self._peer_down: set[str] = set()
        self._recv_kick = False
        # The item the save thread is handling (guarded by ``self._lock``): shutdown()
        # releases its waiter even when the put inside outlives the grace period.
        self._save_in_flight: Any | None = None
        self._closed = False
        self._owns_connector = connector is None
        self.connector: OmniConnectorBase = connector if connector is not None else self.create_connector(config)
        self.recv_thread = threading.Thread(
            target=self._guarded, args=(self.recv_loop,), daemon=True, name=f"{name}-recv-{self.stage_id}"
        )
        self.save_thread = threading.Thread(
            target=self._guarded, args=(self.save_loop,), daemon=True, name=f"{name}-save-{self.stage_id}"
        )

    # -- construction ------------------------------------------------------------
    @classmethod
    def create_connector(cls, config: Any) -> OmniConnectorBase:
        """Build the connector named by ``config`` through the factory.

        ``config`` may be a :class:`ConnectorSpec`, a ``{"name", "extra"}`` dict,
        or an object (or dict) holding one under ``connector``.
        """
        spec: Any = config
        if isinstance(config, Mapping) and "connector" in config:
            spec = config["connector"]
        elif not isinstance(config, (Mapping, ConnectorSpec)):
            spec = getattr(config, "connector", None)
        if spec is None:
            raise ConfigError("adapter config names no 'connector' and no connector was given")
        return create_connector(spec)

    def _start_workers(self) -> None:
        self.recv_thread.start()
        self.save_thread.start()

    def _guarded(self, loop: Any) -> None:
        try:
            loop()
        except Exception:
            # A worker that dies silently would turn every later request into a hang.
            logger.exception("adapter worker %s crashed; stopping the adapter", threading.current_thread().name)
            self.stop_event.set()
            with self._lock:
                self._save_cond.notify_all()
                self._recv_cond.notify_all()
                self._on_stopping()
            # Nothing will send what is queued: fail it now rather than at shutdown().
            self._fail_unsent(f"adapter worker {threading.current_thread().name} crashed")

    # -- the public surface ---------------------------------------------------------
    def load(self, *args: Any, **kwargs: Any) -> Any:
        """Load data synchronously (blocking, bounded). Subclasses define the signature."""
        raise NotImplementedError

    def load_async(self, *args: Any, **kwargs: Any) -> Any:
        """Register a request to load; returns at once. Subclasses define the signature."""
        raise NotImplementedError

    def save(self, *args: Any, **kwargs: Any) -> Any:
        """Save data synchronously (blocking, bounded). Subclasses define the signature."""
        raise NotImplementedError

    def save_async(self, *args: Any, **kwargs: Any) -> Any:
        """Queue data to save; returns at once. Subclasses define the signature."""
        raise NotImplementedError

    def health(self) -> dict[str, Any]:
        """Adapter counters, worker liveness and the connector's own health."""
        return {
            "status": "closed" if self._closed else ("stopped" if self.stop_event.is_set() else "ok"),
            "recv_thread_alive": self.recv_thread.is_alive(),
            "save_thread_alive": self.save_thread.is_alive(),
            **self.counters.snapshot(),
            "connector": self.connector.health(),
        }

    def shutdown(self) -> None:
        """Stop both workers and close the connector; idempotent, bounded.

        The receive worker leaves within ``recv_wait_s``; retry back-offs end at
        once. A save worker still inside one ``put`` is given
        ``shutdown_grace_s``, and what is left of it goes to the connector's
        ``flush`` (puts still in flight get there); the connector is then
        closed regardless (its ``close`` never hangs and reports a put still
        unconfirmed, which is booked as a send failure of its request, so
        ``get_finished_requests`` still tells the scheduler). Items still
        queued are then failed (a send failure of their request, reason "shut
        down") and every waiter on a save is released, so no call waits past
        ``shutdown``. Both workers are daemon threads, so neither can keep the
        process alive.
        """
        if self._closed:
            return
        self._closed = True
        self.stop_event.set()
        with self._lock:
            self._save_cond.notify_all()
            self._recv_cond.notify_all()
            self._on_stopping()
        deadline = time.monotonic() + self.shutdown_grace_s
        for thread in (self.recv_thread, self.save_thread):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        try:
            connector = self.connector  # a vllm-omni connector may lack flush
            if isinstance(connector, Flushable) and not connector.flush(max(0.0, deadline - time.monotonic())):
                logger.warning("stage %s: puts still unconfirmed after shutdown_grace_s", self.stage_id)
            if isinstance(connector, Lingering):
                connector.close_with_linger(0.0)  # the grace above was its linger
            else:
                connector.close()
            self._absorb_connector_failures()
        except Exception:
            logger.exception("stage %s: connector close failed", self.stage_id)
        for thread in (self.recv_thread, self.save_thread):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(0.2)
                if thread.is_alive():
                    logger.warning("stage %s: worker %s still busy after shutdown", self.stage_id, thread.name)
        self._fail_unsent("the adapter shut down before it was sent")
        self._flush_warnings()

    def _fail_unsent(self, reason: str) -> None:
        """Fail every item still queued and release every waiter (shutdown's last step).

        A queued item's request is booked as a send failure (once per request);
        the item in flight, if its put outlived the grace period, has its waiter
        released now, unsent as far as that waiter knows.
        """
        with self._lock:
            unsent = self._drain_save_queue()
            in_flight, self._save_in_flight = self._save_in_flight, None
        failed: set[str] = set()
        for item in unsent:
            request_id = self._request_id_of_item(item)
            if request_id is not None and request_id not in failed:
                failed.add(request_id)
                self.record_send_failure(request_id, reason)
            self._save_item_done(item)
        if in_flight is not None:
            self._save_item_done(in_flight)

    close = shutdown

    def __enter__(self) -> OmniTransferAdapterBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the workers ----------------------------------------------------------------
    def save_loop(self) -> None:
        """Send queued items until :meth:`shutdown`; sleeps on a condition when idle."""
        while True:
            with self._save_cond:
                # Once stopping, nothing more is popped: what is still queued stays
                # there for shutdown() to fail, so no item is lost between the two.
                item = None
                while not self.stop_event.is_set():
                    item = self._next_save_item()
                    if item is not None:
                        break
                    self._save_cond.wait()
                if item is None:
                    return
                self._save_in_flight = item
            try:
                self._send_item(item)
            except Exception as exc:
                # A send that raised (a processor bug, an unencodable payload) is a
                # give-up, not a retry: report it so the scheduler fails the request.
                logger.exception("stage %s: sending an item failed", self.stage_id)
                self.record_send_failure(self._request_id_of_item(item), f"send raised {type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._save_in_flight = None
                self._save_item_done(item)

    def recv_loop(self) -> None:
        """Receive for every pending load until :meth:`shutdown` (see the module docstring)."""
        wakeups = self.connector if isinstance(self.connector, WakeupSource) else None
        while not self.stop_event.is_set():
            generation = None if wakeups is None else wakeups.get_wakeup_generation()
            if self._recv_pass():
                continue
            with self._recv_cond:
                if not self._has_pending_loads() and not self._recv_kick and not self.stop_event.is_set():
                    self._recv_cond.wait()
                    continue
                self._recv_kick = False
            if generation is not None and wakeups is not None:
                wakeups.wait_for_change(generation, timeout=self.recv_wait_s)
                continue
            target = self._recv_target()
            if target is None:
                continue
            try:
                got = self.connector.get_with_deadline(
                    target.from_stage, target.to_stage, target.key, deadline=time.monotonic() + self.recv_wait_s
                )
            except Exception:
                if self.stop_event.is_set():
                    return
                raise
            if got is not None:
                self.counters.add("gets")
                self._recv_commit(target, got[0])
            self._recv_after_get(target)

    def _kick_recv(self) -> None:
        """Wake the receive worker for new work (call with ``self._lock`` held)."""
        self._recv_kick = True
        self._recv_cond.notify_all()

    # -- sending with the retry policy -------------------------------------------------
    def _put_with_retry(self, request_id: str | None, to_stage: str, key: str, data: Any) -> bool:
        """Put ``data`` under ``key`` with the retry policy; a give-up is recorded. True when sent."""
        policy = self.retry_policy
        if to_stage in self._peer_down:
            # The last put to this stage already exhausted its policy: try once, so a
            # dead stage costs one put timeout per request instead of a whole policy.
            policy = policy.single_attempt()
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            if self.stop_event.is_set():
                raise ClosedResourceError("adapter is shutting down")
            if attempts > 1:
                self.counters.add("put_retries")
            with self._failures_lock:
                self._attempt_key, self._attempt_cause = key, None
            ok, _nbytes, _meta = self.connector.put(self.stage_id, to_stage, key, data)
            if ok:
                with self._failures_lock:
                    self._attempt_key = None
                return
            self._absorb_connector_failures()
            with self._failures_lock:
                cause, self._attempt_cause, self._attempt_key = self._attempt_cause, None, None
            if cause is not None and cause.error is not None:
                raise cause.error
            raise _AttemptFailed(cause.reason if cause is not None else "connector.put reported failure")

        started = time.monotonic()
        try:
            policy.retrying(stop_event=self.stop_event)(attempt)
        except Exception as exc:
            with self._failures_lock:
                self._attempt_key = None
            if policy.retryable(exc) and not self.stop_event.is_set():
                self._peer_down.add(to_stage)
            reason = (
                f"put {key!r} to stage {to_stage} gave up after {attempts} attempt(s) "
                f"in {time.monotonic() - started:.2f}s: {type(exc).__name__}: {exc}"
            )
            self.record_send_failure(request_id, reason)
            return False
        self._peer_down.discard(to_stage)
        self.counters.add("puts")
        return True

    # -- hooks for subclasses --------------------------------------------------------------
    def _on_stopping(self) -> None:
        """Wake the subclass's own waiters at shutdown (called with ``self._lock`` held)."""

    @abstractmethod
    def _next_save_item(self) -> Any | None:
        """Pop the next item to send, or None (called with ``self._lock`` held)."""

    def _save_item_done(self, item: Any) -> None:
        """Called after ``item`` was handled, sent or not (may be called twice for one item)."""

    def _drain_save_queue(self) -> list[Any]:
        """Remove and return every queued item (called with ``self._lock`` held, at shutdown)."""
        return []

    @abstractmethod
    def _send_item(self, item: Any) -> None:
        """Send one item (on the save thread); use :meth:`_put_with_retry`."""

    @abstractmethod
    def _request_id_of_item(self, item: Any) -> str | None:
        """The request a queued item belongs to."""

    @abstractmethod
    def _has_pending_loads(self) -> bool:
        """True while some load waits for data (called with ``self._lock`` held)."""

    @abstractmethod
    def _recv_pass(self) -> bool:
        """One non-blocking pass over the pending loads; True when anything progressed."""

    @abstractmethod
    def _recv_target(self) -> RecvTarget | None:
        """The key to block on after a pass without progress."""

    @abstractmethod
    def _recv_commit(self, target: RecvTarget, obj: Any) -> bool:
        """Take the object received for ``target``; False when its stream has stopped."""

    def _recv_after_get(self, target: RecvTarget) -> None:
        """Called after every blocking get of ``target`` (whether it returned an object or not).

        A get may lift the connector's tombstones of its key (``ZmqConnector``: those of
        ``abandon_get``, not a cleanup's); a subclass whose stream of that key was given
        up while the get ran lays them again here.
        """
