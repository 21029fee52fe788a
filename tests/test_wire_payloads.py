"""The codec's payload types beyond arrays: Structs, dataclasses, PIL images, tuples, slices, registered
types and tensors on any device, round-tripped, checked against msgspec, and attacked."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

import zmq_omni
from zmq_omni.errors import ConfigError, DecodeError, EncodeError
from zmq_omni.wire import decode, decode_each, encode, register_type, resolve_device, unregister_type
from zmq_omni.wire._codec import (
    EXT_CUSTOM,
    EXT_IMAGE,
    EXT_RECORD,
    EXT_SLICE,
    EXT_TUPLE,
    FLAG_EXT,
    FLAG_OBJECT,
    FLAG_TUPLE,
    MAGIC,
    WIRE_VERSION,
)
from zmq_omni.wire._staging import StagingPool, stage_to_host

from . import payload_cases as cases


@pytest.fixture
def records() -> Iterator[None]:
    cases.register_records()
    cases.register_custom()
    try:
        yield
    finally:
        cases.unregister_all()


@pytest.fixture
def custom_only() -> Iterator[None]:
    cases.register_custom()
    try:
        yield
    finally:
        cases.unregister_all()


def header(obj: Any, flags: int = FLAG_EXT | FLAG_OBJECT, frames: int = 0) -> bytes:
    return MAGIC + bytes((WIRE_VERSION, flags)) + frames.to_bytes(4, "little") + msgpack.packb(obj)


# -- round trips ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [0, 16 << 10, 1 << 30])
def test_every_payload_type_round_trips_registered(records: None, threshold: int) -> None:
    payload = cases.build_payload()
    got = decode(encode(payload, inline_threshold=threshold))
    assert cases.differences(got, cases.expected(payload, registered=True)) == []


@pytest.mark.parametrize("threshold", [0, 16 << 10])
def test_unregistered_records_decode_as_the_dicts_vllm_omni_yields(custom_only: None, threshold: int) -> None:
    payload = cases.build_payload()
    got = decode(encode(payload, inline_threshold=threshold))
    assert cases.differences(got, cases.expected(payload, registered=False)) == []
    assert got["struct"] == {"x": 1, "y": 2.5, "tags": ["a", "b"], "emb": got["struct"]["emb"]}
    assert got["tagged"] == ["Tagged", 7, "seven"]


class Plain(msgspec.Struct):
    a: int
    b: str = "default-string-value"
    c: list[int] = msgspec.field(default_factory=list)


class Renamed(msgspec.Struct, rename="camel", omit_defaults=True):
    first_field: int
    second_field: str = "x-default-value"
    third: dict[str, int] = msgspec.field(default_factory=dict)
    unset: int | msgspec.UnsetType = msgspec.UNSET


class Arr(msgspec.Struct, array_like=True, omit_defaults=True):
    a: int
    b: int = 5


class TagKind(msgspec.Struct, tag="kind-a", tag_field="kind"):
    v: float


class TagArr(msgspec.Struct, tag=3, array_like=True):
    v: bytes


@dataclasses.dataclass
class DC:
    a: int
    _private: str = "p"
    later: int = dataclasses.field(default=4, init=False)
    set_later: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.set_later = self.a * 2


@dataclasses.dataclass(slots=True)
class Slotted:
    a: int
    b: tuple[int, ...] = ()


MSGSPEC_CASES = [
    Plain(1),
    Plain(2, "other", [1, 2]),
    Renamed(1),
    Renamed(2, "changed", {"k": 1}, 5),
    Renamed(3, "".join(["x-default-", "value"]), {}),  # equal to the default, not the default object
    Renamed(4, Renamed.__struct_defaults__[0], {}),  # the default object itself
    Arr(1),
    Arr(1, 6),
    TagKind(1.5),
    TagArr(b"\x00\x01"),
    DC(3),
    DC(4, "q"),
    Slotted(1, (2, 3)),
]


def _as_msgspec_yields(value: Any) -> Any:
    """Our decoded value with tuples as lists (msgspec's untyped decoder has no tuples)."""
    if isinstance(value, (list, tuple)):
        return [_as_msgspec_yields(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_msgspec_yields(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("obj", MSGSPEC_CASES, ids=lambda o: f"{type(o).__name__}")
def test_unregistered_record_is_exactly_what_msgspec_msgpack_yields(obj: Any) -> None:
    want = msgspec.msgpack.decode(msgspec.msgpack.encode(obj))
    got = decode(encode(obj))
    assert _as_msgspec_yields(got) == want
    assert list(got) == list(want) if isinstance(want, dict) else True  # field order too


class _OmitBase(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    pass


class InnerChunk(_OmitBase):
    decode: Any = None
    start: int | None = None


class OuterChunk(_OmitBase):
    embed: InnerChunk | None = None
    request_id: str | None = None
    ids: list[int] = msgspec.field(default_factory=list)


def test_a_struct_class_is_read_once_and_every_instance_still_encodes_as_msgspec_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vllm-omni's payloads are Structs like these; reading a class's fields each time cost a put milliseconds."""
    calls: list[type] = []
    fields = msgspec.structs.fields

    def counting_fields(cls: Any) -> Any:
        calls.append(cls)
        return fields(cls)

    monkeypatch.setattr(msgspec.structs, "fields", counting_fields)
    chunks = [
        OuterChunk(embed=InnerChunk(decode=np.arange(4), start=n), request_id=f"r{n}", ids=[n] * (n % 2))
        for n in range(4)
    ]
    for chunk in chunks:
        got = decode(encode(chunk))
        plain = OuterChunk(embed=InnerChunk(start=chunk.embed.start), request_id=chunk.request_id, ids=chunk.ids)  # type: ignore[union-attr]
        want = msgspec.msgpack.decode(msgspec.msgpack.encode(plain))
        np.testing.assert_array_equal(got["embed"].pop("decode"), np.arange(4))
        assert got == want
    assert sorted(calls, key=id) == sorted([OuterChunk, InnerChunk], key=id)


@pytest.mark.parametrize("obj", MSGSPEC_CASES, ids=lambda o: f"{type(o).__name__}")
def test_registered_record_decodes_as_its_class(obj: Any) -> None:
    name = register_type(type(obj))
    try:
        got = decode(encode({"o": obj, "in_list": [obj]}))
    finally:
        unregister_type(name)
    assert type(got["o"]) is type(obj) and got["o"] == obj
    assert got["in_list"][0] == obj


def test_registered_type_on_receiver_only_still_decodes_as_the_class() -> None:
    frames = encode(Plain(5, "s"))  # the sender did not register
    name = register_type(Plain)
    try:
        assert decode(frames) == Plain(5, "s")
    finally:
        unregister_type(name)
    assert decode(frames) == {"a": 5, "b": "s", "c": []}


def test_tuples_and_slices_keep_their_types_nested() -> None:
    obj = {"t": (1, (2, (3,)), [(), (slice(None, 5),)]), "s": slice(-1, None, -2), "big": slice(2**80, -(2**70))}
    got = decode(encode(obj))
    assert got == obj
    assert type(got["t"][1][1]) is tuple and type(got["t"][2][1][0]) is slice
    assert decode(encode(slice(np.int64(3), None))) == slice(3, None)
    with pytest.raises(EncodeError, match="slice"):
        encode(slice("a", "b"))


@pytest.mark.parametrize("mode", sorted(zmq_omni.wire._codec.IMAGE_MODE_BITS))
def test_every_pil_mode_round_trips(mode: str) -> None:
    rng = np.random.default_rng(0)
    img = Image.new(mode, (13, 5))
    img.frombytes(rng.integers(0, 256, len(img.tobytes()), dtype=np.uint8).tobytes())
    for threshold in (0, 1 << 20):
        got = decode(encode({"img": img}, inline_threshold=threshold))["img"]
        assert (got.mode, got.size, got.tobytes()) == (mode, (13, 5), img.tobytes())


def test_pil_palette_survives_and_unsupported_modes_are_refused() -> None:
    img = Image.new("P", (4, 4))
    img.putpalette(bytes(range(30)), "RGB")
    assert decode(encode(img)).getpalette() == img.getpalette()
    rgba_pal = Image.new("PA", (2, 2))
    rgba_pal.putpalette(bytes(range(16)), "RGBA")
    got = decode(encode(rgba_pal))
    assert got.palette.mode == "RGBA" and got.getpalette("RGBA") == list(range(16))


def test_pil_image_subclasses_from_files_round_trip(tmp_path: Any) -> None:
    path = tmp_path / "x.png"
    Image.new("RGB", (8, 6), (9, 8, 7)).save(path)
    with Image.open(path) as opened:  # a PngImageFile, loaded lazily
        got = decode(encode(opened))
    assert type(got) is Image.Image and got.tobytes() == bytes((9, 8, 7)) * 48


def test_bfloat16_tensors_decode_without_importing_ml_dtypes() -> None:
    """Its import (up to a second) would fall on the first message of a stage that receives bf16 tensors."""
    code = (
        "import sys, torch\n"
        "from zmq_omni.wire import decode, encode\n"
        "for threshold in (0, 1 << 20):\n"
        "    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)\n"
        "    got = decode([bytes(f) for f in encode({'x': x}, inline_threshold=threshold)])['x']\n"
        "    assert got.dtype == torch.bfloat16 and torch.equal(got, x), got\n"
        "print('ml_dtypes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_receiver_without_pillow_gets_a_clear_decode_error() -> None:
    frames = [bytes(f) for f in encode({"img": Image.new("L", (2, 2))})]
    code = (
        "import sys; sys.modules['PIL'] = None; sys.modules['PIL.Image'] = None\n"
        "from zmq_omni.wire import decode\n"
        "from zmq_omni.errors import DecodeError\n"
        f"frames = {frames!r}\n"
        "try:\n    decode(frames)\nexcept DecodeError as exc:\n    print('DecodeError:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "DecodeError:" in out.stdout and "Pillow is not installed" in out.stdout, out.stdout


def test_tensor_edge_cases_round_trip() -> None:
    tensors = [
        torch.zeros(0),
        torch.zeros((2, 0, 3), dtype=torch.bfloat16),
        torch.tensor(1.5, dtype=torch.bfloat16),
        torch.randn(300, 300).to(torch.bfloat16),
        torch.arange(12).reshape(3, 4).t(),  # not contiguous
        torch.randn(4, requires_grad=True),
        torch.nn.Parameter(torch.randn(3, 2)),  # a subclass: not the hook's plain-tensor test, the same encoding
    ]
    for threshold in (0, 1 << 30):
        got = decode(encode(tensors, inline_threshold=threshold))
        for g, t in zip(got, tensors, strict=True):
            assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t.detach())


def test_one_dimensional_tensors_decode_as_private_writable_copies_or_frame_views() -> None:
    # Every dtype numpy has (bfloat16 as its words) is built by torch.from_numpy; the rest by torch.frombuffer.
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16]
    dtypes += [torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.uint16]
    for dtype in dtypes:
        tensor = torch.arange(800).to(dtype)
        for threshold in (0, 1 << 30):
            frames = encode({"codes": tensor, "flag": torch.tensor(True)}, inline_threshold=threshold)
            received = [bytearray(frame) for frame in frames]
            got = decode(received)
            codes = got["codes"]
            assert codes.dtype == dtype and codes.shape == (800,) and torch.equal(codes, tensor), dtype
            assert got["flag"].dtype == torch.bool and got["flag"].shape == () and bool(got["flag"])
            codes[0] = codes[1]  # writable: a private copy inline, a view of the (writable) frame out of band
            assert torch.equal(decode(frames)["codes"], tensor)
            again = decode(received)["codes"]
            assert torch.equal(again, codes if threshold == 0 else tensor), dtype


# -- registry ------------------------------------------------------------------------------------------------
def test_registry_refuses_duplicates_missing_functions_and_bad_names() -> None:
    name = register_type(cases.Celsius, name="t.C", encode=lambda c: c.degrees, decode=cases.Celsius)
    try:
        assert name == "t.C"
        with pytest.raises(ConfigError, match="already registered"):
            register_type(cases.Celsius, name="t.other", encode=str, decode=str)
        with pytest.raises(ConfigError, match="already registered"):
            register_type(Plain, name="t.C")
        assert decode(encode([cases.Celsius(3.0)])) == [cases.Celsius(3.0)]
    finally:
        unregister_type("t.C")
    with pytest.raises(ConfigError, match="encode and a decode"):
        register_type(cases.Celsius)
    with pytest.raises(ConfigError, match="encode and a decode"):
        register_type(Plain, encode=lambda p: p.a)
    with pytest.raises(ConfigError, match="callable"):
        register_type(cases.Celsius, encode=1, decode=2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="1 to 255"):
        register_type(Plain, name="")
    with pytest.raises(ConfigError, match="1 to 255"):
        register_type(Plain, name="x" * 256)
    with pytest.raises(ConfigError, match="class"):
        register_type(Plain(1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no type"):
        unregister_type("never")
    with pytest.raises(EncodeError, match="Celsius"):
        encode(cases.Celsius(1.0))  # unregistered and not a record
    for cls in (DC, Plain):  # the classes themselves are not records
        with pytest.raises(EncodeError, match="type"):
            encode({"cls": cls})


def test_unknown_registered_name_is_a_decode_error_never_an_import() -> None:
    register_type(cases.Celsius, name="os.system", encode=lambda c: c.degrees, decode=cases.Celsius)
    try:
        frames = encode(cases.Celsius(1.0))
    finally:
        unregister_type("os.system")
    modules = set(sys.modules)
    with pytest.raises(DecodeError, match=r"unknown registered type 'os\.system'"):
        decode(frames)
    assert set(sys.modules) == modules


def test_registered_functions_that_fail_raise_typed_errors() -> None:
    def bad_decode(value: Any) -> Any:
        raise RuntimeError("boom")

    register_type(cases.Celsius, name="t.bad", encode=lambda c: c.degrees, decode=bad_decode)
    try:
        with pytest.raises(DecodeError, match=r"t\.bad.*boom"):
            decode(encode(cases.Celsius(1.0)))
    finally:
        unregister_type("t.bad")
    register_type(cases.Celsius, name="t.bad2", encode=lambda c: 1 / 0, decode=cases.Celsius)
    try:
        with pytest.raises(EncodeError, match=r"t\.bad2.*ZeroDivisionError"):
            encode(cases.Celsius(1.0))
    finally:
        unregister_type("t.bad2")
    name = register_type(Plain)
    try:  # a record whose fields do not fit the registered class
        with pytest.raises(DecodeError, match="unknown field 'zz'"):
            decode([header([msgpack.ExtType(EXT_RECORD, name.encode()), {"a": 1, "zz": 2}])])
    finally:
        unregister_type(name)


def test_public_exports() -> None:
    assert zmq_omni.register_type is register_type and zmq_omni.unregister_type is unregister_type


# -- hostile input -------------------------------------------------------------------------------------------
REC = msgpack.ExtType(EXT_RECORD, b"some.Type")
CUS = msgpack.ExtType(EXT_CUSTOM, b"never.registered")
SLC = msgpack.ExtType(EXT_SLICE, b"")
IMG = msgpack.ExtType(EXT_IMAGE, b"")
PIX = msgpack.ExtType(1, b"\x00\x01\x03|u1" + (4).to_bytes(8, "little") + b"\x01\x02\x03\x04")


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([header([REC, {"a": 1}], flags=FLAG_EXT)], "declares none"),  # marker without the OBJECT flag
        ([header([REC, {"a": 1}], flags=FLAG_OBJECT)], "without EXT"),
        ([header([1, REC, {}])], "marker"),  # not first
        ([header({"k": REC})], "marker"),  # a map value
        ([header(REC)], "marker"),  # top level
        ([header([REC])], r"\[marker, value\]"),
        ([header([REC, {}, 1])], r"\[marker, value\]"),
        ([header([REC, 5])], "not a map or list"),
        ([header([msgpack.ExtType(EXT_RECORD, b""), {}])], "type name of 0 bytes"),
        ([header([msgpack.ExtType(EXT_RECORD, b"x" * 300), {}])], "type name of 300 bytes"),
        ([header([msgpack.ExtType(EXT_RECORD, b"\xff\xfe"), {}])], "not UTF-8"),
        ([header([CUS, 1])], "unknown registered type"),
        ([header([SLC, 1, 2])], "slice"),
        ([header([SLC, 1, "a", None])], "slice"),
        ([header([SLC, 1.5, None, None])], "slice"),
        ([header([msgpack.ExtType(EXT_SLICE, b"x"), 1, 2, 3])], "must be empty"),
        ([header([IMG, "RGB", 1, 1])], "image is"),
        ([header([IMG, "XYZ", 2, 2, PIX, None])], "mode 'XYZ'"),
        ([header([IMG, 5, 2, 2, PIX, None])], "mode 5"),
        ([header([IMG, "L", 2, "2", PIX, None])], "image size"),
        ([header([IMG, "L", -2, -2, PIX, None])], "image size"),
        ([header([IMG, "L", 2**31, 0, msgpack.ExtType(1, b"\x00\x01\x03|u1" + bytes(8)), None])], "image size"),
        ([header([IMG, "L", 3, 2, PIX, None])], "needs 6 pixel bytes, got 4"),
        ([header([IMG, "L", 2**20, 2**20, PIX, None])], "pixel bytes"),
        ([header([IMG, "L", 2, 2, b"\x01\x02\x03\x04", None])], "1-D uint8 array"),
        ([header([IMG, "L", 2, 2, PIX, ["RGB", b"\x00" * 3]])], "palette"),
        ([header([IMG, "P", 2, 2, PIX, ["RGB", b"\x00" * 4]])], "palette"),
        ([header([IMG, "P", 2, 2, PIX, ["CMYK", b"\x00" * 4]])], "palette"),
        ([header([IMG, "P", 2, 2, PIX, ["RGB", b"\x00" * 771]])], "palette"),
        ([header([IMG, "P", 2, 2, PIX, "RGB"])], "palette"),
        ([header([msgpack.ExtType(EXT_TUPLE, b""), 1], flags=FLAG_EXT | FLAG_OBJECT)], "malformed tuple"),
        ([header([msgpack.ExtType(11, b""), 1], flags=FLAG_EXT | FLAG_OBJECT | FLAG_TUPLE)], "unknown extension"),
        ([header({"a": 1}, flags=0x10)], "unknown preamble flags"),
    ],
)
def test_hostile_object_markers_raise_decode_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(frames)
    got = decode_each(frames)[0]  # the batch path too: returned, never raised
    assert isinstance(got, DecodeError)


def test_a_zero_size_image_with_a_huge_side_is_refused_before_pillow_allocates() -> None:
    empty = msgpack.ExtType(1, b"\x00\x01\x03|u1" + bytes(8))
    assert decode([header([IMG, "L", 0, 5, empty, None])]).size == (0, 5)
    with pytest.raises(DecodeError, match="image size"):
        decode([header([IMG, "L", 2**40, 0, empty, None])])


# -- device tensors: host staging, decode device -----------------------------------------------------------------
def test_staging_copies_once_into_a_reused_buffer_released_after_the_last_view() -> None:
    pool = StagingPool(pin=False)
    src = torch.randn(64, 1024)  # 256 KiB
    raw = stage_to_host(torch, src, pool)
    original = src.numpy().tobytes()
    assert raw.dtype == np.uint8 and raw.nbytes == src.nbytes and raw.tobytes() == original
    assert pool.allocated == 1 and pool.cached_bytes == 0
    view = memoryview(raw.reshape(-1).view(np.uint8)).cast("B")  # what a frame holds
    del raw
    gc.collect()
    assert pool.cached_bytes == 0, "released while a frame still views the buffer"
    src.zero_()  # the caller may reuse its tensor at once: the staged copy is independent
    assert bytes(view) == original
    del view
    gc.collect()
    assert pool.cached_bytes == 256 << 10
    again = stage_to_host(torch, torch.ones(60_000), pool)  # 240 KiB: the same size class, reused
    assert pool.reused == 1 and pool.allocated == 1 and pool.cached_bytes == 0
    assert again.nbytes == 240_000 and np.frombuffer(again, np.float32).tolist() == [1.0] * 60_000
    small = stage_to_host(torch, torch.ones(10), pool)  # another class: a new buffer
    assert pool.allocated == 2 and small.nbytes == 40


def test_staging_handles_strided_zero_size_and_bfloat16_and_encodes_through_the_codec() -> None:
    pool = StagingPool(pin=False)
    base = torch.randn(8, 6).to(torch.bfloat16)
    for t in (base.t(), base[:, :1], torch.zeros(0, 4), torch.tensor(3.0)):
        raw = stage_to_host(torch, t, pool)
        assert raw.tobytes() == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_staging_pool_is_bounded() -> None:
    pool = StagingPool(pin=False, max_cached_bytes=128 << 10)
    arrays = [stage_to_host(torch, torch.zeros(32 << 10), pool) for _ in range(3)]  # 128 KiB each
    del arrays
    gc.collect()
    assert pool.cached_bytes == 128 << 10 and pool.allocated == 3


def test_a_tensor_on_a_device_that_cannot_be_read_is_an_encode_error() -> None:
    with pytest.raises(EncodeError, match="meta"):
        encode({"t": torch.empty(4, device="meta")})


def test_resolve_device_and_decode_onto_it() -> None:
    assert resolve_device(None) is None and resolve_device("cpu") is None
    with pytest.raises(ConfigError, match="decode_device"):
        resolve_device("nonsense-device")
    with pytest.raises(ConfigError, match="no meta device"):  # torch cannot vouch for it: refused up front
        resolve_device("meta")
    with pytest.raises(ConfigError, match="device name"):
        resolve_device(3)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no cuda device"):
            resolve_device("cuda")
    t = torch.arange(6.0)
    got = decode(encode({"t": t}), device=torch.device("cpu"))
    assert torch.equal(got["t"], t)
    meta = decode(encode({"t": t}), device="meta")["t"]  # a real move through .to(device)
    assert meta.device.type == "meta" and meta.shape == (6,)


def test_decode_device_key_is_validated_by_the_connectors(tmp_path: Any) -> None:
    from zmq_omni.connectors.shm import SharedMemoryConnector
    from zmq_omni.connectors.zmq import ZmqConnector

    with pytest.raises(ConfigError, match="decode_device"):
        SharedMemoryConnector({"decode_device": "CUDA!"})
    with pytest.raises(ConfigError, match="decode_device"):
        ZmqConnector({"stage_id": "1", "role": "sender", "decode_device": 3})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"decode_device.*no cuda device"):
            ZmqConnector({"stage_id": "1", "role": "sender", "decode_device": "cuda:0"})


# -- CUDA ------------------------------------------------------------------------------------------------------
def _cuda_expected() -> bool:
    """CUDA must work when torch sees a GPU or the environment names one; only then may tests not skip."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return torch.cuda.is_available() or (visible is not None and visible.strip() not in ("", "-1"))


needs_cuda = pytest.mark.skipif(
    not _cuda_expected(), reason="no GPU: torch sees none and CUDA_VISIBLE_DEVICES is unset"
)


@needs_cuda
def test_cuda_is_usable_when_the_environment_names_a_gpu() -> None:
    # Fails (does not skip) when CUDA_VISIBLE_DEVICES names a GPU that torch cannot use.
    assert torch.cuda.is_available(), (
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} but torch.cuda.is_available() is False"
    )
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()


@needs_cuda
def test_cuda_tensors_stage_once_through_reused_pinned_memory_and_decode_on_cpu() -> None:
    from zmq_omni.wire import _staging

    tensors = {
        "f32": torch.randn(512, 1024, device="cuda"),
        "bf16": torch.randn(300, 7, device="cuda").to(torch.bfloat16),
        "strided": torch.randn(64, 64, device="cuda").t(),
        "empty": torch.zeros(0, 3, device="cuda"),
        "small": torch.arange(3, device="cuda"),
    }
    frames = encode(tensors)
    pool = _staging._pools[True]
    assert pool.pin and pool.allocated >= 1
    got = decode([bytes(f) for f in frames])
    for name, t in tensors.items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], t.cpu()), name
    del frames
    gc.collect()
    before = pool.allocated
    encode(tensors)
    assert pool.allocated == before and pool.reused >= 1


@needs_cuda
def test_cuda_decode_device_moves_tensors_onto_the_gpu() -> None:
    t = torch.randn(256, 256)
    got = decode(encode({"t": t, "arr": np.ones(3)}), device=resolve_device("cuda:0"))
    assert got["t"].device.type == "cuda" and torch.equal(got["t"].cpu(), t)
    assert isinstance(got["arr"], np.ndarray)


def test_staged_views_keep_their_buffer_weakly_tracked() -> None:
    pool = StagingPool(pin=False)
    raw = stage_to_host(torch, torch.ones(10), pool)
    owner = raw.base
    ref = weakref.ref(owner)
    del raw, owner
    gc.collect()
    assert ref() is None and pool.cached_bytes > 0
