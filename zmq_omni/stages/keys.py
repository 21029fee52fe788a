"""CURVE key files of a pipeline: one per stage, one for the driver, one for the health prober.

``zmq-omni keygen --config PIPELINE.yaml --out-dir DIR`` writes, for every
party (each stage by name, the driver, and ``health``):

- ``DIR/<name>.keys`` (mode 0600): a JSON object with the party's own key pair
  (``public_key``, ``secret_key``), ``servers`` (stage id -> public key of each
  stage it connects to) and ``clients`` (the public keys allowed to connect to
  the sockets it binds: its neighbours, the driver, the health prober, itself);
- ``DIR/<name>.pub`` (0644): its public key alone, to hand out.

Who trusts whom follows from the pipeline's topology
(:meth:`~zmq_omni.stages.PipelineConfig.trust`); this module makes the pairs
and files from that rule. The directory is made 0700. A pipeline names the directory with
``pipeline.keys_dir`` (``ZMQ_OMNI_KEYS_DIR`` wins); each stage then loads only
its own file. The format and the rotation steps are in ``docs/security.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError

__all__ = [
    "ENV_KEYS_DIR",
    "HEALTH_PROBER",
    "KeyFile",
    "KeyFileExistsError",
    "Party",
    "make_key_files",
    "write_key_files",
]

logger = logging.getLogger("zmq_omni.stages")

#: Overrides ``pipeline.keys_dir``: where the stages of a pipeline find their key files.
ENV_KEYS_DIR = "ZMQ_OMNI_KEYS_DIR"
#: The key file name of the health prober (``zmq-omni health``, container healthchecks).
HEALTH_PROBER = "health"
_SUFFIX = ".keys"
_Z85_KEY_LEN = 40
_FIELDS = ("name", "public_key", "secret_key", "servers", "clients")


def _check_key(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != _Z85_KEY_LEN:
        raise ConfigError(f"{what} must be a {_Z85_KEY_LEN}-character Z85 CURVE key")
    return value


@dataclass(frozen=True)
class KeyFile:
    """One party's CURVE keys: its pair, the servers it connects to, the clients it admits.

    Attributes:
        name: the party (a stage's name, the driver's name, or ``health``).
        public_key: its public key (Z85).
        secret_key: its secret key (Z85); never printed in ``repr``.
        servers: stage id -> public key of that stage, for each stage it connects to.
        clients: public keys allowed to connect to the sockets it binds.
    """

    name: str
    public_key: str
    secret_key: str = field(repr=False)
    servers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    clients: tuple[str, ...] = ()

    @staticmethod
    def path_in(directory: str | Path, name: str) -> Path:
        """Where ``name``'s key file lives in ``directory``."""
        return Path(directory) / f"{name}{_SUFFIX}"

    def curve_extra(self) -> dict[str, Any]:
        """The ``curve_*`` keys of a ``ZmqConnector`` config for this party."""
        return {
            "curve_public_key": self.public_key,
            "curve_secret_key": self.secret_key,
            "curve_server_key": dict(self.servers),
            "curve_allowed_clients": list(self.clients),
        }

    def to_json(self) -> str:
        """The file's text (what :meth:`load` reads)."""
        data = {
            "name": self.name,
            "public_key": self.public_key,
            "secret_key": self.secret_key,
            "servers": dict(self.servers),
            "clients": list(self.clients),
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> KeyFile:
        """Read a key file written by ``zmq-omni keygen --config``.

        Logs a warning when group or others may read it (it holds a secret key).

        Raises:
            ConfigError: the file is missing, unreadable or malformed (the message names it).
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode
        except OSError as exc:
            raise ConfigError(f"cannot read CURVE key file {str(path)!r}: {exc.strerror}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("CURVE key file %s is readable by others (mode %o): chmod 600 it", path, mode & 0o777)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"CURVE key file {str(path)!r} is not JSON: {exc}") from exc
        if not isinstance(data, dict) or set(data) != set(_FIELDS):
            raise ConfigError(f"CURVE key file {str(path)!r} must hold exactly the keys {', '.join(_FIELDS)}")
        where = f"CURVE key file {str(path)!r}"
        servers = data["servers"]
        clients = data["clients"]
        if not isinstance(data["name"], str) or not isinstance(servers, dict) or not isinstance(clients, list):
            raise ConfigError(f"{where}: 'name' must be a string, 'servers' a mapping, 'clients' a list")
        return cls(
            name=data["name"],
            public_key=_check_key(data["public_key"], f"{where}: public_key"),
            secret_key=_check_key(data["secret_key"], f"{where}: secret_key"),
            servers=MappingProxyType({str(k): _check_key(v, f"{where}: servers.{k}") for k, v in servers.items()}),
            clients=tuple(_check_key(v, f"{where}: clients") for v in clients),
        )


class KeyFileExistsError(ConfigError):
    """``write_key_files`` would replace an existing key file and was not told to."""


@dataclass(frozen=True)
class Party:
    """One party of a pipeline's trust rule, by name (``PipelineConfig.trust`` derives them).

    Attributes:
        name: the party (a stage's name, the driver's name, or ``health``).
        stage_id: its stage id (what its servers are looked up by); None for the health prober.
        servers: the parties it connects to (it holds their public keys, by stage id).
        clients: the parties allowed to connect to the sockets it binds.
    """

    name: str
    stage_id: str | None
    servers: tuple[str, ...] = ()
    clients: tuple[str, ...] = ()


def make_key_files(
    parties: Sequence[Party],
    new_pair: Callable[[], tuple[str, str]],
    *,
    existing: Mapping[str, KeyFile] | None = None,
    rotate: tuple[str, ...] = (),
) -> dict[str, KeyFile]:
    """The key file of every party: a pair each, and the public keys its trust names.

    Args:
        parties: who trusts whom (``PipelineConfig.trust()``).
        new_pair: returns a fresh ``(public, secret)`` pair (``zmq.curve_keypair``, decoded).
        existing: key files already made: their pairs are kept, except those in ``rotate``.
        rotate: parties that get a new pair.

    Raises:
        ConfigError: ``rotate`` names an unknown party.
    """
    names = [party.name for party in parties]
    unknown = sorted(set(rotate) - set(names))
    if unknown:
        raise ConfigError(f"--rotate {unknown[0]!r}: no such party (parties: {', '.join(names)})")
    old = dict(existing or {})
    pairs: dict[str, tuple[str, str]] = {}
    for name in names:
        kept = old.get(name)
        pairs[name] = new_pair() if kept is None or name in rotate else (kept.public_key, kept.secret_key)
    stage_ids = {party.name: party.stage_id for party in parties if party.stage_id is not None}
    files: dict[str, KeyFile] = {}
    for party in parties:
        servers = {stage_ids[other]: pairs[other][0] for other in party.servers}
        clients = tuple(dict.fromkeys(pairs[other][0] for other in party.clients))
        files[party.name] = KeyFile(party.name, *pairs[party.name], MappingProxyType(servers), clients)
    return files


def write_key_files(directory: str | Path, files: Mapping[str, KeyFile], *, replace: bool) -> list[Path]:
    """Write ``<name>.keys`` (0600) and ``<name>.pub`` (0644) for each file into ``directory`` (0700).

    Each file is written to a temporary name and renamed into place, so a
    reader never sees half a key and a secret is never readable by others.

    Returns:
        The paths written, secret files first.

    Raises:
        KeyFileExistsError: a ``.keys`` file exists and ``replace`` is False (nothing is written).
        OSError: the directory or a file cannot be made.
    """
    directory = Path(directory)
    for name in files:
        path = KeyFile.path_in(directory, name)
        if path.exists() and not path.is_file():
            # docker-compose makes a directory where a bind-mounted file is missing.
            raise ConfigError(
                f"{path} is not a regular file (a container run without keys may have made it): remove it"
            )
        if path.exists() and not replace:
            raise KeyFileExistsError(f"{path} exists: refusing to overwrite a secret key")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_uid == os.geteuid():
        directory.chmod(0o700)
    written: list[Path] = []
    for name, keys in files.items():
        secret = KeyFile.path_in(directory, name)
        _write_atomically(secret, keys.to_json(), 0o600)
        written.append(secret)
    for name, keys in files.items():
        public = directory / f"{name}.pub"
        _write_atomically(public, keys.public_key + "\n", 0o644)
        written.append(public)
    return written


def _write_atomically(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)  # the umask may have cleared bits of a public file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
