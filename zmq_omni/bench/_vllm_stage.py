"""One stage process of the vllm-omni pipeline benchmark, and the payloads its stages send and check.

Stage 0 (thinker) puts thinker chunks; stage 1 (talker) checks each one and
turns it into the code2wav chunk of the same index; stage 2 (code2wav) checks
those. The shapes are the facts of main's Qwen3-Omni stage input processors
(``thinker2talker_async_chunk``, ``talker2code2wav_async_chunk`` with
``initial_codec_chunk_frames: 4``, ``codec_chunk_frames: 25``,
``codec_left_context_frames: 25``, 16 codebooks), and main's chunk adapter
sets ``meta.finished`` and ``meta.is_segment_finished`` on every chunk:

* thinker chunk 0: ``embed.prefill`` and ``hidden_states.output`` of
  ``[P + 1, D]`` bf16, ``embed.tts_bos/tts_eos/tts_pad`` of ``[1, 1, D]``,
  ``ids.prompt`` (P ids) and ``ids.all`` (P + 1);
* thinker chunk n > 0: ``embed.decode`` of ``[1, D]`` bf16;
* code2wav chunk n: ``codes.audio``, 1-D int64 of 64, 464, then 800 values,
  with ``meta.left_context_size`` 0, 4, then 25. Main's talker emits a codec
  chunk every 25 of its own steps; here each thinker chunk yields one, so that
  every chunk has an end-to-end time.

Every value is checked where it arrives (the talker checks a thinker chunk
right after queueing the code2wav chunk it yields, so the check is off the
timed path): each tensor is a seeded base tensor
(the same in every process) whose first four elements carry ``(job, request,
chunk)`` as small integers, exact in bf16.

The process (:func:`stage_main`) is driven over a pipe by
:mod:`zmq_omni.bench.vllm_pipeline`: it answers ``up``, then for each job
``ready`` (the receivers registered its requests) and ``done`` with its
timings; a wrong value, a failed put or an error is sent at once as
``problem``. It closes its connector on ``stop``, on the pipe's end (the
parent died) and on SIGTERM; SIGINT is left to the parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..connectors import create_connector
from ._vllm_loops import ChunkMover
from ._vllm_main import (
    CodesStruct,
    EmbeddingsStruct,
    HiddenStatesStruct,
    IdsStruct,
    MainShmConnector,
    MetaStruct,
    OmniPayloadStruct,
)

__all__ = [
    "CODEBOOKS",
    "Job",
    "PayloadShapes",
    "Payloads",
    "build_connector",
    "code_length",
    "left_context",
    "stage_main",
]

CODEBOOKS = 16
_INITIAL_FRAMES = 4
_CHUNK_FRAMES = 25
_LEFT_CONTEXT_FRAMES = 25
_TAG = 4  # elements at the start of each tensor that carry (job, request, chunk)


def code_length(chunk: int) -> int:
    """Values of code2wav chunk ``chunk``: main's talker2code2wav schedule (64, 464, then 800)."""
    if chunk == 0:
        return _INITIAL_FRAMES * CODEBOOKS
    if chunk == 1:
        return (_INITIAL_FRAMES + _CHUNK_FRAMES) * CODEBOOKS
    return (_LEFT_CONTEXT_FRAMES + _CHUNK_FRAMES) * CODEBOOKS


def left_context(chunk: int) -> int:
    """``meta.left_context_size`` of code2wav chunk ``chunk`` (0, 4, then 25)."""
    return (0, _INITIAL_FRAMES)[chunk] if chunk < 2 else _LEFT_CONTEXT_FRAMES


@dataclass(frozen=True)
class PayloadShapes:
    """The prompt length ``P`` and hidden size ``D`` of the thinker's chunks."""

    prompt_len: int = 128
    hidden: int = 2048


@dataclass(frozen=True)
class Job:
    """One run through the pipeline: ``requests`` streams of ``chunks`` chunks, paced or as fast as they go."""

    job_id: int
    requests: tuple[str, ...]
    chunks: int
    pace_s: float | None


class Payloads:
    """Builds each stage's chunks and checks them where they arrive; the same seed in every process."""

    def __init__(self, shapes: PayloadShapes) -> None:
        self.shapes = shapes
        gen = torch.Generator().manual_seed(20260)
        rows, dim = shapes.prompt_len + 1, shapes.hidden
        self._prefill = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
        self._hidden = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
        self._special = torch.randn(3, 1, 1, dim, generator=gen).to(torch.bfloat16)
        self._decode = torch.randn(1, dim, generator=gen).to(torch.bfloat16)
        self._prompt = [151_644 + (i * 7919) % 150_000 for i in range(shapes.prompt_len)]

    @staticmethod
    def _tag(job: int, index: int, chunk: int) -> torch.Tensor:
        return torch.tensor([job % 256, index % 256, chunk % 256, (chunk // 256) % 256], dtype=torch.bfloat16)

    def _tagged(self, base: torch.Tensor, tag: torch.Tensor) -> torch.Tensor:
        out = base.clone()
        out.view(-1)[:_TAG] = tag.to(base.dtype)
        return out

    @staticmethod
    def _flag(value: bool) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.bool)

    def thinker_chunk(self, job: int, index: int, chunk: int, last: bool) -> OmniPayloadStruct:
        """Thinker chunk ``chunk`` of request ``index`` of job ``job``, as main's thinker2talker builds it."""
        tag = self._tag(job, index, chunk)
        meta = MetaStruct(finished=self._flag(last), is_segment_finished=self._flag(last))
        if chunk > 0:
            return OmniPayloadStruct(embed=EmbeddingsStruct(decode=self._tagged(self._decode, tag)), meta=meta)
        bos, eos, pad = (self._tagged(self._special[i], tag) for i in range(3))
        return OmniPayloadStruct(
            embed=EmbeddingsStruct(prefill=self._tagged(self._prefill, tag), tts_bos=bos, tts_eos=eos, tts_pad=pad),
            hidden_states=HiddenStatesStruct(output=self._tagged(self._hidden, tag)),
            ids=IdsStruct(all=[*self._prompt, job * 1000 + index], prompt=list(self._prompt)),
            meta=meta,
        )

    @staticmethod
    def _codes(job: int, index: int, chunk: int) -> torch.Tensor:
        return torch.arange(code_length(chunk), dtype=torch.int64) + ((job * 1000 + index) * 100_000 + chunk) * 1000

    def code2wav_chunk(self, job: int, index: int, chunk: int, last: bool) -> OmniPayloadStruct:
        """Code2wav chunk ``chunk`` of request ``index``, as main's talker2code2wav builds it."""
        return OmniPayloadStruct(
            codes=CodesStruct(audio=self._codes(job, index, chunk)),
            meta=MetaStruct(
                left_context_size=left_context(chunk), finished=self._flag(last), is_segment_finished=self._flag(last)
            ),
        )

    def _check_tensor(self, what: str, got: Any, base: torch.Tensor, tag: torch.Tensor) -> str | None:
        if not isinstance(got, torch.Tensor):
            return f"{what} is a {type(got).__name__}, not a tensor"
        if got.dtype != base.dtype or tuple(got.shape) != tuple(base.shape):
            return f"{what} is {got.dtype} {tuple(got.shape)}, expected {base.dtype} {tuple(base.shape)}"
        flat = got.reshape(-1)
        if not torch.equal(flat[:_TAG], tag.to(base.dtype)):
            return f"{what} carries tag {flat[:_TAG].tolist()}, expected {tag.tolist()}"
        if not torch.equal(flat[_TAG:], base.reshape(-1)[_TAG:]):
            return f"{what}'s values differ from what was sent"
        return None

    @staticmethod
    def _check_flags(meta: dict[str, Any], last: bool) -> str | None:
        for name in ("finished", "is_segment_finished"):
            flag = meta.get(name)
            if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or bool(flag.item()) != last:
                return f"meta.{name} is {flag!r}, expected tensor({last})"
        return None

    def check_thinker_chunk(self, payload: Any, job: int, index: int, chunk: int, last: bool) -> str | None:
        """What is wrong with a received thinker chunk (a dict, as main's receivers read it); ``None`` if right."""
        if not isinstance(payload, dict):
            return f"a {type(payload).__name__} arrived where main's receiver reads a dict"
        try:
            tag = self._tag(job, index, chunk)
            problem = self._check_flags(payload["meta"], last)
            embed = payload["embed"]
            if chunk > 0:
                wanted = {"embed", "meta"}
                problem = problem or self._check_tensor("embed.decode", embed.get("decode"), self._decode, tag)
            else:
                wanted = {"embed", "hidden_states", "ids", "meta"}
                checks = [
                    ("embed.prefill", embed.get("prefill"), self._prefill),
                    ("hidden_states.output", payload["hidden_states"].get("output"), self._hidden),
                    ("embed.tts_bos", embed.get("tts_bos"), self._special[0]),
                    ("embed.tts_eos", embed.get("tts_eos"), self._special[1]),
                    ("embed.tts_pad", embed.get("tts_pad"), self._special[2]),
                ]
                for what, got, base in checks:
                    problem = problem or self._check_tensor(what, got, base, tag)
                ids = payload["ids"]
                if ids.get("prompt") != self._prompt or ids.get("all") != [*self._prompt, job * 1000 + index]:
                    problem = problem or "ids.prompt / ids.all differ from what was sent"
            if set(payload) != wanted:
                problem = problem or f"fields {sorted(payload)}, expected {sorted(wanted)}"
            return problem
        except (KeyError, AttributeError, TypeError, ValueError, RuntimeError) as exc:
            return f"malformed thinker chunk: {exc!r}"

    def check_code2wav_chunk(self, payload: Any, job: int, index: int, chunk: int, last: bool) -> str | None:
        """What is wrong with a received code2wav chunk; ``None`` if right."""
        if not isinstance(payload, dict):
            return f"a {type(payload).__name__} arrived where main's receiver reads a dict"
        try:
            problem = self._check_flags(payload["meta"], last)
            codes = payload["codes"].get("audio")
            expected = self._codes(job, index, chunk)
            if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int64 or not torch.equal(codes, expected):
                problem = problem or f"codes.audio differ from what was sent: {codes!r}"
            if payload["meta"].get("left_context_size") != left_context(chunk):
                problem = problem or f"meta.left_context_size is {payload['meta'].get('left_context_size')!r}"
            return problem
        except (KeyError, AttributeError, TypeError, ValueError, RuntimeError) as exc:
            return f"malformed code2wav chunk: {exc!r}"


# -- the stage process ----------------------------------------------------------------------------------------------
def build_connector(stage_id: int, backend: dict[str, Any]) -> Any:
    """The stage's connector: main's SharedMemoryConnector restated, or a ``ZmqConnector`` from its ``extra``."""
    role = "sender" if stage_id == 0 else "receiver"
    extra = {**backend["extra"], "stage_id": stage_id, "role": role}
    if backend["connector"] == "main-shm":
        return MainShmConnector(extra)
    return create_connector({"name": backend["connector"], "extra": extra})


class _Stage:
    """A stage's mover, its current job and what it reports; ``_lock`` guards the job's records and the pipe."""

    def __init__(self, stage_id: int, connector: Any, conn: Connection, shapes: PayloadShapes) -> None:
        self.stage_id = stage_id
        self.conn = conn
        self.payloads = Payloads(shapes)
        self._lock = threading.Lock()
        self.job: Job | None = None
        self._index: dict[str, int] = {}
        self.arrivals: list[tuple[str, int, float]] = []
        self.puts: list[tuple[str, int, float, float]] = []
        self.mover = ChunkMover(connector, stage_id, self.on_chunk, self.on_put)

    def send(self, *message: Any) -> None:
        with self._lock:
            self.conn.send(message)

    def problem(self, text: str) -> None:
        self.send("problem", self.stage_id, text)

    def start(self, job: Job) -> None:
        with self._lock:
            self.job = job
            self._index = {rid: i for i, rid in enumerate(job.requests)}
            self.arrivals = []
            self.puts = []
        if self.stage_id == 0:
            self._produce(job)
            return
        for rid in job.requests:
            self.mover.load_async(rid)
        self.send("ready", job.job_id)

    def _produce(self, job: Job) -> None:
        start = time.monotonic()
        for chunk in range(job.chunks):
            last = chunk == job.chunks - 1
            built = [self.payloads.thinker_chunk(job.job_id, i, chunk, last) for i in range(len(job.requests))]
            if job.pace_s is not None:
                time.sleep(max(0.0, start + chunk * job.pace_s - time.monotonic()))
            for rid, payload in zip(job.requests, built, strict=True):
                self.mover.save_async(rid, payload)

    def on_put(self, request_id: str, chunk: int, started: float, ended: float, ok: bool) -> None:
        if not ok:
            self.problem(f"put of {request_id}_{self.stage_id}_{chunk} failed: {self.mover.errors[-1:]}")
            return
        if self.stage_id != 0:  # only the thinker's puts are timed
            return
        with self._lock:
            job = self.job
            self.puts.append((request_id, chunk, started, ended))
            if job is not None and len(self.puts) == len(job.requests) * job.chunks:
                self.conn.send(("done", job.job_id, self.stage_id, list(self.puts), []))

    def on_chunk(self, request_id: str, chunk: int, payload: Any, arrived: float) -> None:
        try:
            self._take(request_id, chunk, payload, arrived)
        except Exception:  # a fault of the benchmark itself: the run must fail, not wait for its deadline
            self.problem(f"{request_id} chunk {chunk}: {traceback.format_exc()}")

    def _take(self, request_id: str, chunk: int, payload: Any, arrived: float) -> None:
        with self._lock:
            job = self.job
            index = self._index.get(request_id)
        if job is None or index is None:
            self.problem(f"{request_id}_{self.stage_id - 1}_{chunk} arrived outside its job")
            return
        last = chunk == job.chunks - 1
        if self.stage_id == 1:
            # The code2wav chunk depends on the chunk's place, not its values: it goes first, the check after it,
            # so what is timed is the transfer (a wrong value still fails the run).
            self.mover.save_async(request_id, self.payloads.code2wav_chunk(job.job_id, index, chunk, last))
            problem = self.payloads.check_thinker_chunk(payload, job.job_id, index, chunk, last)
        else:
            problem = self.payloads.check_code2wav_chunk(payload, job.job_id, index, chunk, last)
        if problem is not None:
            self.problem(f"{request_id} chunk {chunk}: {problem}")
            return
        with self._lock:
            self.arrivals.append((request_id, chunk, arrived))
            if self.stage_id == 2 and len(self.arrivals) == len(job.requests) * job.chunks:
                self.conn.send(("done", job.job_id, self.stage_id, [], list(self.arrivals)))
        if self.stage_id == 1 and last:
            self._report_talker(job)

    def _report_talker(self, job: Job) -> None:
        # The talker reports its arrivals once each request's last chunk came in (its puts go on meanwhile).
        with self._lock:
            finished = sum(1 for _, chunk, _ in self.arrivals if chunk == job.chunks - 1)
            if finished == len(job.requests):
                self.conn.send(("done", job.job_id, self.stage_id, [], list(self.arrivals)))


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def stage_main(stage_id: int, backend: dict[str, Any], shapes: PayloadShapes, conn: Connection, log_path: str) -> None:
    """Run one stage until ``stop``, the pipe's end or SIGTERM; output goes to ``log_path``."""
    _redirect_output(log_path)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    signal.signal(signal.SIGTERM, _terminate)
    # This process is the benchmark's own: what our connectors log at WARNING belongs in its output.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("zmq_omni").addHandler(handler)
    logging.getLogger("zmq_omni").setLevel(logging.WARNING)
    print(f"stage {stage_id} ({backend['name']}): pid {os.getpid()}", flush=True)
    stage: _Stage | None = None
    try:
        stage = _Stage(stage_id, build_connector(stage_id, backend), conn, shapes)
        stage.send("up", stage_id, os.getpid())
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message[0] == "stop":
                break
            stage.start(message[1])
    except Exception:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("problem", stage_id, f"stage {stage_id} crashed:\n{traceback.format_exc()}"))
    finally:
        if stage is not None:
            if stage.mover.errors:
                print(f"stage {stage_id}: errors {stage.mover.errors[:10]}", flush=True)
            stage.mover.shutdown()
        print(f"stage {stage_id}: closed", flush=True)
        sys.stdout.flush()
