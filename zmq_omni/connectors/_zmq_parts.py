"""``Wiring``: what every part of a :class:`~zmq_omni.connectors.zmq.ZmqConnector` uses and none owns.

A ``ZmqConnector`` holds five parts, one module each, each owning its own state:

* ``Bound`` (``_zmq_bound``): the bound endpoint (a push receiver or a pull server,
  shared with the connectors of this process bound at that address) and cleanups;
* ``Sending`` (``_zmq_puts``): the push sender and its shared-memory pool; ``put``;
* ``Fetching`` (``_zmq_pull``): the pull client and its shared-memory reader; pull-mode fetches;
* ``Gets`` (``_zmq_gets``): every get, over ``Bound``'s mailbox or ``Fetching``'s fetches;
* ``HealthReport`` (``_zmq_health``): ``health()`` from what the others report.

They share this :class:`Wiring`, built once by the connector: the settings, the
endpoints and security, the decode, the counters, the driver of the sockets, the
failure recorder, the watches' signals, and two rules. Parts are built at
construction or at their first use (a lazy bind, a receiver's first put, a sender's
first pull-mode get), one at a time under :attr:`Wiring.build_lock`; ``close`` marks
the connector closed under it, so nothing is built after. Driven by an event loop,
only the loop's thread uses the sockets: :meth:`Wiring.check_sockets_here` and
:meth:`Wiring.can_wait` say who may.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeVar

from ..config.zmq import ZmqConnectorConfig
from ..errors import TransportTimeoutError, ZmqOmniError
from ..metrics import Counters
from ..transport import Curve, Driver, EndpointMap, insecure_from_env, require_curve, tune_malloc
from ..wire import DecodeLimits, decode, resolve_device
from ._expected_puts import settle
from ._zmq_bind import MAX_FRAMES
from .base import Slot

#: Longest a part built on the I/O thread waits for it (it only creates and binds or connects sockets).
_BUILD_WAIT_S = 10.0

_T = TypeVar("_T")

#: ``record_failure(op, from_stage, to_stage, key, reason, error)``: keep a failure for ``drain_failures``.
RecordFailure = Callable[[Literal["put", "get"], str, str, str, str, "ZmqOmniError | None"], None]


class Plan(NamedTuple):
    """What a connector's config says it is made of, and what it builds at construction."""

    endpoints: EndpointMap
    curve: Curve | None
    insecure: bool  # plaintext TCP off the host allowed (``insecure`` or ``ZMQ_OMNI_INSECURE=1``)
    limits: DecodeLimits
    device: Any  # the torch.device decoded tensors go to (None: CPU)
    bind_stage: str | None  # the stage whose endpoint it binds now (None: at its first use, or never)
    sends: bool  # it builds its push sender now
    fetches: bool  # it builds its pull client now
    own_context: bool  # its driver takes a ZeroMQ context of its own (a CURVE allow-list's ZAP handler)


def plan_parts(cfg: ZmqConnectorConfig, device_setting: str) -> Plan:
    """What ``cfg`` builds, checked before any socket exists: a refused plaintext endpoint never sends a byte.

    Without a role a connector can do both, but binds only when it first has to (a get in push mode,
    a put in pull mode): one extra then serves both ends of an edge, and the end that never receives
    never takes the endpoint. A role says which side binds at once; the other direction is built at
    its first use (a middle stage's "receiver" puts downstream). ``device_setting`` names the
    ``decode_device`` key in errors.

    Raises:
        ConfigError: an endpoint it would connect to or bind is plaintext TCP off the host (see
            ``docs/security.md``), or the decode device is unknown.
    """
    endpoints = EndpointMap(cfg.endpoints)
    curve = Curve.from_config(
        cfg.curve_secret_key, cfg.curve_public_key, cfg.curve_server_key, cfg.curve_allowed_clients
    )
    limits = DecodeLimits(
        max_header_bytes=min(cfg.max_message_bytes, 64 << 20),
        max_frames=MAX_FRAMES,
        max_total_bytes=cfg.max_message_bytes,
        max_depth=cfg.max_header_depth,
        max_objects=cfg.max_header_objects,
    )
    device = resolve_device(cfg.decode_device, device_setting)
    insecure = cfg.insecure or insecure_from_env()
    sends = cfg.role != "receiver"
    receives = cfg.role != "sender"
    connects = (cfg.mode == "push" and sends) or (cfg.mode == "pull" and receives)
    exposed = list(endpoints.items()) if connects else []
    bind_stage = stage_to_bind(cfg, None)
    if cfg.role not in ("dual", "receiver" if cfg.mode == "push" else "sender"):
        bind_stage = None
    if bind_stage is not None:
        bind_at = endpoints.env_bind or cfg.bind or endpoints.get(bind_stage)
        if bind_at is not None:
            exposed.append(("bind", bind_at))
    require_curve(exposed, curve=curve is not None, insecure=insecure)
    if cfg.malloc_tuning and receives:
        tune_malloc()  # before the context's I/O threads first allocate
    return Plan(
        endpoints,
        curve,
        insecure,
        limits,
        device,
        bind_stage,
        sends=cfg.mode == "push" and sends,
        fetches=cfg.mode == "pull" and receives,
        # A CURVE allow-list installs a ZAP authenticator, which answers for its whole context: its own then.
        own_context=curve is not None and curve.allowed_clients is not None,
    )


class Wiring:
    """The settings, services and rules the parts of one connector share (see the module docstring).

    Args:
        settings: the typed config.
        plan: what the config says (endpoints, CURVE keys, the plaintext opt-out, decode limits and device).
        sid: the connector's sender id.
        counters: the connector's health counters.
        driver: what drives the sockets (:attr:`driver` is None once closed).
        closed: whether the connector is closed (the connector's own flag).
        record_failure: keeps a failure for ``drain_failures`` (and ``health()``).
        notify_arrivals, notify_room: the watches' signals; parts hook them once :attr:`watched`.
    """

    def __init__(
        self,
        settings: ZmqConnectorConfig,
        plan: Plan,
        *,
        sid: str,
        counters: Counters,
        driver: Driver,
        closed: Callable[[], bool],
        record_failure: RecordFailure,
        notify_arrivals: Callable[[list[Slot]], None],
        notify_room: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.sid = sid
        self.endpoints = plan.endpoints
        self.curve = plan.curve
        self.insecure = plan.insecure
        self.limits = limits = plan.limits
        self.device = device = plan.device  # the torch.device decoded tensors go to (None: CPU)
        #: One call per received message (a partial saves a Python frame on the receive hot path).
        self.decode: Callable[[list[Any]], Any] = functools.partial(
            decode, allow_pickle=settings.allow_pickle, limits=limits, device=device
        )
        self.counters = counters
        self.driver: Driver | None = driver  # None once closed
        self._closed = closed
        self.record_failure = record_failure
        self.notify_arrivals = notify_arrivals
        self.notify_room = notify_room
        #: Held while a part is built; ``close`` marks the connector closed under it.
        self.build_lock = threading.Lock()
        #: True once a watch was taken: a part built later hooks its signals to the watches.
        self.watched = False

    @property
    def closed(self) -> bool:
        """True once the connector closed."""
        return self._closed()

    # -- rules --------------------------------------------------------------------------
    def bind_stage(self, call_stage: str | None) -> str | None:
        """The stage whose endpoint this connector binds (see :func:`stage_to_bind`)."""
        return stage_to_bind(self.settings, call_stage)

    def require_reachable(self, endpoints: list[tuple[str, str]]) -> None:
        """Refuse plaintext TCP off the host unless CURVE or ``insecure`` (see ``docs/security.md``).

        Raises:
            ConfigError: one of ``endpoints`` may not be reached or bound in plaintext.
        """
        require_curve(endpoints, curve=self.curve is not None, insecure=self.insecure)

    def can_wait(self) -> bool:
        """Whether a call on this thread may block on I/O the driver does (always, driven by threads)."""
        driver = self.driver
        return driver is None or driver.threaded or driver.may_wait_here()

    def check_sockets_here(self, what: str) -> None:
        """Raise unless this thread may use the sockets itself (driven by a loop: the loop's thread).

        Raises:
            RuntimeError: driven by an event loop, called on another thread while the loop drives it.
        """
        driver = self.driver
        if driver is not None and not driver.may_use_sockets_here():
            raise RuntimeError(
                f"{what}: this ZmqConnector is driven by an event loop, whose thread alone uses its sockets; "
                "call it on that loop (through its AsyncConnector)"
            )

    @staticmethod
    def refuse_wait(what: str, instead: str) -> RuntimeError:
        """The error of a call that would wait on a thread where the event loop driving us cannot serve it."""
        return RuntimeError(
            f"{what} would wait for I/O that the event loop driving this ZmqConnector must do, on a thread "
            f"where it cannot be done (the loop's own, or while no loop runs it): use {instead}"
        )

    def on_driver(self, build: Callable[[], _T]) -> _T:
        """Run ``build`` on the driver's thread and return its result (or raise its error).

        Driven by an event loop, it runs here: the caller is on the loop's thread (or nothing drives yet).
        A threaded driver not started yet (a connector that only received had no sockets of its own
        to drive) starts now.
        """
        driver = self.driver
        assert driver is not None
        if not driver.threaded:
            self.check_sockets_here("building its send side")
            return build()
        if not driver.started:
            driver.start()
        done = threading.Event()
        result: list[_T | BaseException] = []

        def run() -> None:
            try:
                result.append(build())
            except BaseException as exc:
                result.append(exc)
            finally:
                done.set()

        driver.call_soon(run)
        if not done.wait(_BUILD_WAIT_S) or not result:
            raise TransportTimeoutError(f"the I/O thread did not build its part within {_BUILD_WAIT_S}s")
        got = result[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        """A transport part's failure callback: a failed put to ourselves is no longer expected; keep the failure."""
        if op != "get":
            settle(self.endpoints.get(to_stage), (from_stage, to_stage, key))
        self.record_failure("get" if op == "get" else "put", from_stage, to_stage, key, reason, error)


def stage_to_bind(cfg: ZmqConnectorConfig, call_stage: str | None) -> str | None:
    """The stage whose endpoint a connector binds: its own id, else its end of the edge, else the call's.

    Its end of the edge: ``to_stage`` for a receiver, ``from_stage`` for a sender; without a role (or
    ``dual``), the end that binds in its mode (push: ``to_stage``; pull: ``from_stage``).
    """
    if cfg.stage_id is not None:
        return cfg.stage_id
    if cfg.role == "receiver":
        own = cfg.to_stage
    elif cfg.role == "sender":
        own = cfg.from_stage
    else:
        own = cfg.to_stage if cfg.mode == "push" else cfg.from_stage
    return own if own is not None else call_stage
