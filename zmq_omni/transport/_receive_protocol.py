"""Push mode, receiving half: the protocol without I/O.

:class:`ReceiveProtocol` is fed each message the receiver's ROUTER delivered
(``identity, frames``) and the clock. It decides what is new and becomes an
item to deliver (:attr:`ReceiveProtocol.arrivals`), what each sender must hear
(:class:`Reply` objects to send, each reported back with :meth:`sent`), and
when the batched acknowledgements are due (:meth:`ReceiveProtocol.schedule`,
:attr:`ReceiveProtocol.flush_due`: decided here alone; the driver keeps the
time). It touches no socket, takes no lock and starts no thread: a PING or a
HEALTH waits in :attr:`ReceiveProtocol.asked` until the driver hands over what
left the mailbox (:meth:`ReceiveProtocol.taken`), attaches the probe segments
(:meth:`ReceiveProtocol.probes`), computes the health and calls
:meth:`ReceiveProtocol.answer` (it reads nothing outside: a shared-memory DATA's
size comes from its slot handle, parsed by ``ShmReceive.size`` before it is
accepted). It belongs to the receiver's driver (see
:mod:`~zmq_omni.transport._receiver`), who calls it one message at a time.

What each sender is told (dedupe window, acknowledgements, pongs) is the
per-sender :class:`~zmq_omni.transport._dedupe.SourceState`; how a REPLY says it, in
:mod:`~zmq_omni.transport._receive_replies`; the socket layout and the delivery protocol
are in :mod:`~zmq_omni.transport._push_protocol`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ..errors import DecodeError, MessageTooLargeError
from ..metrics import Counters
from ..wire import brief
from ._dedupe import SourceState
from ._envelope import DEFAULT_MAX_KEY_BYTES, Kind, check_key, check_types, pack, unpack
from ._receive_replies import Reply, cut_replies
from ._shm import ShmReceive, check_probe

__all__ = ["ACK_BATCH", "ACK_BYTES", "DEFAULT_ACK_DELAY_S", "Item", "ReceiveProtocol", "Reply", "Slot"]

log = logging.getLogger("zmq_omni.transport")

Slot = tuple[str, str, str]

# Acks wait ``ack_delay_s`` to be batched (one REPLY covers hundreds of puts under load; a lone
# stream pays one REPLY per delay, not one per put) ... or until this many messages are pending,
ACK_BATCH = 1024
# ... or until this many payload bytes arrived or were taken since the last flush, or were taken since
# the last prompt flush they caused: a sender keeps each put until it hears it consumed, so a stream of
# large payloads acknowledged every 20 ms would pin a dozen at each end.
ACK_BYTES = 2 << 20
DEFAULT_ACK_DELAY_S = 0.02
_MAX_SID = 64
_DATA_TYPES = (str, int, int, str, str, str)
_LOC_TYPES = (type(None), bytes)
_PING_TYPES = (str, int, int)
_BATCH_TYPES = (str, int, str, list)
_BATCH_ENTRY = (int, str, str, bytes)  # seq, from_stage, key, wire frame 0
_MAX_BATCH_ENTRIES = 65536


class Item(NamedTuple):
    """One item for the mailbox (a tuple: the receive hot path builds it with one C call, ``new_item``)."""

    obj: Any
    nbytes: int
    sid: str
    seq: int
    loc: bytes | None  # a shared-memory slot handle, opened by the get that takes it (obj is None until then)
    arrived: float  # the clock when it arrived (unclaimed_ttl_s counts from it)


# ``Item.__new__`` is a Python function; the tuple constructor makes the same object without it.
new_item = tuple.__new__


Verdicts = dict[tuple[str, bytes], bool]  # a probe segment's (name, nonce) -> readable here


class Ask(NamedTuple):
    """A request waiting for the driver (see :meth:`ReceiveProtocol.answer`): a PING, or a HEALTH (``source`` None)."""

    identity: bytes
    source: SourceState | None
    ping: int
    probe: list[Any] | None  # the PING's probe segment, ``[name, nonce]``


class ReceiveProtocol:
    """The receiving end of push mode without I/O (see the module docstring).

    What one acknowledgement costs: a plain acknowledgement says what arrived and what was
    consumed since the previous REPLY to that sender; a pong says the same, at most
    :data:`~zmq_omni.transport._dedupe.MAX_PONG_RECENT` consumptions told once more, and at
    most :data:`~zmq_omni.transport._dedupe.MAX_PONG_REPEATS` told twice, in rotation (why that
    keeps delivery exactly-once while an unclaimed item pins the sender's low mark:
    :class:`~zmq_omni.transport._dedupe.SourceState`). Lists are cut into REPLYs of
    ``MAX_REPLY_SEQS`` seqs at fixed offsets (:func:`~zmq_omni.transport._receive_replies.cut_replies`),
    so building them costs time linear in the seqs they name (plus one sort), and neither grows with
    the sender's history.

    Args:
        endpoint: named in log lines.
        incarnation: this receiver's id, in every REPLY (a new one makes senders resend).
        decode: one DATA message's frames to its object.
        decode_each: a BATCH's wire frames to their objects (a failed one is its DecodeError).
        max_message_bytes: the largest put accepted.
        max_frames: the most frames a message may have.
        counters: where rejections and duplicates are counted.
        shm: the shared-memory reader, None without the fast path (it sizes handles).
        ack_delay_s: longest an acknowledgement owed waits to be batched (see :meth:`schedule`).
        max_key_bytes: the longest key accepted (UTF-8 bytes); a longer one's DATA, or BATCH
            entry alone, is refused (counted in ``rejected_keys`` and ``rejected_frames``).
    """

    def __init__(
        self,
        *,
        endpoint: str,
        incarnation: str,
        decode: Callable[[list[Any]], Any],
        decode_each: Callable[[list[bytes]], list[Any]],
        max_message_bytes: int,
        max_frames: int,
        counters: Counters,
        shm: ShmReceive | None,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
        ack_delay_s: float = DEFAULT_ACK_DELAY_S,
    ) -> None:
        self.max_key_bytes = max_key_bytes
        self._short_key = max_key_bytes // 4  # a key of at most this many characters is never too long
        self.endpoint = endpoint
        self.incarnation = incarnation
        self._decode = decode
        self._decode_each = decode_each
        self._max_message = max_message_bytes
        self.max_frames = max_frames
        self._counters = counters
        self._shm = shm
        self.sources: dict[str, SourceState] = {}
        self.arrivals: list[tuple[Slot, Item]] = []  # decoded since the owner last took them
        self.replies: list[Reply] = []  # to send now (pongs, health answers)
        #: PINGs and HEALTH requests waiting for :meth:`answer`, in arrival order.
        self.asked: list[Ask] = []
        self.batches = 0  # BATCH messages taken in
        self._dirty: set[str] = set()  # senders owed an acknowledgement
        self._hail: set[str] = set()  # senders whose resend for another incarnation was dropped: owed a REPLY
        self._pending = 0  # messages since the last flush
        self._pending_bytes = 0  # payload bytes arrived or taken since the last flush
        self._heavy_bytes = 0  # payload bytes taken since the last prompt flush they caused
        self._ack_delay = ack_delay_s
        #: When the acknowledgements owed are due (None: none is scheduled); set by :meth:`schedule`
        #: and :meth:`left_mailbox`, cleared by :meth:`flush`. The driver flushes once the clock passes it.
        self.flush_due: float | None = None
        self._now = 0.0

    # -- input ------------------------------------------------------------------------------
    def receive(self, identity: bytes, frames: list[Any], ok: bool, now: float) -> str | None:
        """Take in one message (``ok`` False: it had too many frames). The key of a DATA, else None.

        A malformed, oversized or hostile message is counted (``rejected_frames``) and
        otherwise ignored: nothing a peer sends raises out of here.
        """
        self._now = now
        self._pending += 1
        try:
            if not ok:
                raise DecodeError(f"message with more than {self.max_frames} frames")
            kind, header, payload = unpack(frames[0])
            if kind is Kind.DATA:
                check_types(header[:6], _DATA_TYPES, "DATA")
                if type(header[6]) not in _LOC_TYPES:
                    raise DecodeError(f"DATA location table {brief(header[6])} is not a slot handle")
                if len(header[5]) > self._short_key:
                    self._check_key(header[5])
                if len(header) > 7 and self._foreign(header[0], header.pop(), 1):
                    return None
                self._on_data(header, payload, frames)
                key: str = header[5]
                return key
            if kind is Kind.BATCH:
                rejected = self._on_batch(header, payload, len(frames))
                if rejected:
                    self._counters.add("rejected_frames", rejected)
            elif kind is Kind.PING:
                check_types(header[:3], _PING_TYPES, "PING")
                probe = header[3] if len(header) > 3 else None
                if probe is not None:
                    check_probe(probe)
                source = self._source(header[0])
                source.note(header[2], now)
                self.asked.append(Ask(identity, source, header[1], probe))
            elif kind is Kind.HEALTH:
                self.asked.append(Ask(identity, None, 0, None))
            else:
                raise DecodeError(f"unexpected {kind.name} message")
        except (DecodeError, MessageTooLargeError) as exc:
            self._counters.add("rejected_frames")
            if log.isEnabledFor(logging.DEBUG):
                log.debug("rejected a message on %s: %s", self.endpoint, exc)
        return None

    def _foreign(self, sid: str, tag: Any, puts: int) -> bool:
        """True when a resend's ``tag`` names another receiver incarnation: its ``puts`` are dropped, counted.

        A resend is sent for the incarnation the sender knew; one that reaches another (still queued
        in ZeroMQ's pipe when that one closed) may have been delivered there, and this incarnation
        has no dedupe state for it. Not lost: the sender resends what it retains once it hears this
        incarnation, so ``sid`` is owed a REPLY (an empty one if no acknowledgement is). Nothing
        else of the message is read. Raises ``DecodeError`` for a tag not a str or a bad ``sid``.
        """
        if type(tag) is not str:
            raise DecodeError(f"resend incarnation {brief(tag)} is not a str")
        if tag == self.incarnation:
            return False
        if sid not in self.sources:
            self._source(sid)
        self._dirty.add(sid)
        self._hail.add(sid)
        self._counters.add("stale_resends_dropped", puts)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dropped %d puts resent for incarnation %s on %s", puts, brief(tag), self.endpoint)
        return True

    def _check_key(self, key: str) -> None:
        """Refuse a key longer than ``max_key_bytes`` (counted in ``rejected_keys``; the caller counts the message)."""
        try:
            check_key(key, self.max_key_bytes)
        except DecodeError:
            self._counters.add("rejected_keys")
            raise

    def taken(self, consumed: Iterable[tuple[str, int]], dropped: Iterable[tuple[str, int, int]], nbytes: int) -> None:
        """Items left the mailbox: ``consumed`` by gets or re-puts, ``dropped`` unconsumed (with why)."""
        self._pending_bytes += nbytes
        self._heavy_bytes += nbytes
        for sid, seq in consumed:
            source = self.sources.get(sid)
            if source is not None:
                source.consume(seq)
                self._dirty.add(sid)
        for sid, seq, code in dropped:
            source = self.sources.get(sid)
            if source is not None:
                source.drop(seq, code)
                self._dirty.add(sid)

    def probes(self) -> list[list[Any]]:
        """Probe segments of the waiting PINGs that their senders' verdicts do not cover (the driver attaches each)."""
        new = {
            (a.probe[0], a.probe[1]): a.probe for a in self.asked if a.probe and a.source and a.probe != a.source.probe
        }
        return list(new.values())

    def wants_health(self) -> bool:
        """True when a HEALTH request waits (the driver computes the answer for :meth:`answer`)."""
        return any(ask.source is None for ask in self.asked)

    def answer(self, verdicts: Verdicts | None = None, health: dict[str, Any] | None = None) -> None:
        """Answer every request in :attr:`asked`, into :attr:`replies`.

        Call it after handing over what left the mailbox (:meth:`taken`): a pong tells every
        consumption not yet told. ``verdicts``: for each of :meth:`probes`, ``(name, nonce)`` ->
        whether it is readable here (absent: not). ``health``: the HEALTH answer.
        """
        replies = self.replies
        for ask in self.asked:
            source = ask.source
            if source is None:
                replies.append(Reply(ask.identity, pack(Kind.HEALTH_REPLY, (health or {},)), None, 0, [], []))
                continue
            probe = ask.probe
            if probe is not None and probe != source.probe:
                source.shm = verdicts is not None and verdicts.get((probe[0], probe[1]), False)
                source.probe = probe
            for code, seqs in source.drops():  # before the pong; pongs call them consumed once this is routed
                replies += self._reply(source, code, [], seqs)
            arrived, consumed = source.pong()
            replies += self._reply(source, ask.ping, arrived, consumed)
        self.asked = []

    # -- output -----------------------------------------------------------------------------
    def schedule(self, now: float) -> float | None:
        """Decide when the acknowledgements owed are due; :attr:`flush_due` then (None: nothing owed).

        At once when ``ACK_BATCH`` messages or ``ACK_BYTES`` payload bytes came or were taken since
        the last flush, or ``ACK_BYTES`` were taken since the last prompt flush they caused; else
        ``ack_delay_s`` after the first acknowledgement became owed. An earlier due time is kept.
        """
        if self._heavy_bytes >= ACK_BYTES:
            self._heavy_bytes = 0
            self.flush_due = now
        elif self._dirty:
            if self._pending >= ACK_BATCH or self._pending_bytes >= ACK_BYTES:
                self.flush_due = now
            elif self.flush_due is None:
                self.flush_due = now + self._ack_delay
        return self.flush_due

    def left_mailbox(self, now: float) -> float:
        """An item was taken or dropped (not handed over yet): acknowledge it within ``ack_delay_s``; the due time."""
        if self.flush_due is None:
            self.flush_due = now + self._ack_delay
        return self.flush_due

    def flush(self) -> list[Reply]:
        """Every acknowledgement owed: drop reports first, then plain acks, per sender."""
        self._pending = self._pending_bytes = 0
        self.flush_due = None
        replies: list[Reply] = []
        for sid in self._dirty:
            source = self.sources.get(sid)
            if source is None:
                continue
            for code, seqs in source.drops():
                replies += self._reply(source, code, [], seqs)
            acks = source.ack()
            if acks is not None:
                replies += self._reply(source, -1, *acks)
            elif sid in self._hail:  # it must hear this incarnation to resend what it dropped here
                replies += self._reply(source, -1, [], [])
        self._dirty.clear()
        if self._hail:
            self._hail.clear()
        return replies

    def last_words(self) -> list[Reply]:
        """What to tell every sender as the receiver closes: drops, arrivals and every consumption not yet confirmed.

        Early acks may have found no route, and a reopened receiver must not get duplicates.
        What the sender most likely has not heard goes first (drop reports, then the
        consumptions untold or told once, then the rest in rotation order): the REPLYs go
        out as one burst a slow sender's pipe may not take whole, and ZeroMQ refuses the tail.
        """
        replies: list[Reply] = []
        for source in self.sources.values():
            for code, seqs in source.drops():
                replies += self._reply(source, code, [], seqs)
            last = source.last_word()
            if last is not None:
                arrived, urgent, rest = last
                replies += self._reply(source, -1, arrived, urgent)
                if rest:
                    replies += self._reply(source, -1, [], rest, keep_order=True)
        return replies

    def sent(self, reply: Reply, routed: bool) -> None:
        """``reply`` went out (``routed``) or ZeroMQ refused it (unroutable or full): keep what it said."""
        source = reply.source
        if not routed:
            self._counters.add("acks_dropped")
        if source is None:
            return
        source.replied(routed)
        if routed:
            if reply.consumed:
                source.told(reply.consumed)
        else:
            given_up = source.unsent(reply.ping, reply.arrived, reply.consumed)
            if given_up:
                self._counters.add("acks_given_up", given_up)

    def expire_sources(self, cutoff: float) -> None:
        """Forget the senders not heard from since ``cutoff``."""
        for sid in [sid for sid, s in self.sources.items() if s.last_heard < cutoff]:
            del self.sources[sid]
            self._dirty.discard(sid)
            self._hail.discard(sid)

    # -- messages ---------------------------------------------------------------------------
    def _source(self, sid: str) -> SourceState:
        source = self.sources.get(sid)
        if source is None:
            if not sid or len(sid) > _MAX_SID:
                raise DecodeError(f"sender id of {len(sid)} characters")
            source = self.sources[sid] = SourceState(sid, self._now)
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
        source = self.sources.get(sid) or self._source(sid)
        self._pending_bytes += size
        if self._admit(source, sid, low, seq):
            item = new_item(Item, (self._decode(parts), size, sid, seq, None, self._now))
            source.accept(seq)
            self.arrivals.append(((from_stage, to_stage, key), item))

    def _on_handle(self, header: list[Any], loc: bytes, extra: int) -> None:
        # Checked before any state changes: a handle from a sender never confirmed on this host is refused.
        sid, seq, low, from_stage, to_stage, key, _ = header
        source = self.sources.get(sid)
        if self._shm is None or source is None or source.shm is not True:
            raise DecodeError("a shared-memory handle from a sender not confirmed on this host")
        if extra:
            raise DecodeError("a shared-memory DATA message must be one frame")
        size = self._shm.size(loc, source.probe)
        if size > self._max_message:
            raise MessageTooLargeError(f"{size} bytes > max_message_bytes {self._max_message}")
        self._pending_bytes += size
        if self._admit(source, sid, low, seq):  # a duplicate handle is never opened: the first one's item holds it
            source.accept(seq)
            self.arrivals.append(((from_stage, to_stage, key), Item(None, size, sid, seq, loc, self._now)))

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

    def _on_batch(self, header: list[Any], payload: memoryview, n_frames: int) -> int:
        """Take in the puts of one BATCH, each validated on its own; how many of them were rejected.

        Raises:
            DecodeError: the batch itself is malformed (nothing of it is taken in).
        """
        if n_frames != 1 or payload.nbytes:
            raise DecodeError("a BATCH message must be one frame holding only its header")
        tagged = len(header) > 4
        tag = header.pop() if tagged else None
        check_types(header, _BATCH_TYPES, "BATCH")
        sid, low, to_stage, entries = header
        count = len(entries)
        if count < 8 or count % 4 or count > 4 * _MAX_BATCH_ENTRIES:
            raise DecodeError(f"BATCH of {count} fields is not 2..{_MAX_BATCH_ENTRIES} puts of 4 fields")
        if tuple(map(type, entries)) != _BATCH_ENTRY * (count // 4):
            raise DecodeError("BATCH entries are not (seq, from_stage, key, wire) of (int, str, str, bytes)")
        if tagged and self._foreign(sid, tag, count // 4):
            return 0
        source = self.sources.get(sid) or self._source(sid)
        source.check_room(count // 4)
        source.note(low, self._now)
        self._dirty.add(sid)
        self._pending += count // 4 - 1
        self.batches += 1
        seqs, from_stages, keys, wires = entries[::4], entries[1::4], entries[2::4], entries[3::4]
        # One decode call per batch; a batch of resends decodes only what is new.
        all_new = source.all_new(seqs)
        if all_new:
            objs: list[Any] = self._decode_each(wires)
        else:
            fresh = [i for i, seq in enumerate(seqs) if source.is_new(seq)]
            objs = [None] * len(seqs)
            for i, obj in zip(fresh, self._decode_each([wires[i] for i in fresh]), strict=True):
                objs[i] = obj
        accepted: list[int] = []
        duplicates: list[int] = []
        seen: set[int] = set()  # a seq repeated inside the batch is taken once
        rejected = 0
        arrivals, now = self.arrivals, self._now
        short_key = self._short_key
        for seq, from_stage, key, wire, obj in zip(seqs, from_stages, keys, wires, objs, strict=True):
            if not all_new and (seq in seen or not source.is_new(seq)):
                duplicates.append(seq)  # already have (or had) it: acknowledge again, keep one copy
                continue
            if isinstance(obj, DecodeError):
                rejected += 1  # not acknowledged: the sender's deadline reports it
                continue
            if len(key) > short_key:
                try:
                    self._check_key(key)
                except DecodeError:
                    rejected += 1  # as a payload that does not decode: not acknowledged
                    continue
            seen.add(seq)
            accepted.append(seq)
            arrivals.append(((from_stage, to_stage, key), new_item(Item, (obj, len(wire), sid, seq, None, now))))
        source.accept_batch(accepted, duplicates)
        if duplicates:
            self._counters.add("duplicates_dropped", len(duplicates))
        return rejected

    def _reply(
        self, source: SourceState, ping: int, arrived: list[int], consumed: list[int], *, keep_order: bool = False
    ) -> list[Reply]:
        """The REPLYs saying ``arrived`` and ``consumed`` to ``source``, answering ``ping`` (:func:`cut_replies`)."""
        return cut_replies(
            source,
            ping,
            arrived,
            consumed,
            incarnation=self.incarnation,
            max_message=self._max_message,
            keep_order=keep_order,
        )
