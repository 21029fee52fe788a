"""Push puts a process made to one of its own endpoints before any connector of it bound there.

vllm-omni's bare connectors (no role) bind at their first ``get``; its tests put first. A put to an
endpoint this process will bind is kept here, per endpoint, for the connector that binds it (whichever
of the process's connectors built from that spec it is) to hand over as expected there: a get of that
key then waits for the put instead of missing it.

A cleanup on a push connector that has not bound yet is kept here too, per endpoint, for
``tombstone_ttl_s``: its key or prefix, and the keys of the kept puts it cancelled. A put of this process
under it is not kept, and the binding connector buries them all firmly (no get lifts them), so whatever
arrives under them, from this process or another, is dropped. A cleanup when another connector of the
process already serves the endpoint applies there at once (:func:`cancel_early` hands it back).

Threads and locks: everything here changes under ``_lock``. A put or a cleanup checks "is it bound
now?" and stores under that lock, and a bind takes what is stored under it after its endpoint is
registered, so nothing falls between the two.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..transport import PushReceiver, Tombstones
from ._shared_endpoint import SharedEndpoint, served

__all__ = ["cancel_early", "drop_early", "put_early", "take_early"]

Slot = tuple[str, str, str]

#: The most puts (and cancelled keys) kept per endpoint; the oldest go first.
MAX_EARLY_PUTS = 65536

_lock = threading.Lock()
_puts: dict[str, OrderedDict[Slot, float]] = {}  # endpoint -> slot -> until when a get may wait for it
_cancelled: dict[str, Tombstones] = {}  # endpoint -> what was cleaned up there before the bind


def put_early(endpoint: str, slot: Slot, until: float) -> SharedEndpoint | None:
    """A put of ``slot`` to ``endpoint``, which this process binds at a connector's first get.

    Returns:
        The endpoint's :class:`SharedEndpoint` when it is bound already (the put is expected
        there now), else None (kept for the bind). A put whose wait is already over
        (``until`` not in the future) is not kept.
    """
    now = time.monotonic()
    with _lock:
        local = served(endpoint)
        if local is not None:
            if not (isinstance(local.part, PushReceiver) and local.part.buries(slot[2])):  # dropped on arrival
                local.expect(slot, until)
            return local
        cancelled = _cancelled.get(endpoint)
        if until <= now or (cancelled is not None and cancelled.covers(slot[2], now)):
            return None
        puts = _puts.setdefault(endpoint, OrderedDict())
        puts[slot] = until
        puts.move_to_end(slot)
        while puts and (len(puts) > MAX_EARLY_PUTS or next(iter(puts.values())) <= now):  # the oldest first
            puts.popitem(last=False)
    return None


def drop_early(endpoint: str, slot: Slot) -> None:
    """The put of ``slot`` failed before it left: nothing is on its way."""
    with _lock:
        puts = _puts.get(endpoint)
        if puts is not None:
            puts.pop(slot, None)


def cancel_early(
    match: Callable[[str], bool],
    endpoints: Iterable[str],
    *,
    key: str | None,
    prefix: str | None,
    ttl_s: float,
) -> list[SharedEndpoint]:
    """A cleanup on a push connector not bound yet: ``key`` and/or ``prefix`` are cancelled at ``endpoints``.

    At an endpoint nobody here binds yet, the cleanup and the keys of the kept puts it matches are kept
    for ``ttl_s`` (buried at the bind), and those puts are no longer expected.

    Returns:
        The push endpoints of this process already bound at some of ``endpoints``: the caller
        cleans up there at once.
    """
    now = time.monotonic()
    bound: list[SharedEndpoint] = []
    with _lock:
        for endpoint in endpoints:
            local = served(endpoint)
            if local is not None:
                if isinstance(local.part, PushReceiver) and local not in bound:
                    bound.append(local)
                continue
            cancelled = _cancelled.get(endpoint)
            if cancelled is None:
                cancelled = _cancelled[endpoint] = Tombstones(ttl_s, MAX_EARLY_PUTS)
            cancelled.lapse(now)
            cancelled.bury(now, key=key, prefix=prefix)
            puts = _puts.get(endpoint)
            if puts:
                for slot in [slot for slot in puts if match(slot[2])]:
                    del puts[slot]
                    cancelled.bury(now, key=slot[2])
    return bound


def take_early(endpoint: str, shared: SharedEndpoint) -> list[tuple[str | None, str | None]]:
    """At the bind of ``endpoint`` (already registered as served): hand its kept puts to ``shared``.

    Returns:
        What was cleaned up there before the bind and is still in force, as ``(key, None)`` or
        ``(None, prefix)``, for the binder to bury.
    """
    with _lock:
        puts = _puts.pop(endpoint, None)
        cancelled = _cancelled.pop(endpoint, None)
        now = time.monotonic()
        for slot, until in (puts or {}).items():
            if until > now:
                shared.expect(slot, until)
    return [] if cancelled is None else cancelled.buried(now)
