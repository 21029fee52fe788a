"""Binding a :class:`~zmq_omni.connectors.zmq.ZmqConnector`'s endpoint: the bound part and its settings.

The bound part (a push receiver or a pull server) lives in a :class:`SharedEndpoint`
held by every connector of this process bound at that address; the connectors on
it must agree on the settings in :data:`BOUND_SETTINGS`. Plain functions: the
connector's parts (``Bound`` in ``_zmq_bound``, ``Sending``'s pool) hand them what they use.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any

from ..config.zmq import ZmqConnectorConfig
from ..errors import ConfigError
from ..shm import sweep_dead_once
from ..transport import (
    Curve,
    Driver,
    IoLoop,
    PullServer,
    PushReceiver,
    ShmReceive,
    ShmSend,
    StageClient,
    StageLock,
    StagePull,
    StageService,
)
from ..wire import DecodeLimits, decode_each, encode
from ._shared_endpoint import SharedEndpoint

#: Most frames one message may have (a receiver refuses more; its decode limits say the same).
MAX_FRAMES = 65536

#: The settings a bound part uses, by mode: connectors sharing an endpoint must agree on these
#: (and on the mode); the rest (send side, timeouts of gets, endpoints of other stages) may differ.
_BOUND_COMMON = ("mode", "hwm", "shm", "shm_dir", "curve_secret_key", "curve_public_key", "curve_allowed_clients")
BOUND_SETTINGS: dict[str, tuple[str, ...]] = {
    "push": (
        *_BOUND_COMMON,
        "max_message_bytes",
        "max_key_bytes",
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


def shm_pool(cfg: ZmqConnectorConfig, loop: Driver) -> ShmSend:
    """A sending shared-memory pool as configured, reaped every second on ``loop``.

    The first pool of this process in ``shm_dir`` sweeps the leftovers of dead processes there first.
    """
    sweep_dead_once(cfg.shm_dir)
    pool = ShmSend(
        directory=cfg.shm_dir,
        threshold=cfg.shm_threshold,
        max_bytes=cfg.shm_pool_max_bytes,
        min_free_bytes=cfg.shm_min_free_bytes,
        ttl_s=cfg.shm_ttl_s,
    )
    loop.every(1.0, pool.reap)
    return pool


def stage_shareable(address: str) -> bool:
    """Whether the processes of a stage can share ``address`` (a fixed ipc path or tcp port, not ``:0`` / ``*``)."""
    return address.startswith("ipc://") or (address.startswith("tcp://") and not address.endswith((":0", ":*")))


def open_endpoint(
    cfg: ZmqConnectorConfig,
    stage: str,
    bind_at: str,
    advertised: str | None,
    agreed: Any,
    *,
    driver: Driver,
    curve: Curve | None,
    decode: Callable[[list[Any]], Any],
    limits: DecodeLimits,
    device: Any,
) -> SharedEndpoint:
    """Bind a new :class:`SharedEndpoint` for ``stage`` at ``bind_at``, driven by its own I/O thread (started).

    A connector driven by an event loop (``driver`` is not threaded) binds one on its own driver
    instead, that no other connector of the process shares; at a stage endpoint it takes the stage
    lock and serves the stage's other processes as any binder does, and is refused (ConfigError)
    where another process holds the lock (a local client waits on its own thread). ``cfg``,
    ``curve``, ``decode``, ``limits`` and ``device`` are the binding connector's; ``agreed`` the
    settings its sharers must agree on.
    """
    threaded = driver.threaded
    # A CURVE allow-list installs a ZAP authenticator, which answers for its whole context: its own then.
    own_context = curve is not None and curve.allowed_clients is not None
    loop = IoLoop(f"zmq-omni-bound-{stage}", private_context=own_context) if threaded else driver
    fast_path = cfg.shm != "off"
    shm_receive: ShmReceive | None = None
    shm_send: ShmSend | None = None
    lock: StageLock | None = None
    try:
        if fast_path and cfg.mode == "push":
            shm_receive = ShmReceive(directory=cfg.shm_dir)
        if fast_path and cfg.mode == "pull":
            shm_send = shm_pool(cfg, loop)
            if threaded and stage_shareable(bind_at):  # opens the handles of the stage's other processes
                shm_receive = ShmReceive(directory=cfg.shm_dir)
        if curve is not None:
            auth = curve.start_authenticator(loop.ctx)
            if auth is not None:
                loop.on_term(auth.stop)
        shared = SharedEndpoint(
            bind_at, agreed, loop, shm_receive=shm_receive, shm_send=shm_send, exclusive=not threaded
        )
        # The stage endpoint is shared by the stage's processes on this host: the holder of its stage lock
        # binds it and serves the others, which become its local clients (transport/_stage_lock.py).
        lock = StageLock(bind_at) if stage_shareable(bind_at) else None
        if lock is not None and not threaded and not lock.try_acquire():
            # A local client waits for its binder on its own thread: an event loop's connector cannot be one.
            raise ConfigError(
                f"cannot bind {bind_at}: another process of this stage binds it (it holds {lock.paths.lock}), "
                "and a ZmqConnector driven by an event loop cannot be a local client of it; build the "
                "stage's connectors threaded (AsyncConnector(ZmqConnector(extra)) awaits a threaded one)"
            )

        def bind_here(held: StageLock | None, lend_after_s: float = 0.0) -> PushReceiver:
            receiver = PushReceiver(
                loop,
                bind_at,
                incarnation=uuid.uuid4().hex[:16],
                decode=decode,
                decode_each=functools.partial(decode_each, allow_pickle=cfg.allow_pickle, limits=limits, device=device),
                hwm=cfg.hwm,
                max_message_bytes=cfg.max_message_bytes,
                max_frames=MAX_FRAMES,
                max_key_bytes=cfg.max_key_bytes,
                source_ttl_s=max(60.0, 20 * cfg.peer_timeout_s),
                counters=shared.counters,
                unclaimed_ttl_s=cfg.unclaimed_ttl_s,
                ack_delay_s=cfg.ack_delay_s,
                tombstone_ttl_s=cfg.tombstone_ttl_s,
                max_tombstones=cfg.max_tombstones,
                health=shared.health,
                curve=curve,
                shm=shm_receive,
            )
            if held is not None:
                StageService(
                    loop,
                    receiver.mailbox,
                    held.paths.service,
                    encode=functools.partial(
                        encode, inline_threshold=cfg.inline_threshold, allow_pickle=cfg.allow_pickle
                    ),
                    peer_timeout_s=cfg.peer_timeout_s,
                    lend_after_s=lend_after_s,
                )
                loop.on_term(held.release)
            return receiver

        if cfg.mode == "pull":
            fixed = advertised if advertised and not advertised.endswith((":0", ":*")) else None
            serve = functools.partial(
                PullServer,
                loop,
                bind_at,
                fixed,
                put_timeout_s=cfg.put_timeout_s,
                ttl_s=cfg.pull_ttl_s,
                max_unacked=cfg.max_unacked,
                max_unacked_bytes=cfg.max_unacked_bytes,
                hwm=cfg.hwm,
                max_frames=MAX_FRAMES,
                max_key_bytes=cfg.max_key_bytes,
                counters=shared.counters,
                on_failure=shared.on_owned_failure,
                health=shared.health,
                curve=curve,
                shm=shm_send,
            )
            # The stage's processes on this host share the pull endpoint as they share push's (_stage_pull.py).
            shared.part = (
                serve()
                if lock is None
                else StagePull(
                    loop,
                    fixed or bind_at,
                    lock=lock,
                    build_server=serve,
                    counters=shared.counters,
                    on_failure=shared.on_owned_failure,
                    put_timeout_s=cfg.put_timeout_s,
                    heartbeat_s=cfg.heartbeat_s,
                    shm=shm_send,
                    reader=shm_receive,
                )
            )
        elif lock is not None and not lock.try_acquire():
            shared.part = StageClient(
                loop,
                advertised or bind_at,
                lock.paths.service,
                decode=decode,
                counters=shared.counters,
                heartbeat_s=cfg.heartbeat_s,
                peer_timeout_s=cfg.peer_timeout_s,
                ack_delay_s=cfg.ack_delay_s,
                unclaimed_ttl_s=cfg.unclaimed_ttl_s,
                tombstone_ttl_s=cfg.tombstone_ttl_s,
                max_tombstones=cfg.max_tombstones,
                shm=shm_receive,
                lock=lock,
                become_binder=bind_here,
            )
        else:
            shared.part = bind_here(lock)
        if threaded:
            loop.start()
    except BaseException:
        if threaded:
            loop.stop(timeout=1.0)
        if lock is not None:
            lock.release()
        for shm in (shm_send, shm_receive):
            if shm is not None:
                shm.close()
        raise
    return shared
