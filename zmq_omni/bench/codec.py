"""Wire codec grid: ``zmq_omni.wire`` encode+decode against pickle-5, msgpack and one memcpy.

The Struct rows (:func:`run_struct_payloads`) encode+decode the payloads
vllm-omni main's chunk adapter puts: its ``OmniPayloadStruct`` (msgspec
Structs nested four deep, bf16 torch tensors), as the Qwen3-Omni thinker
sends them (a 4 KiB decode chunk, the ~1 MiB chunk 0); they need torch and
msgspec.

Every figure is the median per-call time over timed batches of encode+decode
(after a warm-up call), the contenders of a row measured interleaved
(:func:`~zmq_omni.bench._common.median_seconds`), so the ratios hold on a busy
machine even when the absolute times do not.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from ..wire import decode, encode
from ._common import KIB, MIB, Comparison, median_seconds, size_label

__all__ = [
    "SIZES",
    "SMALL_META",
    "THRESHOLD_SIZES",
    "CodecRow",
    "FreshShapesRow",
    "SmallDictRow",
    "StructRow",
    "ThresholdRow",
    "run_codec",
    "run_fresh_shapes",
    "run_small_dict",
    "run_struct_payloads",
    "run_threshold_sweep",
]

SIZES = [1 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
THRESHOLD_SIZES = [256, 1 * KIB, 4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 128 * KIB, 256 * KIB]
SMALL_META: dict[str, Any] = {
    "request_id": "chatcmpl-4f9a2c1e-0001",
    "stage_id": 1,
    "chunk_id": 17,
    "finished": False,
    "prompt_len": 1024,
    "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 2048, "seed": 1234},
    "token_ids": [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13],
    "lang": "en",
}
_REQUEST_ID = "chatcmpl-4f9a2c1e-0001"
_NAME = "wire codec encode+decode"


@dataclass(frozen=True)
class CodecRow:
    """Seconds per encode+decode of ``{request_id, float32 array of size bytes}``."""

    size: int
    ours: float
    pickle5: float
    msgpack_copy: float
    memcpy: float

    def comparisons(self) -> list[Comparison]:
        """The row as ratio-table cells: ours against each contender."""
        label = size_label(self.size)
        return [
            Comparison("codec", _NAME, label, self.ours, self.pickle5, "pickle5 out-of-band"),
            Comparison("codec", _NAME, label, self.ours, self.msgpack_copy, "msgpack, array copied"),
            Comparison("codec", _NAME, label, self.ours, self.memcpy, "one memcpy of the array"),
        ]


@dataclass(frozen=True)
class SmallDictRow:
    """Seconds per encode+decode of :data:`SMALL_META` (~200 bytes, no array)."""

    packed_bytes: int
    ours: float
    msgpack: float
    pickle5: float

    def comparisons(self) -> list[Comparison]:
        """The row as a ratio-table cell: ours against plain msgpack."""
        label = f"{self.packed_bytes} B dict"
        return [Comparison("codec", _NAME, label, self.ours, self.msgpack, "msgpack packb+unpackb")]


@dataclass(frozen=True)
class StructRow:
    """Seconds per encode+decode of one of main's payload Structs holding ``tensor_bytes`` bytes of tensors.

    ``msgspec_bytes`` is msgspec's own msgpack encode+decode of the same Structs
    with every tensor replaced by its bytes (tensor-free: what the tree costs
    msgspec natively, the bytes copied in and out); ``main_serializer`` is
    vllm-omni main's connector serializer (msgspec with a tensor hook, restated).
    """

    payload: str
    tensor_bytes: int
    ours: float
    msgspec_bytes: float
    main_serializer: float

    def comparisons(self) -> list[Comparison]:
        """The row as ratio-table cells: ours against msgspec with bytes, and against main's serializer."""
        name = "wire codec, payload Struct"
        return [
            Comparison("codec", name, self.payload, self.ours, self.msgspec_bytes, "msgspec msgpack, tensors as bytes"),
            Comparison("codec", name, self.payload, self.ours, self.main_serializer, "vllm-omni main's serializer"),
        ]


@dataclass(frozen=True)
class FreshShapesRow:
    """Seconds per encode+decode of a ~1 MiB array whose shape changes every call (memos miss)."""

    ours: float
    memcpy: float


@dataclass(frozen=True)
class ThresholdRow:
    """Seconds per encode+send+recv+decode over ipc of one array inline and as its own frame."""

    size: int
    inline: float
    own_frame: float


def _ours(payload: Any) -> Callable[[], Any]:
    return lambda: decode(encode(payload))


def _pickle5(payload: Any) -> Callable[[], Any]:
    def run() -> Any:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=buffers)

    return run


def _msgpack_copy(payload: dict[str, Any]) -> Callable[[], Any]:
    def pack_array(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return {"dtype": obj.dtype.str, "shape": obj.shape, "data": obj.tobytes()}
        raise TypeError(type(obj))

    def run() -> Any:
        out = msgpack.unpackb(msgpack.packb(payload, default=pack_array))
        for key, value in out.items():
            if isinstance(value, dict) and "data" in value:
                out[key] = np.frombuffer(value["data"], dtype=value["dtype"]).reshape(value["shape"])
        return out

    return run


def _memcpy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> Callable[[], Any]:
    return lambda: np.copyto(dst, src)


def run_codec(
    sizes: Sequence[int] = SIZES,
    *,
    budget_s: float = 0.5,
    repeats: int = 21,
    large_budget_s: float = 1.0,
    large_repeats: int = 7,
    on_row: Callable[[CodecRow], None] | None = None,
) -> list[CodecRow]:
    """Encode+decode of a dict holding one array of each size, beside pickle-5, msgpack and memcpy.

    Args:
        sizes: array sizes in bytes.
        budget_s: seconds of timed batches per contender for sizes up to 16 MiB.
        repeats: batches per contender (the median is taken) for sizes up to 16 MiB.
        large_budget_s: ``budget_s`` above 16 MiB (few calls per batch there anyway).
        large_repeats: ``repeats`` above 16 MiB.
        on_row: called with each row as soon as it is measured.

    Returns:
        One row per size.
    """
    rows = []
    for size in sizes:
        arr = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
        payload = {"request_id": _REQUEST_ID, "hidden_states": arr}
        dst = np.empty_like(arr)
        budget, reps = (budget_s, repeats) if size <= 16 * MIB else (large_budget_s, large_repeats)
        fns = {
            "ours": _ours(payload),
            "pickle": _pickle5(payload),
            "msgpack": _msgpack_copy(payload),
            "copy": _memcpy(dst, arr),
        }
        times = median_seconds(fns, budget, reps)
        row = CodecRow(size, times["ours"], times["pickle"], times["msgpack"], times["copy"])
        del arr, dst, payload, fns
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def run_small_dict(*, budget_s: float = 0.5, repeats: int = 21) -> SmallDictRow:
    """Encode+decode of :data:`SMALL_META` beside plain msgpack and pickle-5."""
    fns = {
        "ours": _ours(SMALL_META),
        "plain": lambda: msgpack.unpackb(msgpack.packb(SMALL_META)),
        "pickle": _pickle5(SMALL_META),
    }
    times = median_seconds(fns, budget_s, repeats)
    return SmallDictRow(len(msgpack.packb(SMALL_META)), times["ours"], times["plain"], times["pickle"])


def run_struct_payloads(*, budget_s: float = 0.5, repeats: int = 21) -> list[StructRow]:
    """Encode+decode of a 4 KiB thinker chunk and of thinker chunk 0 (~1 MiB) as main's ``OmniPayloadStruct``.

    Raises:
        ImportError: torch or msgspec is missing (the message says what to install).
    """
    from .vllm_pipeline import INSTALL_HINT, missing_dependencies

    missing = missing_dependencies()
    if missing:
        raise ImportError(f"the Struct rows need {' and '.join(missing)}: {INSTALL_HINT}")
    import msgspec
    import torch

    from ._vllm_main import main_deserialize, main_serialize
    from ._vllm_stage import Payloads, PayloadShapes

    def _msgspec_round_trip(obj: Any) -> Any:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))

    def _main_round_trip(obj: Any) -> Any:
        return main_deserialize(main_serialize(obj))

    def as_bytes(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.reshape(-1).view(torch.uint8).numpy().tobytes()
        if isinstance(value, msgspec.Struct):
            fields = {f: as_bytes(getattr(value, f)) for f in value.__struct_fields__}
            return msgspec.structs.replace(value, **fields)
        return value

    def tensor_bytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, msgspec.Struct):
            return sum(tensor_bytes(getattr(value, f)) for f in value.__struct_fields__)
        return 0

    payloads = Payloads(PayloadShapes())
    rows = []
    for label, chunk in (("4 KiB chunk", 1), ("1 MiB chunk0", 0)):
        struct = payloads.thinker_chunk(1, 0, chunk, last=False)
        plain = as_bytes(struct)
        fns: dict[str, Callable[[], Any]] = {
            "ours": _ours(struct),
            "msgspec": functools.partial(_msgspec_round_trip, plain),
            "main": functools.partial(_main_round_trip, struct),
        }
        times = median_seconds(fns, budget_s, repeats)
        rows.append(StructRow(label, tensor_bytes(struct), times["ours"], times["msgspec"], times["main"]))
    return rows


def run_fresh_shapes(*, budget_s: float = 0.5, repeats: int = 21) -> FreshShapesRow:
    """The ~1 MiB row with a shape the codec has not seen on every call: its descriptor memos miss."""
    base = np.zeros(MIB // 4, np.float32)
    # More distinct shapes than the memos hold, visited in a cycle, so every call misses.
    payloads = [{"request_id": _REQUEST_ID, "hidden_states": base[: base.size - i]} for i in range(4096)]
    cycle = itertools.cycle(payloads)
    dst = np.empty_like(base)
    times = median_seconds({"ours": lambda: decode(encode(next(cycle))), "copy": _memcpy(dst, base)}, budget_s, repeats)
    return FreshShapesRow(times["ours"], times["copy"])


def run_threshold_sweep(
    sizes: Sequence[int] = THRESHOLD_SIZES,
    *,
    budget_s: float = 0.4,
    repeats: int = 9,
    on_row: Callable[[ThresholdRow], None] | None = None,
) -> list[ThresholdRow]:
    """Encode, send over ``ipc://`` PAIR, receive and decode one array inline versus out of band."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zomni-bench-") as tmp:
        a = ctx.socket(zmq.PAIR)
        b = ctx.socket(zmq.PAIR)
        try:
            endpoint = f"ipc://{os.path.join(tmp, 'sweep')}"
            a.bind(endpoint)
            b.connect(endpoint)

            def trip(payload: Any, threshold: int) -> Callable[[], Any]:
                def run() -> Any:
                    a.send_multipart(encode(payload, inline_threshold=threshold), copy=False)
                    return decode(b.recv_multipart(copy=False))

                return run

            for size in sizes:
                payload = {"request_id": "r-1", "x": np.ones(size, np.uint8)}
                times = median_seconds(
                    {"inline": trip(payload, size + 1), "frame": trip(payload, 0)}, budget_s, repeats
                )
                row = ThresholdRow(size, times["inline"], times["frame"])
                rows.append(row)
                if on_row is not None:
                    on_row(row)
        finally:
            a.close(linger=0)
            b.close(linger=0)
            ctx.term()
    return rows
