"""Fixtures shared by every test: short temp dirs for ipc paths, contexts closed with linger=0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from zmq_omni.metrics import Counters
from zmq_omni.transport._receive_protocol import ReceiveProtocol

# Hypothesis profiles: CI runs the full count, derandomized so a failure reproduces.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
    )
    settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("ci" if os.environ.get("CI") else "dev")
except ImportError:  # pragma: no cover - hypothesis is in the dev extra
    pass


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: ``ipc://`` paths must stay under ~100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="zo-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private tmpfs directory: leak checks see (and sweeps touch) only this test's segments."""
    path = tempfile.mkdtemp(prefix="zt-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; its last verdict."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def sweep_leftovers_of(pids: list[int]) -> None:
    """After a test killed processes with SIGKILL: the sweep removes whatever they left in /dev/shm."""
    from zmq_omni.shm import default_shm_dir, parse_name, sweep

    def theirs() -> list[str]:
        return [n for n in os.listdir(default_shm_dir()) if (o := parse_name(n)) is not None and o.pid in pids]

    sweep()
    assert theirs() == []


def need_privilege(reason: str) -> None:
    """Skip a test that needs root (mounts, namespaces) on a developer machine; fail it on CI."""
    if os.environ.get("CI"):
        pytest.fail(f"cannot run on CI: {reason}")
    pytest.skip(reason)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[str]:
    """A 4 MiB tmpfs standing in for a too-small /dev/shm (Docker's default is 64 MB)."""
    mnt = tmp_path / "tinyshm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        need_privilege("cannot mount a tmpfs here (needs root)")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A private context; every socket made from it is closed with linger=0 at teardown."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """ZmqConnectors a test builds and appends here; each is closed at once when the test ends."""
    connectors: list[Any] = []
    yield connectors
    for conn in connectors:
        conn.close_with_linger(0)


def bytes_protocol(counters: Counters | None = None, **options: Any) -> ReceiveProtocol:
    """A ``ReceiveProtocol`` fed by hand: each payload decodes to its bytes; ``options`` override the small defaults."""
    settings: dict[str, Any] = {
        "endpoint": "ipc://test",
        "incarnation": "r1",
        "decode": lambda parts: bytes(parts[0]),
        "decode_each": lambda wires: [bytes(w) for w in wires],
        "max_message_bytes": 1 << 20,
        "max_frames": 8,
        "counters": counters if counters is not None else Counters(),
        "shm": None,
    }
    settings.update(options)
    return ReceiveProtocol(**settings)


ROOT = Path(__file__).resolve().parent.parent


def python_in_repo(
    *args: str, env: dict[str, str] | None = None, stderr: int | None = subprocess.STDOUT
) -> subprocess.Popen[str]:
    """``python *args`` from the repository root (this checkout importable), lines on text pipes, stderr merged."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def stage_receiver_extra(endpoint: str, shm_dir: str, peer_timeout_s: float = 0.5) -> dict[str, object]:
    """A receiver of stage 1 at ``endpoint``, with heartbeats quick enough for a binder's death to show soon."""
    return {
        "stage_id": 1,
        "role": "receiver",
        "endpoints": {"1": endpoint},
        "heartbeat_s": 0.1,
        "peer_timeout_s": peer_timeout_s,
        "shm_dir": shm_dir,
    }
