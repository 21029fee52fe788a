from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.queues
import pickle

import pytest
import zmq

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


def _one_of_each() -> list[errors.ZmqOmniError]:
    """An instance of every public error class, built as the library builds it."""
    made: list[errors.ZmqOmniError] = []
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not isinstance(cls, type):
            continue
        if issubclass(cls, errors.DeliveryError):
            made.append(cls("not confirmed", key="req-1_0_3", endpoint="tcp://10.0.0.1:5555", dropped="unclaimed"))
        elif issubclass(cls, errors.TransportError):
            made.append(cls(f"{name} happened", endpoint="ipc:///tmp/x"))
        else:
            made.append(cls(f"{name} happened"))
    return made


@pytest.mark.parametrize("error", _one_of_each(), ids=lambda e: type(e).__name__)
def test_every_public_error_survives_pickle(error: errors.ZmqOmniError) -> None:
    # A failure crosses multiprocessing queues and process pools by pickle: it must come back whole.
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.args == error.args
    assert vars(back) == vars(error)


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
