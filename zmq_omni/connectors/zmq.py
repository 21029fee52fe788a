"""``ZmqConnector``: the connector contract over ZeroMQ, across processes and hosts.

Push mode (default): the receiving stage binds a ROUTER; senders connect and
keep each put until the receiver's ``get`` consumed it, resending after a
receiver restart, so nothing is lost silently. Pull mode: the sending stage
binds and keeps each payload until a receiver fetches it with the metadata
``put`` returned (or by key). The protocol and every config key are described
in ``docs/zmq-connector.md``.

Same-host fast path (``shm: auto`` by default): payloads of at least
``shm_threshold`` bytes for a receiver that proved it reads our shared memory
are written once into a reused slot, and only the slot handle crosses ZeroMQ;
the receiver's arrays view the slot without a copy. Push mode writes the slot
at ``put``; pull mode at fetch time, once the fetcher has shown it reads the
server's probe segment (its first fetch from a server takes frames).

A connector whose ``role`` is not given binds only when it first has to (push:
its first ``get``; pull: its first ``put``), so one ``extra`` serves both ends
of an edge (vllm-omni's orchestrator builds its connectors that way). A bind on
an ``ipc://`` path where a live process listens fails instead of taking it over.

What drives the sockets (see :class:`~zmq_omni.transport.Driver`): by default
an I/O thread per connector (and one per bound endpoint, shared by the
connectors of the process bound there), beside which put and get threads use
the sockets under the transport's locks. Built with ``driver=LoopDriver``
(``zmq_omni.aio``; what ``AsyncConnector.create`` builds), an asyncio event
loop drives every part of the connector and its sockets are the loop's alone
(see :meth:`ZmqConnector.__init__` for what that means for each call).
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ..config import ConnectorExtra
from ..config.zmq import ZmqConnectorConfig
from ..errors import (
    ClosedResourceError,
    ConfigError,
    DecodeError,
    DeliveryError,
    MessageTooLargeError,
    ShmError,
    TransportError,
    TransportTimeoutError,
    ZmqOmniError,
    format_seconds,
)
from ..transport import (
    Curve,
    Driver,
    EndpointMap,
    FetchChannel,
    IoLoop,
    PullClient,
    PullServer,
    PushReceiver,
    PushSender,
    ShmReceive,
    ShmSend,
    WouldBlock,
    insecure_from_env,
    require_curve,
    tune_malloc,
)
from ..wire import DecodeLimits, decode, decode_each, encode, frames_nbytes, resolve_device
from ._early_puts import cancel_early, drop_early, put_early, take_early
from ._shared_endpoint import SharedEndpoint, acquire, has_served, served
from .base import (
    ArrivalWatch,
    OmniConnectorBase,
    bounded_deadline,
    bounded_timeout,
    key_matches_prefix,
    key_matches_request,
)

__all__ = ["ZmqConnector"]

log = logging.getLogger("zmq_omni.connectors")

_MAX_FRAMES = 65536
#: Longest a lazy bind waits for the I/O thread (it only creates and binds one socket).
_BIND_WAIT_S = 10.0
#: Marks the metadata of our push-mode puts: a ``get`` handed it waits for that put to arrive.
_PUSH_METADATA_TAG = "zmq_omni.push"

_T = TypeVar("_T")
#: A get or wait_for_change on a push receiver re-arms its wait this often, to see its own connector's close
#: (a receiver other connectors of the process still hold stays open, and so does not wake it).
_HOLD_CHECK_S = 0.5
# A get waiting for this process's own put looks again this often whether another connector took it.
_OWN_CHECK_S = 0.05
#: Most push puts a connector keeps in mind from before it bound their endpoint (the oldest go first).


class ZmqConnector(OmniConnectorBase):
    """Put/get between stages over ZeroMQ with confirmed delivery (see the module docstring).

    Args:
        config: the ``extra`` dict; see :class:`~zmq_omni.config.zmq.ZmqConnectorConfig`.
        driver: what drives the sockets: :class:`~zmq_omni.transport.IoLoop` (default, an
            I/O thread), or ``zmq_omni.aio``'s ``LoopDriver`` (an event loop; built by
            ``AsyncConnector.create``, which attaches it to its loop at its first await).

    Raises:
        ConfigError: a bad, unknown or missing key, or no endpoint for a stage that must bind;
            with ``LoopDriver``, a bind at an address another connector of this process holds.
        TransportError: the bind failed (the message names the endpoint).

    Without CURVE, binding or connecting to TCP other than loopback is refused
    (``ConfigError``) unless ``insecure`` or ``ZMQ_OMNI_INSECURE=1`` opts out.

    Driven by an event loop, the connector's sockets are the loop's alone, and
    nothing blocks the loop's thread on I/O the loop itself must do. On the
    loop's thread, ``put`` never waits for window room (a full window fails
    the put at once, as its ``put_timeout_s`` would), ``get`` never waits (not
    even with a put's metadata), ``close()`` does not linger, and the calls
    whose job is to wait raise ``RuntimeError`` naming the awaitable to use:
    ``get_with_deadline`` with a deadline ahead, ``flush`` and
    ``wait_for_change`` with a timeout, any pull-mode get (a round trip). From
    other threads, what only waits on the mailbox or the send window works as
    in a threaded connector (push-mode ``get``, ``get_with_deadline``,
    ``wait_for_change``, ``flush``), as do ``cleanup*``, ``health``,
    ``drain_failures`` and ``close``; what would use a socket there (``put``,
    ``try_put``, pull-mode gets, a first bind) raises ``RuntimeError``.
    """

    def __init__(self, config: dict[str, Any], *, driver: type[Driver] = IoLoop) -> None:
        super().__init__()
        self._closed = True  # until fully built: close() must be safe after a failed __init__
        self._loop: Driver | None = None
        self._sender: PushSender | None = None
        self._receiver: PushReceiver | None = None
        self._server: PullServer | None = None
        self._client: PullClient | None = None
        self._shm_send: ShmSend | None = None
        self._shm_receive: ShmReceive | None = None
        self._shm_degraded = False
        self._shared: SharedEndpoint | None = None  # the bound part's endpoint, held with the other connectors on it
        # Push puts made before this connector bound the endpoint they go to (it binds at its first get):
        # slot -> until when a get may wait for it; handed to the endpoint when bound (under _bind_lock).
        self._close_lock = threading.Lock()
        self._bind_lock = threading.Lock()  # one lazy bind at a time (the receive and save threads race to it)
        self._idle = threading.Event()  # set by close(): ends wait_for_change without a receiver
        # health(): when a put last failed (None: one succeeded since), and the receiver's drops last seen.
        self._put_failed_at: float | None = None
        self._put_failure = ""
        self._unclaimed_seen = 0
        self._unclaimed_at = 0.0
        cfg = ZmqConnectorConfig.from_dict(config)
        #: The typed settings (see :class:`~zmq_omni.config.zmq.ZmqConnectorConfig`).
        self.settings = cfg
        #: The ``extra`` dict as given, every key kept: vllm-omni's stage input processors read their
        #: keys (``codec_chunk_frames``, ...) back from it. Attribute reads reach ``settings``.
        self.config = ConnectorExtra(config, cfg)
        #: The stage id exactly as given (vllm-omni's adapters compute ``stage_id - 1``); without one,
        #: the injected ``to_stage`` of a receiver or ``from_stage`` of a sender, as given.
        self.stage_id: str | int | None = config.get("stage_id")
        if self.stage_id is None:
            self.stage_id = config.get({"receiver": "to_stage", "sender": "from_stage"}.get(cfg.role or "", ""))
        self._endpoints = EndpointMap(cfg.endpoints)
        self._curve = Curve.from_config(
            cfg.curve_secret_key, cfg.curve_public_key, cfg.curve_server_key, cfg.curve_allowed_clients
        )
        self.sid = uuid.uuid4().hex[:16]
        self._limits = DecodeLimits(
            max_header_bytes=min(cfg.max_message_bytes, 64 << 20),
            max_frames=_MAX_FRAMES,
            max_total_bytes=cfg.max_message_bytes,
            max_depth=cfg.max_header_depth,
            max_objects=cfg.max_header_objects,
        )
        self._device = device = resolve_device(cfg.decode_device, f"{type(self).__name__}.decode_device")
        # One call per received message (a partial saves a Python frame on the receive hot path).
        self._decode: Callable[[list[Any]], Any] = functools.partial(
            decode, allow_pickle=cfg.allow_pickle, limits=self._limits, device=device
        )
        # Without a role the connector can do both, but binds only when it first has to (a get in push
        # mode, a put in pull mode): one extra then serves both ends of an edge, and the end that never
        # receives never takes the endpoint. A role says which side binds at once; the other direction
        # is built at its first use (a middle stage's "receiver" puts downstream).
        sends = cfg.role != "receiver"
        receives = cfg.role != "sender"
        bind_stage = self._bind_stage(None)
        binds_now = cfg.role in ("dual", "receiver" if cfg.mode == "push" else "sender") and bind_stage is not None
        connects = (cfg.mode == "push" and sends) or (cfg.mode == "pull" and receives)
        self._insecure = cfg.insecure or insecure_from_env()
        exposed = list(self._endpoints.items()) if connects else []
        if binds_now:
            assert bind_stage is not None
            bind_at = self._endpoints.env_bind or cfg.bind or self._endpoints.get(bind_stage)
            if bind_at is not None:
                exposed.append(("bind", bind_at))
        # Before any socket exists: a refused plaintext endpoint never sends or accepts a byte.
        require_curve(exposed, curve=self._curve is not None, insecure=self._insecure)
        if cfg.malloc_tuning and receives:
            tune_malloc()  # before the context's I/O threads first allocate
        self.endpoint: str | None = None
        # A CURVE allow-list installs a ZAP authenticator, which answers for its whole context: its own then.
        own_context = self._curve is not None and self._curve.allowed_clients is not None
        loop = self._loop = driver(f"zmq-omni-{cfg.stage_id}", private_context=own_context)
        self._closed = False
        try:
            if binds_now:
                assert bind_stage is not None
                self._bind(bind_stage)
            if cfg.mode == "push" and sends:
                self._sender = self._build_sender()
            if cfg.mode == "pull" and receives:
                self._client = self._build_client()
            loop.start()
        except BaseException:
            self.close()
            raise
        log.info("ZmqConnector stage=%s role=%s mode=%s endpoint=%s", cfg.stage_id, cfg.role, cfg.mode, self.endpoint)

    # -- the parts built on demand --------------------------------------------------------
    def _build_sender(self) -> PushSender:
        """The push sender and its shared-memory pool (in the constructor, or on the I/O thread)."""
        cfg, loop = self.settings, self._loop
        assert loop is not None
        if cfg.shm != "off" and self._shm_send is None:
            self._shm_send = _shm_pool(cfg, loop)
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
        agreed = {name: getattr(cfg, name) for name in _BOUND_SETTINGS[cfg.mode]}
        build = functools.partial(self._open_endpoint, stage, bind_at, advertised, agreed)
        shared = acquire(bind_at, agreed, self, build, advertised, exclusive=not self._loop.threaded)
        self._shared = shared
        part = shared.part
        if isinstance(part, PushReceiver):
            # This process's puts on their way here since before the bind are expected now; those
            # cleaned up meanwhile are dropped (already in, or as they come).
            for key in take_early(advertised, shared) if advertised is not None else ():
                part.forget(functools.partial(operator.eq, key), key=key)
            self._receiver = part
        else:
            assert part is not None
            self._server = part
        self.endpoint = part.endpoint
        if self._watches:  # a watch taken before this lazy bind hears the new part too
            self._hook_watches()
        log.info("ZmqConnector stage=%s bound %s (%d connectors there)", stage, self.endpoint, shared.holders)

    def _open_endpoint(self, stage: str, bind_at: str, advertised: str | None, agreed: Any) -> SharedEndpoint:
        """Bind a new :class:`SharedEndpoint` for ``stage`` at ``bind_at``, driven by its own I/O thread (started).

        A connector driven by an event loop binds one on its own driver instead, that no other connector shares.
        """
        cfg = self.settings
        assert self._loop is not None
        threaded = self._loop.threaded
        # A CURVE allow-list installs a ZAP authenticator, which answers for its whole context: its own then.
        own_context = self._curve is not None and self._curve.allowed_clients is not None
        loop = IoLoop(f"zmq-omni-bound-{stage}", private_context=own_context) if threaded else self._loop
        fast_path = cfg.shm != "off"
        shm_receive: ShmReceive | None = None
        shm_send: ShmSend | None = None
        try:
            if fast_path and cfg.mode == "push":
                shm_receive = ShmReceive(directory=cfg.shm_dir)
            if fast_path and cfg.mode == "pull":
                shm_send = _shm_pool(cfg, loop)
            if self._curve is not None:
                auth = self._curve.start_authenticator(loop.ctx)
                if auth is not None:
                    loop.on_term(auth.stop)
            shared = SharedEndpoint(
                bind_at, agreed, loop, shm_receive=shm_receive, shm_send=shm_send, exclusive=not threaded
            )
            if cfg.mode == "push":
                shared.part = PushReceiver(
                    loop,  # type: ignore[arg-type]  # (PushReceiver's annotation names IoLoop; any Driver drives it)
                    bind_at,
                    incarnation=uuid.uuid4().hex[:16],
                    decode=self._decode,
                    decode_each=functools.partial(
                        decode_each, allow_pickle=cfg.allow_pickle, limits=self._limits, device=self._device
                    ),
                    hwm=cfg.hwm,
                    max_message_bytes=cfg.max_message_bytes,
                    max_frames=_MAX_FRAMES,
                    source_ttl_s=max(60.0, 20 * cfg.peer_timeout_s),
                    counters=shared.counters,
                    unclaimed_ttl_s=cfg.unclaimed_ttl_s,
                    ack_delay_s=cfg.ack_delay_s,
                    tombstone_ttl_s=cfg.tombstone_ttl_s,
                    max_tombstones=cfg.max_tombstones,
                    health=shared.health,
                    curve=self._curve,
                    shm=shm_receive,
                    getters_read=threaded,  # a loop's socket is read on the loop only
                )
            else:
                fixed = advertised if advertised and not advertised.endswith((":0", ":*")) else None
                shared.part = PullServer(
                    loop,
                    bind_at,
                    fixed,
                    put_timeout_s=cfg.put_timeout_s,
                    ttl_s=cfg.pull_ttl_s,
                    max_unacked=cfg.max_unacked,
                    max_unacked_bytes=cfg.max_unacked_bytes,
                    hwm=cfg.hwm,
                    max_frames=_MAX_FRAMES,
                    counters=shared.counters,
                    on_failure=shared.on_owned_failure,
                    health=shared.health,
                    curve=self._curve,
                    shm=shm_send,
                    owner_of=shared.owner_of,
                )
            if threaded:
                loop.start()
        except BaseException:
            if threaded:
                loop.stop(timeout=1.0)
            for shm in (shm_send, shm_receive):
                if shm is not None:
                    shm.close()
            raise
        return shared

    def _on_loop(self, build: Callable[[], _T]) -> _T:
        """Run ``build`` on the driver's thread and return its result (or raise its error).

        Driven by an event loop, it runs here: the caller is on the loop's thread (or nothing drives yet).
        """
        assert self._loop is not None
        if not self._loop.threaded:
            self._check_sockets_here("building its send side")
            return build()
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

    # -- helpers ------------------------------------------------------------------

    def _on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        if op != "get" and has_served():  # a failed put to ourselves is no longer expected
            local = served(self._endpoints.get(to_stage))
            if local is not None:
                local.settle((from_stage, to_stage, key))
        self._record_failure("get" if op == "get" else "put", from_stage, to_stage, key, reason, error)

    def _record_failure(
        self,
        op: Literal["put", "get"],
        from_stage: str,
        to_stage: str,
        key: str,
        reason: str,
        error: ZmqOmniError | None = None,
    ) -> None:
        """Keep the failure (see the base class); a failed put also makes ``health()`` degraded for a while."""
        super()._record_failure(op, from_stage, to_stage, key, reason, error)
        # A put its receiver dropped because it cancelled the request says nothing about the link.
        cancelled = isinstance(error, DeliveryError) and error.dropped == "cancelled"
        if op == "put" and not self._closed and not cancelled:
            self._put_failure = f"put of {key!r} to stage {to_stage!r} failed: {reason}"
            self._put_failed_at = time.monotonic()

    def _fail_put(self, from_stage: str, to_stage: str, key: str, error: ZmqOmniError) -> tuple[bool, int, None]:
        self._record_failure("put", from_stage, to_stage, key, str(error), error)
        return False, 0, None

    # -- the contract ---------------------------------------------------------------
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Send ``data`` to ``to_stage`` under ``put_key``; ``(True, nbytes, metadata)`` once ZeroMQ has it.

        Push mode returns when the put is in the send window and handed to
        ZeroMQ, not when it is acknowledged; a delivery that is never confirmed,
        or a put its receiver dropped unconsumed (its request cancelled there, or
        unclaimed past its ``unclaimed_ttl_s``), is reported later through
        :meth:`drain_failures` (a ``DeliveryError``; ``dropped`` says which). Large arrays are sent
        without copying and pinned until the receiver consumed them: do not
        modify them in place after ``put`` unless ``copy_on_put`` is set, or
        the put took the same-host fast path (its bytes were copied into
        shared memory; ``health()["shm_puts"]`` counts those).

        A pull-mode connector without a role, or with role ``receiver``, binds its
        server at its first put (joining the connector of this process bound there,
        if any); a push-mode ``receiver`` builds its sender then.

        Driven by an event loop, on the loop's thread: a put that finds no room
        fails at once (``await AsyncConnector.put`` waits for room).

        Raises:
            EncodeError: ``data`` holds an unsupported type (a programming error).
            ConfigError: a ``receiver``'s first put finds an endpoint it may not reach in plaintext
                (see ``docs/security.md``), or its bind finds other settings on that address.
            TransportError: a first put had to bind and the bind failed (the endpoint is named).
            RuntimeError: driven by an event loop, called on another thread than the loop's.
        """
        if self._can_wait():
            got = self._put(from_stage, to_stage, put_key, data, True)
        else:
            reason = "no room in the send window: a put on the thread of its event loop cannot wait for it"
            got = self._put_now(from_stage, to_stage, put_key, data, reason)
        assert got is not None
        return got

    def try_put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any, give_up: bool = False
    ) -> tuple[bool, int, dict[str, Any] | None] | None:
        """:meth:`put` without waiting for window room: None (nothing sent, nothing kept) when there is none.

        For callers that wait on an event loop: they retry when an
        :class:`~zmq_omni.connectors.base.ArrivalWatch` of :meth:`watch_arrivals`
        reports room. With ``give_up`` a full window fails the put as
        :meth:`put` does after ``put_timeout_s`` (a ``TransportTimeoutError``
        kept for the adapters). A put refused at ZeroMQ's high-water mark is
        None too. It may still wait, briefly, while another thread holds the
        peer's socket (bounded by ``put_timeout_s``). With ``shm: on`` the first
        put to a peer does not wait for its shared-memory verdict (it goes as frames).
        """
        if not give_up:
            try:
                return self._put(from_stage, to_stage, put_key, data, False)
            except WouldBlock:
                return None
        reason = "no room in the send window or ZeroMQ's queue within the caller's timeout"
        return self._put_now(from_stage, to_stage, put_key, data, reason)

    def _put_now(
        self, from_stage: str, to_stage: str, key: str, data: Any, reason: str
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """A put that never waits for room: without it, the put fails as a timeout saying ``reason``."""
        try:
            got = self._put(from_stage, to_stage, key, data, False)
        except WouldBlock:
            return self._fail_put(str(from_stage), str(to_stage), str(key), TransportTimeoutError(reason))
        assert got is not None
        return got

    def _put(
        self, from_stage: str, to_stage: str, key: str, data: Any, block: bool
    ) -> tuple[bool, int, dict[str, Any] | None] | None:
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if self._closed:
            return self._fail_put(from_stage, to_stage, key, ClosedResourceError("connector closed"))
        self._check_sockets_here("put")
        cfg = self.settings
        sender = self._sender
        if sender is None and self._server is None:
            if cfg.mode == "push":  # a receiver putting downstream: its send side, built now
                sender = self._ensure_sender()
                if sender is None:
                    return self._fail_put(from_stage, to_stage, key, ClosedResourceError("connector closed"))
            else:
                self._ensure_bound(from_stage)
        frames = encode(data, inline_threshold=cfg.inline_threshold, allow_pickle=cfg.allow_pickle, limits=self._limits)
        nbytes = len(frames[0]) if len(frames) == 1 else frames_nbytes(frames)  # frame 0 is bytes
        if nbytes > cfg.max_message_bytes:
            return self._fail_put(
                from_stage,
                to_stage,
                key,
                MessageTooLargeError(f"put of {nbytes} bytes > max_message_bytes {cfg.max_message_bytes}"),
            )
        shm = self._shm_send
        loc = None if shm is None or nbytes < shm.threshold else self._to_shm(to_stage, frames, nbytes, block)
        if loc is None and cfg.copy_on_put and len(frames) > 1:
            frames = [frames[0], *(bytes(frame) for frame in frames[1:])]
        try:
            if sender is not None:
                # A put to an endpoint this process binds is expected there: a get of it waits for it.
                target = self._endpoints.get(to_stage)
                local = served(target) if has_served() else None
                until = time.monotonic() + cfg.metadata_get_timeout_s
                early = self._receiver is None and target is not None and self._bind_stage(to_stage) == to_stage
                if local is not None:
                    if not (isinstance(local.part, PushReceiver) and local.part.buries(key)):  # dropped on arrival
                        local.expect((from_stage, to_stage, key), until)
                elif early:  # binds there at a first get: expected there once bound, by whichever binds
                    assert target is not None
                    local = put_early(target, (from_stage, to_stage, key), until)
                try:
                    sender.send(from_stage, to_stage, key, frames, nbytes, loc, block=block)
                except BaseException:
                    if local is not None:
                        local.settle((from_stage, to_stage, key))
                    elif early:
                        assert target is not None
                        drop_early(target, (from_stage, to_stage, key))
                    if loc is not None and shm is not None:
                        shm.discard(loc)
                    raise
                metadata: dict[str, Any] = {"key": key, "size": nbytes, "transport": _PUSH_METADATA_TAG}
            else:
                server, shared = self._server, self._shared
                assert server is not None and shared is not None
                # The payload is ours in the shared store: our flush waits for it, its failures come back to us.
                shared.stored_by((from_stage, to_stage, key), self)
                metadata = server.store(from_stage, to_stage, key, frames, nbytes, block=block)
        except TransportError as exc:
            return self._fail_put(from_stage, to_stage, key, exc)
        if self._put_failed_at is not None:  # puts go through again: health() need not wait degraded_hold_s
            self._put_failed_at = None
        return True, nbytes, metadata

    def _to_shm(self, to_stage: str, frames: list[Any], nbytes: int, block: bool = True) -> bytes | None:
        """Write a large payload into a slot for a same-host receiver; the packed handle, or None (frames)."""
        shm, sender = self._shm_send, self._sender
        if shm is None or sender is None or nbytes < shm.threshold:
            return None
        wait_s = self.settings.put_timeout_s if self.settings.shm == "on" and block else 0.0
        if shm.probe is None or not sender.reads_shm(to_stage, wait_s):
            return None
        loc = shm.write(frames)
        if loc is None:
            self._counters.add("shm_fallbacks")
            self._shm_degraded = True
        else:
            self._counters.add("shm_puts")
            self._shm_degraded = False
        return loc

    def watch_arrivals(self) -> ArrivalWatch:
        """A watch notified when items reach the push receiver's mailbox, when window room frees, and at close.

        A pull-mode receiver's items never arrive by themselves: wait for them on a
        :class:`FetchChannel` instead (see :meth:`open_fetch_channel`).
        """
        watch = self._new_watch()
        self._hook_watches()
        return watch

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

    def get_wakeup_generation(self) -> int | None:
        """A counter that changes whenever items arrive in the push receiver's mailbox.

        None when this connector has no push receiver (pull mode or a sender): nothing
        arrives by itself there, so callers should wait in ``get_with_deadline``
        (pull mode's server-side long poll) instead of :meth:`wait_for_change`.
        """
        receiver = self._receiver
        return None if receiver is None else receiver.generation()

    def wait_for_change(self, gen: int, *, timeout: float) -> int:
        """Wait until the wakeup generation differs from ``gen`` (at most ``timeout``); return it then.

        Waits on the mailbox condition (no polling); returns ``gen`` unchanged after
        a timeout or ``close()``. Without a push receiver it waits ``timeout`` (or until closed).

        Raises:
            RuntimeError: driven by an event loop, a wait on the loop's own thread (or while no loop runs it).
        """
        timeout = bounded_timeout(timeout)
        if timeout > 0 and not self._can_wait():
            raise self._refuse_wait("wait_for_change", "the AsyncConnector's awaited get")
        receiver = self._receiver
        if receiver is not None:
            end = time.monotonic() + timeout
            while True:
                # The receiver outlives this connector while others hold it: see our close within a slice.
                remaining = end - time.monotonic()
                now_gen = receiver.wait_for_change(gen, min(remaining, _HOLD_CHECK_S))
                if now_gen != gen or remaining <= _HOLD_CHECK_S or self._closed:
                    return now_gen
        if not self._closed:
            self._idle.wait(timeout)
        return gen

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Take the object put under ``get_key``: ``(obj, nbytes)``, or None when it is not there (yet).

        Push mode: without metadata (or with metadata that is not ours, such as
        vllm-omni's ``{source_host, source_port}`` hints) it never waits. With the
        metadata one of our puts returned it waits up to ``metadata_get_timeout_s``
        for that put to arrive, and records a timeout failure if it does not
        (vllm-omni's orchestrator hands a stage that metadata and calls ``get`` once).
        Pull mode asks the sender (one round trip; at most ``fetch_timeout_s``
        when the sender does not answer). A connector without a role binds at its
        first push-mode ``get``.

        Driven by an event loop, on the loop's thread a push-mode ``get`` never
        waits, with metadata or not (``await AsyncConnector.get`` waits).

        Raises:
            RuntimeError: driven by an event loop, a pull-mode get (a round trip the loop does:
                await it), or a first get that binds, off the loop's thread.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if not self._can_wait():
            return self._get(from_stage, to_stage, key, metadata, None, wait_for_own=False)
        if metadata is not None and self._receiver_or_bind(to_stage) and _announces(metadata, key):
            deadline = time.monotonic() + self.settings.metadata_get_timeout_s
            got = self._get(from_stage, to_stage, key, metadata, deadline)
            if got is None and not self._closed:
                self._record_failure(
                    "get",
                    from_stage,
                    to_stage,
                    key,
                    f"the put of {key!r} its metadata announced did not arrive within "
                    f"metadata_get_timeout_s={self.settings.metadata_get_timeout_s}s",
                    TransportTimeoutError(f"put of {key!r} not arrived", endpoint=self.endpoint),
                )
            return got
        return self._get(from_stage, to_stage, key, metadata, None)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """Like :meth:`get`, waiting (on a condition, or a server-side long poll) until ``deadline``.

        Raises:
            RuntimeError: driven by an event loop, a deadline ahead on the loop's own thread (or while
                no loop runs it): ``await AsyncConnector.get(..., timeout=...)`` waits there.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        deadline = bounded_deadline(deadline)
        if not self._can_wait():
            if deadline > time.monotonic():
                raise self._refuse_wait("get_with_deadline", "await AsyncConnector.get(..., timeout=...)")
            return self._get(from_stage, to_stage, key, metadata, None, wait_for_own=False)
        return self._get(from_stage, to_stage, key, metadata, deadline)

    def _receiver_or_bind(self, to_stage: str) -> bool:
        """True when gets go to a push receiver, binding it first for a connector that binds lazily.

        A push-mode ``sender`` that gets binds its own stage's endpoint (``stage_id``, else its
        ``from_stage``), joining the connector of this process already bound there, if any.
        """
        if self._receiver is None and self.settings.mode == "push" and not self._closed:
            self._ensure_bound(to_stage)
        return self._receiver is not None

    def _get(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        metadata: dict[str, Any] | None,
        deadline: float | None,
        *,
        wait_for_own: bool = True,
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        if self._receiver is None and self._client is None:
            if self.settings.mode == "push":
                self._receiver_or_bind(to_stage)
            elif self._ensure_client() is None:  # a pull-mode sender's first get; None: closed meanwhile
                return None
        if self._receiver is not None:  # push-mode gets are counted by the mailbox
            return self._take(from_stage, to_stage, key, deadline, wait_for_own=wait_for_own)
        got = self._fetch(from_stage, to_stage, key, metadata, deadline)
        if got is not None:
            self._counters.add("gets")
            self._counters.add("bytes_received", got[1])
        return got

    def get_nowait(self, from_stage: str, to_stage: str, get_key: str) -> tuple[Any, int] | None:
        """``get`` by key that never waits, not even for a put of this key this process has on its way here.

        An addition to the contract: ``get`` waits for such a put (bounded by its window), which
        would hold up a caller that waits otherwise (``AsyncConnector``'s gets wait on their loop
        and look with this). Push mode; in pull mode (a round trip to the sender) it is :meth:`get`.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if self._closed:
            return None
        if self._receiver is None and self._client is None:
            self._receiver_or_bind(to_stage)
        if self._receiver is None:
            return self._get(from_stage, to_stage, key, None, None, wait_for_own=False)
        return self._take(from_stage, to_stage, key, None, wait_for_own=False)

    def _take(
        self, from_stage: str, to_stage: str, key: str, deadline: float | None, *, wait_for_own: bool = True
    ) -> tuple[Any, int] | None:
        """A push-mode get from the receiver's mailbox (waiting until ``deadline``, if given); failures recorded.

        Without a deadline it never waits, except for a put of this very key that this process
        made and that has not arrived yet: it waits for that one, until its window ends.
        """
        receiver, shared = self._receiver, self._shared
        assert receiver is not None and shared is not None
        try:
            if deadline is None:
                got = receiver.take(from_stage, to_stage, key)
                if shared.expected:
                    slot = (from_stage, to_stage, key)
                    # Our own put of this key is on its way here: wait for it, in slices, since another
                    # connector of this endpoint may take it (and settle it) meanwhile.
                    while got is None and wait_for_own and not self._closed:
                        until = shared.expected_until(slot)
                        if until is None:
                            break
                        got = receiver.take_by(from_stage, to_stage, key, min(until, time.monotonic() + _OWN_CHECK_S))
                    if got is not None:
                        shared.settle(slot)
                return got
            while True:
                # The receiver outlives this connector while others hold it: see our close within a slice.
                until = min(deadline, time.monotonic() + _HOLD_CHECK_S)
                got = receiver.take_by(from_stage, to_stage, key, until)
                if got is not None or until >= deadline or self._closed:
                    break
            if got is not None and shared.expected:
                shared.settle((from_stage, to_stage, key))
            return got
        except ZmqOmniError as exc:
            self._take_failed(from_stage, to_stage, key, exc)
            return None

    def _take_failed(self, from_stage: str, to_stage: str, key: str, exc: ZmqOmniError) -> None:
        """Record a take whose item's shared-memory payload is gone or malformed (the item is gone too)."""
        what = "shared-memory payload of" if isinstance(exc, ShmError | DecodeError) else "get of"
        self._record_failure("get", from_stage, to_stage, key, f"{what} {key!r}: {exc}", exc)

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

    def cleanup(self, request_id: str) -> bool:
        """Drop everything held for the request ``request_id`` (mailbox, retained sends, unfetched payloads).

        The keys dropped are vllm-omni's: ``request_id`` itself, ``request_id_*`` (its chunk keys
        ``{req}_{stage}_{n}``) and ``*_request_id``. On a shared endpoint it drops them for every
        connector of this process bound there (they share one mailbox).

        Push mode: a put of the key ``request_id`` itself arriving within ``tombstone_ttl_s`` is dropped
        at once (a tombstone); later arrivals of the other keys wait for a get as usual (bury a chunk
        stream with :meth:`cleanup_prefix`). A push sender cancels none of its puts still on their way
        (vllm-omni #6670): it releases only its copies of those the receiver holds; the others are
        released once they arrive.
        """
        rid = str(request_id)
        return self._forget(lambda k: key_matches_request(k, rid), key=rid) > 0

    def cleanup_prefix(self, prefix: str) -> int:
        """Drop everything held under ``prefix`` followed by digits (vllm-omni's rule); return how many.

        Push mode: puts under the prefix arriving within ``tombstone_ttl_s`` are dropped at once.
        A push sender cancels none of its puts still on their way, as with :meth:`cleanup`.
        """
        prefix = str(prefix)
        return self._forget(lambda k: key_matches_prefix(k, prefix), prefix=prefix)

    def abandon_get(self, get_key: str) -> None:
        """The caller stopped waiting for ``get_key``: drop it if it is here, and whatever arrives for it later.

        Push mode: the item (now or arriving within ``tombstone_ttl_s``) is dropped and
        acknowledged as consumed, so its sender's window frees. Pull mode keeps nothing
        here: the server's copy expires after its ``pull_ttl_s``.
        """
        key = str(get_key)
        if self._receiver is not None:
            self._receiver.forget(lambda k: k == key, key=key)
            if self._shared is not None and self._shared.expected:
                self._shared.settle_where(lambda k: k == key)

    def _forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        dropped = 0
        # Puts of this process still on their way to our own endpoint are dropped as they arrive: each key
        # gets a tombstone (receiver-side cleanup; puts to other endpoints go on, #6670).
        in_flight: list[str] = []
        if self._shared is not None and self._shared.expected:
            in_flight = self._shared.settle_where(match)
        if self._receiver is None:  # our puts to an endpoint nobody here bound yet, from any of our connectors
            cancel_early(match, [endpoint for _, endpoint in self._endpoints.items()])
        if self._receiver is not None:
            dropped += self._receiver.forget(match, key=key, prefix=prefix)
            for buried in in_flight:
                if buried != key:
                    self._receiver.forget(functools.partial(operator.eq, buried), key=buried)
        if self._server is not None:
            dropped += self._server.forget(match)
        if self._sender is not None:
            # A push sender's copies of delivered puts only serve redelivery: release them. Puts still
            # on their way go on (#6670). None counts: the receiver's cleanup counts what it drops.
            self._sender.forget(match)
        return dropped

    def health(self) -> dict[str, Any]:
        """Status, counters (puts, gets, bytes, errors, timeouts, resends, rejected_frames, ...) and state."""
        # Hot-path counts live under the locks the transport already holds; fold them in here.
        sending = self._sender.stats() if self._sender else self._server.stats() if self._server else None
        receiving = self._receiver.stats() if self._receiver else None
        if sending is not None:
            self._counters.set("puts", sending["puts"])
            self._counters.set("bytes_sent", sending["bytes_sent"])
            if "batches_sent" in sending:
                self._counters.set("batches_sent", sending["batches_sent"])
        if receiving is not None:
            self._counters.set("gets", receiving["gets"])
            self._counters.set("bytes_received", receiving["bytes_received"])
            self._counters.set("batches_received", receiving["batches_received"])
        base = super().health()
        if self._shared is not None:  # what the bound part counted (shared by the connectors bound there)
            for name, value in self._shared.counters.snapshot().items():
                base[name] = base.get(name, 0) + value
        for name in ("resends", "rejected_frames", "duplicates_dropped", "delivery_failures"):
            base.setdefault(name, 0)
        if self._sender is not None:  # what its receivers dropped unconsumed (and acknowledged, freeing the window)
            for name in ("receiver_dropped_unclaimed", "receiver_dropped_cancelled"):
                base.setdefault(name, 0)
        cfg = self.settings
        base.update({"stage_id": self.stage_id, "role": cfg.role, "mode": cfg.mode, "endpoint": self.endpoint})
        base["pending"] = 0 if sending is None else sending["pending"]
        if sending is not None:
            base["pending_bytes"] = sending["pending_bytes"]
            for name in ("undelivered", "peers"):
                if name in sending:
                    base[name] = sending[name]
        if receiving is not None and self._receiver is not None:
            for name in (
                "mailbox",
                "mailbox_oldest_s",
                "tombstones",
                "dropped_unclaimed",
                "dropped_late",
                "dropped_cleanup",
                "tombstones_evicted",
            ):
                base[name] = receiving[name]
            base.setdefault("acks_dropped", 0)  # REPLYs ZeroMQ could not route (their content waits for the next)
            base.setdefault("acks_given_up", 0)  # ...seqs such REPLYs named once 4 in a row to one sender failed
            base["incarnation"] = self._receiver.incarnation
        reasons = self._reasons(sending, receiving)
        if reasons:
            base["reasons"] = reasons
            if base["status"] == "ok":
                base["status"] = "degraded"
        self._shm_health(base)
        return base

    def _reasons(self, sending: dict[str, Any] | None, receiving: dict[str, Any] | None) -> list[str]:
        """Why ``health()`` is degraded now (empty: it is not); see ``docs/zmq-connector.md``.

        A full send window (or pull store), a window nearly full for five heartbeats, items
        unclaimed for half of ``unclaimed_ttl_s``, items dropped unclaimed within
        ``degraded_hold_s``, and a put that failed within ``degraded_hold_s`` with none
        succeeding since.
        """
        cfg, now = self.settings, time.monotonic()
        problems = []
        if sending is not None:
            if sending.get("window_full"):
                problems.append(
                    f"send window full ({sending['pending']} puts, {sending['pending_bytes']} bytes unconsumed; "
                    f"max_unacked={cfg.max_unacked}, max_unacked_bytes={cfg.max_unacked_bytes})"
                )
            elif sending.get("window_high_s", 0.0) >= 5 * cfg.heartbeat_s:
                problems.append(
                    f"send window nearly full for {sending['window_high_s']:.1f}s "
                    f"({sending['pending']} puts, {sending['pending_bytes']} bytes unconsumed)"
                )
        if receiving is not None:
            # Late arrivals under a tombstone are the expected end of a cancelled stream: counted, not degraded.
            dropped = receiving["dropped_unclaimed"]
            if dropped > self._unclaimed_seen:
                self._unclaimed_seen, self._unclaimed_at = dropped, now
            if self._unclaimed_at and now - self._unclaimed_at < cfg.degraded_hold_s:
                problems.append(
                    f"{dropped} items dropped unclaimed after unclaimed_ttl_s={cfg.unclaimed_ttl_s}s "
                    f"(the last {now - self._unclaimed_at:.1f}s ago)"
                )
            if receiving["mailbox_oldest_s"] >= cfg.unclaimed_ttl_s / 2:
                problems.append(
                    f"an item waits unclaimed for {receiving['mailbox_oldest_s']:.1f}s "
                    f"(dropped at unclaimed_ttl_s={cfg.unclaimed_ttl_s}s)"
                )
        failed_at = self._put_failed_at
        if failed_at is not None and now - failed_at < cfg.degraded_hold_s:
            problems.append(f"{self._put_failure} ({now - failed_at:.1f}s ago; no put succeeded since)")
        return problems

    def _shm_health(self, base: dict[str, Any]) -> None:
        """The fast path's state: policy, pool, fallbacks, verdicts; ``degraded`` while large transfers cannot use it.

        Degraded: our pool cannot take large puts, or, with ``shm: on``, a receiver cannot read our shared
        memory (push) or we cannot read a server's (pull).
        """
        base["shm"] = self.settings.shm
        for name in ("shm_puts", "shm_fallbacks", "shm_stale"):
            base.setdefault(name, 0)
        problems = []
        if self._client is not None and self._shm_receive is not None:
            # A pull receiver learns each server's verdict from its first reply.
            servers = self._client.shm_verdicts()
            base["shm_servers"] = servers
            unread = sorted(endpoint for endpoint, readable in servers.items() if not readable)
            if unread and self.settings.shm == "on":
                problems.append(f"we cannot read the shared memory of pull servers {unread}: their replies are frames")
        shm = self._shm_send  # a push sender's pool, or the bound pull server's
        if shm is None and self._shared is not None:
            shm = self._shared.shm_send
        if shm is not None:
            base.update({f"shm_{k}": v for k, v in shm.stats().items()})
            if shm.error is not None:
                problems.append(shm.error)
            if self._shm_degraded:
                problems.append(
                    "large puts fall back to frames: no shared-memory slot (shm_dir full or pool at its limit)"
                )
            if self.settings.shm == "on":
                refused = [stage for stage, p in base.get("peers", {}).items() if p.get("shm") is False]
                if refused:
                    problems.append(f"receivers of stages {refused} cannot read our shared memory")
        if problems:
            base["shm_problems"] = problems
            base.setdefault("reasons", []).extend(problems)
            if base["status"] == "ok":
                base["status"] = "degraded"

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every put so far is safe without this connector.

        Push mode: each put's arrival at its receiver was confirmed (the receiver
        holds it until its ``get``). Pull mode: each payload this connector stored
        was fetched (other connectors' payloads in a shared store do not count).
        Call it before :meth:`close` to shut down without failing puts that are
        still in flight (``close_timeout_s`` makes ``close`` do it).

        Returns:
            True when nothing is left unconfirmed; False after ``timeout_s``
            or once the connector is closed with puts still unconfirmed.

        Raises:
            RuntimeError: driven by an event loop, a ``timeout_s`` above 0 on the loop's own thread
                (or while no loop runs it): ``await AsyncConnector.flush(timeout_s)`` waits there.
        """
        timeout_s = bounded_timeout(timeout_s)
        if timeout_s > 0 and not self._can_wait():
            raise self._refuse_wait("flush", "await AsyncConnector.flush(timeout_s)")
        if self._sender is not None:
            return self._sender.wait_delivered(timeout_s)
        if self._server is not None:
            return self._server.wait_fetched(timeout_s, owner=self)
        return True

    def close(self) -> None:
        """Stop the driver and close every socket, after a linger of ``close_timeout_s``; idempotent.

        See :meth:`close_with_linger`.
        """
        self.close_with_linger(self.settings.close_timeout_s)

    def close_with_linger(self, linger_s: float) -> None:
        """Stop the driver (the I/O thread) and close every socket; idempotent.

        Lingers as ZeroMQ does: waits up to ``linger_s`` (``close()``: ``close_timeout_s``, default 5 s) for
        the puts not yet confirmed (push: arrived, and consumed when in shared
        memory; pull: fetched), and returns as soon as none is left. Each put still
        unconfirmed then is reported three ways: a WARNING log line naming the
        keys, a :class:`~zmq_omni.errors.DeliveryError` in :meth:`drain_failures`,
        and (through the adapters) its request among the failed sends. Beyond that
        wait it returns in well under a second, peer or no peer.

        Driven by an event loop, on the loop's thread (or once no loop runs it) there
        is no linger: the loop would have to do the I/O it waits for. Await
        ``AsyncConnector.aclose()``, which waits for the acknowledgements on the
        loop first. From another thread the close is handed to the loop.
        """
        with self._close_lock:
            if self._loop is None:
                return
            linger = max(0.0, linger_s) if self._can_wait() else 0.0
            if linger > 0:
                self.flush(linger)
            with self._bind_lock:  # no part is built from now on
                self._closed = True
            self._idle.set()
            lost: list[str] = []
            if self._sender is not None:
                lost += self._sender.close()  # fails waiting puts and reports what is unconfirmed
            if self._client is not None:
                self._client.close()  # wakes waiting gets and gives back its sockets
            if self._shared is not None:  # the last connector bound there closes the receiver or server
                lost += self._shared.release(self, (self._notify_watches, self._notify_room))
            if lost:
                shown = ", ".join(repr(key) for key in lost[:10])
                more = f" and {len(lost) - 10} more" if len(lost) > 10 else ""
                log.warning(
                    "stage %s closed with %d put(s) unconfirmed after a linger of %s: %s%s "
                    "(each is in drain_failures())",
                    self.stage_id,
                    len(lost),
                    format_seconds(linger),
                    shown,
                    more,
                )
            self._notify_closed()
            if not self._loop.stop(timeout=1.0):
                log.warning("the driver of stage %s (%r) did not stop within 1s", self.stage_id, self._loop)
            self._loop = None
            for shm in (self._shm_send, self._shm_receive):
                if shm is not None:
                    shm.close()

    def __repr__(self) -> str:
        cfg = getattr(self, "settings", None)
        if cfg is None:
            return "<ZmqConnector (not configured)>"
        return f"<ZmqConnector stage={cfg.stage_id} role={cfg.role} mode={cfg.mode} endpoint={self.endpoint}>"


#: The settings a bound part uses, by mode: connectors sharing an endpoint must agree on these
#: (and on the mode); the rest (send side, timeouts of gets, endpoints of other stages) may differ.
_BOUND_COMMON = ("mode", "hwm", "shm", "shm_dir", "curve_secret_key", "curve_public_key", "curve_allowed_clients")
_BOUND_SETTINGS: dict[str, tuple[str, ...]] = {
    "push": (
        *_BOUND_COMMON,
        "max_message_bytes",
        "max_header_depth",
        "max_header_objects",
        "allow_pickle",
        "decode_device",
        "peer_timeout_s",
        "unclaimed_ttl_s",
        "ack_delay_s",
        "tombstone_ttl_s",
        "max_tombstones",
    ),
    "pull": (
        *_BOUND_COMMON,
        "put_timeout_s",
        "pull_ttl_s",
        "max_unacked",
        "max_unacked_bytes",
        "shm_threshold",
        "shm_pool_max_bytes",
        "shm_min_free_bytes",
        "shm_ttl_s",
    ),
}


def _shm_pool(cfg: ZmqConnectorConfig, loop: Driver) -> ShmSend:
    """A sending shared-memory pool as configured, reaped every second on ``loop``."""
    pool = ShmSend(
        directory=cfg.shm_dir,
        threshold=cfg.shm_threshold,
        max_bytes=cfg.shm_pool_max_bytes,
        min_free_bytes=cfg.shm_min_free_bytes,
        ttl_s=cfg.shm_ttl_s,
    )
    loop.every(1.0, pool.reap)
    return pool


def _announces(metadata: Any, key: str) -> bool:
    """True when ``metadata`` is what one of our push-mode puts of ``key`` returned (or vllm-omni's ``{key: it}``)."""
    if not isinstance(metadata, dict):
        return False
    inner = metadata.get(key)
    if isinstance(inner, dict):
        metadata = inner
    return bool(metadata.get("transport") == _PUSH_METADATA_TAG and metadata.get("key") == key)
