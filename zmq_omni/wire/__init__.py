"""The wire codec: objects to ``[header, buffer, ...]`` frames and back, zero-copy for large arrays.

No sockets here and no pickle unless both ends opt in. The byte layout is
specified in ``docs/wire-format.md``.
"""

from __future__ import annotations

from ._codec import DEFAULT_INLINE_THRESHOLD, WIRE_VERSION, decode, decode_each, encode, frames_nbytes
from ._dtypes import WIRE_DTYPES
from ._limits import DecodeLimits

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DecodeLimits",
    "WIRE_DTYPES",
    "WIRE_VERSION",
    "decode",
    "decode_each",
    "encode",
    "frames_nbytes",
]
