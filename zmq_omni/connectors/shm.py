"""Same-host connector over shared memory: a mailbox directory plus a reused slot pool.

Transport only (no per-request state): every put is a record in the
namespace's mailbox directory, found by key alone from any process of the
host, and claimed exactly once by an atomic rename (see
:mod:`zmq_omni.shm.mailbox`). Where the payload lives depends on its size:

* up to ``inline_max_bytes``: inside the record (one small file write);
* larger: in a slot of this connector's :class:`~zmq_omni.shm.SlotPool`
  (written once, straight from the arrays), read by the receiver **without a
  copy** through a lease that keeps the slot from reuse until its last array
  is gone;
* when the pool cannot hold it (``/dev/shm`` below its free-space floor, or
  ``pool_max_bytes`` reached with every slot leased): in a *spill file* under
  ``spill_dir`` (a disk-backed directory). The put still succeeds, the
  receiver gets a private copy, and ``health()`` reports ``"degraded"`` until
  a later large put fits in shared memory again. If even the small record
  cannot be written (``/dev/shm`` completely full), the put fails with a
  :class:`~zmq_omni.errors.ShmSpaceError` kept for the adapters.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.device import read_device
from ..config.extra import ConnectorExtra, foreign_keys
from ..config.fields import read_stage_id
from ..config.reader import read_fields, setting
from ..errors import ClosedResourceError, ConfigError, DecodeError, ShmError, ShmSpaceError, ZmqOmniError
from ..shm import (
    DirEvents,
    DirWatch,
    Mailbox,
    Record,
    SlotPool,
    SlotReader,
    default_shm_dir,
    entry_address,
    is_our_name,
    make_name,
    namespace_dir,
    self_owner,
    sweep_dead_once,
)
from ..shm.mailbox import KIND_INLINE, KIND_SLOT, KIND_SPILL, entry_name
from ..shm.pool import flat_bytes
from ..shm.segment import shm_error
from ..wire import decode, encode, frames_nbytes, resolve_device
from .arrivals import ArrivalWatch, Slot
from .base import OmniConnectorBase, bounded_deadline, key_matches_prefix, key_matches_request

__all__ = ["SharedMemoryConfig", "SharedMemoryConnector"]

_log = logging.getLogger("zmq_omni.connectors")

#: Keep at most this many of our own unconsumed puts in mind for ``close()``.
_MAX_TRACKED = 65536
#: A waiting get re-arms its watch at least this often (a removed directory drops it).
_REARM_S = 0.5


@dataclass(frozen=True, kw_only=True)
class SharedMemoryConfig:
    """Config of :class:`SharedMemoryConnector` (the ``extra`` dict).

    Attributes:
        namespace: connectors of one deployment share it; others never collide
            (letters, digits, ``_ . -``). Default ``"default"``.
        stage_id: informational, exposed as ``.stage_id`` with the type it
            was given (vllm-omni injects an int).
        role: informational (``sender`` / ``receiver`` / ``dual``); every
            instance can put and get.
        from_stage: informational (vllm-omni injects it).
        to_stage: informational (vllm-omni injects it).
        shm_dir: tmpfs directory for records and slots. Default
            ``$ZMQ_OMNI_SHM_DIR`` or ``/dev/shm``.
        spill_dir: disk directory for payloads shared memory cannot take.
            Default the system temp directory.
        inline_max_bytes: payloads up to this size travel inside the record.
            Default 64 KiB. ``shm_threshold_bytes`` (the key vllm-omni's loader
            injects into automatically chosen edges) is another name for it.
        pool_max_bytes: most slot memory one connector holds. Default 1 GiB.
        min_free_bytes: never grow the pool if less would stay free in
            ``shm_dir``. Default 16 MiB.
        ttl_s: unconsumed puts expire after this many seconds. Default 300.
        decode_device: torch device received tensors are decoded onto
            (``"cuda"``, ``"cuda:1"``). Default ``None``: the CPU, viewing
            shared memory.
    """

    namespace: str = "default"
    stage_id: str | int | None = setting(None, read=read_stage_id)
    role: str | None = None
    from_stage: str | int | None = setting(None, read=read_stage_id)
    to_stage: str | int | None = setting(None, read=read_stage_id)
    shm_dir: str = setting(default_factory=default_shm_dir)
    spill_dir: str = setting(default_factory=tempfile.gettempdir)
    inline_max_bytes: int = setting(64 << 10, minimum=0)
    pool_max_bytes: int = setting(1 << 30, minimum=0)
    min_free_bytes: int = setting(16 << 20, minimum=0)
    ttl_s: float = setting(300.0, minimum=0.001)
    decode_device: str | None = setting(None, read=read_device)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SharedMemoryConfig:
        """Build from a plain dict. Raises :class:`~zmq_omni.errors.ConfigError` naming a bad key.

        Keys that are not ours are left alone (they belong to other components);
        a close match of one of ours is logged as a WARNING naming it.
        """
        data = dict(data or {})
        where = "SharedMemoryConnector"
        foreign_keys(data, [*cls.__dataclass_fields__, "shm_threshold_bytes"], where)
        if "shm_threshold_bytes" in data:
            if "inline_max_bytes" in data and data["inline_max_bytes"] != data["shm_threshold_bytes"]:
                raise ConfigError(
                    f"config keys '{where}.inline_max_bytes' and '{where}.shm_threshold_bytes' name the same "
                    f"setting and disagree ({data['inline_max_bytes']!r} != {data['shm_threshold_bytes']!r})"
                )
            data["inline_max_bytes"] = data.pop("shm_threshold_bytes")
        # An empty directory is "not given", as None is.
        values = read_fields(cls, {k: v for k, v in data.items() if not (k.endswith("_dir") and v == "")}, where)
        config = cls(**values)
        namespace_dir(config.shm_dir, config.namespace)  # validates the namespace
        return config


class _MailboxWatch(ArrivalWatch):
    """An :class:`ArrivalWatch` that also hears puts of other processes: an inotify descriptor on the mailbox."""

    def __init__(self, connector: SharedMemoryConnector, path: str) -> None:
        self._events = DirEvents(path)
        self._connector = connector
        super().__init__()

    def filenos(self) -> tuple[int, ...]:
        """The eventfd of this process's notifications and the mailbox directory's inotify descriptor."""
        return (self.fileno(), self._events.fileno())

    def drain(self) -> tuple[list[Slot] | None, bool]:
        """Both descriptors' news: record names become addresses (a hashed name means "anything")."""
        arrived, room = super().drain()
        # Closed: its close removed the empty mailbox directory, which a re-arm would make anew.
        names = self._events.read(rearm=not self._connector.closed)
        if arrived is None or names is None:
            return None, room
        for name in names:
            if name.startswith("."):
                continue  # a poster's temp file or a taker's claim
            address = entry_address(name)
            if address is None:
                return None, room  # a hashed (long) name: retry every waiting get
            arrived.append(address)
        return arrived, room

    def close(self) -> None:
        """Stop watching; release both descriptors."""
        super().close()
        self._events.close()


class SharedMemoryConnector(OmniConnectorBase):
    """Same-host connector through shared memory (registered as ``"SharedMemoryConnector"``).

    Every connector of a ``namespace`` on the host sees every put of that
    namespace, whatever process made it. Arrays a ``get`` returns view shared
    memory directly (no copy) and are writable; the memory returns to the
    sender's pool when the last of them is garbage-collected.

    ``close()`` withdraws this connector's unconsumed puts and unlinks its
    slots; arrays already handed to receivers stay valid. A process killed
    without ``close()`` leaves segments that :func:`zmq_omni.shm.sweep`
    removes; its unconsumed records are removed by the same sweep, and other
    connectors expire records older than ``ttl_s``. The first connector of a
    process to use a ``shm_dir`` runs that sweep for dead owners
    (:func:`zmq_omni.shm.sweep_dead_once`) before it builds its pool.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        # Config first: a bad config then leaves nothing for __del__ to warn about.
        #: The typed settings (``config`` is the ``extra`` as given, a dict, as vllm-omni reads it).
        self.settings = cfg = SharedMemoryConfig.from_dict(config)
        #: The ``extra`` dict as given, every key kept (vllm-omni's stage input processors read theirs here).
        self.config = ConnectorExtra(config or {}, cfg)
        self.stage_id = cfg.stage_id
        self.namespace = cfg.namespace
        self._device = resolve_device(cfg.decode_device, "SharedMemoryConnector.decode_device")
        self._box = Mailbox(namespace_dir(cfg.shm_dir, cfg.namespace))
        super().__init__()
        sweep_dead_once(cfg.shm_dir)
        self._pool = SlotPool(
            directory=cfg.shm_dir,
            max_bytes=cfg.pool_max_bytes,
            min_free_bytes=cfg.min_free_bytes,
            ttl=cfg.ttl_s,
        )
        self._reader = SlotReader(directory=cfg.shm_dir)
        self._lock = threading.Lock()
        self._posted: OrderedDict[str, None] = OrderedDict()
        self._degraded = False
        self._maintain_every = min(cfg.ttl_s / 4, 5.0)
        self._next_maintenance = time.monotonic() + self._maintain_every

    # -- put ---------------------------------------------------------------------
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Publish ``data`` under ``put_key``, replacing an unconsumed put of the same address."""
        from_stage, to_stage, key = str(from_stage), str(to_stage), str(put_key)
        frames = encode(data)
        if self._closed:
            self._record_failure(
                "put",
                from_stage,
                to_stage,
                key,
                "connector is closed",
                ClosedResourceError("put on a closed SharedMemoryConnector"),
            )
            return False, 0, None
        nbytes = frames_nbytes(frames)
        lengths = [flat_bytes(f).nbytes for f in frames]
        try:
            kind = self._publish(from_stage, to_stage, key, frames, lengths, nbytes)
        except ZmqOmniError as exc:
            self._record_failure("put", from_stage, to_stage, key, str(exc), exc)
            return False, 0, None
        self._counters.add("puts")
        self._counters.add("bytes_sent", nbytes)
        self._counters.add(("inline_puts", "shm_puts", "spill_puts")[kind])
        with self._lock:
            name = entry_name(key, from_stage, to_stage)
            self._posted[name] = None
            self._posted.move_to_end(name)
            if len(self._posted) > _MAX_TRACKED:
                self._posted.popitem(last=False)
        self._maybe_maintain()
        return True, nbytes, {"key": key, "size": nbytes, "namespace": self.namespace}

    def _publish(
        self, from_stage: str, to_stage: str, key: str, frames: Sequence[Any], lengths: list[int], nbytes: int
    ) -> int:
        kind, body, undo = KIND_INLINE, list(frames), None
        if nbytes > self.settings.inline_max_bytes:
            try:
                handle = self._pool.write(frames)
                kind, body = KIND_SLOT, [handle.pack()]
                undo = lambda: self._pool.discard(handle)  # noqa: E731
                self._degraded = False
            except ShmSpaceError as exc:
                self._note_fallback(exc)
                kind, body, undo = self._spill(frames)
        parts = Record.pack_parts(kind, key, from_stage, to_stage, lengths, body)
        try:
            self._box.post(key, from_stage, to_stage, parts, self._discard)
            return kind
        except OSError as exc:
            if undo is not None:
                undo()
            if exc.errno != errno.ENOSPC or kind == KIND_SPILL:
                raise shm_error(f"cannot publish {key!r} in {self._box.path}", exc) from exc
            self._note_fallback(exc)
        # The record with its payload did not fit in the tmpfs: move the payload to disk.
        kind, body, undo = self._spill(frames)
        parts = Record.pack_parts(kind, key, from_stage, to_stage, lengths, body)
        try:
            self._box.post(key, from_stage, to_stage, parts, self._discard)
        except OSError as exc:
            undo()
            raise shm_error(f"cannot publish {key!r} in {self._box.path}", exc) from exc
        return kind

    def _note_fallback(self, exc: BaseException) -> None:
        if not self._degraded:
            _log.warning("shared memory short (%s): spilling large payloads to %s", exc, self.settings.spill_dir)
        self._degraded = True
        self._counters.add("shm_fallbacks")

    def _spill(self, frames: Sequence[Any]) -> tuple[int, list[Any], Any]:
        name = make_name()
        path = os.path.join(self.settings.spill_dir, name)
        try:
            with open(path, "xb") as fh:
                for frame in frames:
                    fh.write(flat_bytes(frame))
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise shm_error(f"cannot spill to {path}", exc) from exc
        return KIND_SPILL, [name.encode()], lambda: _unlink_quietly(path)

    # -- get ---------------------------------------------------------------------
    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Claim and decode the put of ``get_key``; None at once when it is not there (metadata is ignored).

        A put is in the mailbox once it returned, so its metadata needs no wait.
        """
        if self._closed:
            return None
        from_stage, to_stage, key = str(from_stage), str(to_stage), str(get_key)
        self._maybe_maintain()
        record = self._box.take(key, from_stage, to_stage)
        if record is None:
            return None
        try:
            frames = self._frames_of(record)
        except ZmqOmniError as exc:
            self._record_failure("get", from_stage, to_stage, key, str(exc), exc)
            return None
        if frames is None:
            self._counters.add("stale_gets")
            self._record_failure(
                "get",
                from_stage,
                to_stage,
                key,
                "payload expired or its slot was reclaimed",
                ShmError(f"stale shared-memory handle for {key!r}"),
            )
            return None
        try:
            obj = decode(frames, device=self._device)
        except DecodeError as exc:
            self._record_failure("get", from_stage, to_stage, key, str(exc), exc)
            return None
        nbytes = sum(record.lengths)
        self._counters.add("gets")
        self._counters.add("bytes_received", nbytes)
        return obj, nbytes

    def _frames_of(self, record: Record) -> list[memoryview] | None:
        if record.kind == KIND_INLINE:
            return record.frames()
        if record.kind == KIND_SLOT:
            return self._reader.open(record.handle())
        name = record.spill_name()
        if not is_our_name(name):
            raise ShmError(f"refusing spill file name {name!r}")
        path = os.path.join(self.settings.spill_dir, name)
        try:
            with open(path, "rb") as fh:
                data = bytearray(fh.read())
        except FileNotFoundError:
            return None
        _unlink_quietly(path)
        view = memoryview(data)
        out, pos = [], 0
        for length in record.lengths:
            out.append(view[pos : pos + length])
            pos += length
        return out

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """Like :meth:`get`, sleeping on an inotify watch of the mailbox until ``deadline``.

        The watch is armed before each check, so a put landing between the
        check and the sleep wakes us at once; no CPU is used while waiting.
        """
        deadline = bounded_deadline(deadline)
        while not self._closed:
            self._box.ensure()
            with DirWatch(self._box.path) as watch:
                found = self.get(from_stage, to_stage, get_key, metadata)
                if found is not None:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._counters.add("timeouts")
                    return None
                watch.wait(min(remaining, _REARM_S))
        return None

    def watch_arrivals(self) -> ArrivalWatch:
        """A watch that hears every put of the namespace, from any process (inotify), and this connector's close.

        Raises:
            OSError: inotify is not available (not Linux).
        """
        return self._register_watch(_MailboxWatch(self, self._box.path))

    # -- cleanup -----------------------------------------------------------------
    def cleanup(self, request_id: str) -> bool:
        """Drop every unconsumed put of the request ``request_id`` in the namespace (any edge).

        Its keys are vllm-omni's: ``request_id``, ``request_id_*`` and ``*_request_id``
        (:func:`~zmq_omni.connectors.base.key_matches_request`).
        """
        rid = str(request_id)
        taken = self._box.take_where(lambda k: key_matches_request(k, rid))
        for record in taken:
            self._discard(record)
        return bool(taken)

    def cleanup_prefix(self, prefix: str) -> int:
        """Drop every unconsumed put whose key is ``prefix`` + digits; return how many."""
        prefix = str(prefix)
        taken = self._box.take_where(lambda k: key_matches_prefix(k, prefix))
        for record in taken:
            self._discard(record)
        return len(taken)

    def _discard(self, record: Record) -> None:
        """Free what an unconsumed record holds (we own it: we took it)."""
        try:
            if record.kind == KIND_SLOT:
                handle = record.handle()
                if not self._pool.discard(handle):
                    self._reader.discard(handle)
            elif record.kind == KIND_SPILL:
                name = record.spill_name()
                if is_our_name(name):
                    _unlink_quietly(os.path.join(self.settings.spill_dir, name))
        except (ShmError, OSError) as exc:
            _log.warning("could not release a discarded record of %r: %s", record.key, exc)

    def _maybe_maintain(self) -> None:
        now = time.monotonic()
        if now < self._next_maintenance:
            return
        self._next_maintenance = now + self._maintain_every
        expired = self._box.take_expired(self.settings.ttl_s)
        for record in expired:
            self._discard(record)
        if expired:
            self._counters.add("expired", len(expired))
            _log.info("expired %d unconsumed records in %s", len(expired), self._box.path)
        self._pool.reap()

    # -- status and lifecycle ------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Counters, pool state, and ``status: "degraded"`` while large puts spill to disk."""
        snap = super().health()
        if snap["status"] == "ok" and self._degraded:
            snap["status"] = "degraded"
        snap["shm_fallback"] = self._degraded
        snap["namespace"] = self.namespace
        snap.update({f"pool_{k}" if not k.startswith("pool") else k: v for k, v in self._pool.stats().items()})
        return snap

    def close(self) -> None:
        """Withdraw our unconsumed puts, unlink our slots, drop cached mappings. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            posted, self._posted = self._posted, OrderedDict()
        try:
            for record in self._box.withdraw(posted.keys(), self_owner()):
                self._discard(record)
        finally:
            self._notify_closed()
            self._pool.close()
            self._reader.close()
            with contextlib.suppress(OSError):
                self._box.remove_if_empty()

    def __repr__(self) -> str:
        namespace, stage = getattr(self, "namespace", None), getattr(self, "stage_id", None)
        return f"<SharedMemoryConnector namespace={namespace!r} stage_id={stage!r}>"


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
