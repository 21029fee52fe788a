"""The wire format's numbers: the preamble and its flags, extension type codes, descriptor layouts, image modes.

``docs/wire-format.md`` specifies the byte layout; the names here are the ones
it uses. The encoder (:mod:`._encoder`), the decoder (:mod:`._decoder`) and the
codec's entry points (:mod:`._codec`) all read them from here.
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "EXT_ARRAY",
    "EXT_BIGINT",
    "EXT_CUSTOM",
    "EXT_IMAGE",
    "EXT_PICKLE",
    "EXT_RECORD",
    "EXT_SCALAR",
    "EXT_SLICE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "FLAG_EXT",
    "FLAG_OBJECT",
    "FLAG_PICKLE",
    "FLAG_TUPLE",
    "IMAGE_MODE_BITS",
    "LAYOUT_FORTRAN",
    "LAYOUT_OUT_OF_BAND",
    "MAGIC",
    "PREAMBLE_SIZE",
    "WIRE_VERSION",
]

#: The version byte of the preamble; a decoder rejects every other version.
WIRE_VERSION: Final = 1
#: The first three bytes of frame 0.
MAGIC: Final = b"ZOM"

#: Arrays of at least this many bytes travel as their own zero-copy frame;
#: smaller ones are copied into the header. Measured with
#: ``python benchmarks/codec.py --threshold`` (see docs/wire-format.md): below
#: this size the fixed cost of an extra ZeroMQ frame outweighs copying the bytes.
DEFAULT_INLINE_THRESHOLD: Final = 16 * 1024

# Preamble flags (byte 4): what the header holds, so the decoder can skip
# work (and refuse pickles) before parsing anything.
FLAG_EXT: Final = 0x01  # extension types present: arrays, tensors, scalars, tuples, big ints, pickles
FLAG_TUPLE: Final = 0x02  # tuple markers present
FLAG_PICKLE: Final = 0x04  # pickled objects present
FLAG_OBJECT: Final = 0x08  # object markers present: records, registered types, slices, images
_KNOWN_FLAGS: Final = FLAG_EXT | FLAG_TUPLE | FLAG_PICKLE | FLAG_OBJECT
_MARKS: Final = FLAG_TUPLE | FLAG_OBJECT

# msgpack extension type codes.
EXT_ARRAY: Final = 1
EXT_TENSOR: Final = 2
EXT_SCALAR: Final = 3
EXT_TUPLE: Final = 4
EXT_BIGINT: Final = 5
EXT_PICKLE: Final = 6
# Object markers: like the tuple marker, the first item of a msgpack array (docs/wire-format.md §4.7-4.10).
EXT_RECORD: Final = 7  # payload: type name; [marker, field map or list]
EXT_CUSTOM: Final = 8  # payload: type name; [marker, value]
EXT_SLICE: Final = 9  # empty payload; [marker, start, stop, step]
EXT_IMAGE: Final = 10  # empty payload; [marker, mode, width, height, pixels, palette]
_OBJECT_CODES: Final = frozenset((EXT_RECORD, EXT_CUSTOM, EXT_SLICE, EXT_IMAGE))

# Array descriptor layout bits (first byte of an EXT_ARRAY / EXT_TENSOR payload).
LAYOUT_FORTRAN: Final = 0x01
LAYOUT_OUT_OF_BAND: Final = 0x02
_KNOWN_LAYOUT: Final = LAYOUT_FORTRAN | LAYOUT_OUT_OF_BAND

_PREAMBLE = struct.Struct("<3sBBI")  # magic, version, flags, number of out-of-band frames
PREAMBLE_SIZE: Final = _PREAMBLE.size
_ARRAY_HEAD = struct.Struct("<BBB")  # layout, ndim, dtype name length
_SHAPES = tuple(struct.Struct(f"<{ndim}Q") for ndim in range(65))
_SHAPE_AND_REF = tuple(struct.Struct(f"<{ndim}QIQ") for ndim in range(65))
_MAX_DTYPE_NAME = 16

_N_CACHED_PREAMBLES = 64
_PREAMBLES = tuple(
    tuple(_PREAMBLE.pack(MAGIC, WIRE_VERSION, flags, n) for n in range(_N_CACHED_PREAMBLES))
    for flags in range(_KNOWN_FLAGS + 1)
)

# PIL image modes the format carries, with their bits per pixel in Pillow's raw layout
# (rows padded to whole bytes; "I", "F" and "I;16N" are little-endian, like every host this supports).
IMAGE_MODE_BITS: Final = {
    "1": 1,
    "L": 8,
    "P": 8,
    "LA": 16,
    "La": 16,
    "PA": 16,
    "I;16": 16,
    "I;16L": 16,
    "I;16B": 16,
    "I;16N": 16,
    "RGB": 24,
    "YCbCr": 24,
    "LAB": 24,
    "HSV": 24,
    "RGBA": 32,
    "RGBa": 32,
    "RGBX": 32,
    "CMYK": 32,
    "I": 32,
    "F": 32,
}
_MAX_IMAGE_SIDE: Final = (1 << 31) - 1
