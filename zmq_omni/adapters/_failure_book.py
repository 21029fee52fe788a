"""What an adapter reports to its scheduler: the requests that finished, and the ones that failed.

:class:`FailureBook` is the part of :class:`~zmq_omni.adapters.OmniTransferAdapterBase`
that books send and receive failures (the first reason of each request; their
warnings summed up by :class:`WarningBurst`) and finished requests, for the
scheduler to drain once per step.

Failures a connector finds after ``put`` returned (a delivery never
acknowledged) are kept by the connector; the adapter drains them with
``connector.drain_failures()`` whenever failures are collected or a put fails,
and books them as send failures of the request that owns the key.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import NamedTuple

from ..connectors import FailureSource, OmniConnectorBase, TransferFailure
from ..metrics import Counters
from ._warning_burst import WarningBurst

__all__ = ["FailureBook", "FinishedRequests"]

logger = logging.getLogger("zmq_omni.adapters")


class FinishedRequests(NamedTuple):
    """Requests whose transfer finished since the last call (each reported once)."""

    saved: frozenset[str]
    """Requests whose last item (the terminal chunk) was put successfully."""
    loaded: frozenset[str]
    """Requests whose last item (the terminal chunk) was received."""


class FailureBook(ABC):
    """The failure and finish bookkeeping of :class:`~zmq_omni.adapters.OmniTransferAdapterBase`.

    Its state is set by the adapter's ``__init__``; everything below
    ``_failures_lock`` is guarded by that lock.
    """

    stage_id: str
    counters: Counters
    connector: OmniConnectorBase
    _failures_lock: threading.Lock
    _send_warnings: WarningBurst
    _recv_warnings: WarningBurst
    _failed_send: dict[str, str]
    _failed_recv: dict[str, str]
    _finished_saved: set[str]
    _finished_loaded: set[str]
    # The key the save thread is putting right now, and the cause the connector reported for it.
    _attempt_key: str | None
    _attempt_cause: TransferFailure | None

    def get_finished_requests(self) -> FinishedRequests:
        """Drain the requests that finished saving / loading since the last call."""
        with self._failures_lock:
            out = FinishedRequests(frozenset(self._finished_saved), frozenset(self._finished_loaded))
            self._finished_saved.clear()
            self._finished_loaded.clear()
        return out

    def record_send_failure(self, request_id: str | None, reason: str) -> None:
        """Note that data of ``request_id`` will never be delivered.

        Called from the save thread (or when connector failures are drained);
        the scheduler drains with :meth:`collect_failed_send_request_ids`. The
        first reason of a request is kept. ``None`` means the failure could
        not be tied to a request: it is logged and counted, never lost silently.
        """
        self.counters.add("send_failures")
        if request_id is None:
            self.counters.add("unattributed_send_failures")
        with self._failures_lock:
            if request_id is not None:
                self._failed_send.setdefault(request_id, reason)
            full, summary = self._send_warnings.note(request_id, reason, time.monotonic())
        if summary:
            logger.warning("stage %s: send failures: %s", self.stage_id, summary)
        if full:
            if request_id is None:
                logger.warning("stage %s: send failure for no known request: %s", self.stage_id, reason)
            else:
                logger.warning("stage %s: request %s send failed: %s", self.stage_id, request_id, reason)
        if request_id is not None:
            self._on_send_failure(request_id)

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """Note that data for ``request_id`` will never arrive (stall, bad chunk)."""
        self.counters.add("receive_failures")
        with self._failures_lock:
            self._failed_recv.setdefault(request_id, reason)
            full, summary = self._recv_warnings.note(request_id, reason, time.monotonic())
        if summary:
            logger.warning("stage %s: receive failures: %s", self.stage_id, summary)
        if full:
            logger.warning("stage %s: request %s receive failed: %s", self.stage_id, request_id, reason)

    def _flush_warnings(self) -> None:
        """Log what the warning bursts counted but did not log yet (at shutdown)."""
        with self._failures_lock:
            sends, receives = self._send_warnings.flush(), self._recv_warnings.flush()
        if sends:
            logger.warning("stage %s: send failures: %s", self.stage_id, sends)
        if receives:
            logger.warning("stage %s: receive failures: %s", self.stage_id, receives)

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        """Drain and return ``{request_id: reason}`` for requests whose send gave up."""
        self._absorb_connector_failures()
        with self._failures_lock:
            out = dict(self._failed_send)
            self._failed_send.clear()
        return out

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        """Drain and return ``{request_id: reason}`` for requests whose data will never arrive."""
        self._absorb_connector_failures()
        with self._failures_lock:
            out = dict(self._failed_recv)
            self._failed_recv.clear()
        return out

    def _absorb_connector_failures(self) -> None:
        """Turn failures the connector kept into send / receive failures of their requests."""
        if not isinstance(self.connector, FailureSource):
            return
        failures: list[TransferFailure] = self.connector.drain_failures()
        for failure in failures:
            if failure.op == "put":
                with self._failures_lock:
                    if failure.key == self._attempt_key:
                        self._attempt_cause = failure
                        continue
                self.record_send_failure(
                    self._request_id_for_key(failure.key, "put"), f"{failure.reason} [key={failure.key!r}]"
                )
            else:
                request_id = self._request_id_for_key(failure.key, "get")
                if request_id is None:
                    logger.warning("stage %s: receive failure for no known request: %s", self.stage_id, failure.reason)
                else:
                    self.record_receive_failure(request_id, f"{failure.reason} [key={failure.key!r}]")

    # -- hooks for subclasses --------------------------------------------------------------
    def _on_send_failure(self, request_id: str) -> None:
        """Called after a send failure of ``request_id`` was booked (drop its queued items)."""

    @abstractmethod
    def _request_id_for_key(self, key: str, op: str) -> str | None:
        """Which request a put/get key belongs to, or None when unknown."""
