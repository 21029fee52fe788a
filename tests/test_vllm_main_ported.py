"""vllm-omni main's own connector tests, their behaviours re-expressed against ZmqConnector push and pull (issue 30).

Sources (vraiti/vllm-omni at d6240742), by the section names below:
``tests/distributed/omni_connectors/test_basic_connectors.py``,
``test_shm_connector.py``, ``test_adapter_and_flow.py``,
``test_omni_connector_configs.py``, ``test_chunk_transfer_adapter.py`` and
``tests/worker/test_omni_connector_mixin.py``. Main's tests build one
``SharedMemoryConnector({})`` and put and get on it; the ``one`` fixture is that
connector here: a ``ZmqConnector`` from an extra with ``endpoints`` only (no
role, no stage id). Tests that read vllm-omni's private attributes
(``_pending_keys``, ``_metrics``, lock files, mocked internals) are listed in
docs/vllm-omni.md with the reason; where such a test also checks a public
behaviour, that behaviour is kept here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from tests.vllm_main.main_loader import deploy_files, edges, load_view, processor_config
from zmq_omni.config import load_omni_transfer_config
from zmq_omni.config.pipeline import get_connectors_config_for_stage
from zmq_omni.connectors.factory import create_connector
from zmq_omni.connectors.zmq import ZmqConnector

STAGE_NAMES = ("s0", "s1", "stage_0", "stage_1", "0", "1", "2")


def _extra(tmp: Path, mode: str, **more: Any) -> dict[str, Any]:
    return {"mode": mode, "endpoints": {s: f"ipc://{tmp}/m-{s}.sock" for s in STAGE_NAMES}, **more}


@pytest.fixture(params=["push", "pull"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def one(mode: str, short_tmp: Path, shm_dir: str) -> Iterator[ZmqConnector]:
    """Main's ``connector`` fixture, ``SharedMemoryConnector({})``: one connector that puts and gets."""
    with ZmqConnector(_extra(short_tmp, mode, shm_dir=shm_dir)) as connector:
        yield connector


@pytest.fixture
def pair(mode: str, short_tmp: Path) -> Iterator[tuple[ZmqConnector, ZmqConnector]]:
    """An orchestrator-side connector (extra as is) and stage 1's (role receiver, int stage id), one process."""
    with (
        ZmqConnector(_extra(short_tmp, mode, role="receiver", stage_id=1)) as stage1,
        ZmqConnector(_extra(short_tmp, mode)) as orchestrator,
    ):
        yield orchestrator, stage1


def _round_trip(connector: ZmqConnector, key: str, data: Any, metadata: Any = None) -> Any:
    ok, _, meta = connector.put("s0", "s1", key, data)
    assert ok
    got = connector.get("s0", "s1", key, meta if metadata is None else metadata)
    assert got is not None, key
    return got[0]


# -- test_basic_connectors.py -----------------------------------------------------------------------------------


def test_basic_serialization() -> None:
    data = {"key": "value", "list": [1, 2, 3]}
    blob = ZmqConnector.serialize_obj(data)
    assert isinstance(blob, bytes)
    assert ZmqConnector.deserialize_obj(blob) == data


def test_tensor_serialization(one: ZmqConnector) -> None:
    tensor = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(ZmqConnector.deserialize_obj(ZmqConnector.serialize_obj(tensor)), tensor)
    assert torch.equal(_round_trip(one, "tensor", tensor), tensor)


def test_noncontiguous_tensor_serialization(one: ZmqConnector) -> None:
    tensor = torch.arange(40, dtype=torch.long).reshape(4, 10).transpose(0, 1)
    assert not tensor.is_contiguous() and tensor.stride(-1) != 1
    assert torch.equal(ZmqConnector.deserialize_obj(ZmqConnector.serialize_obj({"codes": tensor}))["codes"], tensor)
    assert torch.equal(_round_trip(one, "strided", {"codes": tensor})["codes"], tensor)


def test_ndarray_serialization(one: ZmqConnector) -> None:
    arr = np.array([[1, 2, 3], [4, 5, 6]])
    assert np.array_equal(ZmqConnector.deserialize_obj(ZmqConnector.serialize_obj(arr)), arr)
    assert np.array_equal(_round_trip(one, "ndarray", arr), arr)


def test_create_connector_by_name(short_tmp: Path) -> None:
    with create_connector({"name": "ZmqConnector", "extra": _extra(short_tmp, "push")}) as connector:
        assert isinstance(connector, ZmqConnector)


def test_create_unknown_connector() -> None:
    with pytest.raises(ValueError, match="UnknownConnector"):
        create_connector({"name": "UnknownConnector", "extra": {}})


def test_put_get_small_payload(one: ZmqConnector) -> None:
    data = {"small": "data"}
    ok, size, metadata = one.put("stage_0", "stage_1", "req_1", data)
    assert ok is True and size > 0 and isinstance(metadata, dict)
    got = one.get("stage_0", "stage_1", "req_1", metadata)
    assert got is not None
    assert got == (data, size)


def test_put_get_large_payload(one: ZmqConnector, shm_dir: str) -> None:
    """Main mocks its shm writer for a payload above its threshold; here a real one above ours (512 KiB)."""
    data = {"large": "x" * 200, "hidden": np.arange(300_000, dtype=np.float32)}
    ok, size, metadata = one.put("stage_0", "stage_1", "req_2", data)
    assert ok and size > 1_000_000
    got = one.get("stage_0", "stage_1", "req_2", metadata)
    assert got is not None
    assert got[0]["large"] == data["large"] and np.array_equal(got[0]["hidden"], data["hidden"])
    assert got[1] == size


def test_get_invalid_metadata(one: ZmqConnector) -> None:
    assert one.get("stage_0", "stage_1", "req_3", {}) is None
    assert one.get("stage_0", "stage_1", "req_3", {"unknown": "format"}) is None


# -- test_shm_connector.py ---------------------------------------------------------------------------------------


def test_put_then_get_by_key(one: ZmqConnector) -> None:
    data = {"hello": "world", "n": 42}
    ok, size, meta = one.put("s0", "s1", "test_key_1", data)
    assert ok and size > 0 and meta is not None
    got = one.get("s0", "s1", "test_key_1", metadata=None)
    assert got is not None
    assert got == (data, size)
    assert one.health()["gets"] == 1


def test_tensor_payload(one: ZmqConnector) -> None:
    payload = torch.ones(2, 2)
    assert torch.equal(_round_trip(one, "tensor_payload", payload), payload)


def test_falsey_payload(one: ZmqConnector) -> None:
    ok, _, metadata = one.put("s0", "s1", "falsey_payload", 0)
    assert ok
    got = one.get("s0", "s1", "falsey_payload", metadata=metadata)
    assert got is not None and got[0] == 0


def test_get_nonexistent_key_returns_none(one: ZmqConnector) -> None:
    assert one.get("s0", "s1", "no_such_key_xyz", metadata=None) is None


def test_rank_aware_keys_independent(one: ZmqConnector) -> None:
    payloads = {}
    for rank in range(4):
        key = f"req1_s0_0_{rank}_{rank}"
        payloads[rank] = {"rank": rank, "values": list(range(rank, rank + 3))}
        assert one.put("s0", "s1", key, payloads[rank])[0]
    for rank in range(4):
        got = one.get("s0", "s1", f"req1_s0_0_{rank}_{rank}", metadata=None)
        assert got is not None and got[0] == payloads[rank]


@pytest.mark.parametrize(
    "metadata",
    [{"source_host": "10.0.0.1", "source_port": 12345}, "not_a_dict", {}],
    ids=["rdma-style", "not-a-dict", "empty-dict"],
)
def test_foreign_metadata_falls_back_to_key(one: ZmqConnector, metadata: Any) -> None:
    data = {"payload": True}
    assert one.put("s0", "s1", "fb_key", data)[0]
    got = one.get("s0", "s1", "fb_key", metadata=metadata)
    assert got is not None and got[0] == data


def test_the_puts_metadata_still_works(one: ZmqConnector) -> None:
    assert _round_trip(one, "shm_direct_1", {"direct": True}) == {"direct": True}


def test_metadata_keyed_by_request_id(one: ZmqConnector) -> None:
    ok, _, meta = one.put("s0", "s1", "wrap_key", {"wrapped": True})
    assert ok
    got = one.get("s0", "s1", "wrap_key", metadata={"wrap_key": meta})
    assert got is not None and got[0] == {"wrapped": True}


def test_receiver_reads_multiple_sender_keys(one: ZmqConnector) -> None:
    for sender_rank in range(2):
        one.put("s0", "s1", f"req1_s0_0_{sender_rank}_0", {"sender": sender_rank, "shard": [sender_rank * 10]})
    shards = []
    for sender_rank in range(2):
        got = one.get("s0", "s1", f"req1_s0_0_{sender_rank}_0", metadata=None)
        assert got is not None
        shards.append(got[0])
    assert [s["sender"] for s in shards] == [0, 1]


def test_sender_writes_multiple_receiver_keys(one: ZmqConnector) -> None:
    for recv_rank in range(2):
        one.put("s0", "s1", f"req1_s0_0_0_{recv_rank}", {"target": recv_rank})
    for recv_rank in range(2):
        got = one.get("s0", "s1", f"req1_s0_0_0_{recv_rank}", metadata=None)
        assert got is not None and got[0]["target"] == recv_rank


def test_cleanup_removes_unconsumed_item(one: ZmqConnector) -> None:
    assert one.put("s0", "s1", "cleanup_req_42", {"leak": True})[0]
    one.cleanup("req_42")
    assert one.get("s0", "s1", "cleanup_req_42", metadata=None) is None


def test_cleanup_noop_for_consumed_item(one: ZmqConnector) -> None:
    assert _round_trip(one, "consumed_req_99", {"consumed": True}) == {"consumed": True}
    one.cleanup("req_99")
    assert one.get("s0", "s1", "consumed_req_99", metadata=None) is None


def test_close_releases_everything_pending(mode: str, short_tmp: Path, shm_dir: str) -> None:
    """Main checks ``_pending_keys`` is empty after close; here: close is idempotent and leaves no segment."""
    connector = ZmqConnector(_extra(short_tmp, mode, shm_dir=shm_dir))
    for i in range(3):
        assert connector.put("s0", "s1", f"close_test_{i}", {"i": i, "big": np.zeros(200_000, np.float32)})[0]
    connector.close()
    connector.close()
    assert os.listdir(shm_dir) == []


# -- test_adapter_and_flow.py --------------------------------------------------------------------------------------


def test_orchestrator_to_stage_flow(pair: tuple[ZmqConnector, ZmqConnector]) -> None:
    """``try_send_via_connector`` -> queue notification -> ``try_recv_via_connector``, with real connectors."""
    orchestrator, stage1 = pair
    inputs = {"tokens": [10, 20, 30]}
    payload = {
        "engine_inputs": inputs,
        "sampling_params": {"n": 1},
        "metadata": {"original_prompt": "prompt", "stage_transition": "0->1", "timestamp": 0.0},
    }
    ok, size, metadata = orchestrator.put(str(0), str(1), "flow_req", payload)
    assert ok and size > 0
    task = {"request_id": "flow_req", "from_connector": True, "from_stage": "0", "to_stage": "1"}
    if metadata:
        task["connector_metadata"] = metadata
    got = stage1.get(task["from_stage"], "1", str(task["request_id"]), metadata=task.get("connector_metadata"))
    assert got is not None and isinstance(got, tuple)
    assert got[0]["engine_inputs"] == inputs and got[1] == size


def test_get_connectors_for_stage() -> None:
    cfg = load_omni_transfer_config(
        config_dict={
            "stages": [
                {"stage_id": 0, "output_connectors": {"to_stage_1": "c1"}},
                {"stage_id": 1, "input_connectors": {"from_stage_0": "c1"}, "output_connectors": {"to_stage_2": "c2"}},
                {"stage_id": 2, "input_connectors": {"from_stage_1": "c2"}},
            ],
            "connectors": {"c1": {"name": "ZmqConnector"}, "c2": {"name": "SharedMemoryConnector"}},
        }
    )
    stage1 = get_connectors_config_for_stage(cfg, stage_id=1)
    assert stage1["from_stage_0"]["spec"]["name"] == "ZmqConnector"
    assert "from_stage_1" not in stage1
    assert get_connectors_config_for_stage(cfg, stage_id=2)["from_stage_1"]["spec"]["name"] == "SharedMemoryConnector"


# -- test_omni_connector_configs.py: every deploy YAML loads, with main's edges -----------------------------------


@pytest.mark.parametrize("path", deploy_files(), ids=[p.stem for p in deploy_files()])
def test_our_loader_reads_mains_deploy_yamls_as_main_does(path: Path) -> None:
    view = load_view(path)
    mains = edges(view)
    ours = load_omni_transfer_config(config_dict={k: v for k, v in view.items() if k != "source"})
    assert ours is not None
    assert {edge: ours.get_connector_for_edge(*edge).name for edge in mains} == {e: s.name for e, s in mains.items()}
    for edge, spec in mains.items():
        kept = dict(ours.get_connector_for_edge(*edge).extra)
        assert {k: kept.get(k) for k in spec.extra} == spec.extra, edge


# -- test_chunk_transfer_adapter.py / test_omni_connector_mixin.py: what they need of the connector ---------------


class MetaStruct(msgspec.Struct, omit_defaults=True, kw_only=True):
    finished: Any = None
    is_segment_finished: Any = None
    left_context_size: int | None = None


class CodesStruct(msgspec.Struct, omit_defaults=True, kw_only=True):
    audio: Any = None


class OmniPayloadStruct(msgspec.Struct, omit_defaults=True, kw_only=True):
    codes: CodesStruct | None = None
    meta: MetaStruct | None = None


def test_load_poll_key_call_form_and_payload(mode: str, short_tmp: Path) -> None:
    """Stage 2's adapter polls ``get("1", "2", "external-1_1_0")`` (positional, no metadata) until it answers."""
    with (
        ZmqConnector(_extra(short_tmp, mode, role="receiver", stage_id=2)) as stage2,
        ZmqConnector(_extra(short_tmp, mode, role="receiver", stage_id=1)) as stage1,
    ):
        stage_id = stage2.stage_id
        assert stage_id == 2 and type(stage_id) is int
        payload = {
            "codes": {"audio": [[1]]},
            "hidden_states": {"output": torch.tensor([[2.0]])},
            "meta": {"finished": torch.tensor(True, dtype=torch.bool)},
        }
        key = f"external-1_{stage_id - 1}_0"
        assert stage1.put(from_stage=str(stage_id - 1), to_stage=str(stage_id), put_key=key, data=payload)[0]
        deadline = time.monotonic() + 10
        while (got := stage2.get(str(stage_id - 1), str(stage_id), key)) is None and time.monotonic() < deadline:
            time.sleep(0.001)  # main's recv loop backs off 1 ms
        assert got is not None
        assert got[0]["codes"] == {"audio": [[1]]}
        assert torch.equal(got[0]["hidden_states"]["output"], payload["hidden_states"]["output"])
        assert bool(got[0]["meta"]["finished"].item()) is True


@pytest.mark.parametrize(
    "codes",
    [torch.tensor([[1, 2], [3, 4]], dtype=torch.long), torch.empty((4, 0), dtype=torch.long)],
    ids=["tensor-codes", "empty-nonterminal"],
)
def test_generation_codes_round_trip(one: ZmqConnector, codes: torch.Tensor) -> None:
    payload = {"codes": {"audio": codes}, "meta": {"left_context_size": 1, "finished": torch.tensor(False)}}
    got = _round_trip(one, "external-tensor_0_0", payload)
    assert got["codes"]["audio"].shape == codes.shape and torch.equal(got["codes"]["audio"], codes)
    assert got["codes"]["audio"].dtype == torch.long
    assert got["meta"]["left_context_size"] == 1 and bool(got["meta"]["finished"].item()) is False


def test_empty_struct_goes_on_the_wire(one: ZmqConnector) -> None:
    sent = OmniPayloadStruct(
        meta=MetaStruct(finished=torch.tensor(False, dtype=torch.bool), is_segment_finished=torch.tensor(True))
    )
    got = _round_trip(one, "ext-empty_1_0", sent)
    assert set(got) == {"meta"} and set(got["meta"]) == {"finished", "is_segment_finished"}
    assert got["meta"]["finished"].item() is False and got["meta"]["is_segment_finished"].item() is True


def test_wire_round_trip_struct_to_dict(one: ZmqConnector) -> None:
    """The sender puts a Struct, the receiver reads a dict with the same keys (main's wire contract)."""
    struct = OmniPayloadStruct(
        meta=MetaStruct(finished=torch.tensor(True, dtype=torch.bool), left_context_size=12),
        codes=CodesStruct(audio=torch.tensor([1, 2, 3], dtype=torch.int64)),
    )
    decoded = _round_trip(one, "struct_1_0", struct)
    assert isinstance(decoded, dict) and isinstance(decoded["meta"], dict)
    assert isinstance(decoded["meta"]["finished"], torch.Tensor) and bool(decoded["meta"]["finished"].item())
    assert decoded["meta"]["left_context_size"] == 12
    assert torch.equal(decoded["codes"]["audio"], torch.tensor([1, 2, 3], dtype=torch.int64))
    assert set(decoded) == {"meta", "codes"} and set(decoded["meta"]) == {"finished", "left_context_size"}


def test_processors_read_the_extra_from_config(short_tmp: Path) -> None:
    """The adapter tests' mock has ``config = {"extra": ...}``; the real shape is the extra itself. Both read alike."""
    extra = _extra(short_tmp, "push", codec_chunk_frames=25, codec_left_context_frames=3, stage_id=1, role="receiver")
    with create_connector({"name": "ZmqConnector", "extra": extra}) as connector:
        assert processor_config(connector)["codec_chunk_frames"] == 25
        assert processor_config(connector)["codec_left_context_frames"] == 3
        assert processor_config(type("Mock", (), {"config": {"extra": extra}})()) == extra


def test_create_connector_with_empty_extra_for_shared_memory() -> None:
    """Main's adapter without a ``stage_connector_config`` builds ``SharedMemoryConnector`` from ``{}``."""
    with create_connector({"name": "SharedMemoryConnector", "extra": {}}) as connector:
        assert processor_config(connector) == {}


def test_each_put_is_consumed_once(one: ZmqConnector) -> None:
    """The mixin's MockConnector pops on get: a second get of a consumed key finds nothing."""
    assert _round_trip(one, "once_1_0", {"x": 1}) == {"x": 1}
    assert one.get("s0", "s1", "once_1_0") is None
