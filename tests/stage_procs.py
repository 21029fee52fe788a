"""Stopping stage processes a test started, and showing what each printed (pytest shows it when a test fails)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path


def stop_and_show(procs: Mapping[str, subprocess.Popen[str]], logs: Mapping[str, Path]) -> None:
    """SIGTERM every process still running, wait for each (killing one that lingers), then print its log."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for name, proc in procs.items():
        print(f"--- stage {name} (exit {proc.returncode}) ---\n{logs[name].read_text(errors='replace')}")
