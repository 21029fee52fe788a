"""The soak of issue 13: a three-stage pipeline under faults, checked for leaks and lost requests.

Three StageWorker processes (``tests/soak_stages.py``: thinker -> talker -> vocoder)
and a :class:`~zmq_omni.PipelineDriver` in this process stream rounds of requests,
over ipc with shared memory on or over tcp (loopback). In every round a mix of
requests is cancelled by the talker mid-stream (ids ``*-cancel``), raises in the
vocoder's function (``*-raise``) or reuses an id of the round before (a fresh
driver per round, as a second ``zmq-omni drive`` against running stages); in one
round the talker is killed with SIGKILL mid-stream and restarted.

:func:`run_soak` returns a :class:`SoakReport` (figures and the list of
``problems``, empty when the soak passed); ``tests/test_soak.py`` asserts on it.
Run it by hand for the figures::

    python -m tests.soak --transport ipc-shm      # or tcp; --rounds/--per-round/--chunks

Sizes come from the environment (CI defaults in brackets): ``ZMQ_OMNI_SOAK_ROUNDS``
[10], ``ZMQ_OMNI_SOAK_PER_ROUND`` [40], ``ZMQ_OMNI_SOAK_CHUNKS`` [12].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tests.ports import reserve_port
from tests.soak_stages import CANCEL_REASON, RAISE_MESSAGE, ROWS, chunk_values

REPO = Path(__file__).resolve().parent.parent
STAGES = (("thinker", "0"), ("talker", "1"), ("vocoder", "2"))
#: A stage's RSS may grow this much between the first and the last third of the steady run (the rounds after
#: the kill round drained): measured noise is 0-2.1 MiB (allocator and pool warm-up of a process moving 16 KiB
#: chunks). With the CI sizes (320 steady requests) it catches a leak of about 40 KiB or more per request, and
#: a queue or mailbox that keeps growing (today's dead edge grows the thinker by ~20 MiB).
#: Plus what the window may hold in flight at a stage (``max_unacked`` puts of ~16 KiB: the allocator's
#: high-water mark can rise by that much whenever a round fills it further than before), with room to spare.
RSS_GROWTH_BOUND_KIB = 8 * 1024 + 16 * 1024


@dataclass(frozen=True)
class SoakSettings:
    """How big the soak is and the bounds it holds requests to."""

    transport: str  # "ipc-shm" or "tcp"
    rounds: int = 10
    per_round: int = 40
    chunks: int = 12
    kill_stage: str = "talker"
    kill_round: int = 1
    stall_timeout_s: float = 3.0
    request_timeout_s: float = 40.0
    #: The send window (puts held unconsumed per sender): far below one round's output (per_round x chunks =
    #: 480) and the run's (4,800), so a stage always has more in flight than its window holds: announcements
    #: share the window with the chunks and must still never wait behind chunks nobody will consume (the
    #: stages put a request's chunks only after its announcement, and announcements first), and chunks
    #: that cancelled or failed requests left held would exhaust it within the run ("left at the end" sees any).
    max_unacked: int = 128
    #: A cancelled / raising request must end this long after its submission at most.
    fault_bound_s: float = 20.0
    #: A reused id must be refused this fast (the stage knows at once; stalls take stall_timeout_s).
    reuse_bound_s: float = 10.0
    #: Push receivers drop items no ``get`` took within this long (``unclaimed_ttl_s``): after the kill,
    #: the restarted talker is resent chunks of requests announced to the dead one, which no get will take.
    unclaimed_ttl_s: float = 5.0
    #: How long the stages get to empty every window, mailbox and pending set after the kill round (before
    #: the next round starts) and after the last round.
    quiesce_s: float = 30.0

    @classmethod
    def from_env(cls, transport: str) -> SoakSettings:
        """Settings with sizes from ``ZMQ_OMNI_SOAK_ROUNDS`` / ``_PER_ROUND`` / ``_CHUNKS``."""
        return cls(
            transport=transport,
            rounds=int(os.environ.get("ZMQ_OMNI_SOAK_ROUNDS", "10")),
            per_round=int(os.environ.get("ZMQ_OMNI_SOAK_PER_ROUND", "40")),
            chunks=int(os.environ.get("ZMQ_OMNI_SOAK_CHUNKS", "12")),
        )


def kind_of(round_index: int, index: int) -> str:
    """The fault a request gets: one in eight is cancelled, one raises, one reuses an id (after round 0)."""
    slot = index % 8
    if slot == 3:
        return "cancel"
    if slot == 5:
        return "raise"
    if slot == 7 and round_index > 0:
        return "reuse"
    return "normal"


def request_id(round_index: int, index: int) -> str:
    """The id of request ``index`` of a round; a reuse takes the id of a normal request of the round before."""
    kind = kind_of(round_index, index)
    if kind == "reuse":
        return f"r{round_index - 1}-{index - 1:03d}"
    suffix = {"cancel": "-cancel", "raise": "-raise"}.get(kind, "")
    return f"r{round_index}-{index:03d}{suffix}"


@dataclass
class Outcome:
    """What the driver saw of one request."""

    request_id: str
    kind: str
    round: int
    seed: int
    submitted: float
    ended: float | None = None
    status: str | None = None  # "completed" or "failed"
    reason: str = ""
    seqs: list[int] = field(default_factory=list)
    bad_chunks: int = 0
    events_after_end: int = 0
    disturbed: bool = False  # in flight when the stage was killed

    @property
    def latency(self) -> float:
        return (self.ended or time.time()) - self.submitted


@dataclass
class SoakReport:
    """The soak's figures and what went wrong (``problems`` is empty when it passed)."""

    settings: SoakSettings
    outcomes: list[Outcome]
    rss_kib: dict[str, dict[str, float]]
    final_status: dict[str, dict[str, Any]]
    leftovers: dict[str, list[str]]
    dropped: dict[str, dict[str, int]]
    shm_left: list[str]
    exit_codes: dict[str, int | None]
    kill: dict[str, float]
    steady_deltas: dict[str, dict[str, int]]
    wall_s: float
    problems: list[str]

    def summary(self) -> str:
        """The figures as text."""
        by_kind: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            key = f"{o.kind}{' (in flight at the kill)' if o.disturbed else ''}"
            row = by_kind.setdefault(key, {})
            row[o.status or "unended"] = row.get(o.status or "unended", 0) + 1
        chunks = sum(len(o.seqs) for o in self.outcomes)
        lines = [
            f"soak over {self.settings.transport}: {len(self.outcomes)} requests in {self.settings.rounds} rounds, "
            f"{self.settings.chunks} chunks each, {chunks} chunks delivered to the driver, wall {self.wall_s:.1f} s",
        ]
        lines += [f"  {kind:32s} {json.dumps(row, sort_keys=True)}" for kind, row in sorted(by_kind.items())]
        reasons: dict[str, int] = {}
        for o in self.outcomes:
            if o.status == "failed":
                short = o.reason.split(": ", 1)[-1][:90]
                reasons[short] = reasons.get(short, 0) + 1
        lines.append("  failure reasons:")
        lines += [f"    {n:4d} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
        lines.append(f"  kill: {json.dumps(self.kill)}")
        lines.append("  stage counters (the last incarnation of each):")
        for name, _ in STAGES:
            status = self.final_status.get(name, {})
            counts = {k: status.get(k) for k in ("requests", "completed", "failed", "cancelled", "refused")}
            counts.update({k: status.get(k) for k in ("chunks_in", "chunks_out")})
            lines.append(f"    {name:8s} {json.dumps(counts)}")
        lines.append(f"  RSS (KiB; bound on growth {RSS_GROWTH_BOUND_KIB} KiB between the thirds of the steady run):")
        for stage, rss in self.rss_kib.items():
            lines.append(f"    {stage:8s} {json.dumps(rss)}")
        lines.append(f"  dropped/expired counters at the end: {json.dumps(self.dropped, sort_keys=True)}")
        lines.append(
            f"  failure counters that moved in the steady run: {json.dumps(self.steady_deltas, sort_keys=True)}"
        )
        lines.append(f"  left at the end: {json.dumps(self.leftovers, sort_keys=True)}")
        lines.append(f"  shared memory left: {self.shm_left}")
        lines.append(f"  exit codes: {self.exit_codes}")
        lines.append(f"  problems ({len(self.problems)}):")
        lines += [f"    - {p}" for p in self.problems[:40]]
        return "\n".join(lines)


def _walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    else:
        yield path, obj


#: Health fields that count held items: the worker's pending sets, windows (``pending``), mailboxes.
_HOLDERS = (
    "active_requests",
    "running_generators",
    "refused_draining",
    "closing_requests",
    "pending",
    "mailbox",
    "undelivered",
)
#: The chunk manager's per-request state and save queue.
_CHUNK_HOLDERS = ("chunks.sending", "chunks.receiving", "chunks.queued", "chunks.parked")


def leftovers(status: Mapping[str, Any]) -> list[str]:
    """What a stage (or the driver) still holds: every pending set, window and mailbox that is not empty."""
    held = []
    for path, value in _walk(status):
        name = path.rsplit(".", 1)[-1]
        if not isinstance(value, int) or isinstance(value, bool) or value == 0:
            continue
        if name in _HOLDERS or path.endswith(_CHUNK_HOLDERS):
            held.append(f"{path}={value}")
    return held


def dropped_counters(status: Mapping[str, Any]) -> dict[str, int]:
    """Counters that say what was dropped or expired, and why (whatever names the layers use)."""
    words = ("drop", "expire", "tombstone", "dispos", "orphan", "refused", "cancelled", "stale")
    return {
        path: value
        for path, value in _walk(status)
        if isinstance(value, int) and not isinstance(value, bool) and value and any(w in path for w in words)
    }


#: Counters that must not move in the steady run (no kill there): no unconfirmed delivery, no put timeout, no
#: rejected frame or reply, no put left unclaimed at its receiver. Send failures may move only as far as the
#: receiver reported puts dropped because their request was cancelled or failed there
#: (``receiver_dropped_cancelled``: the chunks a stage sent after the next one gave the request up).
_STEADY_COUNTERS = (
    "chunks.send_failures",
    "delivery_failures",
    "rejected_frames",
    "outbound.timeouts",
    "receiver_dropped_unclaimed",
    "receiver_dropped_cancelled",
)
_SEND_FAILURES = "chunks.send_failures"
_DROPPED_CANCELLED = "chunks.connector.outbound.receiver_dropped_cancelled"


def steady_counters(status: Mapping[str, Any]) -> dict[str, int]:
    """The values of ``_STEADY_COUNTERS`` in a stage's status, by path."""
    return {
        path: value
        for path, value in _walk(status)
        if path.endswith(_STEADY_COUNTERS) and isinstance(value, int) and not isinstance(value, bool)
    }


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Soak:
    """The stages, the driver rounds and the checks of one soak run (use :func:`run_soak`)."""

    def __init__(self, settings: SoakSettings, workdir: Path) -> None:
        self.s = settings
        self.workdir = workdir
        self.shm_dir: str | None = None
        if settings.transport == "ipc-shm":
            self.shm_dir = tempfile.mkdtemp(prefix="zs-", dir="/dev/shm")
        self.config = workdir / "pipeline.yaml"
        self._write_config()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.all_pids: list[int] = []
        self.rss: dict[str, list[tuple[float, int, int]]] = {name: [] for name, _ in STAGES}
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self.problems: list[str] = []
        self.kill: dict[str, float] = {}
        self.exit_codes: dict[str, int | None] = {}

    # -- setup ------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        s = self.s
        if s.transport == "ipc-shm":
            endpoints = {name: f"ipc://{self.workdir}/{name}.sock" for name in ("driver", *(n for n, _ in STAGES))}
        elif s.transport == "tcp":
            endpoints = {name: f"tcp://127.0.0.1:{reserve_port()}" for name in ("driver", *(n for n, _ in STAGES))}
        else:
            raise ValueError(f"unknown transport {s.transport!r}")
        extra: dict[str, Any] = {
            "put_timeout_s": 2.0,
            "delivery_timeout_s": 5.0,
            "peer_timeout_s": 1.0,
            "heartbeat_s": 0.2,
            "max_unacked": s.max_unacked,
            "unclaimed_ttl_s": s.unclaimed_ttl_s,
        }
        if self.shm_dir is not None:
            extra.update({"shm": "on", "shm_dir": self.shm_dir, "shm_threshold": 8192})
        else:
            extra["shm"] = "off"
        doc = {
            "pipeline": {
                "name": f"soak-{s.transport}",
                "stall_timeout_s": s.stall_timeout_s,
                "request_timeout_s": s.request_timeout_s,
                "retry": {"attempts": 2, "deadline_s": 1.0},
                "driver": {"stage_id": "driver", "endpoint": endpoints["driver"]},
                "stages": [
                    {
                        "name": name,
                        "stage_id": sid,
                        "function": f"tests.soak_stages:{name}",
                        "endpoint": endpoints[name],
                    }
                    for name, sid in STAGES
                ],
            },
            "runtime": {"connectors": {"edge": {"name": "ZmqConnector", "extra": extra}}, "default_connector": "edge"},
        }
        self.config.write_text(yaml.safe_dump(doc), encoding="utf-8")

    def status_path(self, name: str) -> Path:
        return self.workdir / f"{name}.status.json"

    def status(self, name: str) -> dict[str, Any]:
        try:
            loaded = json.loads(self.status_path(name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def log(self, name: str) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"

    def start_stage(self, name: str) -> None:
        self.status_path(name).unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        with open(self.workdir / f"{name}.log", "a", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.soak_stages", str(self.config), name, str(self.status_path(name))],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.procs[name] = proc
        self.all_pids.append(proc.pid)

    def wait_ready(self, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.status(name).get("pid") != self.procs[name].pid:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"stage {name} exited ({self.procs[name].returncode}):\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {name} not ready within {timeout} s:\n{self.log(name)}")
            time.sleep(0.05)

    def _sample(self) -> None:
        while not self._sampling.wait(0.2):
            now = time.time()
            for name, proc in list(self.procs.items()):
                kib = _rss_kib(proc.pid)
                if kib is not None and proc.poll() is None:
                    self.rss[name].append((now, proc.pid, kib))

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        from zmq_omni import PipelineDriver, load_pipeline_config

        started = time.time()
        for name, _ in reversed(STAGES):
            self.start_stage(name)
        for name, _ in STAGES:
            self.wait_ready(name)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        pipeline = load_pipeline_config(self.config)
        outcomes: list[Outcome] = []
        steady_from = started
        steady_start: dict[str, dict[str, int]] = {}
        driver_status: dict[str, Any] = {}
        for round_index in range(self.s.rounds):
            driver = PipelineDriver.from_pipeline(pipeline)
            try:
                outcomes += self._round(driver, round_index)
                if round_index == self.s.kill_round:
                    # The next round starts once the pipeline drained what the kill left (bounded: a problem if not).
                    since = time.time()
                    held = self._quiesce(driver)[1]
                    self.kill["drained_after_s"] = round(time.time() - since, 2)
                    if held:
                        self.problems.append(f"not drained {self.s.quiesce_s} s after the kill round: {held}")
                    steady_from = time.time()
                    steady_start = {name: steady_counters(self.status(name)) for name, _ in STAGES}
                if round_index == self.s.rounds - 1:
                    driver_status = self._quiesce(driver)[0]
            finally:
                driver.close()
        ended = time.time()
        self._sampling.set()
        self._sampler.join(2)
        final_status = {name: self.status(name) for name, _ in STAGES}
        final_status["driver"] = driver_status
        steady_deltas = {
            name: moved
            for name, before in steady_start.items()
            if (
                moved := {
                    path: value - before.get(path, 0)
                    for path, value in steady_counters(final_status[name]).items()
                    if value != before.get(path, 0)
                }
            )
        }
        for name, moved in steady_deltas.items():
            unexplained = dict(moved)
            explained = unexplained.pop(_DROPPED_CANCELLED, 0)
            if unexplained.get(_SEND_FAILURES, 0) <= explained:
                unexplained.pop(_SEND_FAILURES, None)
            if unexplained:
                self.problems.append(
                    f"stage {name}: failure counters moved in the steady run: {unexplained} "
                    f"(puts its receiver dropped as cancelled: {explained})"
                )
        self._stop_stages()
        shm_left = self._shm_left()
        return SoakReport(
            settings=self.s,
            outcomes=outcomes,
            rss_kib=self._rss_verdicts(steady_from, ended),
            final_status=final_status,
            leftovers={name: kept for name, st in final_status.items() if (kept := leftovers(st))},
            dropped={name: dropped_counters(st) for name, st in final_status.items()},
            shm_left=shm_left,
            exit_codes=self.exit_codes,
            kill=self.kill,
            steady_deltas=steady_deltas,
            wall_s=ended - started,
            problems=self.problems + self._check(outcomes, final_status, shm_left),
        )

    def _round(self, driver: Any, round_index: int) -> list[Outcome]:
        s = self.s
        outcomes: dict[str, Outcome] = {}
        for index in range(s.per_round):
            rid = request_id(round_index, index)
            seed = round_index * s.per_round + index
            outcomes[rid] = Outcome(rid, kind_of(round_index, index), round_index, seed, time.time())
            driver.submit(rid, {"n": s.chunks, "seed": seed})
        deadline = time.monotonic() + s.request_timeout_s + 15
        if round_index == s.kill_round:
            # Killed 0.3 s after the round's submissions, before the driver reads any of it back: the round
            # is streaming through the stages then. (A trigger on what the driver has read could miss the
            # whole round on a loaded machine, where one poll may bring all of it at once.)
            time.sleep(0.3)
            self._kill_and_restart(outcomes)
        while driver.pending and time.monotonic() < deadline:
            for event in driver.poll(0.05):
                self._apply(outcomes, event)
        for o in outcomes.values():
            if o.ended is None:
                self.problems.append(f"{o.request_id} (round {round_index}, {o.kind}) never ended")
        return list(outcomes.values())

    def _apply(self, outcomes: dict[str, Outcome], event: Any) -> None:
        o = outcomes.get(event.request_id)
        if o is None:
            self.problems.append(f"an event for unknown request {event.request_id}: {event.kind}")
            return
        if o.ended is not None:
            o.events_after_end += 1
            return
        seq = event.data.get("seq")
        x = event.data.get("x")
        if seq is not None:
            seq = [int(k) for k in seq]
            if not isinstance(x, np.ndarray) or x.shape != (ROWS * len(seq), x.shape[1]):
                o.bad_chunks += len(seq)
            else:
                for j, k in enumerate(seq):
                    expected = chunk_values(o.seed, k) * 2 + 1
                    if not np.array_equal(x[j * ROWS : (j + 1) * ROWS], expected):
                        o.bad_chunks += 1
            o.seqs.extend(seq)
        if event.kind in ("completed", "failed"):
            o.ended, o.status, o.reason = event.at, event.kind, event.reason

    def _kill_and_restart(self, outcomes: dict[str, Outcome]) -> None:
        name = self.s.kill_stage
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.exit_codes[f"{name} (killed, pid {proc.pid})"] = proc.returncode
        self.kill["killed_at"] = time.time()
        for o in outcomes.values():
            if o.ended is None:
                o.disturbed = True
        self.start_stage(name)
        self.wait_ready(name)
        self.kill["restarted_after_s"] = round(time.time() - self.kill["killed_at"], 2)
        self.kill["in_flight"] = sum(1 for o in outcomes.values() if o.disturbed)

    def _quiesce(self, driver: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
        """Wait until every stage and the driver hold nothing; the driver's health and what is still held."""
        deadline = time.monotonic() + self.s.quiesce_s
        while True:
            driver.poll(0.05)
            held = {
                name: h for name in ("driver", *(n for n, _ in STAGES)) if (h := leftovers(self._health(name, driver)))
            }
            if not held or time.monotonic() > deadline:
                time.sleep(0.3)  # one more status write, so the report shows the state the verdict saw
                return dict(driver.health()), held

    def _health(self, name: str, driver: Any) -> dict[str, Any]:
        return dict(driver.health()) if name == "driver" else self.status(name)

    def _stop_stages(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.exit_codes[name] = proc.returncode

    def _shm_left(self) -> list[str]:
        from zmq_omni.shm import default_shm_dir, parse_name

        left: list[str] = []
        if self.shm_dir is not None:
            left += [f"{self.shm_dir}/{n}" for n in os.listdir(self.shm_dir)]
        pids = {*self.all_pids, os.getpid()}
        for n in os.listdir(default_shm_dir()):
            owner = parse_name(n)
            if owner is not None and owner.pid in pids:
                left.append(f"{default_shm_dir()}/{n}")
        return left

    def _rss_verdicts(self, steady_from: float, ended: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name, samples in self.rss.items():
            if not samples:
                self.problems.append(f"no RSS sample of stage {name}")
                continue
            last_pid = samples[-1][1]
            series = [kib for t, pid, kib in samples if pid == last_pid and steady_from <= t <= ended]
            row: dict[str, float] = {"first": samples[0][2], "last": samples[-1][2], "max": max(k for *_, k in samples)}
            if len(series) < 6:
                self.problems.append(f"stage {name}: only {len(series)} RSS samples in the steady run")
                out[name] = row
                continue
            third = len(series) // 3
            early, late = statistics.median(series[:third]), statistics.median(series[-third:])
            row.update({"steady_first_third": early, "steady_last_third": late, "growth": late - early})
            if late - early > RSS_GROWTH_BOUND_KIB:
                self.problems.append(
                    f"stage {name}: RSS grew {late - early:.0f} KiB between the first and last third of the steady "
                    f"run ({early:.0f} -> {late:.0f} KiB; bound {RSS_GROWTH_BOUND_KIB} KiB)"
                )
            out[name] = row
        return out

    # -- the verdict --------------------------------------------------------------------------------
    def _check(self, outcomes: list[Outcome], final: dict[str, dict[str, Any]], shm_left: list[str]) -> list[str]:
        s = self.s
        problems: list[str] = []
        if not self.kill.get("in_flight"):
            problems.append(f"the kill of the {s.kill_stage} caught no request mid-stream: {self.kill}")
        for o in outcomes:
            label = f"{o.request_id} (round {o.round}, {o.kind})"
            if o.ended is None:
                continue  # reported by _round
            if o.events_after_end:
                problems.append(f"{label}: {o.events_after_end} events after it ended")
            if o.bad_chunks:
                problems.append(f"{label}: {o.bad_chunks} chunks with wrong contents")
            if o.seqs != list(range(len(o.seqs))):
                problems.append(f"{label}: chunks lost, duplicated or out of order: {o.seqs}")
            if o.status == "completed" and len(o.seqs) != s.chunks:
                problems.append(f"{label}: completed with {len(o.seqs)} of {s.chunks} chunks")
            if o.status == "failed" and not o.reason:
                problems.append(f"{label}: failed without a reason")
            if o.latency > s.request_timeout_s + 2:
                problems.append(f"{label}: ended after {o.latency:.1f} s (bound {s.request_timeout_s} s)")
            if o.disturbed:
                continue  # in flight at the kill: completed intact, or failed with its reason, in its bound
            expected = {
                "normal": ("completed", ""),
                "cancel": ("failed", f"cancelled: {CANCEL_REASON}"),
                "raise": ("failed", f"RuntimeError: {RAISE_MESSAGE}"),
                "reuse": ("failed", "its stream"),
            }[o.kind]
            refused = o.kind != "reuse" or any(
                f"request {o.request_id!r} {why}" in o.reason
                for why in ("already ended its stream", "is ending its stream", "is already in flight")
            )
            if o.status != expected[0] or expected[1] not in o.reason or not refused:
                problems.append(f"{label}: {o.status} ({o.reason!r}); expected {expected[0]} {expected[1]!r}")
            bound = {"cancel": s.fault_bound_s, "raise": s.fault_bound_s, "reuse": s.reuse_bound_s}.get(o.kind)
            if bound is not None and o.latency > bound:
                problems.append(f"{label}: ended after {o.latency:.1f} s (bound {bound} s)")
        for name, status in final.items():
            if not status:
                problems.append(f"{name}: no status at the end")
            elif held := leftovers(status):
                problems.append(f"{name} still holds after {s.quiesce_s} s: {', '.join(held)}")
        for name, code in self.exit_codes.items():
            if "killed" not in name and code != 0:
                problems.append(f"stage {name} exited {code}")
        if shm_left:
            problems.append(f"shared memory left behind: {shm_left}")
        return problems

    def close(self) -> None:
        self._sampling.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.shm_dir is not None:
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(f"--- stage {name} ---\n{self.log(name)}" for name, _ in STAGES)


def run_soak(settings: SoakSettings, workdir: Path) -> tuple[SoakReport, str]:
    """Run one soak in ``workdir`` (a short path: ipc endpoints live there); the report and the stages' logs."""
    soak = Soak(settings, workdir)
    try:
        return soak.run(), soak.logs()
    finally:
        soak.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--transport", choices=("ipc-shm", "tcp"), default="ipc-shm")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--per-round", type=int)
    parser.add_argument("--chunks", type=int)
    parser.add_argument("--logs", action="store_true", help="print the stages' logs too")
    args = parser.parse_args()
    settings = SoakSettings.from_env(args.transport)
    overrides = {
        k: v for k, v in (("rounds", args.rounds), ("per_round", args.per_round), ("chunks", args.chunks)) if v
    }
    settings = SoakSettings(**{**settings.__dict__, **overrides})
    workdir = Path(tempfile.mkdtemp(prefix="zo-soak-", dir="/tmp"))
    try:
        report, logs = run_soak(settings, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(report.summary())
    if args.logs:
        print(logs)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
