"""Transport: sockets, endpoints, socket options, the envelope and ack protocol, health probes.

Raises typed errors from :mod:`zmq_omni.errors`; the mapping to the connector
contract's ``(ok, nbytes, metadata)`` / ``None`` happens once, in the connector.
"""

from __future__ import annotations

from ._endpoints import ENV_BIND, ENV_ENDPOINT_PREFIX, EndpointMap, check_endpoint, env_name
from ._loop import Driver, IoLoop, Timer
from ._probe import probe
from ._pull_client import SILENT_S, FetchChannel, PullClient
from ._pull_lot import MAX_PARK_S
from ._pull_server import PullServer
from ._push_protocol import FailureCallback
from ._receiver import PushReceiver
from ._security import ENV_INSECURE, Curve, insecure_from_env, is_loopback, require_curve
from ._sender import PushSender
from ._shm import ShmReceive, ShmSend
from ._signal import NotifyingCondition, WouldBlock
from ._sockets import listening, reserve_loopback_port, tune_malloc
from ._stage_client import StageClient
from ._stage_lock import StageLock, close_inherited_sockets
from ._stage_pull import StagePull
from ._stage_service import StageService
from ._tombstones import Tombstones

__all__ = [
    "ENV_BIND",
    "ENV_ENDPOINT_PREFIX",
    "ENV_INSECURE",
    "Curve",
    "Driver",
    "EndpointMap",
    "FetchChannel",
    "MAX_PARK_S",
    "FailureCallback",
    "IoLoop",
    "NotifyingCondition",
    "PullClient",
    "SILENT_S",
    "PullServer",
    "PushReceiver",
    "PushSender",
    "ShmReceive",
    "ShmSend",
    "StageClient",
    "StageLock",
    "StagePull",
    "StageService",
    "Timer",
    "Tombstones",
    "WouldBlock",
    "close_inherited_sockets",
    "check_endpoint",
    "env_name",
    "insecure_from_env",
    "is_loopback",
    "listening",
    "probe",
    "require_curve",
    "reserve_loopback_port",
    "tune_malloc",
]
