"""A stuck receiver must not make either side's memory grow: the window bounds both.

The sender runs in its own process so its resident memory can be read
cleanly; it puts 160 fresh 1 MiB arrays to a receiver that never calls
``get``. Without the byte window, ~160 MiB would pile up in the sender
(pinned payloads) and in the receiver (its mailbox).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmq_omni.connectors.zmq import ZmqConnector

from .zmq_peers import expect, spawned

MiB = 1 << 20
PUTS = 160
WINDOW = 8 * MiB


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def flood_main(config: dict[str, Any], puts: int, out: Any) -> None:
    """Put ``puts`` fresh 1 MiB arrays; report accepted/refused counts and RSS growth."""
    with ZmqConnector(config) as conn:
        warm = np.ones(MiB, dtype=np.uint8)
        conn.put("0", "1", "warmup", {"x": warm})
        gc.collect()
        before = _rss()
        accepted = refused = 0
        peak = before
        for i in range(puts):
            ok, _, _ = conn.put("0", "1", f"k{i}", {"x": np.full(MiB, i % 251, dtype=np.uint8)})
            accepted += ok
            refused += not ok
            peak = max(peak, _rss())
        out.put(("done", accepted, refused, peak - before, conn.health()))


@pytest.mark.parametrize("shm", ["off", "auto"])
def test_stuck_receiver_keeps_both_sides_memory_bounded(short_tmp: Path, shm: str) -> None:
    endpoint = f"ipc://{short_tmp}/stuck.sock"
    common = {"endpoints": {"1": endpoint}, "shm": shm, "malloc_tuning": False}
    with ZmqConnector({"stage_id": "1", "role": "receiver", **common}) as receiver:
        gc.collect()
        receiver_before = _rss()
        sender_config = {
            "stage_id": "0",
            "role": "sender",
            "max_unacked_bytes": WINDOW,
            "put_timeout_s": 0.05,
            "delivery_timeout_s": 60.0,
            **common,
        }
        with spawned(flood_main, sender_config, PUTS) as (_, queue):
            accepted, refused, sender_growth, health = expect(queue, "done", timeout=90)
        receiver_growth = _rss() - receiver_before
        assert accepted + refused == PUTS
        assert refused >= PUTS - 16, f"the 8 MiB window should refuse most puts, accepted {accepted}"
        assert health["timeouts"] >= refused  # each refusal is a timeout, counted
        # Bounded: a few windows of slack, far below the ~160 MiB an unbounded queue would hold.
        assert sender_growth < 6 * WINDOW, f"sender grew {sender_growth / MiB:.0f} MiB"
        assert receiver_growth < 6 * WINDOW, f"receiver grew {receiver_growth / MiB:.0f} MiB"
        assert receiver.health()["gets"] == 0
