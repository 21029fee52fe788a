"""What the chunk scheduler hooks need from a scheduler and from a chunk manager, and the hooks themselves.

The hooks of :class:`~zmq_omni.adapters.OmniChunkManager` need very little:

* a request has a ``request_id`` (:class:`SchedulableRequest`);
* the scheduler keeps ``waiting`` and ``running`` queues that are mutable
  sequences of requests (a ``list`` or a ``collections.deque``);
* a scheduler output lists the ids it scheduled and has a dict where the
  manager attaches each request's assembled inputs (:class:`SchedulerOutputLike`);
* the manager answers three public reads (:class:`ChunkSource`).

:class:`ChunkHooks` implements them over those reads; the manager exposes them
under vllm-omni's names. The pattern to follow in a stage worker (see
:class:`~zmq_omni.adapters.ReferenceScheduler`)::

    manager.process_pending_chunks(waiting, running)   # before scheduling
    output = schedule(waiting, running)                  # the scheduler's own policy
    manager.restore_queues(waiting, running)             # after scheduling
    manager.filter_scheduler_output(output)              # attach inputs, drop not-ready
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["ChunkHooks", "ChunkInputs", "ChunkSource", "SchedulableRequest", "SchedulerOutputLike"]

logger = logging.getLogger("zmq_omni.adapters")


@dataclass(frozen=True)
class ChunkInputs:
    """The assembled inputs of one request for one scheduling step.

    Attributes:
        request_id: the request.
        data: the chunks received since the last take, assembled.
        first_chunk_id: id of the oldest chunk in ``data``.
        num_chunks: how many chunks ``data`` holds (empty keep-alive chunks excluded).
        is_final: the upstream stream ended with these inputs; nothing more comes.
        cancelled: the upstream cancelled the request; ``data`` may be incomplete.
    """

    request_id: str
    data: dict[str, Any]
    first_chunk_id: int
    num_chunks: int
    is_final: bool
    cancelled: bool = False


@runtime_checkable
class SchedulableRequest(Protocol):
    """A request the scheduler queues; the hooks only read its id."""

    @property
    def request_id(self) -> str:
        """The scheduler's id of the request (the one ``load_async`` registered)."""
        ...


class SchedulerOutputLike(Protocol):
    """The part of a scheduler output the hooks read and write."""

    @property
    def scheduled_request_ids(self) -> MutableSequence[str]:
        """Ids scheduled this step, in order; the manager removes the not-ready ones."""
        ...

    @property
    def chunk_inputs(self) -> MutableMapping[str, ChunkInputs]:
        """Where the manager attaches each ready request's assembled inputs."""
        ...


class ChunkSource(Protocol):
    """The reads of a chunk manager the hooks use (each answers from one consistent state)."""

    def waiting_for_chunks(self, request_ids: Iterable[str]) -> set[str]:
        """The ids among ``request_ids`` receiving a stream that has no new chunk yet."""
        ...

    def is_receiving(self, request_id: str) -> bool:
        """True while ``request_id`` has a registered, unfinished incoming stream."""
        ...

    def take_inputs(self, request_id: str) -> ChunkInputs | None:
        """The chunks received for ``request_id`` since the last take, assembled; None when nothing is new."""
        ...


R = TypeVar("R", bound=SchedulableRequest)


class ChunkHooks:
    """The scheduler hooks: park requests without a new chunk, put them back, attach inputs.

    Called from the scheduler thread, the only writer of the parked requests
    (``_parked``): it changes them under ``_lock``, which :meth:`parked` takes to
    read them from another thread, and which is never held while the source is read.
    """

    def __init__(self, source: ChunkSource, stage_id: str) -> None:
        self._source = source
        self._stage_id = stage_id
        self._lock = threading.Lock()
        self._parked: dict[str, tuple[list[str], list[Any]]] = {}

    def parked(self) -> int:
        """How many requests are parked now (between the two hooks of a step)."""
        with self._lock:
            return sum(len(parked) for _, parked in self._parked.values())

    def process_pending_chunks(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        """Before scheduling: take out of ``waiting`` / ``running`` the requests whose next chunk has not arrived.

        See :meth:`~zmq_omni.adapters.OmniChunkManager.process_pending_chunks`.
        """
        if self._parked:  # only this thread writes it
            # restore_queues was skipped: put the previous step's requests back first.
            logger.warning("stage %s: process_pending_chunks called twice without restore_queues", self._stage_id)
            self.restore_queues(waiting, running)
        for name, queue in (("waiting", waiting), ("running", running)):
            order = [request.request_id for request in queue]
            blocked = self._source.waiting_for_chunks(order)
            if blocked:
                keep = [request for request in queue if request.request_id not in blocked]
                parked = [request for request in queue if request.request_id in blocked]
                queue.clear()
                queue.extend(keep)
                with self._lock:
                    self._parked[name] = (order, parked)

    def restore_queues(self, waiting: MutableSequence[R], running: MutableSequence[R]) -> None:
        """After scheduling: put parked requests back where they were.

        See :meth:`~zmq_omni.adapters.OmniChunkManager.restore_queues`.
        """
        for name, queue in (("waiting", waiting), ("running", running)):
            with self._lock:
                entry = self._parked.pop(name, None)
            if entry is None:
                continue
            order, parked = entry
            result = list(queue)
            ids = [request.request_id for request in result]
            present = set(ids)
            position = {rid: i for i, rid in enumerate(order)}
            for request in parked:
                rid = request.request_id
                if rid in present:
                    continue
                at = 0
                for earlier in reversed(order[: position[rid]]):
                    if earlier in present:
                        at = ids.index(earlier) + 1
                        break
                result.insert(at, request)
                ids.insert(at, rid)
                present.add(rid)
            queue.clear()
            queue.extend(result)

    def filter_scheduler_output(self, scheduler_output: SchedulerOutputLike) -> None:
        """After scheduling: attach assembled inputs, drop scheduled requests that are not ready.

        See :meth:`~zmq_omni.adapters.OmniChunkManager.filter_scheduler_output`.
        """
        kept: list[str] = []
        for request_id in scheduler_output.scheduled_request_ids:
            inputs = self._source.take_inputs(request_id)
            if inputs is not None:
                scheduler_output.chunk_inputs[request_id] = inputs
                kept.append(request_id)
            elif not self._source.is_receiving(request_id):
                kept.append(request_id)
        scheduler_output.scheduled_request_ids[:] = kept
