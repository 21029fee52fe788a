"""Decoding: the state of one decode call, reached from msgpack's hooks.

msgpack unpacks the basic types in C; its ``ext_hook`` turns extension types
into arrays, tensors, scalars, big ints and (opt-in) pickles, and its
``list_hook`` turns marked lists into tuples, records, registered types,
slices and images. Everything is checked against the bytes present before
anything is built; bounded memos of validated descriptors keep a large array's
cost a small constant. :func:`~zmq_omni.wire.decode` (in :mod:`._codec`) drives it.
"""

from __future__ import annotations

import importlib
import math
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DecodeError
from . import _dtypes, _registry
from ._encoder import _MEMO_SIZE
from ._format import (
    _ARRAY_HEAD,
    _KNOWN_LAYOUT,
    _MAX_DTYPE_NAME,
    _MAX_IMAGE_SIDE,
    _OBJECT_CODES,
    _SHAPE_AND_REF,
    _SHAPES,
    EXT_ARRAY,
    EXT_BIGINT,
    EXT_CUSTOM,
    EXT_IMAGE,
    EXT_PICKLE,
    EXT_RECORD,
    EXT_SCALAR,
    EXT_SLICE,
    EXT_TENSOR,
    EXT_TUPLE,
    FLAG_OBJECT,
    FLAG_PICKLE,
    FLAG_TUPLE,
    IMAGE_MODE_BITS,
    LAYOUT_FORTRAN,
    LAYOUT_OUT_OF_BAND,
)
from ._limits import DecodeLimits
from ._shape import brief


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


#: Wire names whose native numpy dtype ``torch.from_numpy`` takes: a shaped tensor in one torch call.
_FROM_NUMPY: dict[bytes, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in (
        (b"|b1", "?"),
        (b"|u1", "u1"),
        (b"|i1", "i1"),
        (b"<i2", "i2"),
        (b"<i4", "i4"),
        (b"<i8", "i8"),
        (b"<f2", "f2"),
        (b"<f4", "f4"),
        (b"<f8", "f8"),
        (b"<bf16", "i2"),  # bfloat16's words, viewed as bfloat16 (numpy has no bfloat16 torch takes)
    )
    if np.little_endian
}


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
            # One torch call where one does: after a pause (a chunk every 20 ms) each call into torch costs
            # tens of microseconds. A 1-D tensor is frombuffer's own shape (the byte count was checked).
            if len(shape) == 1:
                tensor = torch.frombuffer(buf, dtype=tdtype)
            else:
                native = _FROM_NUMPY.get(name)
                if native is not None:
                    tensor = torch.from_numpy(np.ndarray(shape, native, buf))
                    if name == b"<bf16":
                        tensor = tensor.view(tdtype)  # two calls still, cheaper than frombuffer's reshape
                else:
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
