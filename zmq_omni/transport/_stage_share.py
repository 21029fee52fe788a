"""A stage endpoint shared by the processes of a stage on one host: who wants which key, and what is lent to whom.

The processes of a stage (replicas, the EngineCore and its TP workers) all name
one receive endpoint. The holder of the stage lock
(:mod:`~zmq_omni.transport._stage_lock`) binds it and is the **binder**; every
other process of the stage on the host is a **local client** of the binder,
over the binder's service socket. A client's ``get`` is a mailbox operation
on the binder: the client says it *wants* a key (with a deadline); when the
key is in the binder's mailbox, or arrives there, the binder *lends* the item
to the first client that wants it; the client's get takes it from its own
mailbox and says it *took* it; only then does the binder count the item
consumed (and its sender hear so). A shared-memory item is lent as its slot
handle: the client maps the slot itself, nothing is copied through the binder.

This module is the bookkeeping of both sides, without I/O (fed messages and
the clock, it says what to do): :class:`LeaseBook` on the binder,
:class:`WantBook` on a client. The drivers around them own the sockets.

Nothing confirmed is lost when the binder dies: its mailbox's items were
acknowledged to their senders as arrived, not consumed, so the senders resend
them to the next binder, as after a restart. A client that took an item the
dead binder never counted keeps the item's ``(sender, seq)``
(:meth:`WantBook.taken_since`) and tells the next binder in its hello, so the
resend is counted consumed instead of delivered again. A client that dies
leaves its leases, which go back to the mailbox (:meth:`LeaseBook.tick`).

Threads: each book belongs to its driver's thread (or loop) alone and has no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Expired", "Lease", "LeaseBook", "WantBook"]

Slot = tuple[str, str, str]  # (from_stage, to_stage, key), as the mailbox addresses items
Pair = tuple[str, int]  # (sender id, sequence number) of one put


class Lease(NamedTuple):
    """An item out of the binder's mailbox, lent to a client until it says it took it or gives it back."""

    lease: int
    client: bytes
    slot: Slot
    item: Any


class Expired(NamedTuple):
    """What the clock ended (see :meth:`LeaseBook.tick`)."""

    wants: list[tuple[bytes, Slot]]  # answer each client: not there by its deadline
    returned: list[Lease]  # leases of clients that died: put their items back in the mailbox
    stalled: list[bytes]  # clients silent for the peer timeout whose process lives (reported once per stall)


class LeaseBook:
    """The binder's side: which clients want which keys (first asker first) and what each holds on lease.

    The driver calls :meth:`want` for a client's ask, then, for every key that
    is (or arrives) in the mailbox and :meth:`first_wanting` names a client,
    takes the item out of the mailbox *without* counting it consumed and calls
    :meth:`lend`; at the client's "took" it counts the consumption
    (:meth:`settle`); at a give-back, or a client gone silent
    (:meth:`tick`), it puts the item back.

    Args:
        peer_timeout_s: silence after which a client is presumed gone (its
            wants drop, its leases come back).
    """

    def __init__(self, peer_timeout_s: float) -> None:
        self.peer_timeout_s = peer_timeout_s
        self._wants: dict[Slot, OrderedDict[bytes, float]] = {}
        self._leases: dict[int, Lease] = {}
        self._seen: dict[bytes, float] = {}
        self._pids: dict[bytes, int] = {}
        self._stalled: set[bytes] = set()
        self._next_lease = 0

    def hello(
        self, client: bytes, now: float, taken: list[Pair], pid: int | None = None
    ) -> tuple[list[Pair], list[Lease]]:
        """A client (new, or back after it judged its binder gone), of process ``pid``.

        Returns the puts it took, which the driver counts consumed at once, and the leases the book
        still has for it, which it gave up with its mailbox: the driver puts their items back.
        """
        self._seen[client] = now
        self._stalled.discard(client)
        if pid is not None:
            self._pids[client] = pid
        stale = self.leases_of(client)
        for lease in stale:
            del self._leases[lease.lease]
        return list(taken), stale

    def knows(self, client: bytes) -> bool:
        """Whether ``client`` said hello to this book (and has not said goodbye or died since)."""
        return client in self._pids

    def bye(self, client: bytes) -> list[Lease]:
        """``client`` closed (its process may live on): its wants end; the leases it still holds, to put back."""
        self._seen.pop(client, None)
        self._pids.pop(client, None)
        self._stalled.discard(client)
        for slot in [s for s, waiting in self._wants.items() if client in waiting]:
            del self._wants[slot][client]
            if not self._wants[slot]:
                del self._wants[slot]
        held = self.leases_of(client)
        for lease in held:
            del self._leases[lease.lease]
        return held

    def heard(self, client: bytes, now: float) -> None:
        """Any message from ``client``: it is alive."""
        if client in self._seen:
            self._seen[client] = now
            self._stalled.discard(client)

    def want(self, client: bytes, slot: Slot, deadline: float, now: float) -> None:
        """``client`` wants ``slot`` until ``deadline`` (a later ask of the same key moves its deadline)."""
        self._seen[client] = now
        self._wants.setdefault(slot, OrderedDict())[client] = deadline

    def first_wanting(self, slot: Slot) -> bytes | None:
        """The client that asked first for ``slot`` and still waits, or None."""
        waiting = self._wants.get(slot)
        return next(iter(waiting)) if waiting else None

    def waits(self) -> bool:
        """Whether some client waits for a key (else nothing that arrives is lent)."""
        return bool(self._wants)

    def wanted(self) -> list[Slot]:
        """Every key some client waits for (the driver looks each up in the mailbox after a binder change)."""
        return list(self._wants)

    def lend(self, client: bytes, slot: Slot, item: Any) -> Lease:
        """``item`` of ``slot`` goes to ``client`` (its want ends); the lease to send it with."""
        waiting = self._wants.get(slot)
        if waiting is not None:
            waiting.pop(client, None)
            if not waiting:
                del self._wants[slot]
        self._next_lease += 1
        lease = Lease(self._next_lease, client, slot, item)
        self._leases[lease.lease] = lease
        return lease

    def settle(self, client: bytes, lease_id: int) -> Lease | None:
        """``client`` took its lease: the driver counts the item consumed. None: no such lease of that client."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.client != client:
            return None
        del self._leases[lease_id]
        return lease

    def give_back(self, client: bytes, lease_id: int) -> Lease | None:
        """``client`` returns a lease unused: the driver puts the item back in the mailbox."""
        return self.settle(client, lease_id)

    def forget(self, match: Callable[[str], bool]) -> list[tuple[bytes, Slot]]:
        """A cleanup of keys matching ``match``: their wants end (the clients to answer); leases stay with clients."""
        ended: list[tuple[bytes, Slot]] = []
        for slot in [s for s in self._wants if match(s[2])]:
            ended.extend((client, slot) for client in self._wants.pop(slot))
        return ended

    def leases_of(self, client: bytes) -> list[Lease]:
        """What ``client`` holds on lease."""
        return [lease for lease in self._leases.values() if lease.client == client]

    def tick(self, now: float, alive: Callable[[int], bool] | None = None) -> Expired:
        """Wants past their deadline end; clients silent for ``peer_timeout_s`` go, with their wants and leases.

        With ``alive``, a silent client goes only when ``alive`` says its process (its hello's pid) is
        dead: a stalled client keeps what it holds (it may still hand it to a get) and is reported once.
        """
        silent = [client for client, seen in self._seen.items() if now - seen > self.peer_timeout_s]
        gone: set[bytes] = set()
        stalled: list[bytes] = []
        for client in silent:
            pid = self._pids.get(client)
            if alive is not None and pid is not None and alive(pid):
                if client not in self._stalled:
                    self._stalled.add(client)
                    stalled.append(client)
            else:
                gone.add(client)
        for client in gone:
            del self._seen[client]
            self._pids.pop(client, None)
            self._stalled.discard(client)
        ended: list[tuple[bytes, Slot]] = []
        for slot in list(self._wants):
            waiting = self._wants[slot]
            for client, deadline in list(waiting.items()):
                if client in gone or deadline <= now:
                    del waiting[client]
                    if client not in gone:
                        ended.append((client, slot))
            if not waiting:
                del self._wants[slot]
        returned = [lease for lease in self._leases.values() if lease.client in gone]
        for lease in returned:
            del self._leases[lease.lease]
        return Expired(ended, returned, stalled)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (the earliest want deadline or client timeout)."""
        times = [d for waiting in self._wants.values() for d in waiting.values()]
        times.extend(seen + self.peer_timeout_s for c, seen in self._seen.items() if c not in self._stalled)
        return min(times, default=None)


class WantBook:
    """A client's side: the keys it asked the binder for, and the puts it took (for the next binder).

    Args:
        remember: how many taken puts to keep for a binder change (the
            last ones; the binder counts a lease consumed within its ack
            delay, so only the last few can be lost with it).
    """

    def __init__(self, remember: int = 4096) -> None:
        self._wants: dict[Slot, float] = {}
        self._taken: OrderedDict[Pair, None] = OrderedDict()
        self._remember = remember

    def want(self, slot: Slot, deadline: float) -> bool:
        """A get asks for ``slot`` until ``deadline``; True when the binder must be told (new, or a later deadline)."""
        known = self._wants.get(slot)
        if known is not None and known >= deadline:
            return False
        self._wants[slot] = deadline
        return True

    def lent(self, slot: Slot) -> None:
        """The binder lent ``slot``: no longer wanted (the item waits in this process's mailbox)."""
        self._wants.pop(slot, None)

    def ended(self, slot: Slot) -> None:
        """The binder answered that ``slot`` did not come by the deadline (or was cleaned up)."""
        self._wants.pop(slot, None)

    def took(self, sid: str, seq: int) -> None:
        """A get here took the put ``(sid, seq)``: the driver sends the binder "took" for its lease."""
        self._taken[(sid, seq)] = None
        while len(self._taken) > self._remember:
            self._taken.popitem(last=False)

    def rebound(self, now: float) -> tuple[list[tuple[Slot, float]], list[Pair]]:
        """A new binder: the wants still open to ask it again, and the taken puts for its hello."""
        self._wants = {slot: deadline for slot, deadline in self._wants.items() if deadline > now}
        return list(self._wants.items()), list(self._taken)

    def taken_since(self) -> list[Pair]:
        """The puts taken here that a new binder must count consumed."""
        return list(self._taken)
