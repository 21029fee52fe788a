"""Host staging of device tensors for the encoder, reading a host tensor's bytes, and the receiver's decode device.

A tensor that does not live in host memory (CUDA, or any other torch device)
is copied once into a host buffer at encode time; the frames then view that
buffer like any host array. The buffers come from a :class:`StagingPool`:
page-locked (pinned) for CUDA, so the device-to-host copy runs at DMA speed,
and reused, because allocating pinned memory costs far more than the copy.

A buffer goes back to its pool when the last frame or array viewing it is
gone (ZeroMQ released the frame, the shared-memory write finished, or an
inline copy was made): a ``weakref.finalize`` on the object every view keeps
alive does it, from whichever thread drops that last reference.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import numpy as np

from ..errors import ConfigError, EncodeError

__all__ = ["StagingPool", "byte_array", "byte_arrays", "resolve_device", "stage_to_host"]

#: ``ctypes.c_char * n`` by ``n``, for :func:`byte_array`; read without a lock (a dict read is atomic).
byte_arrays: dict[int, Any] = {}
_BYTE_ARRAYS_SIZE = 1024


def byte_array(nbytes: int) -> Any:
    """The ctypes array type of ``nbytes`` chars, kept for the next call.

    ``byte_array(n).from_address(address).raw`` is a copy of the ``n`` bytes at ``address``: what
    ``ctypes.string_at`` returns, without its foreign-function call (half its time, warm or cold).
    """
    array = byte_arrays.get(nbytes)
    if array is None:
        if len(byte_arrays) >= _BYTE_ARRAYS_SIZE:
            byte_arrays.clear()
        array = byte_arrays[nbytes] = ctypes.c_char * nbytes
    return array


#: Pooled buffers are powers of two from this size on.
MIN_BLOCK_BYTES = 64 << 10
#: Free buffers a pool keeps at most, in bytes; larger ones are freed on release.
DEFAULT_MAX_CACHED_BYTES = 256 << 20


class StagingPool:
    """Reused host buffers (``uint8`` CPU tensors) for device-to-host copies.

    Thread-safe. ``acquire`` holds ``_lock`` briefly; ``release`` runs from
    finalizers (any thread, possibly inside a garbage collection that
    interrupted ``acquire``), so it only *tries* the lock and frees the buffer
    when it cannot take it, rather than risk a deadlock.

    Attributes:
        pin: whether buffers are page-locked (needs CUDA).
        allocated: buffers allocated so far.
        reused: acquisitions served from the free list.
    """

    def __init__(self, *, pin: bool, max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES) -> None:
        self.pin = pin
        self.max_cached_bytes = max_cached_bytes
        self.allocated = 0
        self.reused = 0
        self._free: dict[int, list[Any]] = {}  # capacity -> free buffers; guarded by _lock
        self._cached = 0  # bytes in _free; guarded by _lock
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """Bytes held in free buffers."""
        return self._cached

    def acquire(self, torch: Any, nbytes: int) -> Any:
        """A ``uint8`` CPU tensor of at least ``nbytes`` bytes, reused when one is free."""
        capacity = max(MIN_BLOCK_BYTES, 1 << max(nbytes - 1, 0).bit_length())
        with self._lock:
            free = self._free.get(capacity)
            if free:
                self._cached -= capacity
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, block: Any) -> None:
        """Give a buffer back (called by the finalizer of its last view)."""
        capacity = block.numel()
        if not self._lock.acquire(blocking=False):
            return  # freed with its last reference
        try:
            if self._cached + capacity <= self.max_cached_bytes:
                self._free.setdefault(capacity, []).append(block)
                self._cached += capacity
        finally:
            self._lock.release()


_pools: dict[bool, StagingPool] = {}
_pools_lock = threading.Lock()


def _pool_for(pin: bool) -> StagingPool:
    pool = _pools.get(pin)
    if pool is None:
        with _pools_lock:
            pool = _pools.setdefault(pin, StagingPool(pin=pin))
    return pool


def stage_to_host(torch: Any, tensor: Any, pool: StagingPool | None = None) -> np.ndarray[Any, Any]:
    """Copy ``tensor``'s elements (C order) once into a pooled host buffer; a flat ``uint8`` array over it.

    Args:
        torch: the torch module.
        tensor: a detached, conj/neg-resolved tensor on any device.
        pool: the pool to stage through; default the process-wide pinned pool
            for CUDA tensors and an unpinned one for other devices.

    Returns:
        A 1-D ``uint8`` array of exactly the tensor's byte size, viewing the
        buffer; the buffer returns to ``pool`` when nothing views it any more.

    Raises:
        EncodeError: the copy failed (the device cannot be read, out of memory).
    """
    if pool is None:
        pool = _pool_for(tensor.device.type == "cuda")
    try:
        # Contiguous on the device first (a device-side copy, only if needed): the one host copy is then flat.
        flat = tensor.contiguous().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:
            flat = flat.clone(memory_format=torch.contiguous_format)
        nbytes = flat.numel() * flat.element_size()
        if nbytes == 0:
            return np.empty(0, np.uint8)
        block = pool.acquire(torch, nbytes)
        dst = block[:nbytes]
        # Synchronous: when this returns the bytes are in host memory and the caller may reuse its tensor.
        dst.copy_(flat.view(torch.uint8))
        raw: np.ndarray[Any, Any] = dst.numpy()
    except EncodeError:
        raise
    except Exception as exc:
        raise EncodeError(f"cannot copy a tensor on device {tensor.device} to host memory: {exc}") from exc
    # Views of raw keep raw alive (numpy stops collapsing view bases at a non-array base), and raw keeps
    # raw.base alive: finalizing the deepest one returns the buffer only after the last view is gone.
    owner = raw.base if isinstance(raw.base, torch.Tensor) else raw
    weakref.finalize(owner, pool.release, block)
    return raw


def resolve_device(name: Any, key: str = "decode_device") -> Any:
    """The ``torch.device`` a receiver decodes tensors onto; ``None`` (CPU, no move) for ``None``/``"cpu"``.

    Checked when a connector is built, so a receiver that names a device it
    does not have fails at once, not on its first message.

    Args:
        name: a device name (``"cuda"``, ``"cuda:1"``), a ``torch.device``, or ``None``.
        key: the config key to name in errors.

    Raises:
        ConfigError: torch is not installed, the name is not a torch device,
            or the device is not available here (e.g. ``cuda`` without a GPU).
    """
    if name is None or name == "cpu":
        return None
    from . import _dtypes

    torch = _dtypes.torch_module()
    if torch is None:
        raise ConfigError(f"config key {key!r} = {name!r} needs torch: pip install 'zmq-omni[torch]'")
    if not isinstance(name, (str, torch.device)):
        raise ConfigError(f"config key {key!r} must be a torch device name, got {name!r}")
    try:
        device = torch.device(name)
    except Exception as exc:
        raise ConfigError(f"config key {key!r}: {name!r} is not a torch device ({exc})") from exc
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    # A device type torch cannot vouch for (no backend module with is_available) would fail on the first
    # message instead of here.
    if not callable(available) or not available():
        raise ConfigError(f"config key {key!r} = {name!r}: torch reports no {device.type} device here")
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise ConfigError(f"config key {key!r} = {name!r}: only {count()} {device.type} device(s) here")
    return device
