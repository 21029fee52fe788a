"""Issue 13's soak: hundreds of streaming requests through three stage processes under faults.

Per transport (ipc with shared memory on; tcp on loopback), rounds of requests of
which one in eight is cancelled by the talker mid-stream, one raises in the
vocoder's function and one reuses an id, while the talker is SIGKILLed and
restarted in round 1 (see tests/soak.py for the scenario and the bounds). It
holds when every request ends as its kind says (completed with every chunk
exactly once and intact, or failed with its reason) within its bound; each
stage's RSS in the steady run grows less than ``RSS_GROWTH_BOUND_KIB``; every
window, mailbox and pending set is empty at the end; nothing of ours is left
in /dev/shm. Sizes: ``ZMQ_OMNI_SOAK_ROUNDS`` / ``_PER_ROUND`` / ``_CHUNKS``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak import SoakSettings, run_soak

pytest.importorskip("zmq_omni.connectors.zmq")


@pytest.mark.slow
@pytest.mark.timeout(600)  # rounds x (request_timeout_s + 15 s) + the quiesce wait, at worst
@pytest.mark.parametrize("transport", ["ipc-shm", "tcp"])
def test_soak_ends_every_request_and_leaves_nothing_behind(short_tmp: Path, transport: str) -> None:
    settings = SoakSettings.from_env(transport)
    report, logs = run_soak(settings, short_tmp)
    print(report.summary())  # the figures, shown by pytest -rP and when the test fails
    if report.problems:
        print(logs)
    assert len(report.outcomes) == settings.rounds * settings.per_round
    assert {o.kind for o in report.outcomes} == {"normal", "cancel", "raise", "reuse"}
    assert report.kill, "the stage was never killed"
    assert report.problems == [], "\n".join(report.problems[:20])
