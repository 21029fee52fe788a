"""A pull endpoint shared by the processes of the sending stage on one host (issue 46): puts, a binder killed.

In pull mode the sending stage binds: the holder of the stage lock binds its
pull server, and the stage's other processes store their puts there. Each
process of stage 0 is a real OS process (``tests/stage_pull_proc.py``); the
fetching stage 1 is this test's process.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_in_repo
from zmq_omni.connectors.zmq import ZmqConnector


class Proc:
    """One stage-0 process and the lines it printed (read on a thread)."""

    def __init__(self, *argv: Any) -> None:
        """Start ``tests.stage_pull_proc`` with ``argv`` (dicts as JSON)."""
        args = [json.dumps(arg) if isinstance(arg, dict) else str(arg) for arg in argv]
        self.popen = python_in_repo("-m", "tests.stage_pull_proc", *args)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))

    def next(self, timeout_s: float = 30.0) -> str:
        line = self.lines.get(timeout=timeout_s)
        self.seen.append(line)
        return line

    def until(self, prefix: str | tuple[str, ...], timeout_s: float = 60.0) -> str:
        """Lines up to the first starting with ``prefix`` (returned)."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.next(max(0.1, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        if proc.popen.stdin is not None and not proc.popen.stdin.closed:
            proc.popen.stdin.close()
        if proc.popen.poll() is None:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        if proc.popen.stdout is not None:
            proc.popen.stdout.close()


def _extra(endpoint: str, shm_dir: str) -> dict[str, Any]:
    return {
        "stage_id": 0,
        "role": "sender",
        "mode": "pull",
        "endpoints": {"0": endpoint},
        "from_stage": "0",
        "to_stage": "1",
        "heartbeat_s": 0.1,
        "shm_dir": shm_dir,
    }


@pytest.fixture
def fetcher(short_tmp: Path, shm_dir: str) -> Iterator[ZmqConnector]:
    connector = ZmqConnector(
        {
            "stage_id": 1,
            "role": "receiver",
            "mode": "pull",
            "endpoints": {"0": f"ipc://{short_tmp}/stage0.sock"},
            "shm_dir": shm_dir,
        }
    )
    yield connector
    connector.close()


def _fetch(connector: ZmqConnector, key: str, wait_s: float = 15.0) -> Any:
    got = connector.get_with_deadline("0", "1", key, deadline=time.monotonic() + wait_s)
    return None if got is None else got[0]


@pytest.mark.timeout(120)
def test_any_process_of_the_stage_puts_and_the_fetcher_gets_every_key_from_the_one_endpoint(
    short_tmp: Path, shm_dir: str, procs: list[Proc], fetcher: ZmqConnector
) -> None:
    extra = _extra(f"ipc://{short_tmp}/stage0.sock", shm_dir)
    binder = Proc(extra, "a", 0, 0)
    procs.append(binder)
    assert binder.next() == "up binds"
    clients = [Proc(extra, name, 8, 0.0) for name in ("b", "c")]
    procs.extend(clients)
    for client in clients:
        assert client.next() == "up client"
    for name in ("b", "c"):
        for i in range(8):
            got = _fetch(fetcher, f"{name}-{i}")
            assert got is not None and got["key"] == f"{name}-{i}", (name, i)
    for client in clients:
        # a client's two large payloads crossed as handles of its slots
        assert client.until("flushed") == "flushed True 0 False 2", client.seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["killed", "closed"])
def test_after_the_binder_goes_no_confirmed_put_of_the_others_is_lost_or_fetched_twice(
    how: str, short_tmp: Path, shm_dir: str, procs: list[Proc], fetcher: ZmqConnector
) -> None:
    extra = _extra(f"ipc://{short_tmp}/stage0.sock", shm_dir)
    binder = Proc(extra, "a", 0, 0)
    procs.append(binder)
    assert binder.next() == "up binds"
    clients = [Proc(extra, name, 40, 0.02) for name in ("b", "c")]
    procs.extend(clients)
    for client in clients:
        assert client.next() == "up client"
    confirmed: list[str] = []
    got: dict[str, int] = {}
    for i in range(10):  # some puts fetched through the first binder, some left in its store
        for name, client in zip(("b", "c"), clients, strict=True):
            assert client.next() == f"ok {name}-{i}", client.seen
            if i < 6:
                value = _fetch(fetcher, f"{name}-{i}")
                assert value is not None and value["key"] == f"{name}-{i}"
                got[f"{name}-{i}"] = 1
            else:
                confirmed.append(f"{name}-{i}")
    if how == "killed":
        binder.popen.send_signal(signal.SIGKILL)
    else:
        assert binder.popen.stdin is not None
        binder.popen.stdin.close()
    assert binder.popen.wait(timeout=15) in (0, -signal.SIGKILL)
    for i in range(10, 40):
        for name, client in zip(("b", "c"), clients, strict=True):
            line = client.next()
            assert line == f"ok {name}-{i}", client.seen
            confirmed.append(f"{name}-{i}")
    for key in confirmed:  # every put confirmed and not fetched yet is fetched, once
        value = _fetch(fetcher, key)
        assert value is not None and value["key"] == key, key
        got[key] = got.get(key, 0) + 1
    assert all(count == 1 for count in got.values())
    finals = [client.until("flushed").split() for client in clients]
    # each client's payloads were all fetched; one of the clients binds the endpoint now
    assert sorted(final[1] + final[3] for final in finals) == ["TrueFalse", "TrueTrue"], [c.seen for c in clients]
    again = [key for key in got if fetcher.get("0", "1", key) is not None]
    assert again == [], "stored twice"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fetcher_shm", [False, True])
def test_a_put_whose_reply_had_not_left_when_the_binder_was_killed_is_fetched_from_the_next_binder(
    fetcher_shm: bool, short_tmp: Path, shm_dir: str, procs: list[Proc]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage0.sock"
    extra = _extra(endpoint, shm_dir)
    binder = Proc(extra, "a", 0, 0)
    procs.append(binder)
    assert binder.next() == "up binds"
    putter = Proc(extra, "b", 1, 0, 16 << 20, 3.0)  # one 16 MiB put, once told; its flush waits 3 s
    procs.append(putter)
    assert putter.next() == "up client"
    fetch_extra = {"stage_id": 1, "role": "receiver", "mode": "pull", "endpoints": {"0": endpoint}, "shm_dir": shm_dir}
    if not fetcher_shm:
        fetch_extra["shm"] = "off"
    fetcher = Proc("fetch", fetch_extra, "b-0", 30)
    procs.append(fetcher)
    assert fetcher.next() == "up"
    assert fetcher.popen.stdin is not None and putter.popen.stdin is not None
    fetcher.popen.stdin.write("go\n")
    fetcher.popen.stdin.flush()
    assert fetcher.next() == "asking"
    time.sleep(0.5)  # its FETCH is parked at the binder (for 2 s)...
    fetcher.popen.send_signal(signal.SIGSTOP)  # ...and it reads no reply
    try:
        putter.popen.stdin.write("go\n")
        putter.popen.stdin.flush()
        assert putter.next() == "ok b-0", putter.seen
        # The binder answers the parked FETCH; the reply cannot leave, so the put is not yet fetched.
        flushed = putter.until("flushed")
        binder.popen.send_signal(signal.SIGKILL)
        assert binder.popen.wait(timeout=15) == -signal.SIGKILL
    finally:
        fetcher.popen.send_signal(signal.SIGCONT)
    assert fetcher.until(("got", "none"), 40) == "got b-0", (flushed, fetcher.seen)
