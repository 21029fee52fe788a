"""ReferenceScheduler: the smallest scheduler built on the chunk manager's hooks (a client of the manager).

The pattern to follow in a stage worker::

    manager.process_pending_chunks(waiting, running)   # before scheduling
    output = schedule(waiting, running)                  # the scheduler's own policy
    manager.restore_queues(waiting, running)             # after scheduling
    manager.filter_scheduler_output(output)              # attach inputs, drop not-ready
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .chunk import OmniChunkManager
from .scheduling import ChunkInputs

__all__ = ["ReferenceScheduler", "StepOutput", "StepRequest"]


@dataclass
class StepRequest:
    """A minimal request for :class:`ReferenceScheduler`."""

    request_id: str
    external_req_id: str | None = None


@dataclass
class StepOutput:
    """One step of :class:`ReferenceScheduler`: what runs, with its inputs."""

    scheduled_request_ids: list[str] = field(default_factory=list)
    chunk_inputs: dict[str, ChunkInputs] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Requests dropped this step because their data can never arrive or leave, with the reason."""


class ReferenceScheduler:
    """A first-come-first-served scheduler that runs up to ``max_running`` requests.

    Every :meth:`step` schedules each running request that has new chunks (and
    every request of a stage without an upstream). A stage worker calls
    :meth:`add_request`, then loops: ``manager.wait_for_progress(timeout)``,
    ``step()``, run its model on ``output.chunk_inputs``, ``save_async`` the
    results, and :meth:`finish_request` when a request's stream is done.

    Failed requests (``collect_failed_*``) are removed from the queues and
    reported in ``StepOutput.failed``, so none waits forever.
    """

    def __init__(self, manager: OmniChunkManager, *, max_running: int = 64) -> None:
        self.manager = manager
        self.max_running = max_running
        self.waiting: deque[StepRequest] = deque()
        self.running: deque[StepRequest] = deque()

    def add_request(self, request: StepRequest, *, receive: bool = True) -> None:
        """Queue ``request``; with ``receive`` it waits for chunks from the upstream stage."""
        if receive and self.manager.config.upstream_stage_id is not None:
            self.manager.load_async(request.request_id, external_req_id=request.external_req_id)
        self.waiting.append(request)

    def finish_request(self, request_id: str) -> None:
        """Take ``request_id`` out of the queues and release its transfer state."""
        self._drop(request_id)
        self.manager.release(request_id)

    def abort_request(self, request_id: str, *, notify_downstream: bool | None = None) -> None:
        """Cancel ``request_id`` on both sides and take it out of the queues.

        See :meth:`OmniChunkManager.cancel` for ``notify_downstream``.
        """
        self._drop(request_id)
        self.manager.cancel(request_id, notify_downstream=notify_downstream)

    def _drop(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)

    def has_requests(self) -> bool:
        """True while any request is queued."""
        return bool(self.waiting or self.running)

    def step(self) -> StepOutput:
        """One scheduling step around the chunk hooks."""
        output = StepOutput()
        failed = self.manager.collect_failed_send_request_ids()
        failed.update(self.manager.collect_failed_receive_request_ids())
        for request_id in failed:
            self._drop(request_id)
            self.manager.release(request_id)
        output.failed = failed
        self.manager.process_pending_chunks(self.waiting, self.running)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        output.scheduled_request_ids = [request.request_id for request in self.running]
        self.manager.restore_queues(self.waiting, self.running)
        self.manager.filter_scheduler_output(output)
        return output
