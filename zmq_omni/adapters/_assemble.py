"""Assembly of received chunk payloads into one input dict (no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["assemble_chunks", "payload_nbytes"]


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "dim")


def _join(values: list[Any], axis: int) -> Any:
    first = values[0]
    if len(values) == 1:
        return first
    if all(isinstance(v, np.ndarray) and v.ndim > 0 for v in values):
        return np.concatenate(values, axis=axis)
    if all(_is_torch(v) and v.dim() > 0 for v in values):
        import torch  # only reached when the payload already holds tensors

        return torch.cat(values, dim=axis)
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    if all(isinstance(v, tuple) for v in values):
        return tuple(item for v in values for item in v)
    if all(isinstance(v, Mapping) for v in values):
        return merge_metadata(values)
    # Scalars, strings, 0-d arrays, mixed kinds: metadata, the latest chunk wins.
    return values[-1]


def merge_metadata(dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge nested metadata dicts; a later chunk's scalar replaces an earlier one."""
    out: dict[str, Any] = {}
    for d in dicts:
        for key, value in d.items():
            old = out.get(key)
            if isinstance(old, Mapping) and isinstance(value, Mapping):
                out[key] = merge_metadata([old, value])
            else:
                out[key] = value
    return out


def assemble_chunks(payloads: Sequence[Mapping[str, Any]], axis: int = 0) -> dict[str, Any]:
    """Assemble chunk payloads (oldest first) into one dict.

    For each key, over the chunks that carry it: arrays (numpy, or torch
    tensors) of one or more dimensions are concatenated along ``axis`` (the
    sequence/time axis, 0 by default), lists and tuples are concatenated,
    nested dicts are merged recursively, and anything else (scalars, strings,
    0-d arrays) is metadata, where the latest chunk wins. A single chunk is
    returned as is, without copying its arrays.
    """
    by_key: dict[str, list[Any]] = {}
    for payload in payloads:
        for key, value in payload.items():
            by_key.setdefault(key, []).append(value)
    return {key: _join(values, axis) for key, values in by_key.items()}


def payload_nbytes(data: Mapping[str, Any]) -> int:
    """Bytes a received chunk holds: its arrays' ``nbytes`` plus ``bytes``/``str`` lengths (for max_ready_bytes)."""
    total = 0
    for value in data.values():
        nbytes = getattr(value, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
        elif isinstance(value, (bytes, bytearray, str)):
            total += len(value)
    return total
