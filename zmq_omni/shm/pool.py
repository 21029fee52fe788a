"""The sender's pool of reused, pre-faulted slots.

A brand-new segment per message is page-fault bound (create + fill + map of
64 MiB costs ~49 ms here, against ~5 ms to fill memory that is already
faulted in). So a sender keeps a :class:`SlotPool`: a set of segments, each
holding one payload at a time, reused for later payloads once the receiver is
done with them.

The slot format and its state machine are in :mod:`._slot`, the receiver's
leases (:class:`SlotReader`) in :mod:`._reader`; this module re-exports their
public names, so both sides of a slot are importable from here.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..errors import ShmError, ShmSpaceError
from ._closing import _Closing
from ._reader import SlotReader
from ._slot import (
    _GEN_AT,
    _HEAD,
    _MAGIC,
    _STATE_AT,
    _VERSION,
    FREE,
    HEADER_BYTES,
    LEASED,
    READY,
    WRITING,
    SlotHandle,
    _layout,
    _ready_at,
    _reclaim,
    flat_bytes,
    frame_nbytes,
)
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


def _slot_capacity(need: int, minimum: int) -> int:
    # Eight size classes per power of two: few distinct sizes (so slots get
    # reused) while wasting at most 1/8 (a payload just over 256 MiB must not
    # take a 512 MiB segment).
    cap = max(minimum, need)
    step = max(1 << (cap.bit_length() - 4), 4096)
    return -(-cap // step) * step


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
