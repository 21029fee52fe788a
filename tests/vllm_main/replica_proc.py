"""One process of a replicated or tensor-parallel stage, building its connectors as vllm-omni main does.

``python -m tests.vllm_main.replica_proc PLAN_JSON``

The plan (a dict, see :class:`Plan`) says which process this is and what it
moves. As main:

- a stage **replica** is its own process with ``VLLM_OMNI_REPLICA_ID`` set (the
  test sets it); with TP = 1 it builds the scheduler's chunk adapter and the
  model runner's mixin from one ``stage_connector_config``;
- a **TP > 1 stage** is an EngineCore process (the scheduler's chunk adapter;
  vLLM imported, no TP group) and one worker process per rank (the mixin, and
  the KV transfer manager where KV moves; vLLM's TP group set up with the
  worker's rank, see :mod:`tests.vllm_main.vllm_state`). Every rank builds its
  connectors; only the EngineCore and rank 0 move chunks.

Each ``(request, mover)`` pair in ``send`` / ``receive`` names which of this
process's chunk movers sends or receives the request's ``chunks`` chunks
(keys ``{request}_{stage}_{n}``, put to ``(stage, stage + 1)``). ``kv_send`` /
``kv_receive`` list requests whose KV shards this rank puts or gets
(main's rank-aware keys). When everything it receives has arrived and
everything it sends is confirmed, the process writes ``result`` (JSON:
``received``, ``kv``, ``problems``); it closes its connectors when stdin
closes, and exits 0 only when nothing went wrong. A connector that fails to
build is a problem written at once.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from tests.vllm_main import vllm_state
from tests.vllm_main.stand_ins import KVManagerStandIn, RunnerConnectorMixin, SchedulerChunkAdapter, is_finished

DEADLINE_S = 45.0
BIG = 700 << 10  # chunk 0 of every request is larger than the shared-memory threshold (512 KiB)


class Plan(TypedDict, total=False):
    """What one process is and does (JSON)."""

    stage_id: int
    tp_rank: int | None  # absent: vLLM is not imported (TP = 1 process); None: the EngineCore of a TP stage
    tp_size: int
    movers: list[str]  # "adapter", "mixin"
    config: dict[str, Any]  # the stage_connector_config
    kv: dict[str, Any]  # {"extra", "from_stage", "to_stage", "from_tp", "to_tp"}
    chunks: int
    send: list[list[str]]  # [request, mover]
    receive: list[list[str]]
    kv_send: list[str]
    kv_receive: list[str]
    result: str
    deadline_s: float  # longest this process waits for what it receives


def chunk_payload(request: str, stage: int, chunk: int, last: bool) -> dict[str, Any]:
    """Chunk ``chunk`` of ``request`` from ``stage``: its identity, an array and main's ``meta.finished``."""
    size = BIG if chunk == 0 else 64
    return {
        "ids": [request, stage, chunk],
        "data": np.full(size // 4, chunk, dtype=np.float32),
        "meta": {"finished": last},
    }


def kv_shard(request: str, from_rank: int, to_rank: int) -> dict[str, Any]:
    """The KV shard source rank ``from_rank`` sends destination rank ``to_rank``."""
    return {"ids": [request, from_rank, to_rank], "layer_0": np.full(1024, from_rank * 10 + to_rank, dtype=np.int32)}


class Process:
    """The connectors of one stage process and what they saw."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.stage_id = plan["stage_id"]
        self.chunks = plan.get("chunks", 0)
        self.deadline_s = plan.get("deadline_s", DEADLINE_S)
        self.problems: list[str] = []
        self.received: dict[str, list[int]] = {r: [] for r, _ in plan.get("receive", [])}
        self.kv_got: dict[str, bool] = {}
        self._lock = threading.Lock()
        self.movers: dict[str, SchedulerChunkAdapter | RunnerConnectorMixin] = {}
        self.kv: KVManagerStandIn | None = None
        config = plan.get("config")
        for mover in plan.get("movers", []):
            assert config is not None
            if mover == "adapter":
                self.movers[mover] = SchedulerChunkAdapter(config, self.on_chunk)
            else:
                self.movers[mover] = RunnerConnectorMixin(config, self.stage_id, self.on_chunk)
        if "kv" in plan:
            kv = plan["kv"]
            self.kv = KVManagerStandIn(kv["extra"], kv["from_stage"], kv["to_stage"], kv["from_tp"], kv["to_tp"])

    def on_chunk(self, request: str, chunk: int, payload: Any) -> None:
        """A chunk arrived at one of this process's movers."""
        with self._lock:
            seen = self.received.setdefault(request, [])
            seen.append(chunk)
            if seen != list(range(len(seen))):
                self.problems.append(f"{request}: chunks out of order {seen}")
        want = [request, self.stage_id - 1, chunk]
        if payload.get("ids") != want:
            self.problems.append(f"{request}: chunk {chunk} carries {payload.get('ids')}, not {want}")
        if is_finished(payload) != (chunk == self.chunks - 1):
            self.problems.append(f"{request}: chunk {chunk} has finished={is_finished(payload)}")

    def run(self) -> None:
        """Register the receives, send every chunk and KV shard, then wait for what this process receives."""
        for request, mover in self.plan.get("receive", []):
            if mover == "adapter":
                adapter = self.movers["adapter"]
                assert isinstance(adapter, SchedulerChunkAdapter)
                adapter.load_async(request, request)
            else:
                mixin = self.movers["mixin"]
                assert isinstance(mixin, RunnerConnectorMixin)
                mixin.register_chunk_recv(request, request)
        for chunk in range(self.chunks):
            for request, mover in self.plan.get("send", []):
                payload = chunk_payload(request, self.stage_id, chunk, chunk == self.chunks - 1)
                target = self.movers[mover]
                if isinstance(target, SchedulerChunkAdapter):
                    target.save_async(request, payload)
                else:
                    target.send_chunk(request, payload)
        if self.kv is not None:
            for request in self.plan.get("kv_send", []):
                for problem in self.kv.send(request, kv_shard):
                    self.problems.append(problem)
            for request in self.plan.get("kv_receive", []):
                shards, problems = self.kv.receive(request, self.deadline_s)
                self.problems.extend(problems)
                expected = {(request, s, self.kv.rank) for s in self.kv.remote_ranks()}
                got = {tuple(s["ids"]) for s in shards}
                self.kv_got[request] = got == expected and len(shards) == len(expected)
                if not self.kv_got[request]:
                    self.problems.append(f"KV {request}: got shards {sorted(got)}, wanted {sorted(expected)}")
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            with self._lock:
                done = all(len(v) >= self.chunks for v in self.received.values())
            if done and all(m.idle() for m in self.movers.values()):
                break
            time.sleep(0.01)
        else:
            health = {name: mover.connector.health() for name, mover in self.movers.items()}
            self.problems.append(f"never arrived: {self._missing()} {health}")
        for name, mover in self.movers.items():
            if not mover.connector.flush(self.deadline_s):
                self.problems.append(f"{name}: puts not confirmed: {mover.connector.health()}")
            if mover.failed_puts:
                self.problems.append(f"{name}: puts that failed: {mover.failed_puts[:10]}")
            if mover.errors:
                self.problems.append(f"{name}: errors: {mover.errors[:10]}")

    def _missing(self) -> dict[str, int]:
        with self._lock:
            return {r: self.chunks - len(v) for r, v in self.received.items() if len(v) < self.chunks}

    def shutdown(self) -> None:
        """Main's shutdowns: every mover and the KV manager close their connectors."""
        for mover in self.movers.values():
            mover.shutdown()
        if self.kv is not None:
            self.kv.close()


def write_result(path: str, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``path``, appearing whole."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(path)


def main(argv: list[str]) -> int:
    """Build, move, report, and close when stdin closes."""
    plan: Plan = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    if "tp_rank" in plan:
        vllm_state.install(plan["tp_rank"], plan.get("tp_size", 1))
    try:
        process = Process(plan)
    except Exception as exc:  # main wraps it: "Failed to create connector ZmqConnector"
        write_result(plan["result"], {"received": {}, "kv": {}, "problems": [f"construct: {exc!r}"]})
        print(f"construct: {exc!r}", flush=True)
        return 1
    try:
        process.run()
    except Exception as exc:
        process.problems.append(f"run: {exc!r}")
    write_result(plan["result"], {"received": process.received, "kv": process.kv_got, "problems": process.problems})
    sys.stdin.read()  # the test closes stdin once every process of the shape has written its result
    process.shutdown()
    for problem in process.problems:
        print(f"PROBLEM {problem}", flush=True)
    return 1 if process.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
