"""CURVE encryption and client allow-lists for TCP across hosts.

The binding side (a push receiver, a pull sender) is the CURVE server; every
connecting socket is a client that must know the server's public key. With an
allow-list, a ZAP handler (pyzmq's ``ThreadAuthenticator``) admits only the
listed client public keys; without one, any client that knows the server key
may connect (traffic is still encrypted).

Secure by default off the host: :func:`require_curve` refuses plaintext TCP to
or from an address other than loopback unless the caller opted out explicitly
(the ``insecure`` config key or ``ZMQ_OMNI_INSECURE=1``); ``ipc://`` and
loopback TCP stay plaintext. :func:`watch_refusals` counts the handshakes a
CURVE server refused (no key, a wrong server key, a client not on the list).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from ..errors import ConfigError
from ..metrics import Counters
from ._loop import Driver
from ._sockets import close_socket

__all__ = ["ENV_INSECURE", "Curve", "insecure_from_env", "is_loopback", "require_curve", "watch_refusals"]

#: Set to 1 (or true/yes) to allow plaintext TCP off the host (containers: the explicit opt-out).
ENV_INSECURE = "ZMQ_OMNI_INSECURE"

log = logging.getLogger("zmq_omni.transport")

_Z85_KEY_LEN = 40


def _key(value: str, what: str) -> bytes:
    if not isinstance(value, str) or len(value) != _Z85_KEY_LEN:
        raise ConfigError(f"config key {what!r} must be a {_Z85_KEY_LEN}-character Z85 CURVE key")
    try:
        z85.decode(value)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"config key {what!r} is not valid Z85: {exc}") from exc
    return value.encode("ascii")


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys
        self._logged: set[bytes] = set()  # ZAP thread only

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        # An intruder retries every reconnect interval: one warning per key, not one per attempt.
        if not allowed and key not in self._logged and len(self._logged) < 1000:
            self._logged.add(key)
            log.warning("CURVE client %s refused (not in curve_allowed_clients)", key.decode("ascii", "replace"))
        return allowed


@dataclass(frozen=True)
class Curve:
    """A connector's CURVE keys: its own pair, the servers' keys, who may connect to it."""

    public_key: bytes
    secret_key: bytes
    server_keys: Mapping[str, bytes]  # stage id (or "*" for every stage) -> that stage's server public key
    allowed_clients: frozenset[bytes] | None

    @classmethod
    def from_config(
        cls,
        secret_key: str | None,
        public_key: str | None,
        server_key: str | Mapping[str, str] | None,
        allowed_clients: tuple[str, ...] | list[str] | None,
    ) -> Curve | None:
        """Validate the ``curve_*`` keys; None when CURVE is not configured.

        Raises:
            ConfigError: naming the missing or malformed key.
        """
        if secret_key is None and public_key is None and server_key is None and allowed_clients is None:
            return None
        if secret_key is None or public_key is None:
            raise ConfigError("config keys 'curve_secret_key' and 'curve_public_key' must be set together")
        servers: dict[str, bytes] = {}
        if isinstance(server_key, str):
            servers["*"] = _key(server_key, "curve_server_key")
        elif isinstance(server_key, Mapping):
            servers = {str(k): _key(v, f"curve_server_key.{k}") for k, v in server_key.items()}
        elif server_key is not None:
            raise ConfigError("config key 'curve_server_key' must be a key or a map of stage id -> key")
        allowed = None
        if allowed_clients is not None:
            if not isinstance(allowed_clients, (list, tuple)):
                raise ConfigError("config key 'curve_allowed_clients' must be a list of public keys")
            allowed = frozenset(_key(k, "curve_allowed_clients") for k in allowed_clients)
        return cls(_key(public_key, "curve_public_key"), _key(secret_key, "curve_secret_key"), servers, allowed)

    def server_key_for(self, stage: str) -> bytes:
        """The public key of the server ``stage`` binds; ``ConfigError`` when not configured."""
        key = self.server_keys.get(stage) or self.server_keys.get("*")
        if key is None:
            raise ConfigError(f"CURVE is on but 'curve_server_key' has no key for stage {stage!r}")
        return key

    def make_server(self, sock: Any) -> None:
        """Make a binding socket a CURVE server (before bind)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)

    def make_client(self, sock: Any, server_key: bytes) -> None:
        """Make a connecting socket a CURVE client of ``server_key`` (before connect)."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)

    def start_authenticator(self, ctx: zmq.Context[Any]) -> ThreadAuthenticator | None:
        """Install the allow-list on ``ctx`` (a ZAP thread, stopped by its owner); None without a list."""
        if self.allowed_clients is None:
            return None
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_AllowList(self.allowed_clients))
        return auth


# -- secure by default off the host ------------------------------------------------------------

_warn_lock = threading.Lock()
_warned = False


def is_loopback(endpoint: str) -> bool:
    """True for ``ipc://`` and for TCP to 127.0.0.0/8, ``[::1]`` or ``localhost``.

    Host names other than ``localhost`` count as off the host (no DNS lookup:
    a name can change what it resolves to); so do ``0.0.0.0`` and ``*``.
    """
    if not endpoint.startswith("tcp://"):
        return endpoint.startswith("ipc://")
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def insecure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ZMQ_OMNI_INSECURE`` opts out of CURVE (``1``, ``true``, ``yes``, ``on``).

    Raises:
        ConfigError: the variable holds anything else but ``0``/``false``/``no``/``off``/empty.
    """
    value = (os.environ if environ is None else environ).get(ENV_INSECURE, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"environment variable {ENV_INSECURE} must be 1 or 0, got {value!r}")


def require_curve(endpoints: Iterable[tuple[str, str]], *, curve: bool, insecure: bool) -> None:
    """Refuse plaintext TCP off the host; with the opt-out, warn once per process instead.

    Args:
        endpoints: ``(what, endpoint)`` pairs this connector binds or connects to
            (``what`` names the config key, for the message).
        curve: CURVE is configured (its own keys are set).
        insecure: the explicit opt-out (config key ``insecure`` or ``ZMQ_OMNI_INSECURE``).

    Raises:
        ConfigError: one line naming the endpoint, how to turn CURVE on and how to opt out.
    """
    global _warned
    if curve:
        return
    exposed = [(what, endpoint) for what, endpoint in endpoints if not is_loopback(endpoint)]
    if not exposed:
        return
    what, endpoint = exposed[0]
    if not insecure:
        raise ConfigError(
            f"refusing plaintext TCP on {endpoint} ({what}): it is not loopback, so anyone who can reach it "
            f"could read and inject data. Turn CURVE on (zmq-omni keygen --config PIPELINE.yaml --out-dir DIR, "
            f"then pipeline.keys_dir: DIR or ZMQ_OMNI_KEYS_DIR=DIR; or the curve_* connector keys), or opt out "
            f"explicitly with 'insecure: true' or {ENV_INSECURE}=1 (see docs/security.md)"
        )
    with _warn_lock:
        first, _warned = not _warned, True
    if first:
        log.warning(
            "INSECURE: plaintext TCP on %s (%s) is neither encrypted nor authenticated: anyone who can reach it "
            "can read and inject data (opted out of CURVE with 'insecure' or %s; see docs/security.md)",
            endpoint,
            what,
            ENV_INSECURE,
        )


_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def watch_refusals(loop: Driver, sock: Any, counters: Counters, *, stop_on_stop: bool = True) -> Callable[[], None]:
    """Count the handshakes the CURVE server ``sock`` refused, as ``curve_refused`` in ``counters``.

    A plaintext client, a client that has the wrong server key and one that is
    not on the allow-list all fail the handshake; each failed attempt counts once.
    Call before ``bind``, from the loop's owner (the monitor runs on the loop thread).
    Returns the function that stops the monitor; it runs as the loop stops unless
    ``stop_on_stop`` is False (then the socket's owner calls it before closing it).
    """
    monitor = sock.get_monitor_socket(_REFUSALS)

    def drain() -> None:
        assert loop.owns_sockets_here(), "the CURVE monitor read off its driver"
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            if event["event"] & _REFUSALS:
                counters.add("curve_refused")

    def stop() -> None:
        loop.remove_reader(monitor)
        # The owner closes ``sock`` after this; disabling first ends the monitor's inproc link cleanly.
        with contextlib.suppress(zmq.ZMQError):  # already closed
            sock.disable_monitor()
        close_socket(monitor)

    counters.add("curve_refused", 0)
    loop.add_reader(monitor, drain)
    if stop_on_stop:
        loop.on_stop(stop)
    return stop
