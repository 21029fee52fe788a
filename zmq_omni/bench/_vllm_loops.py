"""vllm-omni main's chunk adapter loops (``d6240742``), restated for the pipeline benchmark.

Main's chunk adapter (``OmniChunkTransferAdapter``,
``transfer_adapter/chunk_transfer_adapter.py`` + ``base.py``): a save thread
that puts one chunk at a time with
``put(from_stage=str(s), to_stage=str(s + 1), put_key=f"{rid}_{s}_{n}", data=payload)``
and counts a chunk only when its put succeeded, and a receive thread that
polls ``get(str(s - 1), str(s), f"{rid}_{s - 1}_{n}")`` for every pending
request and waits 1 ms when none made progress (100 ms when nothing is
pending); a request stops being polled at the chunk whose ``meta.finished``
is true. Not restated: the scheduler step between a chunk's arrival and the
stage's next output (the benchmark's stage work runs in the receive thread's
callback).

Imports torch: callers import this module lazily, as :mod:`zmq_omni.bench._vllm_main`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ChunkMover", "OnChunk", "OnPut", "is_finished"]


def is_finished(payload: Any) -> bool:
    """Main's ``_is_truthy_scalar(payload["meta"].get("finished"))`` on a received (dict) payload."""
    meta = payload.get("meta", {}) if isinstance(payload, dict) else {}
    flag = meta.get("finished") if isinstance(meta, dict) else None
    if isinstance(flag, torch.Tensor):
        return bool(flag.numel() == 1 and bool(flag.item()))
    return bool(flag) if flag is not None else False


#: ``on_chunk(request_id, chunk_id, payload, arrived)``, on the receive thread; ``arrived`` is ``time.monotonic()``.
OnChunk = Callable[[str, int, Any, float], None]
#: ``on_put(request_id, chunk_id, started, ended, ok)``: called on the save thread after each put.
OnPut = Callable[[str, int, float, float, bool], None]


class ChunkMover:
    """One stage's chunk adapter: a save thread and a receive thread around one connector, as main's.

    Threads: the save thread alone calls ``connector.put``; the receive thread
    alone calls ``connector.get``. ``_lock`` guards the two queues and the
    per-request chunk counters; the conditions wake each thread.
    """

    def __init__(self, connector: Any, stage_id: int, on_chunk: OnChunk, on_put: OnPut) -> None:
        self.connector = connector
        self.stage_id = stage_id
        self._on_chunk = on_chunk
        self._on_put = on_put
        self._lock = threading.Lock()
        self._recv_cond = threading.Condition(self._lock)
        self._save_cond = threading.Condition(self._lock)
        self._pending_load: collections.deque[str] = collections.deque()
        self._pending_save: collections.deque[tuple[str, Any]] = collections.deque()
        self._get_chunk: dict[str, int] = collections.defaultdict(int)
        self._put_chunk: dict[str, int] = collections.defaultdict(int)
        self._stop = False
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._recv_loop, name=f"bench-recv-{stage_id}", daemon=True),
            threading.Thread(target=self._save_loop, name=f"bench-save-{stage_id}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def load_async(self, request_id: str) -> None:
        """Poll for ``request_id``'s chunks, in order, until the finished one."""
        with self._lock:
            self._pending_load.append(request_id)
            self._recv_cond.notify()

    def save_async(self, request_id: str, payload: Any) -> None:
        """Queue the next chunk of ``request_id`` for the save thread."""
        with self._lock:
            self._pending_save.append((request_id, payload))
            self._save_cond.notify()

    def _poll(self, request_id: str) -> bool:
        upstream = self.stage_id - 1
        chunk_id = self._get_chunk[request_id]
        got = self.connector.get(str(upstream), str(self.stage_id), f"{request_id}_{upstream}_{chunk_id}")
        if got is None:
            return False
        arrived = time.monotonic()
        self._get_chunk[request_id] = chunk_id + 1
        payload = got[0]
        if not is_finished(payload):
            with self._lock:
                self._pending_load.append(request_id)
        self._on_chunk(request_id, chunk_id, payload, arrived)
        return True

    def _recv_loop(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                pending = list(self._pending_load)
                self._pending_load.clear()
            progress = False
            for request_id in pending:
                try:
                    if self._poll(request_id):
                        progress = True
                        continue
                except Exception as exc:  # main logs and keeps polling
                    self.errors.append(f"get of {request_id}: {exc!r}")
                with self._lock:
                    self._pending_load.append(request_id)
            with self._lock:
                if self._stop:
                    return
                if not self._pending_load:
                    self._recv_cond.wait(timeout=0.1)
                elif not progress:
                    self._recv_cond.wait(timeout=0.001)

    def _save_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending_save and not self._stop:
                    self._save_cond.wait(timeout=0.1)
                if self._stop:
                    return
                request_id, payload = self._pending_save.popleft()
                chunk_id = self._put_chunk[request_id]
            key = f"{request_id}_{self.stage_id}_{chunk_id}"
            started = time.monotonic()
            try:
                ok, _size, _meta = self.connector.put(
                    from_stage=str(self.stage_id), to_stage=str(self.stage_id + 1), put_key=key, data=payload
                )
            except Exception as exc:  # main logs a warning and the chunk is gone
                self.errors.append(f"put of {key}: {exc!r}")
                ok = False
            ended = time.monotonic()
            if ok:
                with self._lock:
                    self._put_chunk[request_id] = chunk_id + 1
            self._on_put(request_id, chunk_id, started, ended, ok)

    def shutdown(self) -> None:
        """Stop both threads (5 s each at most) and close the connector."""
        with self._lock:
            self._stop = True
            self._recv_cond.notify_all()
            self._save_cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self.connector.close()
