"""Races between a connector's close and the calls of other threads: only our own outcomes escape.

A get racing close returns None or raises ClosedResourceError, never a pyzmq error, whichever
side wins and wherever the close lands in the get. Repeated: each round is a fresh race.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ClosedResourceError

ROUNDS = 500


def _sleep_before_acquire(frame: Any, event: str, arg: Any) -> None:
    """A profile hook: every lock acquisition yields the CPU first, so check-then-acquire windows open wide."""
    if event == "c_call" and getattr(arg, "__name__", "") == "acquire":
        time.sleep(random.random() * 2e-4)


@contextmanager
def forced_switches() -> Iterator[None]:
    """Thread switches everywhere: a switch interval of 1 us and a sleep before every ``acquire``."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threading.setprofile(_sleep_before_acquire)
    try:
        yield
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setswitchinterval(switch)


def _race_gets_with_close(connector: ZmqConnector, peer: ZmqConnector | None) -> list[BaseException]:
    """Two getter threads (one polling, one waiting) while the main thread closes ``connector``."""
    errors: list[BaseException] = []
    started = threading.Barrier(3)

    def polling() -> None:
        started.wait()
        try:
            for _ in range(10_000):
                connector.get("0", "1", "k")
                if connector.closed:
                    connector.get("0", "1", "k")
                    break
        except ClosedResourceError:
            pass
        except BaseException as exc:
            errors.append(exc)

    def waiting() -> None:
        started.wait()
        try:
            while not connector.closed:
                connector.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 0.001)
        except ClosedResourceError:
            pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=polling), threading.Thread(target=waiting)]
    for thread in threads:
        thread.start()
    started.wait()
    connector.close()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "a get outlived close"
    return errors


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_get_racing_close_returns_none_or_raises_our_error(short_tmp: Path, mode: str) -> None:
    escaped: list[BaseException] = []
    with forced_switches():
        _rounds(short_tmp, mode, escaped)
    assert escaped == [], f"{len(escaped)} of {ROUNDS} rounds let through: {escaped[:3]!r}"


def _rounds(short_tmp: Path, mode: str, escaped: list[BaseException]) -> None:
    for n in range(ROUNDS):
        endpoints = {"1" if mode == "push" else "0": f"ipc://{short_tmp}/race-{n}.sock"}
        config: dict[str, Any] = {"endpoints": endpoints, "mode": mode}
        if mode == "push":
            receiver = ZmqConnector({**config, "stage_id": "1", "role": "receiver"})
            escaped += _race_gets_with_close(receiver, None)
        else:
            with ZmqConnector({**config, "stage_id": "0", "role": "sender"}) as sender:
                receiver = ZmqConnector({**config, "stage_id": "1", "role": "receiver", "fetch_timeout_s": 5})
                escaped += _race_gets_with_close(receiver, sender)


_STREAM_SCRIPT = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from test_close_races import forced_switches
from zmq_omni.connectors.zmq import ZmqConnector

N = {n}
endpoints = {{"1": "ipc://{tmp}/stream.sock"}}
got = []
lock = threading.Lock()
with forced_switches():
    with ZmqConnector({{"stage_id": "1", "role": "receiver", "endpoints": endpoints}}) as receiver, \\
         ZmqConnector({{"stage_id": "0", "role": "sender", "endpoints": endpoints}}) as sender:
        done = threading.Event()

        def getter(index):
            # Even getters poll every key; odd ones wait on their share: both kinds read the socket.
            while not done.is_set():
                for n in range(index, N, 4):
                    key = f"k{{n}}"
                    if index % 2:
                        found = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 0.002)
                    else:
                        found = receiver.get("0", "1", key)
                    if found is not None:
                        with lock:
                            got.append(found[0]["n"])
                            if len(got) >= N:
                                done.set()

        threads = [threading.Thread(target=getter, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for n in range(N):
            ok, _, _ = sender.put("0", "1", f"k{{n}}", {{"n": n}})
            assert ok, n
        done.wait(60)
        done.set()
        for thread in threads:
            thread.join(10)
print("received", len(got), "distinct", len(set(got)))
assert sorted(got) == list(range(N)), (len(got), len(set(got)))
"""


def test_concurrent_getters_under_a_stream_receive_every_item_once(short_tmp: Path) -> None:
    # In a child process: a socket touched by two threads at once aborts the whole process in libzmq.
    script = _STREAM_SCRIPT.format(tests=str(Path(__file__).parent), n=2000, tmp=short_tmp)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, f"rc={result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "received 2000 distinct 2000" in result.stdout
