"""The pull server's long-poll lot: parked FETCHes, bounded in count and bytes, shared fairly per peer.

A FETCH for a key not stored yet is parked until the key is put or its wait
ends (at most :data:`MAX_PARK_S`). The lot holds at most ``max_count`` parked
FETCHes and ``max_bytes`` of them (each weighs its request's size plus
:data:`ENTRY_OVERHEAD`). When a FETCH does not fit, the peer (ROUTER identity,
one per connection) holding the most bytes gives way: its oldest parked FETCHes
are evicted (answered "not found", so its client asks again) until the new one
fits, unless the asking peer is itself that heaviest peer, whose FETCH is then
answered "not found" at once. So one connection may use the whole lot while
nobody else needs it, and never keeps another peer out of it.

No sockets, threads or clocks: the server feeds it times and identities, under
its own lock, and sends what the answers say.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from ._pull_protocol import Slot

__all__ = ["ENTRY_OVERHEAD", "MAX_PARK_S", "ParkingLot", "Parked"]

#: The longest a FETCH is parked, whatever wait it asks for: clients ask again when it ends.
MAX_PARK_S = 60.0
#: What one parked FETCH weighs beyond its request bytes (its entry in the lot's tables).
ENTRY_OVERHEAD = 512


class Parked:
    """One parked FETCH: who asked (identity, request id), for what, until when."""

    __slots__ = ("expiry", "identity", "live", "local", "req_id", "slot", "weight")

    def __init__(
        self, identity: bytes, req_id: int, slot: Slot, expiry: float, local: bool | None, weight: int
    ) -> None:
        self.identity = identity
        self.req_id = req_id
        self.slot = slot
        self.expiry = expiry
        self.local = local  # the fetcher reads our shared memory (None: a client of the previous version)
        self.weight = weight
        self.live = True


class ParkingLot:
    """Parked FETCHes by slot (served first come, first served), by peer and by expiry (see the module docstring)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.nbytes = 0
        self._by_slot: dict[Slot, dict[Parked, None]] = {}
        self._by_peer: dict[bytes, dict[Parked, None]] = {}  # each peer's, oldest first
        self._peer_bytes: dict[bytes, int] = {}
        self._heaviest: list[tuple[int, bytes]] = []  # (-bytes, identity); stale entries are skipped
        self._expiries: list[tuple[float, int, Parked]] = []  # stale (not live) entries are skipped
        self._order = itertools.count()

    def __contains__(self, slot: object) -> bool:
        return slot in self._by_slot

    def park(
        self, identity: bytes, req_id: int, slot: Slot, expiry: float, local: bool | None, size: int
    ) -> tuple[bool, list[Parked]]:
        """Park a FETCH of ``size`` request bytes: ``(parked, evicted)``; evicted ones are owed "not found".

        Not parked: the FETCH alone outweighs the lot, or its peer would then hold the most.
        """
        weight = size + ENTRY_OVERHEAD
        if weight > self.max_bytes:
            return False, []
        evicted: list[Parked] = []
        while self.count >= self.max_count or self.nbytes + weight > self.max_bytes:
            heaviest = self._heaviest_peer()
            if heaviest is None or self._peer_bytes.get(identity, 0) + weight > self._peer_bytes[heaviest]:
                return False, evicted  # (what was evicted held more than the asker would: fair either way)
            entry = next(iter(self._by_peer[heaviest]))
            self._remove(entry)
            evicted.append(entry)
        entry = Parked(identity, req_id, slot, expiry, local, weight)
        self._add(entry)
        heapq.heappush(self._expiries, (expiry, next(self._order), entry))
        return True, evicted

    def pop(self, slot: Slot, now: float) -> Parked | None:
        """Take the longest-parked FETCH of ``slot`` still waiting at ``now`` (later ones wait for :meth:`expire`)."""
        waiting = self._by_slot.get(slot)
        if not waiting:
            return None
        for entry in waiting:
            if entry.expiry > now:
                self._remove(entry)
                return entry
        return None

    def expire(self, now: float) -> list[Parked]:
        """Remove and return every FETCH whose wait ended by ``now`` (each is owed "not found")."""
        ended: list[Parked] = []
        expiries = self._expiries
        while expiries and (expiries[0][0] <= now or not expiries[0][2].live):
            entry = heapq.heappop(expiries)[2]
            if entry.live:
                self._remove(entry)
                ended.append(entry)
        if len(expiries) > 2 * self.count + 64:  # entries served or evicted linger until here
            self._expiries = [item for item in expiries if item[2].live]
            heapq.heapify(self._expiries)
        return ended

    def drop_peer(self, identity: bytes) -> int:
        """Forget every FETCH ``identity`` parked (a peer that is gone: nobody to answer); how many."""
        entries = list(self._by_peer.get(identity, ()))
        for entry in entries:
            self._remove(entry)
        return len(entries)

    def peers(self) -> list[bytes]:
        """The identities holding parked FETCHes, the longest-held first."""
        return list(self._by_peer)

    def held_by(self, identity: bytes) -> int:
        """The FETCHes ``identity`` has parked."""
        return len(self._by_peer.get(identity, ()))

    def clear(self) -> list[Parked]:
        """Remove and return every parked FETCH."""
        entries = [entry for waiting in self._by_slot.values() for entry in waiting]
        for entry in entries:
            entry.live = False
        self._by_slot.clear()
        self._by_peer.clear()
        self._peer_bytes.clear()
        self._heaviest.clear()
        self._expiries.clear()
        self.count = self.nbytes = 0
        return entries

    def _add(self, entry: Parked) -> None:
        entry.live = True
        self._by_slot.setdefault(entry.slot, {})[entry] = None
        peer = self._by_peer.get(entry.identity)
        if peer is None:
            peer = self._by_peer[entry.identity] = {}
        peer[entry] = None
        held = self._peer_bytes.get(entry.identity, 0) + entry.weight
        self._peer_bytes[entry.identity] = held
        heapq.heappush(self._heaviest, (-held, entry.identity))
        self.count += 1
        self.nbytes += entry.weight
        self._compact()

    def _remove(self, entry: Parked) -> None:
        entry.live = False
        waiting = self._by_slot[entry.slot]
        del waiting[entry]
        if not waiting:
            del self._by_slot[entry.slot]
        peer = self._by_peer[entry.identity]
        del peer[entry]
        held = self._peer_bytes[entry.identity] - entry.weight
        if peer:
            self._peer_bytes[entry.identity] = held
            heapq.heappush(self._heaviest, (-held, entry.identity))
        else:
            del self._by_peer[entry.identity]
            del self._peer_bytes[entry.identity]
        self.count -= 1
        self.nbytes -= entry.weight
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heaviest-peer heap once stale entries outnumber live ones (amortized constant)."""
        if len(self._heaviest) > 2 * len(self._peer_bytes) + 64:
            self._heaviest = [(-held, peer_id) for peer_id, held in self._peer_bytes.items()]
            heapq.heapify(self._heaviest)

    def _heaviest_peer(self) -> Any:
        """The identity holding the most parked bytes, or None when the lot is empty."""
        heap = self._heaviest
        while heap:
            held, identity = heap[0]
            if self._peer_bytes.get(identity) == -held:
                return identity
            heapq.heappop(heap)
        return None
