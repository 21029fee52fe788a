"""Our connectors driven the way vllm-omni's own code drives them (issue 12).

Call forms and names are those of vllm-omni's ``connectors/base.py``; the
process models are its orchestrator -> stage path (``try_send_via_connector``
/ ``try_recv_via_connector``: one ``get`` per request, with the put's
metadata), its chunk stream (keys ``{request}_{stage}_{n}``, polled by key),
and its older model where both ends are built from one ``extra``.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomllib

from tests.connector_kinds import KINDS
from tests.ports import reserve_port
from zmq_omni.config import load_omni_transfer_config
from zmq_omni.config.pipeline import get_connectors_config_for_stage
from zmq_omni.connectors.base import OmniConnectorBase
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.connectors.shm import SharedMemoryConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=sorted(KINDS))
def pair(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[tuple[Any, Any, tuple[str, str]]]:
    with KINDS[request.param](short_tmp) as made:
        yield made


# -- 1. names and call forms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [OmniConnectorBase, ZmqConnector, SharedMemoryConnector, InProcConnector])
def test_signatures_are_vllm_omnis(cls: type) -> None:
    def names(fn: Any) -> list[str]:
        return [p for p in inspect.signature(fn).parameters if p != "self"]

    assert names(cls.put) == ["from_stage", "to_stage", "put_key", "data"]
    assert names(cls.get) == ["from_stage", "to_stage", "get_key", "metadata"]
    params = inspect.signature(cls.get_with_deadline).parameters
    assert list(params)[1:] == ["from_stage", "to_stage", "get_key", "metadata", "deadline"]
    assert params["deadline"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(cls.get).parameters["metadata"].default is None
    assert names(cls.abandon_get) == ["get_key"]
    assert names(cls.cleanup) == ["request_id"]
    assert names(cls.reap_consumed) == []
    assert cls.supports_raw_data is False
    assert isinstance(inspect.getattr_static(cls, "serialize_obj"), staticmethod)
    assert isinstance(inspect.getattr_static(cls, "deserialize_obj"), staticmethod)


def test_every_call_form_positional_and_keyword(pair: tuple[Any, Any, tuple[str, str]]) -> None:
    sender, receiver, (a, b) = pair
    data = {"codes": np.arange(12, dtype=np.int64).reshape(3, 4), "meta": {"finished": False}}

    ok, nbytes, meta = sender.put(a, b, "pos", data)
    assert ok and nbytes > 0
    got = receiver.get_with_deadline(a, b, "pos", meta, deadline=time.monotonic() + 10)
    assert got is not None and np.array_equal(got[0]["codes"], data["codes"])

    ok, _, meta = sender.put(from_stage=a, to_stage=b, put_key="kw", data=data)
    assert ok
    got = receiver.get_with_deadline(
        from_stage=a, to_stage=b, get_key="kw", metadata=meta, deadline=time.monotonic() + 10
    )
    assert got is not None and got[0]["meta"] == {"finished": False}

    # get, positional and keyword, with the put's metadata: found at once (no re-poll)
    for how in ("positional", "keyword"):
        ok, _, meta = sender.put(a, b, how, data)
        assert ok
        if how == "positional":
            got = receiver.get(a, b, how, meta)
        else:
            got = receiver.get(from_stage=a, to_stage=b, get_key=how, metadata=meta)
        assert got is not None and got[1] > 0, how

    # a get without metadata, or with vllm-omni's foreign hints, answers None at once for an absent key
    for metadata in (None, {"source_host": "127.0.0.1", "source_port": 50051}, {}):
        started = time.monotonic()
        assert receiver.get(from_stage=a, to_stage=b, get_key="absent", metadata=metadata) is None
        assert time.monotonic() - started < 2.0  # "never waits": far below metadata_get_timeout_s (5 s)

    receiver.abandon_get(get_key="absent")
    receiver.abandon_get("absent")
    sender.reap_consumed()
    ok, _, _ = sender.put(a, b, "doomed", data)
    assert ok
    time.sleep(0.2)  # push mode: let it reach the receiver, whose cleanup then drops it
    assert receiver.cleanup(request_id="doomed") | sender.cleanup("doomed")


@pytest.mark.parametrize("cls", [ZmqConnector, SharedMemoryConnector, InProcConnector])
def test_serialize_obj_round_trips_through_bytes(cls: type) -> None:
    obj = {"ids": [1, 2, 3], "hidden": np.linspace(0, 1, 10_000, dtype=np.float32), "flag": False, "none": None}
    blob = cls.serialize_obj(obj)
    assert isinstance(blob, bytes)
    back = cls.deserialize_obj(blob)
    assert back["ids"] == [1, 2, 3] and back["flag"] is False and back["none"] is None
    assert np.array_equal(back["hidden"], obj["hidden"])
    assert np.array_equal(cls.deserialize_obj(memoryview(blob))["hidden"], obj["hidden"])


# -- 2. stage_id keeps its type -------------------------------------------------------------------------------------


def test_stage_id_stays_an_int_and_supports_arithmetic(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/s1"}
    with (
        ZmqConnector({"stage_id": 1, "role": "receiver", "endpoints": endpoints}) as zrx,
        ZmqConnector({"stage_id": 0, "role": "sender", "endpoints": endpoints}) as ztx,
        SharedMemoryConnector({"stage_id": 1, "namespace": f"t{uuid.uuid4().hex}"}) as shm,
        InProcConnector({"stage_id": 2}) as inproc,
    ):
        assert zrx.stage_id == 1 and type(zrx.stage_id) is int
        assert zrx.stage_id - 1 == 0 and ztx.stage_id + 1 == 1 and ztx.stage_id == 0
        assert type(shm.stage_id) is int and shm.stage_id - 1 == 0
        assert type(inproc.stage_id) is int and inproc.stage_id + 1 == 3
        # routing still compares as strings: an int stage 1 receives what is put to "1"
        ok, _, meta = ztx.put(str(ztx.stage_id), str(ztx.stage_id + 1), "r_0_0", {"x": 1})
        assert ok
        assert zrx.get(str(zrx.stage_id - 1), str(zrx.stage_id), "r_0_0", meta) == ({"x": 1}, meta["size"])
    with ZmqConnector({"stage_id": "talker", "role": "sender", "endpoints": endpoints}) as named:
        assert named.stage_id == "talker"
    # without stage_id, vllm-omni's injected edge ends stand in, with their type
    with ZmqConnector({"role": "receiver", "from_stage": 0, "to_stage": 1, "endpoints": endpoints}) as injected:
        assert injected.stage_id == 1 and injected.endpoint == endpoints["1"]


# -- 3. a get with our metadata waits (bounded) for an in-flight put ------------------------------------------


def test_get_with_metadata_waits_for_the_put_and_gives_up_after_the_bound(short_tmp: Path) -> None:
    endpoints = {"1": f"ipc://{short_tmp}/s1"}
    with ZmqConnector({"stage_id": 0, "role": "sender", "endpoints": endpoints}) as sender:
        ok, _, meta = sender.put("0", "1", "late", {"v": 7})  # no receiver yet: in flight
        assert ok and meta is not None
        with ZmqConnector(
            {"stage_id": 1, "role": "receiver", "endpoints": endpoints, "metadata_get_timeout_s": 10.0}
        ) as receiver:
            assert receiver.get("0", "1", "late", metadata=meta) == ({"v": 7}, meta["size"])
            # vllm-omni's {key: metadata} wrapper is understood too
            ok, _, meta = sender.put("0", "1", "wrapped", {"v": 8})
            assert receiver.get("0", "1", "wrapped", {"wrapped": meta}) is not None
            # metadata of a put the receiver will never see: None after the bound, recorded as a timeout
            forged = {**meta, "key": "never"}
    with ZmqConnector(
        {"stage_id": 1, "role": "receiver", "endpoints": endpoints, "metadata_get_timeout_s": 0.3}
    ) as receiver:
        started = time.monotonic()
        assert receiver.get("0", "1", "never", forged) is None
        assert time.monotonic() - started >= 0.3
        failures = receiver.drain_failures()
        assert [f.key for f in failures] == ["never"] and "metadata_get_timeout_s" in failures[0].reason
        assert receiver.health()["timeouts"] == 1


# -- 4. config keys vllm-omni injects --------------------------------------------------------------------------------


def test_injected_keys_are_accepted_and_others_kept(short_tmp: Path) -> None:
    with SharedMemoryConnector(
        {"shm_threshold_bytes": 1234, "stage_id": 1, "role": "receiver", "from_stage": 0, "to_stage": 1}
    ) as shm:
        assert shm.config.inline_max_bytes == 1234
    endpoints = {"1": f"ipc://{short_tmp}/s1", "2": f"ipc://{short_tmp}/s2"}
    # what vllm-omni's _merge_dual_config makes of a stage whose in and out edges both use ZmqConnector
    dual = {
        "endpoints": endpoints,
        "shm_threshold_bytes": 1 << 20,
        "stage_id": 1,
        "role": "dual",
        "from_stage": 1,
        "to_stage": 2,
        "zmq_port": 50052,
        "sender_host": "127.0.0.1",
        "sender_zmq_port": 50051,
        "recv_rank_mapping": {"0": [0]},
        "send_rank_mapping": {"0": [0]},
    }
    with ZmqConnector(dual) as zc:
        assert zc.config.shm_threshold == 1 << 20 and zc.endpoint == endpoints["1"] and zc.stage_id == 1
    # Keys of other components (vllm-omni's stage input processors read them back) are kept.
    for cls, extra in (
        (ZmqConnector, {"stage_id": 1, "endpoints": endpoints, "role": "sender", "colour": "red"}),
        (SharedMemoryConnector, {"colour": "red"}),
        (InProcConnector, {"colour": "red"}),
    ):
        with cls(extra) as conn:
            assert isinstance(conn.config, dict) and conn.config["colour"] == "red"
    with pytest.raises(ConfigError, match="shm_threshold_bytes"):
        ZmqConnector({"shm_threshold": 1 << 20, "shm_threshold_bytes": 1 << 21})


def test_load_omni_transfer_config_takes_vllm_omnis_call_forms(tmp_path: Path) -> None:
    assert load_omni_transfer_config() is None
    assert load_omni_transfer_config(config_path=None, config_dict=None) is None
    doc = {
        "stage_args": [
            {"stage_id": 0, "output_connectors": {"to_stage_1": "zmq"}},
            {"stage_id": 1, "engine_input_source": [0], "input_connectors": {"from_stage_0": "zmq"}},
            {"stage_id": 2, "engine_input_source": [1]},
        ],
        "runtime": {"connectors": {"zmq": {"name": "ZmqConnector", "extra": {"endpoints": {"1": "ipc:///tmp/x"}}}}},
    }
    cfg = load_omni_transfer_config(config_dict=doc, default_shm_threshold=4096)
    assert cfg is not None
    auto = cfg.get_connector_for_edge("1", "2")
    assert auto.name == "SharedMemoryConnector" and dict(auto.extra) == {"shm_threshold_bytes": 4096}
    path = tmp_path / "stages.json"
    path.write_text(json.dumps(doc))
    assert load_omni_transfer_config(config_path=path) == load_omni_transfer_config(path) != None  # noqa: E711
    # the newer top-level schema
    newer = {"stages": doc["stage_args"], "connectors": doc["runtime"]["connectors"]}
    assert load_omni_transfer_config(config_dict=newer) == load_omni_transfer_config(config_dict=doc)
    stage1 = get_connectors_config_for_stage(cfg, 1)
    assert stage1["from_stage_0"]["spec"]["extra"] == {
        "endpoints": {"1": "ipc:///tmp/x"},
        "role": "receiver",
        "from_stage": 0,
        "to_stage": 1,
    }
    assert set(get_connectors_config_for_stage(cfg, 0)) == {"to_stage_1"}
    assert get_connectors_config_for_stage(None, 0) == {}
    with SharedMemoryConnector(dict(auto.extra)) as shm:  # the auto edge's extra builds our connector
        assert shm.config.inline_max_bytes == 4096


# -- 6. one config for both ends; no misdelivery ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_second_process_on_a_live_ipc_path_joins_the_stage_endpoint(mode: str, short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/live"
    role = "receiver" if mode == "push" else "sender"
    stage = 1 if mode == "push" else 0
    extra = {"stage_id": stage, "role": role, "mode": mode, "endpoints": {"1": endpoint, "0": endpoint}}
    with ZmqConnector(extra) as first:
        assert first.endpoint == endpoint
        # Another process of the stage becomes a local client of this one: the stage endpoint is shared
        # (push: tests/test_stage_endpoint.py; pull: tests/test_stage_pull.py).
        code = (
            "import json, sys\n"
            "from zmq_omni.connectors.zmq import ZmqConnector\n"
            "from zmq_omni.errors import TransportError\n"
            "try:\n"
            "    c = ZmqConnector(json.loads(sys.argv[1]))\n"
            "    part = c._bound.receiver or c._bound.server\n"
            "    print(type(part).__name__, 'binds' if getattr(part, '_inner', None) else 'joins')\n"
            "    c.close()\n"
            "except TransportError as exc:\n"
            "    print(exc)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(extra)], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert out.strip() == ("StageClient joins" if mode == "push" else "StagePull joins"), out
        assert first.health()["status"] == "ok"
    # a stale socket file (its process gone) is replaced as before
    stale = short_tmp / "stale"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(stale))
    sock.close()
    assert stale.exists()
    with ZmqConnector({**extra, "endpoints": {"1": f"ipc://{stale}", "0": f"ipc://{stale}"}}) as second:
        assert second.endpoint == f"ipc://{stale}"


def test_a_connector_without_a_role_binds_only_when_it_first_receives(short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/s1"
    extra = {"endpoints": {"1": endpoint}}
    with ZmqConnector(extra) as orchestrator, ZmqConnector(extra) as stage:
        assert orchestrator.endpoint is None and stage.endpoint is None
        ok, _, meta = orchestrator.put(from_stage="0", to_stage="1", put_key="r1", data={"v": 1})
        assert ok and orchestrator.endpoint is None  # a put never binds in push mode
        assert stage.get(from_stage="0", to_stage="1", get_key="r1", metadata=meta) == ({"v": 1}, meta["size"])
        assert stage.endpoint == endpoint and orchestrator.endpoint is None


def test_endpoints_per_replica_and_rank_never_collide(short_tmp: Path) -> None:
    template = {"1": f"ipc://{short_tmp}/s1-r{{replica}}-t{{rank}}"}
    made = []
    try:
        for replica, rank in ((0, 0), (0, 1), (1, 0)):
            extra = {"stage_id": 1, "role": "receiver", "endpoints": template}
            made.append(ZmqConnector({**extra, "replica_id": replica, "local_rank": rank}))
        assert [c.endpoint for c in made] == [
            f"ipc://{short_tmp}/s1-r0-t0",
            f"ipc://{short_tmp}/s1-r0-t1",
            f"ipc://{short_tmp}/s1-r1-t0",
        ]
    finally:
        for connector in made:
            connector.close()


# -- the chunk stream, polled by key -----------------------------------------------------------------------------


def test_chunk_stream_polled_by_key_ends_on_the_final_flag(pair: tuple[Any, Any, tuple[str, str]]) -> None:
    sender, receiver, _ = pair
    stage_id = 1  # the receiving stage, an int as vllm-omni injects it
    requests = {f"req{r}": 5 + r for r in range(3)}  # chunks per request
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for n in range(max(requests.values())):
                for req, chunks in requests.items():
                    if n < chunks:
                        data = {"codes": np.full(16, n, dtype=np.int64), "meta": {"finished": n == chunks - 1}}
                        ok, _, _ = sender.put(
                            from_stage=str(stage_id - 1),
                            to_stage=str(stage_id),
                            put_key=f"{req}_{stage_id - 1}_{n}",
                            data=data,
                        )
                        assert ok
        except BaseException as exc:
            errors.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    received: dict[str, list[int]] = {req: [] for req in requests}
    finished: set[str] = set()
    deadline = time.monotonic() + 30
    while len(finished) < len(requests) and time.monotonic() < deadline:
        progressed = False
        for req in requests:
            if req in finished:
                continue
            n = len(received[req])
            got = receiver.get(
                from_stage=str(stage_id - 1), to_stage=str(stage_id), get_key=f"{req}_{stage_id - 1}_{n}"
            )
            if got is None:
                continue
            progressed = True
            received[req].append(int(got[0]["codes"][0]))
            if got[0]["meta"]["finished"]:
                finished.add(req)
        if not progressed:
            time.sleep(0.001)  # vllm-omni's receive loop idles between passes too
    producer.join(10)
    assert not errors
    assert received == {req: list(range(chunks)) for req, chunks in requests.items()}


# -- two processes: the orchestrator -> stage model, and one extra for both ends ------------------------------


class _Peer:
    """A peer process speaking JSON lines; its stderr is shown when the test fails."""

    def __init__(self, role: str, config: dict[str, Any], tmp: Path) -> None:
        self.errfile = (tmp / f"{role}-{uuid.uuid4().hex[:6]}.err").open("w+")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_omni_peers", role, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errfile,
            text=True,
            cwd=ROOT,
            env=env,
        )

    def read(self) -> Any:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait(10)
            self.errfile.seek(0)
            raise AssertionError(f"peer exited ({self.proc.returncode}) with stderr:\n{self.errfile.read()}")
        return json.loads(line)

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.errfile.close()


def _run_edge(orch_extra: dict[str, Any], stage_extra: dict[str, Any], count: int, tmp: Path) -> dict[str, Any]:
    """Start the stage, then the orchestrator; relay each put's metadata; the stage gets each key once."""
    stage = _Peer("stage", {"extra": stage_extra, "from_stage": "0", "to_stage": "1"}, tmp)
    orch = None
    try:
        ready = stage.read()
        if ready["ready"] is not None and orch_extra.get("mode", "push") == "push":
            orch_extra = {**orch_extra, "endpoints": {"1": ready["ready"]}}  # the port it bound, read back
        orch = _Peer("orchestrator", {"extra": orch_extra, "from_stage": "0", "to_stage": "1", "count": count}, tmp)
        for _ in range(count):
            task = orch.read()
            assert not task.get("failed"), task
            stage.send(task)
        stage.send({"end": True})
        summary = stage.read()
        orch.send("done")
        bye = orch.read()
        summary["sender_failures"] = bye["failures"]
        summary["stage_id"] = ready["stage_id"]
        return summary
    finally:
        for peer in (orch, stage):
            if peer is not None:
                peer.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_orchestrator_to_stage_in_two_processes_loses_nothing(mode: str, transport: str, short_tmp: Path) -> None:
    bound = "1" if mode == "push" else "0"
    endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{short_tmp}/edge"
    edge_extra = {"mode": mode, "endpoints": {bound: endpoint}}
    doc = {
        "stage_args": [
            {"stage_id": 0, "output_connectors": {"to_stage_1": "zmq"}},
            {"stage_id": 1, "input_connectors": {"from_stage_0": "zmq"}},
        ],
        "runtime": {"connectors": {"zmq": {"name": "ZmqConnector", "extra": edge_extra}}},
    }
    cfg = load_omni_transfer_config(config_dict=doc)
    assert cfg is not None
    # the stage's extra as vllm-omni hands it over (role, from_stage, to_stage) plus the factory's stage_id
    stage_extra = {**get_connectors_config_for_stage(cfg, 1)["from_stage_0"]["spec"]["extra"], "stage_id": 1}
    orch_extra = dict(cfg.get_connector_for_edge("0", "1").extra)  # the orchestrator builds it as is
    summary = _run_edge(orch_extra, stage_extra, 200, short_tmp)
    assert summary["stage_id"] == 1
    assert (summary["got"], summary["bad"], summary["missing"]) == (200, [], []), summary
    assert summary["failures"] == [] and summary["sender_failures"] == [], summary


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_both_ends_built_from_one_extra_in_two_processes(mode: str, transport: str, short_tmp: Path) -> None:
    # Both ends must know the endpoint before either binds (that is the model): reserve a port.
    endpoint = f"tcp://127.0.0.1:{reserve_port()}" if transport == "tcp" else f"ipc://{short_tmp}/one"
    # no role, no stage id: the same dict at both ends; only the end that must bind does
    extra = {"mode": mode, "endpoints": {"1" if mode == "push" else "0": endpoint}}
    summary = _run_edge(dict(extra), dict(extra), 60, short_tmp)
    assert (summary["got"], summary["bad"], summary["missing"]) == (60, [], []), summary


# -- 7. the vllm.general_plugins entry point -----------------------------------------------------------------------

_STAND_IN_FACTORY = """
class OmniConnectorFactory:
    _registry = {}
    _dual_role_connectors = set()

    @classmethod
    def register_connector(cls, name, constructor, *, supports_dual=False):
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        cls._registry[name] = constructor
        if supports_dual:
            cls._dual_role_connectors.add(name)

    @classmethod
    def create_connector(cls, spec):
        return cls._registry[spec.name](spec.extra)

    @classmethod
    def list_registered_connectors(cls):
        return list(cls._registry.keys())


def _builtin_shm(config):
    return "vllm-omni's own SharedMemoryConnector"


OmniConnectorFactory.register_connector("SharedMemoryConnector", _builtin_shm, supports_dual=True)
"""

_PLUGIN_RUN = """
import json, sys, uuid
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint

entry = EntryPoint(name=sys.argv[1], value=sys.argv[2], group="vllm.general_plugins")
first = entry.load()()
second = entry.load()()  # vLLM may load plugins more than once
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory as F

@dataclass
class Spec:
    name: str
    extra: dict = field(default_factory=dict)

zmq = F.create_connector(Spec("ZmqConnector", {"stage_id": 0, "role": "sender", "endpoints": {"1": "ipc:///tmp/x"}}))
shm = F.create_connector(Spec("ZmqOmniSharedMemoryConnector", {"namespace": uuid.uuid4().hex, "stage_id": 1}))
inproc = F.create_connector(Spec("ZmqOmniInProcConnector", {"stage_id": 2}))
out = {
    "first": first, "second": second, "names": F.list_registered_connectors(),
    "dual": sorted(F._dual_role_connectors), "builtin_shm": F.create_connector(Spec("SharedMemoryConnector")),
    "types": [type(c).__module__ + "." + type(c).__name__ for c in (zmq, shm, inproc)],
    "stage_ids": [zmq.stage_id, shm.stage_id, inproc.stage_id],
}
for c in (zmq, shm, inproc):
    c.close()
print(json.dumps(out))
"""


def test_the_general_plugin_registers_our_connectors_without_clashing(tmp_path: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert list(plugins) == ["zmq_omni"]
    package = tmp_path / "vllm_omni" / "distributed" / "omni_connectors"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm_omni", tmp_path / "vllm_omni" / "distributed", package):
        (folder / "__init__.py").write_text("")
    (package / "factory.py").write_text(textwrap.dedent(_STAND_IN_FACTORY))
    run = subprocess.run(
        [sys.executable, "-c", _PLUGIN_RUN, "zmq_omni", plugins["zmq_omni"]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    ours = ["ZmqConnector", "ZmqOmniSharedMemoryConnector", "ZmqOmniInProcConnector"]
    assert out["first"] == ours and out["second"] == []
    assert out["names"] == ["SharedMemoryConnector", *ours]
    assert out["dual"] == sorted(["SharedMemoryConnector", *ours])
    assert out["builtin_shm"] == "vllm-omni's own SharedMemoryConnector"  # untouched
    assert out["types"] == [
        "zmq_omni.connectors.zmq.ZmqConnector",
        "zmq_omni.connectors.shm.SharedMemoryConnector",
        "zmq_omni.connectors.inproc.InProcConnector",
    ]
    assert out["stage_ids"] == [0, 1, 2]


def test_register_without_vllm_omni_does_nothing() -> None:
    from zmq_omni.connectors.vllm_plugin import register

    assert "vllm_omni" not in sys.modules
    assert register() == []


def test_entry_point_value_resolves_to_register() -> None:
    from zmq_omni.connectors.vllm_plugin import register

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["vllm.general_plugins"]["zmq_omni"]
    assert EntryPoint(name="zmq_omni", value=value, group="vllm.general_plugins").load() is register


# -- 8. the docs page's YAML -----------------------------------------------------------------------------------------


def _blocks(lang: str) -> list[str]:
    text = (ROOT / "docs" / "vllm-omni.md").read_text()
    return [part.split("```", 1)[0] for part in text.split(f"```{lang}\n")[1:]]


def test_the_docs_page_yaml_loads_and_builds_the_edge(short_tmp: Path) -> None:
    import yaml

    from zmq_omni.config.zmq import ZmqConnectorConfig

    full, tcp, replicas = (yaml.safe_load(block) for block in _blocks("yaml"))
    # section 5's one configuration: one endpoint per stage, no per-process placeholder
    shared = replicas["connectors"]["connector_of_shared_memory"]["extra"]["endpoints"]
    assert sorted(shared) == ["0", "1", "2"] and not any("{" in e for e in shared.values())
    cfg = load_omni_transfer_config(config_dict=full)
    assert cfg is not None
    assert cfg.get_connector_for_edge(0, 1).name == "ZmqConnector"
    assert cfg.get_connector_for_edge(1, 2).name == "SharedMemoryConnector"  # filled in, as vllm-omni does
    stage_extra = {**get_connectors_config_for_stage(cfg, 1)["from_stage_0"]["spec"]["extra"], "stage_id": 1}
    resolved = ZmqConnectorConfig.from_dict({**stage_extra, "replica_id": 2, "local_rank": 0})
    assert resolved.endpoints["1"] == "ipc:///tmp/omni-stage1.sock" and resolved.role == "receiver"
    # the same extra, with the socket moved into this test's directory, builds and binds
    ours = {**stage_extra, "endpoints": {"1": f"ipc://{short_tmp}/s1.sock"}}
    with ZmqConnector(ours) as receiver:
        assert receiver.stage_id == 1 and receiver.endpoint == f"ipc://{short_tmp}/s1.sock"
    tcp_extra = tcp["runtime"]["connectors"]["zmq_edge"]["extra"]
    assert ZmqConnectorConfig.from_dict(tcp_extra).bind == "tcp://0.0.0.0:5601"
    # the diff's "after" side is the same edge choice as the full config
    diff = _blocks("diff")[0]
    after = yaml.safe_load("\n".join(line[1:] for line in diff.splitlines() if not line.startswith("-")))
    assert after["stage_args"][0]["output_connectors"] == {"to_stage_1": "zmq_edge"}
    assert after["runtime"]["connectors"]["zmq_edge"] == full["runtime"]["connectors"]["zmq_edge"]
