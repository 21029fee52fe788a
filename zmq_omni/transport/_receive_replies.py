"""Push mode, receiving half: what a REPLY tells a sender, and how long lists are cut into several.

A :class:`Reply` is one frame for the driver to route to a sender (its ``identity``),
keeping what it says in case ZeroMQ cannot route it (the protocol then remembers it
untold: :meth:`~zmq_omni.transport._receive_protocol.ReceiveProtocol.sent`).
:func:`cut_replies` builds the REPLYs that say a list of arrivals and consumptions:
pure, no I/O, no state of its own. The wire layout of a REPLY is in
:mod:`~zmq_omni.transport._push_protocol`.
"""

from __future__ import annotations

from typing import NamedTuple

from ._dedupe import SourceState
from ._envelope import Kind, pack, to_ranges

__all__ = ["MAX_REPLY_SEQS", "Reply", "cut_replies"]

#: Most seqs per list in one REPLY: a sender refuses a list naming more than 4 * max_unacked + 1024 (a pong
#: names the consumptions not yet told, at most MAX_PONG_RECENT told once and MAX_PONG_REPEATS twice:
#: several REPLYs).
MAX_REPLY_SEQS = 1024


class Reply(NamedTuple):
    """A frame to route to ``identity``; what it says is kept in case ZeroMQ cannot route it."""

    identity: bytes
    frame: bytes
    source: SourceState | None  # None: a HEALTH answer (nothing to remember)
    ping: int  # the PING answered; -1 a plain ack; DROPPED_* a drop report
    arrived: list[int]
    consumed: list[int]


def cut_replies(
    source: SourceState,
    ping: int,
    arrived: list[int],
    consumed: list[int],
    *,
    incarnation: str,
    max_message: int,
    keep_order: bool = False,
) -> list[Reply]:
    """The REPLYs saying ``arrived`` and ``consumed`` to ``source``, answering ``ping``.

    Lists longer than :data:`MAX_REPLY_SEQS` go in several REPLYs, plain acks first and the
    answer to ``ping`` last, so that no REPLY exceeds what any sender accepts. The lists
    are sorted once (``keep_order``: not sorted, the caller's order kept and its seqs
    distinct) and cut at fixed offsets: the cost is linear in the seqs they hold (plus
    the sort), however many parts they make. ``incarnation`` and ``max_message`` are the
    receiver's, told in every REPLY.
    """
    cap = MAX_REPLY_SEQS
    parts: list[tuple[int, list[int], list[int]]]
    if len(arrived) > cap or len(consumed) > cap:
        if not keep_order:
            arrived, consumed = sorted(set(arrived)), sorted(set(consumed))
        count = max(-(-len(arrived) // cap), -(-len(consumed) // cap), 1)
        ack = min(ping, -1)  # a pong's earlier parts are plain acks; a drop report's keep its code
        parts = [
            (ack if i < count - 1 else ping, arrived[i * cap : (i + 1) * cap], consumed[i * cap : (i + 1) * cap])
            for i in range(count)
        ]
    else:
        parts = [(ping, arrived, consumed)]
    return [
        Reply(
            source.ctl,
            pack(Kind.REPLY, (incarnation, code, to_ranges(arr), to_ranges(con), source.shm, max_message)),
            source,
            code,
            arr,
            con,
        )
        for code, arr, con in parts
    ]
