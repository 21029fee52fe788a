"""A stage endpoint shared by the processes of a stage on one host (issue 46): lent keys, a binder killed mid-stream.

Every process is built from the same ``extra``: the first binds the stage
endpoint (it holds the stage lock), the others are its local clients. Each
test's processes are real OS processes; the sender is this test's process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import python_in_repo, stage_receiver_extra
from zmq_omni.connectors.zmq import ZmqConnector

BIG = 700 << 10  # above the shared-memory threshold: lent as a slot handle


def _start(
    extra: dict[str, object], keys: list[str], wait_s: float | str | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    blocking = [] if wait_s is None else [str(wait_s)]
    proc = python_in_repo("-m", "tests.stage_endpoint_proc", json.dumps(extra), ",".join(keys), *blocking, env=env)
    assert proc.stdout is not None
    return proc


def _start_binder(extra: dict[str, object], procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """The first process of the stage: it binds (its receiving part is the endpoint's PushReceiver)."""
    binder = _start(extra, [])
    procs.append(binder)
    assert binder.stdout is not None and binder.stdout.readline().split() == ["up", "PushReceiver"]
    return binder


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _payload(index: int) -> dict[str, np.ndarray]:
    size = BIG if index % 4 == 2 else 64
    return {"data": np.full(size // 4, index, dtype=np.int32)}


@pytest.mark.timeout(120)
def test_a_binder_killed_mid_stream_loses_nothing_confirmed(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = stage_receiver_extra(endpoint, shm_dir)
    keys = [f"req-{i}_0_0" for i in range(12)]
    binder = _start_binder(extra, procs)
    client = _start(extra, keys)
    procs.append(client)
    assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
    sender_extra = {"role": "sender", "endpoints": {"1": endpoint}, "heartbeat_s": 0.1, "peer_timeout_s": 0.5}
    with ZmqConnector({**sender_extra, "shm_dir": shm_dir}) as sender:
        for index, key in enumerate(keys):
            assert sender.put("0", "1", key, _payload(index))[0]
        lines = [client.stdout.readline().split() for _ in range(3)]
        # most keys (shared-memory ones among them) are still in the binder's mailbox, unconsumed
        binder.send_signal(signal.SIGKILL)
        binder.wait(timeout=10)
        lines += [client.stdout.readline().split() for _ in range(len(keys) - 3)]
        done = client.stdout.readline().split()
        assert client.wait(timeout=30) == 0, lines
        assert sender.flush(10.0), sender.health()
    assert lines == [[key, str(_payload(i)["data"].nbytes), str(i)] for i, key in enumerate(keys)]
    assert done == ["done", "StageClient", "binds"]  # the client bound the endpoint after the binder died


@pytest.mark.timeout(120)
def test_a_shared_memory_get_mapping_as_the_binder_dies_is_counted_consumed_once(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    """The client's get maps a lent slot (slowly) while the binder dies: the next binder counts it consumed."""
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = stage_receiver_extra(endpoint, shm_dir, peer_timeout_s=0.3)
    keys = [f"req-{i}_0_0" for i in range(4)]  # req-2 is in shared memory
    binder = _start_binder(extra, procs)
    client = _start(extra, keys, env={"SLOW_SHM_OPEN_S": "1.0"})
    procs.append(client)
    assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
    sender_extra = {"role": "sender", "endpoints": {"1": endpoint}, "heartbeat_s": 0.1, "peer_timeout_s": 0.3}
    with ZmqConnector({**sender_extra, "shm_dir": shm_dir, "shm": "on"}) as sender:  # req-2 waits for the verdict
        for index, key in enumerate(keys):
            assert sender.put("0", "1", key, _payload(index))[0]
        lines = [client.stdout.readline().split() for _ in range(3)]
        assert lines[2] == ["opening"], lines  # the get of req-2 maps its slot now
        binder.send_signal(signal.SIGKILL)
        binder.wait(timeout=10)
        lines += [client.stdout.readline().split() for _ in range(2)]
        done = client.stdout.readline().split()
        assert client.wait(timeout=30) == 0, lines
        # req-2 was delivered once; its resend to the new binder is counted consumed, so the sender hears so
        assert sender.flush(10.0), json.dumps(sender.health())
    got = [line for line in lines if line != ["opening"]]
    assert got == [[key, str(_payload(i)["data"].nbytes), str(i)] for i, key in enumerate(keys)]
    assert done == ["done", "StageClient", "binds"]


@pytest.mark.timeout(120)
def test_after_the_binder_dies_one_client_binds_and_the_other_gets_from_it(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = stage_receiver_extra(endpoint, shm_dir)
    mine = {name: [f"{name}-{i}_0_0" for i in range(6)] for name in ("a", "b")}
    binder = _start_binder(extra, procs)
    clients = {name: _start(extra, keys) for name, keys in mine.items()}
    procs.extend(clients.values())
    for client in clients.values():
        assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
    with ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender:
        for index in range(6):
            for keys in mine.values():
                assert sender.put("0", "1", keys[index], _payload(index))[0]
        got = {name: [c.stdout.readline().split()[0] for _ in range(2)] for name, c in clients.items() if c.stdout}
        binder.send_signal(signal.SIGKILL)
        binder.wait(timeout=10)
        ends = {}
        for name, client in clients.items():
            assert client.stdout is not None
            got[name] += [client.stdout.readline().split()[0] for _ in range(4)]
            ends[name] = client.stdout.readline().split()
            assert client.wait(timeout=30) == 0, got
    assert got == mine  # each process got its keys, each once
    assert sorted(end[2] for end in ends.values()) == ["binds", "client"]  # one took the stage lock


@pytest.mark.timeout(60)
def test_a_client_that_closes_gives_back_what_no_get_took(short_tmp: Path, shm_dir: str) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = {"stage_id": 1, "role": "receiver", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}
    code = (
        "import json, sys, time\n"
        "from zmq_omni.connectors.zmq import ZmqConnector\n"
        "c = ZmqConnector(json.loads(sys.argv[1]))\n"
        "gen = c.get_wakeup_generation()\n"
        "print(type(c._bound.receiver).__name__, c.get('0', '1', 'k'), flush=True)\n"  # asks the binder for k
        "print('lent' if c.wait_for_change(gen, timeout=20) != gen else 'nothing', flush=True)\n"
        "sys.stdin.readline()\n"
        "c.close()\n"
    )
    with (
        ZmqConnector(extra) as binder,
        ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender,
    ):
        child = python_in_repo("-c", code, json.dumps(extra), stderr=None)
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().split() == ["StageClient", "None"]
            assert sender.put("0", "1", "k", _payload(2))[0]  # a shared-memory payload, lent to the child
            assert child.stdout.readline().strip() == "lent"  # in the child's mailbox; no get took it
            child.stdin.write("close\n")
            child.stdin.flush()
            assert child.wait(timeout=30) == 0
            got = binder.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 10)  # given back
            assert sender.flush(10)  # consumed (a shared-memory put is safe once its slot was read)
            assert got is not None and int(got[0]["data"][0]) == 2 and got[0]["data"].nbytes == BIG
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()


@pytest.mark.timeout(60)
def test_a_blocking_get_in_flight_when_the_binder_dies_waits_on_to_its_deadline(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = stage_receiver_extra(endpoint, shm_dir)
    binder = _start_binder(extra, procs)
    client = _start(extra, ["late_0_0"], wait_s=20.0)
    procs.append(client)
    assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
    time.sleep(0.3)  # the client's get waits on the binder's lend
    binder.send_signal(signal.SIGKILL)
    binder.wait(timeout=10)
    time.sleep(1.5)  # past the peer timeout: the client binds (its get still waiting) before the put
    with ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender:
        assert sender.put("0", "1", "late_0_0", _payload(1))[0]
        line = client.stdout.readline().split()
        assert client.wait(timeout=30) == 0, line
    assert line == ["late_0_0", "64", "1"]


@pytest.mark.timeout(60)
def test_a_stalled_client_keeps_what_it_was_lent_and_gets_it_once_it_runs_again(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = stage_receiver_extra(endpoint, shm_dir)
    with ZmqConnector(extra) as binder:  # this process binds; the client asks it for the key
        client = _start(extra, ["k_0_0"])
        procs.append(client)
        assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
        time.sleep(0.5)  # the client's polling get wants the key at the binder
        client.send_signal(signal.SIGSTOP)  # alive, silent: the lend waits in its socket
        try:
            with ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender:
                assert sender.put("0", "1", "k_0_0", _payload(1))[0]
                # well past the peer timeout: the lease stays with the stalled client, not back here
                assert binder.get_with_deadline("0", "1", "k_0_0", deadline=time.monotonic() + 2.0) is None
                client.send_signal(signal.SIGCONT)
                line = client.stdout.readline().split()
                assert client.wait(timeout=30) == 0, line
        finally:
            client.send_signal(signal.SIGCONT)
    assert line == ["k_0_0", "64", "1"]


@pytest.mark.timeout(60)
def test_an_item_lent_to_a_client_and_dropped_there_unclaimed_is_reported_dropped_to_its_sender(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = {
        "stage_id": 1,
        "role": "receiver",
        "endpoints": {"1": endpoint},
        "heartbeat_s": 0.1,
        "peer_timeout_s": 0.5,
        "shm_dir": shm_dir,
        "unclaimed_ttl_s": 1.0,
    }
    with ZmqConnector(extra):  # this process binds; the client asks it once for the key, then no get takes it
        client = _start(extra, ["k_0_0"], "once")
        procs.append(client)
        assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
        assert client.stdout.readline().split() == ["asked"]
        time.sleep(0.3)
        with ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender:
            assert sender.put("0", "1", "k_0_0", _payload(1))[0]
            failures: list[Any] = []
            deadline = time.monotonic() + 10
            while not failures and time.monotonic() < deadline:
                time.sleep(0.1)
                failures = sender.drain_failures()
        assert client.stdin is not None
        client.stdin.close()
        assert client.wait(timeout=30) == 0
    assert [(f.key, "unclaimed" in str(f)) for f in failures] == [("k_0_0", True)]


@pytest.mark.timeout(60)
def test_a_stalled_binder_keeps_its_role_and_its_client_keeps_what_it_was_lent(
    short_tmp: Path, shm_dir: str, procs: list[subprocess.Popen[str]]
) -> None:
    endpoint = f"ipc://{short_tmp}/stage1.sock"
    extra = stage_receiver_extra(endpoint, shm_dir)
    binder = _start_binder(extra, procs)
    client = _start(extra, ["k_0_0"], "once")
    procs.append(client)
    assert client.stdout is not None and client.stdout.readline().split() == ["up", "StageClient"]
    assert client.stdout.readline().split() == ["asked"]
    with ZmqConnector({"role": "sender", "endpoints": {"1": endpoint}, "shm_dir": shm_dir}) as sender:
        assert sender.put("0", "1", "k_0_0", _payload(1))[0]
        time.sleep(0.5)  # lent: it waits in the client's mailbox, no get took it yet
        binder.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.5)  # three peer timeouts of silence: the binder lives and holds the stage lock
        finally:
            binder.send_signal(signal.SIGCONT)
        assert client.stdin is not None
        client.stdin.write("get\n")
        client.stdin.flush()
        line = client.stdout.readline().split()
        done = client.stdout.readline().split()
        assert client.wait(timeout=30) == 0, line
        assert sender.flush(5)  # counted consumed by the binder
    assert line == ["k_0_0", "64", "1"]
    assert done == ["done", "StageClient", "client"]  # nobody else bound the endpoint
