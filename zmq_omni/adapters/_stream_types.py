"""The records of the chunk streams: phases, streams, queued chunks, and the effects a transition answers with.

The rules that move them are :mod:`zmq_omni.adapters._streams`; nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol

__all__ = [
    "NO_EFFECTS",
    "PROGRESS",
    "RESUME",
    "STOPPED",
    "Effects",
    "RecvPhase",
    "RecvStream",
    "SaveItem",
    "SendPhase",
    "SendStream",
    "Taken",
    "Waiter",
]


class SendPhase(enum.Enum):
    """Where a request's send stream is (see the module docstring)."""

    OPEN = "open"
    ENDING = "ending"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    FAILED = "failed"
    ENDED = "ended"


#: The phases in which nothing more of the request's own chunks is sent.
STOPPED = (SendPhase.CANCELLING, SendPhase.CANCELLED, SendPhase.FAILED)


class RecvPhase(enum.Enum):
    """Where a request's receive stream is (see the module docstring)."""

    READING = "reading"
    PAUSED = "paused"
    ENDED = "ended"


class Waiter(Protocol):
    """What a synchronous ``save`` waits on: set once its chunk was handled."""

    def set(self) -> None:
        """Wake the waiter."""


@dataclass(eq=False)
class SendStream:
    """One request's outgoing stream."""

    request_id: str
    prefix: str
    last_activity: float
    phase: SendPhase = SendPhase.OPEN
    next_chunk_id: int = 0


@dataclass(eq=False)
class SaveItem:
    """One chunk queued for the save worker: put ``{"meta", "data"}`` under ``key``."""

    request_id: str
    key: str
    chunk_id: int
    data: Mapping[str, Any]
    final: bool
    cancelled: bool = False
    done: Waiter | None = None
    ok: bool = False


@dataclass(eq=False)
class RecvStream:
    """One request's incoming stream."""

    request_id: str
    prefix: str
    last_progress: float
    phase: RecvPhase = RecvPhase.READING
    next_chunk_id: int = 0
    ready: list[Mapping[str, Any]] = field(default_factory=list)
    first_ready_id: int = 0
    ready_bytes: int = 0  # payload bytes of ``ready`` (0 for a whole-stream load: it is not bounded)
    cancelled_upstream: bool = False
    all_chunks: list[Mapping[str, Any]] | None = None  # kept for a whole-stream load()
    paused_at: float | None = None

    @property
    def next_key(self) -> str:
        """The key of the chunk this stream waits for."""
        return f"{self.prefix}{self.next_chunk_id}"


class Taken(NamedTuple):
    """Chunks handed over by a take, for the caller to assemble (outside its lock)."""

    chunks: list[Mapping[str, Any]]
    first_chunk_id: int
    final: bool
    cancelled: bool


@dataclass(frozen=True, slots=True)
class Effects:
    """What a transition asks of the shell, to do after releasing its lock (the ``bool`` wakes before).

    Attributes:
        give_up: ``(key, prefix)``: nobody reads that stream any more: ``connector.abandon_get(key)``
            then ``connector.cleanup_prefix(prefix)``.
        cleanup: a stream ended: ``connector.cleanup_prefix(prefix)`` drops what a retried put left.
        send_failures, receive_failures: ``(request_id, reason)`` to book as failures.
        abandoned: ``(request_id, reason)`` of idle send streams cancelled: booked as send
            failures without failing their cancelled end-of-stream marker.
        released: queued items dropped: wake their waiters.
        finished_loaded: requests whose final chunk arrived (``get_finished_requests``).
        expired: requests whose state aged out; ``expired_received``: those never taken.
        queued / room / resume / changed: wake the save worker / saves waiting for room /
            the receive worker / the waiters of a receive stream (progress, end or failure).
    """

    give_up: tuple[tuple[str, str], ...] = ()
    cleanup: tuple[str, ...] = ()
    send_failures: tuple[tuple[str, str], ...] = ()
    receive_failures: tuple[tuple[str, str], ...] = ()
    abandoned: tuple[tuple[str, str], ...] = ()
    released: tuple[SaveItem, ...] = ()
    finished_loaded: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()
    expired_received: tuple[str, ...] = ()
    queued: bool = False
    room: bool = False
    resume: bool = False
    changed: bool = False

    def __or__(self, other: Effects) -> Effects:
        """Both effects, this one's first."""
        if other is NO_EFFECTS or self is NO_EFFECTS:
            return self if other is NO_EFFECTS else other
        pairs = ((getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        return Effects(*(a + b if isinstance(a, tuple) else a or b for a, b in pairs))


NO_EFFECTS = Effects()
PROGRESS = Effects(changed=True)
RESUME = Effects(resume=True)
