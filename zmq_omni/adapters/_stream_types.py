"""The records of the chunk streams: phases, streams, queued chunks, and the effects a transition answers with.

The rules that move them are :mod:`zmq_omni.adapters._streams`; nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol

__all__ = [
    "NO_EFFECTS",
    "PROGRESS",
    "REMEMBERED",
    "RESUME",
    "STOPPED",
    "CleanUps",
    "Effects",
    "RecvPhase",
    "RecvStream",
    "SaveItem",
    "SaveQueue",
    "SendPhase",
    "SendStream",
    "Taken",
    "Waiter",
    "remember",
]

#: How many finished requests are remembered (to attribute late failures and to
#: refuse a second stream under a used id); older ones are forgotten.
REMEMBERED = 65_536


def remember(book: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Book ``key`` as the newest entry of ``book``, forgetting the oldest beyond :data:`REMEMBERED`."""
    book[key] = value
    book.move_to_end(key)
    while len(book) > REMEMBERED:
        book.popitem(last=False)


class SendPhase(enum.Enum):
    """Where a request's send stream is (this stage streams the request downstream).

    Transitions::

        OPEN --save(final)--> ENDING --final chunk put--> ENDED
        OPEN --cancel--> CANCELLING (its cancelled end-of-stream marker queued) --marker put--> ENDED
        OPEN --cancel(notify_downstream=False)--> CANCELLED
        any  --a put gave up / a chunk refused--> FAILED
        OPEN --idle for idle_state_timeout_s--> CANCELLING, reported as abandoned
        not OPEN --idle for idle_state_timeout_s, or release--> ENDED

    A cancel in ENDING leaves the final chunk and the chunks before it to go through.
    ENDED streams are forgotten; their ids stay used (a second stream under one is refused).
    """

    OPEN = "open"
    ENDING = "ending"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    FAILED = "failed"
    ENDED = "ended"


#: The phases in which nothing more of the request's own chunks is sent.
STOPPED = (SendPhase.CANCELLING, SendPhase.CANCELLED, SendPhase.FAILED)


class RecvPhase(enum.Enum):
    """Where a request's receive stream is (this stage reads the request from upstream).

    Transitions::

        READING --at max_ready_chunks / max_ready_bytes--> PAUSED --inputs taken--> READING
        READING --final chunk--> ENDED --final inputs taken--> forgotten
        READING --stall, bad chunk, cancel, release--> forgotten; the connector is told to give the stream up
        ENDED --untaken for idle_state_timeout_s--> forgotten

    A PAUSED stream's stall clock stops: on resuming, its last progress moves on by the pause.
    """

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

    def next_item(self, data: Mapping[str, Any], final: bool) -> SaveItem:
        """The next chunk of this stream, under the next key (the stream's chunk id steps)."""
        item = SaveItem(self.request_id, f"{self.prefix}{self.next_chunk_id}", self.next_chunk_id, data, final)
        self.next_chunk_id += 1
        return item


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


class SaveQueue(deque[SaveItem]):
    """The chunks waiting for the save worker, in send order, and the one it took (``in_flight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: SaveItem | None = None

    def take_next(self) -> SaveItem | None:
        """Pop the next chunk to put; it is ``in_flight`` until the caller clears it."""
        if not self:
            return None
        item = self.in_flight = self.popleft()
        return item

    def take_all(self) -> list[SaveItem]:
        """Remove and return every queued chunk."""
        items = list(self)
        self.clear()
        return items

    def drop(self, request_id: str) -> list[SaveItem]:
        """Remove and return the queued chunks of ``request_id``."""
        dropped = [item for item in self if item.request_id == request_id]
        if dropped:
            kept = [item for item in self if item.request_id != request_id]
            self.clear()
            self.extend(kept)
        return dropped

    def busy(self) -> set[str]:
        """The requests with a chunk queued or in flight."""
        busy = {item.request_id for item in self}
        if self.in_flight is not None:
            busy.add(self.in_flight.request_id)
        return busy


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

    @property
    def cleaned_prefixes(self) -> tuple[str, ...]:
        """The key prefixes this effect cleans up in the connector (``give_up`` and ``cleanup``)."""
        return (*(prefix for _key, prefix in self.give_up), *self.cleanup)


NO_EFFECTS = Effects()
PROGRESS = Effects(changed=True)
RESUME = Effects(resume=True)


class CleanUps:
    """The key prefixes whose clean-up (``give_up``, ``cleanup``) was decided and not yet reported done.

    The shell does that I/O after releasing its lock; until it reports it done, a
    stream opened under one of these prefixes would lose its first chunks to it.
    """

    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()

    def __contains__(self, prefix: object) -> bool:
        return prefix in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def begin(self, effects: Effects) -> Effects:
        """Book the clean-ups ``effects`` asks for as in flight; returns ``effects``."""
        self._pending.update(effects.cleaned_prefixes)
        return effects

    def done(self, effects: Effects) -> bool:
        """The clean-ups of ``effects`` were done (or given up); True when a prefix is free again."""
        freed = False
        for prefix in effects.cleaned_prefixes:
            self._pending[prefix] -= 1
            if self._pending[prefix] <= 0:
                del self._pending[prefix]
                freed = True
        return freed
