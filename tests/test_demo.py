"""``zmq-omni demo`` run as users run it: a subprocess with its own stage processes."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import pid_alive, sweep_leftovers_of
from zmq_omni.cli.demo_stages import GROUP, HIDDEN, SAMPLE_RATE, SAMPLES_PER_CODE

CLI = [sys.executable, "-m", "zmq_omni.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The second field (comm) may contain spaces; the ppid is the 2nd field after its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [pid for pid in pids if pid_alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if pid_alive(pid)]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_demo_completes_every_request_and_writes_valid_wavs(short_tmp: Path, transport: str) -> None:
    out = short_tmp / "wavs"
    chunks, payload = 3, 32 * 1024
    result = subprocess.run(
        [
            *CLI,
            "demo",
            "--requests",
            "3",
            "--chunks",
            str(chunks),
            "--payload-size",
            str(payload),
            "--out",
            str(out),
            "--transport",
            transport,
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(),
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 / 3 completed" in result.stdout
    assert [line.split()[-1] for line in result.stdout.splitlines() if line.strip().startswith("failures")] == ["0"]
    for hop in ("driver -> thinker", "thinker -> talker", "talker -> vocoder", "vocoder -> driver"):
        assert hop in result.stdout
    assert "time to first audio  p50 " in result.stdout
    frames = payload // (HIDDEN * 4)
    expected_samples = chunks * (frames // GROUP) * SAMPLES_PER_CODE
    wavs = sorted(out.glob("*.wav"))
    assert [p.name for p in wavs] == ["req-000.wav", "req-001.wav", "req-002.wav"]
    signals = []
    for path in wavs:
        with wave.open(str(path), "rb") as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
            assert wav.getnframes() == expected_samples
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
        assert np.abs(pcm).max() > 1000  # not silent
        assert np.sqrt(np.mean(pcm.astype(np.float64) ** 2)) > 300
        signals.append(pcm)
    assert not np.array_equal(signals[0], signals[1])  # each request has its own audio


def _start_long_demo(out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "demo", "--requests", "4", "--chunks", "5000", "--payload-size", "65536", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _wait_children(proc: subprocess.Popen[str], count: int = 3, timeout: float = 30.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kids = _children(proc.pid)
        if len(kids) >= count:
            return kids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the demo did not start its stage processes")


@contextmanager
def _long_demo(out: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """A long demo run and its stage pids; afterwards no stage may be left, nor the talker's segments."""
    proc = _start_long_demo(out)
    try:
        kids = _wait_children(proc)
        yield proc, kids
    finally:
        if proc.poll() is None:
            proc.kill()
            out, err = proc.communicate()
            print(f"--- demo (killed) ---\n{out}{err}")  # shown by pytest when the test failed
    assert _wait_gone(kids) == []
    sweep_leftovers_of([kids[1]])  # a killed stage's segments do not outlive a sweep


def test_ctrl_c_leaves_no_stage_process_behind(short_tmp: Path) -> None:
    with _long_demo(short_tmp / "out") as (proc, _):
        time.sleep(1.0)  # let requests flow
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0, out + err
        assert "Traceback" not in err, err


def _wait_audio_flowing(proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Read the demo's progress lines (stderr) until audio chunks come back."""
    stderr = proc.stderr
    assert stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    # The reader stops at the first matching line, so communicate() gets the rest of stderr.
    reader = threading.Thread(
        target=lambda: any(lines.put(line) or re.search(r"audio chunks [1-9]", line) for line in stderr),
        daemon=True,
    )
    reader.start()
    reader.join(timeout)
    seen = list(lines.queue)
    assert seen and re.search(r"audio chunks [1-9]", seen[-1]), f"no audio came back: {''.join(seen)}"


def test_crashed_stage_fails_requests_and_leaves_nothing_behind(short_tmp: Path) -> None:
    with _long_demo(short_tmp / "out") as (proc, kids):
        # Kill the talker while requests are in flight (not while the stages are still starting,
        # which a loaded machine can stretch past any fixed sleep).
        _wait_audio_flowing(proc)
        os.kill(kids[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, out + err
        assert "FAILED req-000: stage" in out and "exited with status -9" in out
