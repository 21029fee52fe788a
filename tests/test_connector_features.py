"""The optional connector features, declared as Protocols: who has which, and the edge pair forwarding them."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from zmq_omni import FailureSource, Flushable, WakeupSource
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.stages._edge import _EdgePair


class _VllmOmniStyle:
    """A connector as vllm-omni may hand one: the contract's calls only, none of the optional features."""

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, None]:
        return True, 0, None

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None) -> None:
        return None


def _push_pair(tmp: Path) -> tuple[ZmqConnector, ZmqConnector]:
    endpoints = {"1": f"ipc://{tmp}/features-{uuid.uuid4().hex[:8]}.sock"}
    receiver = ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints})
    sender = ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints})
    return sender, receiver


def test_which_connector_offers_which_feature(short_tmp: Path) -> None:
    plain = _VllmOmniStyle()
    assert not isinstance(plain, Flushable | FailureSource | WakeupSource)
    inproc = InProcConnector({"namespace": uuid.uuid4().hex, "stage_id": "0"})
    sender, receiver = _push_pair(short_tmp)
    try:
        for conn in (inproc, sender, receiver):
            assert isinstance(conn, Flushable) and isinstance(conn, FailureSource)
        assert isinstance(receiver, WakeupSource) and isinstance(sender, WakeupSource)
        assert not isinstance(inproc, WakeupSource)
    finally:
        for conn in (inproc, sender, receiver):
            conn.close()


def test_edge_pair_forwards_the_inbound_wakeups_or_announces_none(short_tmp: Path) -> None:
    sender, receiver = _push_pair(short_tmp)
    outbound = InProcConnector({"namespace": uuid.uuid4().hex, "stage_id": "1"})
    inproc_in = InProcConnector({"namespace": uuid.uuid4().hex, "stage_id": "1"})
    zmq_edge, inproc_edge = _EdgePair(receiver, outbound), _EdgePair(inproc_in, outbound)
    try:
        assert inproc_edge.get_wakeup_generation() is None  # the adapters then wait in get_with_deadline
        gen = zmq_edge.get_wakeup_generation()
        assert gen == receiver.get_wakeup_generation() and gen is not None
        woke: list[int] = []
        waiter = threading.Thread(target=lambda: woke.append(zmq_edge.wait_for_change(gen, timeout=10.0)))
        waiter.start()
        time.sleep(0.05)
        assert sender.put("0", "1", "k", b"x")[0]
        waiter.join(10.0)
        assert woke and woke[0] != gen
    finally:
        for conn in (zmq_edge, inproc_edge, sender):  # the pairs close their edges
            conn.close()
