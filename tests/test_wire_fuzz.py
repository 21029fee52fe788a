"""Property-based fuzzing of the wire codec (hypothesis).

Round trips over generated nested objects, and corrupted, truncated and
forged frame sets that must raise ``DecodeError`` and nothing else, without
allocating more than a small multiple of the bytes received.

The settings are derandomized so CI is reproducible, and sized so the three
properties run about 7000 cases in total in well under a minute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import tracemalloc
from typing import Any

import ml_dtypes
import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from zmq_omni.errors import DecodeError
from zmq_omni.wire import (
    WIRE_DTYPES,
    DecodeLimits,
    decode,
    decode_each,
    encode,
    frames_nbytes,
    register_type,
    unregister_type,
)
from zmq_omni.wire._codec import (
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
    IMAGE_MODE_BITS,
    MAGIC,
    WIRE_VERSION,
)

from .test_wire import same

FUZZ = settings(
    max_examples=2500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NUMERIC = [np.dtype(name) for name in WIRE_DTYPES if name != "<bf16"] + [np.dtype(ml_dtypes.bfloat16)]


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = draw(st.sampled_from(NUMERIC))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    count = int(np.prod(shape))
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy() if count else np.empty(shape, dtype)
    if dtype.kind == "b":
        arr = arr.view(np.uint8) % 2 == 1
    layout = draw(st.sampled_from(["c", "f", "strided", "transposed", "reversed", "last_step", "one_of_strided"]))
    if layout == "f":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim:
        arr = arr[::2]
    elif layout == "transposed":
        arr = arr.T
    elif layout == "reversed" and arr.ndim:
        arr = arr[::-1]  # a negative stride
    elif layout == "last_step" and arr.ndim:
        arr = arr[..., ::3]
    elif layout == "one_of_strided" and arr.ndim:
        arr = arr[..., ::2][..., :1]  # one column of a strided view: "contiguous" with an odd stride
    return arr


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # includes ints far beyond 64 bits
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=40),
    arrays().map(lambda a: a.reshape(-1)[0] if a.size else a),  # numpy scalars (or empty arrays)
)

objects = st.recursive(
    st.one_of(scalars, arrays()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1)), children, max_size=4),
    ),
    max_leaves=12,
)


@FUZZ
@given(obj=objects, threshold=st.sampled_from([0, 1, 16, 64, 1 << 20]))
def test_round_trip_property(obj: Any, threshold: int) -> None:
    assert same(decode(encode(obj, inline_threshold=threshold)), obj)


# -- the payload types of vllm-omni's stages: records, slices, images, nested in everything above -----------
@dataclasses.dataclass
class FuzzRecord:
    a: Any
    b: Any = None


class FuzzStruct(msgspec.Struct):
    x: Any
    y: Any = None


@st.composite
def images(draw: st.DrawFn) -> Any:
    mode = draw(st.sampled_from(sorted(IMAGE_MODE_BITS)))
    width, height = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    size = (width * IMAGE_MODE_BITS[mode] + 7) // 8 * height
    return Image.frombytes(mode, (width, height), draw(st.binary(min_size=size, max_size=size)))


maybe_int = st.one_of(st.none(), st.integers())
payload_objects = st.recursive(
    st.one_of(scalars, arrays(), st.builds(slice, maybe_int, maybe_int, maybe_int), images()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=3),
        st.builds(FuzzRecord, children, children),
        st.builds(FuzzStruct, children, children),
    ),
    max_leaves=8,
)


def as_received(obj: Any) -> Any:
    """What a receiver that registered neither record class decodes: their field maps."""
    if isinstance(obj, FuzzRecord):
        return {"a": as_received(obj.a), "b": as_received(obj.b)}
    if isinstance(obj, FuzzStruct):
        return {"x": as_received(obj.x), "y": as_received(obj.y)}
    if isinstance(obj, dict):
        return {k: as_received(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(as_received(v) for v in obj)
    return obj


def same_payload(a: Any, b: Any) -> bool:
    if isinstance(b, Image.Image):
        return type(a) is Image.Image and (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    if isinstance(b, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(same_payload(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, dict) and type(a) is dict:
        return list(a) == list(b) and all(same_payload(a[k], b[k]) for k in b)
    return same(a, b)


@settings(FUZZ, max_examples=600)
@given(obj=payload_objects, threshold=st.sampled_from([0, 64, 1 << 20]))
def test_payload_types_round_trip_property(obj: Any, threshold: int) -> None:
    assert same_payload(decode(encode(obj, inline_threshold=threshold)), as_received(obj))


@settings(FUZZ, max_examples=1500)
@given(obj=payload_objects, data=st.data())
def test_corrupted_payload_encodings_raise_only_decode_error(obj: Any, data: st.DataObject) -> None:
    frames = _received(encode(obj, inline_threshold=data.draw(st.sampled_from([0, 1 << 20]))))
    _decode_or_decode_error(data.draw(damaged(frames)))


def _received(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


@st.composite
def corrupted(draw: st.DrawFn) -> list[bytes]:
    """A valid encoding, then one or more random damages."""
    frames = _received(encode(draw(objects), inline_threshold=draw(st.sampled_from([0, 16, 1 << 20]))))
    return draw(damaged(frames))


@st.composite
def damaged(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    """``frames`` with one or more random damages."""
    frames = list(frames)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "extend", "drop", "extra", "swap", "replace", "byte"]))
        index = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if kind == "flip" and frames and frames[index]:
            frame = bytearray(frames[index])
            pos = draw(st.integers(0, len(frame) - 1))
            frame[pos] ^= 1 << draw(st.integers(0, 7))
            frames[index] = bytes(frame)
        elif kind == "byte" and frames and frames[0]:
            frame = bytearray(frames[0])
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
            frames[0] = bytes(frame)
        elif kind == "truncate" and frames:
            frames[index] = frames[index][: draw(st.integers(0, max(0, len(frames[index]) - 1)))]
        elif kind == "extend" and frames:
            frames[index] = frames[index] + draw(st.binary(min_size=1, max_size=16))
        elif kind == "drop" and frames:
            del frames[index]
        elif kind == "extra":
            frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=32)))
        elif kind == "swap" and len(frames) > 1:
            other = draw(st.integers(0, len(frames) - 1))
            frames[index], frames[other] = frames[other], frames[index]
        elif kind == "replace" and frames:
            frames[index] = draw(st.binary(max_size=64))
    return frames


def _decode_or_decode_error(frames: list[bytes]) -> None:
    with contextlib.suppress(DecodeError):  # the only acceptable failure
        decode(frames)


@FUZZ
@given(frames=corrupted())
def test_corrupted_frame_sets_raise_only_decode_error(frames: list[bytes]) -> None:
    _decode_or_decode_error(frames)


def _decode_one(frame: bytes) -> Any:
    try:
        return decode([frame])
    except DecodeError as exc:
        return exc


@FUZZ
@given(
    batch=st.lists(corrupted().map(lambda frames: frames[0] if frames else b""), min_size=1, max_size=4),
    valid=st.lists(objects.map(lambda obj: bytes(encode(obj, inline_threshold=1 << 20)[0])), max_size=4),
)
def test_decode_each_decodes_each_frame_as_decode_does(batch: list[bytes], valid: list[bytes]) -> None:
    frames = [*batch, *valid]
    for got, frame in zip(decode_each(frames), frames, strict=True):
        want = _decode_one(frame)
        if isinstance(want, DecodeError):
            assert isinstance(got, DecodeError), (frame, got)
        else:
            assert same(got, want), (frame, got, want)


def test_decode_each_applies_the_limits_on_its_fast_path() -> None:
    small, large = encode({"a": 1})[0], encode({"a": "x" * 100})[0]
    assert isinstance(small, bytes) and isinstance(large, bytes)
    limits = DecodeLimits(max_header_bytes=len(small))  # frame 0 here is larger than the header it bounds
    got = decode_each([small, large, small], limits=limits)
    assert got[0] == {"a": 1} and got[2] == {"a": 1}
    assert isinstance(got[1], DecodeError) and "limit" in str(got[1])
    with pytest.raises(DecodeError):
        decode([large], limits=limits)


# Forged headers: well-formed msgpack with hostile extension payloads.

dtype_names = st.one_of(
    st.sampled_from([n.encode() for n in WIRE_DTYPES]),
    st.sampled_from([b"|O8", b"<U4", b"<M8", b"V8", b"<f16", b"bf16", b">bf16", b"", b"<f4\x00", b"f" * 300]),
    st.binary(max_size=20),
)
dims = st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32, 2**62, 2**63, 2**64 - 1]))


@st.composite
def forged_array(draw: st.DrawFn) -> msgpack.ExtType:
    name = draw(dtype_names)
    shape = draw(st.lists(dims, max_size=draw(st.sampled_from([4, 70]))))
    layout = draw(st.sampled_from([0, 1, 2, 3, 4, 0x82, 255]))
    payload = struct.pack("<BBB", layout, len(shape) & 0xFF, len(name) & 0xFF) + name[:255]
    payload += struct.pack(f"<{len(shape)}Q", *shape)
    if layout & 2:
        payload += struct.pack("<IQ", draw(st.integers(0, 4)), draw(st.one_of(st.integers(0, 64), dims)))
    else:
        payload += draw(st.binary(max_size=64))
    if draw(st.booleans()):
        payload = payload[: draw(st.integers(0, len(payload)))]
    return msgpack.ExtType(draw(st.sampled_from([EXT_ARRAY, EXT_TENSOR])), payload)


marker_ext = st.builds(
    msgpack.ExtType,
    st.sampled_from([EXT_RECORD, EXT_CUSTOM, EXT_SLICE, EXT_IMAGE, EXT_TUPLE]),
    st.one_of(st.just(b""), st.sampled_from([b"tests.test_wire_fuzz.FuzzRecord", b"os.system"]), st.binary(max_size=8)),
)
forged_ext = st.one_of(
    forged_array(),
    st.builds(msgpack.ExtType, st.sampled_from([EXT_SCALAR, EXT_BIGINT, EXT_TUPLE]), st.binary(max_size=24)),
    st.builds(msgpack.ExtType, st.sampled_from([0, EXT_PICKLE, 11, 42, 127]), st.binary(max_size=8)),
    marker_ext,
)
forged_leaf = st.one_of(
    forged_ext,
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=4),
    st.none(),
    st.binary(max_size=8),
    st.sampled_from(sorted(IMAGE_MODE_BITS)),
    st.floats(),
)
forged_tree = st.recursive(
    forged_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
        # A marked list: a marker first, then anything (object shapes with the wrong sizes and types).
        st.tuples(marker_ext, st.lists(children, max_size=6)).map(lambda mc: [mc[0], *mc[1]]),
    ),
    max_leaves=8,
)


@st.composite
def forged(draw: st.DrawFn) -> list[bytes]:
    flags = draw(st.sampled_from([0, 1, 3, 5, 7, 8, 9, 11, 15, 16]))
    oob = draw(st.lists(st.binary(max_size=64), max_size=4))
    n_oob = draw(st.one_of(st.just(len(oob)), st.integers(0, 2**32 - 1)))
    head = MAGIC + struct.pack("<BBI", WIRE_VERSION, flags, n_oob) + msgpack.packb(draw(forged_tree))
    return [head, *oob]


@FUZZ
@given(frames=forged())
def test_forged_headers_raise_only_decode_error_and_never_allocate_from_declared_sizes(
    frames: list[bytes],
) -> None:
    received = frames_nbytes(frames)
    # Registered here, so forged records named after it reach its decode function with hostile fields.
    name = register_type(FuzzRecord)
    try:
        # Once untraced first: a first decode may import or cache something lazily (megabytes once, seen
        # under load); a forged size would allocate on every call, so the traced second one still shows it.
        _decode_or_decode_error(frames)
        tracemalloc.start()
        try:
            _decode_or_decode_error(frames)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        unregister_type(name)
    # Python objects for the parsed header cost a constant factor over its
    # bytes; a forged shape or size would show up as megabytes here.
    assert peak < 64 * received + 256 * 1024, (peak, received)


# -- torch views: every stride pattern slicing, transposing, conjugating and expanding can make -------------
TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int8", "int16",
                "int32", "int64", "uint8", "bool"]  # fmt: skip


@st.composite
def torch_views(draw: st.DrawFn) -> Any:
    torch = pytest.importorskip("torch")

    dtype = getattr(torch, draw(st.sampled_from(TORCH_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    base = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * 50
    if dtype.is_complex:
        tensor = torch.complex(base, -base).to(dtype)
    else:
        tensor = (base > 0) if dtype == torch.bool else base.to(dtype)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["slice", "transpose", "conj", "imag_of_conj", "expand", "select"]))
        if op == "slice" and tensor.dim():
            dim = draw(st.integers(0, tensor.dim() - 1))
            size = tensor.shape[dim]
            start = draw(st.integers(0, size))
            stop = draw(st.integers(start, size))
            step = draw(st.integers(1, 3))
            tensor = tensor.narrow(dim, start, stop - start)[(slice(None),) * dim + (slice(None, None, step),)]
        elif op == "transpose" and tensor.dim() >= 2:
            tensor = tensor.transpose(0, tensor.dim() - 1)
        elif op == "conj" and tensor.is_complex():
            tensor = tensor.conj()
        elif op == "imag_of_conj" and tensor.is_complex():
            tensor = tensor.conj().imag  # a float view with the negative bit and stride 2
        elif op == "expand" and tensor.dim() and tensor.shape[-1] == 1:
            tensor = tensor.expand(*tensor.shape[:-1], draw(st.integers(0, 4)))  # stride 0
        elif op == "select" and tensor.dim() and tensor.shape[0]:
            tensor = tensor[draw(st.integers(0, tensor.shape[0] - 1))]
    return tensor


@settings(FUZZ, max_examples=400)
@given(tensor=torch_views(), threshold=st.sampled_from([0, 64, 1 << 20]))
def test_torch_views_round_trip_bit_exact(tensor: Any, threshold: int) -> None:
    torch = pytest.importorskip("torch")

    got = decode(encode({"t": tensor}, inline_threshold=threshold))["t"]
    want = tensor.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
    assert got.reshape(-1).view(torch.uint8).tolist() == want.reshape(-1).view(torch.uint8).tolist()
