"""README command 1 alone (``pip install`` of the project, no extras) is enough to deploy a pipeline from YAML.

A fresh virtualenv without system site-packages gets the base install from
PyPI; ``zmq-omni stage`` runs each stage of ``examples/pipeline.yaml`` and
``zmq-omni drive`` drives it, all from outside the checkout so the installed
package is what runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import reserve_port
from tests.stage_procs import stop_and_show

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("thinker", "talker", "vocoder")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_base_install_runs_stage_and_drive_from_yaml(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, cli = venv / "bin" / "python", venv / "bin" / "zmq-omni"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    # The base install only: PyYAML came with it, no extra did.
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; import yaml, zmq_omni; "
            "print([m for m in ('torch', 'prometheus_client', 'matplotlib', 'pytest') "
            "if u.find_spec(m)], zmq_omni.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    extras, where = probe.stdout.rsplit("] ", 1)
    assert extras == "[", probe.stdout  # nothing optional installed
    assert where.strip().startswith(str(venv)), probe.stdout  # the installed package, not the checkout

    config = tmp_path / "pipeline.yaml"
    shutil.copy(ROOT / "examples" / "pipeline.yaml", config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZMQ_OMNI_", "PYTHON", "VIRTUAL_ENV"))}
    for stage in ("DRIVER", "0", "1", "2"):
        env[f"ZMQ_OMNI_ENDPOINT_{stage}"] = f"tcp://127.0.0.1:{reserve_port()}"
    procs: dict[str, subprocess.Popen[str]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in STAGES}
    drive: subprocess.CompletedProcess[str] | None = None
    try:
        for name in STAGES:
            with open(logs[name], "w", encoding="utf-8") as log:
                procs[name] = subprocess.Popen(
                    [str(cli), "stage", "--config", str(config), "--stage", name],
                    cwd=tmp_path,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
        drive = subprocess.run(
            [
                str(cli),
                "drive",
                "--config",
                str(config),
                "--requests",
                "2",
                "--chunks",
                "2",
                "--payload-size",
                "32768",
                "--out",
                str(tmp_path / "wavs"),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        stop_and_show(procs, logs)
        if drive is not None:
            print(f"--- drive (exit {drive.returncode}) ---\n{drive.stdout}{drive.stderr}")
    assert drive is not None and drive.returncode == 0, drive
    assert "req-000 completed" in drive.stdout and "req-001 completed" in drive.stdout
    assert f"2 WAV files in {(tmp_path / 'wavs').resolve()}/" in drive.stdout
    assert {name: proc.returncode for name, proc in procs.items()} == dict.fromkeys(STAGES, 0)
