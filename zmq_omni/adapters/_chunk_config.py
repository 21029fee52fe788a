"""ChunkManagerConfig: the config of an :class:`~zmq_omni.adapters.OmniChunkManager`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConnectorSpec
from ..config.pipeline import read_connector_spec
from ..config.reader import read_config, setting
from ..errors import ConfigError
from .retry import RetryPolicy

__all__ = ["ChunkManagerConfig"]


def _neighbour(stage_id: str, step: int) -> str | None:
    try:
        value = int(stage_id) + step
    except ValueError:
        return None
    return str(value) if value >= 0 else None


@dataclass(frozen=True, kw_only=True)
class ChunkManagerConfig:
    """Config of an :class:`OmniChunkManager` (build from YAML with :meth:`from_dict`).

    Attributes:
        stage_id: this stage; chunks it sends are keyed with it.
        upstream_stage_id: the stage it receives from; default ``stage_id - 1``
            for numeric ids (none for stage 0).
        downstream_stage_id: the stage it sends to; default ``stage_id + 1``
            for numeric ids.
        connector: the connector to build when none is passed in.
        retry: the send policy; a chunk that exhausts it fails its request.
        stall_timeout_s: a receiving request that gets no chunk for this long
            is reported by ``collect_failed_receive_request_ids()``.
        recv_wait_s: longest block of the receive worker on one key (bounds
            the latency of other keys and of stall detection).
        concat_axis: axis along which received arrays are concatenated.
        shutdown_grace_s: how long ``shutdown`` waits for a put in progress.
        max_queued_chunks: most chunks queued for the save thread at once.
            A ``save_async`` / ``save`` that finds the queue full waits for
            room up to ``queue_full_timeout_s``; then the chunk is refused and
            its request fails to send (reason "save queue full"), since a
            stream cannot go on with a hole. A cancellation's end-of-stream
            marker is always queued (one per request at most).
        queue_full_timeout_s: how long a save waits for room in a full queue.
        idle_state_timeout_s: a request whose state here saw no activity this
            long is forgotten without ``release``: a stream still open (no
            chunk queued since) is cancelled (the next stage gets a cancelled
            end of stream) and reported as a send failure; a failed or ended
            send state and a finished receiving stream whose inputs were never
            taken are dropped (counted as ``expired_states``). Its id stays a
            used id.
        max_ready_chunks: most chunks received for one request and not taken
            yet. At the bound the receive worker stops reading that request's
            stream until the scheduler takes its inputs: the chunks stay in the
            connector unconsumed, so the sender's window pushes back on the
            upstream stage instead of this stage's memory growing with a
            backlog (and each take assembling an ever larger one). The time a
            stream is paused does not count towards ``stall_timeout_s``.
        max_ready_bytes: most payload bytes (array ``nbytes``, ``bytes``/``str``
            lengths) received for all requests together and not taken yet; at
            the bound, requests holding any untaken chunk pause the same way
            (a request with none may still read one, so every request can
            progress). Streams read by :meth:`OmniChunkManager.load` are not
            bounded (it returns the whole stream at once).
    """

    stage_id: str
    upstream_stage_id: str | None = None
    downstream_stage_id: str | None = None
    connector: ConnectorSpec | None = setting(None, read=read_connector_spec)
    retry: RetryPolicy = setting(default_factory=RetryPolicy, read=RetryPolicy.read)
    stall_timeout_s: float = 30.0  # > 0, checked by __post_init__
    recv_wait_s: float = 0.01  # > 0, checked by __post_init__
    concat_axis: int = 0
    shutdown_grace_s: float = setting(0.5, minimum=0)
    max_queued_chunks: int = 4096  # >= 1, checked by __post_init__
    queue_full_timeout_s: float = setting(10.0, minimum=0)
    idle_state_timeout_s: float = 600.0  # > 0, checked by __post_init__
    max_ready_chunks: int = 64  # >= 1, checked by __post_init__
    max_ready_bytes: int = 256 << 20  # >= 1, checked by __post_init__

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_id", str(self.stage_id))
        if self.upstream_stage_id is None:
            object.__setattr__(self, "upstream_stage_id", _neighbour(self.stage_id, -1))
        if self.downstream_stage_id is None:
            object.__setattr__(self, "downstream_stage_id", _neighbour(self.stage_id, +1))
        if self.stall_timeout_s <= 0 or self.recv_wait_s <= 0:
            raise ConfigError("'stall_timeout_s' and 'recv_wait_s' must be > 0")
        if self.max_queued_chunks < 1:
            raise ConfigError(f"'max_queued_chunks' must be >= 1, got {self.max_queued_chunks}")
        if self.queue_full_timeout_s < 0 or self.idle_state_timeout_s <= 0:
            raise ConfigError("'queue_full_timeout_s' must be >= 0 and 'idle_state_timeout_s' > 0")
        if self.max_ready_chunks < 1 or self.max_ready_bytes < 1:
            raise ConfigError("'max_ready_chunks' and 'max_ready_bytes' must be >= 1")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "chunk_manager") -> ChunkManagerConfig:
        """Build from a plain dict; unknown keys raise ``ConfigError`` naming them."""
        return read_config(cls, data, path)
