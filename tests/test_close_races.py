"""Races between a connector's close and the calls of other threads: only our own outcomes escape.

A get racing close returns None or raises ClosedResourceError, never a pyzmq error, whichever
side wins and wherever the close lands in the get. Repeated: each round is a fresh race.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ClosedResourceError

from .contention import forced_switches

ROUNDS = 500
_DELAYS = (0.0, 0.0005, 0.002)  # seconds from the getters' start to close, round after round
_BLOCKED_EVERY = 4  # a getter blocked far past the round joins every 4th round (with each pause in turn)


def _race_gets_with_close(connector: ZmqConnector, round_no: int) -> list[BaseException]:
    """Getter threads (polling, waiting briefly, every few rounds one blocked) while this thread closes ``connector``.

    The pause before close varies from round to round: it lands before the getters' first
    call, inside one, or while they wait.
    """
    errors: list[BaseException] = []
    blocking = round_no % _BLOCKED_EVERY == 0
    started = threading.Barrier(4 if blocking else 3)

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

    def blocked() -> None:
        # Waits far longer than the round lasts: only close ends its get, which must then return None.
        started.wait()
        try:
            while not connector.closed:
                got = connector.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 60)
                if got is not None:
                    errors.append(AssertionError(f"a get of a key never put returned {got!r}"))
        except ClosedResourceError:
            pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=t) for t in (polling, waiting, blocked)[: 3 if blocking else 2]]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(_DELAYS[round_no % len(_DELAYS)])
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
            escaped += _race_gets_with_close(receiver, n)
        else:
            with ZmqConnector({**config, "stage_id": "0", "role": "sender"}):
                receiver = ZmqConnector({**config, "stage_id": "1", "role": "receiver", "fetch_timeout_s": 5})
                escaped += _race_gets_with_close(receiver, n)


_STREAM_SCRIPT = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from contention import forced_switches
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


def test_a_first_get_that_finds_the_connector_closed_before_it_binds_returns_none(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connector with no role binds at its first get: a close between its closed check and the bind."""
    conn = ZmqConnector({"from_stage": 0, "to_stage": 1, "endpoints": {"1": f"ipc://{short_tmp}/l.sock"}, "shm": "off"})
    bind = conn._bound.receiver_or_bind

    def close_first(to_stage: str) -> Any:
        conn.close()  # (another thread's close, landing just after the get looked)
        return bind(to_stage)

    monkeypatch.setattr(conn._bound, "receiver_or_bind", close_first)
    try:
        assert conn.get("0", "1", "k") is None
    finally:
        conn.close()
