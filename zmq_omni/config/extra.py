"""A connector's ``extra`` as vllm-omni reads it: a plain mapping, with our typed settings beside it.

vllm-omni's deploy YAMLs put keys for other components into a connector's
``extra`` (its stage input processors read ``codec_chunk_frames``,
``connector_get_sleep_s``, ... back from ``connector.config``), so a connector
keeps every key it was given. Only its own keys are validated; a key that is
not one of them but closely matches one (a likely typo) is logged as a
WARNING naming the key we expected.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["ConnectorExtra", "foreign_keys"]

log = logging.getLogger("zmq_omni.config")

#: How alike an unknown key and one of ours must be to be warned about (``difflib``'s ratio).
_TYPO_CUTOFF = 0.85


def foreign_keys(data: Mapping[str, Any], known: Iterable[str], path: str) -> tuple[str, ...]:
    """The keys of ``data`` that are not ours (kept for other components); warn about likely typos.

    Args:
        data: the ``extra`` mapping.
        known: every key we read.
        path: names the connector in messages (``ZmqConnector``).

    Raises:
        ConfigError: ``data`` is not a mapping, or a key is not a string.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    ours = set(known)
    foreign = []
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: config keys must be strings, got {key!r}")
        if key in ours:
            continue
        foreign.append(key)
        close = difflib.get_close_matches(key, ours, n=1, cutoff=_TYPO_CUTOFF)
        if close:
            log.warning(
                "config key '%s.%s' is not one of ours and is kept for other components; did you mean '%s'?",
                path,
                key,
                close[0],
            )
    return tuple(foreign)


class ConnectorExtra(dict[str, Any]):
    """``connector.config``: the ``extra`` dict exactly as given (a real ``dict``).

    vllm-omni's stage input processors read it with
    ``raw = getattr(connector, "config", {}) or {}`` and
    ``raw.get("extra", raw) if isinstance(raw, dict) else {}``, so it is a
    ``dict`` of the given keys, ours and everyone else's. The typed settings
    are the connector's ``settings`` attribute; reading one of their fields
    as an attribute of this mapping (``connector.config.mode``) reaches them
    too. Changing the mapping changes nothing in the connector.
    """

    def __init__(self, extra: Mapping[str, Any], settings: object) -> None:
        super().__init__(extra)
        self._settings = settings

    def __getattr__(self, name: str) -> Any:
        # Only called for names the dict does not have: the typed settings' fields.
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self._settings, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))
