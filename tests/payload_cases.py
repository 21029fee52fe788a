"""Payloads of every type vllm-omni's stages send, with the value a receiver must get back.

Importable by spawned processes: the payload is rebuilt deterministically on
each side, so a receiver checks what it got against its own copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from zmq_omni.wire import register_type, unregister_type


class Point(msgspec.Struct):
    x: int
    y: float
    tags: list[str]
    emb: Any = None


class Tagged(msgspec.Struct, array_like=True, tag=True):
    n: int
    label: str


@dataclasses.dataclass
class Meta:
    request_id: str
    hidden: Any
    scale: tuple[int, int]
    window: slice
    inner: Point


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: list[int] = dataclasses.field(default_factory=list)


class Celsius:
    """A user type with its own encode/decode functions (not a record)."""

    def __init__(self, degrees: float) -> None:
        self.degrees = degrees

    def __eq__(self, other: object) -> bool:
        return type(other) is Celsius and other.degrees == self.degrees

    __hash__ = None  # type: ignore[assignment]


RECORDS = (Point, Tagged, Meta, Frozen)


def register_records() -> None:
    for cls in RECORDS:
        register_type(cls)


def register_custom() -> None:
    register_type(Celsius, name="test.Celsius", encode=lambda c: c.degrees, decode=Celsius)


def unregister_all() -> None:
    from zmq_omni.wire import _registry

    for name in [n for n, e in _registry.by_name.items() if e.cls in (*RECORDS, Celsius)]:
        unregister_type(name)


def images() -> list[Any]:
    rng = np.random.default_rng(3)
    rgb = Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8))  # 180 KB: its own frame
    pal = Image.new("P", (5, 4))
    pal.putpalette(bytes(range(48)), "RGB")
    pal.putdata([i % 16 for i in range(20)])
    bits = Image.fromarray(rng.integers(0, 2, (7, 13), dtype=np.uint8).astype(bool))  # mode "1", 13 bits/row
    i16 = Image.fromarray(rng.integers(0, 65535, (3, 4), dtype=np.uint16))
    flt = Image.fromarray(rng.standard_normal((3, 4)).astype(np.float32))
    return [rgb, Image.new("L", (4, 3), 7), pal, bits, i16, flt, Image.new("RGBA", (0, 0))]


def build_payload() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(256, 1024, generator=gen)  # 1 MiB float32: shared memory on the fast path
    return {
        "struct": Point(1, 2.5, ["a", "b"], torch.arange(4, dtype=torch.bfloat16)),
        "tagged": Tagged(7, "seven"),
        "dataclass": Meta("r1", big, (1, 2), slice(0, 10, 2), Point(3, 0.5, [])),
        "frozen": Frozen(1, [2, 3]),
        "records": [Point(i, float(i), [str(i)]) for i in range(3)],
        "custom": Celsius(21.5),
        "images": images(),
        "tensors": (
            torch.zeros(0, 3),
            torch.zeros((4, 0), dtype=torch.bfloat16),
            torch.randn(64, 1024, generator=gen).to(torch.bfloat16),  # 128 KiB bfloat16
            torch.tensor([1, -2, 3], dtype=torch.int64),
            torch.tensor(True),
            torch.randn(3, 2, generator=gen, dtype=torch.complex64),
            torch.tensor(2.5, dtype=torch.bfloat16),
        ),
        "slices": (slice(None), slice(-3, None, -1), slice(2**70, None), [slice(1, 2)]),
        "nested": {"deep": [(1, (2, [3, {"k": (4,)}])), ()], 7: np.arange(10, dtype=np.int16), "none": None},
    }


def _fields_of(obj: Any) -> Any:
    """The value a receiver that did not register ``obj``'s class gets (vllm-omni's serializer's dict)."""
    if isinstance(obj, Point):
        return {"x": obj.x, "y": obj.y, "tags": obj.tags, "emb": obj.emb}
    if isinstance(obj, Tagged):
        return ["Tagged", obj.n, obj.label]
    if isinstance(obj, Meta):
        return {
            "request_id": obj.request_id,
            "hidden": obj.hidden,
            "scale": obj.scale,
            "window": obj.window,
            "inner": obj.inner,
        }
    if isinstance(obj, Frozen):
        return {"a": obj.a, "b": obj.b}
    return obj


def expected(obj: Any, registered: bool) -> Any:
    """What decoding ``obj`` must give a receiver that did (not) register the record classes."""
    if not registered:
        obj = _fields_of(obj)
    if isinstance(obj, dict):
        return {k: expected(v, registered) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(expected(v, registered) for v in obj)
    if registered and isinstance(obj, RECORDS):
        return obj
    return obj


def _record_items(obj: Any) -> dict[str, Any]:
    if isinstance(obj, msgspec.Struct):
        return {name: getattr(obj, name) for name in obj.__struct_fields__}
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def tensor_bytes(t: Any) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def differences(got: Any, want: Any, path: str = "$") -> list[str]:
    """Every place where ``got`` differs from ``want`` in type, shape, dtype or bytes."""
    if type(got) is not type(want):
        return [f"{path}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape or got.device.type != "cpu":
            return [f"{path}: tensor {got.dtype}{tuple(got.shape)}@{got.device} != {want.dtype}{tuple(want.shape)}"]
        same = tensor_bytes(got) == tensor_bytes(want)
        return [] if same else [f"{path}: tensor bytes differ"]
    if isinstance(want, np.ndarray):
        ok = got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        return [] if ok else [f"{path}: array differs"]
    if isinstance(want, Image.Image):
        if (got.mode, got.size, got.tobytes()) != (want.mode, want.size, want.tobytes()):
            return [f"{path}: image {got.mode} {got.size} differs from {want.mode} {want.size}"]
        return [] if got.getpalette() == want.getpalette() else [f"{path}: palette differs"]
    if isinstance(want, (msgspec.Struct, Meta, Frozen)):
        return differences(_record_items(got), _record_items(want), f"{path}<{type(want).__name__}>")
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{path}: keys {list(got)} != {list(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]
