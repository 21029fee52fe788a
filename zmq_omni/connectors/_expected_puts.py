"""Push puts this process made to its own endpoints, not arrived there yet; cleanups made there before the bind.

A put to an endpoint this process binds (or will bind: vllm-omni's bare connectors bind at their first
``get``, and its tests put first) is *expected* there: a ``get`` of its key that finds nothing waits for
it, until the put's window ends, instead of missing it while it is on its way through ZeroMQ.

Each endpoint's expected puts are kept in one :class:`ExpectedPuts`, from the first put to the last
close of the :class:`~zmq_omni.connectors._shared_endpoint.SharedEndpoint` bound there: the table
``_records`` maps each endpoint name to it, bound or not, and the endpoint adopts it as it registers
(:func:`adopt`), so a put before the bind, during it or after it lands in the same record.

A cleanup on a push connector that has not bound yet is kept in the same record, as firm tombstones
(``ExpectedPuts.cancelled``), for ``tombstone_ttl_s``: its key or prefix, and the keys of the expected
puts it cancelled. A put of this process under it is not expected. As the endpoint binds, its receiver
takes them over (:meth:`~zmq_omni.transport.PushReceiver.bury_all`) and the record keeps none: from then
on the receiver's tombstones are the only ones, so whatever arrives under them, from this process or
another, is dropped. A cleanup at an endpoint already bound applies there at once (:func:`cancel_early`
hands it back).

Threads and locks: one lock, the module's ``_lock``, guards the table and every record (its slots, its
cancels and whether it is bound). A put or a cleanup reads "is it bound?" from the record and stores
under it, and a bind marks the record bound and hands its cancels over under it, before the endpoint is
published as served, so nothing falls between the two. Gets test ``record.slots`` for "anything
expected at all" without it (a dict's truth is atomic). Lock order: the shared endpoints' registry
lock, then ``_lock``, then a receiver's mailbox lock (``buries``, ``bury_all``); a record's waker is
called with none of them held.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from ..transport import PushReceiver, Tombstones


class BoundEndpoint(Protocol):
    """What a record knows of the endpoint that adopted it.

    That endpoint is a :class:`~zmq_omni.connectors._shared_endpoint.SharedEndpoint`, named here by
    this Protocol because its module imports this one.
    """

    @property
    def part(self) -> object:
        """The endpoint's receiving part (a ``PushReceiver`` in push mode)."""
        ...

    @property
    def expected(self) -> ExpectedPuts:
        """Its record of expected puts."""
        ...


__all__ = ["ExpectedPuts", "adopt", "cancel_early", "expect", "forget_all", "release", "settle"]

Slot = tuple[str, str, str]

#: The most puts (and cancelled keys) kept per endpoint; the oldest go first.
MAX_EXPECTED_PUTS = 65536

_lock = threading.Lock()
_records: dict[str, ExpectedPuts] = {}  # endpoint name -> its record (several names of one bound endpoint: one record)


class ExpectedPuts:
    """One endpoint's puts of this process on their way there: slot -> until when a get may wait for it.

    Args:
        wake: wakes the gets waiting at the endpoint (set once it is bound); called when a slot is
            settled, outside the lock.

    Attributes:
        slots: slot -> until when a get may wait for it, in put order. Read without the lock only
            as ``if record.slots:`` and ``slot in record.slots``.
        bound: the endpoint bound here (set as it registers, under ``_lock``), else None.
        cancelled: the cleanups made here before the bind (None once bound, or if none).
    """

    __slots__ = ("bound", "cancelled", "slots", "wake")

    def __init__(self, wake: Callable[[], None] | None = None) -> None:
        self.slots: OrderedDict[Slot, float] = OrderedDict()
        self.wake = wake
        self.bound: BoundEndpoint | None = None
        self.cancelled: Tombstones | None = None

    def add(self, slot: Slot, until: float, now: float) -> None:
        """Expect ``slot`` until ``until``; the oldest whose wait is over (or past the bound) go (under ``_lock``)."""
        slots = self.slots
        slots[slot] = until
        slots.move_to_end(slot)
        while slots and (len(slots) > MAX_EXPECTED_PUTS or next(iter(slots.values())) <= now):
            slots.popitem(last=False)

    def until(self, slot: Slot) -> float | None:
        """Until when a get of ``slot`` may wait for a put of it from this process; None: nothing expected."""
        with _lock:
            until = self.slots.get(slot)
            if until is not None and until <= time.monotonic():
                del self.slots[slot]
                return None
            return until

    def settle(self, slot: Slot) -> None:
        """``slot`` was taken, or its put failed: stop expecting it (a get waiting for it wakes)."""
        with _lock:
            settled = self.slots.pop(slot, None) is not None
        if settled and self.wake is not None:
            self.wake()

    def settle_where(self, match: Callable[[str], bool]) -> list[str]:
        """Stop expecting every slot whose key matches (a cleanup); their keys."""
        with _lock:
            slots = self._drop_where(match)
        if slots and self.wake is not None:
            self.wake()
        return slots

    def _drop_where(self, match: Callable[[str], bool]) -> list[str]:
        slots = [slot for slot in self.slots if match(slot[2])]
        for slot in slots:
            del self.slots[slot]
        return [slot[2] for slot in slots]


def expect(endpoint: str, slot: Slot, until: float, *, unbound: bool) -> ExpectedPuts | None:
    """A put of ``slot`` to ``endpoint`` is on its way: expect it there until ``until``.

    Args:
        unbound: keep it while nobody here binds ``endpoint`` too (a connector of this process
            binds it at its first get).

    Returns:
        The record it is kept in (settle it there if the put fails before it leaves), or None:
        not kept (nobody here binds there and ``unbound`` is false, the endpoint buries the key,
        or the wait is already over).
    """
    now = time.monotonic()
    if until <= now:
        return None
    with _lock:
        found = _records.get(endpoint)
        if found is not None and found.bound is not None:
            part = found.bound.part
            if isinstance(part, PushReceiver) and part.buries(slot[2]):  # dropped on arrival
                return None
            record = found
        else:
            cancelled = None if found is None else found.cancelled
            if not unbound or (cancelled is not None and cancelled.covers(slot[2], now)):
                return None
            record = found if found is not None else _records.setdefault(endpoint, ExpectedPuts())
        record.add(slot, until, now)
    return record


def settle(endpoint: str | None, slot: Slot) -> None:
    """The put of ``slot`` to ``endpoint`` failed: nothing is on its way (a get waiting for it wakes)."""
    record = _records.get(endpoint) if endpoint is not None else None
    if record is not None:
        record.settle(slot)


def adopt(names: Iterable[str], own: ExpectedPuts, shared: BoundEndpoint) -> ExpectedPuts:
    """``shared``, holding ``own``, is registered under ``names``: its one record from now on.

    Called before the endpoint is published as served. The record kept under one of ``names``
    before the bind becomes the endpoint's (with ``own``'s waker); a second record under another
    of its names (one endpoint reached under two addresses before its bind) is moved into it.
    The cleanups kept in them go to ``shared``'s receiver (none is kept here once it is bound).
    """
    part = shared.part
    with _lock:
        # A name another endpoint of this process is bound under stays its (as the registry's first claim does).
        names = [n for n in names if (had := _records.get(n)) is None or had.bound is None or had.bound is shared]
        found: list[ExpectedPuts] = []
        for name in names:
            record = _records.get(name)
            if record is not None and record is not own and record not in found:
                found.append(record)
        registered = any(_records.get(name) is own for name in names)
        base = own if registered or not found else found[0]
        for record in (own, *found):
            if record is not base:
                for slot, until in record.slots.items():
                    base.slots.setdefault(slot, until)
                record.slots.clear()
            if record.cancelled is not None:
                if isinstance(part, PushReceiver):
                    part.bury_all(record.cancelled)
                record.cancelled = None
        base.wake = own.wake
        base.bound = shared
        for name in names:
            _records[name] = base
    return base


def release(names: Iterable[str], record: ExpectedPuts) -> None:
    """The endpoint holding ``record`` closed: its names no longer lead to it (its expected puts go)."""
    with _lock:
        for name in names:
            if _records.get(name) is record:
                del _records[name]
        record.slots.clear()
        record.wake = None
        record.bound = None


def cancel_early(
    match: Callable[[str], bool],
    endpoints: Iterable[str],
    *,
    key: str | None,
    prefix: str | None,
    ttl_s: float,
) -> list[BoundEndpoint]:
    """A cleanup on a push connector not bound yet: ``key`` and/or ``prefix`` are cancelled at ``endpoints``.

    At an endpoint nobody here binds yet, the cleanup and the keys of the expected puts it matches are
    kept for ``ttl_s`` (buried at the bind), and those puts are no longer expected.

    Returns:
        The push endpoints of this process already bound at some of ``endpoints``: the caller
        cleans up there at once.
    """
    now = time.monotonic()
    bound: list[BoundEndpoint] = []
    with _lock:
        for endpoint in endpoints:
            found = _records.get(endpoint)
            record = found if found is not None else _records.setdefault(endpoint, ExpectedPuts())
            local = record.bound
            if local is not None:
                if isinstance(local.part, PushReceiver) and local not in bound:
                    bound.append(local)
                continue
            cancelled = record.cancelled
            if cancelled is None:
                cancelled = record.cancelled = Tombstones(ttl_s, MAX_EXPECTED_PUTS)
            cancelled.lapse(now)
            cancelled.bury(now, key=key, prefix=prefix, firm=True)
            for dropped in record._drop_where(match):
                cancelled.bury(now, key=dropped, firm=True)
    return bound


def forget_all() -> None:
    """A forked child: the parent's expected puts are not its own (the registry's at-fork hook calls this)."""
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _records.clear()
