"""Configuration of :class:`~zmq_omni.connectors.zmq.ZmqConnector` (the ``extra`` dict).

Every key, its default and its meaning is documented in ``docs/zmq-connector.md``.
Each key is declared once, on :class:`ZmqConnectorConfig`'s fields (default,
bounds, reader); :func:`~zmq_omni.config.reader.read_fields` reads them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Literal

from ..errors import ConfigError
from .device import read_device
from .extra import foreign_keys
from .fields import read_mapping, read_stage_id
from .reader import read_fields, setting

__all__ = ["NO_RANK", "TRANSFER_ENGINE_KEYS", "ZmqConnectorConfig"]

#: Keys vllm-omni's factory writes into a dual-merged ``extra`` (its transfer-engine connectors'
#: ports and rank maps). They mean nothing to ZeroMQ endpoints and are accepted and ignored.
TRANSFER_ENGINE_KEYS = (
    "zmq_port",
    "sender_host",
    "sender_zmq_port",
    "rank_mapping",
    "recv_rank_mapping",
    "send_rank_mapping",
)
#: Our own names of the other keys vllm-omni writes (an edge's ``extra`` may be switched
#: from ``SharedMemoryConnector`` to ``ZmqConnector`` unchanged).
_ALIASES = {"shm_threshold_bytes": "shm_threshold"}

Role = Literal["sender", "receiver", "dual"]
Mode = Literal["push", "pull"]
ShmPolicy = Literal["auto", "on", "off"]

_PATH = "ZmqConnector"


def _env_int(name: str) -> int:
    """An integer environment variable, 0 when unset or not a non-negative integer."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else 0


#: What ``{rank}`` becomes in a process that is not a tensor-parallel worker (vLLM's EngineCore, the orchestrator).
NO_RANK = "engine"


def _tp_rank() -> int | None:
    """The TP rank of this process, as main's ``get_local_tp_rank`` finds it; None: not a TP worker.

    vLLM's multiprocess executor hands each worker its rank as an argument and
    sets up the TP group before the model runner builds its connectors: the rank
    is ``get_tensor_model_parallel_rank()`` once that group exists (vLLM is never
    imported here: a process that has not imported it has no TP group). Else
    ``$LOCAL_RANK`` (torchrun and main's own fallback). A process with neither
    (the EngineCore of a TP > 1 stage, which builds the scheduler's connector)
    has no rank, rather than passing for rank 0.
    """
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None:
        try:
            return int(state.get_tensor_model_parallel_rank())
        except Exception:  # vLLM asserts when the TP group is not set up in this process
            pass
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


def _place(endpoint: str, replica_id: int, local_rank: int | None) -> str:
    """``endpoint`` with ``{replica}`` and ``{rank}`` replaced (plain replacement: no format syntax)."""
    rank = NO_RANK if local_rank is None else str(local_rank)
    return endpoint.replace("{replica}", str(replica_id)).replace("{rank}", rank)


def _read_stage(data: Mapping[str, Any], key: str, path: str) -> str | None:
    """A stage id as a string (routing compares strings); ints are accepted."""
    stage = read_stage_id(data, key, path)
    return None if stage is None else str(stage)


def _read_endpoints(data: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    """Stage id -> endpoint; ``{replica}`` and ``{rank}`` are replaced once the ids are read."""
    endpoints: dict[str, str] = {}
    for stage, endpoint in read_mapping(data, key, path=path).items():
        if not isinstance(endpoint, str):
            raise ConfigError(f"config key '{path}.{key}.{stage}' must be a string, got {endpoint!r}")
        endpoints[str(stage)] = endpoint
    return endpoints


def _read_server_key(data: Mapping[str, Any], key: str, path: str) -> str | Mapping[str, str]:
    value = data[key]
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values()):
        return MappingProxyType({str(k): v for k, v in value.items()})
    raise ConfigError(f"config key '{path}.{key}' must be a key or a map of stage id -> key")


def _read_key_list(data: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
    value = data[key]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"config key '{path}.{key}' must be a list of public keys")


@dataclass(frozen=True, kw_only=True)
class ZmqConnectorConfig:
    """Settings of one ZeroMQ connector; build it with :meth:`from_dict`.

    Attributes:
        stage_id: this stage's id as a string (routing compares strings); the
            connector's ``.stage_id`` keeps the type it was given. Absent: a
            receiver takes ``to_stage`` and a sender ``from_stage`` (no role:
            push ``to_stage``, pull ``from_stage``) when those are given, else
            the stage of its first ``get``/``put``.
        role: which side binds at construction: ``receiver`` (push), ``sender``
            (pull), ``dual`` (both directions from the start), or None (not given:
            puts at once, and binds only when it first has to receive, so one
            ``extra`` serves both ends of an edge). No role forbids a direction:
            a receiver's first put builds its sending side, a sender's first get
            its receiving side.
        mode: ``push`` (the receiver binds, senders push and keep payloads until
            consumed) or ``pull`` (the sender binds and keeps payloads; receivers fetch).
        endpoints: stage id -> the endpoint peers connect to for that stage
            (``tcp://host:port`` or ``ipc://path``); ``ZMQ_OMNI_ENDPOINT_<STAGE>``
            environment variables override entries.
        bind: the address this stage binds when it differs from the address peers
            connect to (containers: ``tcp://0.0.0.0:5555``); ``ZMQ_OMNI_BIND`` overrides.
        from_stage: vllm-omni injects it; names the stage to bind when ``stage_id`` is absent.
        to_stage: vllm-omni injects it; names the stage to bind when ``stage_id`` is absent.
        replica_id: this process's replica of its stage (default ``$VLLM_OMNI_REPLICA_ID`` or 0);
            replaces ``{replica}`` in ``endpoints`` and ``bind``.
        local_rank: this process's tensor-parallel rank: default vLLM's TP rank in a TP
            worker, else ``$LOCAL_RANK``, else None (not a TP worker: vLLM's EngineCore,
            the orchestrator); replaces ``{rank}`` in ``endpoints`` and ``bind`` (None
            puts ``engine``, so such a process never takes rank 0's endpoint).
        metadata_get_timeout_s: push mode: longest a ``get`` handed the metadata
            of one of our puts waits for that put to arrive (vllm-omni's
            orchestrator calls ``get`` once); a ``get`` without such metadata never waits.
        put_timeout_s: longest a ``put`` waits for window room and for ZeroMQ.
        delivery_timeout_s: longest a put may stay unconfirmed before it is
            reported as a :class:`~zmq_omni.errors.DeliveryError`.
        close_timeout_s: longest ``close()`` lingers for puts not yet confirmed
            (push: arrival at the receiver; pull: fetched) before it reports them
            as failed (default 5 s; it returns as soon as all are confirmed); 0
            closes at once. ``flush()`` waits on demand.
        heartbeat_s: interval of sender pings (which drive resends).
        ack_delay_s: push mode: longest a receiver holds acknowledgements back to batch
            them (a sender whose window is full or whose ``flush()`` waits asks for them
            at once); also how long after a receiver was killed a consumed item can be
            delivered again by its restarted successor.
        peer_timeout_s: silence after which a receiver is presumed gone.
        max_unacked: most puts held unconsumed by a sender (the window).
        max_unacked_bytes: most payload bytes held unconsumed by a sender.
        max_message_bytes: largest message; also ``MAXMSGSIZE`` of receiving sockets.
        max_key_bytes: longest key (UTF-8 bytes) a receiver accepts from a peer (default 4096,
            far above real keys); a message with a longer one is refused and counted
            (``rejected_keys``, ``rejected_frames``).
        max_header_depth: most arrays and maps nested inside one another in a received
            payload's header (lists, tuples, dicts, records); deeper is refused (1 to 256).
        max_header_objects: most msgpack objects a received payload's header may decode
            into (every list, map, key, value and scalar counts one); more is refused
            before anything is built.
        hwm: ZeroMQ high-water mark (messages) of every socket; never 0.
        batch_max_messages: push mode: most small puts coalesced into one BATCH
            message when puts come faster than they can be sent (1 = never batch).
        batch_max_bytes: push mode: most bytes of one BATCH message (also capped by
            the receiver's ``max_message_bytes``, which it announces).
        pull_ttl_s: pull mode: unfetched payloads expire after this long.
        unclaimed_ttl_s: push mode: an item no ``get`` took within this long after
            it arrived is dropped (its sender's window frees; counted as ``dropped_unclaimed``).
        tombstone_ttl_s: push mode: after ``cleanup``, ``cleanup_prefix`` or ``abandon_get``,
            puts arriving under that key or prefix are dropped at once for this long (each
            one dropped renews it; counted as ``dropped_late``); a ``get`` of the key lifts only
            ``abandon_get``'s (a cleanup's holds whatever gets ask).
        max_tombstones: push mode: most tombstones held; past it the oldest is forgotten.
        degraded_hold_s: how long ``health()`` stays ``degraded`` after a put failed or an
            unclaimed item was dropped (it clears sooner once a put succeeds again).
        fetch_timeout_s: pull mode: longest wait for a fetch reply.
        copy_on_put: copy large arrays at ``put`` instead of pinning them.
        inline_threshold: arrays of at least this many bytes get their own frame.
        allow_pickle: let the codec pickle/unpickle unknown types (trusted peers only).
        decode_device: torch device received tensors are decoded onto (``"cuda"``,
            ``"cuda:1"``); default ``None``: the CPU, viewing the received frames.
        malloc_tuning: tune glibc malloc so large receives reuse heap pages.
        shm: push mode's same-host fast path: ``auto`` (use it for receivers that
            prove they read our shared memory), ``on`` (the same, but a large put
            waits up to ``put_timeout_s`` for that proof instead of sending frames
            meanwhile, and ``health()`` is degraded when it fails), ``off`` (never).
        shm_dir: the tmpfs directory of the fast path's segments (default
            ``$ZMQ_OMNI_SHM_DIR`` or ``/dev/shm``); both ends must see the same one.
        shm_threshold: payloads of at least this many bytes take the fast path
            (``shm_threshold_bytes``, vllm-omni's name, is accepted for it).
        shm_pool_max_bytes: most shared memory a sender's slot pool may hold.
        shm_min_free_bytes: never grow the pool if less would stay free in ``shm_dir``.
        shm_ttl_s: a slot nobody opened is reclaimed after this long (a get then fails).
        curve_secret_key: this connector's CURVE secret key (Z85); turns CURVE on.
        curve_public_key: this connector's CURVE public key (Z85).
        curve_server_key: public key of the server a connecting socket talks to:
            one key, or a map stage id -> key.
        curve_allowed_clients: public keys allowed to connect to this stage's
            bound socket (none: any client that knows the server key).
        insecure: allow plaintext TCP to or from addresses other than loopback
            (without it, and without CURVE, such a connector refuses to start;
            ``ZMQ_OMNI_INSECURE=1`` does the same). See ``docs/security.md``.
    """

    stage_id: str | None = setting(None, read=_read_stage)
    role: Role | None = None
    mode: Mode = "push"
    endpoints: Mapping[str, str] = setting(default_factory=lambda: MappingProxyType({}), read=_read_endpoints)
    bind: str | None = None
    from_stage: str | None = setting(None, read=_read_stage)
    to_stage: str | None = setting(None, read=_read_stage)
    replica_id: int = setting(default_factory=lambda: _env_int("VLLM_OMNI_REPLICA_ID"), minimum=0)
    local_rank: int | None = setting(default_factory=_tp_rank, minimum=0)
    metadata_get_timeout_s: float = setting(5.0, minimum=0.0)
    put_timeout_s: float = setting(10.0, minimum=0.0)
    delivery_timeout_s: float = setting(30.0, minimum=0.001)
    close_timeout_s: float = setting(5.0, minimum=0.0)
    heartbeat_s: float = setting(0.5, minimum=0.01)
    ack_delay_s: float = setting(0.02, minimum=0.001, maximum=10.0)
    peer_timeout_s: float = setting(3.0, minimum=0.01)
    max_unacked: int = setting(10_000, minimum=1)
    max_unacked_bytes: int = setting(1 << 30, minimum=1)
    # ZeroMQ takes MAXMSGSIZE as an int64 and the high-water marks as a C int.
    max_message_bytes: int = setting(1 << 30, minimum=1024, maximum=2**63 - 1)
    max_key_bytes: int = setting(4096, minimum=1, maximum=1 << 24)
    # 256: the ceiling DecodeLimits.max_depth accepts.
    max_header_depth: int = setting(32, minimum=1, maximum=256)
    max_header_objects: int = setting(1 << 20, minimum=1)
    hwm: int = setting(1000, minimum=1, maximum=2**31 - 1)
    batch_max_messages: int = setting(256, minimum=1)
    batch_max_bytes: int = setting(64 << 10, minimum=1024)
    pull_ttl_s: float = setting(300.0, minimum=0.001)
    unclaimed_ttl_s: float = setting(300.0, minimum=0.01)
    tombstone_ttl_s: float = setting(60.0, minimum=0.01)
    max_tombstones: int = setting(65536, minimum=1)
    degraded_hold_s: float = setting(30.0, minimum=0.0)
    fetch_timeout_s: float = setting(5.0, minimum=0.001)
    copy_on_put: bool = False
    inline_threshold: int = setting(4096, minimum=0)
    allow_pickle: bool = False
    decode_device: str | None = setting(None, read=read_device)
    malloc_tuning: bool = True
    shm: ShmPolicy = "auto"
    shm_dir: str | None = None
    shm_threshold: int = setting(512 << 10, minimum=1)
    shm_pool_max_bytes: int = setting(1 << 30, minimum=1 << 20)
    shm_min_free_bytes: int = setting(16 << 20, minimum=0)
    shm_ttl_s: float = setting(300.0, minimum=0.001)
    curve_secret_key: str | None = setting(None, repr=False)
    curve_public_key: str | None = None
    curve_server_key: str | Mapping[str, str] | None = setting(None, read=_read_server_key)
    curve_allowed_clients: tuple[str, ...] | None = setting(None, read=_read_key_list)
    insecure: bool = False

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every accepted key: the attributes, vllm-omni's names for some, and its transfer-engine keys."""
        return (*(f.name for f in fields(cls)), *_ALIASES, *TRANSFER_ENGINE_KEYS)

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any]) -> ZmqConnectorConfig:
        """Build from a plain dict; a bad value of one of our keys raises ``ConfigError`` naming the key.

        Keys that are not ours are left alone (vllm-omni's deploy YAMLs put keys for its
        stage input processors into a connector's ``extra``); one that closely matches
        one of ours is logged as a WARNING naming the key we expected.
        """
        foreign_keys(extra, cls.keys(), _PATH)
        extra = dict(extra)
        for alias, name in _ALIASES.items():
            if alias in extra:
                value = extra.pop(alias)
                if name in extra and extra[name] != value:
                    raise ConfigError(
                        f"config keys '{_PATH}.{name}' and '{_PATH}.{alias}' name the same setting and disagree "
                        f"({extra[name]!r} != {value!r})"
                    )
                extra[name] = value
        if extra.get("role") == "auto":  # vllm-omni's "auto" (a transfer-engine role it could not decide)
            extra["role"] = None  # means "not given"
        values = read_fields(cls, extra, _PATH)
        replica_id, local_rank = values["replica_id"], values["local_rank"]
        values["endpoints"] = MappingProxyType(
            {stage: _place(endpoint, replica_id, local_rank) for stage, endpoint in values["endpoints"].items()}
        )
        if values["bind"] is not None:
            values["bind"] = _place(values["bind"], replica_id, local_rank)
        config = cls(**values)
        if config.peer_timeout_s < config.heartbeat_s:
            raise ConfigError(
                f"config key '{_PATH}.peer_timeout_s' ({config.peer_timeout_s}) must be >= "
                f"heartbeat_s ({config.heartbeat_s})"
            )
        return config
