"""Push puts a process made to one of its own endpoints before any connector of it bound there.

vllm-omni's bare connectors (no role) bind at their first ``get``; its tests put first. A put to an
endpoint this process will bind is kept here, per endpoint, for the connector that binds it (whichever
of the process's connectors built from that spec it is) to hand over as expected there: a get of that
key then waits for the put instead of missing it. A cleanup before that bind records the key, and the
binding connector buries it (the put is dropped as it arrives).

Threads and locks: everything here changes under ``_lock``. A put checks "is it bound now?" and stores
under that lock, and a bind takes what is stored under it after its endpoint is registered, so no put
falls between the two.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ._shared_endpoint import SharedEndpoint, served

__all__ = ["cancel_early", "drop_early", "put_early", "take_early"]

Slot = tuple[str, str, str]

#: The most puts (and cancelled keys) kept per endpoint; the oldest go first.
MAX_EARLY_PUTS = 65536

_lock = threading.Lock()
_puts: dict[str, OrderedDict[Slot, float]] = {}  # endpoint -> slot -> until when a get may wait for it
_cancelled: dict[str, OrderedDict[str, None]] = {}  # endpoint -> keys cleaned up before the bind


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
            local.expect(slot, until)
            return local
        if until <= now:
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


def cancel_early(match: Callable[[str], bool], endpoints: Iterable[str]) -> None:
    """A cleanup: the kept puts to ``endpoints`` whose key matches are cancelled (buried at the bind)."""
    with _lock:
        for endpoint in endpoints:
            puts = _puts.get(endpoint)
            if not puts:
                continue
            for slot in [slot for slot in puts if match(slot[2])]:
                del puts[slot]
                keys = _cancelled.setdefault(endpoint, OrderedDict())
                keys[slot[2]] = None
                while len(keys) > MAX_EARLY_PUTS:
                    keys.popitem(last=False)


def take_early(endpoint: str, shared: SharedEndpoint) -> list[str]:
    """At the bind of ``endpoint`` (already registered as served): hand its kept puts to ``shared``.

    Returns:
        The keys cleaned up before the bind, for the binder to bury.
    """
    with _lock:
        puts = _puts.pop(endpoint, None)
        cancelled = _cancelled.pop(endpoint, None)
        now = time.monotonic()
        for slot, until in (puts or {}).items():
            if until > now:
                shared.expect(slot, until)
    return list(cancelled or ())
