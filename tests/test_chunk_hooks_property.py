"""Property: process_pending_chunks / restore_queues keep the scheduler's queues intact and in order."""

from __future__ import annotations

import uuid
from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, StepRequest
from zmq_omni.connectors.inproc import InProcConnector

# One step of a scheduler: (chunks to deliver, #waiting to admit, #running to preempt,
# #running to finish, #new arrivals).
step_strategy = st.tuples(
    st.lists(st.integers(0, 40), max_size=6),
    st.integers(0, 4),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 3),
)


@settings(max_examples=60, deadline=None)
@given(initial=st.integers(0, 12), steps=st.lists(step_strategy, min_size=1, max_size=25))
def test_hooks_keep_queues_intact_and_ordered(initial: int, steps: list[tuple[list[int], int, int, int, int]]) -> None:
    namespace = uuid.uuid4().hex
    with InProcConnector({"namespace": namespace}) as conn:
        manager = OmniChunkManager(ChunkManagerConfig(stage_id="1", stall_timeout_s=600), conn)
        try:
            run_steps(manager, conn, initial, steps)
        finally:
            manager.shutdown()


def run_steps(
    manager: OmniChunkManager, conn: InProcConnector, initial: int, steps: list[tuple[list[int], int, int, int, int]]
) -> None:
    waiting: deque[StepRequest] = deque()
    running: deque[StepRequest] = deque()
    sent: dict[str, int] = {}
    counter = 0

    def arrive() -> None:
        nonlocal counter
        request = StepRequest(f"r{counter}")
        counter += 1
        if counter % 3:  # two in three requests receive chunks; the rest never park
            manager.load_async(request.request_id)
        waiting.append(request)

    for _ in range(initial):
        arrive()
    for deliveries, admit, preempt, finish, new in steps:
        everyone = [r.request_id for r in (*waiting, *running)]
        for pick in deliveries:
            if everyone:
                target = everyone[pick % len(everyone)]
                n = sent.get(target, 0)
                sent[target] = n + 1
                conn.put(
                    "0", "1", f"{target}_0_{n}", {"meta": {"chunk_id": n, "final": False}, "data": {"x": np.array([n])}}
                )
        before = {"waiting": [r.request_id for r in waiting], "running": [r.request_id for r in running]}
        manager.process_pending_chunks(waiting, running)
        window = [r.request_id for r in (*waiting, *running)]
        parked = set(everyone) - set(window)
        # Only receiving requests without inputs are parked; every request still queued can run.
        assert all(manager.is_ready(request_id) for request_id in window)
        assert all(manager.is_receiving(request_id) for request_id in parked)
        assert len(window) == len(set(window))
        moved: set[str] = set()
        for _ in range(min(admit, len(waiting))):
            request = waiting.popleft()
            moved.add(request.request_id)
            running.append(request)
        for _ in range(min(preempt, len(running))):
            request = running.pop()
            moved.add(request.request_id)
            waiting.appendleft(request)
        finished: set[str] = set()
        for _ in range(min(finish, len(running))):
            request = running.popleft()
            finished.add(request.request_id)
            manager.release(request.request_id)
        manager.restore_queues(waiting, running)
        for _ in range(new):
            arrive()
        after = {"waiting": [r.request_id for r in waiting], "running": [r.request_id for r in running]}
        # Nothing lost, nothing duplicated.
        expected = (set(everyone) - finished) | {f"r{i}" for i in range(counter - new, counter)}
        flat = after["waiting"] + after["running"]
        assert sorted(flat) == sorted(expected)
        # Parked requests come back to their own queue, and every pair of requests the
        # scheduler did not move keeps its order.
        for name in ("waiting", "running"):
            for request_id in parked:
                if request_id in before[name]:
                    assert request_id in after[name]
            stable = [r for r in before[name] if r not in moved and r not in finished]
            positions = [after[name].index(r) for r in stable]
            assert positions == sorted(positions), (name, before[name], after[name], parked, moved)
        # Consume what was delivered, as filter_scheduler_output would.
        for request_id in window:
            manager.take_inputs(request_id)
    assert manager.pending_state()["parked"] == 0
