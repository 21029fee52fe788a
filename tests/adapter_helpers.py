"""Connectors and helpers for the adapter tests (in-process, real threads)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager, RetryPolicy
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.errors import PeerGoneError, TransportTimeoutError

FAST_RETRY = RetryPolicy(attempts=3, deadline_s=1.0, backoff_initial_s=0.005, backoff_max_s=0.02, jitter_s=0.005)


class FlakyConnector(InProcConnector):
    """An InProcConnector whose puts fail on demand, recording the typed cause like a real backend.

    ``fail_puts[key] = n`` makes the next n puts of ``key`` fail with a timeout;
    ``dead = True`` makes every put fail with PeerGoneError; ``lose(key)``
    makes a put "succeed" and later reports it undelivered via drain_failures.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.fail_puts: dict[str, int] = {}
        self.dead = False
        self.lost: set[str] = set()
        self.put_calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        key = put_key
        self.gate.wait(10)
        self.put_calls.append(key)
        if self.dead:
            self._record_failure("put", from_stage, to_stage, key, "peer gone", PeerGoneError("peer gone"))
            return False, 0, None
        if self.fail_puts.get(key, 0) > 0:
            self.fail_puts[key] -= 1
            self._record_failure(
                "put", from_stage, to_stage, key, "put timed out", TransportTimeoutError("put timed out")
            )
            return False, 0, None
        if key in self.lost:
            self._record_failure(
                "put", from_stage, to_stage, key, "delivery never confirmed", TransportTimeoutError("no ack")
            )
            return True, 0, None
        return super().put(from_stage, to_stage, key, data)


@contextmanager
def chunk_pair(
    *, stall_timeout_s: float = 5.0, retry: RetryPolicy = FAST_RETRY, flaky: bool = False, stages: int = 2
) -> Iterator[tuple[list[OmniChunkManager], list[InProcConnector]]]:
    """``stages`` chunk managers (stage 0..n-1) sharing one fresh in-process namespace."""
    namespace = f"chunks-{uuid.uuid4().hex}"
    connectors: list[InProcConnector] = []
    managers: list[OmniChunkManager] = []
    try:
        for stage in range(stages):
            ctor = FlakyConnector if flaky else InProcConnector
            conn = ctor({"namespace": namespace, "stage_id": str(stage)})
            connectors.append(conn)
            managers.append(
                OmniChunkManager(
                    ChunkManagerConfig(stage_id=str(stage), retry=retry, stall_timeout_s=stall_timeout_s), conn
                )
            )
        yield managers, connectors
    finally:
        for manager in managers:
            manager.shutdown()
        for conn in connectors:
            conn.close()


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:8]}"
