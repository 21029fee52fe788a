"""Secure by default off the host (docs/security.md): the plaintext refusal, the opt-out, pipeline keys.

Every socket here talks over loopback; the non-loopback addresses (``0.0.0.0``,
``192.0.2.1`` of TEST-NET-1) are refused before any socket exists, so nothing
is sent to them.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from tests.test_cli import CLI, StageProcs, run_cli, write_pipeline
from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import AuthenticationError, ConfigError, DeliveryError
from zmq_omni.stages import load_pipeline_config
from zmq_omni.stages.keys import Party
from zmq_omni.transport import is_loopback, probe

PARTIES = ("thinker", "talker", "vocoder", "driver", "health")


def _no_io_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("zmq-omni")]


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5", True),
        ("tcp://127.8.9.1:5", True),
        ("tcp://localhost:5", True),
        ("tcp://[::1]:5", True),
        ("ipc:///tmp/x", True),
        ("tcp://0.0.0.0:5", False),
        ("tcp://*:5", False),
        ("tcp://10.1.2.3:5", False),
        ("tcp://talker:5", False),
        ("tcp://[::]:5", False),
        ("tcp://[::ffff:127.0.0.1]:5", True),
    ],
)
def test_what_counts_as_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


@pytest.mark.parametrize(
    "config",
    [
        {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://0.0.0.0:0"}},
        {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}, "bind": "tcp://*:0"},
        {"stage_id": "0", "role": "sender", "endpoints": {"1": "tcp://192.0.2.1:5555"}},
        {"stage_id": "0", "role": "receiver", "mode": "pull", "endpoints": {"1": "tcp://192.0.2.1:5555"}},
    ],
    ids=["bind-all", "bind-key", "connect", "pull-connect"],
)
def test_plaintext_off_the_host_is_refused_with_one_line(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as raised:
        ZmqConnector(config)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("refusing plaintext TCP on ")
    for hint in ("zmq-omni keygen", "keys_dir", "insecure: true", "ZMQ_OMNI_INSECURE=1", "docs/security.md"):
        assert hint in message, hint
    assert _no_io_threads()  # refused before any socket or thread was made


def test_loopback_and_ipc_need_no_keys(short_tmp: Path) -> None:
    for endpoint in ("tcp://127.0.0.1:0", f"ipc://{short_tmp}/s1"):
        with ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": endpoint}}) as receiver:
            assert receiver.endpoint is not None
            with ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": receiver.endpoint}}) as sender:
                assert sender.put("0", "1", "k", {"v": 1})[0]
                got = receiver.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 10)
                assert got is not None and got[0] == {"v": 1}


_OPT_OUT = textwrap.dedent("""
    import logging, sys, time
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    from zmq_omni.connectors.zmq import ZmqConnector
    extra = {} if sys.argv[1] == "env" else {"insecure": True}
    receivers = [ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://0.0.0.0:0"}, **extra})
                 for _ in range(3)]
    port = receivers[0].endpoint.rpartition(":")[2]
    with ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": {"1": "tcp://127.0.0.1:" + port}}) as s:
        assert s.put("0", "1", "k", {"v": 7})[0]
        got = receivers[0].get_with_deadline("0", "1", "k", deadline=time.monotonic() + 10)
    for r in receivers:
        r.close()
    print("got", got[0]["v"])
""")


@pytest.mark.parametrize("how", ["key", "env"])
def test_the_opt_out_works_and_warns_once(how: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")}
    if how == "env":
        env["ZMQ_OMNI_INSECURE"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", _OPT_OUT, how], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "got 7"
    warnings = [line for line in result.stderr.splitlines() if "INSECURE" in line]
    assert len(warnings) == 1, result.stderr  # three insecure connectors, one warning
    assert warnings[0].startswith("WARNING") and "tcp://0.0.0.0:0" in warnings[0], warnings


def test_a_stage_bound_to_every_interface_without_curve_exits_with_one_line(short_tmp: Path) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    doc = yaml.safe_load(config.read_text())
    doc["pipeline"]["stages"][0]["bind"] = "tcp://0.0.0.0:0"
    config.write_text(yaml.safe_dump(doc))
    result = run_cli("stage", "--config", str(config), "--stage", "thinker", timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing plaintext TCP on tcp://0.0.0.0:0" in lines[0], result.stderr
    assert "Traceback" not in result.stderr

    doc["pipeline"]["insecure"] = True  # the documented opt-out, in the pipeline YAML
    config.write_text(yaml.safe_dump(doc))
    with subprocess.Popen(
        [*CLI, "stage", "--config", str(config), "--stage", "thinker"],
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")},
    ) as p:
        assert p.stderr is not None
        first = p.stderr.readline() + p.stderr.readline()  # the warning, then "serving on"
        p.terminate()
        rest = p.communicate(timeout=30)[1]
    assert "INSECURE: plaintext TCP on tcp://0.0.0.0:0" in first and "serving on" in first, first + rest
    assert p.returncode == 0, first + rest


# -- keygen -------------------------------------------------------------------------------------------


def _keygen(config: Path, keys: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("keygen", "--config", str(config), "--out-dir", str(keys), *extra)


def _load(keys: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((keys / f"{name}.keys").read_text())
    return data


def test_keygen_makes_every_party_s_keys_with_safe_modes(short_tmp: Path) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    keys = short_tmp / "keys"
    result = _keygen(config, keys)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in PARTIES:
        assert stat.S_IMODE((keys / f"{name}.keys").stat().st_mode) == 0o600
        assert stat.S_IMODE((keys / f"{name}.pub").stat().st_mode) == 0o644
    files = {name: _load(keys, name) for name in PARTIES}
    pub = {name: data["public_key"] for name, data in files.items()}
    assert len(set(pub.values())) == len(PARTIES)
    for name, data in files.items():
        public, secret = data["public_key"].encode(), data["secret_key"].encode()
        assert zmq.curve_public(secret) == public, name  # each file holds a matching pair
        assert (keys / f"{name}.pub").read_text().strip() == data["public_key"]
    talker = files["talker"]
    assert talker["servers"] == {"0": pub["thinker"], "2": pub["vocoder"]}
    assert sorted(talker["clients"]) == sorted(
        [pub["talker"], pub["thinker"], pub["vocoder"], pub["driver"], pub["health"]]
    )  # itself: healthchecks
    assert files["thinker"]["servers"] == {"driver": pub["driver"], "1": pub["talker"]}
    assert files["driver"]["servers"] == {"0": pub["thinker"], "1": pub["talker"], "2": pub["vocoder"]}
    assert files["health"]["clients"] == [] and len(files["health"]["servers"]) == 4
    assert pub["thinker"] not in files["vocoder"]["clients"]  # not a neighbour: not admitted


def test_the_trust_rule_follows_the_pipeline_topology(short_tmp: Path) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    trust = {party.name: party for party in load_pipeline_config(config).trust()}
    assert list(trust) == list(PARTIES)
    assert trust["talker"] == Party(
        "talker", "1", ("thinker", "vocoder"), ("talker", "thinker", "vocoder", "driver", "health")
    )
    assert trust["driver"].servers == ("thinker", "talker", "vocoder")
    assert trust["health"] == Party("health", None, ("thinker", "talker", "vocoder", "driver"), ())


def test_keygen_never_overwrites_a_secret_key_silently(short_tmp: Path) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    keys = short_tmp / "keys"
    assert _keygen(config, keys).returncode == 0
    before = {name: (keys / f"{name}.keys").read_text() for name in PARTIES}

    again = _keygen(config, keys)
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "refusing to overwrite a secret key" in again.stderr and "--force" in again.stderr
    assert {name: (keys / f"{name}.keys").read_text() for name in PARTIES} == before

    kept = _keygen(config, keys, "--if-missing")
    assert kept.returncode == 0 and "kept" in kept.stdout
    assert {name: (keys / f"{name}.keys").read_text() for name in PARTIES} == before

    rotated = _keygen(config, keys, "--rotate", "talker")
    assert rotated.returncode == 0, rotated.stderr
    after = {name: _load(keys, name) for name in PARTIES}
    old_talker = json.loads(before["talker"])["public_key"]
    assert after["talker"]["public_key"] != old_talker
    for name in ("thinker", "vocoder", "driver", "health"):
        assert after[name]["secret_key"] == json.loads(before[name])["secret_key"], name  # pair kept
    assert after["thinker"]["servers"]["1"] == after["talker"]["public_key"]
    vocoder_clients = after["vocoder"]["clients"]
    assert after["talker"]["public_key"] in vocoder_clients and old_talker not in vocoder_clients

    forced = _keygen(config, keys, "--force")
    assert forced.returncode == 0, forced.stderr
    assert all(_load(keys, name)["secret_key"] != after[name]["secret_key"] for name in PARTIES)

    single = run_cli("keygen", "--out-dir", str(short_tmp / "one"))
    assert single.returncode == 0
    secret = (short_tmp / "one" / "stage.key").read_text()
    refused = run_cli("keygen", "--out-dir", str(short_tmp / "one"))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert (short_tmp / "one" / "stage.key").read_text() == secret
    assert run_cli("keygen", "--out-dir", str(short_tmp / "one"), "--force").returncode == 0
    assert (short_tmp / "one" / "stage.key").read_text() != secret


@pytest.mark.parametrize("pipeline", [False, True])
def test_keygen_into_an_unwritable_directory_is_one_line(short_tmp: Path, pipeline: bool) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    args = ["--config", str(config)] if pipeline else []
    result = run_cli("keygen", *args, "--out-dir", "/proc/x")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("zmq-omni keygen: error: cannot write /proc/x")


# -- a CURVE pipeline of three processes, and intruders ------------------------------------------------


@pytest.fixture
def stage_procs() -> Iterator[list[StageProcs]]:
    made: list[StageProcs] = []
    yield made
    for procs in made:
        procs.terminate()


def _stage_output(procs: StageProcs) -> str:
    """Stop the stages and return what they printed (for a failing assertion's message)."""
    return "\n".join(f"--- {name} (exit {code}):\n{err}" for name, (code, err) in procs.terminate().items())


def _intruders(endpoint: str, server_key: str) -> dict[str, dict[str, Any]]:
    """Three senders the thinker must refuse: no key, a wrong server key, a valid pair not on its list."""
    stranger_pub, stranger_sec = (k.decode() for k in zmq.curve_keypair())
    other_pub, _ = (k.decode() for k in zmq.curve_keypair())
    base = {
        "stage_id": "driver",
        "role": "sender",
        "endpoints": {"0": endpoint},
        "shm": "off",
        "delivery_timeout_s": 2.0,
        "heartbeat_s": 0.1,
        "peer_timeout_s": 0.5,
    }
    curve = {"curve_public_key": stranger_pub, "curve_secret_key": stranger_sec}
    return {
        "no-key": base,
        "wrong-key": {**base, **curve, "curve_server_key": other_pub},
        "not-listed": {**base, **curve, "curve_server_key": server_key},
    }


def test_curve_pipeline_streams_every_request_and_refuses_intruders(
    short_tmp: Path, stage_procs: list[StageProcs]
) -> None:
    config = short_tmp / "pipeline.yaml"
    endpoints = write_pipeline(config, stall=8.0, request_timeout=60.0)
    doc = yaml.safe_load(config.read_text())
    doc["pipeline"]["keys_dir"] = "keys"  # relative to the YAML file
    config.write_text(yaml.safe_dump(doc))
    keys = short_tmp / "keys"
    made = run_cli("keygen", "--config", str(config))
    assert made.returncode == 0, made.stderr
    thinker_pub = (keys / "thinker.pub").read_text().strip()

    procs = StageProcs(config, ["thinker", "talker", "vocoder"])
    stage_procs.append(procs)
    drive = subprocess.Popen(
        [
            *CLI,
            "drive",
            "--config",
            str(config),
            "--requests",
            "4",
            "--chunks",
            "1500",
            "--payload-size",
            "32768",
            "--wait-ready",
            "30",
            "--prefix",
            "sec",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("ZMQ_OMNI_")},
    )
    try:
        # Meanwhile, the intruders try to put into the thinker and to read its health.
        failures: dict[str, list[Any]] = {}
        for name, extra in _intruders(endpoints["thinker"], thinker_pub).items():
            with ZmqConnector(extra) as intruder:
                assert intruder.put("driver", "0", f"sec-000_driver_{900 + len(failures)}", {"evil": 1})[0]
                deadline = time.monotonic() + 20
                while not (got := intruder.drain_failures()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                failures[name] = got
                assert intruder.health()["pending"] == 0
        refused_probes = {}
        stranger_pub, stranger_sec = (k.decode() for k in zmq.curve_keypair())
        for name, kwargs in {
            "no-key": {},
            "wrong-key": {"server_key": stranger_pub},
            "not-listed": {"server_key": thinker_pub, "public_key": stranger_pub, "secret_key": stranger_sec},
        }.items():
            with pytest.raises(AuthenticationError) as raised:
                probe(endpoints["thinker"], timeout_s=10, **kwargs)
            refused_probes[name] = str(raised.value)
        out, err = drive.communicate(timeout=120)
    finally:
        if drive.poll() is None:
            drive.kill()
            drive.communicate()
    assert drive.returncode == 0, f"{out}\n{err}\n{_stage_output(procs)}"
    for i in range(4):
        assert f"sec-{i:03d} completed: " in out, out
    assert "FAILED" not in out, f"{out}\n{_stage_output(procs)}"
    for name, got in failures.items():
        assert len(got) == 1 and isinstance(got[0].error, DeliveryError), (name, got)
    assert "requires authentication" in refused_probes["no-key"]
    assert "not on the stage's allowed clients" in refused_probes["not-listed"]
    assert "wrong server key" in refused_probes["wrong-key"]

    # The stage counted the refusals; the health prober's keys read them, no keys get one line.
    # The stage's driver reads each refusal from its monitor socket on its next turn, so the count may
    # lag the refusals the peers saw: read it again until it is complete or 20 s passed.
    deadline = time.monotonic() + 20
    while True:
        health = run_cli("health", "--config", str(config), "--stage", "thinker")
        assert health.returncode == 0, health.stderr
        stats = json.loads(health.stdout)
        if stats["curve_refused"] >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["curve_refused"] >= 6, stats  # three senders and three probes, each refused at least once
    # A healthcheck beside a stage probes it with the stage's own key file (no health.keys there).
    (keys / "health.keys").rename(short_tmp / "health.keys")
    for name in ("talker", "vocoder"):
        own = run_cli("health", "--config", str(config), "--stage", name)
        assert own.returncode == 0 and json.loads(own.stdout)["status"] == "ok", own.stderr
    other = run_cli(
        "health", "--endpoint", endpoints["thinker"], "--keys", str(keys / "vocoder.keys"), "--server-key", thinker_pub
    )
    assert other.returncode == 1 and "not on the stage's allowed clients" in other.stderr, other.stderr
    anonymous = run_cli("health", "--endpoint", endpoints["thinker"], "--timeout", "20")
    assert anonymous.returncode == 1
    assert anonymous.stderr.count("\n") == 1 and "requires authentication" in anonymous.stderr, anonymous.stderr
    for name, (code, stage_err) in procs.terminate().items():
        assert code == 0 and "Traceback" not in stage_err, (name, stage_err)


# -- the refusals in one process: nothing in, nothing out, counted ------------------------------------


def _pair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


@pytest.fixture
def conns() -> Iterator[list[ZmqConnector]]:
    made: list[ZmqConnector] = []
    yield made
    for conn in made:
        conn.close()
    assert _no_io_threads()


def test_pull_mode_intruders_read_nothing_and_are_counted(conns: list[ZmqConnector]) -> None:
    server_pub, server_sec = _pair()
    good_pub, good_sec = _pair()
    stranger_pub, stranger_sec = _pair()
    server = ZmqConnector(
        {
            "stage_id": "0",
            "role": "sender",
            "mode": "pull",
            "endpoints": {"0": "tcp://127.0.0.1:0"},
            "curve_public_key": server_pub,
            "curve_secret_key": server_sec,
            "curve_allowed_clients": [good_pub],
        }
    )
    conns.append(server)
    assert server.endpoint is not None
    for i in range(4):
        assert server.put("0", "1", f"k{i}", {"secret": i})[0]
    base = {
        "stage_id": "1",
        "role": "receiver",
        "mode": "pull",
        "endpoints": {"0": server.endpoint},
        "fetch_timeout_s": 1.0,
    }
    intruders = {
        "no-key": base,
        "wrong-key": {
            **base,
            "curve_public_key": stranger_pub,
            "curve_secret_key": stranger_sec,
            "curve_server_key": stranger_pub,
        },
        "not-listed": {
            **base,
            "curve_public_key": stranger_pub,
            "curve_secret_key": stranger_sec,
            "curve_server_key": server_pub,
        },
    }
    for i, (name, extra) in enumerate(intruders.items()):
        intruder = ZmqConnector(extra)
        conns.append(intruder)
        assert intruder.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 1.5) is None, name
    good = ZmqConnector(
        {**base, "curve_public_key": good_pub, "curve_secret_key": good_sec, "curve_server_key": server_pub}
    )
    conns.append(good)
    for i in range(4):
        got = good.get_with_deadline("0", "1", f"k{i}", deadline=time.monotonic() + 10)
        assert got is not None and got[0] == {"secret": i}  # every payload still there for the real receiver
    assert server.health()["curve_refused"] >= 3


def test_push_mode_refusals_are_counted(conns: list[ZmqConnector]) -> None:
    server_pub, server_sec = _pair()
    good_pub, good_sec = _pair()
    stranger_pub, stranger_sec = _pair()
    receiver = ZmqConnector(
        {
            "stage_id": "1",
            "role": "receiver",
            "endpoints": {"1": "tcp://127.0.0.1:0"},
            "curve_public_key": server_pub,
            "curve_secret_key": server_sec,
            "curve_allowed_clients": [good_pub],
        }
    )
    conns.append(receiver)
    assert receiver.health()["curve_refused"] == 0
    assert receiver.endpoint is not None
    base = {
        "stage_id": "0",
        "role": "sender",
        "endpoints": {"1": receiver.endpoint},
        "delivery_timeout_s": 1.0,
        "heartbeat_s": 0.1,
        "peer_timeout_s": 0.5,
    }
    good = ZmqConnector(
        {**base, "curve_public_key": good_pub, "curve_secret_key": good_sec, "curve_server_key": server_pub}
    )
    conns.append(good)
    for name, extra in (
        ("no-key", {}),
        (
            "wrong-key",
            {"curve_public_key": stranger_pub, "curve_secret_key": stranger_sec, "curve_server_key": stranger_pub},
        ),
        (
            "not-listed",
            {"curve_public_key": stranger_pub, "curve_secret_key": stranger_sec, "curve_server_key": server_pub},
        ),
    ):
        intruder = ZmqConnector({**base, **extra})
        conns.append(intruder)
        assert intruder.put("0", "1", name, {"evil": name})[0]
        assert good.put("0", "1", f"good-{name}", {"ok": name})[0]
        got = receiver.get_with_deadline("0", "1", f"good-{name}", deadline=time.monotonic() + 10)
        assert got is not None and got[0] == {"ok": name}
    deadline = time.monotonic() + 10
    while receiver.health()["curve_refused"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    health = receiver.health()
    assert health["curve_refused"] >= 3 and health["mailbox"] == 0, health
    for name in ("no-key", "wrong-key", "not-listed"):
        assert receiver.get("0", "1", name) is None


def test_keygen_names_a_directory_where_a_key_file_belongs(short_tmp: Path) -> None:
    config = short_tmp / "pipeline.yaml"
    write_pipeline(config)
    keys = short_tmp / "keys"
    (keys / "talker.keys").mkdir(parents=True)  # what docker-compose leaves for a missing bind-mounted file
    for extra in ((), ("--if-missing",), ("--force",)):
        result = _keygen(config, keys, *extra)
        assert result.returncode == 2, (extra, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "talker.keys is not a regular file" in result.stderr
    assert not (keys / "thinker.keys").exists()  # nothing written


@pytest.mark.parametrize("face", ["threaded", "asyncio"])
def test_a_pull_fetch_from_a_plaintext_endpoint_off_the_host_is_refused_and_reported(face: str) -> None:
    # One rule for both faces of a pull get: the asyncio get refuses what the threaded one does.
    config = {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": {"0": "tcp://127.0.0.1:9"}}
    metadata = {"key": "k", "endpoint": "tcp://192.0.2.1:5555"}  # named by a put's metadata
    with ZmqConnector(config) as receiver:
        if face == "threaded":
            assert receiver.get("0", "1", "k", metadata) is None
        else:

            async def awaited() -> Any:
                async with AsyncConnector(receiver, close_connector=False) as conn:
                    return await conn.get("0", "1", "k", metadata, timeout=2.0)

            assert asyncio.run(awaited()) is None
        failures = receiver.drain_failures()
    assert [f.key for f in failures] == ["k"] and isinstance(failures[0].error, ConfigError)
    assert "refusing plaintext TCP on tcp://192.0.2.1:5555" in str(failures[0].error)
