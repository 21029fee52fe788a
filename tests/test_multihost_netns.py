"""Two "hosts" made of network namespaces joined by a veth pair: TCP + CURVE across them, and a partition.

The namespaces and addresses are created and removed by the fixture; traffic
stays inside them. Needs root and iproute2: on CI (``CI=true``) their absence
fails the test, elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.conftest import need_privilege
from tests.zmq_peers import expected_digest

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parent.parent
PORT = 5601  # a fresh namespace has no other listener, so a fixed port cannot collide
#: The partition tests run plaintext between namespaces: the explicit opt-out (docs/security.md).
PLAINTEXT = {"insecure": True}


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)


@dataclass
class Hosts:
    a: str
    b: str
    addr_a: str
    addr_b: str
    link_a: str

    def run(self, ns: str, *args: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.netns_peer", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        need_privilege("needs root and iproute2 (ip netns) to build two network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"zoA{tag}", f"zoB{tag}"
    link_a, link_b = f"zva{tag}", f"zvb{tag}"
    # 10.251.x.x/30 lives only inside these namespaces.
    octet = int(tag[:2], 16)
    addr_a, addr_b = f"10.251.{octet}.1", f"10.251.{octet}.2"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", link_a, "type", "veth", "peer", "name", link_b)
        _ip("link", "set", link_a, "netns", a)
        _ip("link", "set", link_b, "netns", b)
        for ns, link, addr in ((a, link_a, addr_a), (b, link_b, addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _ip("netns", "del", a, check=False)
        _ip("netns", "del", b, check=False)
        need_privilege(f"cannot create network namespaces: {exc.stderr.decode(errors='replace').strip()}")
    try:
        yield Hosts(a, b, addr_a, addr_b, link_a)
    finally:
        _ip("netns", "del", a, check=False)  # deleting a namespace removes its veth end and the pair
        _ip("netns", "del", b, check=False)


def _lines(proc: subprocess.Popen[str], timeout: float = 60.0) -> list[dict[str, Any]]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"peer hung; stderr:\n{err}")
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _curve() -> tuple[dict[str, Any], dict[str, Any]]:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    receiver = {
        "curve_public_key": server_public.decode(),
        "curve_secret_key": server_secret.decode(),
        "curve_allowed_clients": [client_public.decode()],
    }
    sender = {
        "curve_public_key": client_public.decode(),
        "curve_secret_key": client_secret.decode(),
        "curve_server_key": server_public.decode(),
    }
    return receiver, sender


def test_curve_transfer_between_two_hosts(hosts: Hosts) -> None:
    endpoint = f"tcp://{hosts.addr_b}:{PORT}"
    recv_keys, send_keys = _curve()
    receiver = hosts.run(
        hosts.b,
        "recv",
        "--count",
        "12",
        "--config",
        json.dumps({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}, **recv_keys}),
    )
    sender = hosts.run(
        hosts.a,
        "send",
        "--count",
        "12",
        "--config",
        json.dumps({"stage_id": "0", "role": "sender", "endpoints": {"1": endpoint}, **send_keys}),
    )
    sent, got = _lines(sender), _lines(receiver)
    assert sent[-1]["failures"] == [] and all(sent[-1]["accepted"])
    digests = got[-1]["digests"]
    assert digests == {f"req{i}_0_0": expected_digest(1 << 20, i) for i in range(12)}
    # both ends are in different network namespaces: nothing went through the shared-memory path
    assert got[-1]["health"]["bytes_received"] >= 12 << 20


def test_partition_reports_every_put_as_failed(hosts: Hosts) -> None:
    endpoint = f"tcp://{hosts.addr_b}:{PORT}"
    _ip("-n", hosts.a, "link", "set", hosts.link_a, "down")  # host B is unreachable from host A
    sender = hosts.run(
        hosts.a,
        "send",
        "--count",
        "5",
        "--size",
        "1000",
        "--timeout",
        "20",
        "--config",
        json.dumps(
            {
                "stage_id": "0",
                "role": "sender",
                "endpoints": {"1": endpoint},
                **PLAINTEXT,
                "delivery_timeout_s": 2.0,
                "put_timeout_s": 2.0,
            }
        ),
    )
    done = _lines(sender)[-1]
    failed = {f["key"] for f in done["failures"]}
    # every put is either refused at once or reported later as undelivered: none is lost silently
    refused = {f"req{i}_0_0" for i, ok in enumerate(done["accepted"]) if not ok}
    assert failed | refused == {f"req{i}_0_0" for i in range(5)}
    assert done["health"]["pending"] == 0


def test_a_partition_that_heals_within_the_deadline_loses_nothing_and_duplicates_nothing(hosts: Hosts) -> None:
    endpoint = f"tcp://{hosts.addr_b}:{PORT}"
    count = 60
    receiver = hosts.run(
        hosts.b,
        "recv",
        "--count",
        str(count),
        "--size",
        "4096",
        "--timeout",
        "60",
        "--linger",
        "1",
        "--config",
        json.dumps({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}, **PLAINTEXT}),
    )
    # One put every 50 ms for 3 s; the link goes down for 2.5 s in the middle of it, longer than
    # peer_timeout_s, so the sender presumes the receiver gone meanwhile. Puts keep being accepted; when
    # the link comes back, what ZeroMQ queued and whatever the sender resends arrives, once each.
    sender = hosts.run(
        hosts.a,
        "send",
        "--count",
        str(count),
        "--size",
        "4096",
        "--interval",
        "0.05",
        "--timeout",
        "60",
        "--config",
        json.dumps(
            {
                "stage_id": "0",
                "role": "sender",
                "endpoints": {"1": endpoint},
                **PLAINTEXT,
                "heartbeat_s": 0.2,
                "peer_timeout_s": 1.0,
                "delivery_timeout_s": 40.0,
            }
        ),
    )
    assert sender.stdout is not None
    assert json.loads(sender.stdout.readline())["event"] == "ready"
    time.sleep(0.5)
    _ip("-n", hosts.a, "link", "set", hosts.link_a, "down")
    time.sleep(2.5)
    _ip("-n", hosts.a, "link", "set", hosts.link_a, "up")
    sent, got = _lines(sender, timeout=90), _lines(receiver, timeout=90)
    assert sent[-1]["failures"] == [] and all(sent[-1]["accepted"]), sent[-1]
    assert sent[-1]["health"]["pending"] == 0
    assert got[-1]["digests"] == {f"req{i}_0_0": expected_digest(4096, i) for i in range(count)}
    # Nothing arrived twice: a second copy would still be waiting in the mailbox a second later.
    assert got[-1]["health"]["mailbox"] == 0, got[-1]["health"]


_BIND = """
import json, sys
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError
config = json.loads(sys.argv[1])
try:
    with ZmqConnector(config) as conn:
        print("bound", conn.endpoint)
except ConfigError as exc:
    print("refused", exc)
"""


def test_plaintext_bind_on_a_real_network_address_is_refused_and_the_opt_out_binds(hosts: Hosts) -> None:
    endpoint = f"tcp://{hosts.addr_b}:{PORT}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}
    env["PYTHONPATH"] = str(ROOT)
    outcomes = []
    for extra in ({}, PLAINTEXT):
        config = json.dumps({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}, **extra})
        done = subprocess.run(
            ["ip", "netns", "exec", hosts.b, sys.executable, "-c", _BIND, config],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outcomes.append((done.stdout.strip(), done.stderr))
    (refused, _), (bound, _) = outcomes
    assert refused.startswith(f"refused refusing plaintext TCP on {endpoint} (bind)") and "\n" not in refused, refused
    assert bound == f"bound {endpoint}"
