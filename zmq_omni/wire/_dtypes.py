"""The dtype allow-list of the wire format and its mapping to numpy, ml_dtypes and torch.

A dtype travels as a short ASCII string in numpy's ``dtype.str`` spelling
(byte order, kind, item size), plus ``"<bf16"`` for bfloat16. Only strings in
:data:`WIRE_DTYPES` are accepted on either side; everything else is an error.

torch and ml_dtypes stay optional: they are looked up in ``sys.modules`` on
encode (an object of their types can only exist if they are imported) and
imported lazily on decode, the first time a frame set needs them.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any

import numpy as np

__all__ = [
    "BFLOAT16",
    "NAME_OF_NUMPY",
    "WIRE_DTYPES",
    "numpy_dtype_for",
    "torch_dtype_for",
    "torch_module",
    "torch_names",
    "wire_name_of_numpy",
    "wire_name_of_torch",
]

#: bfloat16 travels as raw little-endian 2-byte words under this name.
BFLOAT16 = "<bf16"

_NUMPY_NAMES = (
    "|b1",
    "|i1",
    "|u1",
    *(f"{order}{kind}{size}" for kind, size in (("i", 2), ("u", 2), ("f", 2)) for order in "<>"),
    *(f"{order}{kind}{size}" for kind in "iuf" for size in (4, 8) for order in "<>"),
    *(f"{order}c{size}" for size in (8, 16) for order in "<>"),
)

#: Every dtype string the format allows, in a stable order (documented in docs/wire-format.md).
WIRE_DTYPES: tuple[str, ...] = (*_NUMPY_NAMES, BFLOAT16)

#: Encode side: numpy dtype -> wire name. np.dtype hashes and compares by
#: byte order, so "=f4" and "<f4" share an entry on a little-endian host.
NAME_OF_NUMPY: dict[np.dtype[Any], str] = {np.dtype(name): name for name in _NUMPY_NAMES}

# Decode side: wire name (bytes, as sliced from the header) -> numpy dtype.
# bfloat16 is resolved lazily because it needs ml_dtypes.
_NUMPY_OF_NAME: dict[bytes, np.dtype[Any]] = {name.encode(): np.dtype(name) for name in _NUMPY_NAMES}

log = logging.getLogger("zmq_omni.wire")

_lazy_lock = threading.Lock()
_bf16_numpy: np.dtype[Any] | None = None
_torch_maps: tuple[dict[Any, str], dict[bytes, Any]] | None = None
_MISSING = object()
_torch: Any = _MISSING


def wire_name_of_numpy(dtype: np.dtype[Any]) -> str | None:
    """The wire name of a numpy dtype, or ``None`` when the format does not carry it."""
    name = NAME_OF_NUMPY.get(dtype)
    if name is not None:
        return name
    # ml_dtypes registers bfloat16 as a void-kind dtype of its own type; it
    # can only reach us if the caller already imported ml_dtypes.
    if dtype.name == "bfloat16":
        ml = sys.modules.get("ml_dtypes")
        # Not cached in NAME_OF_NUMPY: the codec's fast path assumes every
        # dtype there exports a standard buffer format, and bfloat16 does not.
        if ml is not None and dtype.type is ml.bfloat16:
            return BFLOAT16
    return None


def _bfloat16_numpy() -> np.dtype[Any]:
    """ml_dtypes.bfloat16 when importable, else raw little-endian uint16 words."""
    global _bf16_numpy
    if _bf16_numpy is None:
        with _lazy_lock:
            try:
                ml = importlib.import_module("ml_dtypes")
                _bf16_numpy = np.dtype(ml.bfloat16)
            except ImportError:
                log.info("ml_dtypes is not installed: bfloat16 arrays decode to uint16 bit patterns")
                _bf16_numpy = np.dtype("<u2")
    return _bf16_numpy


def numpy_dtype_for(name: bytes) -> np.dtype[Any] | None:
    """The numpy dtype for a wire name, or ``None`` when the name is not allowed.

    ``b"<bf16"`` maps to ``ml_dtypes.bfloat16`` when ml_dtypes is importable and
    to ``uint16`` (the raw bit patterns) when it is not.
    """
    dtype = _NUMPY_OF_NAME.get(name)
    if dtype is None and name == b"<bf16":
        return _bfloat16_numpy()
    return dtype


def raw_numpy_dtype_for(name: bytes) -> np.dtype[Any] | None:
    """As :func:`numpy_dtype_for`, but ``b"<bf16"`` is ``uint16`` (its bit patterns): sizes only, no import."""
    dtype = _NUMPY_OF_NAME.get(name)
    if dtype is None and name == b"<bf16":
        return _BF16_BITS
    return dtype


_BF16_BITS: np.dtype[Any] = np.dtype("<u2")


def torch_module() -> Any:
    """The torch module, imported on first use; ``None`` when torch is not installed."""
    global _torch
    if _torch is _MISSING:
        with _lazy_lock:
            if _torch is _MISSING:
                try:
                    _torch = importlib.import_module("torch")
                except ImportError:
                    _torch = None
    return _torch


def _build_torch_maps(torch: Any) -> tuple[dict[Any, str], dict[bytes, Any]]:
    global _torch_maps
    if _torch_maps is None:
        little = "<" if sys.byteorder == "little" else ">"
        pairs = [
            ("bool", "|b1"),
            ("int8", "|i1"),
            ("uint8", "|u1"),
            ("int16", f"{little}i2"),
            ("int32", f"{little}i4"),
            ("int64", f"{little}i8"),
            ("uint16", f"{little}u2"),
            ("uint32", f"{little}u4"),
            ("uint64", f"{little}u8"),
            ("float16", f"{little}f2"),
            ("float32", f"{little}f4"),
            ("float64", f"{little}f8"),
            ("complex64", f"{little}c8"),
            ("complex128", f"{little}c16"),
            ("bfloat16", BFLOAT16),
        ]
        # uint16/32/64 only exist in newer torch releases.
        present = [(getattr(torch, attr), name) for attr, name in pairs if hasattr(torch, attr)]
        _torch_maps = (dict(present), {name.encode(): tdtype for tdtype, name in present})
    return _torch_maps


def torch_names(torch: Any) -> dict[Any, str]:
    """Every torch dtype the format carries, with its wire name."""
    return _build_torch_maps(torch)[0]


def wire_name_of_torch(torch: Any, dtype: Any) -> str | None:
    """The wire name of a torch dtype, or ``None`` when the format does not carry it."""
    return _build_torch_maps(torch)[0].get(dtype)


def torch_dtype_for(torch: Any, name: bytes) -> Any:
    """The torch dtype for a wire name, or ``None`` when torch has no such dtype."""
    return _build_torch_maps(torch)[1].get(name)
