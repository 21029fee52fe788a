"""docker-compose.yml end to end: images built here, one container per stage, TCP between them.

1. ``docker-compose up --abort-on-container-exit --exit-code-from driver`` (the
   documented one-command run): every request completes, the WAV files are
   valid, and the stages that compose stops afterwards exit 0 on SIGTERM.
2. A long driver run with the talker container stopped mid-run: the driver
   reports every request FAILED (never hangs) and exits 1.
3. CURVE is on (keys made by docker/make-keys.sh from the image build): an
   intruder container on the compose network, given the thinker's public key
   but no allowed client key, gets nothing in and nothing out while the
   driver's requests complete, and the thinker counts the refusals.

Needs a Docker engine and docker-compose; without them the tests skip, except on
CI (``CI=true``) where they fail with the reason. Everything a test starts is
removed by ``docker-compose down -v --remove-orphans`` in the fixture; what a run
killed before its teardown left behind is removed by the next run (project names
carry the pytest pid).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
import uuid
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import pid_alive

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
BUILD_SCRIPT = REPO / "docker" / "build-images.sh"
STAGES = ("thinker", "talker", "vocoder")
#: A cold build (debootstrap, wheels) takes about two minutes here; warm, about ten seconds.
BUILD_TIMEOUT_S = 840
#: The stopped-stage run: long enough to be mid-stream when the talker stops
#: (about 12 s uninterrupted here), well inside its per-request deadline.
CUT_CHUNKS = 6000
CUT_TIMEOUT_S = 40


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    if shutil.which("docker-compose") is None:
        return "docker-compose is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60, check=False)
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"cannot reach the Docker engine: {lines[-1] if lines else 'docker info failed'}"
    return None


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Compose:
    """``docker-compose -p <unique project>`` on the repository's compose file."""

    def __init__(self, project: str) -> None:
        self.project = project
        # Interpolation must see the file's defaults, not a developer's overrides (the image built
        # by the fixture, named by ZMQ_OMNI_IMAGE like build-images.sh names it, is not an override).
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_") or k == "ZMQ_OMNI_IMAGE"}

    @property
    def image(self) -> str:
        return self.env.get("ZMQ_OMNI_IMAGE", "zmq-omni:local")

    def command(self, *args: str) -> list[str]:
        return ["docker-compose", "-f", str(COMPOSE_FILE), "-p", self.project, *args]

    def run(
        self, *args: str, timeout: float = 120, env: dict[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.command(*args),
            cwd=REPO,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(f"docker-compose {' '.join(args)} exited {result.returncode}:\n{_tail(result.stdout)}")
        return result

    def container(self, service: str) -> str:
        """The id of the service's (non one-off) container, running or not."""
        out = subprocess.run(
            [
                "docker",
                "ps",
                "-aq",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--filter",
                f"label=com.docker.compose.service={service}",
                "--filter",
                "label=com.docker.compose.oneoff=False",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        assert len(out) == 1, f"expected one {service} container, found {out}"
        return out[0]

    def state(self, service: str, field: str) -> str:
        return subprocess.run(
            ["docker", "inspect", "-f", f"{{{{{field}}}}}", self.container(service)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()

    def logs(self, *services: str) -> str:
        return self.run("logs", "--no-color", "--tail", "25", *services, check=False, timeout=60).stdout

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(services)
        while pending:
            pending = [s for s in pending if self.state(s, ".State.Health.Status") != "healthy"]
            if pending and time.monotonic() > deadline:
                pytest.fail(f"{pending} not healthy after {timeout_s:.0f}s:\n{self.logs(*pending)}")
            time.sleep(0.5)

    def assert_stopped_cleanly(self, service: str) -> None:
        """The stage got SIGTERM (through tini), logged its stop line and exited 0."""
        code = self.state(service, ".State.ExitCode")
        logs = self.logs(service)
        assert self.state(service, ".State.Running") == "false", f"{service} still running"
        assert code == "0", f"{service} exited {code} on SIGTERM:\n{logs}"
        assert f"zmq-omni stage {service}: stopped (" in logs, logs


_PROJECT_PREFIX = "zotest"


def _remove_projects_of_dead_runs() -> None:
    """``down`` every compose project of this test whose pytest process is gone (killed before teardown).

    Left running, their stages' health checks keep using CPU. A project of a live run is left alone.
    """
    listed = [
        subprocess.run(["docker", kind, "ls", *flags, "--filter", "label=com.docker.compose.project",
                        "--format", '{{.Label "com.docker.compose.project"}}'],
                       capture_output=True, text=True, timeout=60, check=False).stdout.split()
        for kind, flags in (("container", ["-a"]), ("network", []), ("volume", []))
    ]  # fmt: skip
    for name in sorted({name for names in listed for name in names}):
        match = re.fullmatch(rf"{_PROJECT_PREFIX}(\d+)x[0-9a-f]+", name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        Compose(name).run("down", "-v", "--remove-orphans", "-t", "0", check=False, timeout=180)


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    """Images built by docker/build-images.sh; a unique compose project, torn down at the end."""
    problem = _docker_problem()
    if problem is not None:
        message = f"the docker-compose test needs Docker: {problem}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    try:
        build = subprocess.run(
            [str(BUILD_SCRIPT)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"docker/build-images.sh took over {BUILD_TIMEOUT_S}s")
    if build.returncode != 0:
        pytest.fail(f"docker/build-images.sh exited {build.returncode}:\n{_tail(build.stdout)}")
    _remove_projects_of_dead_runs()
    # The pid in the name lets a later run tell a project whose pytest was killed (no teardown) from a live one.
    project = Compose(f"{_PROJECT_PREFIX}{os.getpid()}x{uuid.uuid4().hex[:6]}")
    try:
        yield project
    finally:
        project.run("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=180)


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_compose_up_completes_every_request(compose: Compose, tmp_path: Path) -> None:
    result = compose.run(
        "up",
        "--abort-on-container-exit",
        "--exit-code-from",
        "driver",
        timeout=300,
        env={"ZMQ_OMNI_REQUESTS": "4", "ZMQ_OMNI_CHUNKS": "64", "ZMQ_OMNI_PAYLOAD_SIZE": "65536"},
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, f"driver exited {result.returncode}:\n{_tail(out, 60)}\n{compose.logs(*STAGES)}"
    completed = sorted(set(re.findall(r"\b(req-\d{3}) completed: ", out)))
    assert completed == [f"req-{i:03d}" for i in range(4)], _tail(out, 60)
    assert "FAILED" not in out, _tail(out, 60)
    assert re.search(r"requests\s+4 / 4 completed", out), _tail(out, 60)

    # --abort-on-container-exit stopped the stages once the driver exited.
    for service in STAGES:
        compose.assert_stopped_cleanly(service)

    copied = subprocess.run(
        ["docker", "cp", f"{compose.container('driver')}:/data/out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert copied.returncode == 0, copied.stderr
    wavs = sorted((tmp_path / "out").glob("*.wav"))
    assert [p.name for p in wavs] == [f"req-{i:03d}.wav" for i in range(4)]
    for path in wavs:
        with wave.open(str(path), "rb") as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24_000)
            frames = wav.readframes(wav.getnframes())
        pcm = np.frombuffer(frames, dtype="<i2")
        assert pcm.size > 24_000, f"{path.name}: only {pcm.size} samples"
        assert int(np.abs(pcm).max()) > 1000, f"{path.name} is silent"


def _pump(stream: Iterator[str], lines: list[str], progress: queue.Queue[str]) -> None:
    for line in stream:
        lines.append(line)
        progress.put(line)


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_stopped_stage_fails_requests_at_driver(compose: Compose) -> None:
    compose.run("up", "-d", *STAGES, timeout=180)
    compose.wait_healthy(STAGES, timeout_s=90)
    drive = compose.command(
        "run",
        "--rm",
        "-T",
        "--use-aliases",
        "--no-deps",
        "driver",
        "zmq-omni",
        "drive",
        "--config",
        "/cfg/pipeline.yaml",
        "--requests",
        "4",
        "--chunks",
        str(CUT_CHUNKS),
        "--payload-size",
        "65536",
        "--wait-ready",
        "60",
        "--timeout",
        str(CUT_TIMEOUT_S),
        "--prefix",
        "cut",
    )
    lines: list[str] = []
    progress: queue.Queue[str] = queue.Queue()
    with subprocess.Popen(
        drive, cwd=REPO, env=compose.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines, progress), daemon=True)
        reader.start()
        try:
            # Stop the talker once audio is flowing, i.e. with every request mid-stream.
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, "driver ended before the talker was stopped:\n" + "".join(lines[-40:])
                assert time.monotonic() < deadline, "no audio within 120 s:\n" + "".join(lines[-40:])
                try:
                    line = progress.get(timeout=1)
                except queue.Empty:
                    continue
                match = re.search(r"audio chunks (\d+)", line)
                if match and int(match.group(1)) > 0 and "requests 0/4 done" in line:
                    break
            stopped_at = time.monotonic()
            compose.run("stop", "-t", "10", "talker", timeout=60)
            compose.assert_stopped_cleanly("talker")
            returncode = proc.wait(timeout=CUT_TIMEOUT_S + 60)
            took = time.monotonic() - stopped_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            reader.join(timeout=30)
    out = "".join(lines)
    assert returncode == 1, f"driver exited {returncode}:\n{_tail(out, 60)}"
    failed = dict(re.findall(r"^(cut-\d{3}) FAILED: (.*)$", out, re.MULTILINE))
    assert sorted(failed) == [f"cut-{i:03d}" for i in range(4)], _tail(out, 60)
    assert not re.search(r"^cut-\d{3} completed", out, re.MULTILINE)
    # A stream that went silent mid-run (the vocoder's or the driver's stall timer, whichever
    # fires first): an uninterrupted run never stalls, unlike a merely slow one hitting --timeout.
    assert any("stalled" in reason for reason in failed.values()), _tail(out, 60)
    assert took < CUT_TIMEOUT_S + 30, f"driver took {took:.0f}s after the talker stopped"


#: Runs in the intruder container: three clients that know the thinker's public key but hold no allowed key.
_INTRUDER = """
import json, sys, time
import zmq
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import TransportError
from zmq_omni.transport import probe

endpoint, server_key = sys.argv[1], sys.argv[2]
public, secret = (k.decode() for k in zmq.curve_keypair())
other, _ = (k.decode() for k in zmq.curve_keypair())
base = {"stage_id": "driver", "role": "sender", "endpoints": {"0": endpoint}, "shm": "off", "insecure": True,
        "delivery_timeout_s": 3.0, "heartbeat_s": 0.2, "peer_timeout_s": 1.0}
mine = {"curve_public_key": public, "curve_secret_key": secret}
clients = {"no-key": base, "wrong-key": {**base, **mine, "curve_server_key": other},
           "not-listed": {**base, **mine, "curve_server_key": server_key}}
report = {}
for name, config in clients.items():
    with ZmqConnector(config) as conn:
        accepted = [conn.put("driver", "0", f"sec-{i:03d}_driver_{100 + i}", {"evil": name})[0] for i in range(4)]
        deadline = time.monotonic() + 30
        failed = []
        while len(failed) < 4 and time.monotonic() < deadline:
            failed += [type(f.error).__name__ for f in conn.drain_failures()]
            time.sleep(0.1)
        report[name] = {"accepted": accepted, "failed": failed}
probes = {"no-key": {}, "wrong-key": {"server_key": other},
          "not-listed": {"server_key": server_key, "public_key": public, "secret_key": secret}}
for name, keys in probes.items():
    try:
        report[name]["probe"] = probe(endpoint, timeout_s=10, **keys)
    except TransportError as exc:
        report[name]["probe_error"] = type(exc).__name__ + ": " + str(exc)
# A raw plaintext socket: whatever it sends, nothing comes back.
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.linger = 0
sock.connect(endpoint)
sock.send_multipart([b"ZO", b"junk"])
report["raw_reply"] = bool(sock.poll(3000))
print(json.dumps(report), flush=True)
"""


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_intruder_on_the_network_gets_nothing_in_or_out(compose: Compose) -> None:
    keys_dir = REPO / "deploy" / "keys"
    thinker_pub = (keys_dir / "thinker.pub").read_text().strip()
    # Fresh stages: an earlier test of this module may have left them mid-failure.
    compose.run("up", "-d", "--force-recreate", *STAGES, timeout=180)
    compose.wait_healthy(STAGES, timeout_s=90)  # the healthchecks authenticate with health.keys
    drive = compose.command(
        "run",
        "--rm",
        "-T",
        "--use-aliases",
        "--no-deps",
        "driver",
        "zmq-omni",
        "drive",
        "--config",
        "/cfg/pipeline.yaml",
        "--requests",
        "4",
        "--chunks",
        "3000",
        "--payload-size",
        "65536",
        "--wait-ready",
        "60",
        "--timeout",
        "150",
        "--prefix",
        "sec",
    )
    # The intruder and the driver run side by side: the attack must not disturb the real stream.
    intruder_cmd = [
        "docker",
        "run",
        "--rm",
        "--network",
        f"{compose.project}_default",
        compose.image,
        "python",
        "-c",
        _INTRUDER,
        "tcp://thinker:5561",
        thinker_pub,
    ]
    with (
        subprocess.Popen(intruder_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as attack,
        subprocess.Popen(
            drive, cwd=REPO, env=compose.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        try:
            attack_out, attack_err = attack.communicate(timeout=180)
            out, _ = proc.communicate(timeout=240)
        finally:
            for running in (attack, proc):
                if running.poll() is None:
                    running.kill()
                    running.communicate(timeout=30)
    assert attack.returncode == 0, attack_out + attack_err
    report = json.loads(attack_out.strip().splitlines()[-1])
    for name in ("no-key", "wrong-key", "not-listed"):
        entry = report[name]
        # Nothing in: every put the intruder handed to ZeroMQ was never confirmed by the stage.
        assert entry["failed"] == ["DeliveryError"] * 4, (name, entry)
        # Nothing out: no health answer, an authentication error instead.
        assert "probe" not in entry and entry["probe_error"].startswith("AuthenticationError"), (name, entry)
    assert report["raw_reply"] is False
    assert proc.returncode == 0, f"driver exited {proc.returncode}:\n{_tail(out, 60)}\n{compose.logs(*STAGES)}"
    completed = sorted(set(re.findall(r"\b(sec-\d{3}) completed: ", out)))
    assert completed == [f"sec-{i:03d}" for i in range(4)], _tail(out, 60)
    assert "FAILED" not in out, _tail(out, 60)

    health = compose.run(
        "exec",
        "-T",
        "thinker",
        "zmq-omni",
        "health",
        "--config",
        "/cfg/pipeline.yaml",
        "--stage",
        "thinker",
        timeout=60,
    )
    stats = json.loads(health.stdout.strip().splitlines()[-1])
    assert stats["curve_refused"] >= 6, stats  # three senders and three probes, each refused at least once
    anonymous = compose.run(
        "exec", "-T", "thinker", "zmq-omni", "health", "--endpoint", "tcp://127.0.0.1:5561", check=False, timeout=60
    )
    assert anonymous.returncode == 1 and "requires authentication" in anonymous.stdout, anonymous.stdout
