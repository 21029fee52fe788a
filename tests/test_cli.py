"""``zmq-omni`` as users run it: separate processes, real sockets over tcp://127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from tests.ports import reserve_port
from zmq_omni.cli import main as cli_main

CLI = [sys.executable, "-m", "zmq_omni.cli"]
STAGES = (("thinker", 0), ("talker", 1), ("vocoder", 2))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=_env(), check=False)


def write_pipeline(path: Path, *, stall: float = 5.0, request_timeout: float = 30.0) -> dict[str, str]:
    endpoints = {name: f"tcp://127.0.0.1:{reserve_port()}" for name in ("driver", "thinker", "talker", "vocoder")}
    doc: dict[str, Any] = {
        "pipeline": {
            "name": "test-tcp",
            "stall_timeout_s": stall,
            "request_timeout_s": request_timeout,
            "retry": {"attempts": 2, "deadline_s": 1.0},
            "driver": {"stage_id": "driver", "endpoint": endpoints["driver"]},
            "stages": [
                {
                    "name": name,
                    "stage_id": sid,
                    "function": f"zmq_omni.cli.demo_stages:{name}",
                    "endpoint": endpoints[name],
                }
                for name, sid in STAGES
            ],
        },
        "stage_args": [
            {
                "stage_id": 0,
                "input_connectors": {"from_stage_driver": "tcp"},
                "output_connectors": {"to_stage_1": "tcp"},
            },
            {"stage_id": 1, "input_connectors": {"from_stage_0": "tcp"}, "output_connectors": {"to_stage_2": "tcp"}},
            {
                "stage_id": 2,
                "input_connectors": {"from_stage_1": "tcp"},
                "output_connectors": {"to_stage_driver": "tcp"},
            },
        ],
        "runtime": {
            "connectors": {
                "tcp": {
                    "name": "ZmqConnector",
                    "extra": {
                        "shm": "off",
                        "put_timeout_s": 2.0,
                        "delivery_timeout_s": 3.0,
                        "peer_timeout_s": 1.0,
                        "heartbeat_s": 0.2,
                    },
                }
            }
        },
    }
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return endpoints


class StageProcs:
    """Stage processes whose output goes to log files, so a failing test can show all of it."""

    def __init__(self, config: Path, names: list[str]) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, Path] = {}
        for name in names:
            self.logs[name] = config.parent / f"{name}.log"
            with open(self.logs[name], "w", encoding="utf-8") as log:
                self.procs[name] = subprocess.Popen(
                    [*CLI, "stage", "--config", str(config), "--stage", name],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=_env(),
                )

    def output(self, name: str) -> str:
        try:
            return self.logs[name].read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"

    def terminate(self) -> dict[str, tuple[int, str]]:
        out: dict[str, tuple[int, str]] = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out[name] = (proc.returncode, self.output(name))
        return out


@pytest.fixture
def stage_procs() -> Iterator[list[StageProcs]]:
    """Stops the stages a test started and prints their output (pytest shows it when the test failed)."""
    made: list[StageProcs] = []
    yield made
    for procs in made:
        for name, (code, output) in procs.terminate().items():
            print(f"--- stage {name} (exit {code}) ---\n{output}")


def test_help_on_every_subcommand() -> None:
    top = run_cli("--help")
    assert top.returncode == 0 and "demo" in top.stdout and "shm-sweep" in top.stdout
    for command in ("demo", "stage", "drive", "health", "bench", "keygen", "shm-sweep"):
        result = run_cli(command, "--help")
        assert result.returncode == 0, command
        assert f"usage: zmq-omni {command}" in result.stdout


def test_pipeline_from_yaml_three_stage_processes_over_tcp(short_tmp: Path, stage_procs: list[StageProcs]) -> None:
    config = short_tmp / "pipeline.yaml"
    endpoints = write_pipeline(config)
    procs = StageProcs(config, ["thinker", "talker", "vocoder"])
    stage_procs.append(procs)

    out = short_tmp / "out"
    drive = run_cli(
        "drive",
        "--config",
        str(config),
        "--requests",
        "3",
        "--chunks",
        "4",
        "--payload-size",
        "32768",
        "--out",
        str(out),
        "--wait-ready",
        "30",
        timeout=90,
    )
    assert drive.returncode == 0, drive.stdout + drive.stderr
    for i in range(3):
        assert f"req-{i:03d} completed: " in drive.stdout
        assert (out / f"req-{i:03d}.wav").stat().st_size > 44
    assert "FAILED" not in drive.stdout and "failures" in drive.stdout
    assert f"3 WAV files in {out.resolve()}/ (req-000.wav ... req-002.wav)" in drive.stdout

    healthy = run_cli("health", "--endpoint", endpoints["talker"])
    assert healthy.returncode == 0, healthy.stderr
    assert '"status": "ok"' in healthy.stdout
    by_stage = run_cli("health", "--config", str(config), "--stage", "vocoder")
    assert by_stage.returncode == 0, by_stage.stderr

    # SIGTERM stops every stage cleanly: exit 0, adapters shut down, no traceback.
    for name, (code, err) in procs.terminate().items():
        assert code == 0, (name, err)
        assert f"zmq-omni stage {name}: stopped (3 requests completed, 0 failed)" in err
        assert "Traceback" not in err


def test_driver_reports_failed_requests_when_a_stage_is_down(short_tmp: Path, stage_procs: list[StageProcs]) -> None:
    config = short_tmp / "pipeline.yaml"
    # request_timeout far away: only the driver's first-output bound (stall x hops = 4 s) can end this quickly
    write_pipeline(config, stall=1.0, request_timeout=50.0)
    stage_procs.append(StageProcs(config, ["thinker", "vocoder"]))  # the talker never comes
    started = time.monotonic()
    drive = run_cli(
        "drive",
        "--config",
        str(config),
        "--requests",
        "2",
        "--chunks",
        "2",
        "--payload-size",
        "16384",
        "--wait-ready",
        "0",
        timeout=60,
    )
    assert drive.returncode == 1, drive.stdout + drive.stderr
    assert "req-000 FAILED: " in drive.stdout and "req-001 FAILED: " in drive.stdout
    # Named as the YAML names it, with a duration a person reads (stall 1 s x 4 hops).
    assert "stage 'vocoder' never started it within 4 s" in drive.stdout, drive.stdout
    assert time.monotonic() - started < 45


def test_health_against_nothing_exits_1_with_one_line() -> None:
    result = run_cli("health", "--endpoint", f"tcp://127.0.0.1:{reserve_port()}", "--timeout", "0.5")
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "unhealthy" in result.stderr
    assert "within 0.5 s" in result.stderr, result.stderr


def test_health_takes_a_server_key_that_begins_with_a_dash(capsys: pytest.CaptureFixture[str]) -> None:
    # Z85 keys may begin with '-', which argparse alone reads as an option ("expected one argument").
    public = next(key for key in (zmq.curve_keypair()[0].decode() for _ in range(10_000)) if key.startswith("-"))
    endpoint = f"tcp://127.0.0.1:{reserve_port()}"
    for option in ("--server-key", "--server-k"):  # (argparse takes an option's unique abbreviation too)
        status = cli_main(["health", "--endpoint", endpoint, option, public, "--timeout", "0.3"])
        assert status == 1, capsys.readouterr()  # probed with that key: nothing answers; 2 would be a usage error
        assert "unhealthy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # a forgotten key is not taken from the next option
        cli_main(["health", "--endpoint", endpoint, "--server-key", "--timeout", "0.3"])
    assert usage.value.code == 2 and "expected one argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot read pipeline config"),
        ("pipeline: {stages: [{name: a, stage_id: 0}]}\n", "pipeline.stages[0].function"),
        (
            "pipeline: {stages: [{name: a, stage_id: 0, function: 'x:y', colour: red}]}\n",
            "unknown config key 'pipeline.stages[0].colour'",
        ),
        ("pipeline: [unclosed\n", "invalid YAML"),
        (
            "pipeline: {stages: [{name: a, stage_id: 0, function: 'no.such.module:f', endpoint: 'tcp://127.0.0.1:1'}]}\n",
            "cannot import 'no.such.module'",
        ),
    ],
)
def test_bad_config_is_one_clear_line(short_tmp: Path, content: str | None, needle: str) -> None:
    config = short_tmp / "bad.yaml"
    if content is not None:
        config.write_text(content, encoding="utf-8")
    result = run_cli("stage", "--config", str(config), "--stage", "a")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("zmq-omni stage: configuration error: ") and needle in lines[0]
    drive = run_cli("drive", "--config", str(config), "--wait-ready", "0")
    assert drive.returncode == 2 and len(drive.stderr.strip().splitlines()) == 1, drive.stderr


def test_unknown_stage_name_is_one_line(short_tmp: Path) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    result = run_cli("stage", "--config", str(config), "--stage", "mixer")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "zmq-omni stage: configuration error: pipeline 'test-tcp' has no stage 'mixer' (stages: thinker, talker, "
        "vocoder)"
    ]


def test_shm_sweep_dry_run(short_tmp: Path) -> None:
    result = subprocess.run(
        [*CLI, "shm-sweep", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**_env(), "ZMQ_OMNI_SHM_DIR": str(short_tmp)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "shm-sweep: would remove 0 objects" in result.stdout


def test_keygen_writes_a_usable_private_key_pair(short_tmp: Path) -> None:
    import zmq

    result = run_cli("keygen", "--out-dir", str(short_tmp), "--name", "talker")
    assert result.returncode == 0, result.stderr
    secret = (short_tmp / "talker.key").read_text().strip()
    public = (short_tmp / "talker.pub").read_text().strip()
    assert (short_tmp / "talker.key").stat().st_mode & 0o077 == 0
    assert zmq.curve_public(secret.encode()) == public.encode()  # the pair belongs together
    printed = run_cli("keygen")
    assert printed.returncode == 0 and "curve_public_key:" in printed.stdout


def test_stage_serves_prometheus_metrics(short_tmp: Path) -> None:
    import re
    import urllib.request

    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    # Port 0: the stage binds a free port itself and prints it, so no other process can take it first.
    proc = subprocess.Popen(
        [*CLI, "stage", "--config", str(config), "--stage", "talker", "--metrics-port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    err = ""
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        found = None
        while found is None:
            line = proc.stderr.readline()
            assert line, "".join(seen)  # the stage exited before its banner
            seen.append(line)
            found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
        port = int(found.group(1))
        assert port > 0
        deadline = time.monotonic() + 30
        body = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    body = response.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert "zmq_omni_stage_completed 0.0" in body, body[:2000]
        assert any(line.startswith("zmq_omni_stage_") and "_up " in line for line in body.splitlines())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        print(f"--- stage talker (exit {proc.returncode}) ---\n{err}")
    assert proc.returncode == 0, err


def test_version_prints_the_package_version() -> None:
    import zmq_omni

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"zmq-omni {zmq_omni.__version__}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["stage", "--config", "{config}", "--stage", "talker", "--metrics-port", "99999"], "--metrics-port"),
        (["stage", "--config", "{config}", "--stage", "talker", "--metrics-port", "-1"], "--metrics-port"),
        (["demo", "--out", "/proc/nope"], "/proc/nope"),
        (["drive", "--config", "{config}", "--out", "/proc/nope", "--wait-ready", "0"], "/proc/nope"),
        (["bench", "--quick", "--plot", "/proc/nope/x.png"], "/proc/nope"),
        (["bench", "--quick", "--plot", "{tmp}"], "is a directory"),
        (["health", "--endpoint", "tcp://127.0.0.1:1", "--timeout", "-1"], "--timeout"),
        (["health", "--endpoint", "tcp://127.0.0.1:1", "--timeout", "nan"], "--timeout"),
        (["drive", "--config", "{config}", "--timeout", "0"], "--timeout"),
        (["demo", "--requests", "0"], "--requests"),
        (["no-such-command"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(short_tmp: Path, args: list[str], needle: str) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    argv = [arg.format(config=config, tmp=short_tmp) for arg in args]
    result = run_cli(*argv, timeout=60)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0], lines[0]
    # Checked before any work: no benchmark ran, no stage started.
    assert "benchmark" not in result.stdout and "ratio" not in result.stdout, result.stdout


def test_stage_refuses_an_in_process_connector() -> None:
    config = Path(__file__).resolve().parent.parent / "examples" / "custom_connector.yaml"
    result = run_cli("stage", "--config", str(config), "--stage", "talker", timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "AuditedConnector, an in-process connector" in lines[0] and "other processes" in lines[0]
    assert "serving on" not in result.stderr


def test_two_stages_with_one_endpoint_are_caught_at_load(short_tmp: Path) -> None:
    from zmq_omni import load_pipeline_config
    from zmq_omni.errors import ConfigError

    config = short_tmp / "pipeline.yaml"
    endpoints = write_pipeline(config)
    doc = yaml.safe_load(config.read_text(encoding="utf-8"))
    doc["pipeline"]["stages"][2]["endpoint"] = endpoints["talker"]
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"stages 'talker' and 'vocoder' have the same endpoint"):
        load_pipeline_config(config)
    result = run_cli("stage", "--config", str(config), "--stage", "thinker")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"zmq-omni stage: configuration error: pipeline: stages 'talker' and 'vocoder' have the same endpoint "
        f"'{endpoints['talker']}'; each stage needs its own"
    ]


def test_a_second_drive_with_the_same_ids_fails_fast_with_the_real_cause(
    short_tmp: Path, stage_procs: list[StageProcs]
) -> None:
    config = short_tmp / "pipeline.yaml"
    # A stall bound far away: the old behaviour (every request "stalled" after it) cannot pass.
    write_pipeline(config, stall=20.0, request_timeout=60.0)
    procs = StageProcs(config, ["thinker", "talker", "vocoder"])
    stage_procs.append(procs)
    args = ("drive", "--config", str(config), "--chunks", "2", "--payload-size", "16384")

    # More requests than the announcement look-ahead (16): a later driver starts far behind the last stage.
    first = run_cli(*args, "--requests", "20", "--wait-ready", "30", timeout=90)
    assert first.returncode == 0, first.stdout + first.stderr
    args = (*args, "--requests", "2")

    started = time.monotonic()
    again = run_cli(*args, "--wait-ready", "0", timeout=90)
    elapsed = time.monotonic() - started
    assert again.returncode == 1, again.stdout + again.stderr
    for i in range(2):
        line = next(ln for ln in again.stdout.splitlines() if ln.startswith(f"req-{i:03d} FAILED: "))
        assert f"request 'req-{i:03d}' already ended its stream" in line and "stage thinker" in line, again.stdout
    assert "stalled" not in again.stdout
    assert elapsed < 20.0, f"the refusal took {elapsed:.1f}s, as long as a stall"

    # The stages keep serving other requests.
    fresh = run_cli(*args, "--prefix", "fresh", "--wait-ready", "0", timeout=90)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "fresh-000 completed: " in fresh.stdout and "fresh-001 completed: " in fresh.stdout

    for name, (code, err) in procs.terminate().items():
        assert code == 0, (name, err)
        assert "Traceback" not in err, (name, err)
