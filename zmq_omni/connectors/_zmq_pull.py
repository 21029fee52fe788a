"""``Fetching``: pull-mode gets of a :class:`~zmq_omni.connectors.zmq.ZmqConnector`, FETCHes to the sending stage.

What it owns: the pull client (its sockets to each server, built at construction or at
a ``sender``'s first get) and the shared-memory reader of its replies.

A threaded get fetches on the client's own socket (one round trip, bounded by
``fetch_timeout_s`` or the get's deadline); a get awaited on an event loop
(``zmq_omni.aio``) sends its FETCH on a :class:`FetchChannel` the caller opens
and owns, and hands the reply back to :meth:`Fetching.fetch_done`. Both ask
:meth:`Fetching.fetch_route` where to fetch from, so they apply one rule.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import ClosedResourceError, ConfigError, ShmError, TransportError, ZmqOmniError
from ..transport import FetchChannel, PullClient, ShmReceive
from ._zmq_parts import Wiring


class Fetching:
    """The pull-mode fetches of one connector (see the module docstring); ``client`` is None until built."""

    def __init__(self, wiring: Wiring) -> None:
        self._wiring = wiring
        self.client: PullClient | None = None
        self.shm: ShmReceive | None = None  # reads the servers' shared-memory replies

    def start(self) -> None:
        """Build the pull client at construction (a connector that gets in pull mode)."""
        self.client = self._build_client()

    def _build_client(self) -> PullClient:
        """The pull-mode fetcher and the shared-memory reader of its replies."""
        wiring = self._wiring
        cfg, driver = wiring.settings, wiring.driver
        assert driver is not None
        if cfg.shm != "off" and self.shm is None:
            self.shm = ShmReceive(directory=cfg.shm_dir)
        return PullClient(
            driver.ctx,
            hwm=cfg.hwm,
            max_message_bytes=cfg.max_message_bytes,
            decode=wiring.decode,
            counters=wiring.counters,
            curve=wiring.curve,
            shm=self.shm,
        )

    def ensure_client(self) -> PullClient | None:
        """The pull client, built at the first get of a connector whose role is ``sender``; None once closed."""
        wiring = self._wiring
        with wiring.build_lock:
            if self.client is None and not wiring.closed:
                wiring.require_reachable(list(wiring.endpoints.items()))
                self.client = self._build_client()
        return self.client

    def fetch(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None, deadline: float | None
    ) -> tuple[Any, int] | None:
        """A threaded pull-mode get: one round trip (until ``deadline``, else ``fetch_timeout_s``); failures kept."""
        wiring, client = self._wiring, self.client
        assert client is not None
        if wiring.driver is not None and not wiring.driver.threaded:  # the FETCH's socket would be this thread's
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
            wait_s, reply_by = 0.0, now + wiring.settings.fetch_timeout_s
        else:
            # The server answers "not found" a little before the deadline, so the reply is in by then.
            wait_s = max(0.0, (deadline - now) * 0.8)
            reply_by = deadline
        try:
            return client.fetch(
                endpoint, from_stage, to_stage, key, wait_s=wait_s, deadline=reply_by, server_key=server_key
            )
        except TransportError as exc:
            if not isinstance(exc, ClosedResourceError):
                self._wiring.record_failure("get", from_stage, to_stage, key, str(exc), exc)
            return None
        except ShmError as exc:  # the slot of a shared-memory reply was reclaimed (expired) first
            self._wiring.counters.add("shm_stale")
            self._wiring.record_failure("get", from_stage, to_stage, key, str(exc), exc)
            return None
        except ZmqOmniError as exc:  # a malformed or oversized reply
            self._wiring.counters.add("rejected_frames")
            self._wiring.record_failure("get", from_stage, to_stage, key, f"bad reply from {endpoint}: {exc}", exc)
            return None

    # -- pull-mode gets waited for on an event loop (zmq_omni.aio) ---------------------
    def fetch_route(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None
    ) -> tuple[str, bytes | None] | None:
        """Where a pull-mode get fetches from: the rule is ``ZmqConnector.fetch_route``'s (zmq.py)."""
        wiring = self._wiring
        cfg = wiring.settings
        if cfg.mode != "pull" or self.ensure_client() is None:
            raise ValueError(f"a {cfg.role!r} ZmqConnector in {cfg.mode} mode does not fetch")
        from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if isinstance(metadata, dict) and key in metadata and isinstance(metadata[key], dict):
            metadata = metadata[key]  # vllm-omni's {key: meta} wrapper
        endpoint = metadata.get("endpoint") if isinstance(metadata, dict) else None
        if not isinstance(endpoint, str):
            endpoint = wiring.endpoints.require(from_stage)
        else:  # an endpoint the sender's metadata named: the same rule as configured ones, reported, not raised
            try:
                wiring.require_reachable([("metadata endpoint", endpoint)])
            except ConfigError as exc:
                self._wiring.record_failure("get", from_stage, to_stage, key, str(exc), exc)
                return None
        return endpoint, None if wiring.curve is None else wiring.curve.server_key_for(from_stage)

    def open_fetch_channel(self, ctx: Any, endpoint: str, server_key: bytes | None) -> FetchChannel:
        """A :class:`FetchChannel` to ``endpoint`` on the caller's ZeroMQ context (the caller closes it)."""
        cfg = self._wiring.settings
        client = self.ensure_client() if cfg.mode == "pull" else None
        if client is None:
            raise ValueError(f"a {cfg.role!r} ZmqConnector in {cfg.mode} mode does not fetch")
        return client.open_channel(ctx, endpoint, server_key)

    def fetch_done(
        self, from_stage: str, to_stage: str, key: str, endpoint: str, result: Any
    ) -> tuple[Any, int] | None:
        """A :class:`FetchChannel` result under the get contract: counted, and an error kept as a failure."""
        from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if isinstance(result, ShmError):  # the slot of a shared-memory reply was reclaimed (expired) first
            self._wiring.counters.add("shm_stale")
            self._wiring.record_failure("get", from_stage, to_stage, key, str(result), result)
            return None
        if isinstance(result, TransportError):
            if not isinstance(result, ClosedResourceError):
                self._wiring.record_failure("get", from_stage, to_stage, key, str(result), result)
            return None
        if isinstance(result, ZmqOmniError):  # a malformed or oversized reply
            self._wiring.counters.add("rejected_frames")
            self._wiring.record_failure(
                "get", from_stage, to_stage, key, f"bad reply from {endpoint}: {result}", result
            )
            return None
        if result is not None:
            self._wiring.counters.add("gets")
            self._wiring.counters.add("bytes_received", result[1])
        got: tuple[Any, int] | None = result
        return got

    def shm_verdicts(self) -> dict[str, bool] | None:
        """Whether we read each pull server's shared memory (None without a client or a reader)."""
        if self.client is None or self.shm is None:
            return None
        verdicts: dict[str, bool] = self.client.shm_verdicts()
        return verdicts

    def close(self) -> None:
        """Wake waiting gets and give back the client's sockets (the reader closes with :meth:`close_reader`)."""
        if self.client is not None:
            self.client.close()

    def close_reader(self) -> None:
        """Close the shared-memory reader (once the driver stopped)."""
        if self.shm is not None:
            self.shm.close()
