"""The rules of the chunk streams, without I/O: one request's send and receive streams as state machines.

:class:`Streams` holds every stream of one :class:`~zmq_omni.adapters.OmniChunkManager`
(the save queue, the streams each way, who owns which key, which ids ended) the way
h11's ``_state.py`` holds a connection's: explicit phases and the transitions
between them. It has no thread, lock, connector or clock: the caller passes the
time in, serializes the calls (the manager holds its lock) and performs the I/O a
transition answers with, an :class:`Effects`, after releasing its lock.

A send stream (this stage streams a request downstream)::

    OPEN --save(final)--> ENDING --final chunk put--> ENDED
    OPEN --cancel--> CANCELLING (its cancelled end-of-stream marker queued) --marker put--> ENDED
    OPEN --cancel(notify_downstream=False)--> CANCELLED
    any  --a put gave up / a chunk refused--> FAILED
    OPEN --idle for idle_state_timeout_s--> CANCELLING, reported as abandoned
    not OPEN --idle for idle_state_timeout_s, or release--> ENDED

A cancel in ENDING leaves the final chunk and the chunks before it to go through.
ENDED streams are forgotten; their ids stay used (a second stream under one is refused).

A receive stream (this stage reads a request from upstream)::

    READING --at max_ready_chunks / max_ready_bytes--> PAUSED --inputs taken--> READING
    READING --final chunk--> ENDED --final inputs taken--> forgotten
    READING --stall, bad chunk, cancel, release--> forgotten; the connector is told to give the stream up
    ENDED --untaken for idle_state_timeout_s--> forgotten

A PAUSED stream's stall clock stops: on resuming, its last progress moves on by the pause.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import format_seconds
from ._assemble import payload_nbytes
from ._chunk_config import ChunkManagerConfig
from ._stream_types import (
    NO_EFFECTS,
    PROGRESS,
    RESUME,
    STOPPED,
    Effects,
    RecvPhase,
    RecvStream,
    SaveItem,
    SendPhase,
    SendStream,
    Taken,
    Waiter,
)

__all__ = [
    "NO_EFFECTS",
    "REMEMBERED",
    "Effects",
    "RecvPhase",
    "RecvStream",
    "SaveItem",
    "SendPhase",
    "SendStream",
    "Streams",
    "Taken",
    "Waiter",
]

#: How many finished requests are remembered (to attribute late failures and to
#: refuse a second stream under a used id); older ones are forgotten.
REMEMBERED = 65_536

_DIGITS = "0123456789"


def _remember(book: OrderedDict[str, Any], key: str, value: Any) -> None:
    book[key] = value
    book.move_to_end(key)
    while len(book) > REMEMBERED:
        book.popitem(last=False)


class Streams:
    """Every chunk stream of one manager, and the rules that move them (see the module docstring).

    Not thread-safe: the owner serializes every call. ``now`` is ``time.monotonic()``
    (any clock that only moves forward).

    Attributes:
        queue: the chunks waiting for the save worker, in send order.
        in_flight: the item the save worker took and has not finished.
        ready_bytes: payload bytes received for all streams and not taken yet.
    """

    def __init__(self, config: ChunkManagerConfig, now: float) -> None:
        self.config = config
        self.queue: deque[SaveItem] = deque()
        self.in_flight: SaveItem | None = None
        self.ready_bytes = 0
        self._send: dict[str, SendStream] = {}
        self._recv: dict[str, RecvStream] = {}
        # key prefix -> request id, for failures reported by key (bounded, least recently used first).
        self._send_owner: OrderedDict[str, str] = OrderedDict()
        self._recv_owner: OrderedDict[str, str] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._rotation = 0
        self._last_sweep = now

    # -- reads ---------------------------------------------------------------------------------
    def send_phase(self, request_id: str) -> SendPhase | None:
        """The phase of ``request_id``'s send stream (ENDED for a used id), None when it has none."""
        stream = self._send.get(request_id)
        if stream is not None:
            return stream.phase
        return SendPhase.ENDED if request_id in self._ended else None

    def receiving(self, request_id: str) -> RecvStream | None:
        """The receive stream of ``request_id``, None when it has none."""
        return self._recv.get(request_id)

    def is_ready(self, request_id: str) -> bool:
        """True unless ``request_id`` is receiving and has no new chunk yet."""
        stream = self._recv.get(request_id)
        return stream is None or bool(stream.ready) or stream.phase is RecvPhase.ENDED

    def waiting_for_chunks(self, request_ids: Iterable[str]) -> set[str]:
        """The ids among ``request_ids`` receiving a stream that has no new chunk yet."""
        recv, ended = self._recv, RecvPhase.ENDED
        return {rid for rid in request_ids if (s := recv.get(rid)) is not None and not s.ready and s.phase is not ended}

    def refusal(self, request_id: str) -> str | None:
        """Why a stream of ``request_id`` could not start here, or None."""
        if request_id in self._ended:
            return f"request {request_id!r} already ended its stream"
        stream = self._send.get(request_id)
        if stream is not None and stream.phase in (SendPhase.ENDING, SendPhase.CANCELLING):
            return f"request {request_id!r} is ending its stream"
        return None

    def owner(self, key: str, op: str) -> str | None:
        """The request a put (``op="put"``) or get key belongs to, None when unknown."""
        book = self._send_owner if op == "put" else self._recv_owner
        return book.get(key.rstrip(_DIGITS))

    def sizes(self) -> dict[str, int]:
        """How many streams each way, and how many chunks are queued."""
        return {"sending": len(self._send), "receiving": len(self._recv), "queued": len(self.queue)}

    def ready_chunks(self) -> int:
        """Chunks received for all streams and not taken yet."""
        return sum(len(stream.ready) for stream in self._recv.values())

    def at_bound(self, stream: RecvStream) -> bool:
        """True while ``stream`` must not be read: it holds untaken chunks and a ready bound is reached.

        A stream with no untaken chunk is never at a bound, so every request can progress.
        """
        return (
            bool(stream.ready)
            and stream.all_chunks is None
            and (len(stream.ready) >= self.config.max_ready_chunks or self.ready_bytes >= self.config.max_ready_bytes)
        )

    def has_readable(self) -> bool:
        """True while some stream waits for a chunk and may be read."""
        return any(s.phase is not RecvPhase.ENDED and not self.at_bound(s) for s in self._recv.values())

    # -- send side -------------------------------------------------------------------------------
    def open_send(self, request_id: str, external_req_id: str | None, now: float) -> SendStream | None:
        """The send stream a new chunk of ``request_id`` goes to; None when it stopped (cancelled or failed).

        Raises:
            ValueError: the id already ended its stream, or its final chunk is queued.
        """
        stream = self._send.get(request_id)
        if stream is None:
            if request_id in self._ended:
                raise ValueError(f"request {request_id!r} already ended its stream")
            prefix = f"{external_req_id or request_id}_{self.config.stage_id}_"
            stream = self._send[request_id] = SendStream(request_id, prefix, now)
            _remember(self._send_owner, prefix, request_id)
        if stream.phase in STOPPED:
            return None
        if stream.phase is not SendPhase.OPEN:
            raise ValueError(f"request {request_id!r}: chunk after the final one")
        return stream

    def queue_full(self) -> bool:
        """True while the save queue holds ``max_queued_chunks``."""
        return len(self.queue) >= self.config.max_queued_chunks

    def may_wait(self, stream: SendStream) -> bool:
        """True while a save of ``stream`` may go on waiting for room (it was not stopped or forgotten)."""
        return stream.phase not in STOPPED and self._send.get(stream.request_id) is stream

    def queue_chunk(
        self, stream: SendStream, data: Mapping[str, Any], final: bool, done: Waiter | None, now: float
    ) -> SaveItem:
        """Queue the next chunk of ``stream`` (OPEN -> ENDING with the final one); the caller wakes the saver."""
        item = SaveItem(stream.request_id, f"{stream.prefix}{stream.next_chunk_id}", stream.next_chunk_id, data, final)
        item.done = done
        stream.next_chunk_id += 1
        stream.last_activity = now
        if final:
            stream.phase = SendPhase.ENDING
        self.queue.append(item)
        return item

    def refuse(self, stream: SendStream, reason: str) -> Effects:
        """A chunk of ``stream`` found no room in time: the stream cannot go on with a hole (-> FAILED)."""
        if stream.phase in STOPPED:
            return NO_EFFECTS
        return Effects(send_failures=((stream.request_id, reason),)) | self.send_failed(stream.request_id)

    def send_failed(self, request_id: str) -> Effects:
        """A put of ``request_id`` gave up (-> FAILED): its queued chunks are dropped."""
        stream = self._send.get(request_id)
        if stream is None:
            return NO_EFFECTS
        stream.phase = SendPhase.FAILED
        return Effects(released=tuple(self._drop_queued(request_id)), room=True)

    def next_item(self) -> SaveItem | None:
        """Pop the next chunk to put; it is in flight until :meth:`put_done`."""
        if not self.queue:
            return None
        item = self.in_flight = self.queue.popleft()
        return item

    def begin_put(self, item: SaveItem) -> bool:
        """True when ``item`` should be put (its stream neither failed nor was forgotten)."""
        stream = self._send.get(item.request_id)
        return stream is not None and stream.phase is not SendPhase.FAILED

    def put_done(self, item: SaveItem, ok: bool, now: float) -> bool:
        """``item`` left the save worker (put or not); True when it ended its stream (-> ENDED)."""
        if self.in_flight is item:
            self.in_flight = None
        stream = self._send.get(item.request_id)
        if stream is not None:
            stream.last_activity = now
        if not (ok and item.final):
            return False
        if stream is not None:
            del self._send[item.request_id]
        _remember(self._ended, item.request_id, None)
        return True

    def drain(self) -> list[SaveItem]:
        """Remove and return every queued item (shutdown)."""
        items, self.queue = list(self.queue), deque()
        return items

    def _drop_queued(self, request_id: str) -> list[SaveItem]:
        dropped = [item for item in self.queue if item.request_id == request_id]
        if dropped:
            self.queue = deque(item for item in self.queue if item.request_id != request_id)
        return dropped

    # -- both sides -------------------------------------------------------------------------------
    def cancel(self, request_id: str, notify_downstream: bool | None, now: float) -> Effects:
        """Abort ``request_id`` both ways (see ``OmniChunkManager.cancel``).

        Send side: OPEN -> CANCELLING (its queued chunks dropped, a cancelled
        end-of-stream marker queued in their place) or, with
        ``notify_downstream=False``, -> CANCELLED. ENDING is left as it is: the
        final chunk already queued goes through. Receive side: the stream is
        forgotten and the connector told to give it up.
        """
        stream = self._send.get(request_id)
        downstream = self.config.downstream_stage_id
        if stream is None and notify_downstream and downstream is not None and request_id not in self._ended:
            # A middle stage forwarding an upstream cancellation: its key prefix follows the upstream's.
            ext = request_id
            recv = self._recv.get(request_id)
            if recv is not None:
                ext = recv.prefix[: -len(f"_{self.config.upstream_stage_id}_")]
            stream = self._send[request_id] = SendStream(request_id, f"{ext}_{self.config.stage_id}_", now)
            _remember(self._send_owner, stream.prefix, request_id)
        effects = NO_EFFECTS
        if stream is not None and stream.phase is SendPhase.OPEN:
            dropped = self._drop_queued(request_id)
            if dropped:
                stream.next_chunk_id = min(item.chunk_id for item in dropped)
            queued = notify_downstream is not False
            if queued:
                marker = SaveItem(request_id, f"{stream.prefix}{stream.next_chunk_id}", stream.next_chunk_id, {}, True)
                marker.cancelled = True
                stream.next_chunk_id += 1
                self.queue.append(marker)
            stream.phase = SendPhase.CANCELLING if queued else SendPhase.CANCELLED
            effects = Effects(released=tuple(dropped), room=True, queued=queued)
        return effects | self._give_up_receiving(request_id)

    def release(self, request_id: str, now: float) -> Effects:
        """Forget a finished request (idempotent); one still streaming is cancelled first."""
        stream = self._send.get(request_id)
        effects = NO_EFFECTS
        if (stream is not None and stream.phase in (SendPhase.OPEN, SendPhase.CANCELLED)) or request_id in self._recv:
            effects = self.cancel(request_id, None, now)
        stream = self._send.get(request_id)
        if stream is not None and (
            stream.phase is SendPhase.FAILED or not any(item.request_id == request_id for item in self.queue)
        ):
            del self._send[request_id]
            _remember(self._ended, request_id, None)
        return effects

    def sweep_due(self, now: float) -> bool:
        """True when an idle sweep is due: a few times per ``idle_state_timeout_s``, at most once a second."""
        return now - self._last_sweep >= min(1.0, self.config.idle_state_timeout_s / 4)

    def sweep(self, now: float) -> Effects:
        """Forget the state of requests idle for ``idle_state_timeout_s`` (see ``ChunkManagerConfig``).

        An OPEN send stream with nothing queued or in flight is cancelled
        (downstream gets a cancelled end of stream) and reported as abandoned;
        any other idle send stream -> ENDED. A request still receiving is left
        alone (its stall timeout bounds it). An ENDED receive stream whose
        inputs were never taken is forgotten.
        """
        self._last_sweep = now
        ttl = self.config.idle_state_timeout_s
        busy = {item.request_id for item in self.queue}
        if self.in_flight is not None:
            busy.add(self.in_flight.request_id)
        expired: list[str] = []
        abandoned: list[str] = []
        for request_id, stream in list(self._send.items()):
            recv = self._recv.get(request_id)
            if (
                request_id in busy
                or now - stream.last_activity < ttl
                or (recv is not None and recv.phase is not RecvPhase.ENDED)
            ):
                continue
            if stream.phase is SendPhase.OPEN:
                abandoned.append(request_id)
            else:
                del self._send[request_id]
                _remember(self._ended, request_id, None)
                expired.append(request_id)
        untaken: list[str] = []
        resume = False
        for request_id, recv in list(self._recv.items()):
            if recv.phase is RecvPhase.ENDED and recv.all_chunks is None and now - recv.last_progress >= ttl:
                resume = self._forget_receiving(request_id) or resume
                untaken.append(request_id)
        effects = Effects(expired=(*expired, *untaken), expired_received=tuple(untaken), resume=resume)
        reason = f"abandoned: no chunk queued for {ttl:g}s (idle_state_timeout_s); stream cancelled"
        for request_id in abandoned:
            effects = effects | self.cancel(request_id, True, now) | Effects(abandoned=((request_id, reason),))
        return effects if (expired or untaken or abandoned) else NO_EFFECTS

    # -- receive side -----------------------------------------------------------------------------
    def open_receive(self, request_id: str, external_req_id: str | None, whole: bool, now: float) -> Effects:
        """Start (or find) the receive stream of ``request_id``; ``whole`` keeps every chunk for ``load()``.

        A whole stream's chunks do not count against ``max_ready_bytes`` (``load()`` returns them at once).
        """
        stream = self._recv.get(request_id)
        resume = False
        if stream is None:
            prefix = f"{external_req_id or request_id}_{self.config.upstream_stage_id}_"
            stream = self._recv[request_id] = RecvStream(request_id, prefix, now)
            _remember(self._recv_owner, prefix, request_id)
            resume = True
        if whole and stream.all_chunks is None:
            stream.all_chunks = list(stream.ready)
            self.ready_bytes -= stream.ready_bytes
            stream.ready_bytes = 0
            resume = True
        return RESUME if resume else NO_EFFECTS

    def readable(self, now: float) -> list[RecvStream]:
        """The streams the receive worker may read now; moves each between READING and PAUSED.

        A stream at a bound pauses; one that left it reads on, its stall clock
        moved on by the pause (only time spent waiting for the upstream counts).
        """
        readable: list[RecvStream] = []
        for stream in self._recv.values():
            if stream.phase is RecvPhase.ENDED:
                continue
            if self.at_bound(stream):
                if stream.phase is RecvPhase.READING:
                    stream.phase, stream.paused_at = RecvPhase.PAUSED, now
                continue
            if stream.phase is RecvPhase.PAUSED:
                assert stream.paused_at is not None
                stream.last_progress += now - stream.paused_at
                stream.phase, stream.paused_at = RecvPhase.READING, None
            readable.append(stream)
        return readable

    def scan(self, now: float) -> tuple[list[RecvStream], Effects]:
        """The receive worker's pass: the readable streams, and the failures of those stalled."""
        readable: list[RecvStream] = []
        effects = NO_EFFECTS
        limit = self.config.stall_timeout_s
        for stream in self.readable(now):
            if now - stream.last_progress > limit:
                effects = effects | self.fail_receiving(
                    stream,
                    f"stalled: no chunk from stage {self.config.upstream_stage_id} for {format_seconds(limit)} "
                    f"(waiting for chunk {stream.next_chunk_id})",
                )
            else:
                readable.append(stream)
        return readable, effects

    def next_target(self, now: float) -> str | None:
        """The key the receive worker blocks on after a pass without progress (round robin)."""
        readable = self.readable(now)
        if not readable:
            return None
        self._rotation = (self._rotation + 1) % len(readable)
        return readable[self._rotation].next_key

    def commit(self, key: str, obj: Any, now: float, stream: RecvStream | None = None) -> tuple[bool, Effects]:
        """Apply the object got under ``key``; ``(read on, effects)``.

        A chunk for a stream forgotten or ENDED meanwhile, or not the one it
        waits for, is dropped. A chunk not of this stream fails it. The final
        chunk: READING -> ENDED, and what a retried put left is cleaned up.
        """
        if stream is None:
            request_id = self._recv_owner.get(key.rstrip(_DIGITS))
            stream = self._recv.get(request_id) if request_id is not None else None
        if stream is None or self._recv.get(stream.request_id) is not stream or stream.phase is RecvPhase.ENDED:
            return False, NO_EFFECTS
        if key != stream.next_key:
            return False, NO_EFFECTS
        meta = obj.get("meta") if isinstance(obj, Mapping) else None
        data = obj.get("data") if isinstance(obj, Mapping) else None
        if (
            not isinstance(meta, Mapping)
            or not isinstance(data, Mapping)
            or meta.get("chunk_id") != stream.next_chunk_id
        ):
            return False, self.fail_receiving(stream, f"bad chunk under {key!r}: not a chunk of this stream")
        stream.next_chunk_id += 1
        stream.last_progress = now
        final = bool(meta.get("final"))
        if data or final:
            if not stream.ready:
                stream.first_ready_id = stream.next_chunk_id - 1
            stream.ready.append(data)
            if stream.all_chunks is not None:
                stream.all_chunks.append(data)
            else:
                nbytes = payload_nbytes(data)
                stream.ready_bytes += nbytes
                self.ready_bytes += nbytes
        if not final:
            return True, PROGRESS
        stream.phase = RecvPhase.ENDED
        stream.cancelled_upstream = bool(meta.get("cancelled"))
        loaded = (stream.request_id,) if stream.all_chunks is None else ()
        return False, Effects(cleanup=(stream.prefix,), finished_loaded=loaded, changed=True)

    def after_get(self, key: str) -> Effects:
        """After every get of ``key``: bury its stream again when it was given up while the get ran.

        A get may lift the connector's tombstones covering its key (someone wants
        it again). A cancel, release or failure that gave the stream up between
        the worker choosing the key and its get returning laid them first.
        """
        prefix = key.rstrip(_DIGITS)
        request_id = self._recv_owner.get(prefix)
        stream = self._recv.get(request_id) if request_id is not None else None
        if stream is not None and stream.prefix == prefix:
            return NO_EFFECTS  # still receiving (or ended normally: its final chunk's cleanup buried it)
        return Effects(give_up=((key, prefix),))

    def take(self, request_id: str) -> tuple[Taken | None, bool]:
        """``(the chunks received since the last take or None, wake the receive worker)``.

        Taking frees room: a stream paused at a bound (this one, or any at the
        byte bound) reads on. After the final inputs the stream is forgotten.
        """
        stream = self._recv.get(request_id)
        if stream is None or not (stream.ready or stream.phase is RecvPhase.ENDED):
            return None, False
        chunks, stream.ready = stream.ready, []
        resume = stream.phase is RecvPhase.PAUSED or self.ready_bytes >= self.config.max_ready_bytes
        self.ready_bytes -= stream.ready_bytes
        stream.ready_bytes = 0
        final = stream.phase is RecvPhase.ENDED
        if final:
            del self._recv[request_id]
        return Taken(chunks, stream.first_ready_id, final, stream.cancelled_upstream), resume

    def take_whole(self, request_id: str, stream: RecvStream) -> Taken | None:
        """The whole stream ``load()`` waited for, once ENDED (then forgotten); None when it was given up."""
        if self._recv.get(request_id) is not stream or stream.phase is not RecvPhase.ENDED:
            return None
        self._forget_receiving(request_id)
        return Taken(stream.all_chunks or [], 0, True, stream.cancelled_upstream)

    def fail_receiving(self, stream: RecvStream, reason: str) -> Effects:
        """``stream`` will never complete (stall, bad chunk, load timeout): forget it, report it, give it up."""
        if self._recv.get(stream.request_id) is not stream:
            return NO_EFFECTS
        return Effects(receive_failures=((stream.request_id, reason),)) | self._give_up_receiving(stream.request_id)

    def _give_up_receiving(self, request_id: str) -> Effects:
        stream = self._recv.get(request_id)
        if stream is None:
            return NO_EFFECTS
        resume = self._forget_receiving(request_id)
        return Effects(give_up=((stream.next_key, stream.prefix),), resume=resume, changed=True)

    def _forget_receiving(self, request_id: str) -> bool:
        """Drop a receive stream and its untaken bytes; True when that frees room at the byte bound."""
        stream = self._recv.pop(request_id, None)
        if stream is None or not stream.ready_bytes:
            return False
        at_bound = self.ready_bytes >= self.config.max_ready_bytes
        self.ready_bytes -= stream.ready_bytes
        stream.ready_bytes = 0
        return at_bound
