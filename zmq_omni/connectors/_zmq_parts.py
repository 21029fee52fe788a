"""``ZmqParts``: what a :class:`~zmq_omni.connectors.zmq.ZmqConnector` is made of, and who may use it.

The parts: a push sender or a pull client (they connect), a push receiver or a
pull server (bound, in a :class:`SharedEndpoint` held with the other connectors
of this process bound at that address), the shared-memory pools, and the driver
of their sockets. Each is built at construction or at its first use (a lazy
bind, a receiver's first put, a sender's first pull-mode get), one at a time
under ``_bind_lock``; ``close`` takes that lock to mark the connector closed, so
nothing is built after it. Driven by an event loop, only the loop's thread uses
the sockets: :meth:`ZmqParts._check_sockets_here` and ``_can_wait`` say who may.

``ZmqParts`` is the base of the connector's layers (``_zmq_puts``, ``_zmq_gets``,
``_zmq_pull``, ``_zmq_health``); it declares the state they share, which
``ZmqConnector.__init__`` sets.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..config import ConnectorExtra
from ..config.zmq import ZmqConnectorConfig
from ..errors import ClosedResourceError, ConfigError, TransportTimeoutError, ZmqOmniError
from ..transport import (
    Curve,
    Driver,
    EndpointMap,
    PullClient,
    PullServer,
    PushReceiver,
    PushSender,
    ShmReceive,
    ShmSend,
    require_curve,
)
from ..wire import DecodeLimits
from ._expected_puts import settle
from ._shared_endpoint import SharedEndpoint, acquire
from ._zmq_bind import BOUND_SETTINGS, open_endpoint, shm_pool
from .base import OmniConnectorBase

log = logging.getLogger("zmq_omni.connectors")

#: Longest a lazy bind waits for the I/O thread (it only creates and binds one socket).
_BIND_WAIT_S = 10.0

_T = TypeVar("_T")


class ZmqParts(OmniConnectorBase):
    """The parts of a ZeroMQ connector, built at construction or at first use, and the rules for using them.

    Every attribute below is set by ``ZmqConnector.__init__``; the parts are None until built
    (and the bound ones stay None in a connector that never binds).
    """

    settings: ZmqConnectorConfig
    config: ConnectorExtra
    stage_id: str | int | None
    sid: str
    endpoint: str | None
    _loop: Driver | None  # None once closed
    _sender: PushSender | None
    _receiver: PushReceiver | None  # the bound part, in push mode (the shared endpoint's)
    _server: PullServer | None  # the bound part, in pull mode (the shared endpoint's)
    _client: PullClient | None
    _shm_send: ShmSend | None
    _shm_receive: ShmReceive | None
    _shm_degraded: bool  # the last large put found no shared-memory slot
    _shared: SharedEndpoint | None  # the bound part's endpoint, held with the other connectors on it
    _close_lock: threading.Lock
    _bind_lock: threading.Lock  # one part built at a time; close() marks the connector closed under it
    _idle: threading.Event  # set by close(): ends wait_for_change without a receiver
    # health(): when a put last failed (None: one succeeded since), and the receiver's drops last seen.
    _put_failed_at: float | None
    _put_failure: str
    _unclaimed_seen: int
    _unclaimed_at: float
    _endpoints: EndpointMap
    _curve: Curve | None
    _insecure: bool
    _limits: DecodeLimits
    _device: Any  # the torch.device decoded tensors go to (None: CPU)
    _decode: Callable[[list[Any]], Any]

    # -- the parts built on demand --------------------------------------------------------
    def _build_sender(self) -> PushSender:
        """The push sender and its shared-memory pool (in the constructor, or on the I/O thread)."""
        cfg, loop = self.settings, self._loop
        assert loop is not None
        if cfg.shm != "off" and self._shm_send is None:
            self._shm_send = shm_pool(cfg, loop)
        return PushSender(
            loop,
            self._endpoints,
            sid=self.sid,
            put_timeout_s=cfg.put_timeout_s,
            delivery_timeout_s=cfg.delivery_timeout_s,
            heartbeat_s=cfg.heartbeat_s,
            peer_timeout_s=cfg.peer_timeout_s,
            max_unacked=cfg.max_unacked,
            max_unacked_bytes=cfg.max_unacked_bytes,
            hwm=cfg.hwm,
            counters=self._counters,
            on_failure=self._on_failure,
            curve=self._curve,
            shm=self._shm_send,
            batch_max_messages=cfg.batch_max_messages,
            batch_max_bytes=cfg.batch_max_bytes,
            batch_item_bytes=cfg.inline_threshold,
        )

    def _meet_receivers(self) -> None:
        """Have a sender built at construction connect to its receivers now, to learn their shm verdicts.

        The receivers it can name: ``to_stage`` when configured; else, for a ``sender`` or ``dual``
        connector (vllm-omni injects no ``to_stage``), every other stage of ``endpoints``. Never the
        stage it binds itself: a connector with no role and no ``stage_id`` binds ``to_stage`` in
        push mode, so it meets nobody. A put right after start then finds the verdict (and a slot)
        ready; see ``transport/_shm.py``. A stage it cannot reach yet (no endpoint, a socket ZeroMQ
        cannot make) is left to its first put, which reports that as it always does.

        Not over CURVE: CURVE is the path off the host, where no receiver can read our shared memory,
        and a stage whose allow-list leaves us out (one we never put to) would refuse the handshake
        and log it at every start.
        """
        cfg, sender = self.settings, self._sender
        if sender is None or self._shm_send is None or self._shm_send.probe is None or self._curve is not None:
            return
        if cfg.to_stage is not None:
            stages = [cfg.to_stage]
        elif cfg.role in ("sender", "dual"):
            stages = self._endpoints.stages()
        else:
            return
        own = {self._bind_stage(None), cfg.from_stage}
        for stage in stages:
            if stage in own:
                continue
            try:
                sender.meet(stage)
            except ZmqOmniError as exc:  # ConfigError (no endpoint) or TransportError (no socket)
                log.debug("not meeting stage %s before a put to it: %s", stage, exc)

    def _build_client(self) -> PullClient:
        """The pull-mode fetcher and the shared-memory reader of its replies."""
        cfg, loop = self.settings, self._loop
        assert loop is not None
        if cfg.shm != "off" and self._shm_receive is None:
            self._shm_receive = ShmReceive(directory=cfg.shm_dir)
        return PullClient(
            loop.ctx,
            hwm=cfg.hwm,
            max_message_bytes=cfg.max_message_bytes,
            decode=self._decode,
            counters=self._counters,
            curve=self._curve,
            shm=self._shm_receive,
        )

    def _ensure_sender(self) -> PushSender | None:
        """The push sender, built at the first put of a connector whose role is ``receiver``; None once closed.

        Raises:
            ConfigError: an endpoint it would connect to is plaintext TCP off the host (see ``docs/security.md``).
        """
        with self._bind_lock:
            if self._sender is None and not self._closed:
                require_curve(list(self._endpoints.items()), curve=self._curve is not None, insecure=self._insecure)
                self._sender = self._on_loop(self._build_sender)
                if self._watches:
                    self._hook_watches()
        return self._sender

    def _ensure_client(self) -> PullClient | None:
        """The pull-mode fetcher, built at the first get of a connector whose role is ``sender``; None once closed."""
        with self._bind_lock:
            if self._client is None and not self._closed:
                require_curve(list(self._endpoints.items()), curve=self._curve is not None, insecure=self._insecure)
                self._client = self._build_client()
        return self._client

    # -- binding ----------------------------------------------------------------------
    def _bind_stage(self, call_stage: str | None) -> str | None:
        """The stage whose endpoint this connector binds: its own id, else its end of the edge, else the call's.

        Its end of the edge: ``to_stage`` for a receiver, ``from_stage`` for a sender; without a role (or
        ``dual``), the end that binds in its mode (push: ``to_stage``; pull: ``from_stage``).
        """
        cfg = self.settings
        if cfg.stage_id is not None:
            return cfg.stage_id
        if cfg.role == "receiver":
            own = cfg.to_stage
        elif cfg.role == "sender":
            own = cfg.from_stage
        else:
            own = cfg.to_stage if cfg.mode == "push" else cfg.from_stage
        return own if own is not None else call_stage

    def _bind(self, stage: str) -> None:
        """Bind ``stage``'s endpoint, or join the connector of this process bound there (under ``_bind_lock``).

        The bound part (push receiver or pull server) is a :class:`SharedEndpoint` with its own
        I/O thread, held by every connector of this process bound at that address; a connector
        driven by an event loop binds one of its own, on its driver, that no other connector shares.

        Raises:
            ConfigError: no endpoint is configured for ``stage``, or a connector of this process is
                bound there with other settings, or either of them is driven by an event loop.
            TransportError: the bind failed, or a live process listens on that ipc path (the endpoint is named).
            RuntimeError: driven by an event loop, and called on another thread than the loop's.
        """
        cfg = self.settings
        if self._loop is None:
            raise ClosedResourceError("connector closed")
        self._check_sockets_here("binding its endpoint")
        advertised = self._endpoints.get(stage)
        bind_at = self._endpoints.env_bind or cfg.bind or advertised
        if bind_at is None:
            raise ConfigError(f"stage {stage!r} must bind: set config key 'endpoints.{stage}' or 'bind'")
        # A lazy bind (no role given) is checked here; a bind at construction was checked before any socket.
        require_curve([("bind", bind_at)], curve=self._curve is not None, insecure=self._insecure)
        # Connectors on one endpoint agree on what its bound part uses (fan-in edges may differ in the rest).
        agreed = {name: getattr(cfg, name) for name in BOUND_SETTINGS[cfg.mode]}
        build = functools.partial(
            open_endpoint,
            cfg,
            stage,
            bind_at,
            advertised,
            agreed,
            driver=self._loop,
            curve=self._curve,
            decode=self._decode,
            limits=self._limits,
            device=self._device,
        )
        shared = acquire(bind_at, agreed, self, build, advertised, exclusive=not self._loop.threaded)
        self._shared = shared
        part = shared.part
        if isinstance(part, PushReceiver):
            # What was cleaned up here before the bind is in its tombstones already (handed over as it
            # registered: see _expected_puts), as this process's puts on their way here are in its record.
            self._receiver = part
        else:
            assert part is not None
            self._server = part
        self.endpoint = part.endpoint
        if self._watches:  # a watch taken before this lazy bind hears the new part too
            self._hook_watches()
        log.info("ZmqConnector stage=%s bound %s (%d connectors there)", stage, self.endpoint, shared.holders)

    def _on_loop(self, build: Callable[[], _T]) -> _T:
        """Run ``build`` on the driver's thread and return its result (or raise its error).

        Driven by an event loop, it runs here: the caller is on the loop's thread (or nothing drives yet).
        """
        assert self._loop is not None
        if not self._loop.threaded:
            self._check_sockets_here("building its send side")
            return build()
        if not self._loop.started:  # a connector that only received had no sockets of its own to drive until now
            self._loop.start()
        done = threading.Event()
        result: list[_T | BaseException] = []

        def run() -> None:
            try:
                result.append(build())
            except BaseException as exc:
                result.append(exc)
            finally:
                done.set()

        self._loop.call_soon(run)
        if not done.wait(_BIND_WAIT_S) or not result:
            raise TransportTimeoutError(f"the I/O thread did not build its part within {_BIND_WAIT_S}s")
        got = result[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def _ensure_bound(self, call_stage: str) -> None:
        """Bind now, for a connector that binds lazily (no role, or no stage to bind at construction)."""
        with self._bind_lock:
            if self._receiver is not None or self._server is not None or self._closed:
                return
            stage = self._bind_stage(call_stage)
            assert stage is not None
            self._bind(stage)

    # -- who may do what, driven by an event loop --------------------------------------
    @property
    def driver(self) -> Driver | None:
        """What drives this connector's sockets (None once closed).

        Its I/O thread (an :class:`~zmq_omni.transport.IoLoop`), or an event loop's ``LoopDriver`` (``zmq_omni.aio``).
        """
        return self._loop

    def _can_wait(self) -> bool:
        """Whether a call on this thread may block on I/O the driver does (always, driven by threads)."""
        loop = self._loop
        return loop is None or loop.threaded or loop.may_wait_here()

    def _check_sockets_here(self, what: str) -> None:
        """Raise unless this thread may use the sockets itself (driven by a loop: the loop's thread).

        Raises:
            RuntimeError: driven by an event loop, called on another thread while the loop drives it.
        """
        loop = self._loop
        if loop is not None and not loop.may_use_sockets_here():
            raise RuntimeError(
                f"{what}: this ZmqConnector is driven by an event loop, whose thread alone uses its sockets; "
                "call it on that loop (through its AsyncConnector)"
            )

    def _refuse_wait(self, what: str, instead: str) -> RuntimeError:
        """The error of a call that would wait on a thread where the event loop driving us cannot serve it."""
        return RuntimeError(
            f"{what} would wait for I/O that the event loop driving this ZmqConnector must do, on a thread "
            f"where it cannot be done (the loop's own, or while no loop runs it): use {instead}"
        )

    def _on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        if op != "get":  # a failed put to ourselves is no longer expected
            settle(self._endpoints.get(to_stage), (from_stage, to_stage, key))
        self._record_failure("get" if op == "get" else "put", from_stage, to_stage, key, reason, error)

    def _hook_watches(self) -> None:
        """Point the parts' signals at the watches: at the first watch, and at a lazy bind after it.

        Connectors nobody watches pay nothing for watches on their hot paths.
        """
        shared = self._shared
        if shared is not None:  # arrivals reach the watches without waiting for a get
            if self._receiver is not None:
                shared.hook_arrivals(self._notify_watches)
            else:
                shared.hook_room(self._notify_room)
        if self._sender is not None:
            self._sender.on_window_change(self._notify_room)
