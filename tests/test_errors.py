from __future__ import annotations

import errno
import importlib
import inspect
import multiprocessing
import multiprocessing.queues
import pickle
import pkgutil

import pytest
import zmq

import zmq_omni
from zmq_omni import errors


def test_every_error_is_a_zmq_omni_error() -> None:
    for name in errors.__all__:
        value = getattr(errors, name)
        if isinstance(value, type):
            assert issubclass(value, errors.ZmqOmniError), name


def test_timeouts_are_also_builtin_timeouts() -> None:
    assert issubclass(errors.TransportTimeoutError, TimeoutError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.DecodeError, ValueError)


def test_tree_is_written_in_the_docstring() -> None:
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        if isinstance(getattr(errors, name), type):
            assert name in doc, name


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (zmq.Again(), errors.TransportTimeoutError),
        (zmq.ZMQError(zmq.ETERM), errors.ClosedResourceError),
        (zmq.ZMQError(zmq.EHOSTUNREACH), errors.PeerGoneError),
        (zmq.ZMQError(errno.EADDRINUSE), errors.TransportError),
    ],
)
def test_zmq_errors_translate_with_the_endpoint(exc: zmq.ZMQError, kind: type) -> None:
    translated = errors.from_zmq_error(exc, endpoint="tcp://127.0.0.1:9", op="send")
    assert type(translated) is kind
    assert "tcp://127.0.0.1:9" in str(translated) and "send" in str(translated)


def test_delivery_error_names_the_key() -> None:
    err = errors.DeliveryError("not acknowledged", key="req1_0_3", endpoint="ipc:///tmp/x")
    assert err.key == "req1_0_3" and "req1_0_3" in str(err) and isinstance(err, errors.TransportError)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.5470062520000738, "0.55 s"), (2.0, "2 s"), (40, "40 s"), (0.5, "0.5 s"), (0.004, "4 ms"), (0, "0 s")],
)
def test_format_seconds_writes_durations_for_people(seconds: float, text: str) -> None:
    assert errors.format_seconds(seconds) == text


def test_name_stages_uses_the_pipeline_names_where_it_knows_them() -> None:
    from zmq_omni.stages import name_stages

    names = {"0": "thinker", "2": "vocoder", "driver": "driver"}
    text = "stage 2 never started it; delivery to stage '0' failed; stage 7 and stage driver; stage_id 2; req_2_0"
    assert name_stages(text, names) == (
        "stage 'vocoder' never started it; delivery to stage 'thinker' failed; stage 7 and stage driver; "
        "stage_id 2; req_2_0"
    )


def test_a_delivery_error_crosses_a_process_queue() -> None:
    context = multiprocessing.get_context("spawn")
    queue: multiprocessing.queues.Queue[BaseException] = context.Queue()
    try:
        queue.put(errors.DeliveryError("dropped", key="rid_7", dropped="cancelled"))
        back = queue.get(timeout=10)
    finally:
        queue.close()
        queue.join_thread()
    assert isinstance(back, errors.DeliveryError)
    assert (back.key, back.dropped, back.endpoint) == ("rid_7", "cancelled", None)


def _public_exceptions() -> list[type[BaseException]]:
    """Every exception class a public module of zmq_omni defines under a public name, found by walking the package.

    A new error cannot be forgotten by the pickling test below: it need not be listed anywhere.
    """
    found: list[type[BaseException]] = []
    for module_info in pkgutil.walk_packages(zmq_omni.__path__, "zmq_omni."):
        name = module_info.name
        if any(part.startswith("_") for part in name.split(".")):
            continue  # private modules, and __main__ (importing it would run the CLI)
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attr.startswith("_")
            ):
                found.append(value)
    return found


def _made_with_every_attribute(cls: type[BaseException]) -> BaseException:
    """An instance whose keyword-only attributes all hold a value other than their default."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except ValueError:  # the builtin Exception signature: a message only
        parameters = []  # type: ignore[assignment]
    kwargs = {p.name: f"{p.name} of {cls.__name__}" for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return cls(f"{cls.__name__} happened", **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", _public_exceptions(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_public_exception_of_the_package_pickles_whole(cls: type[BaseException]) -> None:
    # A failure crosses multiprocessing queues and process pools by pickle: it must come back whole.
    assert issubclass(cls, errors.ZmqOmniError), "every error we raise on purpose is in the one tree"
    error = _made_with_every_attribute(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)


def test_the_walk_finds_every_error_of_the_errors_module() -> None:
    exported = {getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)}
    defined = {
        value
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, BaseException) and not name.startswith("_")
    }
    assert defined == exported, "an error class of zmq_omni.errors is missing from its __all__"
    assert exported <= set(_public_exceptions())
