"""The stage lock: one process of a stage binds its endpoint; the kernel hands the lock on when that process dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_until
from zmq_omni.errors import ConfigError
from zmq_omni.transport._stage_lock import StageLock, stage_paths

ROOT = Path(__file__).resolve().parent.parent
HOLD = (
    "import sys; from zmq_omni.transport._stage_lock import StageLock; "
    "lock = StageLock(sys.argv[1]); print(lock.try_acquire(), flush=True); sys.stdin.read(); lock.release()"
)


def _holder(endpoint: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, endpoint],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "True"
    return proc


def test_paths_sit_next_to_an_ipc_endpoint_and_in_the_run_dir_for_tcp(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ipc = stage_paths(f"ipc://{short_tmp}/stage1.sock")
    assert ipc.lock == f"{short_tmp}/stage1.sock.lock" and ipc.service == f"ipc://{short_tmp}/stage1.sock.share"
    monkeypatch.setenv("ZMQ_OMNI_RUN_DIR", str(short_tmp / "run"))
    tcp = stage_paths("tcp://10.0.0.2:5601")
    assert tcp.lock == f"{short_tmp}/run/stage-10.0.0.2-5601.lock"
    assert tcp.service == f"ipc://{short_tmp}/run/stage-10.0.0.2-5601.share"
    assert (short_tmp / "run").stat().st_mode & 0o777 == 0o700
    with pytest.raises(ConfigError, match="inproc"):
        stage_paths("inproc://x")


def test_one_holder_at_a_time_and_a_release_hands_it_on(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/s1.sock"
    with StageLock(endpoint) as first, StageLock(endpoint) as second:
        assert first.try_acquire() and first.held and first.try_acquire()
        assert not second.try_acquire() and not second.held
        assert second.holder() == os.getpid()
        first.release()
        first.release()
        assert second.try_acquire()


def test_a_killed_holder_process_hands_the_lock_to_the_next(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/s1.sock"
    holder = _holder(endpoint)
    try:
        with StageLock(endpoint) as mine:
            assert not mine.try_acquire()
            assert mine.holder() == holder.pid
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
            assert wait_until(mine.try_acquire, timeout=5)
            assert mine.holder() == os.getpid()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()


def test_a_lock_left_unreleased_warns(short_tmp: Path) -> None:
    lock = StageLock(f"ipc://{short_tmp}/s1.sock")
    assert lock.try_acquire()
    with pytest.warns(ResourceWarning, match="never released"):
        lock.__del__()
    assert not lock.held


@pytest.mark.parametrize("shape", ["group_writable", "symlink"])
def test_a_run_dir_another_user_could_reach_is_refused(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    run = short_tmp / "run"
    if shape == "group_writable":
        run.mkdir(mode=0o700)
        run.chmod(0o770)
    else:
        (short_tmp / "elsewhere").mkdir(mode=0o700)
        run.symlink_to(short_tmp / "elsewhere")
    monkeypatch.setenv("ZMQ_OMNI_RUN_DIR", str(run))
    with pytest.raises(ConfigError, match=f"{run}.*ZMQ_OMNI_RUN_DIR"):
        stage_paths("tcp://10.0.0.2:5601")


FORK_AND_DIE = (
    "import os, sys, time; from zmq_omni.transport._stage_lock import StageLock; "
    "lock = StageLock(sys.argv[1]); assert lock.try_acquire(); pid = os.fork()\n"
    "if pid == 0: time.sleep(30); os._exit(0)\n"
    "print(pid, flush=True); os._exit(0)"
)


def test_a_forked_child_does_not_keep_the_lock_of_its_dead_parent(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/s1.sock"
    parent = subprocess.Popen(
        [sys.executable, "-c", FORK_AND_DIE, endpoint],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    with parent.stdout:
        child = int(parent.stdout.readline().strip())  # the child keeps the pipe open: read one line only
    assert parent.wait(timeout=30) == 0
    try:
        with StageLock(endpoint) as mine:
            assert wait_until(mine.try_acquire, timeout=5), "the forked child keeps its dead parent's stage lock"
    finally:
        os.kill(child, signal.SIGKILL)
