"""The rules of the chunk streams, without I/O: one request's send and receive streams as state machines.

:class:`Streams` holds every stream of one :class:`~zmq_omni.adapters.OmniChunkManager`
(the save queue, the streams each way, who owns which key, which ids ended) the way
h11's ``_state.py`` holds a connection's: explicit phases and the transitions
between them. It has no thread, lock, connector or clock: the caller passes the
time in, serializes the calls (the manager holds its lock) and performs the I/O a
transition answers with, an :class:`Effects`, after releasing its lock.

The phases and their transitions are drawn on :class:`SendPhase` (a send stream: this
stage streams a request downstream) and :class:`RecvPhase` (a receive stream: this
stage reads a request from upstream).

A stream given up or ended leaves a clean-up of its key prefix for the shell to do (``Effects.give_up``
/ ``cleanup``), in flight until the shell reports it with :meth:`Streams.cleaned`. A reused id reopens a
receive stream under the same prefix, so :meth:`Streams.open_receive` defers it until then, and while
the receive worker may still get the old stream's keys (its pass, its blocking get): neither can take
the chunks of a stream opened after them (same keys).
"""

from __future__ import annotations

from collections import OrderedDict
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
    CleanUps,
    Effects,
    RecvPhase,
    RecvStream,
    SaveItem,
    SaveQueue,
    SendPhase,
    SendStream,
    Taken,
    Waiter,
    remember,
)

__all__ = ["Streams"]

_DIGITS = "0123456789"


class Streams:
    """Every chunk stream of one manager, and the rules that move them (see the module docstring).

    Not thread-safe: the owner serializes every call. ``now`` is ``time.monotonic()``
    (any clock that only moves forward).

    Attributes:
        queue: the chunks waiting for the save worker, in send order, and the one it took
            (``queue.take_next()``; in flight until :meth:`put_done`).
        ready_bytes: payload bytes received for all streams and not taken yet.
    """

    def __init__(self, config: ChunkManagerConfig, now: float) -> None:
        self.config = config
        self.queue = SaveQueue()
        self.ready_bytes = 0
        self._send: dict[str, SendStream] = {}
        self._recv: dict[str, RecvStream] = {}
        # key prefix -> request id, for failures reported by key (bounded, least recently used first).
        self._send_owner: OrderedDict[str, str] = OrderedDict()
        self._recv_owner: OrderedDict[str, str] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._cleaning = CleanUps()
        self._passing: list[RecvStream] = []  # the streams of the receive worker's pass (scan to end_pass)
        self._getting: str | None = None  # the key prefix of its blocking get (next_target to after_get)
        self._rotation = 0
        self._last_sweep = now

    # -- reads ---------------------------------------------------------------------------------
    def cleaning(self, prefix: str) -> bool:
        """True while a clean-up of ``prefix`` was decided and the shell has not reported it done."""
        return prefix in self._cleaning

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
            remember(self._send_owner, prefix, request_id)
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
        item = stream.next_item(data, final)
        item.done = done
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
        return Effects(released=tuple(self.queue.drop(request_id)), room=True)

    def begin_put(self, item: SaveItem) -> bool:
        """True when ``item`` should be put (its stream neither failed nor was forgotten)."""
        stream = self._send.get(item.request_id)
        return stream is not None and stream.phase is not SendPhase.FAILED

    def put_done(self, item: SaveItem, ok: bool, now: float) -> bool:
        """``item`` left the save worker (put or not); True when it ended its stream (-> ENDED)."""
        if self.queue.in_flight is item:
            self.queue.in_flight = None
        stream = self._send.get(item.request_id)
        if stream is not None:
            stream.last_activity = now
        if not (ok and item.final):
            return False
        if stream is not None:
            del self._send[item.request_id]
        remember(self._ended, item.request_id, None)
        return True

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
            remember(self._send_owner, stream.prefix, request_id)
        effects = NO_EFFECTS
        if stream is not None and stream.phase is SendPhase.OPEN:
            dropped = self.queue.drop(request_id)
            if dropped:
                stream.next_chunk_id = min(item.chunk_id for item in dropped)
            queued = notify_downstream is not False
            if queued:
                marker = stream.next_item({}, True)
                marker.cancelled = True
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
            remember(self._ended, request_id, None)
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
        busy = self.queue.busy()
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
                remember(self._ended, request_id, None)
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
    def open_receive(self, request_id: str, external_req_id: str | None, whole: bool, now: float) -> Effects | None:
        """Start (or find) the receive stream of ``request_id``; ``whole`` keeps every chunk for ``load()``.

        A whole stream's chunks do not count against ``max_ready_bytes`` (``load()`` returns them at once).
        None, and nothing started, while a clean-up of the new stream's key prefix is in flight:
        ask again once :meth:`cleaned` frees it.
        """
        stream = self._recv.get(request_id)
        resume = False
        if stream is None:
            prefix = f"{external_req_id or request_id}_{self.config.upstream_stage_id}_"
            if prefix in self._recv_owner and (  # a reused prefix: its old stream's keys may still be in use
                prefix in self._cleaning or prefix == self._getting or any(s.prefix == prefix for s in self._passing)
            ):
                return None
            stream = self._recv[request_id] = RecvStream(request_id, prefix, now)
            remember(self._recv_owner, prefix, request_id)
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
        """The receive worker's pass: the streams to read (until :meth:`end_pass`), the failures of those stalled."""
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
        self._passing = readable
        return readable, effects

    def end_pass(self) -> None:
        """The receive worker's pass is over: its streams' keys are free for a reused id."""
        self._passing = []

    def next_target(self, now: float) -> str | None:
        """The key the receive worker blocks on after a pass without progress (round robin)."""
        readable = self.readable(now)
        if not readable:
            return None
        self._rotation = (self._rotation + 1) % len(readable)
        stream = readable[self._rotation]
        self._getting = stream.prefix  # until after_get
        return stream.next_key

    def reads_on(self, stream: RecvStream) -> bool:
        """True while the receive worker may get ``stream``'s next key: not forgotten, ENDED nor at a bound."""
        live = self._recv.get(stream.request_id) is stream
        return live and stream.phase is not RecvPhase.ENDED and not self.at_bound(stream)

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
        return False, self._cleaning.begin(Effects(cleanup=(stream.prefix,), finished_loaded=loaded, changed=True))

    def after_get(self, key: str) -> Effects:
        """After every get of ``key``: bury its stream again when it was given up while the get ran.

        A get may lift the connector's tombstones covering its key (someone wants
        it again). A cancel, release or failure that gave the stream up between
        the worker choosing the key and its get returning laid them first.
        """
        prefix = key.rstrip(_DIGITS)
        self._getting = None
        request_id = self._recv_owner.get(prefix)
        stream = self._recv.get(request_id) if request_id is not None else None
        if stream is not None and stream.prefix == prefix:
            return NO_EFFECTS  # still receiving (or ended normally: its final chunk's cleanup buried it)
        return self._cleaning.begin(Effects(give_up=((key, prefix),)))

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
        return self._cleaning.begin(Effects(give_up=((stream.next_key, stream.prefix),), resume=resume, changed=True))

    def cleaned(self, effects: Effects) -> bool:
        """The shell did (or gave up) the clean-ups of ``effects``; True when a stream may open under a prefix again."""
        return self._cleaning.done(effects)

    def _forget_receiving(self, request_id: str) -> bool:
        """Drop a receive stream and its untaken bytes; True when that frees room at the byte bound."""
        stream = self._recv.pop(request_id, None)
        if stream is None or not stream.ready_bytes:
            return False
        at_bound = self.ready_bytes >= self.config.max_ready_bytes
        self.ready_bytes -= stream.ready_bytes
        stream.ready_bytes = 0
        return at_bound
