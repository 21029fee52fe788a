"""Push mode, receiving half: tombstones of keys nobody will take any more (pure state, no sockets, no threads).

``cleanup(key)``, ``cleanup_prefix(prefix)`` and ``abandon_get(key)`` bury a key or a
prefix: for ``ttl_s`` a put arriving under it is dropped at once (acknowledged as
consumed, so its sender's window frees) instead of waiting in the mailbox for a
``get`` that will never come. Each drop renews the tombstone, so a stream still
arriving keeps it. A ``get`` of a buried key lifts the tombstones that are not
*firm* (``abandon_get``'s: the caller asks for the key again); a firm one
(``cleanup``, ``cleanup_prefix``: the request is over) stays until it lapses.
At most ``max_count`` tombstones are held: past it the one that lapses first goes.

Looking a key up costs O(len(key) x the number of distinct buried prefix lengths):
only the lengths some prefix was buried at are cut from the key, never one per
trailing digit (a peer's key ending in many digits would cost its length squared).

:class:`~zmq_omni.transport._mailbox.Mailbox` holds one under its lock; the
cleanups made at an endpoint before its bind are held in one by that endpoint's
record (``connectors/_expected_puts.py``, under its lock) until the receiver
takes them over (:meth:`Tombstones.absorb`). Nothing here reads a clock
(``now`` is passed in).

The invariants the tests check after any sequence of calls:

* ``len(tombstones) <= max_count``;
* :meth:`Tombstones.covers` is true exactly when a tombstone of the key, or of a
  prefix it extends by decimal digits only, was laid or renewed less than ``ttl_s``
  ago (absorbed: before the lapse time it came with) and was neither lifted (a firm
  one never is) nor evicted since.
"""

from __future__ import annotations

__all__ = ["Tombstones"]


class Tombstones:
    """Buried keys and key prefixes, each until a time; see the module docstring.

    Args:
        ttl_s: how long a tombstone lasts after it was laid or last renewed.
        max_count: most tombstones held (keys and prefixes together).
    """

    __slots__ = ("_ends", "_firm", "_lengths", "_max", "_ttl", "entries", "evicted")

    def __init__(self, ttl_s: float, max_count: int) -> None:
        self._ttl = ttl_s
        self._max = max_count
        # (KEY or PREFIX, name) -> when it lapses; insertion order is lapse order (a renewal moves it to the end).
        # Public for one use: ``if tombs.entries:`` is the hot paths' test for "any tombstone at all" (a dict's
        # truth, where ``len()`` would be a Python call per get). Read it, never change it.
        self.entries: dict[tuple[int, str], float] = {}
        # How many buried prefixes have each length (none: an arrival costs one lookup); those lengths, longest first.
        self._lengths: dict[int, int] = {}
        self._ends: list[int] = []
        self._firm: set[tuple[int, str]] = set()  # those a get does not lift
        self.evicted = 0  # tombstones pushed out by max_count

    def __len__(self) -> int:
        return len(self.entries)

    def bury(self, now: float, *, key: str | None = None, prefix: str | None = None, firm: bool = False) -> None:
        """Lay (or renew) a tombstone of ``key`` and/or of ``prefix`` (keys that are it + digits).

        ``firm``: no :meth:`lift` removes it (a renewal without ``firm`` keeps it firm).
        """
        names = [(kind, name) for kind, name in ((_KEY, key), (_PREFIX, prefix)) if name is not None]
        for name in names:
            self._lay(name, now)
            if firm:
                self._firm.add(name)

    def covers(self, key: str, now: float) -> bool:
        """True when an arrival of ``key`` is to be dropped; its tombstone is renewed then."""
        found = self._find(key, now)
        if found is None:
            return False
        self._lay(found, now)
        return True

    def lift(self, key: str) -> None:
        """A ``get`` asks for ``key`` again: forget every tombstone covering it that is not firm, lapsed or not."""
        firm = self._firm
        name = (_KEY, key)
        if name not in firm:
            self.entries.pop(name, None)
        if self._ends:
            for end in self._covering_ends(key):
                name = (_PREFIX, key[:end])
                if name not in firm and name in self.entries:
                    self._remove(name)

    def lapse(self, now: float) -> int:
        """Forget the tombstones whose time is up; how many."""
        tombs = self.entries
        gone = 0
        while tombs:
            name = next(iter(tombs))
            if tombs[name] > now:
                break
            self._remove(name)
            gone += 1
        return gone

    def _find(self, key: str, now: float) -> tuple[int, str] | None:
        """The live tombstone covering ``key``: the key's own, else its longest buried prefix."""
        tombs = self.entries
        until = tombs.get((_KEY, key))
        if until is not None and until > now:
            return _KEY, key
        if self._ends:
            for end in self._covering_ends(key):
                until = tombs.get((_PREFIX, key[:end]))
                if until is not None and until > now:
                    return _PREFIX, key[:end]
        return None

    def _covering_ends(self, key: str) -> list[int]:
        """The buried prefix lengths ``key`` extends by digits only, longest first (``key_matches_prefix``'s rule)."""
        size = len(key)
        ends = []
        for end in self._ends:
            if end >= size:
                continue
            if not key[end:].isdigit():
                break  # a shorter prefix leaves this tail too: no shorter one is covered either
            ends.append(end)
        return ends

    def _lay(self, name: tuple[int, str], now: float) -> None:
        if self.entries.pop(name, None) is None and name[0] == _PREFIX:
            size = len(name[1])
            count = self._lengths.get(size, 0)
            self._lengths[size] = count + 1
            if not count:
                self._ends = sorted(self._lengths, reverse=True)
        self.entries[name] = now + self._ttl
        while len(self.entries) > self._max:  # the first one lapses first
            self._remove(next(iter(self.entries)))
            self.evicted += 1

    def absorb(self, other: Tombstones, now: float) -> None:
        """Take over ``other``'s live tombstones, each with its own lapse time (the later wins) and firmness.

        ``other`` is left as it was; the caller drops it (the cleanups kept for an endpoint before
        its bind, handed to its receiver's mailbox).
        """
        for name, until in other.entries.items():
            if until <= now:
                continue
            have = self.entries.get(name, until)
            self._lay(name, now)
            if name in self.entries:
                self.entries[name] = max(have, until)
            if name in other._firm:
                self._firm.add(name)
        entries = sorted(self.entries.items(), key=lambda entry: entry[1])  # insertion order is lapse order
        self.entries.clear()
        self.entries.update(entries)

    def buried(self, now: float) -> list[tuple[str | None, str | None]]:
        """The live tombstones, oldest first, each as ``(key, None)`` or ``(None, prefix)``."""
        return [(name, None) if kind == _KEY else (None, name) for (kind, name), t in self.entries.items() if t > now]

    def _remove(self, name: tuple[int, str]) -> None:
        del self.entries[name]
        self._firm.discard(name)
        if name[0] == _PREFIX:
            size = len(name[1])
            count = self._lengths[size] - 1
            if count:
                self._lengths[size] = count
            else:
                del self._lengths[size]
                self._ends = sorted(self._lengths, reverse=True)


_KEY, _PREFIX = 0, 1
