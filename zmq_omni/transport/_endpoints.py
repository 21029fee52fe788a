"""Endpoint parsing and environment overrides.

A stage's endpoint is the address peers *connect* to. The address a stage
*binds* may differ (a container binds ``tcp://0.0.0.0:5555`` while peers
connect to ``tcp://talker:5555``); it comes only from an explicit ``bind``
key or ``ZMQ_OMNI_BIND``, so binding every interface is always a choice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ..errors import ConfigError

__all__ = ["ENV_BIND", "ENV_ENDPOINT_PREFIX", "EndpointMap", "check_endpoint", "env_name"]

ENV_ENDPOINT_PREFIX = "ZMQ_OMNI_ENDPOINT_"
ENV_BIND = "ZMQ_OMNI_BIND"

_TCP = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(\d+|\*)$")
_NOT_ALNUM = re.compile(r"[^0-9A-Za-z]")


def env_name(stage: str) -> str:
    """The environment variable that overrides ``stage``'s endpoint (``talker-1`` -> ``..._TALKER_1``)."""
    return ENV_ENDPOINT_PREFIX + _NOT_ALNUM.sub("_", stage).upper()


def check_endpoint(endpoint: str, what: str) -> str:
    """Return ``endpoint`` if it is a usable ``tcp://`` or ``ipc://`` address.

    Raises:
        ConfigError: naming ``what`` (the config key or variable) and the bad value.
    """
    if not isinstance(endpoint, str):
        raise ConfigError(f"{what} must be a string endpoint, got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        match = _TCP.match(endpoint)
        if match is None or (match.group(2) != "*" and not 0 <= int(match.group(2)) <= 65535):
            raise ConfigError(f"{what}: {endpoint!r} is not tcp://host:port")
        return endpoint
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        # sockaddr_un.sun_path holds 107 bytes; libzmq fails late and obscurely past that.
        if not path or len(path.encode()) > 107:
            raise ConfigError(f"{what}: ipc path of {endpoint!r} must be 1..107 bytes")
        return endpoint
    # inproc:// is refused: each connector has its own context, so inproc peers could never meet.
    raise ConfigError(f"{what}: {endpoint!r} must start with tcp:// or ipc://")


class EndpointMap:
    """Stage id -> endpoint, from config with ``ZMQ_OMNI_ENDPOINT_<STAGE>`` overrides.

    The environment is read once, at construction, so a running connector
    never changes peers behind the caller's back.
    """

    def __init__(self, configured: Mapping[str, str], environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._configured = {
            stage: check_endpoint(ep, f"config key 'endpoints.{stage}'") for stage, ep in configured.items()
        }
        self._env = {
            name: check_endpoint(value, f"environment variable {name}")
            for name, value in env.items()
            if name.startswith(ENV_ENDPOINT_PREFIX)
        }
        bind = env.get(ENV_BIND)
        self.env_bind = None if bind is None else check_endpoint(bind, f"environment variable {ENV_BIND}")
        # Each configured stage's endpoint with its override applied, so that a put (which looks up its
        # stage every time) needs no variable name built per call.
        self._resolved = {stage: self._env.get(env_name(stage)) or ep for stage, ep in self._configured.items()}

    def get(self, stage: str) -> str | None:
        """The endpoint of ``stage`` (environment first), or None when unknown."""
        endpoint = self._resolved.get(stage)
        if endpoint is None:  # a stage only the environment names
            endpoint = self._env.get(env_name(stage))
        return endpoint

    def stages(self) -> list[str]:
        """The stage ids the config names (a stage only the environment names has no id to list)."""
        return list(self._configured)

    def items(self) -> list[tuple[str, str]]:
        """Every ``(stage or variable, endpoint)`` known (configured keys and environment overrides)."""
        return [(f"endpoints.{stage}", ep) for stage, ep in self._configured.items()] + list(self._env.items())

    def require(self, stage: str) -> str:
        """The endpoint of ``stage``; ``ConfigError`` naming the key and variable when unknown."""
        endpoint = self.get(stage)
        if endpoint is None:
            raise ConfigError(
                f"no endpoint for stage {stage!r}: set config key 'endpoints.{stage}' or {env_name(stage)}"
            )
        return endpoint
