"""The receiver side of the slot pool: cached mappings of slot segments, and leases on them.

A lease pins a slot (state LEASED, a shared ``flock``) while any array viewing
it is alive; the slot format and its state machine are in :mod:`._slot`.
"""

from __future__ import annotations

import fcntl
import struct
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ..errors import ShmError
from ._closing import _Closing
from ._slot import _GEN_AT, _STATE_AT, FREE, HEADER_BYTES, LEASED, READY, SlotHandle, _layout, _reclaim
from .segment import Segment, default_shm_dir

__all__ = ["SlotReader"]


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
