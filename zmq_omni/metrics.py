"""Thread-safe counters whose reads are immutable snapshots (a leaf room).

Every connector and adapter keeps a :class:`Counters`; ``health()`` returns
``counters.snapshot()`` merged with its status. Counting is cheap (one lock,
one dict update) because it sits on the put/get hot path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from types import MappingProxyType

__all__ = ["Counters"]


class Counters:
    """A set of named integer counters, safe to bump from any thread."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {name: 0 for name in names}

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` (created at zero if new)."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def set(self, name: str, value: int) -> None:
        """Set a gauge-like counter (for example ``pending``) to ``value``."""
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> int:
        """Current value of ``name`` (0 when never counted)."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> Mapping[str, int]:
        """A read-only copy of every counter at this instant."""
        with self._lock:
            return MappingProxyType(dict(self._values))
