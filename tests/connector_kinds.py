"""Pairs of connectors the shared contract suite runs against.

Each kind is a context manager that yields ``(sender, receiver, edge)`` where
``edge = (from_stage, to_stage)``, and closes both connectors on exit. A
backend joins the contract suite by adding a kind here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from zmq_omni.connectors.base import OmniConnectorBase

Pair = tuple[OmniConnectorBase, OmniConnectorBase, tuple[str, str]]
PairFactory = Callable[[Path], AbstractContextManager[Pair]]

KINDS: dict[str, PairFactory] = {}


def kind(name: str) -> Callable[[PairFactory], PairFactory]:
    def register(factory: PairFactory) -> PairFactory:
        KINDS[name] = factory
        return factory

    return register


@kind("inproc")
@contextmanager
def inproc_pair(tmp: Path) -> Iterator[Pair]:
    from zmq_omni.connectors.inproc import InProcConnector

    namespace = f"contract-{uuid.uuid4().hex}"
    with (
        InProcConnector({"namespace": namespace, "stage_id": "0"}) as sender,
        InProcConnector({"namespace": namespace, "stage_id": "1"}) as receiver,
    ):
        yield sender, receiver, ("0", "1")


@kind("shm")
@contextmanager
def shm_pair(tmp: Path) -> Iterator[Pair]:
    from zmq_omni.connectors.shm import SharedMemoryConnector

    config = {"namespace": f"contract-{uuid.uuid4().hex}", "spill_dir": str(tmp)}
    with (
        SharedMemoryConnector({**config, "stage_id": "0"}) as sender,
        SharedMemoryConnector({**config, "stage_id": "1"}) as receiver,
    ):
        yield sender, receiver, ("0", "1")


@kind("zmq")
@contextmanager
def zmq_push_pair(tmp: Path) -> Iterator[Pair]:
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoints = {"1": f"ipc://{tmp}/zmq-contract-1.sock"}
    with (
        ZmqConnector({"stage_id": "1", "role": "receiver", "endpoints": endpoints}) as receiver,
        ZmqConnector({"stage_id": "0", "role": "sender", "endpoints": endpoints}) as sender,
    ):
        yield sender, receiver, ("0", "1")


@kind("zmq-pull")
@contextmanager
def zmq_pull_pair(tmp: Path) -> Iterator[Pair]:
    from zmq_omni.connectors.zmq import ZmqConnector

    endpoints = {"0": f"ipc://{tmp}/zmq-contract-0.sock"}
    with (
        ZmqConnector({"stage_id": "0", "role": "sender", "mode": "pull", "endpoints": endpoints}) as sender,
        ZmqConnector({"stage_id": "1", "role": "receiver", "mode": "pull", "endpoints": endpoints}) as receiver,
    ):
        yield sender, receiver, ("0", "1")
