"""CURVE encryption and client allow-lists for TCP across hosts.

The binding side (a push receiver, a pull sender) is the CURVE server; every
connecting socket is a client that must know the server's public key. With an
allow-list, a ZAP handler (pyzmq's ``ThreadAuthenticator``) admits only the
listed client public keys; without one, any client that knows the server key
may connect (traffic is still encrypted).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ..errors import ConfigError

__all__ = ["Curve"]

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

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
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
