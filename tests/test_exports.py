"""The public surface: an explicit, sorted ``__all__`` whose every name resolves."""

from __future__ import annotations

import zmq_omni


def test_all_is_sorted_and_unique() -> None:
    assert list(zmq_omni.__all__) == sorted(set(zmq_omni.__all__))


def test_every_exported_name_resolves() -> None:
    for name in zmq_omni.__all__:
        assert getattr(zmq_omni, name) is not None, name


def test_public_names_have_docstrings() -> None:
    for name in zmq_omni.__all__:
        value = getattr(zmq_omni, name)
        if isinstance(value, type) or callable(value):
            assert value.__doc__, f"{name} has no docstring"


def test_package_logger_has_a_null_handler() -> None:
    import logging

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("zmq_omni").handlers)


def test_type_registry_is_public() -> None:
    from zmq_omni import wire

    assert {"register_type", "unregister_type"} <= set(zmq_omni.__all__)
    assert zmq_omni.register_type is wire.register_type
    assert zmq_omni.unregister_type is wire.unregister_type
