"""KV transfer manager: synchronous per-layer KV blocks between tensor-parallel layouts.

A finished request's KV cache leaves the source stage in shards: source TP
rank ``r`` of ``S`` holds heads ``[r*H/S, (r+1)*H/S)`` of every layer, and
destination rank ``d`` of ``D`` needs heads ``[d*H/D, (d+1)*H/D)``. Each source
rank puts, for every destination rank whose heads overlap its own, exactly
the overlapping heads under :func:`kv_key` (``{request}_kv_{from}_{to}_{src_rank}_{dst_rank}``);
each destination rank gets the shards of the source ranks that overlap it
and concatenates them along the heads axis. TP 2 -> 1 merges two shards,
TP 1 -> 2 splits one, and any S, D dividing the head count works.

Synchronous by design (vllm-omni's seed: KV moves once, when prefill
finishes): ``save`` retries with the policy and ``load`` waits at most
``recv_timeout_s``; either failure is recorded for ``collect_failed_*``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConnectorSpec
from ..config.pipeline import read_connector_spec
from ..config.reader import read_config, setting
from ..connectors import FailureSource, OmniConnectorBase, create_connector
from ..errors import ConfigError, TransportError, format_seconds
from .retry import RetryPolicy

__all__ = ["KVLoadResult", "KVTransferConfig", "KVTransferManager", "kv_key"]

logger = logging.getLogger("zmq_omni.adapters")


def kv_key(request_id: str, from_stage: str, to_stage: str, src_rank: int, dst_rank: int) -> str:
    """The key of the shard source rank ``src_rank`` sends to destination rank ``dst_rank``."""
    return f"{request_id}_kv_{from_stage}_{to_stage}_{src_rank}_{dst_rank}"


@dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
    """Config of a :class:`KVTransferManager`.

    Attributes:
        from_stage: the stage that produces the KV cache.
        to_stage: the stage that consumes it.
        src_tp_size: tensor-parallel size of ``from_stage``.
        dst_tp_size: tensor-parallel size of ``to_stage``.
        head_axis: the KV-heads axis of each layer's array (-2 for vLLM's
            ``(2, num_blocks, block_size, num_kv_heads, head_size)``).
        block_axis: the blocks axis, used by :meth:`KVTransferManager.save_finished`.
        recv_timeout_s: longest wait of one ``load`` for all its shards.
        retry: the send policy.
        connector: the connector to build when none is passed in.
    """

    from_stage: str
    to_stage: str
    src_tp_size: int = setting(1, minimum=1)
    dst_tp_size: int = setting(1, minimum=1)
    head_axis: int = -2
    block_axis: int = 1
    recv_timeout_s: float = 30.0  # > 0, checked by __post_init__
    retry: RetryPolicy = setting(default_factory=RetryPolicy, read=RetryPolicy.read)
    connector: ConnectorSpec | None = setting(None, read=read_connector_spec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "from_stage", str(self.from_stage))
        object.__setattr__(self, "to_stage", str(self.to_stage))
        if self.src_tp_size < 1 or self.dst_tp_size < 1:
            raise ConfigError("'src_tp_size' and 'dst_tp_size' must be >= 1")
        if self.recv_timeout_s <= 0:
            raise ConfigError(f"'recv_timeout_s' must be > 0, got {self.recv_timeout_s}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "kv_transfer") -> KVTransferConfig:
        """Build from a plain dict; unknown keys raise ``ConfigError`` naming them."""
        return read_config(cls, data, path)


@dataclass(frozen=True)
class KVLoadResult:
    """The KV cache one destination rank loaded for a request.

    Attributes:
        request_id: the request.
        layers: layer name -> this rank's heads of that layer's KV array.
        metadata: what the sender attached (``block_ids``, ``seq_len``, ...).
    """

    request_id: str
    layers: dict[str, np.ndarray]
    metadata: dict[str, Any]


def _heads_of(rank: int, tp_size: int, num_heads: int) -> tuple[int, int]:
    per = num_heads // tp_size
    return rank * per, (rank + 1) * per


class KVTransferManager:
    """Synchronous save/load of per-layer KV blocks for finished requests.

    One manager per process and direction: a source rank calls :meth:`save`
    (or :meth:`save_finished` with a paged cache), a destination rank calls
    :meth:`load`. Failures are drained with
    :meth:`collect_failed_send_request_ids` / :meth:`collect_failed_receive_request_ids`.

    Args:
        config: a :class:`KVTransferConfig` or its dict form.
        connector: the connector to use (owned by the caller); default: built
            from ``config.connector`` and closed by :meth:`close`.
        rank: this process's tensor-parallel rank in its own stage.
    """

    def __init__(
        self,
        config: KVTransferConfig | Mapping[str, Any],
        connector: OmniConnectorBase | None = None,
        *,
        rank: int = 0,
    ) -> None:
        self.config = config if isinstance(config, KVTransferConfig) else KVTransferConfig.from_dict(config)
        if connector is None and self.config.connector is None:
            raise ConfigError("KV transfer config names no 'connector' and no connector was given")
        self._owns_connector = connector is None
        spec = self.config.connector
        if connector is None:
            assert spec is not None  # checked above
            connector = create_connector(spec)
        self.connector: OmniConnectorBase = connector
        self.rank = rank
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._failed_send: dict[str, str] = {}
        self._failed_recv: dict[str, str] = {}

    # -- sending ---------------------------------------------------------------------------
    def save(
        self, request_id: str, layers: Mapping[str, np.ndarray], *, metadata: Mapping[str, Any] | None = None
    ) -> bool:
        """Send this source rank's KV shard of ``request_id`` to every destination rank that needs it.

        Args:
            request_id: the request (its id is part of every key).
            layers: layer name -> this rank's KV array (heads on ``head_axis``).
            metadata: small extra data for the receiver (``block_ids``, ``seq_len``...).

        Returns:
            True when every shard was put; False after recording a send failure.
        """
        cfg = self.config
        if not 0 <= self.rank < cfg.src_tp_size:
            raise ValueError(f"rank {self.rank} is not a source rank of TP {cfg.src_tp_size}")
        if not layers:
            raise ValueError("no KV layers to save")
        local_heads = {arr.shape[cfg.head_axis] for arr in layers.values()}
        if len(local_heads) != 1:
            raise ValueError(f"layers disagree on the number of heads: {sorted(local_heads)}")
        local = local_heads.pop()
        total = local * cfg.src_tp_size
        if total % cfg.dst_tp_size:
            raise ValueError(f"{total} KV heads cannot be split over TP {cfg.dst_tp_size}")
        my_lo, my_hi = _heads_of(self.rank, cfg.src_tp_size, total)
        for dst in range(cfg.dst_tp_size):
            lo, hi = _heads_of(dst, cfg.dst_tp_size, total)
            lo, hi = max(lo, my_lo), min(hi, my_hi)
            if lo >= hi:
                continue
            index: list[Any] = [slice(None)] * next(iter(layers.values())).ndim
            index[cfg.head_axis] = slice(lo - my_lo, hi - my_lo)
            shard = {
                "layers": {name: arr[tuple(index)] for name, arr in layers.items()},
                "meta": {
                    "head_start": lo,
                    "head_end": hi,
                    "num_heads": total,
                    "src_rank": self.rank,
                    "src_tp_size": cfg.src_tp_size,
                    "metadata": dict(metadata or {}),
                },
            }
            key = kv_key(request_id, cfg.from_stage, cfg.to_stage, self.rank, dst)
            if not self._put(request_id, key, shard):
                return False
        return True

    def save_finished(
        self,
        finished: Mapping[str, Sequence[int]],
        kv_caches: Mapping[str, np.ndarray],
        *,
        metadata: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> dict[str, bool]:
        """Gather each finished request's blocks from a paged cache and :meth:`save` them.

        Args:
            finished: request id -> its block ids, in sequence order.
            kv_caches: layer name -> the paged cache of this rank (blocks on ``block_axis``).
            metadata: optional per-request metadata; ``block_ids`` is always added.

        Returns:
            request id -> whether its KV was sent.
        """
        results: dict[str, bool] = {}
        for request_id, block_ids in finished.items():
            ids = np.asarray(block_ids, dtype=np.int64)
            layers = {name: np.take(cache, ids, axis=self.config.block_axis) for name, cache in kv_caches.items()}
            meta = {**dict((metadata or {}).get(request_id, {})), "block_ids": [int(b) for b in ids]}
            results[request_id] = self.save(request_id, layers, metadata=meta)
        return results

    def _put(self, request_id: str, key: str, shard: Any) -> bool:
        cfg = self.config
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            ok, _nbytes, _meta = self.connector.put(cfg.from_stage, cfg.to_stage, key, shard)
            if ok:
                return
            causes = [f for f in self._drain() if f.key == key and f.op == "put"]
            if causes and causes[-1].error is not None:
                raise causes[-1].error
            raise TransportError(causes[-1].reason if causes else "connector.put reported failure")

        started = time.monotonic()
        try:
            cfg.retry.retrying(stop_event=self.stop_event)(attempt)
        except Exception as exc:
            self._record(
                self._failed_send,
                request_id,
                f"KV put {key!r} gave up after {attempts} attempt(s) in "
                f"{time.monotonic() - started:.2f}s: {type(exc).__name__}: {exc}",
            )
            return False
        return True

    # -- receiving ---------------------------------------------------------------------------
    def load(self, request_id: str, *, timeout_s: float | None = None) -> KVLoadResult | None:
        """Receive and merge this destination rank's KV heads of ``request_id``.

        Waits at most ``timeout_s`` (default ``recv_timeout_s``) for all shards.
        Returns None after recording a receive failure when a shard is missing
        or the shards do not fit together.
        """
        cfg = self.config
        if not 0 <= self.rank < cfg.dst_tp_size:
            raise ValueError(f"rank {self.rank} is not a destination rank of TP {cfg.dst_tp_size}")
        deadline = time.monotonic() + (cfg.recv_timeout_s if timeout_s is None else timeout_s)
        # Which source ranks overlap this rank does not depend on the head count:
        # rank d of D covers the fraction [d/D, (d+1)/D), rank s of S [s/S, (s+1)/S).
        sources = [
            s
            for s in range(cfg.src_tp_size)
            if s * cfg.dst_tp_size < (self.rank + 1) * cfg.src_tp_size
            and self.rank * cfg.src_tp_size < (s + 1) * cfg.dst_tp_size
        ]
        shards: list[Mapping[str, Any]] = []
        for src in sources:
            key = kv_key(request_id, cfg.from_stage, cfg.to_stage, src, self.rank)
            got = cfg.retry.polling(max(0.0, deadline - time.monotonic()), stop_event=self.stop_event)(
                lambda key=key: self.connector.get_with_deadline(cfg.from_stage, cfg.to_stage, key, deadline=deadline)
            )
            if got is None:
                self._record(
                    self._failed_recv,
                    request_id,
                    f"KV shard {key!r} from source rank {src} did not arrive within "
                    f"{format_seconds(cfg.recv_timeout_s if timeout_s is None else timeout_s)}",
                )
                return None
            shards.append(got[0])
        return self._merge(request_id, shards)

    def _merge(self, request_id: str, shards: list[Mapping[str, Any]]) -> KVLoadResult | None:
        cfg = self.config
        try:
            shards = sorted(shards, key=lambda s: int(s["meta"]["head_start"]))
            total = int(shards[0]["meta"]["num_heads"])
            want_lo, want_hi = _heads_of(self.rank, cfg.dst_tp_size, total)
            edge = want_lo
            for shard in shards:
                if int(shard["meta"]["head_start"]) != edge or int(shard["meta"]["num_heads"]) != total:
                    raise ValueError(f"shards do not tile heads [{want_lo}, {want_hi})")
                edge = int(shard["meta"]["head_end"])
            if edge != want_hi:
                raise ValueError(f"shards cover heads up to {edge}, need {want_hi}")
            names = list(shards[0]["layers"])
            if any(list(shard["layers"]) != names for shard in shards):
                raise ValueError("shards disagree on the layer names")
            layers = {
                name: shards[0]["layers"][name]
                if len(shards) == 1
                else np.concatenate([shard["layers"][name] for shard in shards], axis=cfg.head_axis)
                for name in names
            }
        except (KeyError, TypeError, ValueError) as exc:
            self._record(self._failed_recv, request_id, f"KV shards of {request_id!r} are inconsistent: {exc}")
            return None
        return KVLoadResult(request_id, layers, dict(shards[0]["meta"].get("metadata") or {}))

    # -- failures and lifecycle -----------------------------------------------------------------
    def _drain(self) -> list[Any]:
        return list(self.connector.drain_failures()) if isinstance(self.connector, FailureSource) else []

    def _record(self, book: dict[str, str], request_id: str, reason: str) -> None:
        logger.warning("KV transfer of request %s failed: %s", request_id, reason)
        with self._lock:
            book.setdefault(request_id, reason)

    def record_send_failure(self, request_id: str | None, reason: str) -> None:
        """Note that the KV of ``request_id`` will never be delivered."""
        if request_id is None:
            logger.warning("KV send failure for no known request: %s", reason)
            return
        self._record(self._failed_send, request_id, reason)

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """Note that the KV of ``request_id`` will never arrive."""
        self._record(self._failed_recv, request_id, reason)

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        """Drain ``{request_id: reason}`` of sends that gave up (delivery failures included)."""
        for failure in self._drain():
            if failure.op == "put" and "_kv_" in failure.key:
                self.record_send_failure(failure.key.split("_kv_", 1)[0], failure.reason)
        with self._lock:
            out, self._failed_send = self._failed_send, {}
        return out

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        """Drain ``{request_id: reason}`` of loads that failed."""
        with self._lock:
            out, self._failed_recv = self._failed_recv, {}
        return out

    def close(self) -> None:
        """Stop any retry in progress; close the connector when this manager built it."""
        self.stop_event.set()
        if self._owns_connector:
            self.connector.close()

    def __enter__(self) -> KVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
