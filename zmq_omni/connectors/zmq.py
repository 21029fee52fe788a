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
of an edge (vllm-omni's orchestrator builds its connectors that way). A threaded
bind at an ``ipc://`` path or a fixed tcp port takes the stage lock first: held by a
live process of the stage, this one becomes that binder's local client (``StageClient``);
a listener there without the lock (a foreign process) makes the bind fail.

What drives the sockets (see :class:`~zmq_omni.transport.Driver`): by default
an I/O thread per connector that sends (a receive-only connector starts none) and
one per bound endpoint, shared by the connectors of the process bound there, beside which put and get threads use
the sockets under the transport's locks. Built with ``driver=LoopDriver``
(``zmq_omni.aio``; what ``AsyncConnector.create`` builds), an asyncio event
loop drives every part of the connector and its sockets are the loop's alone
(see :meth:`ZmqConnector.__init__` for what that means for each call).

The connector holds its parts, one module each, each owning its state (the list is
in ``_zmq_parts``, with the :class:`~zmq_omni.connectors._zmq_parts.Wiring` they
share): ``Bound`` (the bound endpoint, cleanups), ``Sending`` (put), ``Fetching``
(pull-mode fetches), ``Gets`` (every get) and ``HealthReport``. This module builds
them, hands each public call to its part, and closes them.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any, Literal

from ..config import ConnectorExtra
from ..config.zmq import ZmqConnectorConfig
from ..errors import ZmqOmniError, format_seconds
from ..transport import Driver, FetchChannel, IoLoop
from ._shared_endpoint import address_released
from ._zmq_bound import Bound
from ._zmq_gets import Gets
from ._zmq_health import HealthReport
from ._zmq_parts import Wiring, plan_parts
from ._zmq_pull import Fetching
from ._zmq_puts import Sending
from .arrivals import ArrivalWatch
from .base import OmniConnectorBase, bounded_timeout, key_matches_prefix, key_matches_request

__all__ = ["ZmqConnector"]

log = logging.getLogger("zmq_omni.connectors")

Got = tuple[Any, int] | None


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
        self._wiring: Wiring | None = None  # (None: nothing to close)
        self._close_lock = threading.Lock()
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
        #: This connector's sender id (its puts' dedupe stream at each receiver).
        self.sid = uuid.uuid4().hex[:16]
        # What to build now; checked before any socket exists (a refused plaintext endpoint never sends a byte).
        plan = plan_parts(cfg, f"{type(self).__name__}.decode_device")
        loop = driver(f"zmq-omni-{cfg.stage_id}", private_context=plan.own_context)
        wiring = self._wiring = Wiring(
            cfg,
            plan,
            sid=self.sid,
            counters=self._counters,
            driver=loop,
            closed=self._is_closed,
            record_failure=self._record_failure,
            notify_arrivals=self._notify_watches,
            notify_room=self._notify_room,
        )
        self._bound = Bound(wiring, self)
        self._sending = Sending(wiring, self._bound)
        self._fetching = Fetching(wiring)
        self._gets = Gets(wiring, self._bound, self._fetching)
        self._health = HealthReport(
            wiring,
            self._sending,
            self._bound,
            self._fetching,
            stage_id=self.stage_id,
            counted=super().health,
        )
        self._closed = False
        try:
            if plan.bind_stage is not None:
                self._bound.bind(plan.bind_stage)
            if plan.sends:
                self._sending.start()
            if plan.fetches:
                self._fetching.start()
            # A threaded connector that only receives drives no socket of its own (its bound endpoint has its
            # I/O thread): its thread starts with its first part that needs one (a put's sender).
            if not loop.threaded or self._sending.sender is not None:
                loop.start()
        except BaseException:
            self.close()
            raise
        log.info("ZmqConnector stage=%s role=%s mode=%s endpoint=%s", cfg.stage_id, cfg.role, cfg.mode, self.endpoint)

    # -- what it is ---------------------------------------------------------------------------
    @property
    def endpoint(self) -> str | None:
        """Where peers reach this connector's bound endpoint (None until it binds, or never)."""
        bound = getattr(self, "_bound", None)
        return None if bound is None else bound.endpoint

    @property
    def driver(self) -> Driver | None:
        """What drives this connector's sockets (None once closed).

        Its I/O thread (an :class:`~zmq_omni.transport.IoLoop`), or an event loop's ``LoopDriver`` (``zmq_omni.aio``).
        """
        return None if self._wiring is None else self._wiring.driver

    @property
    def pull_receiver(self) -> bool:
        """True when gets fetch from the sender (pull mode): wait for them with a :class:`FetchChannel`."""
        return self.settings.mode == "pull"

    def _is_closed(self) -> bool:
        return self._closed

    # -- put ------------------------------------------------------------------------------------
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
        return self._sending.put(from_stage, to_stage, put_key, data)

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
        return self._sending.try_put(from_stage, to_stage, put_key, data, give_up)

    # -- get ------------------------------------------------------------------------------------
    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None) -> Got:
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
        return self._gets.get(from_stage, to_stage, get_key, metadata)

    def get_with_deadline(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None, *, deadline: float
    ) -> Got:
        """Like :meth:`get`, waiting (on a condition, or a server-side long poll) until ``deadline``.

        Raises:
            RuntimeError: driven by an event loop, a deadline ahead on the loop's own thread (or while
                no loop runs it): ``await AsyncConnector.get(..., timeout=...)`` waits there.
        """
        return self._gets.get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=deadline)

    def get_nowait(self, from_stage: str, to_stage: str, get_key: str) -> Got:
        """``get`` by key that never waits, not even for a put of this key this process has on its way here.

        An addition to the contract: ``get`` waits for such a put (bounded by its window), which
        would hold up a caller that waits otherwise (``AsyncConnector``'s gets wait on their loop
        and look with this). Push mode; in pull mode (a round trip to the sender) it is :meth:`get`.
        """
        return self._gets.get_nowait(from_stage, to_stage, get_key)

    def watch_arrivals(self) -> ArrivalWatch:
        """A watch notified when items reach the push receiver's mailbox, when window room frees, and at close.

        A pull-mode receiver's items never arrive by themselves: wait for them on a
        :class:`FetchChannel` instead (see :meth:`open_fetch_channel`).
        """
        watch = self._register_watch(ArrivalWatch())
        wiring = self._wiring
        if wiring is not None:
            wiring.watched = True
            self._bound.hook_watches()
            self._sending.hook_watches()
        return watch

    def get_wakeup_generation(self) -> int | None:
        """A counter that changes whenever items arrive in the push receiver's mailbox.

        None when this connector has no push receiver (pull mode or a sender): nothing
        arrives by itself there, so callers should wait in ``get_with_deadline``
        (pull mode's server-side long poll) instead of :meth:`wait_for_change`.
        """
        return self._gets.get_wakeup_generation()

    def wait_for_change(self, gen: int, *, timeout: float) -> int:
        """Wait until the wakeup generation differs from ``gen`` (at most ``timeout``); return it then.

        Waits on the mailbox condition (no polling); returns ``gen`` unchanged after
        a timeout or ``close()``. Without a push receiver it waits ``timeout`` (or until closed).

        Raises:
            RuntimeError: driven by an event loop, a wait on the loop's own thread (or while no loop runs it).
        """
        return self._gets.wait_for_change(gen, timeout=timeout)

    # -- pull-mode gets waited for on an event loop (zmq_omni.aio) ---------------------------------
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
        return self._fetching.fetch_route(from_stage, to_stage, key, metadata)

    def open_fetch_channel(self, ctx: Any, endpoint: str, server_key: bytes | None) -> FetchChannel:
        """A :class:`FetchChannel` to ``endpoint`` on the caller's ZeroMQ context (the caller closes it)."""
        return self._fetching.open_fetch_channel(ctx, endpoint, server_key)

    def fetch_done(self, from_stage: str, to_stage: str, key: str, endpoint: str, result: Any) -> Got:
        """A :class:`FetchChannel` result under the get contract: counted, and an error kept as a failure."""
        return self._fetching.fetch_done(from_stage, to_stage, key, endpoint, result)

    # -- cleanups ---------------------------------------------------------------------------------
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

    def _forget(self, match: Callable[[str], bool], *, key: str | None = None, prefix: str | None = None) -> int:
        """A cleanup: the bound part drops and buries (counted); the sender releases its copies (not counted)."""
        dropped = self._bound.forget(match, key=key, prefix=prefix)
        self._sending.forget(match)
        return dropped

    def abandon_get(self, get_key: str) -> None:
        """The caller stopped waiting for ``get_key``: drop it if it is here, and whatever arrives for it later.

        Push mode: the item (now or arriving within ``tombstone_ttl_s``) is dropped and
        acknowledged as consumed, so its sender's window frees; a later ``get`` of the key
        asks for it again (it lifts that tombstone). Pull mode keeps nothing here: the
        server's copy expires after its ``pull_ttl_s``.
        """
        self._bound.abandon(str(get_key))

    # -- health and failures --------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Status, counters (puts, gets, bytes, errors, timeouts, resends, rejected_frames, ...) and state."""
        return self._health.health()

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
        if op == "put" and not self._closed:
            self._sending.note_failure(to_stage, key, reason, error)

    def on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        """The shared endpoint's report of a failure of ours (a pull-mode payload of ours never fetched)."""
        if self._wiring is not None:
            self._wiring.on_failure(op, from_stage, to_stage, key, reason, error)

    # -- flush and close --------------------------------------------------------------------------
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
        wiring = self._wiring
        assert wiring is not None
        timeout_s = bounded_timeout(timeout_s)
        if timeout_s > 0 and not wiring.can_wait():
            raise wiring.refuse_wait("flush", "await AsyncConnector.flush(timeout_s)")
        delivered = self._sending.wait_delivered(timeout_s)
        if delivered is not None:
            return delivered
        if self._bound.server is not None:
            return self._bound.wait_fetched(timeout_s)
        return True

    def close(self) -> None:
        """Stop the driver and close every socket, after a linger of ``close_timeout_s``; idempotent.

        See :meth:`close_with_linger`.
        """
        self.close_with_linger(self.settings.close_timeout_s)

    def close_with_linger(self, linger_s: float, *, address_awaited: bool = False) -> None:
        """Stop the driver (the I/O thread) and close every socket; idempotent.

        Lingers as ZeroMQ does: waits up to ``linger_s`` (``close()``: ``close_timeout_s``, default 5 s) for
        the puts not yet confirmed (push: arrived, and consumed when in shared
        memory; pull: fetched), and returns as soon as none is left. Each put still
        unconfirmed then is reported three ways: a WARNING log line naming the
        keys, a :class:`~zmq_omni.errors.DeliveryError` in :meth:`drain_failures`,
        and (through the adapters) its request among the failed sends. Beyond that
        wait it returns as its I/O threads end, peer or no peer: in well under a second,
        unless something is busy (then at most about 13 s: 1 s for the seal to wait for shm
        items being mapped, ``_CLOSE_WAIT_S`` (10 s) for the endpoint's thread (its last acks
        to a sender reconnecting retried up to 2 s within it), 1 s for the driver, 1 s for
        the listener to go; each logged when late).

        Driven by an event loop, on the loop's thread (or once no loop runs it) there
        is no linger: the loop would have to do the I/O it waits for. Await
        ``AsyncConnector.aclose()``, which waits for the acknowledgements on the
        loop first. From another thread the close is handed to the loop and returns once
        the address is free. On the loop's thread (a wait would stall it) a listener still
        there is logged as a WARNING naming the endpoint, unless ``address_awaited``
        (``aclose()`` awaits it); a bind there by this process waits for it, another's fails.
        """
        with self._close_lock:
            wiring = self._wiring
            driver = None if wiring is None else wiring.driver
            if wiring is None or driver is None:
                return
            linger = max(0.0, linger_s) if wiring.can_wait() else 0.0
            if linger > 0:
                self.flush(linger)
            with wiring.build_lock:  # no part is built from now on
                self._closed = True
            self._gets.close()
            lost = self._sending.close()  # fails waiting puts and reports what is unconfirmed
            self._fetching.close()  # wakes waiting gets and gives back its sockets
            # The last connector bound there closes the receiver or server.
            lost += self._bound.release((wiring.notify_arrivals, wiring.notify_room))
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
            endpoint, on_loop = self.endpoint, driver.in_loop()
            if not driver.stop(timeout=1.0):
                log.warning("the driver of stage %s (%r) did not stop within 1s", self.stage_id, driver)
            wiring.driver = None
            self._sending.close_pool()
            self._fetching.close_reader()
            if endpoint is not None and not driver.threaded:  # (a threaded receiver's close waited)
                address_released(endpoint, on_loop=on_loop, awaited=address_awaited)

    def __repr__(self) -> str:
        cfg = getattr(self, "settings", None)
        if cfg is None:
            return "<ZmqConnector (not configured)>"
        return f"<ZmqConnector stage={cfg.stage_id} role={cfg.role} mode={cfg.mode} endpoint={self.endpoint}>"
