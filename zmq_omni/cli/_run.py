"""Drive requests through a pipeline, track them, write WAV files, print progress and the final table.

Shared by ``zmq-omni demo`` (which also starts the stages) and ``zmq-omni drive``.
"""

from __future__ import annotations

import sys
import time
import wave
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..errors import ConfigError
from ..stages import DriverEvent, PipelineConfig, PipelineDriver

__all__ = ["Progress", "RequestResult", "RunResult", "drive_requests", "format_table", "make_out_dir", "write_wav"]


@dataclass
class RequestResult:
    """What happened to one request."""

    request_id: str
    submitted_at: float
    first_output_at: float | None = None
    finished_at: float | None = None
    chunks: int = 0
    bytes: int = 0
    failed: str | None = None
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 24_000
    wav_path: Path | None = None

    @property
    def done(self) -> bool:
        """Completed or failed."""
        return self.finished_at is not None


@dataclass
class RunResult:
    """Every request's result plus per-hop latencies (seconds) and wall time."""

    requests: dict[str, RequestResult]
    hops: dict[str, list[float]]
    hop_order: list[str]
    started_at: float
    ended_at: float

    @property
    def failed(self) -> list[RequestResult]:
        """Requests that failed (or never finished)."""
        return [r for r in self.requests.values() if r.failed is not None or not r.done]


class Progress:
    """A live progress line: rewritten in place on a TTY, a line per second otherwise."""

    def __init__(self, stream: TextIO | None = None, *, interval_s: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 1.0)
        self._last = 0.0
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        """Show ``text`` if the interval passed (or ``force``)."""
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the live line (a TTY gets its newline)."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


def make_out_dir(path: Path, option: str = "--out") -> Path:
    """Create the output directory up front, so that a bad path fails before any work is done.

    Raises:
        ConfigError: it cannot be created (the message names ``option`` and the OS's reason).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot create the directory: {exc.strerror or exc}") from exc
    return path


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """Write mono float audio in [-1, 1] as 16-bit PCM."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())


def _nbytes(data: Mapping[str, Any]) -> int:
    return sum(int(v.nbytes) for v in data.values() if isinstance(v, np.ndarray))


def drive_requests(
    driver: PipelineDriver,
    pipeline: PipelineConfig,
    *,
    requests: int,
    chunks: int,
    payload_size: int,
    out_dir: Path | None,
    progress: Progress | None = None,
    check_stages: Callable[[], str | None] | None = None,
    prefix: str = "req",
) -> RunResult:
    """Submit ``requests`` demo requests at once and follow them to the end.

    Args:
        driver: an open driver.
        pipeline: its pipeline (for hop names).
        requests: how many requests to submit.
        chunks: thinker chunks per request.
        payload_size: bytes of hidden states per thinker chunk.
        out_dir: where ``{request_id}.wav`` files go (None: no files).
        progress: the live progress line.
        check_stages: called every step; returns a reason when a stage is gone,
            which fails every request still in flight.
        prefix: request id prefix.
    """
    names = {spec.stage_id: spec.name for spec in (*pipeline.stages, pipeline.driver)}
    order = [pipeline.driver.stage_id, *(spec.stage_id for spec in pipeline.stages)]
    hop_order = [f"{names[a]} -> {names[b]}" for a, b in zip(order, [*order[1:], order[0]], strict=True)]
    hops: dict[str, list[float]] = {name: [] for name in hop_order}
    started = time.time()
    results: dict[str, RequestResult] = {}
    for index in range(requests):
        request_id = f"{prefix}-{index:03d}"
        results[request_id] = RequestResult(request_id, time.time())
        driver.submit(request_id, {"n_chunks": chunks, "payload_size": payload_size, "prompt": f"request {index}"})
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    def record_hops(event: DriverEvent) -> None:
        trace = event.trace
        for i, stage in enumerate(order):
            nxt = order[(i + 1) % len(order)]
            sent = trace.get(stage)
            if sent is None:
                continue
            received = event.at if nxt == order[0] else (trace.get(nxt) or [None])[0]
            if received is not None:
                hops[hop_order[i]].append(max(0.0, float(received) - float(sent[1])))

    def apply(event: DriverEvent) -> None:
        result = results.get(event.request_id)
        if result is None or result.done:
            return
        if event.kind == "failed":
            result.failed = event.reason or "failed"
            result.finished_at = event.at
            return
        audio = event.data.get("audio")
        if isinstance(audio, np.ndarray) and audio.size:
            if result.first_output_at is None:
                result.first_output_at = event.at
            result.audio.append(audio)
            result.chunks += 1
            result.bytes += _nbytes(event.data)
            result.sample_rate = int(event.data.get("sample_rate", result.sample_rate))
            record_hops(event)
        if event.kind == "completed":
            result.finished_at = event.at
            if out_dir is not None and result.audio:
                result.wav_path = out_dir / f"{result.request_id}.wav"
                write_wav(result.wav_path, np.concatenate(result.audio), result.sample_rate)
            result.audio = []

    while driver.pending:
        for event in driver.poll(0.05):
            apply(event)
        if check_stages is not None and driver.pending:
            reason = check_stages()
            if reason is not None:
                for event in driver.fail_all(reason):
                    apply(event)
        if progress is not None:
            progress.update(_progress_text(results, chunks, started))
    if progress is not None:
        progress.update(_progress_text(results, chunks, started), force=True)
        progress.finish()
    return RunResult(results, hops, hop_order, started, time.time())


def _progress_text(results: Mapping[str, RequestResult], chunks: int, started: float) -> str:
    done = sum(1 for r in results.values() if r.done and r.failed is None)
    failed = sum(1 for r in results.values() if r.failed is not None)
    got = sum(r.chunks for r in results.values())
    mb = sum(r.bytes for r in results.values()) / 1e6
    return (
        f"[{time.time() - started:6.1f}s] requests {done}/{len(results)} done, {failed} failed | "
        f"audio chunks {got} | {mb:.1f} MB audio"
    )


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{float(np.percentile(np.asarray(values), q)) * 1e3:.1f} ms"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover - loop always returns


def format_table(
    run: RunResult,
    *,
    title: str,
    chunks_per_request: int,
    payload_size: int,
    hop_bytes: Mapping[str, int] | None = None,
) -> str:
    """The final report: one table of figures, then per-hop latency."""
    results = list(run.requests.values())
    completed = [r for r in results if r.done and r.failed is None]
    failed = run.failed
    wall = max(1e-9, run.ended_at - run.started_at)
    ttfa = [r.first_output_at - r.submitted_at for r in results if r.first_output_at is not None]
    audio_chunks = sum(r.chunks for r in results)
    audio_s = sum(r.bytes / 4 / r.sample_rate for r in results)
    thinker_chunks = len(completed) * chunks_per_request
    rows: list[tuple[str, str]] = [
        ("requests", f"{len(completed)} / {len(results)} completed"),
        (
            "chunks",
            f"{thinker_chunks} streamed by the thinker, {audio_chunks} audio chunks received "
            "(a stage merges chunks that arrive together)",
        ),
        (
            "bytes",
            _size(sum(hop_bytes.values())) + " over all hops"
            if hop_bytes
            else _size(sum(r.bytes for r in results)) + " of audio received",
        ),
        ("time to first audio", f"p50 {_pct(ttfa, 50)}   p99 {_pct(ttfa, 99)}"),
        (
            "throughput",
            f"{thinker_chunks / wall:.1f} chunks/s, "
            f"{thinker_chunks * payload_size / wall / 1e6:.1f} MB/s hidden states, "
            f"{audio_s / wall:.1f}x real-time audio",
        ),
        ("wall time", f"{wall:.2f} s"),
        ("failures", str(len(failed))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [title, "", f"  {'metric'.ljust(width)}  value", f"  {'-' * width}  {'-' * 40}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    hop_width = max(len(h) for h in run.hop_order)
    lines += [
        "",
        f"  {'hop'.ljust(hop_width)}  {'bytes':>10}  {'p50':>9}  {'p99':>9}",
        f"  {'-' * hop_width}  {'-' * 10}  {'-' * 9}  {'-' * 9}",
    ]
    for hop in run.hop_order:
        nbytes = _size(hop_bytes[hop]) if hop_bytes and hop in hop_bytes else "-"
        lines.append(
            f"  {hop.ljust(hop_width)}  {nbytes:>10}  {_pct(run.hops[hop], 50):>9}  {_pct(run.hops[hop], 99):>9}"
        )
    for r in failed:
        lines.append(f"  FAILED {r.request_id}: {r.failed or 'did not finish'}")
    return "\n".join(lines)
