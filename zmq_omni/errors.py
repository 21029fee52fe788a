"""The one exception tree of zmq_omni.

Every error the library raises on purpose is a :class:`ZmqOmniError`::

    ZmqOmniError
    ├── ConfigError (ValueError)            bad or missing config key, unknown connector name
    ├── CodecError
    │   ├── EncodeError (TypeError)         object cannot be encoded (unsupported type, limits)
    │   └── DecodeError (ValueError)        frames are not a valid encoding (never another type)
    ├── TransportError                      a socket-level fault, with the endpoint in the message
    │   ├── TransportTimeoutError (TimeoutError)  an operation hit its bound
    │   ├── PeerGoneError                   the peer disconnected, died, or never came
    │   ├── ClosedResourceError             the connector/socket was already closed
    │   ├── MessageTooLargeError            a message is above the configured maximum
    │   ├── AuthenticationError             the peer requires CURVE, or refused our keys
    │   └── DeliveryError                   delivery could not be confirmed before the deadline
    └── ShmError                            shared-memory segment fault
        └── ShmSpaceError                   /dev/shm has not enough free space

pyzmq's ``zmq.ZMQError`` is translated into this tree in exactly one place,
:func:`from_zmq_error`, with ``raise ... from exc`` at the call site.
"""

from __future__ import annotations

import errno as _errno

import zmq

__all__ = [
    "AuthenticationError",
    "ClosedResourceError",
    "CodecError",
    "ConfigError",
    "DecodeError",
    "DeliveryError",
    "EncodeError",
    "MessageTooLargeError",
    "PeerGoneError",
    "ShmError",
    "ShmSpaceError",
    "TransportError",
    "TransportTimeoutError",
    "DROPPED_ENDED",
    "ZmqOmniError",
    "format_seconds",
    "from_zmq_error",
]


def _restore(cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]) -> BaseException:
    """Rebuild a pickled error without calling its ``__init__`` (whose signature differs per class)."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class ZmqOmniError(Exception):
    """Root of every error zmq_omni raises on purpose.

    Every error in the tree survives ``pickle`` (a ``multiprocessing`` queue, a process pool) with
    its type, message and attributes: the default reduction calls ``cls(*args)``, which the
    keyword-only constructors below would refuse.
    """

    def __reduce__(self) -> tuple[object, ...]:
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class ConfigError(ZmqOmniError, ValueError):
    """A config key is missing, unknown or has a bad value; the message names the key."""


class CodecError(ZmqOmniError):
    """Base of the wire codec errors."""


class EncodeError(CodecError, TypeError):
    """An object cannot be encoded (unsupported type, or over a size limit)."""


class DecodeError(CodecError, ValueError):
    """A frame set is not a valid encoding. Decoding raises nothing else."""


class TransportError(ZmqOmniError):
    """A socket-level fault. ``endpoint`` names the peer when known."""

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message if endpoint is None else f"{message} (endpoint={endpoint})")
        self.endpoint = endpoint


class TransportTimeoutError(TransportError, TimeoutError):
    """An operation hit its time bound (send, receive, acknowledgement)."""


class PeerGoneError(TransportError):
    """The peer disconnected, died, or was never reachable."""


class ClosedResourceError(TransportError):
    """The connector or socket was used after ``close()``."""


class MessageTooLargeError(TransportError):
    """A message is larger than the configured maximum message size."""


class AuthenticationError(TransportError):
    """The peer requires CURVE and we have no keys, or it refused ours (not allowed, wrong server key)."""


class DeliveryError(TransportError):
    """Delivery of ``key`` could not be confirmed before its deadline, or its receiver dropped it unconsumed.

    ``dropped`` says why a receiver disposed of the put: ``"cancelled"`` (its
    request was cleaned up or abandoned there), ``"unclaimed"`` (no ``get``
    took it within the receiver's ``unclaimed_ttl_s``), or None (delivery was
    not confirmed). A cancelled put is not worth retrying: the receiver gave
    the request up.
    """

    def __init__(self, message: str, *, key: str, endpoint: str | None = None, dropped: str | None = None) -> None:
        super().__init__(f"{message} [key={key!r}]", endpoint=endpoint)
        self.key = key
        self.dropped = dropped


#: In the reason of a put its receiver dropped under a tombstone: the receiver had ended, cancelled or
#: abandoned that request (a reused request id lands here too, before the stage's refusal says why).
DROPPED_ENDED = "dropped it: its request had ended or was cancelled there"


class ShmError(ZmqOmniError):
    """A shared-memory segment could not be created, attached or released."""


class ShmSpaceError(ShmError):
    """``/dev/shm`` has less free space than a write needs."""


def format_seconds(seconds: float) -> str:
    """A duration as a person reads it in a message: ``0.55 s``, ``2 s``, ``40 s``, ``5 ms``."""
    if 0 < seconds < 0.01:
        return f"{seconds * 1e3:.2g} ms"
    return f"{f'{seconds:.2f}'.rstrip('0').rstrip('.')} s"


def from_zmq_error(exc: zmq.ZMQError, *, endpoint: str | None = None, op: str = "") -> TransportError:
    """Translate a pyzmq error into the zmq_omni tree.

    Call as ``raise from_zmq_error(exc, endpoint=ep, op="send") from exc``.
    """
    what = f"{op} failed: {exc}" if op else str(exc)
    if isinstance(exc, zmq.Again) or exc.errno == _errno.EAGAIN:
        return TransportTimeoutError(what, endpoint=endpoint)
    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or exc.errno == _errno.EBADF:
        return ClosedResourceError(what, endpoint=endpoint)
    if exc.errno in (zmq.EHOSTUNREACH, _errno.ECONNREFUSED, _errno.ECONNRESET):
        return PeerGoneError(what, endpoint=endpoint)
    return TransportError(what, endpoint=endpoint)
