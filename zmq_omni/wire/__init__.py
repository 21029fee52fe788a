"""The wire codec: objects to ``[header, buffer, ...]`` frames and back, zero-copy for large arrays.

No sockets here and no pickle unless both ends opt in. Besides the basic
types, arrays and tensors (on any device), the codec carries msgspec Structs,
dataclasses, PIL images, slices and any type registered with
:func:`register_type` on both ends. The byte layout is
specified in ``docs/wire-format.md``.
"""

from __future__ import annotations

from ._codec import DEFAULT_INLINE_THRESHOLD, WIRE_VERSION, decode, decode_each, encode, frames_nbytes
from ._dtypes import WIRE_DTYPES
from ._limits import DecodeLimits
from ._registry import register_type, unregister_type
from ._shape import brief, check_shape
from ._staging import resolve_device

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DecodeLimits",
    "WIRE_DTYPES",
    "WIRE_VERSION",
    "brief",
    "check_shape",
    "decode",
    "decode_each",
    "encode",
    "frames_nbytes",
    "register_type",
    "resolve_device",
    "unregister_type",
]
