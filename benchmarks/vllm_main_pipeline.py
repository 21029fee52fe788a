"""vllm-omni main's own Qwen3-Omni async-chunk pipeline on its SharedMemoryConnector and on ZmqConnector.

Run (from a checkout of zmq_omni, with a tree of vllm-omni main ``d6240742``):

    python benchmarks/vllm_main_pipeline.py --vllm-omni DIR [--quick] [--reps 3] [--json OUT]

``DIR`` is an extracted tree of vllm-omni main (the harness never fetches it):
``git -C CLONE archive d6240742 | tar -x -C DIR`` from a clone of
github.com/vraiti/vllm-omni. vLLM itself is not needed: it is stubbed.

**What runs is main's code**: three stage processes (thinker 0 -> talker 1 ->
code2wav 2), each building main's ``OmniChunkTransferAdapter`` (its own
receive and save threads, its 1 ms receive back-off) through main's
``OmniConnectorFactory``, from the spec main derives from its deploy YAML
``vllm_omni/deploy/qwen3_omni_moe.yaml`` (main's ``load_omni_transfer_config``
and ``get_stage_connector_config``; the first spec of the stage, with
``stage_id`` added, as main's ``get_stage_connector_spec`` and
``create_model_config`` do), and main's Qwen3-Omni stage input processors
(``thinker2talker_async_chunk``, ``talker2code2wav_async_chunk``) building
every payload (main's ``OmniPayloadStruct`` and its nested Structs). Main's
``SharedMemoryConnector`` runs as shipped (YAML unchanged); ZmqConnector is
the same YAML with ``name: ZmqConnector`` and ``endpoints`` added (the recipe
of ``docs/vllm-omni.md``), registered in main's factory by
``zmq_omni.connectors.vllm_plugin.register()``.

**What is re-stated, not main's** (``_vllm_main/env.py``,
``_vllm_main/stage.py``): vLLM's modules (stubs: empty classes, TypedDicts
and msgspec Structs for the names main imports; ``RequestStatus`` and its
``is_finished`` re-stated); placeholders for three main modules imported but
unused on this path (``config.yaml_util``, ``platforms``, ``metrics``: their
dependencies omegaconf and prettytable are not installed); vLLM's
``Request`` (the fields main's adapter and processors touch) and waiting
queue; the scheduler loop around the adapter (the order of main's
``OmniARScheduler.schedule``/``OmniGenerationScheduler.schedule``:
``process_pending_chunks``, schedule what is ready, ``restore_queues``,
``postprocess_scheduler_output``, run the model, ``save_async``; an idle step
waits 1 ms); ``get_stage_connector_spec`` (four lines of
``engine/stage_init_utils.py``, whose module imports the whole engine); the
models (stand-ins producing the tensors main's processors consume; see
``_vllm_main/stage.py``). Not built: the model runner's connector
(``OmniConnectorModelRunnerMixin``), which main builds from the same spec in
each stage process but which carries no chunk in async-chunk mode (its
``register_chunk_recv`` is fed only by the full-payload input coordinator).
Each stage process sets ``torch.set_num_threads(1)``; ZmqConnector's segments
go to a per-run directory (``ZMQ_OMNI_SHM_DIR``), main's to ``/dev/shm`` as
it names them; the writer's resource-tracker warnings about segments the
reader already unlinked (main's connector, Python 3.11) are silenced.

**Backends**, in one run, interleaved within each repetition: main's
``SharedMemoryConnector``; ZmqConnector push over ``ipc://`` (shared-memory
fast path ``auto``, its default); push over ``tcp://`` loopback with
``shm: off``; pull over ``tcp://``.

**Workloads**, in one set of stage processes per backend and repetition:

- *first*: one request of ``--chunks-paced`` chunks at the pace below, the
  first the connectors carry after start: its chunk 0's latency is reported
  on its own ("1st chunk0"), and kept out of the other figures;
- *paced*: requests one after another, each of ``--chunks-paced`` thinker
  chunks at a thinker step every ``--pace-ms`` (20 ms); per request, chunk
  0's end-to-end latency; per chunk ``k >= 1``, its latency;
- *burst*: ``--requests`` (8) requests of ``--chunks`` (50) thinker chunks,
  the thinker stepping them all as fast as its loop goes; code2wav chunks/s
  (chunks received / (last arrival - first thinker ``save_async``)), and
  the first hop's rate alone (chunks in the talker's hands over the same
  start). The talker calls main's ``talker2code2wav_async_chunk`` once per
  codec frame (25 per chunk), which costs a few ms of the talker's CPU per
  chunk whatever the connector: it caps the code2wav rate of every backend.

A chunk's end-to-end latency runs from the thinker's ``save_async`` of the
step that completes thinker chunk ``k`` to the ``get`` on code2wav that
returns codec chunk ``k`` (the talker turns each thinker chunk into one codec
chunk), through both hops, both adapters' threads and the talker's
scheduler. ``put`` p50/p99 is over the thinker's ``[1, 2048]`` bf16 decode
chunks (~4 KiB) of every workload, timed around ``connector.put`` inside
main's save thread (most of them burst puts, back to back); *paced put p50*
over the paced requests' alone (a put after 20 ms idle).

Every chunk's tensors are checked at the far end; a stage that finds a
difference, or a run that leaves a process, a shared-memory segment or a lock
file behind (removed, then reported), fails the benchmark, with every stage's
output. Each run's ipc socket files (libzmq leaves them after close) go with
its temporary directory. Figures are medians over repetitions; ratios are
against main's ``SharedMemoryConnector`` in the same run (chunks/s: ours /
theirs; latency: theirs / ours; above 1, ZmqConnector is better). Each line
per run also shows where a paced chunk's time goes (p50 of each leg) and how
many of the thinker's puts took ZmqConnector's shared-memory path.

``--cpu`` adds, per run, each stage process's CPU over the burst in ms per
chunk (the burst's chunks), by thread, and the CPU its connector calls took
(``(in put)``, ``(in get hit)``, ``(in get miss)``), with how many cores the
three stages kept busy and the whole host (``/proc/stat``: other work on the
host shows there). When the host has cores to spare the talker process is the
bottleneck: its threads share one GIL, so code2wav's chunks/s is close to
1000 / (the talker's CPU ms per chunk).

``--quick``: one repetition, 1 paced request and 8 burst requests of 20
chunks (about 40 s on two cores at load average 1.4).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _vllm_main import env as main_env
from _vllm_main.report import BACKENDS, BASELINE, RunResult, host_cpu, pct, print_cpu, report

from zmq_omni.transport import reserve_loopback_port

STAGE_SCRIPT = Path(__file__).resolve().parent / "_vllm_main" / "stage.py"
DEPLOY_YAML = "vllm_omni/deploy/qwen3_omni_moe.yaml"
SHM_ROOT = Path("/dev/shm")


class BenchmarkFailed(RuntimeError):
    """A stage found wrong data, hung, crashed, or a run left something behind."""


def stage_configs(checkout: Path, backend: str, workdir: Path) -> dict[int, dict[str, Any]]:
    """The ``stage_connector_config`` main hands each stage process, from its deploy YAML (switched for ours)."""
    from vllm_omni.distributed.omni_connectors.utils.initialization import (  # type: ignore[import-not-found]
        get_stage_connector_config,
        load_omni_transfer_config,
    )

    view = yaml.safe_load((checkout / DEPLOY_YAML).read_text())
    if backend != BASELINE:
        _, transport = backend.rsplit("-", 1)
        if transport == "ipc":
            endpoints = {str(s): f"ipc://{workdir}/stage{s}.sock" for s in (0, 1, 2)}
        else:
            endpoints = {str(s): f"tcp://127.0.0.1:{reserve_loopback_port()}" for s in (0, 1, 2)}
        ours: dict[str, Any] = {"endpoints": endpoints}
        if backend.startswith("zmq-pull"):
            ours["mode"] = "pull"
        if backend == "zmq-push-tcp":
            ours["shm"] = "off"
        for spec in view["connectors"].values():
            spec["name"] = "ZmqConnector"
            spec["extra"] = {**(spec.get("extra") or {}), **ours}
    transfer = load_omni_transfer_config(config_dict=view)
    out: dict[int, dict[str, Any]] = {}
    for stage in (0, 1, 2):
        # main's get_stage_connector_spec (async_chunk: true): the stage's first spec; create_model_config adds stage_id
        specs = get_stage_connector_config(transfer, stage)
        spec = next(iter(specs.values()))["spec"]
        out[stage] = {"name": spec["name"], "extra": {**copy.deepcopy(spec["extra"]), "stage_id": stage}}
    return out


@dataclass
class StageProc:
    """A stage process, its output and its events."""

    stage: int
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    events: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: set[str] = field(default_factory=set)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("@@"):
                self.events.put(line[2:].strip())
        self.events.put("exited")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_event(self, event: str, deadline: float) -> None:
        """Wait until the stage has reported ``event`` (events are kept: they may come in any order)."""
        while event not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchmarkFailed(f"stage {self.stage}: no '{event}' in time")
            try:
                got = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if got == "exited":
                raise BenchmarkFailed(f"stage {self.stage} exited (rc {self.proc.poll()}) before '{event}'")
            self.seen.add(got)


def run_once(checkout: Path, backend: str, args: argparse.Namespace, nonce: str) -> RunResult:
    """Start three stages, run the paced then the burst workload, stop them, check nothing is left."""
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="vmp-"))
    shm_dir = SHM_ROOT / f"zmq-omni-vmp-{nonce}"
    shm_dir.mkdir()
    env = {
        **os.environ,
        "ZMQ_OMNI_SHM_DIR": str(shm_dir),
        "PYTHONUNBUFFERED": "1",
        # main's SharedMemoryConnector creates segments that the reading process unlinks; at exit the writer's
        # multiprocessing resource tracker warns once per segment that it cannot unlink what is already gone
        "PYTHONWARNINGS": "ignore::UserWarning:multiprocessing.resource_tracker",
    }
    stages: list[StageProc] = []
    problems: list[str] = []
    phases: dict[str, float] = {}
    ok = False
    try:
        configs = stage_configs(checkout, backend, workdir)
        for stage in (2, 1, 0):
            config = {"stage_connector_config": configs[stage], "prompt_len": args.prompt_len}
            proc = subprocess.Popen(
                [sys.executable, str(STAGE_SCRIPT), str(checkout), str(stage), json.dumps(config),
                 str(workdir / f"records-{stage}.json")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            )  # fmt: skip
            sp = StageProc(stage, proc)
            threading.Thread(target=sp.read, daemon=True).start()
            stages.append(sp)
        by_stage = {sp.stage: sp for sp in stages}
        start_by = time.monotonic() + args.start_timeout
        for sp in stages:
            sp.wait_event("ready", start_by)
        phases = {"start": time.monotonic() - t_start}

        def add(rids: list[tuple[str, int]], chunks: int, pace_s: float) -> None:
            for stage in (2, 1, 0):  # receivers first, as the orchestrator submits to every stage
                for rid, ordinal in rids:
                    by_stage[stage].send(f"add {rid} {ordinal} {chunks} {pace_s}")

        first = (f"{nonce}-w0", 200)  # the first request after start: reported apart, not in the paced figures
        paced = [(f"{nonce}-p{i}", i) for i in range(args.paced_requests)]
        for rid, ordinal in [first, *paced]:
            add([(rid, ordinal)], args.chunks_paced, args.pace_ms / 1e3)
            by_stage[2].wait_event(f"done {rid}", time.monotonic() + args.chunks_paced * args.pace_ms / 1e3 + 30)
        phases["first+paced"] = time.monotonic() - t_start - phases["start"]
        burst = [(f"{nonce}-b{i}", 100 + i) for i in range(args.requests)]
        for sp in stages:
            sp.send("cpu before")
        host_before, wall_before = host_cpu(), time.monotonic()
        add(burst, args.chunks, 0.0)
        burst_by = time.monotonic() + args.burst_timeout
        for rid, _ in burst:
            by_stage[2].wait_event(f"done {rid}", burst_by)
        for sp in stages:
            sp.send("cpu after")
        host_busy = (host_cpu() - host_before) / (time.monotonic() - wall_before)
        ok = True
    finally:
        t_stop = time.monotonic()
        phases["burst"] = t_stop - t_start - sum(phases.values())
        problems += _stop(stages, args.stop_timeout)
        print(
            f"    ({backend}: {', '.join(f'{k} {v:.1f} s' for k, v in phases.items())},"
            f" stop {time.monotonic() - t_stop:.1f} s)",
            flush=True,
        )
        problems += _leftovers(nonce, shm_dir)
        records = {}
        for sp in stages:
            path = workdir / f"records-{sp.stage}.json"
            if path.exists() and args.records:
                args.records.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, args.records / f"{backend}-{nonce}-stage{sp.stage}.json")
            if path.exists():
                records[sp.stage] = json.loads(path.read_text())
                problems += [f"stage {sp.stage}: {p}" for p in records[sp.stage]["problems"]]
        shutil.rmtree(workdir, ignore_errors=True)
        if problems or not ok:
            for sp in sorted(stages, key=lambda s: s.stage):
                print(f"---- stage {sp.stage} output (rc {sp.proc.returncode}) ----", file=sys.stderr)
                print("\n".join(sp.lines[-80:]), file=sys.stderr)
            for problem in problems:
                print(f"{backend}: {problem}", file=sys.stderr)
    if problems:
        raise BenchmarkFailed(f"{backend}: " + "; ".join(problems[:10]))
    result = _measure(records, first[0], paced, burst, args)
    result.host_busy_cores = host_busy
    return result


def _stop(stages: list[StageProc], timeout: float) -> list[str]:
    """Close every stage's stdin (``finish``), wait, kill what does not exit; say what had to be killed."""
    problems = []
    for sp in stages:
        with contextlib.suppress(OSError, ValueError):
            sp.send("finish")
            assert sp.proc.stdin is not None
            sp.proc.stdin.close()
    deadline = time.monotonic() + timeout
    for sp in stages:
        try:
            sp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append(f"stage {sp.stage} did not exit within {timeout} s (killed)")
            sp.proc.kill()
            sp.proc.wait()
        if sp.proc.returncode != 0:
            problems.append(f"stage {sp.stage} exited with {sp.proc.returncode}")
    return problems


def _leftovers(nonce: str, shm_dir: Path) -> list[str]:
    """Segments, lock files and sockets the run left behind (removed, and reported)."""
    problems = []
    for path in SHM_ROOT.iterdir():
        if nonce in path.name and path != shm_dir:
            problems.append(f"left in /dev/shm: {path.name}")
            with contextlib.suppress(OSError):
                path.unlink()
    left = sorted(p.name for p in shm_dir.iterdir())
    if left:
        problems.append(f"left in {shm_dir}: {left[:5]}")
    shutil.rmtree(shm_dir, ignore_errors=True)
    # libzmq 4.3 leaves the socket file of an ipc:// bind after close (raw pyzmq too) and unlinks a stale one at the
    # next bind; ZmqConnector's bind probes it first. They go with the run's temporary directory.
    return problems


def _measure(
    records: dict[int, Any],
    first: str,
    paced: list[tuple[str, int]],
    burst: list[tuple[str, int]],
    args: argparse.Namespace,
) -> RunResult:
    saves, puts = records[0]["saves"], records[0]["puts"]
    arrivals = {key: end for key, (_start, end) in records[2]["gets"].items()}

    def latency(rid: str, chunk: int) -> float:
        return float(arrivals[f"{rid}_1_{chunk}"] - saves[f"{rid}_{chunk + 1}"])

    chunk0 = [latency(rid, 0) * 1e3 for rid, _ in paced]
    per_chunk = [latency(rid, k) * 1e3 for rid, _ in paced for k in range(1, args.chunks_paced)]
    burst_start = min(saves[f"{rid}_1"] for rid, _ in burst)
    burst_end = max(arrivals[f"{rid}_1_{k}"] for rid, _ in burst for k in range(args.chunks))
    rate = len(burst) * args.chunks / (burst_end - burst_start)
    put_us = [(end - start) * 1e6 for key, (start, end, _ok) in puts.items() if not key.endswith("_0")]
    # the paced requests' alone: a put after 20 ms idle, as one request streaming meets it
    paced_keys = [f"{rid}_0_{k}" for rid, _ in paced for k in range(1, args.chunks_paced)]
    paced_put_us = [(puts[key][1] - puts[key][0]) * 1e6 for key in paced_keys]
    # where a paced chunk's time goes: thinker save_async, its put, talker's get, talker's put, code2wav's get
    talker_gets = {key: end for key, (_start, end) in records[1]["gets"].items()}
    talker_puts = records[1]["puts"]
    hops: dict[str, list[float]] = {"save->put": [], "put0->get1": [], "get1->put1": [], "put1->get2": []}
    for rid, _ in paced:
        for k in range(args.chunks_paced):
            marks = (saves[f"{rid}_{k + 1}"], puts[f"{rid}_0_{k}"][0], talker_gets[f"{rid}_0_{k}"],
                     talker_puts[f"{rid}_1_{k}"][0], arrivals[f"{rid}_1_{k}"])  # fmt: skip
            for name, a, b in zip(hops, marks, marks[1:], strict=False):
                hops[name].append((b - a) * 1e3)
    # ZmqConnector's same-host fast path: how many of the thinker's puts took it (main's connector: every put)
    shm_puts = records[0]["health"].get("shm_puts")
    # the first hop's rate: thinker chunks in the talker's hands, before the talker's own work (main's processor,
    # called once per codec frame) sets the pace of the second hop
    hop1_end = max(talker_gets[f"{rid}_0_{k}"] for rid, _ in burst for k in range(args.chunks))
    hop1_rate = len(burst) * args.chunks / (hop1_end - burst_start)
    # each stage's CPU over the burst, per thread, in ms per code2wav chunk
    cpu: dict[str, dict[str, float]] = {}
    for stage, record in records.items():
        before, after = record["cpu"]["before"], record["cpu"]["after"]
        cpu[str(stage)] = {
            name: (spent - before.get(name, 0.0)) * 1e3 / (len(burst) * args.chunks) for name, spent in after.items()
        }
    return RunResult(
        chunk0, per_chunk, rate, put_us, paced_put_us, latency(first, 0) * 1e3, hops, shm_puts, hop1_rate, cpu
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-omni", type=Path, required=True, help="a tree of vllm-omni main d6240742")
    parser.add_argument("--quick", action="store_true", help="one repetition, short workloads (well under a minute)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--requests", type=int, default=8, help="burst: concurrent requests")
    parser.add_argument("--chunks", type=int, default=50, help="burst: thinker chunks per request")
    parser.add_argument("--paced-requests", type=int, default=4, help="paced: requests, one after another")
    parser.add_argument("--chunks-paced", type=int, default=50, help="paced: thinker chunks per request")
    parser.add_argument("--pace-ms", type=float, default=20.0, help="paced: thinker step interval")
    parser.add_argument("--prompt-len", type=int, default=128, help="P: chunk 0 carries [P+1, 2048] bf16 twice")
    parser.add_argument("--start-timeout", type=float, default=90.0)
    parser.add_argument("--burst-timeout", type=float, default=120.0)
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    parser.add_argument("--cpu", action="store_true", help="print each stage's CPU per chunk in the burst, by thread")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--records", type=Path, help="keep each stage's raw timings (JSON) in this directory")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.requests, args.chunks, args.paced_requests, args.chunks_paced = 1, 8, 20, 1, 20
    checkout = main_env.check_checkout(args.vllm_omni)
    main_env.install(checkout)
    backends = args.backends.split(",")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}")
    nonce = secrets.token_hex(4)
    import zmq_omni

    print(
        f"vllm-omni main pipeline ({checkout}; zmq_omni from {Path(zmq_omni.__file__).parent}):"
        f" {args.reps} reps; paced {args.paced_requests} x {args.chunks_paced}"
        f" chunks at {args.pace_ms:g} ms; burst {args.requests} x {args.chunks}; P = {args.prompt_len}",
        flush=True,
    )
    results: dict[str, list[RunResult]] = {b: [] for b in backends}
    for rep in range(args.reps):
        order = backends[rep % len(backends) :] + backends[: rep % len(backends)]
        for backend in order:
            result = run_once(checkout, backend, args, f"{nonce}r{rep}{backends.index(backend)}")
            results[backend].append(result)
            print(
                f"  rep {rep} {backend:13s} chunk0 p50 {statistics.median(result.chunk0_ms):6.2f} ms"
                f"  per-chunk p50 {pct(result.per_chunk_ms, 0.5):6.2f} p99 {pct(result.per_chunk_ms, 0.99):6.2f} ms"
                f"  {result.chunks_per_s:7.1f} chunks/s (hop 1 {result.hop1_chunks_per_s:.0f})"
                f"  put p50 {pct(result.put_us, 0.5):7.1f} us (paced {pct(result.paced_put_us, 0.5):.1f})"
                f"  (hops p50 ms: {', '.join(f'{k} {pct(v, 0.5):.2f}' for k, v in result.hops_ms.items())};"
                f" thinker shm puts {result.shm_puts if result.shm_puts is not None else '-'})",
                flush=True,
            )
            if args.cpu:
                print_cpu(result)
    report(results, args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
