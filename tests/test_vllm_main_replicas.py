"""Replicas and TP ranks as vllm-omni main deploys them, with one configuration: every shape, push and pull (issue 46).

Each process of each stage is its own OS process (``tests/vllm_main/replica_proc.py``)
and builds its connectors the way main does: main's loader, ``get_stage_connector_spec``
and ``create_model_config`` give the ``stage_connector_config``; the scheduler's chunk
adapter, the model runner's mixin and the KV transfer manager build from it
(``tests/vllm_main/stand_ins.py``). A replica is a process with
``VLLM_OMNI_REPLICA_ID`` set; a TP = 2 stage is an EngineCore process (the adapter)
and two worker processes (the mixin, and the KV manager where KV moves), whose
TP rank comes from vLLM's parallel state (``tests/vllm_main/vllm_state.py``).
Every rank constructs; only the EngineCore and rank 0 move chunks; a stage picks
the replica of a request on its own (round-robin), which the sending stage is
never told.

The one configuration is the user's edit of the deploy YAML: the connector's name
becomes ``ZmqConnector`` and ``endpoints`` gives **one receive endpoint per stage
and host** (no ``{replica}``, no ``{rank}``). A shape passes when every request's
chunks (or KV shards) reach the process that asks for them, exactly once, and
every process builds, confirms its puts and exits cleanly.

The stage endpoint is shared by the stage's processes on a host: the holder
of the stage lock binds it, the others become its local clients (push: they
ask the binder for keys; pull: they store their puts in the binder's pull
server, which answers every FETCH of the stage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.ports import reserve_port
from tests.vllm_main.main_loader import (
    DEPLOY_DIR,
    Spec,
    edges,
    kv_spec,
    load_view,
    stage_connector_config,
    stage_connector_spec,
    switch_to_zmq,
)

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = [f"chatcmpl-{i}" for i in range(4)]
CHUNKS = 4
RESULT_WAIT_S = 60.0
EXIT_WAIT_S = 15.0
PROCESS_DEADLINE_S = 30.0


def one_configuration(stage_ids: list[str], tmp: Path, mode: str, transport: str = "ipc") -> dict[str, Any]:
    """What the user adds to the connector's extra: the mode and one endpoint per stage (``ipc://`` or ``tcp://``)."""
    if transport == "ipc":
        return {"mode": mode, "endpoints": {sid: f"ipc://{tmp}/stage{sid}.sock" for sid in stage_ids}}
    return {"mode": mode, "endpoints": {sid: f"tcp://127.0.0.1:{reserve_port()}" for sid in stage_ids}}


@dataclass
class Proc:
    """One OS process of a shape: its plan for ``replica_proc`` and its environment."""

    name: str
    plan: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


def mover_of(index: int) -> str:
    """Which of a TP = 1 process's two chunk movers handles request ``index`` (both take part)."""
    return "adapter" if (index // 2) % 2 == 0 else "mixin"


class Shape:
    """The processes of one row of the issue's table, built from a main deploy YAML switched by the recipe."""

    def __init__(self, yaml_name: str, tmp: Path, mode: str, hosts: str | None = None, transport: str = "ipc") -> None:
        original = load_view(DEPLOY_DIR / yaml_name)
        stage_ids = sorted({str(s["stage_id"]) for s in original["stages"]})
        transport = "tcp" if hosts is not None else transport
        self.view = switch_to_zmq(original, one_configuration(stage_ids, tmp, mode, transport))
        self.edges = edges(self.view)
        self.tmp = tmp
        #: None: one host. Else a directory: replica ``k`` runs on "host" ``k``, with its own shared-memory
        #: directory there, so no host-local path (ipc, shared memory) joins processes of different hosts.
        self.hosts = hosts
        self.procs: list[Proc] = []

    def config(self, sid: int) -> dict[str, Any]:
        """The stage's ``stage_connector_config`` (main's ``get_stage_connector_spec`` + ``create_model_config``)."""
        return stage_connector_config(stage_connector_spec(self.edges, sid, True), sid)

    def kv(self, from_stage: str, to_stage: str, sid: int, from_tp: int, to_tp: int) -> dict[str, Any]:
        """The KV manager's connector extra for the KV edge ``from_stage -> to_stage`` in stage ``sid``."""
        spec: Spec | None = kv_spec({(from_stage, to_stage): self.edges[(from_stage, to_stage)]}, sid)
        assert spec is not None
        return {"extra": spec.extra, "from_stage": from_stage, "to_stage": to_stage, "from_tp": from_tp, "to_tp": to_tp}

    def add(self, name: str, sid: int, movers: list[str], **plan: Any) -> None:
        """One process of stage ``sid``; ``replica`` sets ``VLLM_OMNI_REPLICA_ID``, ``tp_rank`` vLLM's TP state."""
        replica = plan.pop("replica", 0)
        full = {
            "stage_id": sid,
            "movers": movers,
            "config": self.config(sid),
            "chunks": CHUNKS,
            "deadline_s": PROCESS_DEADLINE_S,
            "result": str(self.tmp / f"{name}.json"),
            **plan,
        }
        env = {"VLLM_OMNI_REPLICA_ID": str(replica)}
        if self.hosts is not None:
            env["ZMQ_OMNI_SHM_DIR"] = os.path.join(self.hosts, f"host{replica}")
            os.makedirs(env["ZMQ_OMNI_SHM_DIR"], exist_ok=True)
        self.procs.append(Proc(name, full, env))

    def tp_stage(
        self, name: str, sid: int, tp: int, engine: dict[str, Any], rank0: dict[str, Any], **each: Any
    ) -> None:
        """A TP stage: the EngineCore (the adapter) and one worker per rank (the mixin, ``each``'s KV part)."""
        self.add(f"{name}-engine", sid, ["adapter"], tp_rank=None, tp_size=tp, **engine)
        for rank in range(tp):
            self.add(
                f"{name}-rank{rank}", sid, ["mixin"], tp_rank=rank, tp_size=tp, **(rank0 if rank == 0 else {}), **each
            )


def split(requests: list[str], movers: Callable[[int], str]) -> list[list[str]]:
    """``[request, mover]`` pairs."""
    return [[r, movers(REQUESTS.index(r))] for r in requests]


def replicas_receiving(shape: Shape) -> None:
    """Stage 1 with 2 replicas receiving from stage 0 (qwen3_omni_moe's 0 -> 1, stage 1 replicated)."""
    shape.add("s0", 0, ["adapter", "mixin"], send=split(REQUESTS, mover_of))
    for replica in (0, 1):
        mine = [r for i, r in enumerate(REQUESTS) if i % 2 == replica]  # the stage's round-robin
        shape.add(f"s1-replica{replica}", 1, ["adapter", "mixin"], replica=replica, receive=split(mine, mover_of))


def replicas_sending(shape: Shape) -> None:
    """Stage 1 with 2 replicas sending to stage 2 (main's minicpmo_4_5_3gpu_stage1_replicas.yaml)."""
    for replica in (0, 1):
        mine = [r for i, r in enumerate(REQUESTS) if i % 2 == replica]
        shape.add(f"s1-replica{replica}", 1, ["adapter", "mixin"], replica=replica, send=split(mine, mover_of))
    shape.add("s2", 2, ["adapter", "mixin"], receive=split(REQUESTS, mover_of))


def leader_split(requests: list[str]) -> tuple[list[list[str]], list[list[str]]]:
    """A TP stage's chunk movers: the EngineCore's adapter takes even requests, rank 0's mixin odd ones."""
    even = [[r, "adapter"] for i, r in enumerate(requests) if i % 2 == 0]
    odd = [[r, "mixin"] for i, r in enumerate(requests) if i % 2 == 1]
    return even, odd


def tp_receiving(shape: Shape) -> None:
    """The receiving stage with TP = 2 (qwen3_omni_moe's talker, TP 2)."""
    shape.add("s0", 0, ["adapter", "mixin"], send=split(REQUESTS, mover_of))
    engine, rank0 = leader_split(REQUESTS)
    shape.tp_stage("s1", 1, 2, {"receive": engine}, {"receive": rank0})


def tp_sending(shape: Shape) -> None:
    """The sending stage with TP = 2 (main's qwen3_omni thinker on NPU: TP 2)."""
    engine, rank0 = leader_split(REQUESTS)
    shape.tp_stage("s0", 0, 2, {"send": engine}, {"send": rank0})
    shape.add("s1", 1, ["adapter", "mixin"], receive=split(REQUESTS, mover_of))


def kv_between(from_tp: int, to_tp: int) -> Callable[[Shape], None]:
    """KV cache from stage 0 (TP ``from_tp``) to stage 1 (TP ``to_tp``), rank-aware keys, every rank's shard."""

    def build(shape: Shape) -> None:
        for sid, tp, role in ((0, from_tp, "kv_send"), (1, to_tp, "kv_receive")):
            kv = shape.kv("0", "1", sid, from_tp, to_tp)
            if tp == 1:
                shape.add(f"s{sid}", sid, ["adapter", "mixin"], chunks=0, tp_rank=0, kv=kv, **{role: REQUESTS})
            else:
                shape.tp_stage(f"s{sid}", sid, tp, {"chunks": 0}, {}, chunks=0, kv=kv, **{role: REQUESTS})

    return build


@dataclass
class Row:
    """One row of the issue's table: its YAML and its processes."""

    yaml: str
    build: Callable[[Shape], None]


ROWS = {
    "replicas-receiving": Row("qwen3_omni_moe.yaml", replicas_receiving),
    "replicas-sending": Row("minicpmo_4_5_3gpu_stage1_replicas.yaml", replicas_sending),
    "tp2-receiving": Row("qwen3_omni_moe.yaml", tp_receiving),
    "tp2-sending": Row("qwen3_omni_moe.yaml", tp_sending),
    "kv-tp2-to-tp2": Row("qwen3_omni_moe.yaml", kv_between(2, 2)),
    "kv-tp2-to-tp1": Row("qwen3_omni_moe.yaml", kv_between(2, 1)),
    "kv-tp1-to-tp2": Row("qwen3_omni_moe.yaml", kv_between(1, 2)),
}


def _cases() -> list[Any]:
    return [pytest.param(row_id, mode, id=f"{row_id}-{mode}") for row_id in ROWS for mode in ("push", "pull")]


def run_shape(shape: Shape) -> tuple[dict[str, dict[str, Any]], dict[str, int], str]:
    """Start every process of ``shape``, wait for all results (or the first problem); results, exit codes, logs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LOCAL_RANK", None)  # vLLM's multiprocess executor sets none
    logs = {p.name: shape.tmp / f"{p.name}.log" for p in shape.procs}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        for proc in shape.procs:
            with logs[proc.name].open("wb") as log:
                procs[proc.name] = subprocess.Popen(
                    [sys.executable, "-m", "tests.vllm_main.replica_proc", json.dumps(proc.plan)],
                    cwd=ROOT,
                    env={**env, **proc.env},
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + RESULT_WAIT_S
        while len(results) < len(procs) and time.monotonic() < deadline:
            for proc in shape.procs:
                path = Path(proc.plan["result"])
                if proc.name not in results and path.exists():
                    results[proc.name] = json.loads(path.read_text())
            if any(r["problems"] for r in results.values()):
                break
            if any(p.poll() is not None and name not in results for name, p in procs.items()):
                break
            time.sleep(0.05)
    finally:
        codes = {}
        for popen in procs.values():
            assert popen.stdin is not None
            popen.stdin.close()
        # a shape that already failed is not waited for: processes still waiting for chunks are killed
        clean = len(results) == len(procs) and not any(r["problems"] for r in results.values())
        exit_by = time.monotonic() + (EXIT_WAIT_S if clean else 2.0)
        for name, popen in procs.items():
            try:
                codes[name] = popen.wait(timeout=max(0.1, exit_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                codes[name] = popen.wait()
    outputs = "\n".join(f"--- {name} ---\n{path.read_text(errors='replace')}" for name, path in logs.items())
    return results, codes, outputs


def check(shape: Shape) -> None:
    """Run ``shape``; every process built, got what it asked for exactly once, and exited cleanly."""
    results, codes, outputs = run_shape(shape)
    problems = {name: r["problems"] for name, r in results.items() if r["problems"]}
    assert not problems, f"{problems}\n{outputs}"
    assert set(results) == {p.name for p in shape.procs}, f"processes without a result\n{outputs}"
    # each request's chunks reached each process that asked for them, all of them, once, in order
    asked = {(p.name, r) for p in shape.procs for r, _ in p.plan.get("receive", [])}
    got = {(name, r): chunks for name, res in results.items() for r, chunks in res["received"].items()}
    assert got == {key: list(range(CHUNKS)) for key in asked}, outputs
    for proc in shape.procs:
        if proc.plan.get("kv_receive"):
            assert results[proc.name]["kv"] == dict.fromkeys(REQUESTS, True), outputs
    assert codes == dict.fromkeys(codes, 0), outputs


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("row_id", "mode"), _cases())
def test_every_shape_moves_every_chunk_with_one_configuration(row_id: str, mode: str, short_tmp: Path) -> None:
    row = ROWS[row_id]
    shape = Shape(row.yaml, short_tmp, mode)
    row.build(shape)
    check(shape)


def minicpmo_stage1_replicas(shape: Shape) -> None:
    """Main's ``minicpmo_4_5_3gpu_stage1_replicas.yaml`` whole: stage 0 builds no connector (its YAML names
    none for it), stage 1's two replicas stream to stage 2."""
    assert shape.config(0)["name"] != "ZmqConnector" and not shape.edges.get(("0", "1"))
    replicas_sending(shape)


def qwen3_omni_tp2(shape: Shape) -> None:
    """``qwen3_omni_moe.yaml`` laid out as its NPU platform section does: the thinker (stage 0) with TP = 2
    (an EngineCore and two ranks) streams to the talker (stage 1), which streams to code2wav (stage 2)."""
    engine, rank0 = leader_split(REQUESTS)
    shape.tp_stage("s0", 0, 2, {"send": engine}, {"send": rank0})
    shape.add("s1", 1, ["adapter", "mixin"], receive=split(REQUESTS, mover_of), send=split(REQUESTS, mover_of))
    shape.add("s2", 2, ["adapter", "mixin"], receive=split(REQUESTS, mover_of))


PIPELINES = {
    "minicpmo_4_5_3gpu_stage1_replicas": Row("minicpmo_4_5_3gpu_stage1_replicas.yaml", minicpmo_stage1_replicas),
    "qwen3_omni_moe-tp2": Row("qwen3_omni_moe.yaml", qwen3_omni_tp2),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_main_deploys_switched_by_the_recipe_stream_every_chunk_once_to_the_right_stage(
    pipeline: str, mode: str, short_tmp: Path
) -> None:
    """Every stage process of the deploy builds its connectors; every chunk reaches its next stage, once."""
    row = PIPELINES[pipeline]
    shape = Shape(row.yaml, short_tmp, mode)
    row.build(shape)
    check(shape)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("row_id", "mode"),
    [
        # the replicas fetch what each asks for from the one sending process's endpoint
        pytest.param("replicas-receiving", "pull", id="replicas-on-two-hosts-receiving-pull"),
        # the replicas push into the one receiving process's endpoint
        pytest.param("replicas-sending", "push", id="replicas-on-two-hosts-sending-push"),
    ],
)
def test_replicas_on_two_hosts_with_one_endpoint_per_stage(
    row_id: str, mode: str, short_tmp: Path, shm_dir: str
) -> None:
    """Across hosts: replica 1 of stage 1 on a host of its own (tcp, its own shared-memory directory)."""
    row = ROWS[row_id]
    shape = Shape(row.yaml, short_tmp, mode, hosts=shm_dir)
    row.build(shape)
    check(shape)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("row_id", ["tp2-receiving", "kv-tp2-to-tp2"])
def test_a_tcp_stage_endpoint_is_shared_by_the_stages_processes(
    row_id: str, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One host, ``tcp://`` endpoints, push: the stage lock and the service socket live in ``$ZMQ_OMNI_RUN_DIR``."""
    monkeypatch.setenv("ZMQ_OMNI_RUN_DIR", str(short_tmp / "run"))
    row = ROWS[row_id]
    shape = Shape(row.yaml, short_tmp, "push", transport="tcp")
    row.build(shape)
    check(shape)
    assert any(p.name.endswith(".lock") for p in (short_tmp / "run").iterdir())
