"""A shared stage endpoint's binder changing under its clients (issue 46): each put delivered once.

The binder is killed, or closes and reopens its endpoint in the same process;
its clients must notice (even when their sockets reconnect by themselves to
the next binder), tell the next binder what their gets took, and not hand out
what the old binder lent. A client that closes while its process lives on is
forgotten by the binder. Every process is real; schedules are forced with
SIGSTOP/SIGCONT and stdin commands (tests/stage_change_proc.py), never timed.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import python_in_repo
from zmq_omni.connectors.zmq import ZmqConnector

KEY = "k_0_0"


class Proc:
    """A stage_change_proc process: send it lines, read its answers."""

    def __init__(self, mode: str, extra: dict[str, object], key: str = KEY, seconds: float | None = None) -> None:
        args = [mode, json.dumps(extra), key, *([] if seconds is None else [str(seconds)])]
        self.popen = python_in_repo("-m", "tests.stage_change_proc", *args, stderr=None)

    def line(self) -> str:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline().strip()

    def tell(self, command: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        popen = proc.popen
        if popen.poll() is None:
            popen.send_signal(signal.SIGCONT)
            popen.kill()
        popen.wait()
        for stream in (popen.stdin, popen.stdout):
            if stream is not None:
                stream.close()


def _extra(short_tmp: Path, shm_dir: str, heartbeat_s: float = 0.1, peer_timeout_s: float = 0.5) -> dict[str, object]:
    return {
        "stage_id": 1,
        "role": "receiver",
        "endpoints": {"1": f"ipc://{short_tmp}/stage1.sock"},
        "heartbeat_s": heartbeat_s,
        "peer_timeout_s": peer_timeout_s,
        "shm_dir": shm_dir,
    }


def _sender(extra: dict[str, object]) -> dict[str, object]:
    return {"role": "sender", "endpoints": extra["endpoints"], "shm_dir": extra["shm_dir"], "heartbeat_s": 0.1}


def _start(procs: list[Proc], mode: str, extra: dict[str, object], seconds: float | None = None) -> Proc:
    proc = Proc(mode, extra, seconds=seconds)
    procs.append(proc)
    return proc


@pytest.mark.timeout(120)
def test_a_put_taken_through_a_killed_binder_is_not_delivered_again_by_the_next(
    short_tmp: Path, shm_dir: str, procs: list[Proc]
) -> None:
    # a long peer timeout: the client hears of the next binder from its WHO, not from silence
    extra = _extra(short_tmp, shm_dir, peer_timeout_s=5.0)
    binder = _start(procs, "hold", extra)
    assert binder.line() == "up PushReceiver"
    client = _start(procs, "lend", extra)
    assert client.line() == "up StageClient" and client.line() == "asked"
    sender = _start(procs, "send", _sender(extra))
    assert sender.line().startswith("up")
    assert sender.line() == "put" and client.line() == "lent"
    sender.signal(signal.SIGSTOP)  # it resends only once the client told the next binder what it took
    binder.signal(signal.SIGSTOP)  # the client's TOOK is never read: the put stays unconsumed
    client.tell("take")
    assert client.line() == f"got {KEY}"
    binder.popen.kill()
    binder.popen.wait()
    successor = _start(procs, "poll", extra, seconds=8.0)  # it wants the same key, and binds
    assert successor.line() == "up PushReceiver"
    client.tell("rebound")
    rebound = client.line()  # it said hello to the successor, naming what it took
    sender.signal(signal.SIGCONT)
    sender.tell("flush")
    ends = [successor.line(), sender.line(), rebound]
    # the resend is counted consumed by the successor, not delivered a second time
    assert ends == ["none binds", "flush True", "rebound"]


@pytest.mark.timeout(120)
def test_blocking_gets_in_flight_when_the_binder_dies_each_get_their_key(
    short_tmp: Path, shm_dir: str, procs: list[Proc]
) -> None:
    extra = _extra(short_tmp, shm_dir, heartbeat_s=0.5, peer_timeout_s=3.0)
    binder = _start(procs, "hold", extra)
    assert binder.line() == "up PushReceiver"
    clients = {key: Proc("block", extra, key=key, seconds=60.0) for key in ("k_0_0", "j_0_0")}
    procs.extend(clients.values())
    for client in clients.values():
        assert client.line() == "up StageClient"
    time.sleep(1.0)  # both gets wait on the binder
    binder.popen.kill()
    binder.popen.wait()
    time.sleep(7.0)  # past two peer timeouts: one client binds, the other asks it (or missed it)
    with ZmqConnector(_sender(extra)) as sender:
        for key in clients:
            assert sender.put("0", "1", key, {"x": 1})[0]
        assert {key: client.line() for key, client in clients.items()} == {key: f"got {key}" for key in clients}


@pytest.mark.timeout(120)
def test_a_binder_that_reopens_its_endpoint_in_the_same_process_is_a_new_binder(
    short_tmp: Path, shm_dir: str, procs: list[Proc]
) -> None:
    extra = _extra(short_tmp, shm_dir)
    with ZmqConnector(_sender(extra)) as sender:
        first = ZmqConnector(extra)
        try:
            client = _start(procs, "lend", extra)
            assert client.line() == "up StageClient" and client.line() == "asked"
            assert sender.put("0", "1", KEY, {"x": 1})[0]
            assert client.line() == "lent"  # untaken in the client's mailbox
        finally:
            first.close()  # the lent item stays uncounted: its sender resends it
        with ZmqConnector(extra) as second:  # the same pid takes the stage lock again and binds
            client.tell("rebound")
            assert client.line() == "rebound"  # its mailbox of the first's lends withdrawn
            got = second.get_with_deadline("0", "1", KEY, deadline=time.monotonic() + 20)
            assert got is not None and got[0] == {"x": 1}
            client.tell("take")
            assert client.line() == "none"  # not a second time from the withdrawn lend


@pytest.mark.timeout(60)
def test_a_client_that_closes_is_forgotten_with_its_wants_and_never_reported_silent(
    short_tmp: Path, shm_dir: str, procs: list[Proc], caplog: pytest.LogCaptureFixture
) -> None:
    extra = _extra(short_tmp, shm_dir)
    caplog.set_level(logging.WARNING, logger="zmq_omni.transport")
    with ZmqConnector(extra) as binder, ZmqConnector(_sender(extra)) as sender:
        client = _start(procs, "askclose", extra)
        assert client.line() == "up StageClient" and client.line() == "closed"  # its process lives on
        assert sender.put("0", "1", KEY, {"x": 1})[0]
        got = binder.get_with_deadline("0", "1", KEY, deadline=time.monotonic() + 20)
        assert got is not None and got[0] == {"x": 1}  # not lent to the closed client
        time.sleep(1.5)  # three peer timeouts: a client the binder still knew would be reported silent
        assert sender.flush(10)
    assert [r.getMessage() for r in caplog.records if "silent" in r.getMessage()] == []


@pytest.mark.timeout(120)
def test_a_client_stalled_across_its_binders_death_does_not_hand_out_that_binders_lend(
    short_tmp: Path, shm_dir: str, procs: list[Proc]
) -> None:
    extra = _extra(short_tmp, shm_dir)
    binder = _start(procs, "hold", extra)
    assert binder.line() == "up PushReceiver"
    client = _start(procs, "lend", extra)
    assert client.line() == "up StageClient" and client.line() == "asked"
    with ZmqConnector(_sender(extra)) as sender:
        assert sender.put("0", "1", KEY, {"x": 1})[0]
        assert client.line() == "lent"
        client.signal(signal.SIGSTOP)
        try:
            binder.popen.kill()
            binder.popen.wait()
            successor = _start(procs, "poll", extra, seconds=20.0)
            assert successor.line() == "up PushReceiver"
            assert successor.line() == f"got {KEY} binds"  # the resend
            client.tell("take")  # read by the client's get as soon as it runs again
        finally:
            client.signal(signal.SIGCONT)
        assert client.line() == "none"


@pytest.mark.timeout(120)
def test_a_client_that_binds_after_its_binder_died_hands_out_nothing_before_the_others_hello(
    short_tmp: Path, shm_dir: str, procs: list[Proc]
) -> None:
    binder = _start(procs, "hold", _extra(short_tmp, shm_dir))
    assert binder.line() == "up PushReceiver"
    # the client that takes the key hears of the next binder from its WHO; the other binds after 3 s of silence
    client = _start(procs, "lend", _extra(short_tmp, shm_dir, peer_timeout_s=30.0))
    assert client.line() == "up StageClient" and client.line() == "asked"
    with ZmqConnector(_sender(_extra(short_tmp, shm_dir))) as sender:
        assert sender.put("0", "1", KEY, {"x": 1})[0]
        assert client.line() == "lent"
        successor = _start(procs, "poll", _extra(short_tmp, shm_dir, peer_timeout_s=3.0), seconds=12.0)
        assert successor.line() == "up StageClient"  # it wants the same key
        binder.signal(signal.SIGSTOP)  # the client's TOOK is never read: the put stays unconsumed
        client.tell("take")
        assert client.line() == f"got {KEY}"
        client.signal(signal.SIGSTOP)  # its hello comes only once the resend reached the successor
        try:
            binder.popen.kill()
            binder.popen.wait()
            assert successor.line() == "bound"  # it holds the resend for one peer timeout (3 s)
            time.sleep(1.0)  # the sender resends (its peer timeout is 0.5 s)
        finally:
            client.signal(signal.SIGCONT)
        client.tell("rebound")
        assert client.line() == "rebound"
        assert sender.flush(10)  # the resend counted consumed
    assert successor.line() == "none binds"  # not delivered a second time
