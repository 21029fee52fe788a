"""The codec's registry of user types, and the field maps of msgspec Structs and dataclasses.

A type travels under a *name* that both ends agree on; the receiver looks
the name up in its own registry and never imports anything named by a peer.

* A msgspec ``Struct`` or a dataclass needs no registration to be sent: it
  travels as a RECORD (``docs/wire-format.md`` §4.7) holding exactly the map
  (or, for ``array_like`` Structs, the list) that msgspec's msgpack encoder
  writes for it, so a receiver that has not registered the class gets the
  plain ``dict``/``list`` vllm-omni's own serializer yields. A receiver that
  registered the class (under the same name) gets the class back.
* Any other type needs an encode and a decode function on both ends and
  travels as a CUSTOM object; a receiver that does not know the name raises
  :class:`~zmq_omni.errors.DecodeError`.

The registry is process-wide; registering and unregistering take a lock,
lookups (one dict read on the codec's paths) do not.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from ..errors import ConfigError
from ._shape import brief

__all__ = [
    "Entry",
    "by_name",
    "by_type",
    "default_name",
    "record_of",
    "register_type",
    "struct_plans",
    "struct_value",
    "unregister_type",
]

#: Longest type name on the wire, in UTF-8 bytes.
MAX_NAME_BYTES = 255


class Entry(NamedTuple):
    """One registered type."""

    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    #: True: the encoded value is the msgspec field map (RECORD, receivers may fall back to it);
    #: False: the user's own encoding (CUSTOM, receivers must know the name).
    record: bool


#: Read without the lock by the codec (a dict read is atomic); written only under ``_lock``.
by_type: dict[type, Entry] = {}
by_name: dict[str, Entry] = {}
_lock = threading.Lock()


def default_name(cls: type) -> str:
    """The name a class travels under unless registered with another: ``module.QualName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_struct_class(cls: type) -> bool:
    msgspec = sys.modules.get("msgspec")
    return msgspec is not None and isinstance(cls, type) and issubclass(cls, msgspec.Struct)


def register_type(
    cls: type,
    *,
    name: str | None = None,
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
) -> str:
    """Teach the wire codec (``zmq_omni.wire.encode``/``decode``) a type, under a name.

    Register the same type under the same name on both ends. Objects whose
    type is exactly ``cls`` (not subclasses) are then encoded with ``encode``
    and decoded with ``decode``; nothing is ever imported by name from the
    wire.

    For a msgspec ``Struct`` or a dataclass both functions may be left out:
    the object travels as its msgspec field map and the receiver rebuilds it
    with ``cls(**fields)`` (``cls(*values)`` for ``array_like`` Structs).
    Unregistered Structs and dataclasses travel all the same, under their
    default name, and reach a receiver that did not register them as the
    field ``dict`` (or ``list``) vllm-omni's serializer yields.

    Args:
        cls: the type.
        name: the name on the wire (1 to 255 UTF-8 bytes). Default
            ``f"{cls.__module__}.{cls.__qualname__}"``.
        encode: ``obj -> value``, where ``value`` is anything the codec can
            encode (it may hold arrays, tensors and other registered types).
            Required unless ``cls`` is a Struct or dataclass.
        decode: ``value -> obj``, the inverse. It runs on the receiving
            thread for every message that holds the type; whatever it
            raises becomes a :class:`~zmq_omni.errors.DecodeError`. Required
            when ``encode`` is given or ``cls`` is not a Struct or dataclass.

    Returns:
        The name the type travels under.

    Raises:
        ConfigError: ``cls`` or ``name`` is already registered, the name is
            empty or too long, or a function is missing or not callable.
    """
    if not isinstance(cls, type):
        raise ConfigError(f"register_type needs a class, got {cls!r}")
    if name is None:
        name = default_name(cls)
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ConfigError(f"a registered type name must be a str of 1 to {MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
    for fn, what in ((encode, "encode"), (decode, "decode")):
        if fn is not None and not callable(fn):
            raise ConfigError(f"register_type({cls.__qualname__}): {what} must be callable, got {fn!r}")
    is_record = _is_struct_class(cls) or dataclasses.is_dataclass(cls)
    if encode is None and decode is None and is_record:
        entry = Entry(cls, name, _record_value, _record_builder(cls), True)
    elif encode is None or decode is None:
        kind = "a Struct or dataclass with custom functions" if is_record else f"type {cls.__qualname__}"
        raise ConfigError(f"register_type: {kind} needs both an encode and a decode function")
    else:
        entry = Entry(cls, name, encode, decode, False)
    with _lock:
        if cls in by_type:
            raise ConfigError(f"type {default_name(cls)} is already registered as {by_type[cls].name!r}")
        if name in by_name:
            raise ConfigError(f"type name {name!r} is already registered (for {default_name(by_name[name].cls)})")
        by_type[cls] = entry
        by_name[name] = entry
    return name


def unregister_type(name: str) -> None:
    """Forget a type registered with :func:`register_type` under ``name``.

    Raises:
        ConfigError: no type is registered under ``name``.
    """
    with _lock:
        entry = by_name.pop(name, None)
        if entry is None:
            raise ConfigError(f"no type is registered under the name {name!r}")
        del by_type[entry.cls]


# ---------------------------------------------------------------- records


def record_of(obj: object) -> tuple[str, Any] | None:
    """``(name, field map or list)`` for a msgspec Struct or dataclass instance; ``None`` for anything else."""
    cls = type(obj)
    msgspec = sys.modules.get("msgspec")
    if msgspec is not None and isinstance(obj, msgspec.Struct):
        plan = struct_plans.get(cls) or _struct_plan(msgspec, cls)
        return plan.name, struct_value(plan, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # an instance, not the class itself
        return default_name(cls), _dataclass_value(obj)
    return None


def _record_value(obj: Any) -> Any:
    msgspec = sys.modules.get("msgspec")
    if msgspec is not None and isinstance(obj, msgspec.Struct):
        return struct_value(struct_plans.get(type(obj)) or _struct_plan(msgspec, type(obj)), obj)
    return _dataclass_value(obj)


_EMPTY_FACTORIES = (list, dict, set, frozenset, bytearray)

#: The msgpack extension code of a RECORD marker (``docs/wire-format.md`` §4.7; the codec's ``EXT_RECORD``).
RECORD_CODE = 7


class StructPlan(NamedTuple):
    """What encoding a Struct class needs, read from the class once.

    ``msgspec.structs.fields`` costs tens of microseconds a call: it re-evaluates the class's annotations.
    With the plan, a Struct's field map is one C call for its values (``msgspec.structs.astuple``) and one
    comprehension over them, with no per-field method call.
    """

    #: The name the class travels under when it is not registered (:func:`default_name`).
    name: str
    array_like: bool
    #: ``{tag_field: tag}`` to start the field map with, or ``None``; for array_like, ``[tag]`` or ``None``.
    tag: Any
    #: Every field, in order: ``(attribute, encode name, default or _NO_DEFAULT, empty-collection factory or None)``.
    fields: tuple[tuple[str, str, Any, type | None], ...]
    omit_defaults: bool
    unset: Any
    #: The encode names, in field order (the order of ``msgspec.structs.astuple``).
    keys: tuple[str, ...]
    #: Each field's default (or ``_NO_DEFAULT``), in field order.
    defaults: tuple[Any, ...]
    #: How the field map is made: ``_ALL_NONE`` (omit_defaults, every default ``None``: vllm-omni's payloads),
    #: ``_DEFAULTS`` (omit_defaults, no collection factory), ``_EVERY`` (no omit_defaults) or ``_FIELDWISE``.
    how: int
    #: The RECORD marker of an unregistered instance nested in another Struct's fields.
    marker: Any


_ALL_NONE, _DEFAULTS, _EVERY, _FIELDWISE = range(4)

#: A field without a default: no value is ever identical to it.
_NO_DEFAULT = object()
#: Plans by Struct class, for the codec's look-up by type. Read without a lock (a dict read is atomic;
#: two threads that miss at once build equal plans). Bounded: cleared when full, for programs that
#: make classes on the fly.
struct_plans: dict[type, StructPlan] = {}
_PLANS_SIZE = 1024
#: ``msgspec.structs.astuple``, read when the first plan is made (msgspec is imported by then).
_astuple: Callable[[Any], tuple[Any, ...]] = tuple


def _struct_plan(msgspec: Any, cls: type) -> StructPlan:
    global _astuple
    config = cls.__struct_config__  # type: ignore[attr-defined]
    nodefault = msgspec.NODEFAULT
    infos = msgspec.structs.fields(cls)
    fields = tuple(
        (
            info.name,
            info.encode_name,
            _NO_DEFAULT if info.default is nodefault else info.default,
            info.default_factory if info.default_factory in _EMPTY_FACTORIES else None,
        )
        for info in infos
    )
    tag: Any = None
    if config.tag is not None:
        tag = [config.tag] if config.array_like else {config.tag_field: config.tag}
    defaults = tuple(field[2] for field in fields)
    if tuple(field[0] for field in fields) != cls.__struct_fields__:  # type: ignore[attr-defined]
        how = _FIELDWISE  # astuple's order is __struct_fields__; never seen otherwise
    elif not config.omit_defaults:
        how = _EVERY
    elif any(info.default_factory is not nodefault for info in infos):
        how = _FIELDWISE  # msgspec's test of an empty collection from a factory
    else:
        how = _ALL_NONE if all(default is None for default in defaults) else _DEFAULTS
    name = default_name(cls)
    marker = msgpack.ExtType(RECORD_CODE, name.encode("utf-8", "surrogatepass"))
    plan = StructPlan(
        name,
        config.array_like,
        tag,
        fields,
        config.omit_defaults,
        msgspec.UNSET,
        tuple(field[1] for field in fields),
        defaults,
        how,
        marker,
    )
    _astuple = msgspec.structs.astuple
    if len(struct_plans) >= _PLANS_SIZE:
        struct_plans.clear()
    struct_plans[cls] = plan
    return plan


def struct_value(plan: StructPlan, obj: Any) -> Any:
    """:func:`record_of`'s value for ``obj``, an instance of exactly the class ``plan`` was made for.

    Struct values of unregistered classes with a plan are made RECORDs here too (``[marker, value]``,
    what the codec would make of them), saving the codec a call back per nested Struct.
    """
    unset = plan.unset
    if plan.array_like:
        # msgspec ignores omit_defaults for array_like Structs.
        values = [getattr(obj, field[0]) for field in plan.fields]
        return values if plan.tag is None else [*plan.tag, *values]
    how = plan.how
    if how == _ALL_NONE:
        out = {
            key: value
            for key, value in zip(plan.keys, _astuple(obj), strict=True)
            if value is not None and value is not unset
        }
    elif how == _DEFAULTS:
        out = {
            key: value
            for key, value, default in zip(plan.keys, _astuple(obj), plan.defaults, strict=True)
            if value is not default and value is not unset
        }
    elif how == _EVERY:
        out = {key: value for key, value in zip(plan.keys, _astuple(obj), strict=True) if value is not unset}
    else:
        out = {}
        for attr, key, default, factory in plan.fields:
            value = getattr(obj, attr)
            if value is unset:
                continue
            # msgspec's own test: the default object itself, or an empty collection from a collection factory.
            if plan.omit_defaults and (
                value is default or (factory is not None and type(value) is factory and not value)
            ):
                continue
            out[key] = value
    for key, value in out.items():
        inner = struct_plans.get(type(value))
        if inner is not None and type(value) not in by_type:
            out[key] = [inner.marker, struct_value(inner, value)]
    if plan.tag is not None:
        return {**plan.tag, **out}
    return out


def _dataclass_value(obj: Any) -> dict[str, Any]:
    """What msgspec writes for a dataclass: each field, in order, that the instance holds a value for."""
    attrs = getattr(obj, "__dict__", None)
    out: dict[str, Any] = {}
    unset = getattr(sys.modules.get("msgspec"), "UNSET", None)
    for field in dataclasses.fields(obj):
        name = field.name
        if attrs is not None and name in attrs:
            value = attrs[name]
        elif attrs is None or name in getattr(type(obj), "__slots__", ()):
            try:
                value = getattr(obj, name)
            except AttributeError:
                continue
        else:
            # An init=False field with a class-level default: msgspec leaves it out too.
            continue
        if unset is not None and value is unset:
            continue
        out[name] = value
    return out


def _record_builder(cls: type) -> Callable[[Any], Any]:
    """The default decode function of a registered Struct or dataclass."""
    if _is_struct_class(cls):
        config = cls.__struct_config__  # type: ignore[attr-defined]
        attr_of = dict(zip(cls.__struct_encode_fields__, cls.__struct_fields__, strict=True))  # type: ignore[attr-defined]
        tag, tag_field = config.tag, config.tag_field

        def build_struct(value: Any) -> Any:
            if config.array_like:
                if type(value) is not list:
                    raise TypeError(f"expected a list of fields, got {type(value).__name__}")
                if tag is not None:
                    if not value or value[0] != tag:
                        raise TypeError(f"expected the tag {tag!r} first")
                    value = value[1:]
                return cls(*value)
            if type(value) is not dict:
                raise TypeError(f"expected a map of fields, got {type(value).__name__}")
            kwargs: dict[str, Any] = {}
            for key, item in value.items():
                if tag is not None and key == tag_field:
                    if item != tag:
                        raise TypeError(f"tag {brief(item)} is not {tag!r}")
                    continue
                attr = attr_of.get(key)
                if attr is None:
                    raise TypeError(f"unknown field {brief(key)}")
                kwargs[attr] = item
            return cls(**kwargs)

        return build_struct

    init_names = {f.name for f in dataclasses.fields(cls) if f.init}
    other_names = {f.name for f in dataclasses.fields(cls) if not f.init}

    def build_dataclass(value: Any) -> Any:
        if type(value) is not dict:
            raise TypeError(f"expected a map of fields, got {type(value).__name__}")
        unknown = [key for key in value if key not in init_names and key not in other_names]
        if unknown:
            raise TypeError(f"unknown field {brief(unknown[0])}")
        obj = cls(**{key: item for key, item in value.items() if key in init_names})
        for key, item in value.items():
            if key in other_names:
                # object.__setattr__: frozen dataclasses too.
                object.__setattr__(obj, key, item)
        return obj

    return build_dataclass
