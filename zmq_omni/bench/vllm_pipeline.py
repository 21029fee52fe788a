"""vllm-omni pipeline grid: Qwen3-Omni's three stages with vllm-omni main's call patterns, per connector.

Three stage processes per backend, thinker (0) -> talker (1) -> code2wav (2),
each with one connector and main's chunk adapter loops (restated in
``zmq_omni.bench._vllm_main``): a save thread putting one chunk at a time,
``put(from_stage=str(s), to_stage=str(s + 1), put_key=f"{rid}_{s}_{n}", data=payload)``,
and a receive loop polling ``get(str(s - 1), str(s), key)`` without metadata,
waiting 1 ms when nothing arrived. Payloads are main's ``OmniPayloadStruct``
(msgspec Structs holding torch tensors) shaped as main's Qwen3-Omni stage
input processors build them: thinker chunk 0 ~1.02 MiB (``[P + 1, 2048]``
bf16 twice, P = 128), later thinker chunks 4 KiB, code2wav chunks 64, 464,
then 800 int64 codes (see ``zmq_omni.bench._vllm_stage``). Every chunk's
values are checked where it arrives; a wrong value fails the run.

Backends (:data:`BACKENDS`), all in the same run, interleaved per repetition:

* ``main-shm``: the baseline, main's ``SharedMemoryConnector`` restated
  (serialize with main's msgspec serializer, a new segment and a lock file per
  put; get copies out and unlinks);
* ``push-ipc``: ``ZmqConnector`` push mode over ``ipc://``, ``shm: auto``;
* ``push-tcp``: push mode over ``tcp://127.0.0.1``, ``shm: off``;
* ``pull-tcp``: pull mode over ``tcp://127.0.0.1``, ``shm: auto``.

Figures (times are ``time.monotonic()``, one clock for every process of the host):

* **end-to-end time of chunk n** of a request: from the moment the thinker's
  save thread calls ``put`` for thinker chunk n to the moment code2wav's
  receive loop has code2wav chunk n in hand (its ``get`` returned it). Chunk n
  of code2wav is the one the talker queued when thinker chunk n arrived, so
  the time covers both hops and both stages' loops (the talker checks thinker
  chunk n after queueing code2wav chunk n; code2wav checks after taking the time);
* **paced** workload: one request at a time, a thinker chunk every
  ``pace_s`` (20 ms); *chunk 0* is chunk 0's end-to-end time (the ~1 MiB
  chunk), *chunk p50/p99* are over every chunk of the paced requests;
* **throughput** workload: ``requests`` (8) requests of ``chunks`` (50)
  chunks, all queued at once: chunks/s = ``requests x chunks`` / (the last
  code2wav arrival - the first thinker put's start);
* **put 4 KiB p50/p99**: how long the thinker's ``put`` of a 4 KiB chunk took,
  in the paced workload (``put 1 MiB``: its chunk 0);
* **cold chunk 0**: chunk 0's end-to-end time in the first request after the
  processes started (one warm-up request of 3 chunks; not in the medians).

Each repetition measures every backend; a row's figure is the median over
repetitions of that repetition's figure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..transport import reserve_loopback_port
from ._common import Comparison, percentile

__all__ = [
    "BACKENDS",
    "BASELINE",
    "INSTALL_HINT",
    "PipelineResult",
    "PipelineRow",
    "missing_dependencies",
    "run_vllm_pipeline",
]

BACKENDS: dict[str, str] = {
    "main-shm": "main's SharedMemoryConnector (restated)",
    "push-ipc": "ZmqConnector push ipc, shm auto",
    "push-tcp": "ZmqConnector push tcp, shm off",
    "pull-tcp": "ZmqConnector pull tcp, shm auto",
}
BASELINE = "main-shm"
INSTALL_HINT = "pip install 'zmq-omni[torch,payloads]'"
_GRID = "vllm"
_BASELINE_NAME = "main's SharedMemoryConnector, restated"
_SHM_DIR = Path("/dev/shm")
#: The YAML keys main's Qwen3-Omni deploy gives its connector (for its stage input processors).
_CODEC_KEYS = {"initial_codec_chunk_frames": 4, "codec_chunk_frames": 25, "codec_left_context_frames": 25}
_WARMUP_CHUNKS = 3


def missing_dependencies() -> list[str]:
    """The packages this grid needs that are not installed (torch, msgspec); empty when it can run."""
    return [name for name in ("torch", "msgspec") if importlib.util.find_spec(name) is None]


@dataclass(frozen=True)
class PipelineRow:
    """One backend's figures (seconds; ``chunks_per_s`` a rate): medians over the repetitions."""

    backend: str
    label: str
    chunk0: float
    chunk_p50: float
    chunk_p99: float
    chunks_per_s: float
    put_small_p50: float
    put_small_p99: float
    put_chunk0_p50: float
    hop1_p50: float
    cold_chunk0: float


@dataclass(frozen=True)
class PipelineResult:
    """Every backend's row, the baseline's included, and what was run."""

    rows: tuple[PipelineRow, ...]
    repeats: int
    paced_requests: int
    paced_chunks: int
    pace_s: float
    requests: int
    chunks: int
    checked_chunks: int
    settings: dict[str, Any] = field(default_factory=dict)

    def row(self, backend: str) -> PipelineRow:
        """The row of ``backend``."""
        return next(r for r in self.rows if r.backend == backend)

    def comparisons(self) -> list[Comparison]:
        """Each ZmqConnector backend against the restated SharedMemoryConnector of the same run."""
        if BASELINE not in {r.backend for r in self.rows}:
            return []
        base = self.row(BASELINE)
        out = []
        for r in self.rows:
            if r.backend == BASELINE:
                continue
            name = f"vllm pipeline {r.backend}"
            out += [
                Comparison(_GRID, name, "chunk0 paced", r.chunk0, base.chunk0, _BASELINE_NAME),
                Comparison(_GRID, name, "p50 paced", r.chunk_p50, base.chunk_p50, _BASELINE_NAME),
                Comparison(_GRID, name, "p99 paced", r.chunk_p99, base.chunk_p99, _BASELINE_NAME),
                Comparison(
                    _GRID,
                    name,
                    f"{self.requests}x{self.chunks} rate",
                    r.chunks_per_s,
                    base.chunks_per_s,
                    _BASELINE_NAME,
                    "chunks/s",
                ),
                Comparison(_GRID, name, "put 4K p50", r.put_small_p50, base.put_small_p50, _BASELINE_NAME),
            ]
        return out


# -- what each backend's stages are given ---------------------------------------------------------------------------
def _backend_spec(name: str, tmp: Path) -> dict[str, Any]:
    if name == BASELINE:
        return {"name": name, "connector": "main-shm", "extra": dict(_CODEC_KEYS)}
    mode, transport = name.split("-")
    if transport == "ipc":
        endpoints = {str(s): f"ipc://{tmp}/{name}-{s}.sock" for s in (0, 1, 2)}
    else:
        endpoints = {str(s): f"tcp://127.0.0.1:{reserve_loopback_port()}" for s in (0, 1, 2)}
    shm = "off" if name == "push-tcp" else "auto"
    extra = {**_CODEC_KEYS, "mode": mode, "shm": shm, "endpoints": endpoints}
    return {"name": name, "connector": "ZmqConnector", "extra": extra}


# -- the three processes of one backend -----------------------------------------------------------------------------
class _StageFailure(RuntimeError):
    """A stage reported a problem, died, or a job ran out of time; ``backend`` names whose."""

    def __init__(self, backend: str, message: str) -> None:
        super().__init__(f"vllm pipeline, backend {backend}: {message}")
        self.backend = backend


@dataclass
class _JobRecords:
    puts: list[tuple[str, int, float, float]]
    talker: list[tuple[str, int, float]]
    code2wav: list[tuple[str, int, float]]


class _Pipeline:
    """Three stage processes of one backend, driven over one pipe each; only the caller's thread uses it."""

    def __init__(self, ctx: Any, spec: dict[str, Any], shapes: Any, tmp: Path) -> None:
        from ._vllm_stage import stage_main

        self.name: str = spec["name"]
        self.logs = {stage: tmp / f"{self.name}-stage{stage}.log" for stage in (0, 1, 2)}
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, mp_connection.Connection] = {}
        for stage in (0, 1, 2):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=stage_main,
                args=(stage, spec, shapes, theirs, str(self.logs[stage])),
                name=f"bench-{self.name}-stage{stage}",
                daemon=True,
            )
            self.conns[stage] = mine
            self.procs[stage] = proc
            proc.start()
            theirs.close()

    def _expect(self, what: str, stages: set[int], deadline: float) -> dict[int, tuple[Any, ...]]:
        """Wait for message ``what`` from each of ``stages``; a problem, a death or the deadline raises."""
        got: dict[int, tuple[Any, ...]] = {}
        by_conn = {id(conn): stage for stage, conn in self.conns.items()}
        while set(got) != stages:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(stages - set(got))
                raise _StageFailure(self.name, f"no {what!r} from stage(s) {missing} in time")
            for ready in mp_connection.wait(list(self.conns.values()), timeout=min(left, 0.5)):
                stage = by_conn[id(ready)]
                try:
                    message = self.conns[stage].recv()
                except EOFError:
                    raise _StageFailure(self.name, f"stage {stage} exited") from None
                if message[0] == "problem":
                    raise _StageFailure(self.name, f"stage {message[1]}: {message[2]}")
                if message[0] == what:
                    got[stage] = message
            for stage, proc in self.procs.items():
                if proc.exitcode is not None:
                    raise _StageFailure(self.name, f"stage {stage} exited with {proc.exitcode}")
        return got

    def wait_up(self, timeout_s: float) -> None:
        self._expect("up", {0, 1, 2}, time.monotonic() + timeout_s)

    def run(self, job: Any, timeout_s: float) -> _JobRecords:
        deadline = time.monotonic() + timeout_s
        for stage in (1, 2):
            self.conns[stage].send(("job", job))
        self._expect("ready", {1, 2}, deadline)
        self.conns[0].send(("job", job))
        done = self._expect("done", {0, 1, 2}, deadline)
        for stage, message in done.items():
            if message[1] != job.job_id:
                raise _StageFailure(self.name, f"stage {stage} answered job {message[1]}, not {job.job_id}")
        return _JobRecords(puts=done[0][3], talker=done[1][4], code2wav=done[2][4])

    def stop(self, stage: int) -> None:
        """Ask ``stage`` to close its connector and exit."""
        with contextlib.suppress(OSError):
            self.conns[stage].send(("stop",))

    def join(self, stage: int) -> bool:
        """Wait for ``stage`` to exit (then terminate it, then kill it); True when it exited on its own, with 0."""
        proc = self.procs[stage]
        proc.join(10)
        on_its_own: bool = proc.exitcode == 0
        if proc.exitcode is None:
            proc.terminate()
            proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
        self.conns[stage].close()
        return on_its_own

    def output(self, tail_chars: int = 4000) -> str:
        """Each stage's output (its last ``tail_chars`` characters)."""
        parts = []
        for stage, path in self.logs.items():
            text = path.read_text(errors="replace") if path.exists() else "(no output)"
            parts.append(f"--- {self.name} stage {stage} ---\n{text[-tail_chars:]}")
        return "\n".join(parts)


# -- figures --------------------------------------------------------------------------------------------------------
def _put_started(records: _JobRecords) -> dict[tuple[str, int], float]:
    return {(rid, n): t0 for rid, n, t0, _ in records.puts}


def _end_to_end(records: _JobRecords) -> dict[tuple[str, int], float]:
    started = _put_started(records)
    return {(rid, n): t - started[(rid, n)] for rid, n, t in records.code2wav}


@dataclass
class _Samples:
    chunk0: list[float] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)
    put_small: list[float] = field(default_factory=list)
    put_chunk0: list[float] = field(default_factory=list)
    hop1: list[float] = field(default_factory=list)

    def add_paced(self, records: _JobRecords) -> None:
        e2e = _end_to_end(records)
        started = _put_started(records)
        self.chunks += e2e.values()
        self.chunk0 += [t for (_, n), t in e2e.items() if n == 0]
        self.put_small += [t1 - t0 for _, n, t0, t1 in records.puts if n > 0]
        self.put_chunk0 += [t1 - t0 for _, n, t0, t1 in records.puts if n == 0]
        self.hop1 += [t - started[(rid, n)] for rid, n, t in records.talker]


def _rate(records: _JobRecords) -> float:
    first = min(t0 for _, _, t0, _ in records.puts)
    last = max(t for _, _, t in records.code2wav)
    return len(records.code2wav) / (last - first)


def _sweep_names(tag: str) -> list[str]:
    """Remove what the restated baseline of this run left in /dev/shm (its segments and lock files)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(_SHM_DIR):
            if entry.name.startswith((tag, f"shm_{tag}")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def run_vllm_pipeline(
    backends: Sequence[str] = tuple(BACKENDS),
    *,
    repeats: int = 3,
    paced_requests: int = 4,
    paced_chunks: int = 25,
    pace_s: float = 0.02,
    requests: int = 8,
    chunks: int = 50,
    prompt_len: int = 128,
    hidden: int = 2048,
    job_timeout_s: float = 120.0,
    on_progress: Callable[[str], None] | None = None,
) -> PipelineResult:
    """Run the pipeline on each backend, interleaved per repetition; medians over the repetitions.

    Args:
        backends: names from :data:`BACKENDS`; the baseline (``main-shm``) gives the ratios.
        repeats: repetitions; every backend is measured once in each.
        paced_requests: requests of the paced workload per repetition, one after another.
        paced_chunks: chunks per paced request (at least 2).
        pace_s: seconds between the thinker's chunks in the paced workload.
        requests: concurrent requests of the throughput workload.
        chunks: chunks per request of the throughput workload (at least 2).
        prompt_len: ``P``, the prompt length of thinker chunk 0 (``[P + 1, hidden]``).
        hidden: the hidden size of the thinker's tensors.
        job_timeout_s: how long one job (one workload on one backend) may take.
        on_progress: called with a line of text as the run goes.

    Returns:
        One row per backend.

    Raises:
        ImportError: torch or msgspec is missing (the message says what to install).
        RuntimeError: a stage saw a wrong value, a put failed, a stage died or a job ran out of time;
            the message holds the stages' output.
    """
    missing = missing_dependencies()
    if missing:
        raise ImportError(f"the vllm pipeline benchmark needs {' and '.join(missing)}: {INSTALL_HINT}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"unknown backends {unknown}; choose from {list(BACKENDS)}")
    if min(paced_chunks, chunks) < 2 or min(repeats, paced_requests, requests) < 1:
        raise ValueError("at least 2 chunks per request and 1 repetition, paced request and request")
    from ._vllm_stage import Job, PayloadShapes

    progress = on_progress or (lambda line: None)
    ctx = mp.get_context("forkserver")
    # Each stage process forks from a server that imported torch once, instead of importing it itself.
    ctx.set_forkserver_preload(["torch", "msgspec", "zmq_omni.bench._vllm_stage"])
    tag = f"zobench{os.getpid()}x{secrets.token_hex(3)}"
    tmp = Path(tempfile.mkdtemp(prefix="zo-vllm-", dir="/tmp"))
    shapes = PayloadShapes(prompt_len=prompt_len, hidden=hidden)
    pipelines: dict[str, _Pipeline] = {}
    failure: _StageFailure | None = None
    clean = True
    job_ids = iter(range(1, 1 << 30))

    def job(n_requests: int, n_chunks: int, pace: float | None) -> Job:
        job_id = next(job_ids)
        return Job(job_id, tuple(f"{tag}-j{job_id}r{i}" for i in range(n_requests)), n_chunks, pace)

    samples: dict[str, list[_Samples]] = {b: [] for b in backends}
    rates: dict[str, list[float]] = {b: [] for b in backends}
    cold: dict[str, float] = {}
    checked = 0
    try:
        for name in backends:
            pipelines[name] = _Pipeline(ctx, _backend_spec(name, tmp), shapes, tmp)
        for pipeline in pipelines.values():
            pipeline.wait_up(job_timeout_s)
        progress(f"{len(pipelines) * 3} stage processes up")
        for name, pipeline in pipelines.items():
            records = pipeline.run(job(1, _WARMUP_CHUNKS, None), job_timeout_s)
            cold[name] = _end_to_end(records)[(records.puts[0][0], 0)]
            checked += 2 * _WARMUP_CHUNKS
        for rep in range(repeats):
            order = list(backends[rep % len(backends) :]) + list(backends[: rep % len(backends)])
            for name in order:
                pipeline = pipelines[name]
                got = _Samples()
                for _ in range(paced_requests):
                    got.add_paced(pipeline.run(job(1, paced_chunks, pace_s), job_timeout_s))
                samples[name].append(got)
                rates[name].append(_rate(pipeline.run(job(requests, chunks, None), job_timeout_s)))
                checked += 2 * (paced_requests * paced_chunks + requests * chunks)
                progress(f"repetition {rep + 1}/{repeats}: {name} done")
    except _StageFailure as exc:
        failure = exc
    finally:
        # Upstream first, every backend at once: a sender closes while its receiver can still acknowledge.
        for stage in (0, 1, 2):
            for pipeline in pipelines.values():
                pipeline.stop(stage)
            for pipeline in pipelines.values():
                clean = pipeline.join(stage) and clean
        _sweep_names(tag)
        if not clean:
            # A stage that had to be killed may have left segments of our connectors: remove those of dead owners.
            from ..shm import sweep

            sweep()
        if failure is not None:
            output = pipelines[failure.backend].output() if failure.backend in pipelines else ""
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"{failure}\n{output}") from failure
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for name in backends:
        reps = samples[name]
        rows.append(
            PipelineRow(
                backend=name,
                label=BACKENDS[name],
                chunk0=statistics.median([statistics.median(s.chunk0) for s in reps]),
                chunk_p50=statistics.median([percentile(s.chunks, 50) for s in reps]),
                chunk_p99=statistics.median([percentile(s.chunks, 99) for s in reps]),
                chunks_per_s=statistics.median(rates[name]),
                put_small_p50=statistics.median([percentile(s.put_small, 50) for s in reps]),
                put_small_p99=statistics.median([percentile(s.put_small, 99) for s in reps]),
                put_chunk0_p50=statistics.median([statistics.median(s.put_chunk0) for s in reps]),
                hop1_p50=statistics.median([percentile(s.hop1, 50) for s in reps]),
                cold_chunk0=cold[name],
            )
        )
    return PipelineResult(
        rows=tuple(rows),
        repeats=repeats,
        paced_requests=paced_requests,
        paced_chunks=paced_chunks,
        pace_s=pace_s,
        requests=requests,
        chunks=chunks,
        checked_chunks=checked,
        settings={"prompt_len": prompt_len, "hidden": hidden, "tag": tag},
    )
