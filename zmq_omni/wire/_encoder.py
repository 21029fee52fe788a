"""Encoding: the per-thread msgpack packer and the hook that carries what msgpack cannot.

msgpack packs the basic types in C; its ``default`` hook (:meth:`_Encoder._default`)
runs only for the rest: arrays, tensors, numpy scalars, tuples, big ints,
records (msgspec Structs, dataclasses), registered types, slices, images and
(opt-in) pickles. An array at or above the inline threshold becomes a
reference to a frame that views its memory. Precomputed descriptor prefixes
and a bounded memo of whole out-of-band extensions keep a large array's cost a
small constant. :func:`~zmq_omni.wire.encode` (in :mod:`._codec`) drives it.
"""

from __future__ import annotations

import operator
import pickle
import sys
from typing import Any, Final

import msgpack
import numpy as np

from ..errors import EncodeError
from . import _dtypes, _registry, _staging
from ._format import (
    _ARRAY_HEAD,
    _SHAPE_AND_REF,
    _SHAPES,
    DEFAULT_INLINE_THRESHOLD,
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
    FLAG_EXT,
    FLAG_OBJECT,
    FLAG_PICKLE,
    FLAG_TUPLE,
    IMAGE_MODE_BITS,
    LAYOUT_FORTRAN,
    LAYOUT_OUT_OF_BAND,
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


def _type_name(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


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
        tensor_class, torch = _torch_seen
        if cls is tensor_class:  # a plain torch.Tensor, once the first tensor was encoded
            return self._tensor(torch, obj)
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
            heads = (_torch_heads or _torch_prefixes(torch)).get(tensor.dtype)
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


# (torch.Tensor, torch) from the first tensor on: the encoder's hook then tells a plain tensor first.
_torch_seen: tuple[Any, Any] = (None, None)


def _torch_prefixes(torch: Any) -> dict[Any, tuple[tuple[bytes, ...], tuple[bytes, ...]]]:
    """Descriptor prefixes by torch dtype: (inline by ndim, out of band by ndim), built at the first tensor."""
    global _torch_seen
    _torch_seen = (torch.Tensor, torch)
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
