"""Push mode, receiving half: the I/O shell of a bound ROUTER feeding a keyed mailbox, with batched acks.

The socket layout and the delivery protocol are described in
:mod:`zmq_omni.transport._push_protocol`; what is new, what is a resend and
what each REPLY says is decided per sender by
:class:`~zmq_omni.transport._dedupe.SourceState`.

Threads and locks:

* **application threads** run :meth:`PushReceiver.take`, ``take_by``, ``forget``,
  ``stats``, ``generation``, ``wait_for_change`` and ``close``;
* the ROUTER, every ``SourceState`` (``_sources``), ``_dirty``, ``_pending_acks``, ``_pending_bytes``,
  ``_arrivals``, ``_now`` and ``_read_poller`` belong to whoever holds ``_owner``:
  the connector's **I/O thread** while it runs a handler, or a **reading getter**
  (below); nobody else touches them;
* ``_lock`` (under the condition ``_cv``) guards the mailbox ``_box``, ``_taken`` and
  ``_dropped_taken`` (consumed and dropped seqs handed to the I/O thread), the
  tombstones ``_tombs``, ``_generation``, ``_batches_received``, ``_gets``,
  ``_bytes_received``, ``_dropped``, ``_flush_armed``, ``_flush_due`` and ``_closed``.

A lone get reads the socket itself. Handing each message from the I/O thread
to a waiting thread costs two thread wake-ups and a GIL hand-over, about as
much again as ZeroMQ's whole round trip; so a ``take_by`` that finds nothing
and nobody handling the socket takes ``_owner`` and becomes the **reading
getter**: the I/O thread stops watching the socket (``_unwatch``, confirmed
before the getter touches it) and the getter polls it and runs the same
handler until its item arrives. Other getters wait on ``_cv``, fed by
the reading one. The socket stays with the getters when one leaves (the next
takes it without waking the I/O thread); the I/O thread takes it back
(``_rewatch``) once nobody read it for ``_reclaim_s`` (``_reclaim``), or at once
when a ``wait_for_change`` or an arrivals hook needs it. What the I/O thread
must do meanwhile (the ack flush, expiring sources) it leaves in ``_owed`` and
signals on the ``_recall`` eventfd, which the reading getter polls beside the
socket; ``close`` signals it too.

Nothing unclaimed lives forever: an item no ``get`` took within ``unclaimed_ttl_s``
is dropped, and ``forget`` with a key or prefix (``cleanup``, ``cleanup_prefix``,
``abandon_get``) leaves a :class:`~zmq_omni.transport._tombstones.Tombstones` entry
under which a late arrival is dropped at once. Either way the item is acknowledged
as consumed, in a REPLY whose ping number says why (``DROPPED_UNCLAIMED``,
``DROPPED_CANCELLED``), so its sender's window frees and it counts the drop, and
its shared-memory slot is released.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import zmq

from ..errors import DecodeError, MessageTooLargeError, ShmError, from_zmq_error
from ..metrics import Counters
from ..wire import brief
from ._dedupe import SourceState
from ._envelope import Kind, check_types, pack, to_ranges, unpack
from ._loop import IoLoop
from ._push_protocol import _MAX_DRAIN, DROPPED_CANCELLED, DROPPED_UNCLAIMED
from ._router import recv_routed
from ._security import Curve, watch_refusals
from ._shm import ShmReceive
from ._sockets import bind, close_bound, close_socket, make_socket
from ._tombstones import Tombstones

__all__ = ["DEFAULT_ACK_DELAY_S", "PushReceiver"]

log = logging.getLogger("zmq_omni.transport")

# Acks wait ``ack_delay_s`` (default 20 ms) to be batched: one REPLY covers hundreds of puts under
# load, and a lone message stream pays for one REPLY (a wake-up of the sender's I/O thread) per
# 20 ms rather than per 5 ms (with 5 ms acks and a context per connector, a lone round trip between
# two stages takes 15-20 % longer). A sender that needs its acks sooner
# (window full, flush() waiting) pings, and a PING is answered at once.
DEFAULT_ACK_DELAY_S = 0.02
_ACK_BATCH = 1024  # ...or until this many are pending
# ...or until this many payload bytes arrived, or were taken: a sender keeps each put until it is
# acknowledged as consumed, and a stream of large payloads acknowledged every 20 ms keeps a dozen of
# them alive at each end (their buffers cold again by the time they are reused: a lone 1 MiB round
# trip takes ~15% longer). Checked once the arrivals are handed over (I/O thread) or before a reading
# getter waits again, so the REPLY is never sent between a message's arrival and its get returning;
# takes from the mailbox (items another thread read) have the I/O thread flush once they reach it.
_ACK_BYTES = 2 << 20
# A socket a getter read stays with the getters (no I/O thread wake-up per get) until none read it this
# long (or ack_delay_s, if shorter); it also bounds how long a PING asking for acks waits unread.
_RECLAIM_S = 0.02
# ...but a socket lent to an event loop with gets waiting stays lent through idle spells (the loop polls
# its descriptor and reads what comes, faster than the I/O thread could hand it over) and is taken back
# only when the loop has not read it this long: the loop is blocked, or gone without closing its reader.
_LOOP_STALL_S = 1.0
_MAX_SID = 64
# Plain ints: ``sock.get(zmq.EVENTS) & zmq.POLLIN`` goes through enum.IntFlag, ~1 us a test on the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_DATA_TYPES = (str, int, int, str, str, str)
_LOC_TYPES = (type(None), bytes)
_PING_TYPES = (str, int, int)
_BATCH_TYPES = (str, int, str, list)
_BATCH_ENTRY = (int, str, str, bytes)  # seq, from_stage, key, wire frame 0
_MAX_BATCH_ENTRIES = 65536
# Most seqs per list in one REPLY: a sender refuses a list naming more than 4 * max_unacked + 1024, and
# a pong repeats every consumption its sender may not know yet (many, while an orphan pins its low mark).
_MAX_REPLY_SEQS = 1024


class _Item(NamedTuple):
    """One mailbox entry; a tuple, so the receive hot path builds it with one C call (``_new_item``)."""

    obj: Any
    nbytes: int
    sid: str
    seq: int
    loc: bytes | None  # a slot handle, opened by ``take`` (obj is None until then)
    arrived: float  # time.monotonic() when it reached the mailbox (unclaimed_ttl_s counts from it)


# ``_Item.__new__`` is a Python function; the tuple constructor makes the same object without it.
_new_item = tuple.__new__

# An event loop's hand-off of arrivals to its waiting gets: hand(slot, (obj, nbytes)) is True when one took it.
Hand = Callable[[tuple[str, str, str], tuple[Any, int]], bool]


class LoopClaim(Protocol):
    """An event loop's hold on the receiver's socket, as the receiver sees it (a ``LoopReader``)."""

    def waiting(self) -> bool:
        """Whether the loop has gets waiting now (called on the I/O thread: reads a flag, never blocks)."""
        ...


class PushReceiver:
    """The receiving half of push mode: a bound ROUTER feeding a keyed mailbox."""

    def __init__(
        self,
        loop: IoLoop,
        bind_endpoint: str,
        *,
        incarnation: str,
        decode: Callable[[list[Any]], Any],
        decode_each: Callable[[list[bytes]], list[Any]],
        hwm: int,
        max_message_bytes: int,
        max_frames: int,
        source_ttl_s: float,
        counters: Counters,
        unclaimed_ttl_s: float = 300.0,
        ack_delay_s: float = DEFAULT_ACK_DELAY_S,
        tombstone_ttl_s: float = 60.0,
        max_tombstones: int = 65536,
        health: Callable[[], dict[str, Any]],
        curve: Curve | None = None,
        shm: ShmReceive | None = None,
    ) -> None:
        self._loop = loop
        self._shm = shm
        self.incarnation = incarnation
        self._decode = decode
        self._decode_each = decode_each  # a BATCH's puts: each result an object or its DecodeError
        self._max_message = max_message_bytes
        self._max_frames = max_frames
        self._source_ttl = source_ttl_s
        self._unclaimed_ttl = unclaimed_ttl_s
        self._ack_delay = ack_delay_s
        self._reclaim_s = min(ack_delay_s, _RECLAIM_S)
        self._counters = counters
        self._health = health
        # A plain Lock under the condition: ``with self._lock`` costs a C call, a Condition's two Python ones.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._box: dict[tuple[str, str, str], _Item] = {}  # in arrival order (a re-put moves to the end)
        self._tombs = Tombstones(tombstone_ttl_s, max_tombstones)
        self._dropped = {"unclaimed": 0, "late": 0, "cleanup": 0}
        self._arrivals: list[tuple[tuple[str, str, str], _Item]] = []  # decoded this drain, stored at its end
        self._generation = 0  # bumped under _cv whenever items arrive (wait_for_change)
        # Called by the socket's owner with the addresses of each drain's arrivals, after they are in the mailbox.
        self.on_arrivals: Callable[[list[tuple[str, str, str]]], None] | None = None
        # While an event loop's pump reads (it holds _owner): its waiting gets, offered each arrival first.
        self._hand: Hand | None = None
        self._batches_received = 0
        self._taken: list[tuple[str, int]] = []  # consumed (sid, seq) waiting for the I/O thread
        self._dropped_taken: list[tuple[str, int, int]] = []  # dropped unconsumed (sid, seq, DROPPED_* code)
        self._sources: dict[str, SourceState] = {}
        self._dirty: set[str] = set()
        self._pending_acks = 0
        self._pending_bytes = 0
        self._taken_bytes = 0  # payload taken since the last flush (under _lock)
        self._taken_flush_asked = False  # the I/O thread was asked to flush for _taken_bytes (under _lock)
        self._now = time.monotonic()
        self._flush_armed = False
        self._flush_due = 0.0  # time.monotonic() when the armed flush is due
        self._gets = 0
        self._bytes_received = 0
        self._closed = False
        # The socket's owner (see the module docstring): the I/O thread in a handler, or the reading getter.
        self._owner = threading.Lock()
        self._owed: deque[Callable[[], None]] = deque()  # I/O-thread work left to the reading getter
        self._recall = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # "run _owed" (and close)
        self._sock = make_socket(loop.ctx, zmq.ROUTER, hwm=hwm, max_message_bytes=max_message_bytes)
        if curve is not None:
            curve.make_server(self._sock)
            watch_refusals(loop, self._sock, counters)
        try:
            self.endpoint = bind(self._sock, bind_endpoint)
        except BaseException:
            close_socket(self._sock)
            os.close(self._recall)
            raise
        self._read_poller = zmq.Poller()  # the reading getter's: the socket and the recall signal
        self._read_poller.register(self._sock, zmq.POLLIN)
        self._read_poller.register(self._recall, zmq.POLLIN)
        self._recall_poller = zmq.Poller()  # ...before the I/O thread confirmed it stopped polling the socket
        self._recall_poller.register(self._recall, zmq.POLLIN)
        self._io_watching = True  # the I/O thread polls the socket (written there, under _owner or for its holder)
        self._reclaim_armed = False  # I/O thread: _reclaim is scheduled
        self._last_read = 0.0  # when the last reading getter gave the socket back
        self._waiting = 0  # getters waiting on _cv (under _lock)
        self._watchers = 0  # wait_for_change callers waiting (under _lock)
        # Open LoopReaders (event loops that may read the lent socket); copied on change, read by any thread.
        self._loop_readers: tuple[LoopClaim, ...] = ()
        self._loop_missed = False  # a loop's pump found _owner taken: its holder wakes the loops on release
        self.fd = self._sock.getsockopt(zmq.FD)  # ZeroMQ's descriptor: readable when the socket's state changed
        loop.add_reader(self._sock, self._on_readable_io)
        loop.every(max(1.0, source_ttl_s / 10), self._owned(self._expire_sources))
        loop.every(min(1.0, unclaimed_ttl_s / 4, tombstone_ttl_s / 4), self._expire_unclaimed)
        loop.on_stop(self._shutdown)

    # -- application threads -------------------------------------------------------
    def take(self, from_stage: str, to_stage: str, key: str, *, look: bool = True) -> tuple[Any, int] | None:
        """Remove and return ``(obj, nbytes)`` for the key, or None (never blocks on I/O).

        When getters borrowed the socket and none reads it now, it first takes in what
        ZeroMQ holds; ``look=False`` skips that (an event loop that polls the socket
        reads it anyway: the look would cost a ``ZMQ_EVENTS`` call for nothing).

        Raises:
            ShmError: the item's shared-memory payload expired or was withdrawn (the item is gone).
            DecodeError: the shared-memory payload is not a valid encoding.
        """
        slot = (from_stage, to_stage, key)
        item = self._pop(slot, key)
        if item is None and look and not self._io_watching and self._owner.acquire(False):
            try:  # a getter borrowed the socket and nobody reads it now: take in what is queued
                # Checked again as the owner: the I/O thread may have taken the socket back (it sets
                # _io_watching only while it holds _owner) or closed it between the test and the acquire.
                if not self._io_watching and not self._closed:
                    generation = self._generation
                    with self._closing_is_none():
                        self._settle_for_loops()
                    if self._generation != generation:
                        item = self._pop(slot, key)
            finally:
                self._release_owner()
        if item is None:
            return None
        return (item.obj, item.nbytes) if item.loc is None else self._open(item)

    def buries(self, key: str) -> bool:
        """True while a tombstone covers ``key``: a put of it arriving now is dropped (any thread)."""
        with self._lock:
            return bool(self._tombs.entries) and self._tombs.covers(key, time.monotonic())

    @contextlib.contextmanager
    def _closing_is_none(self) -> Iterator[None]:
        """Around a getter's socket use: a pyzmq error from a receiver closed meanwhile ends the get.

        Raises:
            TransportError: the error came from a receiver still open (translated, never raw pyzmq).
        """
        try:
            yield
        except zmq.ZMQError as exc:
            if not self._closed:
                raise from_zmq_error(exc, endpoint=self.endpoint, op="receive") from exc

    def _pop(self, slot: tuple[str, str, str], key: str) -> _Item | None:
        """Take ``slot``'s item out of the mailbox (its consumption acknowledged), or None."""
        with self._lock:
            if self._tombs.entries:
                self._tombs.lift(key)
            item = self._box.pop(slot, None)
            if item is not None and item.loc is None:  # a slot's consumption is acked once it is open
                self._ack_taken(item)
        return item

    def take_by(self, from_stage: str, to_stage: str, key: str, deadline: float) -> tuple[Any, int] | None:
        """Like :meth:`take`, waiting until ``time.monotonic() >= deadline``.

        It waits on a condition, or, when nobody handles the socket, reads it itself
        (the reading getter of the module docstring).
        """
        slot = (from_stage, to_stage, key)
        with self._lock:
            if self._tombs.entries:
                self._tombs.lift(key)
            item = self._box.pop(slot, None)
            while item is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                # Non-blocking under _lock: the I/O thread takes _owner first, then _lock.
                if self._owner.acquire(False):
                    break
                self._waiting += 1
                try:
                    self._cv.wait(remaining)
                finally:
                    self._waiting -= 1
                item = self._box.pop(slot, None)
            else:
                if item.loc is None:
                    self._ack_taken(item)
        if item is None:  # we hold _owner: read until our item comes
            with self._closing_is_none():
                item = self._read_for(slot, deadline)
            if item is None:
                return None
        return (item.obj, item.nbytes) if item.loc is None else self._open(item)

    def _read_for(self, slot: tuple[str, str, str], deadline: float) -> _Item | None:
        """Be the reading getter until ``slot`` arrives or ``deadline`` passes (holds ``_owner``, releases it).

        The socket is touched only once the I/O thread no longer polls it: ZeroMQ sockets
        are not thread-safe, and a poll reads the socket's state as a recv does.
        """
        sock, recall = self._sock, self._recall
        if self._io_watching:
            self._loop.call_soon(self._unwatch)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if self._io_watching:
                    poller = self._recall_poller
                else:
                    poller = self._read_poller
                    self._flush_if_heavy()
                # Capped: an infinite deadline waits in 60 s slices (close and owed work wake it at once).
                for ready, _ in zmq.zmq_poll(poller.sockets, int(min(remaining, 60.0) * 1000) + 1):
                    if ready is sock:
                        # Event loops poll ZeroMQ's edge-triggered descriptor: for them, read until empty.
                        self._on_readable(None if self._loop_readers else slot[2])
                    elif ready == recall:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(recall)
                        self._run_owed()
                with self._lock:
                    item = self._box.pop(slot, None)
                    if item is not None:
                        if item.loc is None:
                            self._ack_taken(item)
                    elif self._closed:
                        return None
                if item is not None:
                    if not self._io_watching:
                        self._flush_if_heavy()  # this read may have crossed the mark: ack now, not at the next read
                    return item
        finally:
            self._last_read = time.monotonic()
            self._release_owner()
            if self._watchers or self.on_arrivals is not None:
                self._loop.call_soon(self._rewatch)  # someone else waits for arrivals: the I/O thread reads now

    def _release_owner(self) -> None:
        """Release ``_owner``; while the I/O thread does not watch the socket, let a waiting getter read it.

        A loop whose :meth:`pump` found ``_owner`` taken meanwhile is woken to pump again: the
        descriptor's signal it came for may have been spent by the holder's reads.
        """
        self._owner.release()
        if self._loop_missed:
            self._loop_missed = False
            self._wake_loops()
        if self._waiting and not self._io_watching:
            with self._lock:
                self._cv.notify_all()

    # -- an event loop as the reading getter (LoopReader) ----------------------------------
    def add_loop_reader(self, reader: LoopClaim) -> None:
        """Count an event loop that reads this socket through :meth:`pump` (see :class:`LoopClaim`)."""
        with self._lock:
            self._loop_readers = (*self._loop_readers, reader)

    def remove_loop_reader(self, reader: LoopClaim) -> None:
        """Stop counting ``reader`` (a no-op when it was not counted)."""
        with self._lock:
            self._loop_readers = tuple(r for r in self._loop_readers if r is not reader)

    def _a_loop_waits(self) -> bool:
        """Whether an event loop reading this socket has gets waiting (any thread)."""
        return any(reader.waiting() for reader in self._loop_readers)

    def lend_to_loop(self) -> None:
        """Have the I/O thread stop watching the socket, so that :meth:`pump` reads it (any thread).

        The I/O thread then wakes the loops (an empty arrivals notice); it takes the
        socket back once nobody read it for ``_reclaim_s``, as from a reading getter.
        """
        if self._io_watching:
            self._loop.call_soon(self._unwatch)

    def pump(self, rounds: int = 1, *, woken: bool = True, hand: Hand | None = None) -> bool | None:
        """Read the socket on an event loop's thread, as a reading getter would, without blocking.

        For a loop that polls :attr:`fd` (a dup of it) after :meth:`lend_to_loop`.
        The arrivals reach the mailbox and the arrivals hook on this thread.

        ``woken``: the descriptor woke the loop, so a message is most likely queued. It is
        read at once (no ``ZMQ_EVENTS`` look first), and the read stops after the first
        message that brought items: their waiters resume before anything else is looked at,
        and the caller calls again (``woken=False``) after its other callbacks. A lone
        message's reply is then sent before the socket is asked whether more is queued.

        ``hand``: the loop's waiting gets. Each arrival whose address has no item in the
        mailbox is offered to ``hand(slot, (obj, nbytes))`` first; one it took (True) is
        consumed there, as a take would (never stored, never notified). Shared-memory items
        are not offered: opening them may fail, which a take records.

        Returns:
            True: read all that was queued, or another reader holds the socket for now (it
            reads until empty, and its release wakes the loops by an arrivals notice);
            False: stopped with more queued, or maybe queued (call again soon,
            ``woken=False``); None: the socket is not the loop's now (the I/O thread
            watches it, or it is closed): stop polling :attr:`fd` until the next
            :meth:`lend_to_loop`.
        """
        if self._io_watching or self._closed:
            return None
        if not self._owner.acquire(False):
            # Lent, and held for a moment by the I/O thread's owed work, a take or a reading getter:
            # each reads until ZeroMQ holds nothing, and the flag has its release wake the loops, in
            # case the message this pump came for arrived after that read. The socket stays the loop's.
            self._loop_missed = True
            if not self._owner.acquire(False):  # (released before the flag was seen: read it now)
                return True
        try:
            if self._io_watching or self._closed:
                return None
            if self._owed:
                self._run_owed()
            self._hand = hand
            settled = self._on_readable(stop_at_items=True) if woken else self._settle(rounds)
            if self._flush_if_heavy():
                settled = self._settle(rounds)  # the REPLY may have used up the descriptor's signal
            self._last_read = time.monotonic()
            return settled
        finally:
            self._hand = None
            self._release_owner()

    def _settle(self, rounds: int) -> bool:
        """Read until ZeroMQ holds nothing for us, at most ``rounds`` drains (holds ``_owner``); True if it did.

        ZeroMQ's descriptor signals a change, not a state: whoever uses the socket while
        an event loop polls that descriptor (a read, an ack sent) may consume the signal
        of a message that arrived meanwhile. So nobody leaves a message queued behind
        its back: each user reads until ``ZMQ_EVENTS`` says empty (a loop's woken
        :meth:`pump` stops early, and its caller calls again to settle).
        """
        events = self._sock.get
        for _ in range(rounds):
            if not events(_EVENTS) & _POLLIN or self._on_readable():
                return True
        return not events(_EVENTS) & _POLLIN

    def _settle_for_loops(self) -> None:
        """:meth:`_settle` a lent socket, then wake the loops if a flood is still queued (holds ``_owner``)."""
        if not self._settle(1) and self._loop_readers:
            self._wake_loops()

    def _leave_to_loops(self) -> None:
        """After the I/O thread used a lent socket (holds ``_owner``): what is queued is read by a loop that waits.

        Using the socket may have spent the signal of a message that arrived meanwhile, so
        somebody must look. A loop with gets waiting is woken to read it (it would anyway:
        reading here makes two threads take turns at the GIL, which in a flood costs far
        more than the read); without one, the I/O thread reads it itself.
        """
        if not self._a_loop_waits():
            self._settle_for_loops()
        elif self._sock.get(_EVENTS) & _POLLIN:
            self._wake_loops()

    def _open(self, item: _Item) -> tuple[Any, int]:
        """Decode the payload of an item whose ``loc`` names a shared-memory slot, taken out of the mailbox.

        Its consumption is acknowledged only once the slot is mapped (or found gone): a sender that
        hears "consumed" may unlink the slot, and one unlinked before the mapping would be lost
        while its sender counts it delivered.
        """
        assert self._shm is not None and item.loc is not None
        try:
            views = self._shm.open(item.loc)
        finally:
            with self._lock:
                self._ack_taken(item)
        if views is None:
            self._counters.add("shm_stale")
            raise ShmError("its shared-memory payload expired or its sender withdrew it")
        return self._decode(views), item.nbytes

    def forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        """Drop mailbox items whose key matches (acknowledged as consumed); return how many.

        With ``key`` (``cleanup``, ``abandon_get``) or ``prefix`` (``cleanup_prefix``) it also
        leaves a tombstone: for ``tombstone_ttl_s`` an arrival under it is dropped at once.
        """
        now = time.monotonic()
        with self._lock:
            self._tombs.bury(now, key=key, prefix=prefix)
            slots = [slot for slot in self._box if match(slot[2])]
            items = [self._box.pop(slot) for slot in slots]
            for item in items:
                self._ack_dropped(item, DROPPED_CANCELLED)
            self._dropped["cleanup"] += len(items)
        self._discard(items)
        return len(slots)

    def _discard(self, items: Iterable[_Item]) -> None:
        if self._shm is not None:
            for item in items:
                if item.loc is not None:
                    self._shm.discard(item.loc)

    def _ack_taken(self, item: _Item) -> None:
        # Caller holds _cv. Wake the I/O thread once per batch, not once per get.
        self._taken.append((item.sid, item.seq))
        self._gets += 1
        self._bytes_received += item.nbytes
        self._taken_bytes += item.nbytes
        if self._taken_bytes >= _ACK_BYTES and not self._taken_flush_asked:
            # Large items read before their gets came (their arrival acks are out): acknowledge their
            # consumption now, not ack_delay_s later. A reading getter flushes itself (_flush_if_heavy).
            self._taken_flush_asked = True
            self._loop.call_soon(self._owned_flush)
        # The flush armed when the item arrived usually carries this consumption too: a get wakes the
        # I/O thread only when none is armed (not on a lone message's critical path).
        if not self._flush_armed:
            self._arm_from_app()

    def _ack_dropped(self, item: _Item, code: int) -> None:
        """Hand ``item``'s disposal (``code`` says why) to the I/O thread: the sender's window frees (holds ``_cv``)."""
        self._dropped_taken.append((item.sid, item.seq, code))
        if not self._flush_armed:
            self._arm_from_app()

    def _arm_from_app(self) -> None:
        """Arm the ack flush from an application thread and have the I/O thread time it (holds ``_cv``)."""
        self._flush_armed = True
        self._flush_due = time.monotonic() + self._ack_delay
        self._loop.call_soon(self._schedule_flush)

    def stats(self) -> dict[str, Any]:
        """Gets, bytes taken, items waiting for ``get``, BATCH messages taken in, and what was dropped unclaimed.

        ``dropped_unclaimed``: items no get took within ``unclaimed_ttl_s``; ``dropped_late``: arrivals
        under a tombstone; ``dropped_cleanup``: items cleanup/abandon removed; ``tombstones_evicted``:
        tombstones pushed out by ``max_tombstones``. ``mailbox_oldest_s``: age of the oldest item.
        """
        now = time.monotonic()
        with self._lock:
            oldest = next(iter(self._box.values()), None)
            return {
                "gets": self._gets,
                "bytes_received": self._bytes_received,
                "mailbox": len(self._box),
                "mailbox_oldest_s": 0.0 if oldest is None else max(0.0, now - oldest.arrived),
                "batches_received": self._batches_received,
                "tombstones": len(self._tombs),
                "tombstones_evicted": self._tombs.evicted,
                **{f"dropped_{k}": v for k, v in self._dropped.items()},
            }

    def generation(self) -> int:
        """A counter bumped whenever items arrive in the mailbox (for :meth:`wait_for_change`).

        Read without ``_lock``: callers only compare it, and ``wait_for_change`` re-reads it under the lock.
        """
        return self._generation

    def wait_for_change(self, generation: int, timeout: float) -> int:
        """Wait on the mailbox condition until the generation differs from ``generation``, at most ``timeout``.

        Returns the generation then (equal to ``generation`` after a timeout or close).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._watchers += 1
            try:
                while self._generation == generation and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    if not self._io_watching:  # a getter borrowed the socket: have the I/O thread read again
                        self._loop.call_soon(self._rewatch)
                    self._cv.wait(remaining)
            finally:
                self._watchers -= 1
            return self._generation

    def close(self) -> None:
        """Wake every waiting ``get``; the socket closes on the loop thread after a last ack flush."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
            self._signal_recall()

    def _signal_recall(self) -> None:
        """Wake the reading getter, if any, and the event loops reading (they run ``_owed`` and see ``_closed``)."""
        if self._recall >= 0:  # closed (-1) by _shutdown, on the I/O thread under _lock
            os.eventfd_write(self._recall, 1)
        if self._loop_readers:
            self._wake_loops()

    def _wake_loops(self) -> None:
        """Have the event loops reading this socket call :meth:`pump` (an arrivals notice naming nothing)."""
        hook = self.on_arrivals
        if hook is not None:
            hook([])

    # -- I/O thread ---------------------------------------------------------------
    def _owned(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` run on the I/O thread as the socket's owner, or left to the reading getter holding it."""

        def run() -> None:
            if self._owner.acquire(False):
                try:
                    fn()
                    if self._loop_readers and not self._io_watching:
                        self._leave_to_loops()  # fn may have used up the descriptor's signal
                finally:
                    self._release_owner()
            else:
                self._owed.append(fn)
                self._signal_recall()

        return run

    def _on_readable_io(self) -> None:
        if self._owner.acquire(False):
            try:
                self._on_readable()
                self._flush_if_heavy()
            finally:
                self._owner.release()
        else:  # a getter reads it now (its _unwatch is on its way): stop watching rather than spin
            self._unwatch()

    def _unwatch(self) -> None:
        """Stop polling the socket: the getter holding ``_owner`` reads it once this is seen."""
        if self._io_watching:
            self._loop.remove_reader(self._sock)
            self._io_watching = False
            self._last_read = time.monotonic()  # _reclaim's clock starts at the hand-over, not at the last read
            self._signal_recall()
        if not self._reclaim_armed:
            self._reclaim_armed = True
            self._loop.call_later(self._reclaim_s, self._reclaim)

    def watch_soon(self) -> None:
        """Have the I/O thread read the socket again if getters borrowed it (any thread; for a new arrivals hook)."""
        self._loop.call_soon(self._rewatch)

    def _rewatch(self) -> None:
        """Watch the socket again unless a getter reads it (then ``_reclaim`` checks again)."""
        if self._io_watching or self._sock.closed or not self._owner.acquire(False):
            return
        try:
            if self._flush_armed:  # armed by a getter: its acks go now
                self._flush_all()
            self._resume_watching()
        finally:
            self._owner.release()

    def _resume_watching(self) -> None:
        """Poll the socket on the I/O thread again and do what was left for a reader (holds ``_owner``)."""
        self._loop.add_reader(self._sock, self._on_readable_io)
        self._io_watching = True
        self._run_owed()

    def _run_owed(self) -> None:
        """Do the I/O thread's work left while a getter held the socket (holds ``_owner``)."""
        while self._owed:
            self._owed.popleft()()

    def _reclaim(self) -> None:
        """While getters borrow the socket: flush their acks, and take it back once none read it for ``_reclaim_s``.

        Between a getter giving the socket back and the next one taking it, nobody reads it:
        this bounds how long acks, pongs and arrivals nobody waits for can sit in ZeroMQ's queue.
        An event loop with gets waiting polls the descriptor and reads what comes: lent to it,
        the socket is taken back only after ``_LOOP_STALL_S`` without a read.
        """
        self._reclaim_armed = False
        if self._io_watching:
            return
        now = time.monotonic()
        flush_due = self._flush_armed and now >= self._flush_due
        if self._owner.acquire(False):
            try:
                if flush_due:
                    self._flush_all()
                idle = now - self._last_read
                if idle >= self._reclaim_s and (idle >= _LOOP_STALL_S or not self._a_loop_waits()):
                    if self._flush_armed:  # armed by a getter and not due yet: the I/O thread's timer sends it
                        self._loop.call_later(self._flush_due - now, self._owned_flush)
                    self._resume_watching()
                    return
                if self._loop_readers:
                    self._leave_to_loops()  # the flush may have used up the descriptor's signal
            finally:
                self._release_owner()
        elif flush_due:
            self._owed.append(self._flush_all)
            self._signal_recall()
        self._reclaim_armed = True
        next_check = self._reclaim_s
        if self._flush_armed and not flush_due:  # the next beat is the flush's due time, if sooner
            next_check = min(next_check, max(0.001, self._flush_due - now))
        self._loop.call_later(next_check, self._reclaim)

    def _on_readable(self, want_key: str | None = None, *, stop_at_items: bool = False) -> bool:
        """Drain the socket (holds ``_owner``: on the I/O thread or a reading getter).

        A reading getter passes the key it waits for as ``want_key``: the drain stops once a
        DATA of that key is in, without asking ZeroMQ whether more is queued (``ZMQ_EVENTS``, about
        1 us a call, on every lone message's critical path). What stays queued is read by
        the next getter's poll or by the I/O thread, both level-triggered (``zmq_poll``);
        a getter passes None while event loops poll the edge-triggered descriptor.
        ``stop_at_items`` (an event loop's woken :meth:`pump`) stops after any DATA or BATCH:
        the loop settles the socket after the waiters of those items ran.

        Returns:
            True when it left ZeroMQ's queue empty and did not use the socket after
            seeing so (:meth:`_settle` needs no further look).
        """
        sock, max_frames, events = self._sock, self._max_frames, self._sock.get
        self._now = time.monotonic()
        rejected = 0
        emptied = False
        for _ in range(_MAX_DRAIN):
            message = recv_routed(sock, max_frames)
            if message is None:
                emptied = True
                break
            self._pending_acks += 1
            identity, frames, ok = message
            try:
                if not ok:
                    raise DecodeError(f"message with more than {max_frames} frames")
                kind, header, payload = unpack(frames[0])
                if kind is Kind.BATCH:
                    rejected += self._on_batch(header, payload, len(frames))
                    if stop_at_items:
                        break
                elif kind is Kind.DATA:
                    check_types(header[:6], _DATA_TYPES, "DATA")
                    if type(header[6]) not in _LOC_TYPES:
                        raise DecodeError(f"DATA location table {brief(header[6])} is not a slot handle")
                    self._on_data(header, payload, frames)
                    if stop_at_items or header[5] == want_key:
                        break  # (most likely) the getter's item: it looks now; the ack decision below still runs
                elif kind is Kind.PING:
                    check_types(header[:3], _PING_TYPES, "PING")
                    self._on_ping(header[0], header[1], header[2], header[3] if len(header) > 3 else None)
                elif kind is Kind.HEALTH:
                    self._reply(identity, pack(Kind.HEALTH_REPLY, (self._health(),)))
                else:
                    raise DecodeError(f"unexpected {kind.name} message")
            except (DecodeError, MessageTooLargeError) as exc:
                rejected += 1
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("rejected a message on %s: %s", self.endpoint, exc)
            # Asking is a third of the cost of the zmq.Again a recv on an empty socket raises (2.5 vs 7.8 us).
            if not events(_EVENTS) & _POLLIN:
                emptied = True
                break
        if rejected:
            self._counters.add("rejected_frames", rejected)
        # The wake-up before the acknowledgements: arming the ack timer is a flag, sending acks is I/O.
        arm = self._pending_acks < _ACK_BATCH
        if self._arrivals:
            self._store_arrivals(arm)
        elif arm:
            self._arm_flush()
        if not arm:
            self._flush_all()
            return False
        return emptied

    def _store_arrivals(self, arm: bool) -> None:
        """Put this drain's items in the mailbox: one lock, one notify, for every message and batch.

        With ``arm``, the ack flush is armed under the same lock (as :meth:`_arm_flush`
        does): a getter that takes an item then never wakes the I/O thread for it.
        """
        arrivals, self._arrivals = self._arrivals, []
        replaced: list[_Item] = []
        schedule = False
        hand = self._hand
        with self._lock:
            if arm and not self._flush_armed:
                self._flush_armed = schedule = True
                self._flush_due = self._now + self._ack_delay
            if self._tombs.entries:
                arrivals = self._drop_buried(arrivals, replaced)
            if hand is not None:
                arrivals = self._hand_off(hand, arrivals)
            box = self._box
            for slot, item in arrivals:
                old = box.pop(slot, None)  # a re-put goes to the end: the mailbox stays in arrival order
                box[slot] = item
                if old is not None:  # a re-put replaces; the replaced one counts as consumed
                    self._taken.append((old.sid, old.seq))
                    replaced.append(old)
            self._generation += 1
            if self._waiting or self._watchers:
                self._cv.notify_all()
        if schedule:
            self._flush_was_armed()
        if replaced:
            self._discard(replaced)
        if self.on_arrivals is not None and arrivals:
            self.on_arrivals([slot for slot, _ in arrivals])

    def _hand_off(
        self, hand: Hand, arrivals: list[tuple[tuple[str, str, str], _Item]]
    ) -> list[tuple[tuple[str, str, str], _Item]]:
        """Give arrivals to the pumping loop's waiting gets; the ones nobody took (holds ``_lock``).

        Under the lock, so that a take on another thread finds each item in the mailbox or
        consumed, never both (``hand`` resolves a future of the loop: it never blocks nor calls
        back here). An address with an item in the mailbox keeps it first: its arrival is stored.
        """
        box = self._box
        kept = []
        for slot, item in arrivals:
            if item.loc is None and slot not in box and hand(slot, (item.obj, item.nbytes)):
                self._ack_taken(item)
            else:
                kept.append((slot, item))
        return kept

    def _drop_buried(
        self, arrivals: list[tuple[tuple[str, str, str], _Item]], dropped: list[_Item]
    ) -> list[tuple[tuple[str, str, str], _Item]]:
        """Drop (acknowledged as consumed) the arrivals under a tombstone, renewing it; the rest (holds ``_lock``)."""
        kept = []
        covers, now = self._tombs.covers, self._now
        for slot, item in arrivals:
            if not covers(slot[2], now):  # a drop renews the tombstone: a stream still arriving keeps it
                kept.append((slot, item))
                continue
            self._ack_dropped(item, DROPPED_CANCELLED)
            self._dropped["late"] += 1
            dropped.append(item)
        return kept

    def _on_batch(self, header: list[Any], payload: memoryview, n_frames: int) -> int:
        """Take in the puts of one BATCH, each validated on its own; how many of them were rejected.

        Raises:
            DecodeError: the batch itself is malformed (nothing of it is taken in).
        """
        if n_frames != 1 or payload.nbytes:
            raise DecodeError("a BATCH message must be one frame holding only its header")
        check_types(header, _BATCH_TYPES, "BATCH")
        sid, low, to_stage, entries = header
        count = len(entries)
        if count < 8 or count % 4 or count > 4 * _MAX_BATCH_ENTRIES:
            raise DecodeError(f"BATCH of {count} fields is not 2..{_MAX_BATCH_ENTRIES} puts of 4 fields")
        if tuple(map(type, entries)) != _BATCH_ENTRY * (count // 4):
            raise DecodeError("BATCH entries are not (seq, from_stage, key, wire) of (int, str, str, bytes)")
        source = self._sources.get(sid) or self._source(sid)
        source.check_room(count // 4)
        source.note(low, self._now)
        self._dirty.add(sid)
        self._pending_acks += count // 4 - 1
        with self._lock:
            self._batches_received += 1
        arrivals = self._arrivals
        now = self._now
        accepted: list[int] = []
        duplicates: list[int] = []
        rejected = 0
        seqs, from_stages, keys, wires = entries[::4], entries[1::4], entries[2::4], entries[3::4]
        # One decode call per batch. A batch of resends (puts we already have) decodes only what is new.
        all_new = source.all_new(seqs)
        if all_new:
            objs: list[Any] = self._decode_each(wires)
        else:
            fresh = [i for i, seq in enumerate(seqs) if source.is_new(seq)]
            objs = [None] * len(seqs)
            for i, obj in zip(fresh, self._decode_each([wires[i] for i in fresh]), strict=True):
                objs[i] = obj
            taken: set[int] = set()  # a seq repeated inside the batch is taken once
        for seq, from_stage, key, wire, obj in zip(seqs, from_stages, keys, wires, objs, strict=True):
            if not all_new and (seq in taken or not source.is_new(seq)):
                duplicates.append(seq)  # already have (or had) it: acknowledge again, keep one copy
                continue
            if isinstance(obj, DecodeError):
                rejected += 1  # not acknowledged: the sender's deadline reports it
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("rejected put %s of a batch on %s: %s", seq, self.endpoint, obj)
                continue
            if not all_new:
                taken.add(seq)
            accepted.append(seq)
            arrivals.append(((from_stage, to_stage, key), _new_item(_Item, (obj, len(wire), sid, seq, None, now))))
        source.accept_batch(accepted, duplicates)
        if duplicates:
            self._counters.add("duplicates_dropped", len(duplicates))
        return rejected

    def _source(self, sid: str) -> SourceState:
        source = self._sources.get(sid)
        if source is None:
            if not sid or len(sid) > _MAX_SID:
                raise DecodeError(f"sender id of {len(sid)} characters")
            source = self._sources[sid] = SourceState(sid, self._now)
        return source

    def _on_data(self, header: list[Any], payload: memoryview, frames: list[Any]) -> None:
        sid, seq, low, from_stage, to_stage, key, loc = header
        if loc is not None:
            self._on_handle(header, loc, payload.nbytes + len(frames) - 1)
            return
        size = payload.nbytes
        if len(frames) > 1:
            size += sum(f.buffer.nbytes for f in frames[1:])
            if size > self._max_message:
                raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
            parts = [payload, *frames[1:]]
        else:
            parts = [payload]
        source = self._sources.get(sid) or self._source(sid)
        self._pending_bytes += size
        if self._admit(source, sid, low, seq):
            item = _new_item(_Item, (self._decode(parts), size, sid, seq, None, self._now))
            self._store(source, (from_stage, to_stage, key), item)

    def _on_handle(self, header: list[Any], loc: bytes, extra: int) -> None:
        # Checked before any state changes: a handle from a sender we never confirmed is refused.
        sid, seq, low, from_stage, to_stage, key, _ = header
        source = self._sources.get(sid)
        if self._shm is None or source is None or source.shm is not True:
            raise DecodeError("a shared-memory handle from a sender not confirmed on this host")
        if extra:
            raise DecodeError("a shared-memory DATA message must be one frame")
        size = self._shm.size(loc, source.probe)
        if size > self._max_message:
            raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
        self._pending_bytes += size
        # A duplicate handle is never opened: the first arrival's item holds it.
        if self._admit(source, sid, low, seq):
            self._store(source, (from_stage, to_stage, key), _Item(None, size, sid, seq, loc, self._now))

    def _admit(self, source: SourceState, sid: str, low: int, seq: int) -> bool:
        """Note a message from ``source``; False for a duplicate, which is acknowledged again and dropped."""
        source.note(low, self._now)
        self._dirty.add(sid)
        if source.is_new(seq):
            source.check_room()
            return True
        self._counters.add("duplicates_dropped")
        source.duplicate(seq)
        return False

    def _store(self, source: SourceState, slot: tuple[str, str, str], item: _Item) -> None:
        source.accept(item.seq)
        self._arrivals.append((slot, item))

    def _on_ping(self, sid: str, ping: int, low: int, probe: Any) -> None:
        source = self._source(sid)
        source.note(low, self._now)
        if probe is not None and probe != source.probe:
            source.shm = False if self._shm is None else self._shm.probe(probe)
            source.probe = probe
        self._flush_taken()
        for code, seqs in source.drops():  # before the pong, which then repeats them as consumed
            self._send_reply(source, code, [], seqs)
        arrived, consumed = source.pong()
        self._send_reply(source, ping, arrived, consumed)

    def _arm_flush(self) -> None:
        with self._lock:
            if self._flush_armed:
                return
            self._flush_armed = True
            self._flush_due = self._now + self._ack_delay
        self._flush_was_armed()

    def _flush_was_armed(self) -> None:
        """Schedule the ack flush just armed, on the I/O thread; a getter or loop reading leaves it to ``_reclaim``."""
        if self._loop.in_loop():
            self._schedule_flush()
        # else: _reclaim, due while getters borrow the socket, flushes (no wake-up here)

    def _schedule_flush(self) -> None:
        self._loop.call_later(self._ack_delay, self._owned_flush)

    def _owned_flush(self) -> None:
        self._owned(self._flush_all)()

    def _flush_if_heavy(self) -> bool:
        """Send the acks now if ``_ACK_BYTES`` of payload arrived or was taken since the last (holds ``_owner``).

        True if it did.
        """
        if self._pending_bytes < _ACK_BYTES and self._taken_bytes < _ACK_BYTES:
            return False
        self._flush_all()
        return True

    def _flush_all(self) -> None:
        self._pending_acks = self._pending_bytes = 0
        self._flush_taken(disarm=True)
        self._flush_acks()

    def _flush_taken(self, *, disarm: bool = False) -> None:
        with self._lock:
            taken, self._taken = self._taken, []
            dropped, self._dropped_taken = self._dropped_taken, []
            self._taken_bytes, self._taken_flush_asked = 0, False
            if disarm:
                self._flush_armed = False
        for sid, seq in taken:
            source = self._sources.get(sid)
            if source is not None:
                source.consume(seq)
                self._dirty.add(sid)
        for sid, seq, code in dropped:
            source = self._sources.get(sid)
            if source is not None:
                source.drop(seq, code)
                self._dirty.add(sid)

    def _flush_acks(self) -> None:
        for sid in self._dirty:
            source = self._sources.get(sid)
            if source is not None:
                for code, seqs in source.drops():
                    self._send_reply(source, code, [], seqs)
            acks = None if source is None else source.ack()
            if acks is not None:
                assert source is not None
                self._send_reply(source, -1, *acks)
        self._dirty.clear()

    def _send_reply(self, source: SourceState, ping: int, arrived: list[int], consumed: list[int]) -> None:
        """A REPLY to ``source``: answering ``ping`` (-1: a plain ack), ``arrived`` and ``consumed``.

        Lists longer than ``_MAX_REPLY_SEQS`` go in several REPLYs, plain acks first and the
        answer to ``ping`` last, so no REPLY exceeds what any sender accepts. What a REPLY
        that could not go out said is kept for the next one (see :meth:`SourceState.unsent`).
        """
        cap = _MAX_REPLY_SEQS
        if len(arrived) > cap or len(consumed) > cap:
            arrived, consumed = sorted(set(arrived)), sorted(set(consumed))
            ack = min(ping, -1)  # a pong's earlier parts are plain acks; a drop report's keep its code
            while len(arrived) > cap or len(consumed) > cap:
                if not self._send_one_reply(source, ack, arrived[:cap], consumed[:cap]):
                    self._counters.add("acks_given_up", source.unsent(ack, arrived[:cap], consumed[:cap]))
                arrived, consumed = arrived[cap:], consumed[cap:]
        if not self._send_one_reply(source, ping, arrived, consumed):
            self._counters.add("acks_given_up", source.unsent(ping, arrived, consumed))

    def _send_one_reply(self, source: SourceState, ping: int, arrived: Iterable[int], consumed: Iterable[int]) -> bool:
        header = (
            self.incarnation,
            ping,
            to_ranges(arrived),
            to_ranges(consumed),
            source.shm,
            self._max_message,
        )
        routed = self._reply(source.ctl, pack(Kind.REPLY, header))
        source.replied(routed)
        return routed

    def _reply(self, identity: bytes, frame: bytes) -> bool:
        """Send a reply routed to ``identity``; False when ZeroMQ refused it (dropped, ``acks_dropped``)."""
        try:
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            # Unroutable (a sender whose control socket has not connected yet, or is gone) or full.
            self._counters.add("acks_dropped")
            return False
        return True

    def _expire_unclaimed(self) -> None:
        """Drop items no get took within ``unclaimed_ttl_s`` (acknowledged as consumed) and lapsed tombstones."""
        now = time.monotonic()
        cutoff = now - self._unclaimed_ttl
        expired: list[_Item] = []
        with self._lock:
            box = self._box
            slots = []
            for slot, item in box.items():  # arrival order: the expired ones are a prefix
                if item.arrived > cutoff:
                    break
                slots.append(slot)
                expired.append(item)
            for slot, item in zip(slots, expired, strict=True):
                del box[slot]
                self._ack_dropped(item, DROPPED_UNCLAIMED)
            self._dropped["unclaimed"] += len(expired)
            self._tombs.lapse(now)
        if expired:
            log.warning(
                "%d items on %s were never taken within unclaimed_ttl_s=%ss: dropped",
                len(expired),
                self.endpoint,
                self._unclaimed_ttl,
            )
            self._discard(expired)

    def _expire_sources(self) -> None:
        cutoff = time.monotonic() - self._source_ttl
        for sid in [sid for sid, s in self._sources.items() if s.last_heard < cutoff]:
            del self._sources[sid]

    def _shutdown(self) -> None:
        with self._lock:  # no getter starts reading from now on
            self._closed = True
            self._cv.notify_all()
            self._signal_recall()
        # The reading getter, if any, saw the recall and is giving the socket back.
        if not self._owner.acquire(timeout=1.0):
            log.warning("a getter on %s did not give its socket back at close", self.endpoint)
            return
        try:
            self._close_owned()
        finally:
            self._owner.release()
            with self._lock:
                os.close(self._recall)
                self._recall = -1

    def _close_owned(self) -> None:
        # Last chance to tell senders what was consumed, so a reopened receiver gets no duplicates:
        # repeat every consumption not yet confirmed, since early acks may have found no route.
        self._flush_taken()
        for source in self._sources.values():
            last = source.last_word()
            if last is not None:
                self._send_reply(source, -1, *last)
        self._loop.remove_reader(self._sock)
        close_bound(self._sock, self.endpoint, linger_ms=200)
