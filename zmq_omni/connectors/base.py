"""The connector contract: what every put/get backend implements.

The contract is the one of vllm-omni's ``OmniConnectorBase``, so a stage
worker written for vllm-omni can use any zmq_omni connector unchanged.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
from abc import ABCMeta, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from ..errors import ZmqOmniError
from ..metrics import Counters
from ..wire import DecodeLimits, decode, encode
from .arrivals import ArrivalWatch, Slot, WatchSet

__all__ = [
    "HEALTH_COUNTERS",
    "MAX_WAIT_S",
    "ArrivalWatch",
    "FailureSource",
    "Flushable",
    "OmniConnectorBase",
    "Slot",
    "TransferFailure",
    "WakeupSource",
    "bounded_deadline",
    "bounded_timeout",
    "key_matches_prefix",
    "key_matches_request",
]

#: The longest one call waits, whatever deadline or timeout it is given (``float("inf")`` included):
#: the waits of ``threading`` and ZeroMQ overflow long before an infinite one.
MAX_WAIT_S = 365 * 24 * 3600.0


def bounded_deadline(deadline: float) -> float:
    """``deadline`` (``time.monotonic()`` based) brought within :data:`MAX_WAIT_S` of now.

    Raises:
        ValueError: ``deadline`` is NaN (a programming error: it would expire at once, or never).
    """
    if deadline < MAX_WAIT_S:
        # time.monotonic() is never negative, so such a deadline is within bounds (the per-get hot path).
        return deadline
    if math.isnan(deadline):
        raise ValueError("deadline is NaN")
    return min(deadline, time.monotonic() + MAX_WAIT_S)


def bounded_timeout(timeout_s: float) -> float:
    """``timeout_s`` brought into ``[0, MAX_WAIT_S]``.

    Raises:
        ValueError: ``timeout_s`` is NaN.
    """
    if math.isnan(timeout_s):
        raise ValueError("timeout is NaN")
    return min(max(timeout_s, 0.0), MAX_WAIT_S)


#: Counters every connector reports in ``health()``; backends may add more.
HEALTH_COUNTERS = (
    "puts",
    "gets",
    "bytes_sent",
    "bytes_received",
    "errors",
    "timeouts",
)

#: An inline threshold no array reaches: ``serialize_obj`` keeps everything in frame 0.
_ONE_BUFFER = 1 << 62
_ONE_BUFFER_LIMITS = DecodeLimits(max_header_bytes=64 << 30, max_frames=0)

#: How many undrained failures a connector keeps; older ones are dropped (and counted).
MAX_KEPT_FAILURES = 10_000

_W = TypeVar("_W", bound=ArrivalWatch)


def key_matches_prefix(key: str, prefix: str) -> bool:
    """The ``cleanup_prefix`` rule: ``key`` is ``prefix`` followed by decimal digits only.

    This is vllm-omni's rule: chunk keys are ``{req}_{stage}_{n}``, and
    ``cleanup_prefix("req1_0_")`` must drop ``req1_0_7`` but never a key of
    another request such as ``req1_0_7_x`` or ``req1_0_x``.
    """
    return len(key) > len(prefix) and key.startswith(prefix) and key[len(prefix) :].isdigit()


def key_matches_request(key: str, request_id: str) -> bool:
    """The ``cleanup`` rule (vllm-omni's): ``key`` is ``request_id``, ``request_id_*`` or ``*_request_id``.

    A request's keys are its id alone, the id followed by ``_`` and more (chunk keys
    ``{req}_{stage}_{n}``), or something followed by ``_`` and the id. An empty id matches nothing.
    """
    if not request_id:
        return False
    return key == request_id or key.startswith(request_id + "_") or key.endswith("_" + request_id)


@dataclass(frozen=True)
class TransferFailure:
    """A put or get that failed for good, kept for the adapters to collect.

    Attributes:
        key: the put/get key.
        from_stage: the sending stage.
        to_stage: the receiving stage.
        op: ``"put"`` or ``"get"``.
        reason: a one-line human-readable reason.
        error: the typed cause, when there is one.
        at: ``time.time()`` when the failure was recorded.
    """

    key: str
    from_stage: str
    to_stage: str
    op: Literal["put", "get"]
    reason: str
    error: ZmqOmniError | None = None
    at: float = 0.0


@runtime_checkable
class Lingering(Protocol):
    """A connector whose ``close`` waits for puts in flight, for a linger the caller may set (optional feature).

    ``ZmqConnector`` has it: its ``close()`` is ``close_with_linger(close_timeout_s)``. The
    adapters, which give their puts ``shutdown_grace_s`` before closing, close with a linger of 0.
    """

    def close_with_linger(self, linger_s: float) -> None:
        """Close after waiting up to ``linger_s`` for unconfirmed puts; report those still unconfirmed."""
        ...


@runtime_checkable
class Flushable(Protocol):
    """A connector that can wait until no put depends on it staying open (optional feature).

    Every zmq_omni connector has it (:meth:`OmniConnectorBase.flush`); a
    vllm-omni connector may not, so callers test ``isinstance(c, Flushable)``.
    """

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every put so far is safe without this connector; True then."""
        ...


@runtime_checkable
class FailureSource(Protocol):
    """A connector that keeps the failures it could not report from a call (optional feature).

    The adapters turn them into failed requests; a connector without it reports nothing later.
    """

    def drain_failures(self) -> list[TransferFailure]:
        """Return and forget every failure recorded since the last call."""
        ...


@runtime_checkable
class WakeupSource(Protocol):
    """A connector that says when something arrived, so a receive loop can sleep until then (optional feature).

    ``get_wakeup_generation`` returns None when nothing arrives by itself on this
    connector (pull mode, a sender): the caller then waits in ``get_with_deadline``.
    """

    def get_wakeup_generation(self) -> int | None:
        """A counter that changes whenever items arrive; None when arrivals are not announced."""
        ...

    def wait_for_change(self, gen: int, *, timeout: float) -> int:
        """Wait until the generation differs from ``gen``, at most ``timeout``; return it then."""
        ...


def _drop_tracebacks(error: BaseException | None) -> None:
    """Cut kept errors loose from their stack frames.

    A traceback holds every frame's locals, and a failed ``put``'s frames hold
    its payload: keeping thousands of failures with their tracebacks would pin
    every refused payload in memory. The type, message and cause chain stay.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


class _ConnectorMeta(ABCMeta):
    """Marks an instance as fully built once its whole ``__init__`` chain returned."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = super().__call__(*args, **kwargs)
        instance._fully_built = True
        return instance


class OmniConnectorBase(metaclass=_ConnectorMeta):
    """Base of every connector: ``put``/``get`` keyed by ``(from_stage, to_stage, key)``.

    Who calls what, and from which thread:

    * ``__init__(config)`` -- the stage worker (or the factory), once, with the
      ``extra`` dict of a :class:`~zmq_omni.config.ConnectorSpec`. Bad config
      raises :class:`~zmq_omni.errors.ConfigError`; a bind that fails raises too.
    * ``put`` -- the adapter's save thread (vllm-omni: the sender loop). It
      copies or pins ``data`` before returning, so the caller may reuse its
      arrays at once. Returns ``(ok, nbytes, metadata)``; ``metadata`` may be
      forwarded over a control plane and passed to ``get``.
    * ``get`` -- the adapter's receive thread. Without metadata it looks the
      key up and returns ``None`` at once when it is not there yet; callers
      re-poll (or use ``get_with_deadline``). Each put is consumed exactly
      once; a re-put of an unconsumed key replaces it.
    * ``get_with_deadline`` -- the receive thread, when it would rather wait
      (on a condition, never a sleep loop) until ``time.monotonic()`` reaches
      ``deadline``.
    * ``cleanup`` / ``cleanup_prefix`` -- the scheduler thread, concurrently
      with the two above, when a request finishes or is aborted. Never block.
    * ``health`` -- any thread; a snapshot of counters and status.
    * ``drain_failures`` -- the adapters, to learn which puts/gets failed for
      good and why (for failures found after ``put`` returned, such as a
      delivery that was never acknowledged).
    * ``flush`` -- the owner, before ``close``, when it would rather wait (a
      bounded time) for puts still in flight than have ``close`` fail them.
    * ``close`` -- the owner, once or more: idempotent, never hangs. A put
      whose delivery is not confirmed yet is reported as failed, never dropped
      silently.

    Transport faults never escape ``put``/``get`` as exceptions: they return
    ``False``/``None``, are counted in ``health()`` (``timeouts`` apart from
    ``errors``) and are kept as :class:`TransferFailure` for the adapters.
    Programming errors (bad arguments, unsupported types) raise.
    """

    #: True when the backend takes raw bytes / tensors natively (vllm-omni RDMA flag).
    supports_raw_data: bool = False

    def __init__(self) -> None:
        self._closed = False
        self._counters = Counters(HEALTH_COUNTERS)
        self._failures: deque[TransferFailure] = deque(maxlen=MAX_KEPT_FAILURES)
        self._failures_lock = threading.Lock()
        self._watches = WatchSet()

    # -- the contract ---------------------------------------------------------
    # The parameter names are vllm-omni's (``put_key``, ``get_key``, ``request_id``): its callers pass
    # them by keyword, so they are part of the contract like the positions are.
    @abstractmethod
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Hand ``data`` to ``to_stage`` under ``put_key``; return ``(ok, nbytes, metadata)``."""

    @abstractmethod
    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Take the object put under ``get_key``: ``(obj, nbytes)``, or ``None`` if not there yet.

        With the ``metadata`` of a put that returned ok, the data is found even
        if it is still in flight (a backend may wait a bounded time for it);
        without metadata, or with metadata of another transport, never waits.
        """

    @abstractmethod
    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """Like :meth:`get`, waiting until ``time.monotonic() >= deadline`` at most."""

    @abstractmethod
    def cleanup(self, request_id: str) -> bool:
        """Drop everything held for the request ``request_id``; True when something was dropped.

        The keys dropped are vllm-omni's (:func:`key_matches_request`): ``request_id`` itself,
        ``request_id_*`` and ``*_request_id``.
        """

    @abstractmethod
    def cleanup_prefix(self, prefix: str) -> int:
        """Drop every key that is ``prefix`` + digits (:func:`key_matches_prefix`); return how many."""

    @abstractmethod
    def close(self) -> None:
        """Release every socket, thread and segment. Idempotent; never hangs."""

    def health(self) -> dict[str, Any]:
        """Status (``"ok"``/``"closed"``) plus every counter, as a plain dict."""
        snap = dict(self._counters.snapshot())
        snap["bytes_transferred"] = snap.get("bytes_sent", 0) + snap.get("bytes_received", 0)
        return {"status": "closed" if self._closed else "ok", **snap}

    # -- vllm-omni hooks that most backends need not implement ------------------
    def abandon_get(self, get_key: str) -> None:
        """The caller stopped waiting for ``get_key`` (vllm-omni hook; no-op by default)."""

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no put depends on this connector staying open; True then.

        Backends whose ``put`` completes before returning have nothing to wait
        for (this default); buffering ones (``ZmqConnector``) wait for delivery.
        """
        return True

    def reap_consumed(self) -> None:
        """Reclaim resources of payloads consumed by the peer (no-op by default)."""

    # -- vllm-omni's serializer hooks ------------------------------------------------
    @staticmethod
    def serialize_obj(obj: Any) -> bytes:
        """``obj`` as one ``bytes`` object in zmq_omni's wire format (vllm-omni's ``serialize_obj``).

        Arrays are copied into the one buffer (the connectors themselves send
        them as separate frames without copying). No pickle.

        Raises:
            EncodeError: ``obj`` holds a type the codec does not carry.
        """
        return bytes(encode(obj, inline_threshold=_ONE_BUFFER)[0])

    @staticmethod
    def deserialize_obj(data: bytes | bytearray | memoryview) -> Any:
        """The object :meth:`serialize_obj` turned into ``data``.

        Raises:
            DecodeError: ``data`` is not a valid single-buffer encoding.
        """
        return decode([data], limits=_ONE_BUFFER_LIMITS)

    # -- wake-ups for waiters without a thread (zmq_omni.aio) --------------------
    def watch_arrivals(self) -> ArrivalWatch | None:
        """A new :class:`ArrivalWatch` for this connector, or None when the backend offers none.

        The watch is notified when items arrive that a non-blocking :meth:`get`
        could now return (with their addresses when known), when room frees in
        the put window (see ``try_put`` where a backend has it), and at
        :meth:`close`. The caller closes it. Backends that support it:
        ``InProcConnector``, ``SharedMemoryConnector`` and ``ZmqConnector``
        (whose pull-mode receivers wait on a ``FetchChannel`` instead).
        """
        return None

    def _register_watch(self, watch: _W, *also: WatchSet) -> _W:
        """Register ``watch`` (made by a backend's :meth:`watch_arrivals`) with this connector; return it.

        The one registration path of every backend: the watch is notified by this
        connector (and by each set of ``also``, e.g. a mailbox every connector of a
        namespace shares) until it closes, and woken at once when the connector is closed.
        """
        for watches in (self._watches, *also):
            watches.add(watch)
        if self._closed:
            watch.notify(None)
        return watch

    def _notify_closed(self) -> None:
        """Wake every watch at close: waiting gets and puts then see :attr:`closed`.

        "Anything" is enough for both: a watcher checks :attr:`closed` before what a drain names.
        """
        self._notify_watches(None)

    def _notify_room(self) -> None:
        """Tell every watch that room may have freed in the put window. Any thread."""
        self._watches.notify_room()

    def _notify_watches(self, slots: Iterable[Slot] | None) -> None:
        """Tell every watch that ``slots`` arrived (None: anything changed). Any thread."""
        watches: WatchSet | None = getattr(self, "_watches", None)  # close() after a failed __init__
        if watches is not None:
            watches.notify(slots)

    # -- failures kept for the adapters ----------------------------------------
    def drain_failures(self) -> list[TransferFailure]:
        """Return and forget every failure recorded since the last call."""
        with self._failures_lock:
            out = list(self._failures)
            self._failures.clear()
        return out

    def _record_failure(
        self,
        op: Literal["put", "get"],
        from_stage: str,
        to_stage: str,
        key: str,
        reason: str,
        error: ZmqOmniError | None = None,
    ) -> None:
        """Keep a failure for :meth:`drain_failures` and count it (timeouts apart)."""
        if isinstance(error, TimeoutError):
            self._counters.add("timeouts")
        else:
            self._counters.add("errors")
        _drop_tracebacks(error)
        failure = TransferFailure(key, from_stage, to_stage, op, reason, error, time.time())
        with self._failures_lock:
            if len(self._failures) == self._failures.maxlen:
                self._counters.add("failures_dropped")
            self._failures.append(failure)

    # -- lifecycle --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self) -> OmniConnectorBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Safe after a failed __init__: _closed may not exist yet, and a connector
        # whose constructor raised was never handed to the caller, so no warning.
        if getattr(self, "_closed", True):
            return
        if not getattr(self, "_fully_built", False):
            with contextlib.suppress(Exception):
                self.close()
            return
        warnings.warn(f"unclosed connector {self!r}", ResourceWarning, stacklevel=2, source=self)
        with contextlib.suppress(Exception):  # nothing may escape __del__
            self.close()
