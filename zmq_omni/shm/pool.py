"""A pool of reused, pre-faulted slots, and leases that pin them while viewed.

A brand-new segment per message is page-fault bound (create + fill + map of
64 MiB costs ~49 ms here, against ~5 ms to fill memory that is already
faulted in). So a sender keeps a :class:`SlotPool`: a set of segments, each
holding one payload at a time, reused for later payloads once the receiver is
done with them.

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

import contextlib
import fcntl
import logging
import struct
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..errors import ShmError, ShmSpaceError
from .segment import Segment, check_free_space, default_shm_dir

__all__ = [
    "FREE",
    "LEASED",
    "READY",
    "WRITING",
    "SlotHandle",
    "SlotPool",
    "SlotReader",
    "flat_bytes",
    "frame_nbytes",
]

_log = logging.getLogger("zmq_omni.shm")

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


def _slot_capacity(need: int, minimum: int) -> int:
    # Eight size classes per power of two: few distinct sizes (so slots get
    # reused) while wasting at most 1/8 (a payload just over 256 MiB must not
    # take a 512 MiB segment).
    cap = max(minimum, need)
    step = max(1 << (cap.bit_length() - 4), 4096)
    return -(-cap // step) * step


# A TypeVar rather than typing.Self, which Python 3.10 lacks.
_ClosingT = TypeVar("_ClosingT", bound="_Closing")


class _Closing:
    """What the pool and the reader share: ``with`` closes, and an unclosed one warns when collected."""

    _closed: bool
    directory: str

    def close(self) -> None:  # pragma: no cover - both subclasses define it
        raise NotImplementedError

    def __enter__(self: _ClosingT) -> _ClosingT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):  # also after a constructor that raised
            return
        warnings.warn(f"unclosed {type(self).__name__} in {self.directory}", ResourceWarning, stacklevel=2, source=self)
        with contextlib.suppress(Exception):
            self.close()


class _Slot:
    __slots__ = ("busy_since", "capacity", "gen", "seg")

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.capacity = seg.size - HEADER_BYTES
        self.gen = 0
        self.busy_since = 0.0

    @property
    def state(self) -> int:
        return self.seg.mm[_STATE_AT]


class SlotPool(_Closing):
    """The sender side: copies frames into reused slots and hands out handles.

    Args:
        directory: the tmpfs directory for segments (default ``/dev/shm``).
        max_bytes: the most segment memory this pool may hold.
        min_free_bytes: never grow if fewer bytes would stay free in ``directory``.
        min_slot_bytes: the smallest slot created (payloads round up to a power of two).
        ttl: seconds after which a READY slot nobody leased is reclaimed.

    Thread-safe. :meth:`write` raises :class:`ShmSpaceError` when no slot can be
    had; the caller then falls back (ZeroMQ frames, or a spill file).
    """

    def __init__(
        self,
        *,
        directory: str | None = None,
        max_bytes: int = 1 << 30,
        min_free_bytes: int = 16 << 20,
        min_slot_bytes: int = 256 << 10,
        ttl: float = 300.0,
    ) -> None:
        self.directory = directory or default_shm_dir()
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.min_slot_bytes = min_slot_bytes
        self.ttl = ttl
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_written = 0
        self.segments_created = 0
        self.reclaimed = 0

    # -- writing ---------------------------------------------------------------
    def write(self, frames: Sequence[Any]) -> SlotHandle:
        """Copy ``frames`` into one slot (the only copy the payload gets) and return its handle.

        Raises:
            ShmSpaceError: no free slot fits and the pool cannot grow.
            ShmError: the pool is closed or a segment could not be made.
        """
        views = [flat_bytes(f) for f in frames]
        spans, need = _layout([v.nbytes for v in views])
        slot = self._acquire(need)
        mm = slot.seg.mm
        base = HEADER_BYTES
        try:
            for view, (off, length) in zip(views, spans, strict=True):
                mm[base + off : base + off + length] = view
        except BaseException:
            mm[_STATE_AT] = FREE
            raise
        gen = slot.gen + 1
        slot.gen = gen
        struct.pack_into("<Qd", mm, _GEN_AT, gen, time.time())
        # The state byte is written last: a reader checks it before trusting gen and data.
        mm[_STATE_AT] = READY
        with self._lock:
            self.bytes_written += need
        return SlotHandle(slot.seg.name, gen, spans)

    def prepare(self, capacity: int) -> bool:
        """Create the pool's first slot, of at least ``capacity`` bytes, ahead of any write; True if made.

        A new segment costs about 1 ms per MiB (created and faulted in): made here, off a put's
        path, the first write finds it ready. A pool that already holds a slot, or cannot grow
        (limits, free space), is left as it is: the first write then does what it always does.

        Raises:
            ShmError: the pool is closed or a segment could not be made.
        """
        with self._lock:
            if self._closed:
                raise ShmError("slot pool is closed")
            if self._slots:
                return False
            return self._grow(capacity) is not None

    def _acquire(self, need: int) -> _Slot:
        with self._lock:
            if self._closed:
                raise ShmError("slot pool is closed")
            slot = self._pick_free(need)
            if slot is None:
                self._reap_locked()
                slot = self._pick_free(need) or self._grow(need) or self._pick_free(need, any_size=True)
            if slot is None:
                raise ShmSpaceError(f"no shared-memory slot for {need} bytes (pool {self.pool_bytes()} bytes)")
            slot.seg.mm[_STATE_AT] = WRITING
            slot.busy_since = time.monotonic()
            return slot

    def _pick_free(self, need: int, *, any_size: bool = False) -> _Slot | None:
        best: _Slot | None = None
        # Don't park a small payload in a huge slot unless nothing else is possible.
        ceiling = None if any_size else _slot_capacity(need, self.min_slot_bytes) * 4
        for slot in self._slots:
            if slot.state != FREE or slot.capacity < need:
                continue
            if ceiling is not None and slot.capacity > ceiling:
                continue
            if best is None or slot.capacity < best.capacity:
                best = slot
        return best

    def _grow(self, need: int) -> _Slot | None:
        size = _slot_capacity(need, self.min_slot_bytes) + HEADER_BYTES
        if size > self.max_bytes:
            return None
        # Make room by dropping idle slots of other sizes before refusing.
        while self.pool_bytes() + size > self.max_bytes:
            idle = [s for s in self._slots if s.state == FREE]
            if not idle:
                return None
            victim = min(idle, key=lambda s: s.capacity)
            self._drop(victim)
        try:
            seg = Segment.create(size, directory=self.directory, min_free_bytes=self.min_free_bytes)
        except ShmSpaceError:
            return None
        seg.mm[: _HEAD.size] = _HEAD.pack(_MAGIC, _VERSION, FREE, 0, 0.0)
        slot = _Slot(seg)
        self._slots.append(slot)
        self.segments_created += 1
        return slot

    def _drop(self, slot: _Slot) -> None:
        self._slots.remove(slot)
        slot.seg.unlink()
        slot.seg.close()

    # -- reclaiming --------------------------------------------------------------
    def reap(self) -> int:
        """Reclaim slots whose lease holder died or whose handle expired; return how many."""
        with self._lock:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        now = time.time()
        count = 0
        for slot in self._slots:
            state = slot.state
            if state == LEASED or (state == READY and now - _ready_at(slot.seg) >= self.ttl):
                count += _reclaim(slot.seg, None, expect=(state,))
        self.reclaimed += count
        return count

    def discard(self, handle: SlotHandle) -> bool:
        """Free the slot of an unconsumed handle of ours (re-put, cleanup). True if freed."""
        with self._lock:
            for slot in self._slots:
                if slot.seg.name == handle.segment:
                    freed = _reclaim(slot.seg, handle.gen, expect=(READY,)) == 1
                    self.reclaimed += freed
                    return freed
        return False

    def unopened(self, handle: SlotHandle) -> bool:
        """True while ``handle``'s slot still holds its payload READY: no receiver has leased it yet."""
        with self._lock:
            for slot in self._slots:
                if slot.seg.name == handle.segment:
                    mm = slot.seg.mm
                    return mm[_STATE_AT] == READY and struct.unpack_from("<Q", mm, _GEN_AT)[0] == handle.gen
        return False

    def owns(self, handle: SlotHandle) -> bool:
        """True when ``handle`` points into this pool."""
        with self._lock:
            return any(slot.seg.name == handle.segment for slot in self._slots)

    # -- introspection and lifecycle -----------------------------------------------
    def pool_bytes(self) -> int:
        """Segment bytes the pool holds (free and busy)."""
        return sum(slot.seg.size for slot in self._slots)

    def stats(self) -> dict[str, int]:
        """A snapshot: slots by state, pool bytes, bytes written, segments created."""
        with self._lock:
            states = [slot.state for slot in self._slots]
            return {
                "slots": len(states),
                "slots_free": states.count(FREE),
                "slots_ready": states.count(READY),
                "slots_leased": states.count(LEASED),
                "pool_bytes": self.pool_bytes(),
                "bytes_written": self.bytes_written,
                "segments_created": self.segments_created,
                "reclaimed": self.reclaimed,
            }

    def segment_names(self) -> list[str]:
        """Names of the pool's segments (for tests and the sweep report)."""
        with self._lock:
            return [slot.seg.name for slot in self._slots]

    def check_space(self, nbytes: int) -> None:
        """Raise :class:`ShmSpaceError` when ``nbytes`` more would break the free-space floor."""
        check_free_space(self.directory, nbytes, self.min_free_bytes)

    def close(self) -> None:
        """Unlink every segment. Receivers' live views stay valid (their mappings pin the memory)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots, self._slots = self._slots, []
        for slot in slots:
            slot.seg.unlink()
            slot.seg.close()


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


class _Attachment:
    """A receiver's cached mapping of one slot segment, with its lease count."""

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.array = np.frombuffer(seg.mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.leased = False
        self.evicted = False
        self.lock = threading.RLock()

    def close_if_idle(self) -> None:
        with self.lock:
            if self.leased or not self.evicted or self.seg.closed:
                return
            del self.array
            self.seg.close()


class _LeasedRegion:
    """The base object of every array a lease hands out; its death ends the lease.

    numpy keeps the object behind ``__array_interface__`` as the array's base,
    and every slice or view of that array keeps it alive, so the finalizer runs
    exactly when the last view of the slot is gone.
    """

    __slots__ = ("__array_interface__", "__weakref__", "attachment")

    def __init__(self, attachment: _Attachment, offset: int, nbytes: int) -> None:
        self.attachment = attachment
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (attachment.address + offset, False),
        }


def _end_lease(attachment: _Attachment, gen: int) -> None:
    seg = attachment.seg
    with attachment.lock:
        if seg.closed:
            return
        if seg.mm[_STATE_AT] == LEASED and struct.unpack_from("<Q", seg.mm, _GEN_AT)[0] == gen:
            seg.mm[_STATE_AT] = FREE
        fcntl.flock(seg.fd, fcntl.LOCK_UN)
        attachment.leased = False
    attachment.close_if_idle()


class SlotReader(_Closing):
    """The receiver side: maps slots (cached) and leases them as zero-copy views.

    Args:
        directory: the tmpfs directory the senders use.
        cache_size: how many segment mappings to keep between payloads
            (attaching costs a map and page-table fill, so reuse it).

    Thread-safe.
    """

    def __init__(self, *, directory: str | None = None, cache_size: int = 64) -> None:
        self.directory = directory or default_shm_dir()
        self.cache_size = cache_size
        self._cache: OrderedDict[str, _Attachment] = OrderedDict()
        self._lock = threading.RLock()
        self._closed = False
        self.stale = 0

    def open(self, handle: SlotHandle) -> list[memoryview] | None:
        """Lease the slot of ``handle`` and return one writable view per frame.

        The slot stays leased (never reused by the sender) until every view,
        and every array built on them, is garbage-collected. Returns None when
        the handle is stale: the slot was reclaimed or reused, or its segment
        is gone.
        """
        att = self._attachment(handle.segment)
        if att is None:
            self.stale += 1
            return None
        with att.lock:
            seg = att.seg
            if att.leased or seg.closed:
                self.stale += 1
                return None
            # Blocking is bounded: a sender holds LOCK_EX only to flip one byte.
            fcntl.flock(seg.fd, fcntl.LOCK_SH)
            gen = struct.unpack_from("<Q", seg.mm, _GEN_AT)[0]
            _, end = _layout([length for _, length in handle.spans])
            if seg.mm[_STATE_AT] != READY or gen != handle.gen or HEADER_BYTES + end > seg.size:
                fcntl.flock(seg.fd, fcntl.LOCK_UN)
                self.stale += 1
                return None
            seg.mm[_STATE_AT] = LEASED
            att.leased = True
        region = _LeasedRegion(att, HEADER_BYTES, max(end, 1))
        weakref.finalize(region, _end_lease, att, gen)
        whole = np.asarray(region)
        return [memoryview(whole[off : off + length]) for off, length in handle.spans]  # type: ignore[arg-type]

    def discard(self, handle: SlotHandle) -> bool:
        """Free the slot of a handle that will never be read (expiry, cleanup by a non-owner)."""
        att = self._attachment(handle.segment)
        if att is None:
            return False
        return _reclaim(att.seg, handle.gen, expect=(READY,)) == 1

    def _attachment(self, name: str) -> _Attachment | None:
        with self._lock:
            if self._closed:
                raise ShmError("slot reader is closed")
            att = self._cache.get(name)
            if att is not None:
                self._cache.move_to_end(name)
                return att
            self._evict_unlinked()
            try:
                seg = Segment.attach(name, directory=self.directory)
            except FileNotFoundError:
                return None
            att = _Attachment(seg)
            self._cache[name] = att
            while len(self._cache) > self.cache_size:
                _, old = self._cache.popitem(last=False)
                self._evict(old)
            return att

    def _evict_unlinked(self) -> None:
        # A released sender's segments are unlinked; our mappings of them only pin memory.
        for name in [n for n, a in self._cache.items() if a.seg.is_unlinked()]:
            self._evict(self._cache.pop(name))

    @staticmethod
    def _evict(att: _Attachment) -> None:
        att.evicted = True
        att.close_if_idle()

    def cached(self) -> int:
        """How many segment mappings are cached."""
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        """Drop every cached mapping; leased ones are unmapped when their last view dies."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            cache, self._cache = self._cache, OrderedDict()
        for att in cache.values():
            self._evict(att)
