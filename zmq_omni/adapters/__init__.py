"""Adapters: asynchronous transfer workers beside a scheduler.

:class:`OmniTransferAdapterBase` runs a save worker and a receive worker over a
connector, with a :class:`RetryPolicy` and failure reporting;
:class:`OmniChunkManager` streams requests in chunks with scheduler hooks;
:class:`KVTransferManager` moves per-layer KV blocks between tensor-parallel
layouts.
"""

from __future__ import annotations

from ._assemble import assemble_chunks, merge_metadata
from .base import FinishedRequests, OmniTransferAdapterBase, RecvTarget, WarningBurst
from .chunk import ChunkInputs, ChunkManagerConfig, OmniChunkManager
from .kv import KVLoadResult, KVTransferConfig, KVTransferManager, kv_key
from .reference import ReferenceScheduler, StepOutput, StepRequest
from .retry import RetryPolicy, default_retryable
from .scheduling import SchedulableRequest, SchedulerOutputLike

__all__ = [
    "ChunkInputs",
    "ChunkManagerConfig",
    "FinishedRequests",
    "KVLoadResult",
    "KVTransferConfig",
    "KVTransferManager",
    "OmniChunkManager",
    "OmniTransferAdapterBase",
    "RecvTarget",
    "ReferenceScheduler",
    "RetryPolicy",
    "SchedulableRequest",
    "SchedulerOutputLike",
    "StepOutput",
    "StepRequest",
    "WarningBurst",
    "assemble_chunks",
    "default_retryable",
    "kv_key",
    "merge_metadata",
]
