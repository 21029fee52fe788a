"""Typed field readers for building frozen config dataclasses from plain dicts.

Every reader raises :class:`~zmq_omni.errors.ConfigError` naming the key
(with its dotted path) so a user can fix their YAML without reading code.
Every room that builds a config from a dict (connectors, adapters, stages, and
connectors of your own) reads its fields with these, most often through
:func:`zmq_omni.config.reader.read_fields`, which picks the reader, default and
bounds of each key from the dataclass field that declares it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from ..errors import ConfigError

__all__ = [
    "check_known_keys",
    "import_callable",
    "read_bool",
    "read_choice",
    "read_float",
    "read_int",
    "read_mapping",
    "read_stage_id",
    "read_str",
]

T = TypeVar("T")
_MISSING: Any = object()


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_known_keys(data: Mapping[str, Any], known: Iterable[str], path: str = "") -> None:
    """Raise ``ConfigError`` for the first key of ``data`` not in ``known``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    allowed = set(known)
    for key in data:
        if key not in allowed:
            raise ConfigError(f"unknown config key {_where(path, str(key))!r} (known: {', '.join(sorted(allowed))})")


def _read(data: Mapping[str, Any], key: str, default: Any, path: str) -> Any:
    if key in data and data[key] is not None:
        return data[key]
    if default is _MISSING:
        raise ConfigError(f"missing required config key {_where(path, key)!r}")
    return default


def read_str(data: Mapping[str, Any], key: str, default: Any = _MISSING, path: str = "") -> Any:
    """Read a string; ints are accepted and turned into strings (stage ids are often ints)."""
    value = _read(data, key, default, path)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        if value is default:
            return value
        raise ConfigError(f"config key {_where(path, key)!r} must be a string, got {value!r}")
    return str(value)


def read_stage_id(data: Mapping[str, Any], key: str, path: str = "") -> str | int | None:
    """Read a stage id (a string or an int) and keep its type; None when absent.

    vllm-omni's adapters do arithmetic on ``connector.stage_id`` (``stage_id - 1``),
    so an int must stay an int; routing compares ``str(stage_id)``.
    """
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"config key {_where(path, key)!r} must be a string or an integer, got {value!r}")
    return value


def read_int(
    data: Mapping[str, Any],
    key: str,
    default: Any = _MISSING,
    path: str = "",
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> Any:
    """Read an integer, optionally with a lower and an upper bound."""
    value = _read(data, key, default, path)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {_where(path, key)!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"config key {_where(path, key)!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"config key {_where(path, key)!r} must be <= {maximum}, got {value}")
    return value


_MAX_NUMBER = 1e9  # seconds: 31 years


def read_float(
    data: Mapping[str, Any],
    key: str,
    default: Any = _MISSING,
    path: str = "",
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """Read a finite number as float, optionally with bounds."""
    value = _read(data, key, default, path)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config key {_where(path, key)!r} must be a number, got {value!r}")
    if not math.isfinite(value) or abs(value) > _MAX_NUMBER:
        # YAML's .nan/.inf: a NaN deadline expires at once, an infinite one breaks "nothing waits unbounded",
        # and waits of more than ~292 years overflow threading's.
        raise ConfigError(f"config key {_where(path, key)!r} must be a finite number up to 1e9, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"config key {_where(path, key)!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"config key {_where(path, key)!r} must be <= {maximum}, got {value}")
    return float(value)


def read_bool(data: Mapping[str, Any], key: str, default: Any = _MISSING, path: str = "") -> Any:
    """Read a boolean (YAML true/false)."""
    value = _read(data, key, default, path)
    if not isinstance(value, bool):
        raise ConfigError(f"config key {_where(path, key)!r} must be true or false, got {value!r}")
    return value


def read_choice(
    data: Mapping[str, Any], key: str, choices: Iterable[str], default: Any = _MISSING, path: str = ""
) -> Any:
    """Read a string that must be one of ``choices``."""
    value = read_str(data, key, default, path)
    options = tuple(choices)
    if value not in options:
        raise ConfigError(f"config key {_where(path, key)!r} must be one of {', '.join(options)}; got {value!r}")
    return value


def read_mapping(data: Mapping[str, Any], key: str, default: Any = _MISSING, path: str = "") -> Any:
    """Read a nested mapping."""
    value = _read(data, key, default, path)
    if not isinstance(value, Mapping):
        raise ConfigError(f"config key {_where(path, key)!r} must be a mapping, got {value!r}")
    return value


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """Import the callable a ``"package.module:name"`` string names; ``what`` labels errors.

    Raises:
        ConfigError: a malformed path, a failed import, a missing or non-callable attribute.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {path!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name!r}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise ConfigError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"{what} {path!r} is not callable")
    return target  # type: ignore[no-any-return]
