"""``zmq-omni demo``: the three-stage streaming pipeline on one machine, defaults embedded.

The demo writes its pipeline config (the same format ``zmq-omni stage``
reads) to a private temp dir, starts one ``zmq-omni stage`` process per stage,
drives requests from this process and prints the report. Stage processes
never outlive it: they are stopped with SIGTERM (then SIGKILL) on every exit
path, and they get SIGTERM from the kernel if this process is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..stages import PipelineDriver, load_pipeline_config
from ..transport import reserve_loopback_port
from ._commands import PARENT_PID_ENV, wait_ready
from ._run import Progress, drive_requests, format_table, make_out_dir

__all__ = ["demo_pipeline", "run_demo"]

STAGES = (("thinker", "0"), ("talker", "1"), ("vocoder", "2"))


def demo_pipeline(transport: str, workdir: Path, *, shm: str = "auto", timeout_s: float = 120.0) -> dict[str, Any]:
    """The demo's pipeline config as a dict (ipc endpoints under ``workdir``, or free tcp ports)."""

    def endpoint(name: str) -> str:
        return f"ipc://{workdir}/{name}.sock" if transport == "ipc" else f"tcp://127.0.0.1:{reserve_loopback_port()}"

    stages = [
        {"name": name, "stage_id": stage_id, "function": f"zmq_omni.cli.demo_stages:{name}", "endpoint": endpoint(name)}
        for name, stage_id in STAGES
    ]
    return {
        "pipeline": {
            "name": "demo",
            "stall_timeout_s": 15.0,
            "request_timeout_s": timeout_s,
            "driver": {"name": "driver", "stage_id": "driver", "endpoint": endpoint("driver")},
            "stages": stages,
        },
        "stage_args": [
            {
                "stage_id": "0",
                "input_connectors": {"from_stage_driver": "zmq"},
                "output_connectors": {"to_stage_1": "zmq"},
            },
            {"stage_id": "1", "input_connectors": {"from_stage_0": "zmq"}, "output_connectors": {"to_stage_2": "zmq"}},
            {
                "stage_id": "2",
                "input_connectors": {"from_stage_1": "zmq"},
                "output_connectors": {"to_stage_driver": "zmq"},
            },
        ],
        "runtime": {"connectors": {"zmq": {"name": "ZmqConnector", "extra": {"shm": shm}}}},
    }


class _Stages:
    """The stage processes; :meth:`stop` is the one way they end."""

    def __init__(self, config_path: Path, workdir: Path, log_level: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ZMQ_OMNI_ENDPOINT_", "ZMQ_OMNI_BIND"))}
        env[PARENT_PID_ENV] = str(os.getpid())
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        try:
            for name, _ in STAGES:
                self.logs[name] = workdir / f"{name}.log"
                with open(self.logs[name], "wb") as log:
                    self.procs[name] = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "zmq_omni.cli",
                            "--log-level",
                            log_level,
                            "stage",
                            "--config",
                            str(config_path),
                            "--stage",
                            name,
                            "--stats-out",
                            str(workdir / f"{name}.json"),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        env=env,
                    )
        except BaseException:
            self.stop()
            raise

    def dead(self) -> str | None:
        """A reason when a stage process has exited, else None."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return f"stage {name} exited with status {code}: {self.log_tail(name)}"
        return None

    def log_lines(self, name: str, count: int) -> str:
        """The last ``count`` lines of a stage's log."""
        try:
            lines = self.logs[name].read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-count:]) if lines else "(empty log)"

    def log_tail(self, name: str) -> str:
        """The last non-empty line of a stage's log."""
        try:
            lines = [line for line in self.logs[name].read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every stage, wait, SIGKILL stragglers; return exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each stage's final health, as it wrote it on exit."""
        out: dict[str, dict[str, Any]] = {}
        for name, _ in STAGES:
            try:
                out[name] = json.loads((self.workdir / f"{name}.json").read_text())
            except (OSError, ValueError):
                continue
        return out


def _hop_bytes(stats: dict[str, dict[str, Any]], driver_health: dict[str, Any]) -> dict[str, int]:
    """Bytes each hop's receiver took in, from the stages' final health."""
    names = ["driver", *(name for name, _ in STAGES)]
    out: dict[str, int] = {}
    for index, name in enumerate(names):
        health = driver_health if name == "driver" else stats.get(name, {}).get("chunks", {})
        received = health.get("connector", {}).get("inbound", {}).get("bytes_received")
        if isinstance(received, int):
            out[f"{names[index - 1]} -> {name}"] = received
    return out


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request completed."""
    out_dir = make_out_dir(Path(args.out))
    workdir = Path(tempfile.mkdtemp(prefix="zo-demo-", dir="/tmp"))
    stages: _Stages | None = None
    try:
        config = demo_pipeline(args.transport, workdir, shm=args.shm, timeout_s=args.timeout)
        config_path = workdir / "pipeline.json"
        config_path.write_text(json.dumps(config), encoding="utf-8")
        pipeline = load_pipeline_config(config_path)
        print(
            f"zmq-omni demo: thinker -> talker -> vocoder as 3 processes over {args.transport}:// "
            f"(shm {args.shm}); {args.requests} requests x {args.chunks} chunks of "
            f"{args.payload_size} bytes; audio to {out_dir}/",
            flush=True,
        )
        stages = _Stages(config_path, workdir, args.log_level)
        with PipelineDriver.from_pipeline(pipeline) as driver:
            wait_ready(pipeline, 30.0, alive=stages.dead)
            run = drive_requests(
                driver,
                pipeline,
                requests=args.requests,
                chunks=args.chunks,
                payload_size=args.payload_size,
                out_dir=out_dir,
                progress=Progress(),
                check_stages=stages.dead,
            )
            driver_health = driver.health().get("chunks", {})
        codes = stages.stop()
        hop_bytes = _hop_bytes(stages.stats(), driver_health)
        title = (
            f"zmq-omni demo: {len(run.requests)} requests through thinker -> talker -> vocoder "
            f"({args.transport}://, shm {args.shm})"
        )
        print(
            format_table(
                run, title=title, chunks_per_request=args.chunks, payload_size=args.payload_size, hop_bytes=hop_bytes
            )
        )
        wavs = [r.wav_path for r in run.requests.values() if r.wav_path is not None]
        if wavs:
            print(f"\n  {len(wavs)} WAV files in {out_dir.resolve()}/ ({wavs[0].name} ... {wavs[-1].name})")
        bad = {name: code for name, code in codes.items() if code != 0}
        if bad:
            print(f"zmq-omni demo: stage processes did not stop cleanly: {bad}", file=sys.stderr)
        if run.failed or bad:
            # The stages' logs live in a temp dir removed below: show their ends while they still exist.
            for name, _ in STAGES:
                print(
                    f"--- stage {name} (exit {codes.get(name)}), last lines of its log ---\n"
                    f"{stages.log_lines(name, 20)}",
                    file=sys.stderr,
                )
        return 1 if run.failed or bad else 0
    finally:
        if stages is not None:
            stages.stop()
        shutil.rmtree(workdir, ignore_errors=True)
