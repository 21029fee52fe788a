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

The class is assembled from layers, one module each: ``_zmq_parts`` (what it is
made of, lazy binds, who may use the sockets), ``_zmq_bind`` (the bound part),
``_zmq_puts`` (put), ``_zmq_gets`` and ``_zmq_pull`` (get, push and pull mode),
``_zmq_health`` (``health()``); this module builds it, cleans up and closes it.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import uuid
from collections.abc import Callable
from typing import Any

from ..config import ConnectorExtra
from ..config.zmq import ZmqConnectorConfig
from ..errors import format_seconds
from ..transport import (
    Curve,
    Driver,
    EndpointMap,
    IoLoop,
    PushReceiver,
    insecure_from_env,
    require_curve,
    tune_malloc,
)
from ..wire import DecodeLimits, decode, resolve_device
from ._expected_puts import BoundEndpoint, cancel_early
from ._zmq_bind import MAX_FRAMES
from ._zmq_gets import ZmqGets
from ._zmq_health import ZmqHealth
from ._zmq_puts import ZmqSending
from .base import bounded_timeout, key_matches_prefix, key_matches_request

__all__ = ["ZmqConnector"]

log = logging.getLogger("zmq_omni.connectors")


class ZmqConnector(ZmqSending, ZmqGets, ZmqHealth):
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
        self._loop = None
        self._sender = None
        self._receiver = None
        self._server = None
        self._client = None
        self._shm_send = None
        self._shm_receive = None
        self._shm_degraded = False
        self._shared = None  # the bound part's endpoint, held with the other connectors on it
        # Push puts made before this connector bound the endpoint they go to (it binds at its first get):
        # slot -> until when a get may wait for it; handed to the endpoint when bound (under _bind_lock).
        self._close_lock = threading.Lock()
        self._bind_lock = threading.Lock()  # one lazy bind at a time (the receive and save threads race to it)
        self._idle = threading.Event()  # set by close(): ends wait_for_change without a receiver
        # health(): when a put last failed (None: one succeeded since), and the receiver's drops last seen.
        self._put_failed_at = None
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
        self.stage_id = config.get("stage_id")
        if self.stage_id is None:
            self.stage_id = config.get({"receiver": "to_stage", "sender": "from_stage"}.get(cfg.role or "", ""))
        self._endpoints = EndpointMap(cfg.endpoints)
        self._curve = Curve.from_config(
            cfg.curve_secret_key, cfg.curve_public_key, cfg.curve_server_key, cfg.curve_allowed_clients
        )
        self.sid = uuid.uuid4().hex[:16]
        self._limits = DecodeLimits(
            max_header_bytes=min(cfg.max_message_bytes, 64 << 20),
            max_frames=MAX_FRAMES,
            max_total_bytes=cfg.max_message_bytes,
            max_depth=cfg.max_header_depth,
            max_objects=cfg.max_header_objects,
        )
        self._device = device = resolve_device(cfg.decode_device, f"{type(self).__name__}.decode_device")
        # One call per received message (a partial saves a Python frame on the receive hot path).
        self._decode = functools.partial(decode, allow_pickle=cfg.allow_pickle, limits=self._limits, device=device)
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
        self.endpoint = None
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
                self._meet_receivers()
            if cfg.mode == "pull" and receives:
                self._client = self._build_client()
            # A threaded connector that only receives drives no socket of its own (its bound endpoint has its
            # I/O thread): its thread starts with its first part that needs one (a put's sender).
            if not loop.threaded or self._sender is not None:
                loop.start()
        except BaseException:
            self.close()
            raise
        log.info("ZmqConnector stage=%s role=%s mode=%s endpoint=%s", cfg.stage_id, cfg.role, cfg.mode, self.endpoint)

    def cleanup(self, request_id: str) -> bool:
        """Drop everything held for the request ``request_id`` (mailbox, retained sends, unfetched payloads).

        The keys dropped are vllm-omni's: ``request_id`` itself, ``request_id_*`` (its chunk keys
        ``{req}_{stage}_{n}``) and ``*_request_id``. On a shared endpoint it drops them for every
        connector of this process bound there (they share one mailbox).

        Push mode: a put of the key ``request_id`` itself arriving within ``tombstone_ttl_s`` is dropped
        at once (a tombstone, which no ``get`` lifts); later arrivals of the other keys wait for a get as
        usual (bury a chunk stream with :meth:`cleanup_prefix`). A connector that has not bound its
        endpoint yet (it binds at its first ``get``) keeps the cleanup and buries it when it binds.
        A push sender cancels none of its puts still on their way (vllm-omni #6670): it releases only
        its copies of those the receiver holds; the others are released once they arrive.
        """
        rid = str(request_id)
        return self._forget(lambda k: key_matches_request(k, rid), key=rid) > 0

    def cleanup_prefix(self, prefix: str) -> int:
        """Drop everything held under ``prefix`` followed by digits (vllm-omni's rule); return how many.

        Push mode: puts under the prefix arriving within ``tombstone_ttl_s`` are dropped at once,
        whatever gets ask meanwhile, as with :meth:`cleanup` (before the bind too).
        A push sender cancels none of its puts still on their way, as with :meth:`cleanup`.
        """
        prefix = str(prefix)
        return self._forget(lambda k: key_matches_prefix(k, prefix), prefix=prefix)

    def abandon_get(self, get_key: str) -> None:
        """The caller stopped waiting for ``get_key``: drop it if it is here, and whatever arrives for it later.

        Push mode: the item (now or arriving within ``tombstone_ttl_s``) is dropped and
        acknowledged as consumed, so its sender's window frees; a later ``get`` of the key
        asks for it again (it lifts that tombstone). Pull mode keeps nothing here: the
        server's copy expires after its ``pull_ttl_s``.
        """
        key = str(get_key)
        if self._receiver is not None:
            self._receiver.forget(lambda k: k == key, key=key)
            if self._shared is not None and self._shared.expected.slots:
                self._shared.expected.settle_where(lambda k: k == key)

    def _forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        """A cleanup: drop what matches everywhere we hold it, and bury ``key`` / ``prefix`` firmly."""
        dropped = 0
        bound: list[BoundEndpoint] = [] if self._shared is None or self._receiver is None else [self._shared]
        if self._receiver is None and self.settings.mode == "push":
            # Not bound (yet): kept for whichever of our connectors binds the endpoint we would bind (any
            # of ours while the stage is up to the first get's call), or applied at once where one has.
            # Never another stage's endpoint: a sender's cleanup cancels none of its puts (#6670).
            stage = self._bind_stage(None)
            endpoint = None if stage is None else self._endpoints.get(stage)
            endpoints = [e for _, e in self._endpoints.items()] if stage is None else [endpoint] if endpoint else []
            ttl_s = self.settings.tombstone_ttl_s
            bound = cancel_early(match, endpoints, key=key, prefix=prefix, ttl_s=ttl_s)
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
        if self._server is not None:
            dropped += self._server.forget(match, key=key, prefix=prefix)
        if self._sender is not None:
            # A push sender's copies of delivered puts only serve redelivery: release them. Puts still
            # on their way go on (#6670). None counts: the receiver's cleanup counts what it drops.
            self._sender.forget(match)
        return dropped

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
        wait it returns as its I/O threads end, peer or no peer: in well under a second,
        unless a handler there is busy (then at most about 11 s: ``_CLOSE_WAIT_S`` for the
        endpoint's thread, 1 s for the driver, each logged when it stops late).

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
