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
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from ..config.zmq import ZmqConnectorConfig
from ..errors import (
    ClosedResourceError,
    ConfigError,
    DeliveryError,
    MessageTooLargeError,
    ShmError,
    TransportError,
    TransportTimeoutError,
    ZmqOmniError,
)
from ..transport import (
    Curve,
    EndpointMap,
    FetchChannel,
    IoLoop,
    LoopReader,
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
from .base import ArrivalWatch, OmniConnectorBase, bounded_deadline, bounded_timeout, key_matches_prefix

__all__ = ["ZmqConnector"]

log = logging.getLogger("zmq_omni.connectors")

_MAX_FRAMES = 65536
#: Longest a lazy bind waits for the I/O thread (it only creates and binds one socket).
_BIND_WAIT_S = 10.0
#: Marks the metadata of our push-mode puts: a ``get`` handed it waits for that put to arrive.
_PUSH_METADATA_TAG = "zmq_omni.push"


class ZmqConnector(OmniConnectorBase):
    """Put/get between stages over ZeroMQ with confirmed delivery (see the module docstring).

    Args:
        config: the ``extra`` dict; see :class:`~zmq_omni.config.zmq.ZmqConnectorConfig`.

    Raises:
        ConfigError: a bad, unknown or missing key, or no endpoint for a stage that must bind.
        TransportError: the bind failed (the message names the endpoint).

    Without CURVE, binding or connecting to TCP other than loopback is refused
    (``ConfigError``) unless ``insecure`` or ``ZMQ_OMNI_INSECURE=1`` opts out.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self._closed = True  # until fully built: close() must be safe after a failed __init__
        self._loop: IoLoop | None = None
        self._sender: PushSender | None = None
        self._receiver: PushReceiver | None = None
        self._server: PullServer | None = None
        self._client: PullClient | None = None
        self._shm_send: ShmSend | None = None
        self._shm_receive: ShmReceive | None = None
        self._shm_degraded = False
        self._close_lock = threading.Lock()
        self._bind_lock = threading.Lock()  # one lazy bind at a time (the receive and save threads race to it)
        self._idle = threading.Event()  # set by close(): ends wait_for_change without a receiver
        # health(): when a put last failed (None: one succeeded since), and the receiver's drops last seen.
        self._put_failed_at: float | None = None
        self._put_failure = ""
        self._unclaimed_seen = 0
        self._unclaimed_at = 0.0
        cfg = ZmqConnectorConfig.from_dict(config)
        self.config = cfg
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
        # receives never takes the endpoint.
        sends = cfg.role != "receiver"
        receives = cfg.role != "sender"
        bind_stage = self._bind_stage(None)
        binds_now = cfg.role in ("dual", "receiver" if cfg.mode == "push" else "sender") and bind_stage is not None
        fast_path = cfg.shm != "off"
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
        loop = self._loop = IoLoop(f"zmq-omni-{cfg.stage_id}", private_context=own_context)
        self._closed = False
        try:
            if fast_path and receives:
                self._shm_receive = ShmReceive(directory=cfg.shm_dir)
            if fast_path and sends:
                shm_send = self._shm_send = ShmSend(
                    directory=cfg.shm_dir,
                    threshold=cfg.shm_threshold,
                    max_bytes=cfg.shm_pool_max_bytes,
                    min_free_bytes=cfg.shm_min_free_bytes,
                    ttl_s=cfg.shm_ttl_s,
                )
                loop.every(1.0, shm_send.reap)
            if binds_now:
                assert bind_stage is not None
                self._bind(bind_stage)
            if cfg.mode == "push" and sends:
                self._sender = PushSender(
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
            if cfg.mode == "pull" and receives:
                self._client = PullClient(
                    loop.ctx,
                    hwm=cfg.hwm,
                    max_message_bytes=cfg.max_message_bytes,
                    decode=self._decode,
                    counters=self._counters,
                    curve=self._curve,
                    shm=self._shm_receive,
                )
            loop.start()
        except BaseException:
            self.close()
            raise
        log.info("ZmqConnector stage=%s role=%s mode=%s endpoint=%s", cfg.stage_id, cfg.role, cfg.mode, self.endpoint)

    # -- binding ----------------------------------------------------------------------
    def _bind_stage(self, call_stage: str | None) -> str | None:
        """The stage whose endpoint this connector binds: its own id, else the injected edge end, else the call's."""
        cfg = self.config
        if cfg.stage_id is not None:
            return cfg.stage_id
        own = cfg.to_stage if cfg.mode == "push" else cfg.from_stage
        return own if own is not None else call_stage

    def _bind(self, stage: str) -> None:
        """Bind ``stage``'s endpoint: the push receiver or the pull server (constructor, or under ``_bind_lock``).

        Once the I/O thread runs, the part is built on it (it owns the poller).

        Raises:
            ConfigError: no endpoint is configured for ``stage``.
            TransportError: the bind failed, or a live process listens on that ipc path (the endpoint is named).
        """
        cfg, loop = self.config, self._loop
        if loop is None:
            raise ClosedResourceError("connector closed")
        advertised = self._endpoints.get(stage)
        bind_at = self._endpoints.env_bind or cfg.bind or advertised
        if bind_at is None:
            raise ConfigError(f"stage {stage!r} must bind: set config key 'endpoints.{stage}' or 'bind'")
        # A lazy bind (no role given) is checked here; a bind at construction was checked before any socket.
        require_curve([("bind", bind_at)], curve=self._curve is not None, insecure=self._insecure)
        if self._curve is not None:
            auth = self._curve.start_authenticator(loop.ctx)
            if auth is not None:
                loop.on_term(auth.stop)
        if cfg.mode == "push":

            def build() -> PushReceiver | PullServer:
                return PushReceiver(
                    loop,
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
                    counters=self._counters,
                    unclaimed_ttl_s=cfg.unclaimed_ttl_s,
                    ack_delay_s=cfg.ack_delay_s,
                    tombstone_ttl_s=cfg.tombstone_ttl_s,
                    max_tombstones=cfg.max_tombstones,
                    health=self.health,
                    curve=self._curve,
                    shm=self._shm_receive,
                )

        else:
            fixed = advertised if advertised and not advertised.endswith((":0", ":*")) else None

            def build() -> PushReceiver | PullServer:
                return PullServer(
                    loop,
                    bind_at,
                    fixed,
                    put_timeout_s=cfg.put_timeout_s,
                    ttl_s=cfg.pull_ttl_s,
                    max_unacked=cfg.max_unacked,
                    max_unacked_bytes=cfg.max_unacked_bytes,
                    hwm=cfg.hwm,
                    max_frames=_MAX_FRAMES,
                    counters=self._counters,
                    on_failure=self._on_failure,
                    health=self.health,
                    curve=self._curve,
                    shm=self._shm_send,
                )

        part = self._on_loop(build) if loop.started else build()
        if isinstance(part, PushReceiver):
            self._receiver = part
        else:
            self._server = part
        self.endpoint = part.endpoint
        if self._watches:  # a watch taken before this lazy bind hears the new part too
            self._hook_watches()
        log.info("ZmqConnector stage=%s bound %s", stage, self.endpoint)

    def _on_loop(self, build: Callable[[], PushReceiver | PullServer]) -> PushReceiver | PullServer:
        """Run ``build`` on the I/O thread and return its result (or raise its error)."""
        assert self._loop is not None
        done = threading.Event()
        result: list[PushReceiver | PullServer | BaseException] = []

        def run() -> None:
            try:
                result.append(build())
            except BaseException as exc:
                result.append(exc)
            finally:
                done.set()

        self._loop.call_soon(run)
        if not done.wait(_BIND_WAIT_S) or not result:
            raise TransportTimeoutError(f"the I/O thread did not bind within {_BIND_WAIT_S}s")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _ensure_bound(self, call_stage: str) -> None:
        """Bind now, for a connector that binds lazily (no role, or no stage to bind at construction)."""
        with self._bind_lock:
            if self._receiver is not None or self._server is not None or self._closed:
                return
            stage = self._bind_stage(call_stage)
            assert stage is not None
            self._bind(stage)

    # -- helpers ------------------------------------------------------------------

    def _on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
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

        A pull-mode connector without a role binds its server at its first put.

        Raises:
            EncodeError: ``data`` holds an unsupported type (a programming error).
            ValueError: this connector's role cannot put.
            TransportError: a first put had to bind and the bind failed (the endpoint is named).
        """
        got = self._put(from_stage, to_stage, put_key, data, True)
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
        try:
            return self._put(from_stage, to_stage, put_key, data, False)
        except WouldBlock:
            if not give_up:
                return None
            reason = "no room in the send window or ZeroMQ's queue within the caller's timeout"
            return self._fail_put(str(from_stage), str(to_stage), str(put_key), TransportTimeoutError(reason))

    def _put(
        self, from_stage: str, to_stage: str, key: str, data: Any, block: bool
    ) -> tuple[bool, int, dict[str, Any] | None] | None:
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if self._closed:
            return self._fail_put(from_stage, to_stage, key, ClosedResourceError("connector closed"))
        sender = self._sender
        if sender is None and self._server is None:
            if self.config.role == "receiver" or self.config.mode == "push":
                raise ValueError(f"a {self.config.role!r} ZmqConnector in {self.config.mode} mode cannot put")
            self._ensure_bound(from_stage)
        cfg = self.config
        frames = encode(data, inline_threshold=cfg.inline_threshold, allow_pickle=cfg.allow_pickle)
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
                try:
                    sender.send(from_stage, to_stage, key, frames, nbytes, loc, block=block)
                except BaseException:
                    if loc is not None and shm is not None:
                        shm.discard(loc)
                    raise
                metadata: dict[str, Any] = {"key": key, "size": nbytes, "transport": _PUSH_METADATA_TAG}
            else:
                assert self._server is not None
                metadata = self._server.store(from_stage, to_stage, key, frames, nbytes, block=block)
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
        wait_s = self.config.put_timeout_s if self.config.shm == "on" and block else 0.0
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

    def loop_reader(self) -> LoopReader | None:
        """A reader of the push receiver's socket for the calling event loop (``zmq_omni.aio``); the caller closes it.

        None in pull mode (items come back on fetch channels) and before the receiver is bound.
        """
        receiver = self._receiver
        if receiver is None or self._closed:
            return None
        return LoopReader(receiver, self._take_queued)

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

        Connectors nobody watches keep their hot paths as they were.
        """
        if self._receiver is not None:
            self._receiver.on_arrivals = self._notify_watches
            self._receiver.watch_soon()  # arrivals reach the watches without waiting for a get
        for part in (self._sender, self._server):
            if part is not None:
                part.on_window_change(self._notify_room)

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
        """
        timeout = bounded_timeout(timeout)
        receiver = self._receiver
        if receiver is not None:
            return receiver.wait_for_change(gen, timeout)
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
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if metadata is not None and self._receiver_or_bind(to_stage) and _announces(metadata, key):
            deadline = time.monotonic() + self.config.metadata_get_timeout_s
            got = self._get(from_stage, to_stage, key, metadata, deadline)
            if got is None and not self._closed:
                self._record_failure(
                    "get",
                    from_stage,
                    to_stage,
                    key,
                    f"the put of {key!r} its metadata announced did not arrive within "
                    f"metadata_get_timeout_s={self.config.metadata_get_timeout_s}s",
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
        """Like :meth:`get`, waiting (on a condition, or a server-side long poll) until ``deadline``."""
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        return self._get(from_stage, to_stage, key, metadata, bounded_deadline(deadline))

    def _receiver_or_bind(self, to_stage: str) -> bool:
        """True when gets go to a push receiver, binding it first for a connector that binds lazily."""
        if self._receiver is None and self.config.mode == "push" and self.config.role != "sender" and not self._closed:
            self._ensure_bound(to_stage)
        return self._receiver is not None

    def _get(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None, deadline: float | None
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        if self._receiver is None and self._client is None:
            self._receiver_or_bind(to_stage)
        if self._receiver is not None:  # push-mode gets are counted by the mailbox
            return self._take(from_stage, to_stage, key, deadline)
        if self._client is None:
            raise ValueError(f"a {self.config.role!r} ZmqConnector in {self.config.mode} mode cannot get")
        got = self._fetch(from_stage, to_stage, key, metadata, deadline)
        if got is not None:
            self._counters.add("gets")
            self._counters.add("bytes_received", got[1])
        return got

    def _take(self, from_stage: str, to_stage: str, key: str, deadline: float | None) -> tuple[Any, int] | None:
        """A push-mode get from the receiver's mailbox (waiting until ``deadline``, if given); failures recorded."""
        receiver = self._receiver
        assert receiver is not None
        try:
            if deadline is None:
                return receiver.take(from_stage, to_stage, key)
            return receiver.take_by(from_stage, to_stage, key, deadline)
        except ZmqOmniError as exc:
            self._take_failed(from_stage, to_stage, key, exc)
            return None

    def _take_queued(self, from_stage: str, to_stage: str, key: str) -> tuple[Any, int] | None:
        """What a :class:`LoopReader` takes: the mailbox alone (the loop reads the socket itself)."""
        receiver = self._receiver
        if self._closed or receiver is None:
            return None
        try:
            return receiver.take(from_stage, to_stage, key, look=False)
        except ZmqOmniError as exc:
            self._take_failed(from_stage, to_stage, key, exc)
            return None

    def _take_failed(self, from_stage: str, to_stage: str, key: str, exc: ZmqOmniError) -> None:
        """Record a take whose item's shared-memory payload is gone or malformed (the item is gone too)."""
        self._record_failure("get", from_stage, to_stage, key, f"shared-memory payload of {key!r}: {exc}", exc)

    def _fetch(
        self, from_stage: str, to_stage: str, key: str, metadata: dict[str, Any] | None, deadline: float | None
    ) -> tuple[Any, int] | None:
        assert self._client is not None
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
        now = time.monotonic()
        if deadline is None:
            wait_s, reply_by = 0.0, now + self.config.fetch_timeout_s
        else:
            # The server answers "not found" a little before the deadline, so the reply is in by then.
            wait_s = max(0.0, (deadline - now) * 0.8)
            reply_by = deadline
        server_key = None if self._curve is None else self._curve.server_key_for(from_stage)
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
        return self._client is not None

    def fetch_route(self, from_stage: str, key: str, metadata: dict[str, Any] | None) -> tuple[str, bytes | None]:
        """Where a pull-mode get fetches from: ``(endpoint, server_key)`` (the metadata's endpoint wins).

        Raises:
            ValueError: this connector does not get in pull mode.
            ConfigError: no endpoint is known for ``from_stage``.
        """
        if self._client is None:
            raise ValueError(f"a {self.config.role!r} ZmqConnector in {self.config.mode} mode does not fetch")
        from_stage, key = str(from_stage), str(key)
        if isinstance(metadata, dict) and key in metadata and isinstance(metadata[key], dict):
            metadata = metadata[key]  # vllm-omni's {key: meta} wrapper
        endpoint = metadata.get("endpoint") if isinstance(metadata, dict) else None
        if not isinstance(endpoint, str):
            endpoint = self._endpoints.require(from_stage)
        return endpoint, None if self._curve is None else self._curve.server_key_for(from_stage)

    def open_fetch_channel(self, ctx: Any, endpoint: str, server_key: bytes | None) -> FetchChannel:
        """A :class:`FetchChannel` to ``endpoint`` on the caller's ZeroMQ context (the caller closes it)."""
        if self._client is None:
            raise ValueError(f"a {self.config.role!r} ZmqConnector in {self.config.mode} mode does not fetch")
        return self._client.open_channel(ctx, endpoint, server_key)

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
        """Drop everything held for the key ``request_id`` (mailbox, retained sends, unfetched payloads).

        Push mode: a put of that key arriving within ``tombstone_ttl_s`` is dropped at once (a tombstone).
        A push sender cancels none of its puts still on their way (vllm-omni #6670): it releases only
        its copies of those the receiver holds; the others are released once they arrive.
        """
        key = str(request_id)
        return self._forget(lambda k: k == key, key=key) > 0

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

    def _forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        dropped = 0
        if self._receiver is not None:
            dropped += self._receiver.forget(match, key=key, prefix=prefix)
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
        for name in ("resends", "rejected_frames", "duplicates_dropped", "delivery_failures"):
            base.setdefault(name, 0)
        if self._sender is not None:  # what its receivers dropped unconsumed (and acknowledged, freeing the window)
            for name in ("receiver_dropped_unclaimed", "receiver_dropped_cancelled"):
                base.setdefault(name, 0)
        base.update(
            {"stage_id": self.stage_id, "role": self.config.role, "mode": self.config.mode, "endpoint": self.endpoint}
        )
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
        cfg, now = self.config, time.monotonic()
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
        base["shm"] = self.config.shm
        for name in ("shm_puts", "shm_fallbacks", "shm_stale"):
            base.setdefault(name, 0)
        problems = []
        if self._client is not None and self._shm_receive is not None:
            # A pull receiver learns each server's verdict from its first reply.
            servers = self._client.shm_verdicts()
            base["shm_servers"] = servers
            unread = sorted(endpoint for endpoint, readable in servers.items() if not readable)
            if unread and self.config.shm == "on":
                problems.append(f"we cannot read the shared memory of pull servers {unread}: their replies are frames")
        shm = self._shm_send
        if shm is not None:
            base.update({f"shm_{k}": v for k, v in shm.stats().items()})
            if shm.error is not None:
                problems.append(shm.error)
            if self._shm_degraded:
                problems.append(
                    "large puts fall back to frames: no shared-memory slot (shm_dir full or pool at its limit)"
                )
            if self.config.shm == "on":
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
        holds it until its ``get``). Pull mode: each stored payload was fetched.
        Call it before :meth:`close` to shut down without failing puts that are
        still in flight (``close_timeout_s`` makes ``close`` do it).

        Returns:
            True when nothing is left unconfirmed; False after ``timeout_s``
            or once the connector is closed with puts still unconfirmed.
        """
        timeout_s = bounded_timeout(timeout_s)
        if self._sender is not None:
            return self._sender.wait_delivered(timeout_s)
        if self._server is not None:
            return self._server.wait_fetched(timeout_s)
        return True

    def close(self) -> None:
        """Stop the I/O thread and close every socket; idempotent.

        Waits up to ``close_timeout_s`` (default 0) for unconfirmed puts, then
        reports each one still unconfirmed through :meth:`drain_failures` as a
        :class:`~zmq_omni.errors.DeliveryError`. Beyond that wait it returns in
        well under a second, peer or no peer.
        """
        with self._close_lock:
            if self._loop is None:
                return
            if self.config.close_timeout_s > 0:
                self.flush(self.config.close_timeout_s)
            self._closed = True
            self._idle.set()
            for part in (self._sender, self._receiver, self._server, self._client):
                if part is not None:
                    part.close()  # wakes waiting puts/gets; the client also gives back its sockets
            self._notify_closed()
            if not self._loop.stop(timeout=1.0):
                log.warning("I/O thread of stage %s did not stop within 1s", self.stage_id)
            self._loop = None
            for shm in (self._shm_send, self._shm_receive):
                if shm is not None:
                    shm.close()

    def __repr__(self) -> str:
        cfg = getattr(self, "config", None)
        if cfg is None:
            return "<ZmqConnector (not configured)>"
        return f"<ZmqConnector stage={cfg.stage_id} role={cfg.role} mode={cfg.mode} endpoint={self.endpoint}>"


def _announces(metadata: Any, key: str) -> bool:
    """True when ``metadata`` is what one of our push-mode puts of ``key`` returned (or vllm-omni's ``{key: it}``)."""
    if not isinstance(metadata, dict):
        return False
    inner = metadata.get(key)
    if isinstance(inner, dict):
        metadata = inner
    return bool(metadata.get("transport") == _PUSH_METADATA_TAG and metadata.get("key") == key)
