"""The receive side's promises, seen from outside: exactly once, one security rule, no stalled loop, no silent loss.

Behaviour only: every test drives connectors through their public calls (``put``,
``get``, ``get_with_deadline``, ``close``, ``drain_failures``, ``health``, the
``AsyncConnector`` awaitables) and real sockets, and never asks which thread read
what. Scheduling is perturbed from outside (forced thread switches, a busy process
per core); the only times asserted are stall bounds, never speeds.

* many threads getting and polling one receiver under a stream of puts from
  another process take every item exactly once, also with forced thread switches;
* threaded and event-loop connectors, push and pull, refuse the same plaintext
  endpoints off the host, the same way;
* hostile frames reaching an event loop's receiver stall that loop no more than
  100 ms, a get in progress still ends at its timeout, and good puts still arrive;
* a sender closed right after eight ok puts of 64 MiB (default settings, under CPU
  contention) delivers each of them or names it (a WARNING, and ``drain_failures()``).

(A get racing close is in ``test_close_races.py``; every public error pickling is in
``test_errors.py``.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from zmq_omni.aio import AsyncConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.wire import encode

from .contention import Ticker, busy_cores
from .test_zmq_failures import connectors, make
from .zmq_peers import (
    concurrent_getters_main,
    expect_while_alive,
    expected_digest,
    get_main,
    make_payload,
    spawned,
    stream_size,
)

__all__ = ["connectors"]  # the fixture, imported for pytest

MiB = 1 << 20


# -- many getters, one receiver, a stream from another process ---------------------------------------------------

STREAM_ITEMS = 480


@pytest.mark.timeout(150)
@pytest.mark.parametrize("switches", ["plain", "forced"])
def test_concurrent_getters_and_pollers_take_every_item_exactly_once(
    connectors: list[ZmqConnector], switches: str
) -> None:
    # The receiver runs in its own process: a socket touched by two threads at once can abort a
    # process in libzmq, and then the test still reports (the exit code, and the peer's output).
    config = {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}}
    with spawned(concurrent_getters_main, config, STREAM_ITEMS, switches == "forced") as (proc, queue):
        (endpoint,) = expect_while_alive(proc, queue, "ready")
        sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint})
        order = list(range(STREAM_ITEMS))
        random.Random(7).shuffle(order)  # the blocking getters wait for their keys in another order
        for n in order:
            assert sender.put("0", "1", f"k{n}", make_payload(stream_size(n), n))[0], n
        (report,) = expect_while_alive(proc, queue, "done", timeout=120)
    assert report["errors"] == [] and report["stuck_threads"] == 0, report
    assert report["missing"] == [], report
    assert report["twice"] == [] and report["wrong_payload"] == [], report
    assert report["taken"] == STREAM_ITEMS, report


# -- the plaintext refusal, the same for every face and mode ------------------------------------------------------

#: A non-loopback address no case may ever contact: each is refused before any socket connects.
OFF_HOST = "tcp://10.255.255.1:5555"


def _spec(config: dict[str, Any]) -> dict[str, Any]:
    return {"name": "ZmqConnector", "extra": config}


def _outcome_of(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What a call did, comparable across faces: ``("raised", type, message)`` or ``("returned", value)``."""
    try:
        return ("returned", call())
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


async def _await_outcome_of(call: Callable[[], Awaitable[Any]]) -> tuple[Any, ...]:
    try:
        return ("returned", await call())
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


CONSTRUCTION_CASES = {
    "push-connect": {"stage_id": "0", "role": "sender", "endpoints": {"1": OFF_HOST}},
    "push-bind": {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://0.0.0.0:0"}},
    "pull-connect": {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": {"0": OFF_HOST}},
    "pull-bind": {"stage_id": "0", "role": "sender", "mode": "pull", "endpoints": {"0": "tcp://0.0.0.0:0"}},
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(CONSTRUCTION_CASES))
def test_every_face_refuses_a_plaintext_endpoint_off_the_host_when_built(case: str) -> None:
    config = CONSTRUCTION_CASES[case]

    async def build_on_a_loop() -> AsyncConnector:
        return AsyncConnector.create(_spec(config))

    outcomes = {
        "threaded": _outcome_of(lambda: ZmqConnector(config)),
        "event-loop": _outcome_of(lambda: asyncio.run(build_on_a_loop())),
    }
    for face, outcome in outcomes.items():
        if outcome[0] == "returned":
            outcome[1].close()
        assert outcome[:2] == ("raised", "ConfigError"), (face, outcome)
        assert outcome[2].startswith("refusing plaintext TCP on "), (face, outcome)
    assert outcomes["threaded"] == outcomes["event-loop"]


def _refusing_config(case: str, tmp: Path) -> dict[str, Any]:
    """A connector that starts (its own endpoints are local) and meets ``OFF_HOST`` at its first call."""
    local = f"ipc://{tmp}/local.sock"
    if case == "push-put":  # a middle stage: receives on its own endpoint, puts downstream to OFF_HOST
        return {"stage_id": "1", "role": "receiver", "endpoints": {"1": local, "2": OFF_HOST}}
    if case == "pull-get-by-metadata":  # a pull get whose put's metadata names OFF_HOST
        return {"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": {"0": local}}
    assert case == "pull-sender-get"  # a pull server that also gets, from a stage at OFF_HOST
    return {"stage_id": "0", "role": "sender", "mode": "pull", "endpoints": {"0": local, "2": OFF_HOST}}


# The first call of each case: a put and its arguments, or a get and its (from_stage, to_stage, key, metadata).
CALLS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "push-put": ("put", ("1", "2", "k", {"v": 1})),
    "pull-get-by-metadata": ("get", ("0", "1", "k", {"key": "k", "endpoint": OFF_HOST})),
    "pull-sender-get": ("get", ("2", "0", "k", None)),
}


def _threaded_refusal(case: str, tmp: Path) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    op, args = CALLS[case]
    with ZmqConnector(_refusing_config(case, tmp)) as conn:
        if op == "put":
            outcome = _outcome_of(lambda: conn.put(*args))
        else:
            outcome = _outcome_of(lambda: conn.get_with_deadline(*args, deadline=time.monotonic() + 2.0))
        failures = conn.drain_failures()
    return outcome, [(f.op, f.key, type(f.error).__name__, str(f.error)) for f in failures]


def _loop_refusal(case: str, tmp: Path) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    op, args = CALLS[case]

    async def main() -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
        async with AsyncConnector.create(_spec(_refusing_config(case, tmp))) as conn:
            if op == "put":
                outcome = await _await_outcome_of(lambda: conn.put(*args))
            else:
                outcome = await _await_outcome_of(lambda: conn.get(*args, timeout=2.0))
            failures = conn.connector.drain_failures()
        return outcome, [(f.op, f.key, type(f.error).__name__, str(f.error)) for f in failures]

    return asyncio.run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(CALLS))
def test_every_face_refuses_a_plaintext_endpoint_off_the_host_at_its_first_call(case: str, short_tmp: Path) -> None:
    # The same refusal whichever face calls: raised as a ConfigError, or a failed call (put not ok,
    # get None) with the ConfigError kept in drain_failures(). Nothing listens at OFF_HOST: a face
    # that tried it instead of refusing would see its get time out, unrefused, and fail here.
    for face_dir in ("t", "l"):  # one directory of ipc endpoints per face
        (short_tmp / face_dir).mkdir()
    threaded = _threaded_refusal(case, short_tmp / "t")
    loop = _loop_refusal(case, short_tmp / "l")
    for face, (outcome, failures) in (("threaded", threaded), ("event-loop", loop)):
        refusals = [f for f in failures if f[2] == "ConfigError" and f"refusing plaintext TCP on {OFF_HOST}" in f[3]]
        if outcome[0] == "raised":
            assert outcome[1] == "ConfigError" and f"refusing plaintext TCP on {OFF_HOST}" in outcome[2], face
        else:
            value = outcome[1]
            assert value is None or value[0] is False, (face, outcome)
            assert len(refusals) == 1 and refusals[0][1] == "k", (face, failures)
    # The same refusal: what the call did and what it recorded, message for message (the paths differ).
    assert _without_paths(threaded) == _without_paths(loop)


def _without_paths(refusal: Any) -> str:
    return re.sub(r"ipc://\S+?\.sock", "ipc://…", repr(refusal))


# -- hostile frames against an event loop's receiver ----------------------------------------------------------------

# The transport envelope (zmq_omni/transport/_envelope.py): preamble b"ZT" | version | kind | header length,
# then a msgpack header; a DATA carries the wire codec's frame 0 after it (docs/wire-format.md).
_PREAMBLE = struct.Struct("<2sBBI")
DATA, PING, REPLY, HEALTH, HEALTH_REPLY, FETCH, FETCH_REPLY, BATCH = range(1, 9)


def envelope(kind: int, header: bytes, payload: bytes = b"", *, version: int = 1, declared: int | None = None) -> bytes:
    """A transport frame 0 around raw msgpack ``header`` bytes (``declared``: the header length it claims)."""
    length = len(header) if declared is None else declared
    return _PREAMBLE.pack(b"ZT", version, kind, length) + header + payload


def codec(header: bytes, *, flags: int = 0, n_oob: int = 0) -> bytes:
    """A wire codec frame 0 (docs/wire-format.md §2) around raw msgpack ``header`` bytes."""
    return b"ZOM" + bytes((1, flags)) + struct.pack("<I", n_oob) + header


def nested(levels: int) -> bytes:
    """msgpack of ``levels`` one-item arrays one in another around a nil."""
    return b"\x91" * levels + b"\xc0"


def data(key: str, wire: bytes, *more: bytes, sid: str = "hostile", loc: Any = None) -> list[bytes]:
    """A DATA message from stage 0 to 1 under ``key``: header, then ``wire`` and any further frames."""
    return [envelope(DATA, msgpack.packb([sid, 1, 0, "0", "1", key, loc]), wire), *more]


GOOD_WIRE = encode({"x": 1})[0]
POISON = "poison"  # every hostile DATA names this key: none of them may ever be delivered

HOSTILE: dict[str, list[bytes]] = {
    "empty frame": [b""],
    "garbage": [bytes(range(256)) * 8],
    "foreign magic": [b"XX" + GOOD_WIRE],
    "truncated preamble": [b"ZT\x01"],
    "unknown version": [envelope(DATA, b"\x90", version=99)],
    "unknown kind": [envelope(200, b"\x90")],
    "header length past the frame": [envelope(DATA, b"\x90", declared=0xFFFFFFFF)],
    "header nested 1,000 deep": [envelope(DATA, nested(1000), GOOD_WIRE)],
    "header nested 100,000 deep": [envelope(BATCH, nested(100_000))],
    "header fields of the wrong types": [envelope(DATA, msgpack.packb([1, "seq", None, 0, 1.5, b"k", 7]), GOOD_WIRE)],
    "header with too few fields": [envelope(DATA, msgpack.packb(["hostile", 1]), GOOD_WIRE)],
    "header that is not an array": [envelope(PING, msgpack.packb({"sid": "hostile"}))],
    "bin declaring 4 GiB": [envelope(DATA, b"\x97\xa7hostile\x01\x00\xa10\xa11\xa6poison\xc6\xff\xff\xff\xff")],
    "map declaring 4 G entries": [envelope(PING, b"\xdf\xff\xff\xff\xff")],
    "array declaring 4 G items": [envelope(BATCH, b"\xdd\xff\xff\xff\xff")],
    "sender id of 10,000 characters": data(POISON, GOOD_WIRE, sid="s" * 10_000),
    "payload that is not the codec": data(POISON, b"not a codec frame at all"),
    "payload nested 1,000 deep": data(POISON, codec(nested(1000))),
    "payload declaring a million buffers": data(POISON, codec(msgpack.packb({"x": 1}), flags=1, n_oob=1_000_000)),
    "payload with undeclared frames": data(POISON, GOOD_WIRE, b"x" * 100, b"y"),
    "payload with unknown flags": data(POISON, codec(msgpack.packb({"x": 1}), flags=0xF0)),
    "shared-memory handle of garbage": data(POISON, b"", loc=b"\x00" * 48),
    "batch of an odd entry list": [envelope(BATCH, msgpack.packb(["hostile", 0, "1", [1, "0", POISON]]))],
    "batch whose payloads are not bytes": [
        envelope(BATCH, msgpack.packb(["hostile", 0, "1", [1, "0", POISON, 5, 2, "0", POISON, None]]))
    ],
    "batch of garbage payloads": [
        envelope(BATCH, msgpack.packb(["hostile", 0, "1", [1, "0", POISON, b"junk", 2, "0", POISON, b"\xff" * 9]]))
    ],
    "ping naming a segment that does not exist": [
        envelope(PING, msgpack.packb(["hostile", 1, 0, ["zo-no-such-segment", b"\x00" * 16]]))
    ],
    "reply sent to a receiver": [envelope(REPLY, msgpack.packb(["inc", -1, [[0, 2**62]], [[5, 1]]]))],
    "fetch sent to a push receiver": [envelope(FETCH, msgpack.packb([1, "0", "1", POISON, 2**31]))],
    "health reply sent to a receiver": [envelope(HEALTH_REPLY, msgpack.packb([{"x": 1}]))],
    "a thousand frames": [b"x"] * 1000,
}
ROUNDS_OF_HOSTILITY = 10  # the whole set, this many times over: a sustained attack, not one frame


def _attack_and_probe(endpoint: str, ctx: zmq.Context[Any]) -> None:
    """Send every hostile message from a raw DEALER, then a HEALTH: its reply means all of them were handled.

    One DEALER's messages reach the receiver in order, and it answers a HEALTH after what came
    before it (``zmq-omni health`` relies on that answer).
    """
    attacker = ctx.socket(zmq.DEALER)
    try:
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(endpoint)
        for _ in range(ROUNDS_OF_HOSTILITY):
            for frames in HOSTILE.values():
                attacker.send_multipart(frames)
        attacker.send(envelope(HEALTH, msgpack.packb([])))
        deadline = time.monotonic() + 10
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and attacker.poll(remaining * 1000), "no answer to a HEALTH after the attack"
            reply = attacker.recv_multipart()
            if reply[0][:4] == _PREAMBLE.pack(b"ZT", 1, HEALTH_REPLY, 0)[:4]:
                return
    finally:
        attacker.close(linger=0)


@asynccontextmanager
async def async_receiver(face: str, config: dict[str, Any]) -> AsyncIterator[AsyncConnector]:
    """An awaitable receiver: a threaded ``ZmqConnector`` wrapped, or one built for the loop by ``create``."""
    conn = AsyncConnector(ZmqConnector(config)) if face == "wrapped" else AsyncConnector.create(_spec(config))
    async with conn:
        yield conn


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("face", ["wrapped", "created"])
async def test_hostile_frames_never_stall_the_event_loop(
    connectors: list[ZmqConnector], zmq_ctx: zmq.Context[Any], face: str
) -> None:
    config = {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}}
    async with async_receiver(face, config) as conn:
        endpoint = conn.connector.endpoint
        assert endpoint is not None
        sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint})
        loop = asyncio.get_running_loop()
        with Ticker() as ticker:
            # Gets wait on the loop while the attack comes in, each with its own timeout ahead.
            waiting = [asyncio.ensure_future(conn.get("0", "1", f"after{i}", timeout=30)) for i in range(3)]
            await asyncio.sleep(0.05)
            attack = asyncio.ensure_future(asyncio.to_thread(_attack_and_probe, endpoint, zmq_ctx))
            started = loop.time()
            poisoned = await conn.get("0", "1", POISON, timeout=0.5)
            took = loop.time() - started
            await attack  # every hostile message was handled by now
            assert await conn.get("0", "1", POISON, timeout=0) is None
            assert not any(w.done() for w in waiting)
            for i in range(3):
                assert (await asyncio.to_thread(sender.put, "0", "1", f"after{i}", {"n": i}))[0]
            got = await asyncio.gather(*waiting)
            # A put after the attack, awaited after its arrival.
            assert (await asyncio.to_thread(sender.put, "0", "1", "later", {"n": "later"}))[0]
            later = await conn.get("0", "1", "later", timeout=10)
            await asyncio.sleep(0.02)
    assert poisoned is None
    assert took < 1.5, f"a get(timeout=0.5) took {took:.2f} s during the attack"
    assert [g[0] if g else None for g in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert later is not None and later[0] == {"n": "later"}
    assert ticker.worst < 0.1, (
        f"the event loop stalled {ticker.worst * 1000:.0f} ms ({ticker.worst_wall * 1000:.0f} ms by the clock)"
    )


# -- close right after large puts ------------------------------------------------------------------------------------

CLOSE_RUNS = 5


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["default", "frames"])
def test_a_sender_closed_right_after_large_puts_delivers_them_or_names_the_missing(
    connectors: list[ZmqConnector], caplog: pytest.LogCaptureFixture, path: str
) -> None:
    # Default settings, push mode over loopback TCP, the receiver in its own process, a spinning
    # process per core: close() right after eight ok puts of 64 MiB. Each item reaches the receiver
    # whole, or its key is reported: in a WARNING naming it and in drain_failures() of the closed sender.
    # By default a same-host receiver takes them through shared memory; "frames" sends their bytes over TCP.
    extra = {"shm": "off"} if path == "frames" else {}
    payloads = [make_payload(64 * MiB, n) for n in range(8)]  # read-only: every run puts the same eight
    digests = [expected_digest(64 * MiB, n) for n in range(8)]
    with busy_cores():
        for run in range(CLOSE_RUNS):
            keys = [f"big{run}-{n}" for n in range(8)]
            config = {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}}
            wants = [("0", key, None) for key in keys]
            with spawned(get_main, config, wants, "1", 30.0) as (proc, queue):  # 30 s for all eight
                (endpoint,) = expect_while_alive(proc, queue, "ready")
                sender = make(connectors, stage_id="0", role="sender", endpoints={"1": endpoint}, **extra)
                for n, key in enumerate(keys):
                    assert sender.put("0", "1", key, payloads[n])[0], key
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="zmq_omni"):
                    sender.close()
                drained = {f.key for f in sender.drain_failures()}
                warning = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
                warned = {key for key in keys if repr(key) in warning}
                results, _ = expect_while_alive(proc, queue, "done", timeout=120)
            missing = {key for key in keys if results[key] is None}
            # Reported where every caller sees it: in the log, and to a caller who drains the failures.
            assert missing <= warned, f"run {run}: lost without a WARNING naming it: {sorted(missing - warned)}"
            assert missing <= drained, f"run {run}: lost and not in drain_failures(): {sorted(missing - drained)}"
            delivered = {key: results[key] for key in keys if key not in missing}
            assert delivered == {key: digests[n] for n, key in enumerate(keys) if key in delivered}
