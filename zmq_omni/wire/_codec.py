"""Encode objects to ``[header, buffer, ...]`` frames and back, without copying large arrays.

The byte layout is specified in ``docs/wire-format.md``; the constants below
are the ones that document names. In short: frame 0 is a 9-byte preamble
followed by one msgpack object; arrays, tensors, numpy scalars, tuples, big
ints, records (msgspec Structs, dataclasses), registered types, slices, images
and (opt-in) pickles are msgpack extension types or marked lists; an array whose size is
at or above the inline threshold is carried by its own frame, referenced by
index, and that frame is a view of the array's memory.

Speed matters on two paths. Small metadata dicts (hundreds of bytes, at 100k+
messages/s) go through msgpack's C packer and unpacker untouched: the Python
hooks only run for the few types msgpack cannot carry natively, and a preamble
flag lets the decoder skip them altogether when the header holds none. Large
arrays are never copied, so their cost is a constant per array; bounded memos
of out-of-band descriptors (by dtype, shape and frame index) keep that
constant small for the shapes a pipeline sends again and again.
"""

from __future__ import annotations

import importlib
import math
import operator
import pickle
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import numpy as np

from ..errors import DecodeError, EncodeError
from . import _dtypes, _registry, _staging
from ._limits import DecodeLimits
from ._shape import CONTAINER_MAP, brief, check_shape, walk_shape

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "WIRE_VERSION",
    "decode",
    "encode",
    "frames_nbytes",
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
_FRAME_REF = struct.Struct("<IQ")  # frame index, nbytes
_SHAPES = tuple(struct.Struct(f"<{ndim}Q") for ndim in range(65))
_SHAPE_AND_REF = tuple(struct.Struct(f"<{ndim}QIQ") for ndim in range(65))
_MAX_DTYPE_NAME = 16

_N_CACHED_PREAMBLES = 64
_PREAMBLES = tuple(
    tuple(_PREAMBLE.pack(MAGIC, WIRE_VERSION, flags, n) for n in range(_N_CACHED_PREAMBLES))
    for flags in range(_KNOWN_FLAGS + 1)
)

_INT64_MIN: Final = -(1 << 63)
_UINT64_END: Final = 1 << 64

_TUPLE_EXT = msgpack.ExtType(EXT_TUPLE, b"")
# What an idle encoder's frame list points to; only a call in progress appends.
_NO_FRAMES: list[bytes | memoryview] = []
_ExtType = msgpack.ExtType
# ExtType.__new__ re-validates its arguments in Python; ours are valid by
# construction, and this path runs once per array.
_new_ext = tuple.__new__
_byte_arrays = _staging.byte_arrays
byte_array = _staging.byte_array
# An encoding with at least this many bytes of inline arrays, and at most this many others, is walked at once.
_WALK_INLINE_BYTES: Final = 1024
_DEFAULT_LIMITS = DecodeLimits()
_unpackb = msgpack.unpackb
# Frame 0 of a plain-msgpack encoding (no extension types, no out-of-band frames) starts with exactly this.
_PLAIN_PREAMBLE: Final = _PREAMBLE.pack(MAGIC, WIRE_VERSION, 0, 0)


class _TupleMark:
    """Decoded form of the tuple marker; only ever seen by ``_Decoding.list_hook``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tuple marker>"


_TUPLE_MARK = _TupleMark()


class _ObjectMark:
    """Decoded form of an object marker (RECORD, CUSTOM, SLICE, IMAGE); only ever seen by ``list_hook``."""

    __slots__ = ("code", "name")

    def __init__(self, code: int, name: str) -> None:
        self.code = code
        self.name = name

    def __repr__(self) -> str:
        return f"<object marker {self.code} {self.name!r}>"


_SLICE_EXT = msgpack.ExtType(EXT_SLICE, b"")
_IMAGE_EXT = msgpack.ExtType(EXT_IMAGE, b"")
# Ext payloads of type names, by name (bounded like the descriptor memos).
_name_exts: dict[tuple[int, str], msgpack.ExtType] = {}


def _named_ext(code: int, name: str) -> msgpack.ExtType:
    ext = _name_exts.get((code, name))
    if ext is None:
        if len(_name_exts) >= 4096:
            _name_exts.clear()
        ext = _name_exts[code, name] = msgpack.ExtType(code, name.encode("utf-8", "surrogatepass"))
    return ext


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


def _type_name(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------- encoding


class _Encoder:
    """One msgpack packer plus the state of the ``encode`` call it serves.

    Each thread keeps one, so the hot path allocates no packer; a re-entrant
    call (a ``__reduce__`` that encodes, under ``allow_pickle``) gets a fresh one.
    """

    __slots__ = ("allow_pickle", "busy", "flags", "frames", "inline", "pack", "threshold")

    def __init__(self) -> None:
        # strict_types routes tuples, numpy scalars (np.float64 is a float
        # subclass) and other subclasses to _default instead of letting
        # msgpack flatten them silently; datetime=False keeps datetimes out.
        packer = msgpack.Packer(default=self._default, strict_types=True, use_bin_type=True, datetime=False)
        self.pack = packer.pack
        # The frame list of the call in progress: a placeholder for the
        # header, then one buffer per out-of-band array, so an array's frame
        # index is its position here.
        self.frames: list[bytes | memoryview] = _NO_FRAMES
        self.flags = 0
        self.threshold = DEFAULT_INLINE_THRESHOLD
        self.inline = 0  # bytes of arrays copied into the header by the call in progress
        self.allow_pickle = False
        self.busy = False

    def _default(self, obj: Any) -> Any:
        """Hook msgpack calls for every object it cannot pack natively."""
        cls = type(obj)
        if cls is np.ndarray:
            # Fast path for the common large array: allowed dtype, C-contiguous,
            # out of band. Everything else takes the general path in _array.
            dtype = obj.dtype
            if dtype in _OOB_PREFIXES:
                view = memoryview(obj)
                nbytes = view.nbytes
                if nbytes >= self.threshold and nbytes and view.c_contiguous:
                    self.flags |= FLAG_EXT
                    frames = self.frames
                    index = len(frames)
                    frames.append(view.cast("B"))
                    # view.shape is never None for an ndarray's buffer.
                    key: tuple[np.dtype[Any], tuple[int, ...], int] = (dtype, view.shape, index)  # type: ignore[assignment]
                    ext = _oob_ext_memo.get(key)
                    return _oob_ext(key, nbytes) if ext is None else ext
                if nbytes < self.threshold and view.c_contiguous:
                    # Fast path for a small C-contiguous array: the bytes _descriptor would build.
                    self.flags |= FLAG_EXT
                    shape = view.shape
                    ndim = len(shape)  # type: ignore[arg-type]
                    head = _INLINE_PREFIXES[dtype][ndim]
                    if ndim == 1:
                        head += _SHAPES[1].pack(shape[0])  # type: ignore[index]
                    elif ndim:
                        head += _SHAPES[ndim].pack(*shape)  # type: ignore[misc]
                    self.inline += nbytes
                    return _new_ext(_ExtType, (EXT_ARRAY, head + view.tobytes()))
            return self._array(obj)
        plan = _registry.struct_plans.get(cls)
        if plan is not None and cls not in _registry.by_type:
            # A Struct class seen before and not registered (vllm-omni's payloads): its RECORD at once.
            self.flags |= FLAG_EXT | FLAG_OBJECT
            return [plan.marker, _registry.struct_value(plan, obj)]
        if cls is tuple:
            self.flags |= FLAG_EXT | FLAG_TUPLE
            return [_TUPLE_EXT, *obj]
        if isinstance(obj, np.generic):
            return self._scalar(obj)
        if cls is int:  # msgpack calls back only when the int does not fit in 64 bits
            return self._bigint(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor(torch, obj)
        return self._object(obj)

    def _object(self, obj: Any) -> Any:
        """Registered types, Structs and dataclasses, slices and PIL images; then subclasses of the basics."""
        entry = _registry.by_type.get(type(obj))
        if entry is not None:
            self.flags |= FLAG_EXT | FLAG_OBJECT
            try:
                value = entry.encode(obj)
            except EncodeError:
                raise
            except Exception as exc:
                raise EncodeError(f"the encode function registered for {entry.name!r} failed: {exc!r}") from exc
            return [_named_ext(EXT_RECORD if entry.record else EXT_CUSTOM, entry.name), value]
        if type(obj) is slice:
            try:
                parts = [None if part is None else operator.index(part) for part in (obj.start, obj.stop, obj.step)]
            except TypeError:
                return self._unsupported(obj, "slice bounds must be ints or None")
            self.flags |= FLAG_EXT | FLAG_OBJECT
            return [_SLICE_EXT, *parts]
        record = _registry.record_of(obj)
        if record is not None:
            self.flags |= FLAG_EXT | FLAG_OBJECT
            return [_named_ext(EXT_RECORD, record[0]), record[1]]
        image = sys.modules.get("PIL.Image")
        if image is not None and isinstance(obj, image.Image):
            return self._image(obj)
        return self._subclass(obj)

    def _image(self, img: Any) -> Any:
        mode = img.mode
        if mode not in IMAGE_MODE_BITS:
            return self._unsupported(img, f"PIL image mode {mode!r} is not carried; convert it, e.g. to 'RGB'")
        self.flags |= FLAG_EXT | FLAG_OBJECT
        width, height = img.size
        # One copy, in Pillow's raw layout; a large image then travels out of band without another.
        pixels = np.frombuffer(img.tobytes(), np.uint8)
        palette = None
        if mode in ("P", "PA") and img.palette is not None:
            raw_mode = img.palette.mode if img.palette.mode in ("RGB", "RGBA") else "RGB"
            values = img.getpalette(raw_mode)
            if values is not None:
                palette = [raw_mode, bytes(values)]
        return [_IMAGE_EXT, mode, width, height, pixels, palette]

    def _subclass(self, obj: Any) -> Any:
        """Subclasses of supported types travel as their base type (a namedtuple comes back a tuple)."""
        if isinstance(obj, np.ndarray):
            masked = sys.modules.get("numpy.ma")
            if masked is not None and isinstance(obj, masked.MaskedArray):
                return self._unsupported(obj, "a masked array would lose its mask")
            return self._array(np.asarray(obj))
        if isinstance(obj, tuple):
            self.flags |= FLAG_EXT | FLAG_TUPLE
            return [_TUPLE_EXT, *obj]
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, int):  # IntEnum, IntFlag, ...
            value = int(obj)
            return value if _INT64_MIN <= value < _UINT64_END else self._bigint(value)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray)):
            return bytes(obj)
        return self._unsupported(obj, "")

    def _unsupported(self, obj: object, why: str) -> msgpack.ExtType:
        if not self.allow_pickle:
            detail = f" ({why})" if why else ""
            raise EncodeError(
                f"cannot encode object of type {_type_name(obj)}{detail}; "
                "supported: None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays and "
                "scalars, torch tensors, slices, msgspec Structs, dataclasses, PIL images and types "
                "registered with zmq_omni.register_type (pass allow_pickle=True on both ends for anything else)"
            )
        self.flags |= FLAG_EXT | FLAG_PICKLE
        return msgpack.ExtType(EXT_PICKLE, pickle.dumps(obj, protocol=5))

    def _bigint(self, value: int) -> msgpack.ExtType:
        self.flags |= FLAG_EXT
        return _new_ext(_ExtType, (EXT_BIGINT, value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)))

    def _scalar(self, obj: np.generic) -> Any:
        name = _dtypes.wire_name_of_numpy(obj.dtype)
        if name is None:
            if isinstance(obj, str):  # np.str_
                return str(obj)
            if isinstance(obj, bytes):  # np.bytes_
                return bytes(obj)
            return self._unsupported(obj, f"numpy scalar of dtype {obj.dtype}")
        self.flags |= FLAG_EXT
        return _new_ext(_ExtType, (EXT_SCALAR, _scalar_prefix(name) + obj.tobytes()))

    def _array(self, arr: np.ndarray[Any, Any]) -> msgpack.ExtType:
        name = _dtypes.wire_name_of_numpy(arr.dtype)
        if name is None:
            return self._unsupported(arr, f"numpy array of dtype {arr.dtype}")
        flags = arr.flags
        if flags.c_contiguous:
            layout = 0
        elif flags.f_contiguous:
            layout = LAYOUT_FORTRAN
        else:
            # The one copy this codec makes of a large array: strided views
            # have no single buffer a frame could expose.
            arr = np.ascontiguousarray(arr)
            layout = 0
        return self._descriptor(EXT_ARRAY, name, arr.shape, layout, arr)

    def _tensor(self, torch: Any, tensor: Any) -> msgpack.ExtType:
        if type(tensor) is torch.Tensor:
            # A plain contiguous CPU tensor: its bytes read, or viewed, straight from its memory. Each torch
            # call through its dispatcher (detach, view, numpy) costs tens of microseconds once the caches
            # went cold (a put every 20 ms); these are attribute reads and direct methods.
            heads = _torch_prefixes(torch).get(tensor.dtype)
            if (
                heads is not None
                and tensor.is_cpu
                and tensor.layout is torch.strided
                and tensor.is_contiguous()
                and not tensor.is_neg()
                and not tensor.is_conj()
            ):
                shape = tensor.shape
                ndim = len(shape)
                nbytes = tensor.nbytes
                if ndim <= 64 and nbytes:
                    self.flags |= FLAG_EXT
                    if nbytes < self.threshold:
                        # The bytes at the tensor's address, without ctypes.string_at's foreign call.
                        data = (_byte_arrays.get(nbytes) or byte_array(nbytes)).from_address(tensor.data_ptr()).raw
                        self.inline += nbytes
                        return _new_ext(_ExtType, (EXT_TENSOR, heads[0][ndim] + _SHAPES[ndim].pack(*shape) + data))
                    frames = self.frames
                    index = len(frames)
                    frames.append(_tensor_bytes(tensor, nbytes))
                    ref = _SHAPE_AND_REF[ndim].pack(*shape, index, nbytes)
                    return _new_ext(_ExtType, (EXT_TENSOR, heads[1][ndim] + ref))
        name = _dtypes.wire_name_of_torch(torch, tensor.dtype) if tensor.layout == torch.strided else None
        if name is None:
            return self._unsupported(tensor, f"torch tensor of dtype {tensor.dtype}, layout {tensor.layout}")
        tensor = tensor.detach()
        if tensor.is_cpu and tensor.is_contiguous() and not tensor.is_neg() and not tensor.is_conj():
            # The common case (a contiguous CPU tensor with no lazy conjugate or negation), in the fewest torch calls.
            flat = tensor.view(-1)
            if flat.stride(0) == 1:
                return self._descriptor(EXT_TENSOR, name, tuple(tensor.shape), 0, flat.view(torch.uint8).numpy(), True)
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():
            tensor = tensor.resolve_neg()
        if tensor.device.type != "cpu":
            # One copy to host memory (pinned and reused for CUDA); the frames view that copy.
            return self._descriptor(EXT_TENSOR, name, tuple(tensor.shape), 0, _staging.stage_to_host(torch, tensor))
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        flat = tensor.reshape(-1)
        if flat.stride(0) != 1:
            # Zero or one element counts as contiguous whatever its stride (x[:, :1] of a strided view),
            # but a byte view needs stride 1: copy it (a plain clone would keep the stride).
            flat = flat.clone(memory_format=torch.contiguous_format)
        # A uint8 numpy view of the storage: no copy, and it works for
        # bfloat16, which numpy cannot represent.
        raw = flat.view(torch.uint8).numpy()
        return self._descriptor(EXT_TENSOR, name, tuple(tensor.shape), 0, raw)

    def _descriptor(
        self,
        code: int,
        name: str,
        shape: tuple[int, ...],
        layout: int,
        data: np.ndarray[Any, Any],
        flat_bytes: bool = False,
    ) -> msgpack.ExtType:
        """Build an array/tensor extension; ``data`` is contiguous in ``layout`` order (``flat_bytes``: 1-D uint8)."""
        self.flags |= FLAG_EXT
        nbytes = data.nbytes
        ndim = len(shape)
        if ndim > 64:
            raise EncodeError(f"cannot encode an array of {ndim} dimensions (at most 64)")
        if nbytes >= self.threshold:
            flat = data if flat_bytes else data.reshape(-1, order="F" if layout else "C").view(np.uint8)
            index = len(self.frames)
            self.frames.append(flat.data)
            return _new_ext(
                _ExtType,
                (
                    code,
                    _descriptor_prefix(layout | LAYOUT_OUT_OF_BAND, ndim, name)
                    + _SHAPE_AND_REF[ndim].pack(*shape, index, nbytes),
                ),
            )
        self.inline += nbytes
        # tobytes(order="A") keeps Fortran order for F-contiguous data.
        return _new_ext(
            _ExtType,
            (code, _descriptor_prefix(layout, ndim, name) + _SHAPES[ndim].pack(*shape) + data.tobytes(order="A")),
        )


def _descriptor_prefix(layout: int, ndim: int, name: str) -> bytes:
    """Layout byte, ndim byte, dtype name length and dtype name of an array descriptor."""
    encoded = name.encode("ascii")
    return _ARRAY_HEAD.pack(layout, ndim, len(encoded)) + encoded


_scalar_prefix_cache: dict[str, bytes] = {}
# Precomputed out-of-band descriptor prefixes for the encoder's fast path, by
# numpy dtype then ndim. Only dtypes whose buffer format memoryview can cast
# to bytes are here (bfloat16 takes the general path).
_OOB_PREFIXES: dict[np.dtype[Any], tuple[bytes, ...]] = {
    dtype: tuple(_descriptor_prefix(LAYOUT_OUT_OF_BAND, ndim, name) for ndim in range(65))
    for dtype, name in _dtypes.NAME_OF_NUMPY.items()
}
# The same for inline C-order arrays (layout 0).
_INLINE_PREFIXES: dict[np.dtype[Any], tuple[bytes, ...]] = {
    dtype: tuple(_descriptor_prefix(0, ndim, name) for ndim in range(65))
    for dtype, name in _dtypes.NAME_OF_NUMPY.items()
}


# Out-of-band array extensions by (dtype, shape, frame index): pipelines send
# the same shapes over and over, and building the extension is most of the
# encoder's per-array cost. Bounded; cleared when full.
_oob_ext_memo: dict[tuple[np.dtype[Any], tuple[int, ...], int], msgpack.ExtType] = {}
_MEMO_SIZE: Final = 1024


def _oob_ext(key: tuple[np.dtype[Any], tuple[int, ...], int], nbytes: int) -> msgpack.ExtType:
    """The ARRAY extension of a C-contiguous out-of-band array (the encoder's fast path), memoized."""
    dtype, shape, index = key
    ndim = len(shape)
    # Spelled-out arguments for the common ranks: pack(*shape, ...) costs twice as much.
    if ndim == 1:
        ref = _SHAPE_AND_REF[1].pack(shape[0], index, nbytes)
    elif ndim == 2:
        ref = _SHAPE_AND_REF[2].pack(shape[0], shape[1], index, nbytes)
    else:
        ref = _SHAPE_AND_REF[ndim].pack(*shape, index, nbytes)
    ext: msgpack.ExtType = _new_ext(_ExtType, (EXT_ARRAY, _OOB_PREFIXES[dtype][ndim] + ref))
    if len(_oob_ext_memo) >= _MEMO_SIZE:
        _oob_ext_memo.clear()
    _oob_ext_memo[key] = ext
    return ext


_torch_heads: dict[Any, tuple[tuple[bytes, ...], tuple[bytes, ...]]] = {}


def _torch_prefixes(torch: Any) -> dict[Any, tuple[tuple[bytes, ...], tuple[bytes, ...]]]:
    """Descriptor prefixes by torch dtype: (inline by ndim, out of band by ndim), built at the first tensor."""
    if not _torch_heads:
        for dtype, name in _dtypes.torch_names(torch).items():
            inline = tuple(_descriptor_prefix(0, ndim, name) for ndim in range(65))
            oob = tuple(_descriptor_prefix(LAYOUT_OUT_OF_BAND, ndim, name) for ndim in range(65))
            _torch_heads[dtype] = (inline, oob)
    return _torch_heads


class _TensorMemory:
    """A tensor's memory as numpy's array interface sees it; holds the tensor while an array views it."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: Any, nbytes: int) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _tensor_bytes(tensor: Any, nbytes: int) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory that keeps the tensor alive (no torch dispatcher call)."""
    return np.asarray(_TensorMemory(tensor, nbytes)).data


def _scalar_prefix(name: str) -> bytes:
    prefix = _scalar_prefix_cache.get(name)
    if prefix is None:
        encoded = name.encode("ascii")
        prefix = _scalar_prefix_cache[name] = bytes((len(encoded),)) + encoded
    return prefix


_local = threading.local()


def encode(
    obj: object,
    *,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    allow_pickle: bool = False,
    limits: DecodeLimits | None = None,
) -> list[bytes | memoryview]:
    """Encode ``obj`` into frames: ``[header, buffer_1, ..., buffer_n]``.

    ``header`` (``bytes``) is the preamble plus a msgpack description of the
    object tree. Every numpy array or torch CPU tensor of at least
    ``inline_threshold`` bytes becomes one of the following frames, in the
    order the arrays appear in the tree: a flat ``uint8`` ``memoryview`` over
    the array's own memory (C- or Fortran-contiguous arrays are not copied;
    other strided arrays are copied once into a C-contiguous buffer).
    Smaller arrays are copied into the header.

    The frames alias the caller's arrays: do not modify those arrays until
    the frames have been sent (with ``copy=False``, until ZeroMQ released
    them) or dropped.

    Args:
        obj: None, bool, int (any size), float, str, bytes, bytearray,
            memoryview, list, tuple, dict (str or int keys), numpy arrays and
            scalars of the allowed dtypes, torch CPU tensors; subclasses of
            these travel as their base type.
        inline_threshold: size in bytes from which an array gets its own frame.
        allow_pickle: pickle objects of any other type instead of raising.
            The receiver must opt in too. Only for trusted peers.
        limits: the receiving side's header depth and object limits (default
            ``DecodeLimits()``): an object tree they would reject is refused here,
            so the put fails at once instead of being dropped on arrival.

    Returns:
        The frames, ready for ``socket.send_multipart(frames, copy=False)``.

    Raises:
        EncodeError: an object (named in the message) cannot be encoded, or its
            tree is deeper or has more objects than ``limits`` allow.
    """
    try:
        encoder: _Encoder = _local.encoder
    except AttributeError:
        encoder = _local.encoder = _Encoder()
    if encoder.busy:
        encoder = _Encoder()
    if inline_threshold < 0:
        raise EncodeError(f"inline_threshold must be >= 0, got {inline_threshold}")
    frames: list[bytes | memoryview] = [b""]
    encoder.frames = frames
    encoder.flags = 0
    encoder.threshold = inline_threshold
    encoder.inline = 0
    encoder.allow_pickle = allow_pickle
    encoder.busy = True
    try:
        body = encoder.pack(obj)
    except EncodeError:
        raise
    except Exception as exc:
        raise EncodeError(f"cannot encode {_type_name(obj)}: {exc}") from exc
    finally:
        encoder.busy = False
        # Drop the references so this thread's encoder does not pin the arrays.
        encoder.frames = _NO_FRAMES
    lim = _DEFAULT_LIMITS if limits is None else limits
    # Bytes of inline arrays look like msgpack containers (one in seven at random), so counting them would only
    # send a header that holds some to the walk anyway; when the rest of the header is short, walk it at once.
    inline = encoder.inline
    if (
        len(body) > lim.max_objects
        or (inline >= _WALK_INLINE_BYTES and len(body) - inline <= _WALK_INLINE_BYTES)
        or body.translate(CONTAINER_MAP).count(1) > lim.max_depth
    ):
        try:
            walk_shape(body, lim.max_depth, lim.max_objects)
        except DecodeError as exc:
            raise EncodeError(f"cannot encode {_type_name(obj)}: a receiver would refuse it ({exc})") from None
    n_oob = len(frames) - 1
    if n_oob < _N_CACHED_PREAMBLES:
        frames[0] = _PREAMBLES[encoder.flags][n_oob] + body
    elif n_oob > 0xFFFFFFFF:
        raise EncodeError(f"too many out-of-band arrays ({n_oob})")
    else:
        frames[0] = _PREAMBLE.pack(MAGIC, WIRE_VERSION, encoder.flags, n_oob) + body
    return frames


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size in bytes of a frame set (any buffer-protocol objects)."""
    total = 0
    for frame in frames:
        cls = type(frame)
        if cls is bytes or cls is bytearray:
            total += len(frame)
        elif cls is memoryview:
            total += frame.nbytes
        else:
            total += memoryview(frame).nbytes
    return total


# ---------------------------------------------------------------- decoding


def _reject_ext(code: int, data: bytes) -> object:
    raise DecodeError(f"extension type {code} in a header whose preamble declares none")


# Array descriptor prefixes (layout, ndim, dtype name) that passed validation,
# parsed. Only valid prefixes enter, so the memo holds at most
# 4 layouts x 65 ndims x len(WIRE_DTYPES) entries whatever peers send.
_prefix_memo: dict[bytes, tuple[int, int, np.dtype[Any]]] = {}
# Whole C-order out-of-band descriptors that passed the checks that do not
# depend on the frames (dtype, layout, length, declared size), parsed into
# ndim, shape, dtype, frame index and size, for the decoder's fast path.
# Bounded like the encoder's memo.
_oob_descriptors: dict[bytes, tuple[int, tuple[int, ...], np.dtype[Any], int, int]] = {}


# The same for tensor descriptors, whose dtype only sizes the bytes: a bfloat16 tensor never needs
# ml_dtypes, whose import (0.3-0.9 s) would otherwise fall on the first message that carries one.
_tensor_prefix_memo: dict[bytes, tuple[int, int, np.dtype[Any]]] = {}


def _parse_prefix(prefix: bytes, tensor: bool = False) -> tuple[int, int, np.dtype[Any]]:
    layout, ndim, name_len = _ARRAY_HEAD.unpack_from(prefix)
    if layout & ~_KNOWN_LAYOUT:
        raise DecodeError(f"unknown array layout bits {layout:#04x}")
    if ndim > 64:
        raise DecodeError(f"array has {ndim} dimensions, more than numpy's 64")
    name = prefix[_ARRAY_HEAD.size :]
    dtype = None
    if len(name) == name_len <= _MAX_DTYPE_NAME:
        dtype = _dtypes.raw_numpy_dtype_for(name) if tensor else _dtypes.numpy_dtype_for(name)
    if dtype is None:
        raise DecodeError(f"dtype {name!r} is not in the wire format's allow-list")
    entry = (layout, ndim, dtype)
    (_tensor_prefix_memo if tensor else _prefix_memo)[prefix] = entry
    return entry


def _parse_oob(data: bytes) -> tuple[int, tuple[int, ...], np.dtype[Any], int, int] | None:
    """Parse and memoize a valid C-order out-of-band descriptor; ``None`` for anything else.

    ``None`` sends the descriptor down ``_Decoding._array``, which makes every
    check again and raises the precise error.
    """
    if len(data) < _ARRAY_HEAD.size or data[0] != LAYOUT_OUT_OF_BAND:
        return None
    pos = _ARRAY_HEAD.size + data[2]
    prefix = data[:pos]
    entry = _prefix_memo.get(prefix)
    if entry is None:
        try:
            entry = _parse_prefix(prefix)
        except DecodeError:
            return None
    ndim, dtype = entry[1], entry[2]
    ref = _SHAPE_AND_REF[ndim]
    if len(data) != pos + ref.size:
        return None
    fields = ref.unpack_from(data, pos)
    shape = fields[:ndim]
    nbytes = math.prod(shape) * dtype.itemsize
    if fields[ndim + 1] != nbytes:
        return None
    parsed = (ndim, shape, dtype, fields[ndim], nbytes)
    if len(_oob_descriptors) >= _MEMO_SIZE:
        _oob_descriptors.clear()
    _oob_descriptors[data] = parsed
    return parsed


class _Decoding:
    """State of one ``decode`` call, reached from msgpack's hooks."""

    __slots__ = ("allow_pickle", "count", "device", "flags", "frames", "limits", "next_frame", "open_marks", "total")

    def __init__(
        self,
        frames: Sequence[Any],
        count: int,
        flags: int,
        allow_pickle: bool,
        limits: DecodeLimits,
        total: int,
        device: Any = None,
    ) -> None:
        self.device = device
        self.frames = frames
        self.count = count
        self.flags = flags
        self.allow_pickle = allow_pickle
        self.limits = limits
        self.next_frame = 1
        # Markers (tuple and object) decoded but not yet consumed as the first item of a list.
        self.open_marks = 0
        self.total = total

    def ext_hook(self, code: int, data: bytes) -> object:
        if code == EXT_ARRAY and data and not data[0]:
            # Fast path for a small inline C-order array (metadata-sized messages): a private, writable
            # copy like _array's. Anything unusual or invalid takes _array, which raises the errors.
            pos = _ARRAY_HEAD.size + data[2] if len(data) >= _ARRAY_HEAD.size else 0
            entry = _prefix_memo.get(data[:pos]) if pos else None
            if entry is not None and entry[1] <= self.limits.max_ndim:
                ndim, dtype = entry[1], entry[2]
                end = pos + 8 * ndim
                if len(data) > end:
                    shape = _SHAPES[ndim].unpack_from(data, pos)
                    if len(data) - end == math.prod(shape) * dtype.itemsize:
                        flat = np.frombuffer(data, dtype, -1, end).copy()
                        return flat if ndim == 1 else flat.reshape(shape)
            return self._array(code, data)
        if code == EXT_ARRAY:
            # Inlined fast path for a C-order out-of-band array (one per large
            # array; this is most of the codec's cost at >= 1 MiB). It makes
            # the same checks as _array, which handles everything else and
            # raises the errors.
            fast = _oob_descriptors.get(data)
            if fast is None:
                fast = _parse_oob(data)
            if fast is not None:
                ndim, shape, dtype, index, nbytes = fast
                if index == self.next_frame and index < self.count and ndim <= self.limits.max_ndim:
                    frame = self.frames[index]
                    cls = type(frame)
                    if cls is bytes:
                        size = len(frame)
                    else:
                        if cls is not memoryview:
                            frame = memoryview(frame)
                        size = frame.nbytes
                    total = self.total + nbytes
                    if size == nbytes and total <= self.limits.max_total_bytes:
                        self.total = total
                        self.next_frame = index + 1
                        if ndim == 1:
                            return np.frombuffer(frame, dtype)
                        return np.ndarray(shape, dtype, frame)
            # Anything else, including every error, takes the general path.
            return self._array(code, data)
        if code == EXT_TENSOR:
            return self._array(code, data)
        if code == EXT_TUPLE:
            if data or not self.flags & FLAG_TUPLE:
                raise DecodeError("malformed tuple marker")
            self.open_marks += 1
            return _TUPLE_MARK
        if code == EXT_SCALAR:
            return self._scalar(data)
        if code == EXT_BIGINT:
            if not data:
                raise DecodeError("empty big-int extension")
            return int.from_bytes(data, "big", signed=True)
        if code == EXT_PICKLE:
            if not self.allow_pickle or not self.flags & FLAG_PICKLE:
                raise DecodeError("pickled content rejected: this decoder has not opted in (allow_pickle=False)")
            return pickle.loads(data)
        if code in _OBJECT_CODES:
            return self._mark(code, data)
        raise DecodeError(f"unknown extension type code {code}")

    def _mark(self, code: int, data: bytes) -> _ObjectMark:
        if not self.flags & FLAG_OBJECT:
            raise DecodeError(f"object marker (extension type {code}) in a header whose preamble declares none")
        if code in (EXT_RECORD, EXT_CUSTOM):
            if not 0 < len(data) <= _registry.MAX_NAME_BYTES:
                raise DecodeError(f"type name of {len(data)} bytes (1 to {_registry.MAX_NAME_BYTES} allowed)")
            try:
                name = data.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError as exc:
                raise DecodeError(f"type name is not UTF-8: {brief(data)}") from exc
        elif data:
            raise DecodeError(f"marker of extension type {code} must be empty, got {len(data)} bytes")
        else:
            name = ""
        self.open_marks += 1
        return _ObjectMark(code, name)

    def list_hook(self, items: list[Any]) -> object:
        if items:
            first = items[0]
            if first is _TUPLE_MARK:
                self.open_marks -= 1
                return tuple(items[1:])
            if type(first) is _ObjectMark:
                self.open_marks -= 1
                return self._build(first, items)
        return items

    def _build(self, mark: _ObjectMark, items: list[Any]) -> object:
        """The object a marked list stands for; every shape and type is checked first."""
        code = mark.code
        if code == EXT_SLICE:
            if len(items) != 4 or any(part is not None and type(part) is not int for part in items[1:]):
                raise DecodeError("a slice is [marker, start, stop, step], each an int or nil")
            return slice(items[1], items[2], items[3])
        if code == EXT_IMAGE:
            return _build_image(items)
        if len(items) != 2:
            raise DecodeError(
                f"a {'record' if code == EXT_RECORD else 'registered object'} is [marker, value], "
                f"got {len(items) - 1} items after the marker"
            )
        value = items[1]
        entry = _registry.by_name.get(mark.name)
        if entry is None:
            if code == EXT_RECORD:
                if type(value) is not dict and type(value) is not list:
                    raise DecodeError(f"record {mark.name!r} holds a {type(value).__name__}, not a map or list")
                # Not registered here: the field map (or list) vllm-omni's serializer yields.
                return value
            raise DecodeError(
                f"unknown registered type {mark.name!r}: register it with zmq_omni.register_type on this side too"
            )
        try:
            return entry.decode(value)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"the decode function registered for {mark.name!r} failed: {exc!r}") from exc

    def _scalar(self, data: bytes) -> object:
        if not data:
            raise DecodeError("empty scalar extension")
        name_len = data[0]
        name = data[1 : 1 + name_len]
        dtype = _dtypes.numpy_dtype_for(name) if len(name) == name_len <= _MAX_DTYPE_NAME else None
        if dtype is None:
            raise DecodeError(f"dtype {name!r} is not in the wire format's allow-list")
        raw = data[1 + name_len :]
        if len(raw) != dtype.itemsize:
            raise DecodeError(f"scalar of dtype {dtype} needs {dtype.itemsize} bytes, got {len(raw)}")
        return np.frombuffer(raw, dtype=dtype)[0]

    def _array(self, code: int, data: bytes) -> object:
        # Everything is checked against the bytes actually present before an
        # array is built; building one allocates nothing but the view.
        pos = _ARRAY_HEAD.size + data[2]
        prefix = data[:pos]
        tensor = code == EXT_TENSOR
        entry = (_tensor_prefix_memo if tensor else _prefix_memo).get(prefix)
        layout, ndim, dtype = _parse_prefix(prefix, tensor) if entry is None else entry
        if ndim > self.limits.max_ndim:
            raise DecodeError(f"array has {ndim} dimensions, limit is {self.limits.max_ndim}")
        buf: memoryview | bytearray
        if layout & LAYOUT_OUT_OF_BAND:
            if len(data) != pos + _SHAPE_AND_REF[ndim].size:
                raise DecodeError(f"array descriptor of {len(data)} bytes, expected {pos + _SHAPE_AND_REF[ndim].size}")
            fields = _SHAPE_AND_REF[ndim].unpack_from(data, pos)
            shape = fields[:ndim]
            index = fields[ndim]
            declared = fields[ndim + 1]
            nbytes = math.prod(shape) * dtype.itemsize
            if index != self.next_frame or index >= len(self.frames):
                raise DecodeError(
                    f"array refers to frame {index}; expected frame {self.next_frame} "
                    f"of {len(self.frames) - 1} (each frame is used once, in order)"
                )
            if declared != nbytes:
                raise DecodeError(f"array declares {declared} bytes but shape {shape} x {dtype} is {nbytes}")
            buf = memoryview(self.frames[index])
            if buf.nbytes != nbytes:
                raise DecodeError(f"frame {index} holds {buf.nbytes} bytes, its array needs {nbytes}")
            self.total += nbytes
            if self.total > self.limits.max_total_bytes:
                raise DecodeError(f"frames hold more than the limit of {self.limits.max_total_bytes} bytes")
            self.next_frame = index + 1
        else:
            shape = _SHAPES[ndim].unpack_from(data, pos)
            pos += 8 * ndim
            nbytes = math.prod(shape) * dtype.itemsize
            if len(data) - pos != nbytes:
                raise DecodeError(f"inline array needs {nbytes} bytes, got {len(data) - pos}")
            # A private, writable copy; inline arrays are small by definition.
            buf = bytearray(memoryview(data)[pos:])
        if tensor:
            return self._tensor(data[_ARRAY_HEAD.size : _ARRAY_HEAD.size + data[2]], shape, layout, buf)
        return np.ndarray(shape, dtype, buf, order="F" if layout & LAYOUT_FORTRAN else "C")

    def _tensor(self, name: bytes, shape: tuple[int, ...], layout: int, buf: Any) -> object:
        if layout & LAYOUT_FORTRAN:
            raise DecodeError("tensor descriptors are always C order")
        torch = _dtypes.torch_module()
        if torch is None:
            # No torch on this side: the same bytes as a numpy array (the name is allowed: the prefix was parsed).
            return np.ndarray(shape, _dtypes.numpy_dtype_for(name), buf)
        tdtype = _dtypes.torch_dtype_for(torch, name)
        if tdtype is None:
            raise DecodeError(f"dtype {name!r} is not a torch tensor dtype")
        if len(buf) == 0:
            tensor = torch.empty(shape, dtype=tdtype)
        else:
            if isinstance(buf, memoryview) and buf.readonly:
                # torch has no read-only tensors; aliasing an immutable buffer
                # would let a write corrupt it, so copy once.
                buf = bytearray(buf)
            tensor = torch.frombuffer(buf, dtype=tdtype).reshape(shape)
        if self.device is None:
            return tensor
        try:
            return tensor.to(self.device)
        except Exception as exc:
            raise DecodeError(f"cannot move a decoded tensor of {tensor.nbytes} bytes to {self.device}: {exc}") from exc


def _build_image(items: list[Any]) -> object:
    """A PIL image from ``[marker, mode, width, height, pixels, palette]``, checked before Pillow allocates."""
    if len(items) != 6:
        raise DecodeError(f"an image is [marker, mode, width, height, pixels, palette], got {len(items)} items")
    _, mode, width, height, pixels, palette = items
    bits = IMAGE_MODE_BITS.get(mode) if type(mode) is str else None
    if bits is None:
        raise DecodeError(f"image mode {brief(mode)} is not carried by the wire format")
    if (
        type(width) is not int
        or type(height) is not int
        or not (0 <= width <= _MAX_IMAGE_SIDE and 0 <= height <= _MAX_IMAGE_SIDE)
    ):
        raise DecodeError(f"image size {brief(width)} x {brief(height)} is not two ints in [0, 2**31)")
    if type(pixels) is not np.ndarray or pixels.dtype != np.uint8 or pixels.ndim != 1:
        raise DecodeError("image pixels must be a 1-D uint8 array")
    expected = (width * bits + 7) // 8 * height
    if pixels.nbytes != expected:
        raise DecodeError(f"{mode} image of {width}x{height} needs {expected} pixel bytes, got {pixels.nbytes}")
    if palette is not None and (
        mode not in ("P", "PA")
        or type(palette) is not list
        or len(palette) != 2
        or palette[0] not in ("RGB", "RGBA")
        or type(palette[1]) is not bytes
        or len(palette[1]) % len(palette[0])
        or len(palette[1]) > 256 * len(palette[0])
    ):
        raise DecodeError('image palette must be nil or ["RGB" or "RGBA", bytes of at most 256 entries]')
    image_module = _pil_image()
    try:
        img = image_module.frombytes(mode, (width, height), pixels)
        if palette is not None:
            img.putpalette(palette[1], palette[0])
    except Exception as exc:
        raise DecodeError(f"Pillow cannot build a {mode} image of {width}x{height}: {exc}") from exc
    return img


_PIL_MISSING = object()
_pil: Any = _PIL_MISSING


def _pil_image() -> Any:
    """``PIL.Image``, imported on first use; DecodeError when Pillow is not installed."""
    global _pil
    if _pil is _PIL_MISSING:
        try:
            _pil = importlib.import_module("PIL.Image")
        except ImportError:
            _pil = None
    if _pil is None:
        raise DecodeError("received a PIL image but Pillow is not installed here: pip install 'zmq-omni[payloads]'")
    return _pil


def decode_each(
    frames: Sequence[bytes], *, allow_pickle: bool = False, limits: DecodeLimits | None = None, device: Any = None
) -> list[Any]:
    """Decode many single-frame encodings (frame 0 only, ``bytes``), each on its own.

    Each item of the result is the decoded object, or the :class:`DecodeError`
    that decoding that frame raised (the others are decoded all the same):
    ``[decode([f]) or its DecodeError for f in frames]``, with a faster path for
    plain-msgpack frames, which small metadata puts are.

    Args:
        frames: frame 0 of each encoding; one that refers to out-of-band frames
            gets a DecodeError (it has none here).
        allow_pickle: accept pickled objects (trusted peers only).
        limits: bounds on each frame; defaults to ``DecodeLimits()``.
        device: as for :func:`decode`.

    Returns:
        One item per frame, in order. Nothing is raised for a bad frame.
    """
    lim = _DEFAULT_LIMITS if limits is None else limits
    largest = min(lim.max_header_bytes, lim.max_total_bytes - PREAMBLE_SIZE)
    plain, skip, unpackb, reject = _PLAIN_PREAMBLE, PREAMBLE_SIZE, _unpackb, _reject_ext
    depth, objects = lim.max_depth, lim.max_objects
    out: list[Any] = []
    add = out.append
    for frame in frames:
        if type(frame) is bytes and frame.startswith(plain) and len(frame) - skip <= largest:
            try:
                # As decode's plain path: msgpack bounds every declared length by the input's.
                body = frame[skip:]
                if len(body) > objects or body.translate(CONTAINER_MAP).count(1) > depth:
                    walk_shape(body, depth, objects)
                add(unpackb(body, ext_hook=reject, raw=False, strict_map_key=False))
            except DecodeError as exc:
                add(exc)
            except Exception as exc:
                add(DecodeError(f"invalid header: {exc!r}"))
            continue
        try:
            add(decode([frame], allow_pickle=allow_pickle, limits=lim, device=device))
        except DecodeError as exc:
            add(exc)
    return out


def _single_frame_state(limits: DecodeLimits) -> _Decoding:
    """The shared decoding state of one-frame encodings whose preamble declares only ``FLAG_EXT``.

    Decoding such a header never changes its state: an out-of-band array reference
    fails (there is no frame 1), tuple and object markers and pickles are refused
    (their flags are absent), and inline arrays, tensors, scalars and big ints read
    nothing but the limits. So it needs neither a state of its own nor the checks
    after the parse (no marker can be open, no frame unused), and any thread may
    use it at once. The last one made is kept with its limits, compared by identity
    (a connector decodes with the same limits object every time; hashing the
    dataclass would cost more than building a state).
    """
    global _last_single_frame_state
    state = _Decoding((b"",), 1, FLAG_EXT, False, limits, 0)
    _last_single_frame_state = (limits, state)
    return state


_last_single_frame_state: tuple[DecodeLimits, _Decoding]
_single_frame_state(_DEFAULT_LIMITS)


_PREAMBLE_CHECK = struct.Struct("<4sBI")
_MAGIC_AND_VERSION: Final = MAGIC + bytes((WIRE_VERSION,))
_SLICE_HEADER_MAX: Final = 4096


def _reject_preamble(head: Any, flags: int, n_oob: int, count: int, size: int, lim: DecodeLimits) -> None:
    """Raise the DecodeError that says what is wrong with a preamble that failed the quick check."""
    magic, version = bytes(memoryview(head)[:3]), memoryview(head)[3]
    if magic != MAGIC:
        raise DecodeError(f"frame 0 starts with {magic!r}, not the zmq_omni magic {MAGIC!r}")
    if version != WIRE_VERSION:
        raise DecodeError(f"wire version {version} is not supported (this decoder speaks {WIRE_VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise DecodeError(f"unknown preamble flags {flags:#04x}")
    if n_oob != count - 1:
        raise DecodeError(f"preamble declares {n_oob} out-of-band frames, got {count - 1}")
    if n_oob and not flags & FLAG_EXT:
        raise DecodeError(f"{n_oob} out-of-band frames but no extension types to refer to them")
    if flags & (FLAG_TUPLE | FLAG_PICKLE | FLAG_OBJECT) and not flags & FLAG_EXT:
        raise DecodeError(f"preamble flags {flags:#04x} set TUPLE, PICKLE or OBJECT without EXT")
    if n_oob > lim.max_frames:
        raise DecodeError(f"{n_oob} out-of-band frames, limit is {lim.max_frames}")
    if size > lim.max_header_bytes:
        raise DecodeError(f"header of {size} bytes, limit is {lim.max_header_bytes}")
    if size + PREAMBLE_SIZE > lim.max_total_bytes:
        raise DecodeError(f"frame 0 of {size + PREAMBLE_SIZE} bytes, limit is {lim.max_total_bytes}")
    if flags & FLAG_PICKLE:
        raise DecodeError("pickled content rejected: this decoder has not opted in (allow_pickle=False)")
    raise DecodeError("invalid preamble")  # pragma: no cover - the quick check and this list agree


def decode(
    frames: Sequence[Any], *, allow_pickle: bool = False, limits: DecodeLimits | None = None, device: Any = None
) -> Any:
    """Decode a frame set produced by :func:`encode`.

    Large arrays come back as numpy arrays (torch tensors for encoded
    tensors, when torch is installed) that view the given frames' memory:
    writable when the frame buffer is writable (``zmq.Frame``, shared
    memory), read-only over ``bytes``. Each view keeps its frame alive.
    Inline arrays are private, writable copies.

    Args:
        frames: frame 0 and every out-of-band frame, in order; each any
            buffer-protocol object (``bytes``, ``memoryview``, ``zmq.Frame``).
        allow_pickle: accept pickled objects (trusted peers only).
        limits: bounds on the frame set; defaults to ``DecodeLimits()``.
        device: a ``torch.device`` (or its name) to move decoded tensors
            onto; ``None`` leaves them on the CPU (viewing the frames).
            Validate a configured name with ``resolve_device`` first.

    Returns:
        The decoded object.

    Raises:
        DecodeError: the frames are not a valid encoding, violate ``limits``,
            or carry pickles without ``allow_pickle``. Nothing else is raised.
    """
    lim = _DEFAULT_LIMITS if limits is None else limits
    try:
        count = len(frames)
        head = frames[0]
        magic, flags, n_oob = _PREAMBLE_CHECK.unpack_from(head)
        if type(head) is bytes and len(head) <= _SLICE_HEADER_MAX:
            # Copying a small header is cheaper than a memoryview slice.
            body: bytes | memoryview = head[PREAMBLE_SIZE:]
            size = len(body)
        else:
            body = memoryview(head)[PREAMBLE_SIZE:]
            size = body.nbytes
    except Exception as exc:
        raise DecodeError(f"frame 0 is not a zmq_omni preamble: {exc!r}") from exc
    if (
        magic != _MAGIC_AND_VERSION
        or flags & ~_KNOWN_FLAGS
        or n_oob != count - 1
        or ((n_oob or flags & (FLAG_TUPLE | FLAG_PICKLE | FLAG_OBJECT)) and not flags & FLAG_EXT)
        or n_oob > lim.max_frames
        or size > lim.max_header_bytes
        or size + PREAMBLE_SIZE > lim.max_total_bytes
        or (flags & FLAG_PICKLE and not allow_pickle)
    ):
        _reject_preamble(head, flags, n_oob, count, size, lim)
    try:
        # Depth and object count before msgpack builds anything. Inlined here, check_shape's first test for
        # the usual small header: too few bytes that may open an array or a map to nest past the limit.
        if type(body) is not bytes:
            check_shape(body, lim.max_depth, lim.max_objects)
        elif size > lim.max_objects or body.translate(CONTAINER_MAP).count(1) > lim.max_depth:
            walk_shape(body, lim.max_depth, lim.max_objects)
        if not flags:
            # Plain msgpack: the metadata-only hot path.
            # msgpack bounds every declared length by the input's length when no limit is
            # given (max_*_len=-1 means len(body)), so a forged count cannot make it allocate.
            return _unpackb(body, ext_hook=_reject_ext, strict_map_key=False)
        if count == 1 and flags == FLAG_EXT and device is None:
            # Inline arrays, scalars, big ints and nothing else (a small put's usual header): no hook
            # here changes its state (see _single_frame_state), so one state per limits serves every call.
            last = _last_single_frame_state  # one read: another thread may replace it meanwhile
            state = last[1] if last[0] is lim else _single_frame_state(lim)
            return _unpackb(body, ext_hook=state.ext_hook, strict_map_key=False)
        state = _Decoding(frames, count, flags, allow_pickle, lim, size + PREAMBLE_SIZE, device)
        list_hook = state.list_hook if flags & _MARKS else None
        obj = _unpackb(body, ext_hook=state.ext_hook, list_hook=list_hook, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"invalid header: {exc!r}") from exc
    if state.open_marks:
        raise DecodeError("tuple marker or object marker outside the first slot of a list")
    if state.next_frame != count:
        raise DecodeError(f"header refers to {state.next_frame - 1} of {count - 1} out-of-band frames")
    return obj
