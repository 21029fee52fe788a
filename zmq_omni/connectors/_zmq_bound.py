"""``Bound``: a :class:`~zmq_omni.connectors.zmq.ZmqConnector`'s bound endpoint, and its cleanups.

What it owns: the :class:`SharedEndpoint` this connector holds (once bound), its part
(a :class:`PushReceiver` in push mode, a :class:`PullServer` in pull mode) and the
endpoint peers reach. The endpoint is held with every connector of this process bound
at that address; a connector driven by an event loop binds one of its own, on its driver.
It binds at construction (a role that binds), or at the first call that needs it (a
push-mode get, a pull-mode put) under the wiring's ``build_lock``.

Cleanups drop what matches everywhere this connector holds it: the bound part, this
process's puts expected there, and, before the bind, a record kept for whichever of our
connectors binds the endpoint (``_expected_puts.cancel_early``).
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from typing import Any

from ..errors import ClosedResourceError, ConfigError
from ..transport import PullServer, PushReceiver
from ._expected_puts import BoundEndpoint, cancel_early
from ._shared_endpoint import Holder, SharedEndpoint, acquire
from ._zmq_bind import BOUND_SETTINGS, open_endpoint
from ._zmq_parts import Wiring

log = logging.getLogger("zmq_omni.connectors")


class Bound:
    """The bound endpoint of one connector (see the module docstring); None fields until it binds.

    Args:
        wiring: the connector's shared settings and rules.
        holder: the connector, as the shared endpoint knows it (its health, its failures, and,
            in pull mode, the owner of the payloads it stores).
    """

    def __init__(self, wiring: Wiring, holder: Holder) -> None:
        self._wiring = wiring
        self._holder = holder
        self.shared: SharedEndpoint | None = None  # held with the other connectors bound there
        self.receiver: PushReceiver | None = None  # the part, in push mode
        self.server: PullServer | None = None  # the part, in pull mode
        self.endpoint: str | None = None  # where peers reach it

    # -- binding --------------------------------------------------------------------------
    def bind(self, stage: str) -> None:
        """Bind ``stage``'s endpoint, or join the connector of this process bound there (under ``build_lock``).

        Raises:
            ConfigError: no endpoint is configured for ``stage``, or a connector of this process is
                bound there with other settings, or either of them is driven by an event loop.
            TransportError: the bind failed, or a live process listens on that ipc path (the endpoint is named).
            RuntimeError: driven by an event loop, and called on another thread than the loop's.
        """
        wiring = self._wiring
        cfg, driver = wiring.settings, wiring.driver
        if driver is None:
            raise ClosedResourceError("connector closed")
        wiring.check_sockets_here("binding its endpoint")
        advertised = wiring.endpoints.get(stage)
        bind_at = wiring.endpoints.env_bind or cfg.bind or advertised
        if bind_at is None:
            raise ConfigError(f"stage {stage!r} must bind: set config key 'endpoints.{stage}' or 'bind'")
        # A lazy bind (no role given) is checked here; a bind at construction was checked before any socket.
        wiring.require_reachable([("bind", bind_at)])
        # Connectors on one endpoint agree on what its bound part uses (fan-in edges may differ in the rest).
        agreed = {name: getattr(cfg, name) for name in BOUND_SETTINGS[cfg.mode]}
        build = functools.partial(
            open_endpoint,
            cfg,
            stage,
            bind_at,
            advertised,
            agreed,
            driver=driver,
            curve=wiring.curve,
            decode=wiring.decode,
            limits=wiring.limits,
            device=wiring.device,
        )
        shared = acquire(bind_at, agreed, self._holder, build, advertised, exclusive=not driver.threaded)
        self.shared = shared
        part = shared.part
        if isinstance(part, PushReceiver):
            # What was cleaned up here before the bind is in its tombstones already (handed over as it
            # registered: see _expected_puts), as this process's puts on their way here are in its record.
            self.receiver = part
        else:
            assert part is not None
            self.server = part
        self.endpoint = part.endpoint
        if wiring.watched:  # a watch taken before this lazy bind hears the new part too
            self.hook_watches()
        log.info("ZmqConnector stage=%s bound %s (%d connectors there)", stage, self.endpoint, shared.holders)

    def ensure_bound(self, call_stage: str) -> None:
        """Bind now, for a connector that binds lazily (no role, or no stage to bind at construction)."""
        wiring = self._wiring
        with wiring.build_lock:
            if self.receiver is not None or self.server is not None or wiring.closed:
                return
            stage = wiring.bind_stage(call_stage)
            assert stage is not None
            self.bind(stage)

    def receiver_or_bind(self, to_stage: str) -> PushReceiver | None:
        """The push receiver gets take from, bound first for a connector that binds lazily; None in pull mode.

        A push-mode ``sender`` that gets binds its own stage's endpoint (``stage_id``, else its
        ``from_stage``), joining the connector of this process already bound there, if any.
        """
        if self.receiver is None and self._wiring.settings.mode == "push" and not self._wiring.closed:
            self.ensure_bound(to_stage)
        return self.receiver

    def hook_watches(self) -> None:
        """Point the bound part's signals at the watches (arrivals in push mode, store room in pull mode)."""
        shared = self.shared
        if shared is not None:
            if self.receiver is not None:
                shared.hook_arrivals(self._wiring.notify_arrivals)
            else:
                shared.hook_room(self._wiring.notify_room)

    # -- pull mode: the store ---------------------------------------------------------------
    def store(
        self, from_stage: str, to_stage: str, key: str, frames: list[Any], nbytes: int, *, block: bool
    ) -> dict[str, Any]:
        """Store a pull-mode payload until fetched; its metadata. Ours in the shared store: our flush waits for it.

        Raises:
            TransportError: no room in time (or closed).
        """
        server = self.server
        assert server is not None
        return server.store(from_stage, to_stage, key, frames, nbytes, block=block, owner=self._holder)

    def wait_fetched(self, timeout_s: float) -> bool:
        """Pull mode: wait until every payload this connector stored was fetched (True), or ``timeout_s``."""
        assert self.server is not None
        return self.server.wait_fetched(timeout_s, owner=self._holder)

    # -- cleanups ---------------------------------------------------------------------------
    def forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        """A cleanup: drop what matches here and bury ``key`` / ``prefix`` firmly; how many items were dropped.

        Not bound (yet) in push mode: kept for whichever of our connectors binds the endpoint we would
        bind (any of ours while the stage is up to the first get's call), or applied at once where one
        has. Never another stage's endpoint: a sender's cleanup cancels none of its puts (#6670).
        """
        wiring = self._wiring
        dropped = 0
        bound: list[BoundEndpoint] = [] if self.shared is None or self.receiver is None else [self.shared]
        if self.receiver is None and wiring.settings.mode == "push":
            stage = wiring.bind_stage(None)
            endpoint = None if stage is None else wiring.endpoints.get(stage)
            endpoints = [e for _, e in wiring.endpoints.items()] if stage is None else [endpoint] if endpoint else []
            bound = cancel_early(match, endpoints, key=key, prefix=prefix, ttl_s=wiring.settings.tombstone_ttl_s)
        for shared in bound:
            receiver = shared.part
            assert isinstance(receiver, PushReceiver)
            # Puts of this process still on their way here are dropped as they arrive: each key gets a
            # tombstone (receiver-side cleanup; puts to other endpoints go on, #6670).
            in_flight = shared.expected.settle_where(match) if shared.expected.slots else []
            dropped += receiver.forget(match, key=key, prefix=prefix, firm=True)
            for buried in in_flight:
                if buried != key:
                    receiver.forget(functools.partial(operator.eq, buried), key=buried, firm=True)
        if self.server is not None:
            dropped += self.server.forget(match, key=key, prefix=prefix)
        return dropped

    def abandon(self, key: str) -> None:
        """A get of ``key`` was given up: drop the item, whatever arrives for it later, and our put expected here."""
        if self.receiver is not None:
            self.receiver.forget(lambda k: k == key, key=key)
            shared = self.shared
            if shared is not None and shared.expected.slots:
                shared.expected.settle_where(lambda k: k == key)

    # -- close ----------------------------------------------------------------------------
    def release(self, hooks: tuple[Callable[..., Any], ...]) -> list[str]:
        """Let go of the endpoint (the last connector bound there closes it); the keys of our puts lost.

        ``hooks``: the signals this connector hooked there. Pull mode: our payloads nobody fetched are
        taken out of the store and reported failed to us.
        """
        shared = self.shared
        return [] if shared is None else shared.release(self._holder, hooks)
