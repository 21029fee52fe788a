"""asyncio: awaitable put, get and chunk streams that never block an event loop.

:class:`AsyncConnector` wraps any zmq_omni connector (``AsyncConnector(connector)``);
``AsyncConnector.create(spec)`` builds a ``ZmqConnector`` whose sockets the
event loop itself drives (no I/O thread). Waiting gets and puts are futures
woken on the loop (by the loop's own reads, or by the connector's wake-up
descriptor registered with the loop), so thousands of them cost no thread.
:class:`AsyncChunkStream` iterates over the chunks of one request as the chunk
manager streams them (same keys and wire format as
:class:`~zmq_omni.adapters.OmniChunkManager`), and :class:`AsyncChunkSender`
sends such a stream. See ``docs/asyncio.md``.
"""

from __future__ import annotations

from ._chunks import AsyncChunkSender, AsyncChunkStream, Chunk
from ._connector import AsyncConnector

__all__ = ["AsyncChunkSender", "AsyncChunkStream", "AsyncConnector", "Chunk"]
