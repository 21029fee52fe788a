"""Push mode, sending half: when small puts ride together in one BATCH message (pure policy, no I/O).

A put of one small frame that finds its peer busy (a send in progress, or a
stream of puts on) waits in the peer's :class:`Outbox` and leaves with the
next BATCH; a lone put goes at once. The sender's lock (``SenderCore.lock``) guards every field
of an :class:`Outbox` except ``retry_s``, which only the holder of the peer's
``data_lock`` touches. Nothing here reads a clock (``now`` is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence

from ._push_protocol import _BATCH_OVERHEAD
from ._send_window import Out

__all__ = ["LONE_GAP_S", "RETRY_MAX_S", "RETRY_MIN_S", "STREAM_FLUSH_S", "Outbox", "batch_end"]

RETRY_MIN_S = 0.001  # a batch refused at the high-water mark is retried after this, doubling...
RETRY_MAX_S = 0.05  # ...up to this
# A flush that found puts queued keeps the peer busy this much longer (a stream is on): puts ride in batches
# without waking the I/O thread, whose next turn flushes them.
STREAM_FLUSH_S = 0.0002
# A lone put sent by its own thread keeps the peer busy only this long: a put loop (one put every
# 10-20 us) still forms a stream that rides in batches, while one message in flight at a time (a
# round trip apart, >= 50 us even for raw ZeroMQ) always goes at once from the put thread, never
# through the I/O thread.
LONE_GAP_S = 0.00003


def entry_cost(out: Out) -> int:
    """What one put adds to the outbox's byte count (its payload plus its key and a header's worth)."""
    return out.nbytes + len(out.key) + 16


def batch_end(outs: Sequence[Out], start: int, batch_bytes: int, to_stage: str, max_messages: int) -> int:
    """End of the longest run of ``outs`` from ``start`` that fits one BATCH of ``batch_bytes`` (at least one put)."""
    # Costs bound the packed size from above: 4 bytes per character, 24 for msgpack's type headers.
    budget = batch_bytes - _BATCH_OVERHEAD - 4 * len(to_stage)
    end = min(len(outs), start + max_messages)
    size = 0
    i = start
    while i < end:
        out = outs[i]
        size += out.nbytes + 4 * (len(out.key) + len(out.from_stage)) + 24
        if size > budget and i > start:
            break
        i += 1
    return i


class Outbox:
    """Small puts of one peer waiting for a BATCH, and the state that decides when it leaves."""

    __slots__ = ("blocked", "busy_until", "flush_armed", "items", "nbytes", "retry_s")

    def __init__(self) -> None:
        self.items: list[Out] = []
        self.nbytes = 0
        self.busy_until = 0.0  # a small put before this time rides in the next batch instead of going at once
        self.flush_armed = False  # a flush is scheduled on the I/O thread: new small puts ride with it
        self.blocked = False  # the last flush met the high-water mark; the I/O thread retries
        self.retry_s = RETRY_MIN_S  # the next retry's delay while blocked (data_lock holder only)

    def add(self, out: Out, now: float, max_messages: int, batch_bytes: int) -> bool:
        """Queue ``out``; True when the outbox should leave now (by the put's own thread, if the socket is free).

        It leaves at once when the peer is idle (no added latency), or when it is
        full; never while blocked.
        """
        out.queued = True
        items = self.items
        items.append(out)
        self.nbytes += entry_cost(out)
        return not self.blocked and (
            (len(items) == 1 and now >= self.busy_until) or len(items) >= max_messages or self.nbytes >= batch_bytes
        )

    def take(self, batch_bytes: int, to_stage: str, max_messages: int) -> list[Out]:
        """Remove the next batch, skipping puts that left the window meanwhile (no longer ``queued``)."""
        items = self.items
        # One put is a batch of its own whatever its size (a lone put's case): nothing to measure.
        end = len(items) if len(items) < 2 else batch_end(items, 0, batch_bytes, to_stage, max_messages)
        if end == len(items):
            self.items = []
            self.nbytes = 0
            taken = items
        else:
            taken = items[:end]
            del items[:end]
            self.nbytes = max(0, self.nbytes - sum(map(entry_cost, taken)))
        live = []
        for out in taken:
            if out.queued:
                out.queued = False
                live.append(out)
        return live

    def requeue(self, outs: list[Out]) -> None:
        """Put back in front (their order) puts whose send failed."""
        for out in outs:
            out.queued = True
        self.items[:0] = outs
        self.nbytes += sum(map(entry_cost, outs))
