"""Pull-mode gets of :class:`~zmq_omni.connectors.zmq.ZmqConnector`: FETCHes to the sending stage.

A threaded get fetches on the client's own socket (one round trip, bounded by
``fetch_timeout_s`` or the get's deadline); a get awaited on an event loop
(``zmq_omni.aio``) sends its FETCH on a :class:`FetchChannel` the caller opens
and owns, and hands the reply back to :meth:`ZmqPullFetch.fetch_done`. Both ask
:meth:`ZmqPullFetch.fetch_route` where to fetch from, so they apply one rule.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import ClosedResourceError, ConfigError, ShmError, TransportError, ZmqOmniError
from ..transport import FetchChannel, require_curve
from ._zmq_parts import ZmqParts


class ZmqPullFetch(ZmqParts):
    """The pull-mode fetches of a :class:`~zmq_omni.connectors.zmq.ZmqConnector` (see the module docstring)."""

    def _fetch(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None, deadline: float | None
    ) -> tuple[Any, int] | None:
        assert self._client is not None
        if self._loop is not None and not self._loop.threaded:  # the FETCH's socket would be this thread's
            raise RuntimeError(
                "a pull-mode get of a ZmqConnector driven by an event loop is a round trip on the loop's own "
                "sockets: await AsyncConnector.get"
            )
        route = self.fetch_route(from_stage, to_stage, key, metadata)
        if route is None:
            return None
        endpoint, server_key = route
        now = time.monotonic()
        if deadline is None:
            wait_s, reply_by = 0.0, now + self.settings.fetch_timeout_s
        else:
            # The server answers "not found" a little before the deadline, so the reply is in by then.
            wait_s = max(0.0, (deadline - now) * 0.8)
            reply_by = deadline
        try:
            return self._client.fetch(
                endpoint, from_stage, to_stage, key, wait_s=wait_s, deadline=reply_by, server_key=server_key
            )
        except TransportError as exc:
            if not isinstance(exc, ClosedResourceError):
                self._record_failure("get", from_stage, to_stage, key, str(exc), exc)
            return None
        except ShmError as exc:  # the slot of a shared-memory reply was reclaimed (expired) first
            self._counters.add("shm_stale")
            self._record_failure("get", from_stage, to_stage, key, str(exc), exc)
            return None
        except ZmqOmniError as exc:  # a malformed or oversized reply
            self._counters.add("rejected_frames")
            self._record_failure("get", from_stage, to_stage, key, f"bad reply from {endpoint}: {exc}", exc)
            return None

    # -- pull-mode gets waited for on an event loop (zmq_omni.aio) ---------------------
    @property
    def pull_receiver(self) -> bool:
        """True when gets fetch from the sender (pull mode): wait for them with a :class:`FetchChannel`."""
        return self.settings.mode == "pull"

    def fetch_route(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None
    ) -> tuple[str, bytes | None] | None:
        """Where a pull-mode get fetches from: ``(endpoint, server_key)``, or None when refused.

        Both the threaded and the asyncio get go through here, so they apply one rule: an
        endpoint the metadata names (it wins over the configured one) must pass the same
        plaintext/CURVE check as configured endpoints; one that does not is recorded as the
        get's failure and the get finds nothing.

        Raises:
            ValueError: this connector does not get in pull mode (or is closed).
            ConfigError: no endpoint is known for ``from_stage``.
        """
        if self.settings.mode != "pull" or self._ensure_client() is None:
            raise ValueError(f"a {self.settings.role!r} ZmqConnector in {self.settings.mode} mode does not fetch")
        from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if isinstance(metadata, dict) and key in metadata and isinstance(metadata[key], dict):
            metadata = metadata[key]  # vllm-omni's {key: meta} wrapper
        endpoint = metadata.get("endpoint") if isinstance(metadata, dict) else None
        if not isinstance(endpoint, str):
            endpoint = self._endpoints.require(from_stage)
        else:  # an endpoint the sender's metadata named: the same rule as configured ones, reported, not raised
            try:
                require_curve([("metadata endpoint", endpoint)], curve=self._curve is not None, insecure=self._insecure)
            except ConfigError as exc:
                self._record_failure("get", from_stage, to_stage, key, str(exc), exc)
                return None
        return endpoint, None if self._curve is None else self._curve.server_key_for(from_stage)

    def open_fetch_channel(self, ctx: Any, endpoint: str, server_key: bytes | None) -> FetchChannel:
        """A :class:`FetchChannel` to ``endpoint`` on the caller's ZeroMQ context (the caller closes it)."""
        client = self._ensure_client() if self.settings.mode == "pull" else None
        if client is None:
            raise ValueError(f"a {self.settings.role!r} ZmqConnector in {self.settings.mode} mode does not fetch")
        return client.open_channel(ctx, endpoint, server_key)

    def fetch_done(
        self, from_stage: str, to_stage: str, key: str, endpoint: str, result: Any
    ) -> tuple[Any, int] | None:
        """A :class:`FetchChannel` result under the get contract: counted, and an error kept as a failure."""
        from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if isinstance(result, ShmError):  # the slot of a shared-memory reply was reclaimed (expired) first
            self._counters.add("shm_stale")
            self._record_failure("get", from_stage, to_stage, key, str(result), result)
            return None
        if isinstance(result, TransportError):
            if not isinstance(result, ClosedResourceError):
                self._record_failure("get", from_stage, to_stage, key, str(result), result)
            return None
        if isinstance(result, ZmqOmniError):  # a malformed or oversized reply
            self._counters.add("rejected_frames")
            self._record_failure("get", from_stage, to_stage, key, f"bad reply from {endpoint}: {result}", result)
            return None
        if result is not None:
            self._counters.add("gets")
            self._counters.add("bytes_received", result[1])
        got: tuple[Any, int] | None = result
        return got
