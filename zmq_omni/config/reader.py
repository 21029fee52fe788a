"""Config dataclasses read from plain dicts by their own field declarations.

A config class declares each key once: its name, type and default on the
dataclass field, its bounds or choices in the field's metadata
(:func:`setting`). :func:`read_fields` then reads every field from a dict with
the typed readers of :mod:`zmq_omni.config.fields`, so the messages name the
key as they always do (``config key 'ZmqConnector.put_timeout_s' must be >= 0.0,
got -1``)::

    @dataclass(frozen=True, kw_only=True)
    class Limits:
        timeout_s: float = setting(10.0, minimum=0.0)
        mode: Literal["push", "pull"] = "push"
        device: str | None = setting(None, read=read_device)

    Limits(**read_fields(Limits, {"timeout_s": 2}, "limits"))
    read_config(Limits, {"timeout_s": 2}, "limits")  # the same, refusing keys that are not fields

How a field is read, by its declared type (``X | None`` reads as ``X``):
``bool``, ``int`` and ``float`` (with ``minimum`` / ``maximum``), ``str``
(with ``choices``), a ``Literal`` of strings (its values are the choices).
Any other type needs ``read=``, a function ``(data, key, path) -> value``, or
the caller reads it (``skip``).
An absent key, or one whose value is ``None``, takes the declared default
(a ``default_factory`` is called); a field without a default is required.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal, TypeVar, Union

from ..errors import ConfigError
from .fields import _where, check_known_keys, read_bool, read_choice, read_float, read_int, read_str

__all__ = ["FieldReader", "declared_defaults", "read_config", "read_fields", "setting"]

T = TypeVar("T")

#: Reads ``data[key]`` (present, not None) into a field's value; ``path`` prefixes the key in messages.
FieldReader = Callable[[Mapping[str, Any], str, str], Any]

_METADATA_KEY = "zmq_omni.config"


@dataclass(frozen=True)
class _Rules:
    """What a field's metadata says about reading it."""

    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    read: FieldReader | None = None


def setting(
    default: Any = MISSING,
    *,
    default_factory: Callable[[], Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: Iterable[str] | None = None,
    read: FieldReader | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with its reading rules: bounds of a number, choices of a string, or its own reader.

    Args:
        default: the key's default (omit it, and ``default_factory``, for a required key).
        default_factory: makes the default (a mutable value, or one read from the environment).
        minimum: the smallest value accepted (numbers).
        maximum: the largest value accepted (numbers).
        choices: the values accepted (strings; a ``Literal`` type gives them too).
        read: reads the value instead of the type's reader: ``(data, key, path) -> value``.
        repr: whether ``repr`` shows the field (False for secrets).
    """
    metadata = {_METADATA_KEY: _Rules(minimum, maximum, None if choices is None else tuple(choices), read)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, repr=repr)
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


@dataclass(frozen=True)
class _Plan:
    """How one field is read: its key, its default and its reader."""

    name: str
    default: Any
    factory: Callable[[], Any] | None
    read: FieldReader

    def value(self, data: Mapping[str, Any], path: str) -> Any:
        if data.get(self.name) is not None:
            return self.read(data, self.name, path)
        if self.factory is not None:
            return self.factory()
        if self.default is MISSING:
            raise ConfigError(f"missing required config key {_where(path, self.name)!r}")
        return self.default


def _unwrap_optional(kind: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        rest = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind


def _reader(owner: type, name: str, kind: Any, rules: _Rules) -> FieldReader:
    if rules.read is not None:
        return rules.read
    kind = _unwrap_optional(kind)
    choices = rules.choices
    if choices is None and typing.get_origin(kind) is Literal:
        choices = tuple(str(arg) for arg in typing.get_args(kind))
    if choices is not None:
        options = choices
        return lambda data, key, path: read_choice(data, key, options, path=path)
    low, high = rules.minimum, rules.maximum
    if kind is bool:
        return lambda data, key, path: read_bool(data, key, path=path)
    if kind is int:
        return lambda data, key, path: read_int(
            data, key, path=path, minimum=None if low is None else int(low), maximum=None if high is None else int(high)
        )
    if kind is float:
        return lambda data, key, path: read_float(data, key, path=path, minimum=low, maximum=high)
    if kind is str:
        return lambda data, key, path: read_str(data, key, path=path)
    problem = f"{owner.__name__}.{name}: no reader for {kind!r}; declare it with setting(read=...) or skip it"

    def unreadable(data: Mapping[str, Any], key: str, path: str) -> Any:
        raise TypeError(problem)

    return unreadable


@functools.cache
def _plans(cls: type) -> tuple[_Plan, ...]:
    kinds = typing.get_type_hints(cls)
    plans: list[_Plan] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        rules = field.metadata.get(_METADATA_KEY, _Rules())
        factory = None if field.default_factory is MISSING else field.default_factory
        plans.append(_Plan(field.name, field.default, factory, _reader(cls, field.name, kinds[field.name], rules)))
    return tuple(plans)


def read_fields(cls: type, data: Mapping[str, Any], path: str, *, skip: Iterable[str] = ()) -> dict[str, Any]:
    """Every field of the dataclass ``cls`` read from ``data``, in declaration order, as keyword arguments.

    Args:
        cls: a dataclass whose fields are declared as the module docstring says.
        data: the plain dict (YAML, JSON); keys that are not fields are not looked at.
        path: what prefixes a key in messages (``"ZmqConnector"``, ``"pipeline"``).
        skip: fields the caller reads itself.

    Raises:
        ConfigError: a required key is missing, or a value has the wrong type or is out of bounds.
    """
    skipped = set(skip)
    return {plan.name: plan.value(data, path) for plan in _plans(cls) if plan.name not in skipped}


def read_config(cls: type[T], data: Mapping[str, Any], path: str, *, unread: Iterable[str] = ()) -> T:
    """``cls`` built from ``data``, whose every key must be one of its fields, each read by its declaration.

    Args:
        cls: a dataclass whose fields are declared as the module docstring says.
        data: the plain dict (YAML, JSON).
        path: what prefixes a key in messages (``"chunk_manager"``).
        unread: fields that are not keys of the dict (a callable, say); they keep their declared default.

    Raises:
        ConfigError: ``data`` is not a mapping or holds an unknown key (named, with the known ones), a
            required key is missing, or a value has the wrong type or is out of bounds.
    """
    left_out, owner = tuple(unread), typing.cast(type, cls)
    check_known_keys(data, [plan.name for plan in _plans(owner) if plan.name not in left_out], path)
    return cls(**read_fields(cls, data, path, skip=left_out))


def declared_defaults(cls: type) -> dict[str, Any]:
    """Each field of ``cls`` that has a default, with it (a ``default_factory`` is called)."""
    return {
        plan.name: plan.factory() if plan.factory is not None else plan.default
        for plan in _plans(cls)
        if plan.factory is not None or plan.default is not MISSING
    }
