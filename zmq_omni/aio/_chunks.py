"""Chunk streams on an event loop: the chunk manager's stream, awaited chunk by chunk.

Keys and wire format are :class:`~zmq_omni.adapters.OmniChunkManager`'s: chunk
``n`` of a request goes under ``{external_req_id}_{stage_id}_{n}`` as
``{"meta": {"chunk_id", "final", "cancelled"}, "data": {...}}``, and ``final``
ends the stream in band. So an async stage talks to stages that run the
threaded manager, either way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..adapters import ChunkManagerConfig
from ..errors import ClosedResourceError, DecodeError, DeliveryError, TransportTimeoutError
from ._connector import AsyncConnector

__all__ = ["AsyncChunkSender", "AsyncChunkStream", "Chunk"]

_DEFAULT_STALL_S: float = ChunkManagerConfig.__dataclass_fields__["stall_timeout_s"].default  # type: ignore[assignment]


@dataclass(frozen=True)
class Chunk:
    """One chunk of a request's stream.

    Attributes:
        request_id: the request (its external id, shared by every stage).
        chunk_id: 0, 1, 2, ... in stream order.
        data: the chunk's payload (a dict of arrays and metadata; empty for an end marker).
        final: the last chunk of the stream.
        cancelled: the upstream cancelled the request (only on the final chunk; ``data`` may be incomplete).
        nbytes: the size the connector reported for it.
    """

    request_id: str
    chunk_id: int
    data: Mapping[str, Any]
    final: bool
    cancelled: bool = False
    nbytes: int = 0


class AsyncChunkStream:
    """``async for chunk in AsyncChunkStream(conn, upstream, stage, request_id)``: one request's chunks, in order.

    Each chunk is awaited on ``conn`` (no thread, no polling); the iteration
    ends after the final chunk, whose key prefix is then cleaned up on the
    connector (as the chunk manager does). A stream that fails raises:

    * :class:`~zmq_omni.errors.TransportTimeoutError` -- no chunk for
      ``stall_timeout_s`` (the chunk manager's stall failure);
    * :class:`~zmq_omni.errors.DecodeError` -- a chunk that is not a chunk of
      this stream (wrong format or id);
    * :class:`~zmq_omni.errors.ClosedResourceError` -- the connector closed.

    Cancelling the task that iterates loses nothing: the chunk being awaited
    stays for the next ``__anext__`` (see :class:`AsyncConnector`).

    Args:
        conn: the receiving stage's :class:`AsyncConnector`.
        upstream_stage_id: the stage that sends the chunks.
        stage_id: this stage.
        request_id: the request's external id (the one in the keys).
        stall_timeout_s: longest wait for one chunk (default the chunk manager's, 30 s).
    """

    def __init__(
        self,
        conn: AsyncConnector,
        upstream_stage_id: str | int,
        stage_id: str | int,
        request_id: str,
        *,
        stall_timeout_s: float = _DEFAULT_STALL_S,
    ) -> None:
        if stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be > 0")
        self._conn = conn
        self._upstream = str(upstream_stage_id)
        self._stage = str(stage_id)
        self.request_id = request_id
        self._prefix = f"{request_id}_{self._upstream}_"
        self._stall = stall_timeout_s
        self._next = 0
        self._ended = False

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        key = f"{self._prefix}{self._next}"
        got = await self._conn.get(self._upstream, self._stage, key, None, timeout=self._stall)
        if got is None:
            self._ended = True
            if self._conn.closed:
                raise ClosedResourceError(f"connector closed while waiting for chunk {self._next} of {key!r}")
            raise TransportTimeoutError(
                f"stalled: no chunk from stage {self._upstream} for {self._stall:.1f}s "
                f"(request {self.request_id!r}, waiting for chunk {self._next})"
            )
        obj, nbytes = got
        meta = obj.get("meta") if isinstance(obj, Mapping) else None
        data = obj.get("data") if isinstance(obj, Mapping) else None
        if not isinstance(meta, Mapping) or not isinstance(data, Mapping) or meta.get("chunk_id") != self._next:
            self._ended = True
            self._conn.connector.cleanup_prefix(self._prefix)
            raise DecodeError(f"bad chunk under {key!r}: not chunk {self._next} of request {self.request_id!r}")
        final = bool(meta.get("final"))
        chunk = Chunk(self.request_id, self._next, data, final, bool(meta.get("cancelled")), nbytes)
        self._next += 1
        if final:
            self._ended = True
            # Drop anything a retried put may have left behind for this stream (as the chunk manager does).
            self._conn.connector.cleanup_prefix(self._prefix)
        return chunk


class AsyncChunkSender:
    """Send one request's chunk stream from an event loop: ``await sender.send(data)``, the last with ``final=True``.

    Args:
        conn: this stage's :class:`AsyncConnector`.
        stage_id: this stage (in the keys).
        downstream_stage_id: the stage that receives.
        request_id: the request's external id.
    """

    def __init__(
        self, conn: AsyncConnector, stage_id: str | int, downstream_stage_id: str | int, request_id: str
    ) -> None:
        self._conn = conn
        self._stage = str(stage_id)
        self._downstream = str(downstream_stage_id)
        self.request_id = request_id
        self._next = 0
        self._ended = False

    @property
    def next_chunk_id(self) -> int:
        """The id the next chunk will carry."""
        return self._next

    async def send(self, data: Mapping[str, Any] | None = None, *, final: bool = False, cancelled: bool = False) -> int:
        """Put the next chunk (waiting for window room without blocking the loop); its chunk id.

        Raises:
            ValueError: a chunk after the final one.
            DeliveryError: the put failed (the connector keeps the cause for the adapters).
        """
        if self._ended:
            raise ValueError(f"request {self.request_id!r}: chunk after the final one")
        chunk_id = self._next
        wire = {"meta": {"chunk_id": chunk_id, "final": final, "cancelled": cancelled}, "data": dict(data or {})}
        key = f"{self.request_id}_{self._stage}_{chunk_id}"
        ok, _, _ = await self._conn.put(self._stage, self._downstream, key, wire)
        if not ok:
            raise DeliveryError(f"put of chunk {chunk_id} of request {self.request_id!r} failed", key=key)
        self._next += 1
        self._ended = final
        return chunk_id

    async def cancel(self) -> None:
        """End the stream with a final chunk marked ``cancelled`` (the receiver stops instead of stalling)."""
        if not self._ended:
            await self.send(None, final=True, cancelled=True)
