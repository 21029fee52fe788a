"""Property-based fuzzing of the wire codec (hypothesis).

Round trips over generated nested objects, and corrupted, truncated and
forged frame sets that must raise ``DecodeError`` and nothing else, without
allocating more than a small multiple of the bytes received.

The settings are derandomized so CI is reproducible, and sized so the three
properties run about 7000 cases in total in well under a minute.
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zmq_omni.errors import DecodeError
from zmq_omni.wire import WIRE_DTYPES, decode, encode, frames_nbytes
from zmq_omni.wire._codec import (
    EXT_ARRAY,
    EXT_BIGINT,
    EXT_PICKLE,
    EXT_SCALAR,
    EXT_TENSOR,
    EXT_TUPLE,
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
    layout = draw(st.sampled_from(["c", "f", "strided", "transposed"]))
    if layout == "f":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim:
        arr = arr[::2]
    elif layout == "transposed":
        arr = arr.T
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


def _received(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


@st.composite
def corrupted(draw: st.DrawFn) -> list[bytes]:
    """A valid encoding, then one or more random damages."""
    frames = _received(encode(draw(objects), inline_threshold=draw(st.sampled_from([0, 16, 1 << 20]))))
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


forged_ext = st.one_of(
    forged_array(),
    st.builds(msgpack.ExtType, st.sampled_from([EXT_SCALAR, EXT_BIGINT, EXT_TUPLE]), st.binary(max_size=24)),
    st.builds(msgpack.ExtType, st.sampled_from([0, EXT_PICKLE, 7, 42, 127]), st.binary(max_size=8)),
)
forged_tree = st.recursive(
    st.one_of(forged_ext, st.integers(-(2**63), 2**64 - 1), st.text(max_size=4), st.none()),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def forged(draw: st.DrawFn) -> list[bytes]:
    flags = draw(st.sampled_from([0, 1, 3, 5, 7, 8]))
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
    tracemalloc.start()
    try:
        _decode_or_decode_error(frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Python objects for the parsed header cost a constant factor over its
    # bytes; a forged shape or size would show up as megabytes here.
    assert peak < 64 * received + 256 * 1024, (peak, received)
