"""One WARNING per interval for a stream of like failures, the rest counted and summed up."""

from __future__ import annotations

from ..errors import format_seconds

__all__ = ["WARNING_INTERVAL_S", "WarningBurst"]

#: Like warnings past the first within this many seconds are counted, then summed up in one line.
WARNING_INTERVAL_S = 5.0


class WarningBurst:
    """One WARNING per interval for a stream of like failures, the rest counted and summed up.

    A downstream stage that stops fails every chunk in flight to it, each a
    failure the scheduler must hear of but a person need not read 800 times:
    the first of an interval is logged in full, the others are counted and the
    next interval's first line (or :meth:`flush`, at shutdown) says how many
    there were, for how many requests, and the last reason. Pure state; the
    owner serializes calls (the adapters hold ``_failures_lock``).
    """

    def __init__(self, interval_s: float = WARNING_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._window_start: float | None = None
        self._count = 0
        self._requests: set[str] = set()
        self._last = ""

    def note(self, request_id: str | None, reason: str, now: float) -> tuple[bool, str | None]:
        """``(log this one in full, the summary of the interval that ended or None)``."""
        if self._window_start is not None and now - self._window_start < self.interval_s:
            self._count += 1
            if request_id is not None:
                self._requests.add(request_id)
            self._last = reason
            return False, None
        summary = self.flush()
        self._window_start = now
        return True, summary

    def flush(self) -> str | None:
        """The summary of the failures counted but not logged yet (None when there are none)."""
        if not self._count:
            return None
        line = (
            f"{self._count} more like the one logged {format_seconds(self.interval_s)} or less before "
            f"({len(self._requests)} requests); the last: {self._last}"
        )
        self._count, self._requests, self._last = 0, set(), ""
        return line
