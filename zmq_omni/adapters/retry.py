"""Retry policy for adapter sends and bounded receives, mapped onto tenacity.

A :class:`RetryPolicy` is plain frozen config; :meth:`RetryPolicy.retrying`
turns it into a ``tenacity.Retrying`` whose sleeps end early when the
adapter stops, so a retry loop never delays ``shutdown()``.

Retries are idempotent by construction: every attempt re-puts the *same* key,
a re-put of an unconsumed key replaces it (connector contract), and the
receiving adapter reads each key once, in order, so a late copy of a chunk it
already consumed is never read again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import tenacity

from ..config.fields import read_mapping
from ..config.reader import read_config, setting
from ..errors import (
    ClosedResourceError,
    ConfigError,
    DeliveryError,
    MessageTooLargeError,
    TransportError,
)

__all__ = ["RetryPolicy", "default_retryable"]


def default_retryable(exc: BaseException) -> bool:
    """Retry transport faults that a later attempt may cure.

    Timeouts, a peer that is gone, undelivered messages and unknown socket
    faults are retried. A closed connector, an oversized message, a put its
    receiver dropped because the request was cancelled there (a
    :class:`~zmq_omni.errors.DeliveryError` with ``dropped="cancelled"``: a
    re-put would be dropped again, in a loop) and anything that is not a
    :class:`~zmq_omni.errors.TransportError` (an encode error, a bug) would
    fail the same way again, so they are not.
    """
    if isinstance(exc, (ClosedResourceError, MessageTooLargeError)):
        return False
    if isinstance(exc, DeliveryError) and exc.dropped == "cancelled":
        return False
    return isinstance(exc, TransportError)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard a send (or a bounded receive) tries before it is reported as failed.

    Attributes:
        attempts: most attempts in all, the first included (>= 1).
        deadline_s: overall budget from the first attempt; no attempt starts
            after it. One attempt may itself last up to the connector's
            ``put_timeout_s``, so a give-up can come that much later.
        backoff_initial_s: wait before the second attempt.
        backoff_max_s: cap on one wait.
        backoff_multiplier: growth factor of the wait between attempts.
        jitter_s: up to this much random time is added to each wait, so
            many senders that failed together do not retry in lockstep.
        retryable: predicate on the attempt's exception; False gives up at once.
    """

    attempts: int = setting(5, minimum=1)
    deadline_s: float = setting(5.0, minimum=0)
    backoff_initial_s: float = setting(0.02, minimum=0)
    backoff_max_s: float = setting(0.5, minimum=0)
    backoff_multiplier: float = setting(2.0, minimum=1)
    jitter_s: float = setting(0.02, minimum=0)
    retryable: Callable[[BaseException], bool] = default_retryable

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry 'attempts' must be >= 1, got {self.attempts}")
        for name in ("deadline_s", "backoff_initial_s", "backoff_max_s", "jitter_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"retry {name!r} must be >= 0, got {getattr(self, name)}")
        if self.backoff_multiplier < 1:
            raise ConfigError(f"retry 'backoff_multiplier' must be >= 1, got {self.backoff_multiplier}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, path: str = "retry") -> RetryPolicy:
        """Build from a plain dict (YAML); unknown keys raise ``ConfigError``.

        The predicate cannot come from YAML; it stays :func:`default_retryable`.
        """
        return read_config(cls, dict(data or {}), path, unread=("retryable",))

    @classmethod
    def read(cls, data: Mapping[str, Any], key: str, path: str) -> RetryPolicy:
        """The policy under ``data[key]`` (a mapping), its keys named ``path.key.*`` in errors.

        A :func:`~zmq_omni.config.reader.setting` reader: ``retry: RetryPolicy = setting(..., read=RetryPolicy.read)``.
        """
        return cls.from_dict(read_mapping(data, key, path=path), f"{path}.{key}" if path else key)

    def single_attempt(self) -> RetryPolicy:
        """The same policy with one attempt (used while a peer is known to be down)."""
        return replace(self, attempts=1)

    def retrying(self, *, stop_event: threading.Event | None = None) -> tenacity.Retrying:
        """A fresh ``tenacity.Retrying`` for one call (its statistics are per call).

        Args:
            stop_event: when set, waits between attempts end at once and no
                further attempt starts.

        The last exception is re-raised when the policy is exhausted.
        """
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(self.attempts) | tenacity.stop_before_delay(
            self.deadline_s
        )
        sleep: Callable[[float], None] = tenacity.nap.sleep
        if stop_event is not None:
            stop = stop | tenacity.stop_when_event_set(stop_event)
            event = stop_event

            def sleep(seconds: float) -> None:
                event.wait(seconds)

        return tenacity.Retrying(
            stop=stop,
            wait=self._wait(),
            retry=tenacity.retry_if_exception(self.retryable),
            sleep=sleep,
            reraise=True,
        )

    def polling(self, timeout_s: float, *, stop_event: threading.Event | None = None) -> tenacity.Retrying:
        """A ``tenacity.Retrying`` for a bounded receive: repeat while the call returns None.

        The call is expected to wait by itself (``get_with_deadline``); the
        policy's back-off only paces calls that return None early (a transport
        fault), so a broken connector is not hammered. Gives up with result
        None once ``timeout_s`` has passed or ``stop_event`` is set.
        """
        stop: tenacity.stop.stop_base = tenacity.stop_after_delay(timeout_s)
        if stop_event is not None:
            stop = stop | tenacity.stop_when_event_set(stop_event)
        return tenacity.Retrying(
            stop=stop,
            wait=self._wait(),
            retry=tenacity.retry_if_result(lambda result: result is None),
            retry_error_callback=lambda _state: None,
        )

    def _wait(self) -> tenacity.wait.wait_base:
        # wait_exponential + wait_random rather than wait_exponential_jitter, whose
        # arguments changed between tenacity 8 and 9.
        return tenacity.wait_exponential(
            multiplier=self.backoff_initial_s, max=self.backoff_max_s, exp_base=self.backoff_multiplier
        ) + tenacity.wait_random(0, self.jitter_s)
