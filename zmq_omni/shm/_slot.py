"""A slot's layout and state machine, the handle that names one write, and reclaiming a slot.

The slot pool (:mod:`.pool`, the sender) and the slot reader (:mod:`._reader`,
the receiver) both read and write slots through what this module defines.

Each slot segment starts with a 4 KiB header; the payload follows, page
aligned::

    offset 0  magic  b"ZOSL"
    offset 4  version  u8
    offset 5  state    u8   FREE / WRITING / READY / LEASED
    offset 8  gen      u64  bumped by every write; handles carry it
    offset 16 ready_at f64  time.time() when the slot became READY

State machine (one writer at any time, so no atomic read-modify-write is needed):

* FREE -> WRITING -> READY: the sender, which owns FREE slots.
* READY -> LEASED: the one receiver holding the handle (a handle is delivered
  to exactly one receiver: by ZeroMQ, or by the atomic rename of a mailbox
  entry), under a shared ``flock`` on the segment, after checking ``gen``.
* LEASED -> FREE: that receiver, when the last array viewing the slot is
  garbage-collected; then it drops the ``flock``.
* READY -> FREE: whoever reclaims an unconsumed handle (expiry after
  ``ttl``, a re-put, ``cleanup``) under an exclusive ``flock``.
* LEASED -> FREE: the sender, when an exclusive ``flock`` succeeds on a
  LEASED slot, which means the holder died (the kernel drops ``flock`` locks
  of dead processes).

A receiver that took the shared lock holds it for the whole lease, so the
sender can never reclaim a slot that is being viewed; a receiver that comes
late finds FREE or a newer ``gen`` and gets ``None`` (a stale handle).
"""

from __future__ import annotations

import fcntl
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ShmError
from .segment import Segment

__all__ = [
    "FREE",
    "HEADER_BYTES",
    "LEASED",
    "READY",
    "WRITING",
    "SlotHandle",
    "flat_bytes",
    "frame_nbytes",
]

FREE, WRITING, READY, LEASED = 0, 1, 2, 3

HEADER_BYTES = 4096
_MAGIC = b"ZOSL"
_VERSION = 1
_STATE_AT = 5
_HEAD = struct.Struct("<4sBBxxQd")  # magic, version, state, gen, ready_at
_GEN_AT = 8
_READY_AT = 16
_ALIGN = 64

_HANDLE_MAGIC = b"ZOSH"
_HANDLE = struct.Struct("<4sBBHQ")  # magic, version, name length, span count, gen
_SPAN = struct.Struct("<QQ")


def frame_nbytes(frame: Any) -> int:
    """Size in bytes of one frame (bytes, bytearray, memoryview or array)."""
    return memoryview(frame).nbytes


def flat_bytes(frame: Any) -> memoryview:
    """A flat unsigned-byte view of any buffer (copied only when it is not contiguous)."""
    view = memoryview(frame)
    if view.ndim == 1 and view.format in ("B", "b", "c"):
        return view
    if view.c_contiguous:
        return view.cast("B")
    return memoryview(view.tobytes())


@dataclass(frozen=True)
class SlotHandle:
    """What crosses the wire instead of the payload: where it lies and which write.

    Attributes:
        segment: the slot's segment name (it names the owning process).
        gen: the slot generation of this write; a mismatch means stale.
        spans: ``(offset, length)`` of each frame relative to the payload start.
    """

    segment: str
    gen: int
    spans: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        """Payload bytes (sum of the frame lengths)."""
        return sum(length for _, length in self.spans)

    def pack(self) -> bytes:
        """A compact binary form (tens of bytes)."""
        name = self.segment.encode()
        spans = b"".join(_SPAN.pack(off, length) for off, length in self.spans)
        return _HANDLE.pack(_HANDLE_MAGIC, 1, len(name), len(self.spans), self.gen) + name + spans

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> SlotHandle:
        """Parse :meth:`pack` output. Raises :class:`ShmError` when malformed."""
        try:
            magic, version, name_len, count, gen = _HANDLE.unpack_from(data, 0)
            if magic != _HANDLE_MAGIC or version != 1:
                raise ShmError("not a slot handle")
            pos = _HANDLE.size
            name = bytes(data[pos : pos + name_len]).decode()
            pos += name_len
            if len(data) != pos + count * _SPAN.size:
                raise ShmError("slot handle has a bad length")
            spans = tuple(_SPAN.unpack_from(data, pos + i * _SPAN.size) for i in range(count))
        except (struct.error, UnicodeDecodeError) as exc:
            raise ShmError(f"malformed slot handle: {exc}") from exc
        return cls(name, gen, spans)


def _layout(sizes: Sequence[int]) -> tuple[tuple[tuple[int, int], ...], int]:
    spans = []
    pos = 0
    for size in sizes:
        spans.append((pos, size))
        pos += (size + _ALIGN - 1) // _ALIGN * _ALIGN
    return tuple(spans), pos


def _ready_at(seg: Segment) -> float:
    return float(struct.unpack_from("<d", seg.mm, _READY_AT)[0])


def _reclaim(seg: Segment, gen: int | None, *, expect: tuple[int, ...]) -> int:
    """Set a slot FREE under an exclusive flock when its state (and gen) still match."""
    try:
        fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # a live receiver holds the lease
    try:
        if seg.mm[_STATE_AT] not in expect:
            return 0
        if gen is not None and struct.unpack_from("<Q", seg.mm, _GEN_AT)[0] != gen:
            return 0
        seg.mm[_STATE_AT] = FREE
        return 1
    finally:
        fcntl.flock(seg.fd, fcntl.LOCK_UN)
