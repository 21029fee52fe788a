"""The codec's per-class Struct plans: every way a plan makes a field map writes what msgspec writes, nested
Structs made RECORDs in the same pass encode to the same bytes as one at a time, and the encoder's shortcuts
(a small tensor's bytes, the walk of a header holding inline arrays) keep their results and their limits."""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from zmq_omni.errors import EncodeError
from zmq_omni.wire import DecodeLimits, _registry, _staging, decode, encode, register_type, unregister_type


class _Omit(msgspec.Struct, omit_defaults=True, kw_only=True):
    pass


class Leaf(_Omit):
    data: Any = None
    start: int | None = None
    note: str | msgspec.UnsetType = msgspec.UNSET


class Defaults(msgspec.Struct, omit_defaults=True):
    size: int = 7
    label: str = "plain"
    leaf: Leaf | None = None


class Factories(msgspec.Struct, omit_defaults=True):
    items: list[int] = msgspec.field(default_factory=list)
    extra: dict[str, int] = msgspec.field(default_factory=dict)
    leaf: Leaf | None = None


class Every(msgspec.Struct):
    required: int
    leaf: Leaf | None = None
    maybe: int | msgspec.UnsetType = msgspec.UNSET


class Tagged(msgspec.Struct, tag="t", tag_field="kind", omit_defaults=True, rename="camel"):
    first_field: int | None = None
    inner_leaf: Leaf | None = None


class Outer(_Omit):
    embed: Leaf | None = None
    meta: Defaults | None = None
    more: Factories | None = None
    every: Every | None = None
    tagged: Tagged | None = None
    rows: list[Leaf] | None = None


CASES = [
    Leaf(),
    Leaf(data=3, note="n"),
    Defaults(),
    Defaults(8, "plain", Leaf(start=1)),
    Defaults(7, "".join(["pla", "in"])),  # equal to the default, not the default object: written
    Factories(),
    Factories([1], {}, Leaf(start=0)),
    Every(1),
    Every(2, Leaf(note="x"), 5),
    Tagged(),
    Tagged(3, Leaf(data="d")),
    Outer(
        embed=Leaf(data=4),
        meta=Defaults(size=1),
        more=Factories(items=[2]),
        every=Every(0),
        tagged=Tagged(1),
        rows=[Leaf(start=5)],
    ),
]


def _as_msgspec_yields(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_msgspec_yields(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_msgspec_yields(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("obj", CASES, ids=lambda o: type(o).__name__)
def test_every_plan_writes_what_msgspec_writes_field_order_too(obj: Any) -> None:
    want = msgspec.msgpack.decode(msgspec.msgpack.encode(obj))
    for _ in range(2):  # the first encode makes the plans, the second uses them (nested ones in one pass)
        got = decode(encode(obj))
        assert _as_msgspec_yields(got) == want
        assert repr(got) == repr(want)  # key order at every level


@pytest.mark.parametrize("obj", CASES, ids=lambda o: type(o).__name__)
def test_nested_structs_in_one_pass_encode_to_the_bytes_of_one_at_a_time(obj: Any) -> None:
    _registry.struct_plans.clear()
    first = encode(obj)  # plans made as each class is met: nested Structs go back through the codec
    assert encode(obj) == first
    fieldwise = {cls: plan._replace(how=_registry._FIELDWISE) for cls, plan in _registry.struct_plans.items()}
    _registry.struct_plans.update(fieldwise)
    try:
        assert encode(obj) == first
    finally:
        _registry.struct_plans.clear()


def test_a_plan_chooses_its_comprehension_by_the_class() -> None:
    for obj in CASES:
        encode(obj)
    how = {cls: plan.how for cls, plan in _registry.struct_plans.items()}
    assert how[Leaf] == _registry._DEFAULTS  # an UNSET default, not None
    assert how[Outer] == _registry._ALL_NONE
    assert how[Defaults] == _registry._DEFAULTS
    assert how[Factories] == _registry._FIELDWISE
    assert how[Every] == _registry._EVERY


def test_a_registered_struct_nested_in_an_unregistered_one_keeps_its_own_encoding() -> None:
    name = register_type(Leaf, name="leaf", encode=lambda leaf: leaf.start, decode=lambda v: Leaf(start=v))
    try:
        obj = Defaults(1, "x", Leaf(start=9))
        for _ in range(2):
            got = decode(encode(obj))
            assert got == {"size": 1, "label": "x", "leaf": Leaf(start=9)}
    finally:
        unregister_type(name)


def test_registered_structs_decode_as_their_classes_nested() -> None:
    names = [register_type(cls) for cls in (Outer, Leaf, Defaults)]
    try:
        obj = Outer(embed=Leaf(data=1), meta=Defaults(size=2, leaf=Leaf(start=3)))
        for _ in range(2):
            assert decode(encode(obj)) == obj
    finally:
        for name in names:
            unregister_type(name)


def test_small_tensor_bytes_are_read_at_their_address() -> None:
    for dtype in (torch.bfloat16, torch.bool, torch.int64, torch.float32):
        tensor = (torch.arange(300) % 7).to(dtype).reshape(3, 100)
        got = decode(encode(Leaf(data=tensor)))["data"]
        assert got.dtype == dtype
        assert torch.equal(got, tensor)
    address = torch.arange(10, dtype=torch.int64).data_ptr()
    assert _staging.byte_array(80).from_address(address).raw == ctypes.string_at(address, 80)


def test_byte_array_types_are_bounded() -> None:
    _staging.byte_arrays.clear()
    for n in range(1, _staging._BYTE_ARRAYS_SIZE + 10):
        _staging.byte_array(n)
    assert len(_staging.byte_arrays) <= _staging._BYTE_ARRAYS_SIZE
    assert _staging.byte_array(5) is _staging.byte_array(5)


def test_a_header_walked_at_once_for_its_inline_arrays_still_meets_the_limits() -> None:
    inline = np.arange(512, dtype=np.int64)  # 4 KiB inline, under the 16 KiB threshold
    deep: Any = inline
    for _ in range(40):
        deep = [deep]
    with pytest.raises(EncodeError, match="refuse"):
        encode(deep)
    shallow: Any = inline
    for _ in range(30):
        shallow = [shallow]
    got = decode(encode(shallow))
    for _ in range(30):
        got = got[0]
    np.testing.assert_array_equal(got, inline)
    many = {"a": inline, "b": list(range(100))}
    with pytest.raises(EncodeError, match="refuse"):
        encode(many, limits=DecodeLimits(max_objects=50))
    assert decode(encode(many))["b"] == list(range(100))


def test_the_registry_marks_records_with_the_codec_s_record_code() -> None:
    from zmq_omni.wire._codec import EXT_RECORD

    assert _registry.RECORD_CODE == EXT_RECORD
    encode(Leaf())
    assert _registry.struct_plans[Leaf].marker.code == EXT_RECORD
