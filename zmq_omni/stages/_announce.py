"""The announcements that tell a stage which requests its upstream sends, and the loop that reads them.

How a downstream stage learns about a new request:
    chunk keys are ``{request_id}_{stage_id}_{n}`` (the chunk manager's keys),
    so a receiver must know a request id before it can read its chunks. For
    every new request a worker therefore also puts a small *announcement*
    ``{"request_id": ...}`` under ``_zo_req_{stage_id}_{seq}`` (``seq`` = 0, 1,
    2, ... per sending process); the downstream stage reads announcements in
    order and registers each request with ``load_async``. Announcements are
    read with a look-ahead window, so one lost announcement does not block the
    ones behind it, and a restarted upstream (whose ``seq`` starts again at 0)
    is picked up. After every announcement (before the request's chunks) the
    sender also puts its ``seq`` under ``_zo_req_{stage_id}_head`` (one
    attempt; a re-put replaces an unconsumed one, so it holds one window slot
    at most; one that failed is put again after the next announcement or after
    a second idle): a receiver that finds nothing at its next ``seq`` while the
    head is at or past it reads what is left up to the head and goes on after
    it, so a receiver that (re)started after its upstream announced many
    requests (a second ``zmq-omni drive`` against running stages, a restarted
    stage), or a gap of lost announcements wider than the look-ahead, costs a
    wait for the next head, not the requests after it. A receiver still does
    not learn about requests announced before it came back: restart a
    pipeline from its last stage.

Refusals travel as announcements too:
    a stage that cannot serve an announced request (its id was already used:
    the stream under it ended, or it is in flight) announces
    ``{"request_id": ..., "error": reason}`` instead of streaming it; every
    stage after it forwards such an announcement at once, so the driver fails
    the request with the real reason within a few hops' latency. Announcement
    keys are fresh per announcement, so a reused request id cannot block them.

This module owns the key scheme and the reading side: :func:`read_announcements`
is the body of a stage's admitter thread (``<label>-admit-<stage id>``, started
by :class:`~zmq_omni.stages._link._Endpoint`), the only thread that gets
announcement keys from the inbound connector. The writing side (the announcer
thread) is the endpoint's; the order of its puts against the chunks is
:mod:`zmq_omni.stages._edge`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..connectors import OmniConnectorBase

logger = logging.getLogger("zmq_omni.stages")

ANNOUNCE_PREFIX = "_zo_req_"
#: How far past the next expected announcement a receiver looks for later ones.
_ANNOUNCE_WINDOW = 16
#: The key (after ``_zo_req_{stage_id}``) of the sequence number of a stage's latest announcement.
HEAD_SUFFIX = "_head"
#: How many announcements before the head a receiver that jumps to it still reads.
_CATCH_UP = 1024


def read_announcements(
    inbound: OmniConnectorBase,
    *,
    upstream: str,
    stage_id: str,
    label: str,
    stop_event: threading.Event,
    admit: Callable[[str, str | None], None],
) -> None:
    """Read the announcements ``upstream`` puts for ``stage_id`` in order, until ``stop_event`` is set.

    Calls ``admit(request_id, error)`` once per well-formed announcement read
    (``error`` None for a request to serve, else the reason an upstream stage
    refused it), on the calling thread; a malformed one is logged and skipped.
    Each wait for the next announcement is bounded (0.2 s), so a set
    ``stop_event`` ends the loop within that.
    """
    next_seq = 0
    taken_ahead: set[int] = set()

    head_key = f"{ANNOUNCE_PREFIX}{upstream}{HEAD_SUFFIX}"

    def key(seq: int) -> str:
        return f"{ANNOUNCE_PREFIX}{upstream}_{seq}"

    def admit_one(obj: Any) -> None:
        request_id = obj.get("request_id") if isinstance(obj, Mapping) else None
        error = obj.get("error") if isinstance(obj, Mapping) else None
        if not isinstance(request_id, str) or not isinstance(error, (str, type(None))):
            logger.warning("%s %s: ignoring a malformed announcement %r", label, stage_id, obj)
            return
        admit(request_id, error)

    while not stop_event.is_set():
        deadline = time.monotonic() + 0.2
        got = inbound.get_with_deadline(upstream, stage_id, key(next_seq), deadline=deadline)
        if stop_event.is_set():
            return
        if got is not None:
            admit_one(got[0])
            next_seq += 1
            while next_seq in taken_ahead:
                taken_ahead.discard(next_seq)
                next_seq += 1
            continue
        # Nothing at next_seq: look past a lost announcement, and at the start
        # of the sequence for an upstream that restarted.
        restart = range(0, min(_ANNOUNCE_WINDOW, next_seq))
        for seq in (*range(next_seq + 1, next_seq + _ANNOUNCE_WINDOW), *restart):
            if seq in taken_ahead:
                continue
            found = inbound.get(upstream, stage_id, key(seq))
            if found is None:
                continue
            admit_one(found[0])
            if seq < next_seq:
                logger.info("%s %s: stage %s restarted its announcements", label, stage_id, upstream)
                next_seq, taken_ahead = seq + 1, set()
            else:
                taken_ahead.add(seq)
        if next_seq in taken_ahead:
            # What was read ahead (after a restart: from its seq 1 on) is behind us now.
            while next_seq in taken_ahead:
                taken_ahead.discard(next_seq)
                next_seq += 1
            continue
        # Still nothing at next_seq while the upstream's head says it announced
        # it (or later): those announcements went to an earlier incarnation of
        # this stage (a driver run before this one, a stage since restarted)
        # or were given up. Read what is still there, then go on after the head.
        head = inbound.get(upstream, stage_id, head_key)
        latest = head[0].get("seq") if head is not None and isinstance(head[0], Mapping) else None
        if not isinstance(latest, int) or latest < next_seq:
            continue
        for seq in range(max(next_seq, latest - _CATCH_UP + 1), latest + 1):
            if seq not in taken_ahead and (found := inbound.get(upstream, stage_id, key(seq))):
                admit_one(found[0])
        logger.info(
            "%s %s: announcements %d..%d of stage %s were not for this incarnation; going on at %d",
            label,
            stage_id,
            next_seq,
            latest,
            upstream,
            latest + 1,
        )
        next_seq, taken_ahead = latest + 1, {seq for seq in taken_ahead if seq > latest}
        while next_seq in taken_ahead:
            taken_ahead.discard(next_seq)
            next_seq += 1
