"""The ``decode_device`` key shared by the connectors' configs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["read_device"]

_DEVICE_NAME = re.compile(r"[a-z][a-z0-9_]*(:[0-9]+)?")


def read_device(data: Mapping[str, Any], key: str, path: str) -> str | None:
    """Read a torch device name (``"cpu"``, ``"cuda"``, ``"cuda:1"``); absent or ``None`` gives ``None``.

    Only the spelling is checked here (config never imports torch); the
    connector checks that the device exists when it is built
    (:func:`zmq_omni.wire.resolve_device`).
    """
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not _DEVICE_NAME.fullmatch(value):
        where = f"{path}.{key}" if path else key
        raise ConfigError(f"config key {where!r} must be a torch device such as 'cpu' or 'cuda:0', got {value!r}")
    return value
