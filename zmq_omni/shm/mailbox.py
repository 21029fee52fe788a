"""Key-addressed mailboxes in a tmpfs directory: discovery without a socket.

A namespace is one directory, ``{shm_dir}/zomni_{uid}_ns_{namespace}``. Each
unconsumed put is one small file in it, named after ``(key, from, to)``,
holding a :class:`Record`: the payload itself when small, else a
:class:`~zmq_omni.shm.pool.SlotHandle` (or the name of a spill file).

Every state change is one atomic directory operation, so any number of
processes can share a namespace without a lock:

* post: write ``.t.<owner>`` then ``link()`` it to the key name, which fails
  if the key is taken; the poster then takes the old record back (below) and
  retries, so a re-put replaces an unconsumed record and never orphans it.
* take (a get, a cleanup, a take-back, an expiry): ``rename()`` the key name
  to ``.c.<owner>``. Of any number of racing takers, exactly one rename
  succeeds; the winner reads the record, unlinks its claim and owns the
  payload (and must consume or discard it).

Leftovers of a killed process (``.t.``/``.c.`` files carry their owner) and
records of dead owners are removed by :func:`zmq_omni.shm.sweep`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import quote, unquote

from ..errors import ConfigError, ShmError
from ._owner import Owner, make_name, self_owner
from .pool import SlotHandle, flat_bytes

__all__ = [
    "KIND_INLINE",
    "KIND_SLOT",
    "KIND_SPILL",
    "Mailbox",
    "Record",
    "entry_address",
    "entry_name",
    "is_entry",
    "iter_namespace_dirs",
    "namespace_dir",
]

_log = logging.getLogger("zmq_omni.shm")

KIND_INLINE, KIND_SLOT, KIND_SPILL = 0, 1, 2

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_REC = struct.Struct("<4sBBHIQIQdI")  # magic, version, kind, pad, uid, pidns, pid, start, put_at, frames
_MAGIC = b"ZOMR"
_MAX_NAME = 240


def namespace_dir(shm_dir: str, namespace: str) -> str:
    """The directory of ``namespace`` under ``shm_dir`` (validates the name)."""
    if not _NAMESPACE_RE.match(namespace):
        raise ConfigError(
            f"config key 'namespace' must match {_NAMESPACE_RE.pattern} (letters, digits, _ . -), got {namespace!r}"
        )
    return os.path.join(shm_dir, f"zomni_{os.getuid()}_ns_{namespace}")


@dataclass(frozen=True)
class Record:
    """One mailbox entry: who put what, when, and where its bytes are.

    Attributes:
        kind: ``KIND_INLINE`` (frames follow the record), ``KIND_SLOT`` (a slot
            handle follows) or ``KIND_SPILL`` (a spill file name follows).
        owner: the putting process.
        put_at: ``time.time()`` of the put.
        key, from_stage, to_stage: the address.
        lengths: byte length of each frame.
        body: the inline frames concatenated, the packed handle, or the spill file name.
    """

    kind: int
    owner: Owner
    put_at: float
    key: str
    from_stage: str
    to_stage: str
    lengths: tuple[int, ...]
    body: memoryview

    @staticmethod
    def pack_parts(
        kind: int, key: str, from_stage: str, to_stage: str, lengths: Sequence[int], body: Sequence[Any]
    ) -> list[Any]:
        """The buffers of a record, for ``writev`` (body buffers are not copied)."""
        owner = self_owner()
        names = [s.encode() for s in (key, from_stage, to_stage)]
        head = _REC.pack(_MAGIC, 1, kind, 0, owner.uid, owner.pidns, owner.pid, owner.start, time.time(), len(lengths))
        meta = struct.pack(f"<{len(lengths)}Q3H", *lengths, *(len(n) for n in names)) + b"".join(names)
        return [head + meta, *body]

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Record:
        """Parse a record. Raises :class:`ShmError` when it is not one."""
        view = memoryview(data)
        try:
            magic, version, kind, _, uid, pidns, pid, start, put_at, count = _REC.unpack_from(view, 0)
            if magic != _MAGIC or version != 1 or kind not in (KIND_INLINE, KIND_SLOT, KIND_SPILL):
                raise ShmError("not a zmq_omni mailbox record")
            pos = _REC.size
            *lengths, klen, flen, tlen = struct.unpack_from(f"<{count}Q3H", view, pos)
            pos += 8 * count + 6
            key = bytes(view[pos : pos + klen]).decode()
            from_stage = bytes(view[pos + klen : pos + klen + flen]).decode()
            to_stage = bytes(view[pos + klen + flen : pos + klen + flen + tlen]).decode()
            pos += klen + flen + tlen
        except (struct.error, UnicodeDecodeError) as exc:
            raise ShmError(f"malformed mailbox record: {exc}") from exc
        body = view[pos:]
        if kind == KIND_INLINE and body.nbytes != sum(lengths):
            raise ShmError("truncated mailbox record")
        owner = Owner(uid, pidns, pid, start)
        return cls(kind, owner, put_at, key, from_stage, to_stage, tuple(lengths), body)

    def frames(self) -> list[memoryview]:
        """The inline frames, viewing the record's buffer."""
        out = []
        pos = 0
        for length in self.lengths:
            out.append(self.body[pos : pos + length])
            pos += length
        return out

    def handle(self) -> SlotHandle:
        """The slot handle of a ``KIND_SLOT`` record."""
        return SlotHandle.unpack(self.body)

    def spill_name(self) -> str:
        """The spill file name of a ``KIND_SPILL`` record."""
        return bytes(self.body).decode()


@lru_cache(maxsize=4096)  # quoting dominates the cost of a small put otherwise
def entry_name(key: str, from_stage: str, to_stage: str) -> str:
    """The file name of an address: readable when short, a hash when too long for a name."""
    name = "k." + "=".join(quote(s, safe="") for s in (key, from_stage, to_stage))
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256("\0".join((key, from_stage, to_stage)).encode()).hexdigest()
    return "h." + digest


def _entry_key(name: str) -> str | None:
    """The key of an entry name, or None when it is hashed (read the record instead)."""
    if name.startswith("k."):
        return unquote(name[2:].split("=", 1)[0])
    return None


def entry_address(name: str) -> tuple[str, str, str] | None:
    """``(from_stage, to_stage, key)`` of a record name; None when it is hashed or not a record name."""
    if not name.startswith("k."):
        return None
    parts = name[2:].split("=")
    if len(parts) != 3:
        return None
    key, from_stage, to_stage = (unquote(part) for part in parts)
    return from_stage, to_stage, key


def is_entry(name: str) -> bool:
    """True for a record name (not a temp or claim file)."""
    return name.startswith(("k.", "h."))


class Mailbox:
    """One namespace directory. Thread- and process-safe; methods never block.

    Args:
        directory: the namespace directory (see :func:`namespace_dir`); created on demand.
    """

    def __init__(self, directory: str) -> None:
        self.path = directory
        self.ensure()

    def ensure(self) -> None:
        """Create the directory if it is missing (another process may remove it when empty)."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)

    def post(
        self, key: str, from_stage: str, to_stage: str, parts: Sequence[Any], on_replaced: Callable[[Record], None]
    ) -> None:
        """Publish a record (``parts`` from :meth:`Record.pack_parts`) under the address.

        An unconsumed record already there is taken back and handed to
        ``on_replaced``, which must discard it.

        Raises:
            OSError: the record could not be written (``ENOSPC`` when the tmpfs is full).
        """
        final = os.path.join(self.path, entry_name(key, from_stage, to_stage))
        tmp = os.path.join(self.path, ".t." + make_name())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            self.ensure()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                _writev_all(fd, parts)
            finally:
                os.close(fd)
            # link() refuses to overwrite, so a record we did not take back is never lost.
            for _ in range(100):
                try:
                    os.link(tmp, final)
                    return
                except FileExistsError:
                    old = self._take_path(final)
                    if old is not None:
                        on_replaced(old)
            raise ShmError(f"cannot publish {final}: it keeps being re-created")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def take(self, key: str, from_stage: str, to_stage: str) -> Record | None:
        """Claim the record of an address; None when there is none. Exactly one taker wins."""
        return self._take_path(os.path.join(self.path, entry_name(key, from_stage, to_stage)))

    def take_where(self, match: Callable[[str], bool]) -> list[Record]:
        """Claim every record whose key satisfies ``match`` (for cleanup)."""
        taken = []
        for name in self._names():
            key = _entry_key(name)
            if key is None:
                record = self._peek(name)
                key = record.key if record is not None else None
            if key is not None and match(key):
                record = self._take_path(os.path.join(self.path, name))
                if record is not None:
                    taken.append(record)
        return taken

    def take_expired(self, ttl: float, *, now: float | None = None) -> list[Record]:
        """Claim every record older than ``ttl`` seconds (by file time)."""
        now = time.time() if now is None else now
        taken = []
        for name in self._names():
            try:
                age = now - os.stat(os.path.join(self.path, name)).st_mtime
            except FileNotFoundError:
                continue
            if age >= ttl:
                record = self._take_path(os.path.join(self.path, name))
                if record is not None:
                    taken.append(record)
        return taken

    def withdraw(self, names: Iterable[str], owner: Owner) -> list[Record]:
        """Take back the records among ``names`` that ``owner`` posted (a closing sender's)."""
        taken = []
        for name in set(names) & set(self._names()):
            peeked = self._peek(name)
            if peeked is None or peeked.owner != owner:
                continue
            record = self._take_path(os.path.join(self.path, name))
            if record is not None:
                taken.append(record)
        return taken

    def names(self) -> list[str]:
        """Names of the records present (a snapshot)."""
        return self._names()

    def _names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.path) if is_entry(n)]
        except FileNotFoundError:
            return []

    def _peek(self, name: str) -> Record | None:
        try:
            with open(os.path.join(self.path, name), "rb") as fh:
                return Record.unpack(fh.read())
        except (OSError, ShmError):
            return None

    def _take_path(self, path: str) -> Record | None:
        claim = os.path.join(self.path, ".c." + make_name())
        try:
            os.rename(path, claim)
        except FileNotFoundError:
            return None
        try:
            data = _read_all(claim)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)
        try:
            return Record.unpack(data)
        except ShmError:
            _log.warning("dropped a malformed mailbox record %s", path)
            return None

    def remove_if_empty(self) -> None:
        """Remove the directory when nothing is left in it (others recreate it on demand)."""
        try:
            os.rmdir(self.path)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
                raise


def _writev_all(fd: int, parts: Sequence[Any]) -> None:
    views = [v for v in (flat_bytes(p) for p in parts) if v.nbytes]
    while views:
        written = os.writev(fd, views[:1024])  # IOV_MAX
        while written and views:
            if written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][written:]
                written = 0


def _read_all(path: str) -> bytearray:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        pos = 0
        while pos < size:
            got = os.readv(fd, [view[pos:]])
            if got == 0:
                break
            pos += got
        return buf
    finally:
        os.close(fd)


def iter_namespace_dirs(shm_dir: str) -> Iterator[str]:
    """Every namespace directory of ours under ``shm_dir``."""
    prefix = f"zomni_{os.getuid()}_ns_"
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(prefix) and os.path.isdir(os.path.join(shm_dir, name)):
            yield os.path.join(shm_dir, name)
