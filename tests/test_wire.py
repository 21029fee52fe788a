"""Wire codec: bit-exact round trips, zero-copy proofs, pickle opt-in, strict decoding."""

from __future__ import annotations

import collections
import enum
import gc
import json
import math
import pickle
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import ml_dtypes  # the dev extra: always present where tests run
import msgpack
import numpy as np
import pytest
import zmq

import zmq_omni.wire as wire
from zmq_omni.errors import DecodeError, EncodeError
from zmq_omni.wire import DEFAULT_INLINE_THRESHOLD, WIRE_VERSION, DecodeLimits, decode, encode, frames_nbytes

NUMERIC = [name for name in wire.WIRE_DTYPES if name != "<bf16"]
THRESHOLDS = [0, 64, 1 << 30]  # everything out of band, mixed, everything inline


def same(a: Any, b: Any) -> bool:
    """Structural equality that is strict about types, dtypes, byte order and NaN bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def roundtrip(obj: Any, threshold: int = DEFAULT_INLINE_THRESHOLD) -> Any:
    return decode(encode(obj, inline_threshold=threshold))


def test_public_surface_is_sorted_and_complete() -> None:
    assert wire.__all__ == sorted(wire.__all__)
    assert set(wire.__all__) == {
        "DEFAULT_INLINE_THRESHOLD",
        "WIRE_DTYPES",
        "WIRE_VERSION",
        "DecodeLimits",
        "brief",
        "check_shape",
        "decode",
        "decode_each",
        "encode",
        "frames_nbytes",
        "register_type",
        "resolve_device",
        "unregister_type",
    }
    for name in wire.__all__:
        assert getattr(wire, name) is not None


def test_wire_room_never_imports_torch() -> None:
    code = "import sys, zmq_omni.wire as w; w.decode(w.encode({'a': 1})); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- scalars and containers


@pytest.mark.parametrize(
    "obj",
    [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        2**64,
        -(2**63) - 1,
        10**100,
        -(10**100),
        0.0,
        -0.0,
        1.5,
        math.inf,
        -math.inf,
        "",
        "héllo \U0001f600",
        b"",
        b"\x00\xff" * 100,
        [],
        [1, "a", None],
        (),
        (1,),
        ((), ((),)),
        [(1, 2), [3, (4, [5])]],
        {},
        {"a": 1, 2: "b", -3: [4]},
        {"nested": {"t": (1.5, "x"), "l": [b"z"]}},
        {(1, 2): "tuple key"},
    ],
    ids=repr,
)
def test_builtin_round_trip_is_exact(obj: Any) -> None:
    assert same(roundtrip(obj), obj)


def test_nan_keeps_its_bits() -> None:
    nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
    assert struct.pack("<d", roundtrip(nan)) == struct.pack("<d", nan)


def test_bytes_like_come_back_as_bytes() -> None:
    assert roundtrip(bytearray(b"ab")) == b"ab"
    assert type(roundtrip(bytearray(b"ab"))) is bytes
    assert roundtrip(memoryview(b"cd")) == b"cd"


def test_subclasses_travel_as_their_base_type() -> None:
    class Color(enum.IntEnum):
        RED = 1

    class Big(int):
        pass

    point = collections.namedtuple("point", "x y")
    obj = {
        "enum": Color.RED,
        "big": Big(2**70),
        "nt": point(1, 2),
        "od": collections.OrderedDict(a=1),
        "dd": collections.defaultdict(list, b=[1]),
        "np_str": np.str_("s"),
    }
    back = roundtrip(obj)
    assert same(back, {"enum": 1, "big": 2**70, "nt": (1, 2), "od": {"a": 1}, "dd": {"b": [1]}, "np_str": "s"})


def test_large_header_frames_are_bytes_and_preamble_is_as_documented() -> None:
    frames = encode({"a": (1,), "x": np.zeros(4096, "<f8")}, inline_threshold=1024)
    head = frames[0]
    assert isinstance(head, bytes)
    assert head[:3] == b"ZOM" and head[3] == WIRE_VERSION
    flags, n_oob = head[4], struct.unpack_from("<I", head, 5)[0]
    assert flags == 0x03 and n_oob == 1 == len(frames) - 1
    assert encode({"a": 1})[0][4] == 0  # plain metadata: no flags


# ---------------------------------------------------------------- numpy


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("dtype", NUMERIC)
def test_numpy_arrays_of_every_dtype_round_trip_bit_exact(dtype: str, threshold: int) -> None:
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(3, 5, 4 * np.dtype(dtype).itemsize), dtype=np.uint8)
    base = raw.view(np.dtype(dtype).newbyteorder("<") if dtype[0] != "|" else dtype).view(dtype)
    if np.dtype(dtype).kind == "b":
        base = raw[..., :4] % 2 == 1
    cases = {
        "c": base,
        "0d": base.reshape(-1)[:1].reshape(()),
        "empty": base[:0],
        "empty2": np.empty((0, 7, 0), dtype=base.dtype),
        "strided": base[:, ::2, 1::3],
        "fortran": np.asfortranarray(base),
        "transposed": base.T,
        "reversed": base[::-1],
    }
    back = roundtrip(cases, threshold)
    for key, arr in cases.items():
        got = back[key]
        assert got.dtype == arr.dtype and got.dtype.str == np.dtype(dtype).str, key
        assert got.shape == arr.shape, key
        assert got.tobytes() == arr.tobytes(), key
        if arr.flags.f_contiguous and not arr.flags.c_contiguous:
            assert got.flags.f_contiguous, key


@pytest.mark.parametrize("dtype", NUMERIC)
def test_numpy_scalars_come_back_as_numpy_scalars(dtype: str) -> None:
    values = [np.ones((), dtype=dtype)[()], np.zeros((), dtype=dtype)[()]]
    back = roundtrip(values)
    assert all(type(b) is type(values[0]) for b in back)
    assert same(back, values)


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_bfloat16_numpy_arrays_via_ml_dtypes(threshold: int) -> None:
    arr = np.arange(-8, 8, dtype=np.float32).reshape(4, 4).astype(ml_dtypes.bfloat16) / 3
    back = roundtrip({"a": arr, "f": np.asfortranarray(arr), "s": arr[::2, ::3], "x": arr[1, 1]}, threshold)
    assert back["a"].dtype == ml_dtypes.bfloat16
    for key, want in (("a", arr), ("f", np.asfortranarray(arr)), ("s", arr[::2, ::3])):
        assert back[key].tobytes() == want.tobytes() and back[key].shape == want.shape
    assert type(back["x"]) is type(arr[1, 1]) and back["x"].tobytes() == arr[1, 1].tobytes()


def test_without_torch_or_ml_dtypes_bfloat16_decodes_to_raw_uint16_words(tmp_path: Any) -> None:
    arr = (np.arange(6, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)
    frames = [bytes(f) for f in encode({"a": arr, "small": arr[:2], "s": arr[0]}, inline_threshold=4)]
    path = tmp_path / "frames.json"
    path.write_text(json.dumps([f.hex() for f in frames]))
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["ml_dtypes"] = None  # make both imports fail
        sys.modules["torch"] = None
        from zmq_omni.wire import decode
        frames = [bytes.fromhex(h) for h in json.load(open({str(path)!r}))]
        out = decode(frames)
        print(out["a"].dtype.str, out["small"].dtype.str, type(out["s"]).__name__, out["a"].tobytes().hex())
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["<u2", "<u2", "uint16", arr.tobytes().hex()]


def test_unsupported_numpy_dtypes_raise_encode_error_naming_them() -> None:
    for arr in (np.array(["a"]), np.array([object()]), np.zeros(2, "datetime64[s]"), np.zeros(2, "f16")):
        with pytest.raises(EncodeError, match=str(arr.dtype).replace("[", r"\[").replace("]", r"\]")):
            encode({"a": arr})
    with pytest.raises(EncodeError, match="mask"):
        encode(np.ma.masked_array([1, 2], mask=[0, 1]))


# ---------------------------------------------------------------- zero copy


def test_encoded_large_array_frame_is_a_view_of_the_array() -> None:
    arr = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    for src in (arr, np.asfortranarray(arr), arr.astype(">f4")):
        frames = encode({"x": src, "meta": "m"}, inline_threshold=1024)
        assert len(frames) == 2
        view = np.frombuffer(frames[1], dtype=np.uint8)
        assert np.shares_memory(view, src)
        assert view.ctypes.data == src.ctypes.data and view.nbytes == src.nbytes
        src.flat[0] = 42  # the frame sees later writes: proof it is the same memory
        assert np.frombuffer(frames[1], dtype=src.dtype)[0] == 42


def test_small_arrays_are_inline_and_large_ones_out_of_band() -> None:
    small = np.zeros(100, np.uint8)
    large = np.zeros(1000, np.uint8)
    frames = encode([small, large, small, large], inline_threshold=1000)
    assert len(frames) == 3
    assert all(np.shares_memory(np.frombuffer(f, np.uint8), large) for f in frames[1:])


def test_non_contiguous_array_is_copied_once_into_its_frame() -> None:
    arr = np.arange(4096, dtype=np.int64).reshape(64, 64)[:, ::2]
    frames = encode(arr, inline_threshold=0)
    assert not np.shares_memory(np.frombuffer(frames[1], np.uint8), arr)
    assert np.array_equal(decode(frames), arr)


def test_decoded_large_array_views_bytes_frames_read_only() -> None:
    arr = np.arange(4096, dtype=np.float64)
    frames = [bytes(f) for f in encode({"x": arr}, inline_threshold=0)]
    out = decode(frames)["x"]
    assert np.shares_memory(out, np.frombuffer(frames[1], np.uint8))
    assert not out.flags.writeable


def test_decoded_inline_arrays_are_private_writable_copies() -> None:
    frames = encode({"x": np.arange(4)}, inline_threshold=1 << 20)
    out = decode(frames)["x"]
    out[0] = 7
    assert out.flags.writeable and decode(frames)["x"][0] == 0


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    a.linger = b.linger = 0
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_decoded_large_array_views_received_zmq_frames_and_is_writable(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    sender, receiver = pair
    arr = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)  # 1 MiB: above pyzmq's copy threshold
    sender.send_multipart(encode({"x": arr, "t": (1, 2)}), copy=False)
    assert receiver.poll(10_000)
    frames = receiver.recv_multipart(copy=False)
    out = decode(frames)
    assert out["t"] == (1, 2)
    assert np.array_equal(out["x"], arr)
    assert np.shares_memory(out["x"], np.frombuffer(frames[1].buffer, np.uint8))
    assert out["x"].flags.writeable
    out["x"][0, 0] = -1  # writes land in the frame
    assert np.frombuffer(frames[1].buffer, np.float32)[0] == -1


def test_frames_nbytes_counts_every_buffer_kind() -> None:
    frames = [b"abc", bytearray(4), memoryview(np.zeros(3, np.float64)), zmq.Frame(b"12345")]
    assert frames_nbytes(frames) == 3 + 4 + 24 + 5
    enc = encode({"x": np.zeros(1000)}, inline_threshold=0)
    assert frames_nbytes(enc) == len(enc[0]) + 8000


# ---------------------------------------------------------------- torch (optional)


def test_torch_tensors_round_trip_bit_exact_including_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    cases = {
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f32": base,
        "f64": base.double(),
        "c64": torch.complex(base, -base),
        "i64": (base * 100).long(),
        "u8": (base * 10).to(torch.uint8),
        "bool": base > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "strided": base.to(torch.bfloat16)[:, ::2],
        "transposed": base.T,
        "grad": base.clone().requires_grad_(True),
        "conj": torch.complex(base, base).conj(),
        "neg": torch.complex(base, base).conj().imag,  # the negative bit on a stride-2 view
        # One element is "contiguous" whatever its stride, yet has no stride-1 byte view.
        "one_of_strided": base[:, ::2][:1, :1],
        "neg_one": torch.complex(base, base).conj().imag[:1, :1],
        "one_of_strided_1d": base.reshape(-1)[::3][:1],
        "none_of_strided": base.reshape(-1)[::2][:0],
    }
    for threshold in THRESHOLDS:
        back = roundtrip(cases, threshold)
        for key, want in cases.items():
            got = back[key]
            want = want.detach().resolve_conj().resolve_neg()
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype and got.shape == want.shape, key
            want_bytes = want.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)
            assert got.view(-1).view(torch.uint8).tolist() == want_bytes.tolist(), key


def test_torch_tensor_frames_view_the_tensor_and_decode_views_writable_frames() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(1 << 16, dtype=torch.bfloat16)
    frames = encode({"t": tensor}, inline_threshold=0)
    assert np.frombuffer(frames[1], np.uint8).ctypes.data == tensor.data_ptr()
    received = [frames[0], bytearray(frames[1])]  # a writable receive buffer
    out = decode(received)["t"]
    assert out.data_ptr() == np.frombuffer(received[1], np.uint8).ctypes.data
    # Over a read-only buffer torch gets a private copy (torch has no read-only tensors).
    copied = decode([frames[0], bytes(frames[1])])["t"]
    assert torch.equal(copied, tensor) and copied.data_ptr() != tensor.data_ptr()


def test_shaped_tensors_of_every_dtype_decode_writable_and_view_a_writable_frame() -> None:
    torch = pytest.importorskip("torch")
    from zmq_omni.wire._dtypes import torch_names

    for dtype in torch_names(torch):
        for shape in ((), (3,), (2, 3), (2, 1, 4)):
            want = torch.arange(math.prod(shape) or 1, dtype=torch.float64)[: math.prod(shape)].reshape(shape).to(dtype)
            inline = decode(encode(want))
            assert inline.dtype == dtype and inline.shape == want.shape and torch.equal(inline, want), (dtype, shape)
            inline.zero_()  # a private, writable copy
            frames = encode(want, inline_threshold=0)
            received = [frames[0], *(bytearray(frame) for frame in frames[1:])]
            viewed = decode(received)
            assert viewed.dtype == dtype and viewed.shape == want.shape and torch.equal(viewed, want), (dtype, shape)
            if want.nbytes:
                assert viewed.data_ptr() == np.frombuffer(received[1], np.uint8).ctypes.data, (dtype, shape)


def test_torch_tensor_decodes_to_numpy_where_torch_is_missing(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    frames = [bytes(f) for f in encode({"t": torch.arange(6, dtype=torch.int32).reshape(2, 3)}, inline_threshold=0)]
    path = tmp_path / "frames.json"
    path.write_text(json.dumps([f.hex() for f in frames]))
    script = (
        "import json, sys; sys.modules['torch'] = None\n"
        "from zmq_omni.wire import decode\n"
        f"t = decode([bytes.fromhex(h) for h in json.load(open({str(path)!r}))])['t']\n"
        "print(type(t).__name__, t.dtype.str, t.tolist())"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ndarray <i4 [[0, 1, 2], [3, 4, 5]]"


# ---------------------------------------------------------------- pickle opt-in


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


def test_unsupported_type_raises_encode_error_naming_it() -> None:
    with pytest.raises(EncodeError, match=r"test_wire\.Opaque"):
        encode({"ok": 1, "bad": [Opaque(1)]})
    with pytest.raises(EncodeError, match="set"):
        encode({1, 2})


def test_pickle_needs_opt_in_on_both_ends() -> None:
    frames = encode({"x": Opaque(3), "a": np.arange(3)}, allow_pickle=True)
    assert frames[0][4] & 0x04
    with pytest.raises(DecodeError, match="allow_pickle"):
        decode(frames)
    back = decode(frames, allow_pickle=True)
    assert back["x"] == Opaque(3) and np.array_equal(back["a"], np.arange(3))


def test_pickle_ext_hidden_behind_a_cleared_flag_is_rejected_even_with_opt_in() -> None:
    frames = encode([Opaque(1)], allow_pickle=True)
    forged = frames[0][:4] + bytes([frames[0][4] & ~0x04]) + frames[0][5:]
    for allow in (False, True):
        with pytest.raises(DecodeError):
            decode([forged], allow_pickle=allow)


# ---------------------------------------------------------------- strict decoding


def header(body: Any, *, flags: int = 0x01, n_oob: int = 0, version: int = WIRE_VERSION) -> bytes:
    return b"ZOM" + struct.pack("<BBI", version, flags, n_oob) + msgpack.packb(body)


def array_ext(dtype: bytes, shape: tuple[int, ...], *, index: int, nbytes: int, layout: int = 0x02) -> msgpack.ExtType:
    payload = (
        struct.pack("<BBB", layout, len(shape), len(dtype))
        + dtype
        + struct.pack(f"<{len(shape)}QIQ", *shape, index, nbytes)
    )
    return msgpack.ExtType(1, payload)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "preamble"),
        ([b""], "preamble"),
        ([b"ZO"], "preamble"),
        ([b"XYZ\x01\x00\x00\x00\x00\x00\xc0"], "magic"),
        ([b"ZOM\x02\x00\x00\x00\x00\x00\xc0"], "version 2"),
        ([b"ZOM\x01\x80\x00\x00\x00\x00\xc0"], "flags"),
        ([b"ZOM\x01\x00\x00\x00\x00\x00"], "header"),
        ([b"ZOM\x01\x00\x00\x00\x00\x00\xc0\xc0"], "header"),
        ([b"ZOM\x01\x00\x01\x00\x00\x00\xc0", b"x"], "no extension"),
        ([b"ZOM\x01\x00\x00\x00\x00\x00\xc0", b"x"], "declares 0"),
        ([b"ZOM\x01\x02\x00\x00\x00\x00\xc0"], "without EXT"),
        ([header(msgpack.ExtType(1, b""), flags=0)], "declares none"),
        ([header(msgpack.ExtType(99, b""))], "unknown extension"),
        ([b"ZOM\x01\x01\x00\x00\x00\x00\xd4\xff\x00"], "header"),  # malformed msgpack timestamp
        ([header(array_ext(b"<f4", (4,), index=1, nbytes=16), n_oob=1), bytes(15)], "holds 15"),
        ([header(array_ext(b"<f4", (4,), index=1, nbytes=12), n_oob=1), bytes(16)], "declares 12"),
        ([header(array_ext(b"<f4", (2**62, 2**62), index=1, nbytes=16), n_oob=1), bytes(16)], "declares"),
        ([header(array_ext(b"|O8", (2,), index=1, nbytes=16), n_oob=1), bytes(16)], "allow-list"),
        ([header(array_ext(b"<U1", (1,), index=1, nbytes=4), n_oob=1), bytes(4)], "allow-list"),
        ([header(array_ext(b"<f4", (1,), index=2, nbytes=4), n_oob=2), bytes(4), bytes(4)], "expected frame 1"),
        ([header([array_ext(b"<f4", (1,), index=1, nbytes=4)] * 2, n_oob=1), bytes(4)], "expected frame 2"),
        ([header(array_ext(b"<f4", (1,), index=1, nbytes=4, layout=0x06), n_oob=1), bytes(4)], "layout"),
        ([header(msgpack.ExtType(4, b""))], "tuple marker"),
        ([header([1, msgpack.ExtType(4, b"")], flags=0x03)], "tuple marker"),
        ([header(msgpack.ExtType(5, b""))], "big-int"),
        ([header(msgpack.ExtType(3, b"\x03<f4\x00"))], "needs 4 bytes"),
        ([header(msgpack.ExtType(6, pickle.dumps(1)), flags=0x05)], "allow_pickle"),
        ([b"ZOM\x01\x00\x00\x00\x00\x00\xa3ab"], "header"),  # truncated str
        ([b"ZOM\x01\x00\x00\x00\x00\x00\xa2\xff\xfe"], "header"),  # invalid UTF-8
        ([b"ZOM\x01\x00\x00\x00\x00\x00\x81\x90\x01"], "header"),  # unhashable map key
        ([b"ZOM\x01\x00\x00\x00\x00\x00\xdd\xff\xff\xff\xff"], "header"),  # forged 4G-element array
        ([b"ZOM\x01\x00\x00\x00\x00\x00" + b"\x91" * 5000 + b"\xc0"], "header"),  # too deep
        ([12345], "preamble"),
        ([None], "preamble"),
        (None, "preamble"),
    ],
)
def test_invalid_frame_sets_raise_decode_error(frames: Any, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(frames)


def test_deeply_nested_tuples_are_rejected_or_decoded_never_crash() -> None:
    deep: Any = ()
    for _ in range(200):
        deep = (deep,)
    wide = DecodeLimits(max_depth=256)
    frames = encode(deep, limits=wide)
    assert decode(frames, limits=wide) == deep
    with pytest.raises(DecodeError, match="deeper than the limit of 32"):
        decode(frames)
    with pytest.raises(EncodeError, match="deeper than the limit of 32"):  # the encoder refuses it too
        encode(deep)
    body = b"\x91\xd4\x04\x00" * 2000 + b"\xc0"  # 2000 nested tuple markers: over msgpack's stack
    with pytest.raises(DecodeError):
        decode([b"ZOM\x01\x03\x00\x00\x00\x00" + body])


def test_limits_are_enforced() -> None:
    frames = encode({"a": np.zeros((2, 3, 4), np.float32), "b": np.zeros(100), "s": "x" * 500}, inline_threshold=0)
    assert decode(frames, limits=DecodeLimits(max_ndim=3, max_frames=2, max_header_bytes=len(frames[0])))
    with pytest.raises(DecodeError, match="3 dimensions, limit is 2"):
        decode(frames, limits=DecodeLimits(max_ndim=2))
    with pytest.raises(DecodeError, match="limit is 1"):
        decode(frames, limits=DecodeLimits(max_frames=1))
    with pytest.raises(DecodeError, match="header of"):
        decode(frames, limits=DecodeLimits(max_header_bytes=len(frames[0]) - 10))
    with pytest.raises(DecodeError, match="limit of"):
        decode(frames, limits=DecodeLimits(max_total_bytes=frames_nbytes(frames) - 1))
    assert decode(frames, limits=DecodeLimits(max_total_bytes=frames_nbytes(frames)))


def test_one_frame_headers_share_a_state_that_keeps_each_calls_limits_and_no_decode_changes() -> None:
    """Inline-only headers decode through one shared state: limits still per call, hostile ones refused."""
    from zmq_omni.wire import _codec

    cube = encode({"a": np.arange(8, dtype=np.int16).reshape(2, 2, 2)})
    assert len(cube) == 1 and cube[0][4] == 0x01  # one frame whose preamble declares only FLAG_EXT
    strict, loose = DecodeLimits(max_ndim=2), DecodeLimits(max_ndim=3)
    for _ in range(3):  # alternating limits objects: the kept state is compared by identity, never reused wrongly
        with pytest.raises(DecodeError, match="3 dimensions, limit is 2"):
            decode(cube, limits=strict)
        assert same(decode(cube, limits=loose)["a"], np.arange(8, dtype=np.int16).reshape(2, 2, 2))
        assert decode(cube)["a"].flags.writeable  # an inline array is a private, writable copy
    out_of_band = header([array_ext(b"<i2", (4,), index=1, nbytes=8)])  # refers to a frame 1 it does not have
    tuple_mark = header([msgpack.ExtType(_codec.EXT_TUPLE, b""), 1])  # a tuple marker its flags do not declare
    for forged, message in ((out_of_band, "refers to frame 1"), (tuple_mark, "malformed tuple marker")):
        with pytest.raises(DecodeError, match=message):
            decode([forged])
    state = _codec._last_single_frame_state[1]
    assert (state.next_frame, state.total, state.open_marks) == (1, 0, 0)
    assert same(decode(encode((1, 2))), (1, 2))  # a header with marks still gets a state of its own

    arrays = [np.full(64, i, np.uint8) for i in range(4)]
    wires = [encode(a) for a in arrays]
    errors: list[BaseException] = []

    def decode_many(i: int) -> None:
        try:
            for _ in range(2000):
                assert same(decode(wires[i]), arrays[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=decode_many, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors


def test_decode_limits_reject_bad_values() -> None:
    from zmq_omni.errors import ConfigError

    with pytest.raises(ConfigError, match="max_frames"):
        DecodeLimits(max_frames=-1)
    with pytest.raises(ConfigError, match="max_ndim"):
        DecodeLimits(max_ndim=65)


def test_encode_rejects_bad_arguments_and_cuda_style_misuse() -> None:
    with pytest.raises(EncodeError):
        encode(1, inline_threshold=-1)
    with pytest.raises(EncodeError):
        encode("\ud800")  # lone surrogate: not UTF-8 encodable


def test_encoder_does_not_pin_arrays_after_the_call() -> None:
    import gc
    import weakref

    arr = np.zeros(1 << 16)
    ref = weakref.ref(arr)
    frames = encode(arr, inline_threshold=0)
    del arr, frames
    gc.collect()
    assert ref() is None


# --- the codec's memos must never weaken validation or grow without bound ---------------------------------


def test_memoized_descriptor_still_rejects_wrong_frames() -> None:
    from zmq_omni.errors import DecodeError
    from zmq_omni.wire import decode, encode

    arr = np.arange(1 << 18, dtype=np.float32)  # 1 MiB, out of band
    frames = [bytes(f) for f in encode({"x": arr})]
    np.testing.assert_array_equal(decode(frames)["x"], arr)  # primes the memos
    with pytest.raises(DecodeError):
        decode([frames[0], frames[1][:-4]])  # short frame, same descriptor
    with pytest.raises(DecodeError):
        decode([frames[0]])  # missing frame
    with pytest.raises(DecodeError):
        decode([frames[0], frames[1], b"extra"])  # extra frame
    from zmq_omni.wire import DecodeLimits

    with pytest.raises(DecodeError):
        decode(frames, limits=DecodeLimits(max_total_bytes=1024))
    # and the memo did not break a valid decode afterwards
    np.testing.assert_array_equal(decode(frames)["x"], arr)


def test_codec_memos_stay_bounded() -> None:
    from zmq_omni.wire import _decoder, _encoder, decode, encode

    for n in range(3000):
        arr = np.zeros(4096 + n, dtype=np.float32)  # a new shape every call
        decode(encode({"x": arr}))
    assert len(_encoder._oob_ext_memo) <= _encoder._MEMO_SIZE
    assert len(_decoder._oob_descriptors) <= _encoder._MEMO_SIZE


def test_a_tensor_frame_keeps_its_tensor_alive() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(1 << 12, dtype=torch.int32)
    want = tensor.clone()
    frames = encode({"t": tensor}, inline_threshold=0)
    del tensor
    gc.collect()
    fillers = [torch.full((1 << 12,), -1, dtype=torch.int32) for _ in range(8)]  # what would reuse freed memory
    assert torch.equal(decode([frames[0], bytes(frames[1])])["t"], want)
    del fillers


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lead", [b"", b"\x90" * 600, b"a" * 600])
def test_nesting_past_the_first_counted_bytes_is_rejected(lead: bytes) -> None:
    """A header's container bytes are counted in two parts: nesting after either part is refused all the same."""
    from zmq_omni.wire._codec import _PLAIN_PREAMBLE

    limits = DecodeLimits(max_depth=8)
    deep = b"\x91" * 9 + b"\x01"  # [[[...1...]]], nine deep
    filler = msgpack.packb(lead) if lead else b""
    body = b"\x92" + filler + deep if filler else deep
    for frame in (_PLAIN_PREAMBLE + body, memoryview(b"pad" + _PLAIN_PREAMBLE + body)[3:]):  # bytes, or a view
        with pytest.raises(DecodeError, match="deeper"):
            decode([frame], limits=limits)
    shallow = b"\x92" + filler + b"\x91" * 6 + b"\x01" if filler else b"\x91" * 6 + b"\x01"
    assert decode([_PLAIN_PREAMBLE + shallow], limits=limits) is not None
