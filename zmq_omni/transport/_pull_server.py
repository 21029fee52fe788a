"""Pull mode, sending half: a bounded store of payloads served once each from a bound ROUTER.

The FETCH/FETCH_REPLY exchange is described in :mod:`zmq_omni.transport._pull_protocol`.

Bounds on what fetchers make it hold (see docs/limits.md): parked FETCHes in
a :class:`~zmq_omni.transport._pull_lot.ParkingLot` shared per connection,
keys of at most ``max_key_bytes``, and the ROUTER's reading bounded per turn
(:mod:`~zmq_omni.transport._pull_socket`).

Threads: put threads call :meth:`PullServer.store`, :meth:`~PullServer.forget`,
:meth:`~PullServer.wait_fetched` and :meth:`~PullServer.close`; the driver (the
endpoint's I/O thread, or the event loop of a connector it drives) runs the
rest (it owns the ROUTER). Every field below ``_cv`` is guarded by it; the
socket is touched by the driver only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import (
    ClosedResourceError,
    DecodeError,
    DeliveryError,
    TransportTimeoutError,
    ZmqOmniError,
)
from ..metrics import Counters
from ..wire import brief
from ._envelope import DEFAULT_MAX_KEY_BYTES, Kind, check_key, check_types, pack, unpack
from ._loop import Driver
from ._pull_lot import MAX_PARK_S, Parked, ParkingLot
from ._pull_protocol import Slot
from ._pull_socket import PullRouter
from ._pull_store import GONE, Leaving, Stored
from ._security import Curve
from ._shm import ShmSend
from ._signal import NotifyingCondition, WouldBlock

__all__ = ["PullServer"]

log = logging.getLogger("zmq_omni.transport")

_MORE = zmq.SNDMORE | zmq.NOBLOCK
_SEND_CHECK_S = 0.01  # wait_fetched re-checks replies still leaving this often (ZeroMQ does not notify)
_CLOSE_GRACE_S = 0.5  # close() lets replies still leaving finish this long, then reports them
# Long polls parked at once, and their bytes (each FETCH's request plus its entry): beyond them the peer holding
# the most gives way (see ``_pull_lot``). Bounds on what fetchers (buggy or hostile) make the server hold.
_MAX_PARKED = 65536
_MAX_PARKED_BYTES = 64 << 20
_PROBE_S = 5.0  # a peer whose FETCHes are parked is checked this often (a gone peer's are dropped)
_PRUNE_MIN = 64  # replies leaving before the I/O thread first prunes those that left
_UNFETCHED = "connector closed before stage {!r} fetched the payload".format  # why, from the stage it was for


#: A failure of a stored payload, with its owner first (the ``owner`` its :meth:`PullServer.store` named).
OwnedFailureCallback = Callable[[Any, str, str, str, str, str, ZmqOmniError], None]


class PullServer:
    """The sending half of pull mode: a bounded store of payloads served from a bound ROUTER."""

    def __init__(
        self,
        loop: Driver,
        bind_endpoint: str,
        advertised: str | None,
        *,
        put_timeout_s: float,
        ttl_s: float,
        max_unacked: int,
        max_unacked_bytes: int,
        hwm: int,
        max_frames: int,
        counters: Counters,
        on_failure: OwnedFailureCallback,
        health: Callable[[], dict[str, Any]],
        curve: Curve | None = None,
        shm: ShmSend | None = None,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
    ) -> None:
        """Bind and serve on ``loop``.

        Each payload keeps the ``owner`` its :meth:`store` named: ``on_failure`` gets it first,
        ``wait_fetched`` and ``drop_owned`` select by it. A request (one frame) of more than
        ``max_frames`` frames closes the ROUTER and binds a new one on the same endpoint: libzmq
        holds a message whole, and reading it to its end would keep every other peer waiting.
        """
        self._loop = loop
        self._shm = shm
        self._probe = None if shm is None else shm.probe  # named in every reply to a client that asks
        self._put_timeout = put_timeout_s
        self._ttl = ttl_s
        self._max_count = max_unacked
        self._max_bytes = max_unacked_bytes
        self._max_frames = max_frames
        self._counters = counters
        self._on_failure = on_failure
        self._health = health
        self._cv = NotifyingCondition()
        self._store: dict[Slot, Stored] = {}
        self._bytes = 0
        self._leaving: list[Leaving] = []  # pending like the store: close() before they left loses them
        self._left: list[Leaving] = []  # replies that left, not yet told to on_fetched (the driver tells it)
        self._telling = False  # the driver checks for replies that left while some it must tell of are leaving
        self._prune_at = _PRUNE_MIN  # _leaving is pruned when it reaches this length (amortized), and each second
        self._puts = 0
        self._bytes_sent = 0
        self._max_key = max_key_bytes
        self._lot = ParkingLot(_MAX_PARKED, _MAX_PARKED_BYTES)  # parked FETCHes (long polls)
        for name in ("fetches_evicted", "fetches_of_gone_peers", "parked", "parked_bytes", "rejected_keys"):
            counters.add(name, 0)
        self._probed_at = 0.0
        self._closed = False
        #: Called (on the driver, with the store lock held) once a fetched payload's reply has left: its
        #: tracker is done and, for a shared-memory reply, the fetcher opened its slot: ``(slot, owner)``.
        #: A stage's shared endpoint tells the process that stored it (``_stage_pull_service``).
        self.on_fetched: Callable[[Slot, Any], None] | None = None
        self._router = PullRouter(
            loop,
            bind_endpoint,
            hwm=hwm,
            max_frames=max_frames,
            counters=counters,
            curve=curve,
            on_message=self._on_message,
            on_rebind=self._forget_parked,
        )
        self.endpoint = advertised or self._router.bound
        loop.every(min(1.0, ttl_s / 4), self._expire)
        loop.on_stop(self._shutdown)

    # -- put threads ----------------------------------------------------------------
    def on_window_change(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` (from any thread, with the store lock held) whenever room may have freed."""
        self._cv.listener = listener

    def store(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        frames: list[Any],
        nbytes: int,
        *,
        block: bool = True,
        owner: Any = None,
    ) -> dict[str, Any]:
        """Keep a payload until fetched; return the metadata a receiver fetches it with.

        ``owner`` (the storing connector, weakly referenceable) is kept with the payload
        only: a store that raises keeps nothing of it, :meth:`drop_owned` lets go of its
        unfetched payloads, and a reply still leaving holds it weakly.

        Raises:
            TransportTimeoutError: the store stayed full for ``put_timeout_s``.
            ClosedResourceError: the server was closed.
            WouldBlock: ``block=False`` and the store is full (nothing kept).
        """
        slot = (from_stage, to_stage, key)
        deadline = time.monotonic() + self._put_timeout
        with self._cv:
            while not self._closed:
                held = self._store.get(slot)
                count = len(self._store) - (held is not None)
                used = self._bytes - (held.nbytes if held else 0)
                if not count or (count < self._max_count and used + nbytes <= self._max_bytes):
                    break
                if not block:
                    raise WouldBlock
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeoutError(
                        f"pull store full ({len(self._store)} payloads, {self._bytes} bytes unfetched)",
                        endpoint=self.endpoint,
                    )
                self._cv.wait(remaining)
            if self._closed:
                raise ClosedResourceError("connector closed", endpoint=self.endpoint)
            old = self._store.pop(slot, None)
            if old is not None:  # a re-put of an unfetched key replaces it
                self._bytes -= old.nbytes
            self._store[slot] = Stored(frames, nbytes, time.monotonic() + self._ttl, owner)
            self._bytes += nbytes
            self._puts += 1
            self._bytes_sent += nbytes
            if slot in self._lot:
                self._loop.call_soon(lambda: self._serve_waiter(slot))
        return {"endpoint": self.endpoint, "from_stage": from_stage, "to_stage": to_stage, "key": key, "size": nbytes}

    def forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        """Drop stored payloads whose key matches; return how many.

        ``key`` / ``prefix``: the cleanup ``match`` stands for (a stage's shared endpoint forwards them).
        """
        with self._cv:
            slots = [slot for slot in self._store if match(slot[2])]
            for slot in slots:
                self._bytes -= self._store.pop(slot).nbytes
            if slots:
                self._cv.notify_all()
        return len(slots)

    def stats(self) -> dict[str, Any]:
        """Store occupancy."""
        with self._cv:
            leaving = self._still_leaving()
            return {
                "puts": self._puts,
                "bytes_sent": self._bytes_sent,
                "pending": len(self._store) + len(leaving),
                "pending_bytes": self._bytes + sum(entry.nbytes for entry in leaving),
                "window_full": bool(self._store)
                and (len(self._store) >= self._max_count or self._bytes >= self._max_bytes),
                "endpoint": self.endpoint,
            }

    def _still_leaving(self) -> list[Leaving]:
        """Forget replies that left; the rest (caller holds ``_cv``)."""
        leaving = []
        for entry in self._leaving:
            if not entry.left(self._shm):
                leaving.append(entry)
            elif entry.tell:
                self._left.append(entry)
        self._leaving = leaving
        return leaving

    def _tell_left(self) -> None:
        """Tell ``on_fetched`` of the replies that left; check again soon while more are leaving (the driver)."""
        with self._cv:
            self._still_leaving()
            left, self._left, hook = self._left, [], self.on_fetched
            for entry in left:
                if hook is not None:  # None: the service closed
                    hook(entry.slot, entry.owner)
            self._telling = any(entry.tell for entry in self._leaving)
            if self._telling:
                self._loop.call_later(_SEND_CHECK_S, self._tell_left)

    def wait_fetched(self, timeout_s: float, owner: Any = None) -> bool:
        """Wait until every stored payload was fetched and its reply has left; True when none is left.

        With ``owner``, only the payloads it owns count.
        """
        deadline = time.monotonic() + timeout_s

        def stored() -> bool:
            if owner is None:
                return bool(self._store)
            return any(entry.owner is owner for entry in self._store.values())

        def leaving() -> bool:
            return any(owner is None or entry.owner is owner for entry in self._still_leaving())

        with self._cv:
            while (stored() or leaving()) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # A fetch notifies; a reply that finished leaving does not, so that part is re-checked.
                self._cv.wait(remaining if stored() else min(remaining, _SEND_CHECK_S))
            return not stored() and not leaving()

    def drop_owned(self, owner: Any) -> list[str]:
        """Take ``owner``'s unfetched payloads out of the store and report them lost; return their keys.

        Replies of its payloads already leaving are left to finish (they hold ``owner`` weakly).
        """
        with self._cv:
            dropped = [(slot, entry.owner) for slot, entry in self._store.items() if entry.owner is owner]
            for slot, _ in dropped:
                self._bytes -= self._store.pop(slot).nbytes
            if dropped:
                self._cv.notify_all()
        self._report_lost(dropped, "delivery_failures", _UNFETCHED)
        return [slot[2] for slot, _ in dropped]

    def close(self) -> list[str]:
        """Fail waiting and future puts; report every payload nobody fetched. The socket closes on the loop thread.

        Returns:
            The keys of the payloads reported lost.
        """
        with self._cv:
            self._closed = True
            unfetched = [(slot, entry.owner) for slot, entry in self._store.items()]
            self._store.clear()
            self._bytes = 0
            self._cv.notify_all()
        self._report_lost(unfetched, "delivery_failures", _UNFETCHED)
        return [slot[2] for slot, _ in unfetched]

    def _report_lost(self, lost: list[tuple[Slot, Any]], counter: str, why: Callable[[str], str]) -> None:
        """Count and report each payload given up on (slot, owner) as a DeliveryError (no lock held)."""
        for (from_stage, to_stage, key), owner in lost:
            self._counters.add(counter)
            if owner is GONE:  # nobody is left to tell
                continue
            reason = why(to_stage)
            error = DeliveryError(reason, key=key, endpoint=self.endpoint)
            self._on_failure(owner, "put", from_stage, to_stage, key, reason, error)

    # -- I/O thread ---------------------------------------------------------------
    def _on_message(self, identity: bytes, frames: list[Any], ok: bool) -> None:
        try:
            if not ok:
                raise DecodeError("a request must be exactly one frame")
            kind, header, _ = unpack(frames[0])
            if kind is Kind.FETCH:
                check_types(header[:5], (int, str, str, str, int), "FETCH")
                # None: a client of the previous version, which takes replies of two fields only.
                local = header[5] if len(header) > 5 else None
                if local is not None and type(local) is not bool:
                    raise DecodeError(f"FETCH shm flag {brief(local)} is not a bool")
                self._check_key(header[3])
                slot = (header[1], header[2], header[3])
                self._on_fetch(identity, header[0], slot, header[4], local, len(frames[0]))
            elif kind is Kind.HEALTH:
                self._reply(identity, [pack(Kind.HEALTH_REPLY, (self._health(),))])
            else:
                raise DecodeError(f"unexpected {kind.name} message")
        except DecodeError as exc:
            self._counters.add("rejected_frames")
            log.debug("rejected a request on %s: %s", self.endpoint, exc)

    def _check_key(self, key: str) -> None:
        """Refuse a key longer than ``max_key_bytes`` (counted in ``rejected_keys``; the caller counts the message)."""
        try:
            check_key(key, self._max_key)
        except DecodeError:
            self._counters.add("rejected_keys")
            raise

    def _forget_parked(self) -> None:
        """The socket was bound anew: the parked FETCHes' peers reconnect with new identities and ask again."""
        with self._cv:
            self._lot.clear()

    def _on_fetch(self, identity: bytes, req_id: int, slot: Slot, wait_ms: int, local: bool | None, size: int) -> None:
        evicted: list[Parked] = []
        parked = False
        with self._cv:
            taken = self._take(slot)
            if taken is None and wait_ms > 0:
                expiry = time.monotonic() + min(wait_ms / 1000.0, MAX_PARK_S)
                parked, evicted = self._lot.park(identity, req_id, slot, expiry, local, size)
                if evicted:
                    self._counters.add("fetches_evicted", len(evicted))
                if not parked:
                    self._counters.add("fetches_not_parked")
        for entry in evicted:  # their clients ask again
            self._not_found(entry.identity, entry.req_id, entry.local)
        if taken is not None:
            self._deliver(identity, req_id, slot, *taken, local)
        elif not parked:
            self._not_found(identity, req_id, local)

    def _not_found(self, identity: bytes, req_id: int, local: bool | None) -> Any:
        return self._reply(identity, [pack(Kind.FETCH_REPLY, self._reply_header(req_id, False, local))])

    def _take(self, slot: Slot) -> tuple[Stored, Leaving] | None:
        """Move a payload from the store to the replies leaving (caller holds ``_cv``): still pending."""
        entry = self._store.pop(slot, None)
        if entry is None:
            return None
        self._bytes -= entry.nbytes
        leaving = Leaving(slot, entry.nbytes, None, None, entry.owner)
        self._leaving.append(leaving)
        if len(self._leaving) >= self._prune_at:  # amortized: pruning is linear in what is leaving
            self._prune_at = 2 * len(self._still_leaving()) + _PRUNE_MIN
        self._cv.notify_all()
        return entry, leaving

    def _serve_waiter(self, slot: Slot) -> None:
        with self._cv:
            if slot not in self._store:
                return
            served = self._lot.pop(slot, time.monotonic())  # the others stay parked for the next put of the key
            taken = self._take(slot) if served is not None else None
        if taken is not None and served is not None:
            self._deliver(served.identity, served.req_id, slot, *taken, served.local)

    def _deliver(
        self, identity: bytes, req_id: int, slot: Slot, entry: Stored, leaving: Leaving, local: bool | None
    ) -> None:
        loc = self._to_shm(entry) if local else None
        if loc is not None:
            message = [pack(Kind.FETCH_REPLY, (req_id, True, self._probe, loc))]
        else:
            head = pack(Kind.FETCH_REPLY, self._reply_header(req_id, True, local), entry.frames[0])
            message = [head, *entry.frames[1:]]
        # Tracked: a large reply takes a while to leave, and closing the socket meanwhile would drop it.
        tracker = self._reply(identity, message, track=True)
        with self._cv:
            if tracker is not None:
                self._counters.add("fetched")
                leaving.tracker, leaving.loc = tracker, loc
                leaving.tell = self.on_fetched is not None  # told once it has left (a dead binder's never leaves)
                if leaving.tell and not self._telling:
                    self._telling = True
                    self._loop.call_soon(self._tell_left)
                return
            self._leaving.remove(leaving)
        if loc is not None and self._shm is not None:
            self._shm.discard(loc)
        with self._cv:  # the fetcher is gone or full: keep the payload for the next fetch
            if slot not in self._store and not self._closed:
                self._store[slot] = entry
                self._bytes += entry.nbytes

    def _reply_header(self, req_id: int, found: bool, local: bool | None) -> tuple[Any, ...]:
        """FETCH_REPLY fields: with our probe for a client that sent the shm flag, without for an older one."""
        return (req_id, found) if local is None else (req_id, found, self._probe)

    def _to_shm(self, entry: Stored) -> bytes | None:
        """Copy a large payload into a slot for a same-host fetcher; the packed handle, or None (frames)."""
        shm = self._shm
        if shm is None or entry.nbytes < shm.threshold:
            return None
        loc = shm.write(entry.frames)
        self._counters.add("shm_fallbacks" if loc is None else "shm_puts")
        return loc

    def _reply(self, identity: bytes, frames: list[Any], *, track: bool = False) -> Any:
        """Send a reply without blocking; its tracker (or True untracked), or None when ZeroMQ refused it."""
        try:
            if not track:
                self._router.sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
                return True
            # One tracker per part: send_multipart tracks only the last, which may be a small copied one.
            parts = [identity, *frames]
            trackers = [self._router.sock.send(part, _MORE, copy=False, track=True) for part in parts[:-1]]
            trackers.append(self._router.sock.send(parts[-1], zmq.NOBLOCK, copy=False, track=True))
            return zmq.MessageTracker(*trackers)
        except zmq.ZMQError as exc:
            self._counters.add("replies_dropped")
            log.debug("reply on %s dropped: %s", self.endpoint, exc)
            return None

    def _expire(self) -> None:
        now = time.monotonic()
        expired: list[tuple[Slot, Any]] = []
        with self._cv:
            self._still_leaving()  # replies that left since the last beat are forgotten here, not only at stats()
            for slot, entry in list(self._store.items()):
                if entry.expires <= now:
                    self._bytes -= self._store.pop(slot).nbytes
                    expired.append((slot, entry.owner))
            if expired:
                self._cv.notify_all()
            unanswered = self._lot.expire(now)  # parked fetches whose wait ended
            probe = self._lot.peers() if now - self._probed_at >= _PROBE_S else []
            self._counters.set("parked", self._lot.count)  # gauges, as of this beat
            self._counters.set("parked_bytes", self._lot.nbytes)
        for waiter in unanswered:
            self._not_found(waiter.identity, waiter.req_id, waiter.local)
        if probe:
            self._probed_at = now
            self._drop_gone(probe)
        self._report_lost(
            expired, "expired", lambda to_stage: f"not fetched by stage {to_stage!r} within pull_ttl_s={self._ttl}"
        )

    def _drop_gone(self, peers: list[bytes]) -> None:
        """Forget the parked FETCHes of peers no longer connected (a FETCH_REPLY to request 0 finds no route)."""
        probe = pack(Kind.FETCH_REPLY, (0, False))  # request ids start at 1: clients ignore it
        gone = 0
        for identity in peers:
            try:
                self._router.sock.send_multipart([identity, probe], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    with self._cv:
                        gone += self._lot.drop_peer(identity)
        if gone:
            self._counters.add("fetches_of_gone_peers", gone)

    def _shutdown(self) -> None:
        self._router.stop_reading()
        # Replies handed to ZeroMQ just before close may still be leaving: give them a bounded moment,
        # then report those that did not make it (closing the socket drops them).
        deadline = time.monotonic() + _CLOSE_GRACE_S
        with self._cv:
            leaving = self._still_leaving()
        while leaving and time.monotonic() < deadline:
            time.sleep(_SEND_CHECK_S)
            with self._cv:
                leaving = self._still_leaving()
        self._router.close()
        self._report_lost(
            [(entry.slot, entry.owner) for entry in leaving],
            "delivery_failures",
            lambda to_stage: f"connector closed while its reply to stage {to_stage!r}'s fetch was still leaving",
        )
