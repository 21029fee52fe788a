"""Receiver-side bounds applied by :func:`zmq_omni.wire.decode` before it builds anything."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigError

__all__ = ["DecodeLimits"]


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    """Bounds a frame set must respect to be decoded; anything over raises ``DecodeError``.

    Declared sizes in a header are never trusted: every array size is checked
    against the bytes actually received, so these limits bound how much a
    *valid-looking* message may make the receiver hold, not whether a forged
    one can make it allocate (it cannot).

    Attributes:
        max_header_bytes: largest frame 0 (preamble plus msgpack header),
            inline arrays, strings and bytes included. Default 64 MiB.
        max_frames: largest number of out-of-band frames (frames after
            frame 0). Default 65536.
        max_total_bytes: largest sum of all frame sizes. Default 64 GiB.
        max_ndim: largest number of dimensions of one array. Default 32
            (numpy itself allows 64).
        max_depth: most arrays and maps (lists, tuples, dicts, records) nested
            inside one another in the header. Default 32, at most 256: far below
            Python's recursion limit, so no later walk of a decoded object
            (``repr``, ``==``, ``copy.deepcopy``) can recurse out of it.
        max_objects: most msgpack objects the header may decode into (every
            list, map, key, value and scalar counts one; an array is one).
            Default 1,048,576: decoded Python objects take at most about 70
            bytes per object, so one header holds at most about 72 MiB beyond
            its own bytes, whatever ``max_header_bytes`` allows.

    The last two are checked on the header's bytes, before msgpack builds any
    object; a header past either is a ``DecodeError``.
    """

    max_header_bytes: int = 64 << 20
    max_frames: int = 65536
    max_total_bytes: int = 64 << 30
    max_ndim: int = 32
    max_depth: int = 32
    max_objects: int = 1 << 20

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"DecodeLimits.{field.name} must be a non-negative int, got {value!r}")
        if self.max_ndim > 64:
            raise ConfigError(f"DecodeLimits.max_ndim must be at most 64 (numpy's limit), got {self.max_ndim}")
        if self.max_depth > MAX_DEPTH:
            raise ConfigError(f"DecodeLimits.max_depth must be at most {MAX_DEPTH}, got {self.max_depth}")


#: The highest ``max_depth`` accepted: every walk of a decoded object stays far from Python's recursion limit.
MAX_DEPTH = 256
