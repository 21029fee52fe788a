"""The connector call patterns of vllm-omni main's two chunk movers in a stage process, re-stated.

- :class:`SchedulerChunkAdapter` is the scheduler's ``OmniChunkTransferAdapter``
  (``distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py``
  + ``base.py``): it builds its connector from the stage's
  ``stage_connector_config`` through the factory; a receive thread polls
  ``connector.get(str(stage_id - 1), str(stage_id), f"{ext}_{stage_id - 1}_{n}")``
  (positional, no metadata), backing off 1 ms when nothing arrived; a save
  thread calls ``connector.put(from_stage=str(stage_id), to_stage=str(stage_id + 1),
  put_key=f"{ext}_{stage_id}_{n}", data=payload)`` and counts the chunk only when
  the put succeeds (a failed put is dropped: main logs nothing more).
- :class:`RunnerConnectorMixin` is the model runner's
  ``OmniConnectorModelRunnerMixin`` (``worker/omni_connector_model_runner_mixin.py``):
  ``_create_connector`` from the same config; ``register_chunk_recv`` +
  a receive thread with the same key and call form, waiting 5 ms when no
  request made progress; ``send_chunk`` numbers the chunk when it is queued
  and a save thread puts it (keyword form), re-queueing a failed put up to 3
  times.

Main's adapters hand payloads that carry ``meta.finished`` (a bool tensor);
the receiver reads them back as dicts. Here, what arrives is handed to
``on_chunk(request_id, chunk_id, payload)``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from zmq_omni.connectors.factory import create_connector

OnChunk = Callable[[str, int, Any], None]


def is_finished(payload: Any) -> bool:
    """Main's ``_is_truthy_scalar(meta.get("finished"))`` on a received payload."""
    meta = payload.get("meta", {}) if isinstance(payload, dict) else {}
    flag = meta.get("finished") if isinstance(meta, dict) else None
    if hasattr(flag, "numel"):
        return bool(flag.numel() == 1 and bool(flag.item()))
    return bool(flag) if flag is not None else False


class SchedulerChunkAdapter:
    """The scheduler's chunk adapter: one connector, a receive thread and a save thread."""

    def __init__(self, stage_connector_config: dict[str, Any], on_chunk: OnChunk) -> None:
        config = stage_connector_config
        spec = {"name": config.get("name", "SharedMemoryConnector"), "extra": config.get("extra", {})}
        self.connector = create_connector(spec)
        self.on_chunk = on_chunk
        self.get_req_chunk: dict[str, int] = defaultdict(int)
        self.put_req_chunk: dict[str, int] = defaultdict(int)
        self.finished: set[str] = set()
        self.failed_puts: list[str] = []
        self.errors: list[str] = []
        self._pending_load: deque[tuple[str, str]] = deque()
        self._pending_save: deque[tuple[str, Any]] = deque()
        self._stop = threading.Event()
        self._recv_cond = threading.Condition()
        self._save_cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._recv_loop, daemon=True, name="adapter-recv"),
            threading.Thread(target=self._save_loop, daemon=True, name="adapter-save"),
        ]
        for thread in self._threads:
            thread.start()

    def load_async(self, request_id: str, external_req_id: str) -> None:
        """Register a request whose chunks the receive thread polls until the finished one."""
        self._pending_load.append((request_id, external_req_id))
        with self._recv_cond:
            self._recv_cond.notify()

    def save_async(self, external_req_id: str, payload: Any) -> None:
        """Queue one chunk of a request for the save thread."""
        self._pending_save.append((external_req_id, payload))
        with self._save_cond:
            self._save_cond.notify()

    def _poll(self, request_id: str, external_req_id: str) -> bool:
        stage_id = self.connector.stage_id
        target = stage_id - 1
        chunk_id = self.get_req_chunk[request_id]
        result = self.connector.get(str(target), str(stage_id), f"{external_req_id}_{target}_{chunk_id}")
        if result is None:
            return False
        payload, _size = result
        self.get_req_chunk[request_id] += 1
        if is_finished(payload):
            self.finished.add(request_id)
        self.on_chunk(request_id, chunk_id, payload)
        return True

    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            any_success = False
            for _ in range(len(self._pending_load)):
                request_id, ext = self._pending_load.popleft()
                try:
                    got = self._poll(request_id, ext)
                except Exception as exc:  # main logs and keeps polling
                    self.errors.append(f"get {request_id}: {exc!r}")
                    got = False
                any_success |= got
                if request_id not in self.finished:
                    self._pending_load.append((request_id, ext))
            with self._recv_cond:
                if not self._pending_load and not self._stop.is_set():
                    self._recv_cond.wait(timeout=0.1)
                elif not any_success and not self._stop.is_set():
                    self._recv_cond.wait(timeout=0.001)

    def _save_loop(self) -> None:
        while not self._stop.is_set():
            while self._pending_save:
                external_req_id, payload = self._pending_save.popleft()
                stage_id = self.connector.stage_id
                chunk_id = self.put_req_chunk[external_req_id]
                key = f"{external_req_id}_{stage_id}_{chunk_id}"
                try:
                    ok, _size, _meta = self.connector.put(
                        from_stage=str(stage_id), to_stage=str(stage_id + 1), put_key=key, data=payload
                    )
                except Exception as exc:  # main: logger.warning, the chunk is gone
                    self.errors.append(f"put {key}: {exc!r}")
                    ok = False
                if ok:
                    self.put_req_chunk[external_req_id] += 1
                else:
                    self.failed_puts.append(key)
            with self._save_cond:
                if not self._pending_save and not self._stop.is_set():
                    self._save_cond.wait(timeout=0.1)

    def idle(self) -> bool:
        """Nothing queued to save."""
        return not self._pending_save

    def shutdown(self) -> None:
        """Main's ``shutdown``: stop the loops, close the connector."""
        self._stop.set()
        for cond in (self._recv_cond, self._save_cond):
            with cond:
                cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self.connector.close()


class RunnerConnectorMixin:
    """The model runner's connector mixin: one connector, a receive thread and a save thread."""

    MAX_SEND_RETRIES = 3

    def __init__(self, stage_connector_config: dict[str, Any], stage_id: int, on_chunk: OnChunk) -> None:
        config = stage_connector_config
        name = config.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RuntimeError("Invalid stage connector config: missing connector name")
        extra = config.get("extra")
        self._connector = create_connector({"name": name.strip(), "extra": {} if extra is None else extra})
        self._stage_id = stage_id
        self._next_stage_id = stage_id + 1
        self.on_chunk = on_chunk
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = threading.Event()
        self._pending_load: dict[str, str] = {}
        self._get_req_chunk: dict[str, int] = defaultdict(int)
        self._put_req_chunk: dict[str, int] = defaultdict(int)
        self._pending_save: dict[str, deque[dict[str, Any]]] = {}
        self.failed_puts: list[str] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._recv_loop, daemon=True, name="omni-mixin-recv"),
            threading.Thread(target=self._save_loop, daemon=True, name="omni-mixin-save"),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def connector(self) -> Any:
        """The mixin's connector (what stage input processors read ``config`` from)."""
        return self._connector

    def register_chunk_recv(self, request_id: str, external_req_id: str) -> None:
        """Register a request for the receive thread."""
        with self._lock:
            self._pending_load[request_id] = external_req_id
        self._work.set()

    def send_chunk(self, external_req_id: str, payload: Any) -> None:
        """Number one chunk and queue it for the save thread."""
        chunk_id = self._put_req_chunk[external_req_id]
        self._put_req_chunk[external_req_id] += 1
        key = f"{external_req_id}_{self._stage_id}_{chunk_id}"
        task = {"put_key": key, "data": payload, "request_id": external_req_id}
        with self._lock:
            self._pending_save.setdefault(external_req_id, deque()).append(task)
        self._work.set()

    def _poll(self, request_id: str, external_req_id: str) -> bool:
        target = self._stage_id - 1
        chunk_id = self._get_req_chunk[request_id]
        result = self._connector.get(str(target), str(self._stage_id), f"{external_req_id}_{target}_{chunk_id}")
        if result is None:
            return False
        payload, _size = result
        if not payload:
            return False
        self._get_req_chunk[request_id] += 1
        if is_finished(payload):
            with self._lock:
                self._pending_load.pop(request_id, None)
        self.on_chunk(request_id, chunk_id, payload)
        return True

    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._pending_load.items())
            if not pending:
                self._work.wait(timeout=0.01)
                self._work.clear()
                continue
            progress = False
            for request_id, ext in pending:
                try:
                    progress = self._poll(request_id, ext) or progress
                except Exception as exc:  # main: logger.warning, keep polling
                    self.errors.append(f"get {request_id}: {exc!r}")
            if not progress and not self._stop.is_set():
                self._work.wait(timeout=0.005)
                self._work.clear()

    def _save_loop(self) -> None:
        while not self._stop.is_set():
            task = None
            with self._lock:
                for request_id in list(self._pending_save):
                    queue = self._pending_save[request_id]
                    if queue:
                        task = queue.popleft()
                        if not queue:
                            del self._pending_save[request_id]
                        break
                    del self._pending_save[request_id]
            if task is None:
                self._work.wait(timeout=0.01)
                self._work.clear()
                continue
            try:
                ok, _size, _meta = self._connector.put(
                    from_stage=str(self._stage_id),
                    to_stage=str(self._next_stage_id),
                    put_key=task["put_key"],
                    data=task["data"],
                )
            except Exception as exc:  # main: logger.error, then the retry path
                self.errors.append(f"put {task['put_key']}: {exc!r}")
                ok = False
            if not ok:
                retries = task.get("_retry_count", 0) + 1
                if retries <= self.MAX_SEND_RETRIES:
                    task["_retry_count"] = retries
                    with self._lock:
                        self._pending_save.setdefault(task["request_id"], deque()).appendleft(task)
                else:
                    self.failed_puts.append(task["put_key"])

    def idle(self) -> bool:
        """Nothing queued to save."""
        with self._lock:
            return not any(self._pending_save.values())

    def shutdown(self) -> None:
        """Main's ``shutdown_omni_connectors``: stop the threads (5 s each), close the connector."""
        self._stop.set()
        self._work.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._connector.close()


def main_tp_rank() -> int:
    """Main's ``kv_utils.get_local_tp_rank``: vLLM's TP rank, else ``$LOCAL_RANK``, else 0."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None:
        try:
            return int(state.get_tensor_model_parallel_rank())
        except Exception:
            pass
    value = os.environ.get("LOCAL_RANK", "0")
    return int(value) if value.isdigit() else 0


class KVManagerStandIn:
    """The KV transfer manager of a TP worker (``kv_transfer_manager.py`` + the mixin's rank-aware keys).

    Its connector is built from ``{**extra, "role": sender|receiver}`` without a
    stage id (``resolve_omni_kv_config_for_stage``); its rank is
    :func:`main_tp_rank`. Keys are ``{req}_{from_stage}_0_{from_rank}_{to_rank}``
    (``get_kv_connector_key``); a source rank sends to the ranks of
    ``get_kv_target_ranks_for_send``, a destination rank gets from those of
    ``get_kv_remote_ranks``, polling ``get`` by key alone until ``recv_timeout``.
    """

    def __init__(self, extra: dict[str, Any], from_stage: str, to_stage: str, from_tp: int, to_tp: int) -> None:
        self.connector = create_connector({"name": "ZmqConnector", "extra": extra})
        self.from_stage, self.to_stage = from_stage, to_stage
        self.from_tp, self.to_tp = from_tp, to_tp
        self.rank = main_tp_rank()

    def key(self, request_id: str, from_rank: int, to_rank: int) -> str:
        """Main's ``get_kv_connector_key`` (chunk 0)."""
        return f"{request_id}_{self.from_stage}_0_{from_rank}_{to_rank}"

    def target_ranks(self) -> list[int]:
        """Main's ``get_kv_target_ranks_for_send``."""
        if self.from_tp == self.to_tp:
            return [self.rank]
        if self.from_tp > self.to_tp:
            return [self.rank // (self.from_tp // self.to_tp)]
        ratio = self.to_tp // self.from_tp
        return [self.rank * ratio + i for i in range(ratio)]

    def remote_ranks(self) -> list[int]:
        """Main's ``get_kv_remote_ranks``."""
        if self.from_tp == self.to_tp:
            return [self.rank]
        if self.from_tp > self.to_tp:
            ratio = self.from_tp // self.to_tp
            return [self.rank * ratio + i for i in range(ratio)]
        return [self.rank // (self.to_tp // self.from_tp)]

    def send(self, request_id: str, shard: Callable[[str, int, int], Any]) -> list[str]:
        """Put this rank's shard for every target rank; what failed."""
        failed = []
        for target in self.target_ranks():
            key = self.key(request_id, self.rank, target)
            data = shard(request_id, self.rank, target)
            ok, _size, _meta = self.connector.put(self.from_stage, self.to_stage, key, data)
            if not ok:
                failed.append(f"KV put {key} failed")
        return failed

    def receive(self, request_id: str, timeout_s: float) -> tuple[list[Any], list[str]]:
        """Poll this rank's shards of ``request_id`` until all arrived or ``timeout_s`` passed."""
        wanted = {self.key(request_id, s, self.rank) for s in self.remote_ranks()}
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while wanted and time.monotonic() < deadline:
            for key in sorted(wanted):
                result = self.connector.get(self.from_stage, self.to_stage, key)
                if result is not None:
                    got.append(result[0])
                    wanted.discard(key)
            time.sleep(0.005)
        return got, [f"KV {key} never arrived" for key in sorted(wanted)]

    def close(self) -> None:
        """Close the connector."""
        self.connector.close()
