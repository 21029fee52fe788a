"""Remove what dead processes left in shared memory, and (optionally) expired records.

Safe by construction:

* only names that follow the scheme of :mod:`zmq_omni.shm._owner` are
  considered, and only those of our uid; anything else is never touched;
* an object is removed only when its owner is provably dead: a process of our
  own PID namespace whose pid is gone or now has another start time. Objects
  of other namespaces (another container sharing ``/dev/shm``) are reported
  and kept;
* records are taken with the same atomic rename a receiver uses, so a sweep
  racing a live receiver never delivers a payload twice or loses it.

Removing a segment that a live receiver still maps is harmless: the mapping
keeps the memory until the receiver's last view is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field

from ..errors import ShmError
from ._owner import Owner, make_name, parse_name
from .mailbox import KIND_SLOT, KIND_SPILL, Record, is_entry, iter_namespace_dirs
from .pool import SlotReader
from .segment import default_shm_dir

__all__ = ["SweepReport", "sweep", "sweep_dead_once"]

_log = logging.getLogger("zmq_omni.shm")


@dataclass(frozen=True)
class SweepReport:
    """What a sweep found and removed (or would remove, with ``dry_run``).

    Attributes:
        dry_run: nothing was removed; ``removed`` lists what would have been.
        removed: paths removed: segments, spill files, records, temp and claim files.
        expired: paths of records removed because they outlived ``expire_after``.
        kept_live: objects of ours whose owner is alive.
        kept_foreign: objects whose owner lives in another PID namespace or uid.
        freed_bytes: bytes of the removed segments and spill files.
        errors: one line per object that could not be removed.
    """

    dry_run: bool
    removed: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()
    kept_live: int = 0
    kept_foreign: int = 0
    freed_bytes: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)


class _Sweeper:
    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.removed: list[str] = []
        self.expired: list[str] = []
        self.kept_live = 0
        self.kept_foreign = 0
        self.freed = 0
        self.errors: list[str] = []
        self.uid = os.getuid()

    def judge(self, owner: Owner) -> bool:
        """True when ``owner`` is provably dead (so its objects may go)."""
        if owner.uid != self.uid or not owner.is_local():
            self.kept_foreign += 1
            return False
        if owner.is_alive():
            self.kept_live += 1
            return False
        return True

    def remove(self, path: str, *, sized: bool = False) -> None:
        try:
            size = os.stat(path).st_size if sized else 0
            if not self.dry_run:
                os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            self.errors.append(f"{path}: {exc}")
            return
        self.removed.append(path)
        self.freed += size

    def files(self, directory: str) -> None:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        for name in names:
            owner = parse_name(name)
            if owner is not None and self.judge(owner):
                self.remove(os.path.join(directory, name), sized=True)

    def namespace(self, directory: str, expire_after: float | None, reader: SlotReader, spill_dir: str) -> None:
        now = time.time()
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith((".t.", ".c.")):
                owner = parse_name(name[3:])
                if owner is not None and self.judge(owner):
                    self.remove(path)
            elif is_entry(name):
                self.record(path, now, expire_after, reader, spill_dir)
        if not self.dry_run:
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # only succeeds when empty; connectors recreate it

    def record(self, path: str, now: float, expire_after: float | None, reader: SlotReader, spill_dir: str) -> None:
        try:
            with open(path, "rb") as fh:
                record = Record.unpack(fh.read())
            age = now - os.stat(path).st_mtime
        except FileNotFoundError:
            return
        except (OSError, ShmError) as exc:
            self.errors.append(f"{path}: {exc}")
            return
        dead = self.judge(record.owner)
        expired = not dead and expire_after is not None and age >= expire_after
        if not (dead or expired):
            return
        if self.dry_run:
            (self.removed if dead else self.expired).append(path)
            return
        claim = os.path.join(os.path.dirname(path), ".c." + make_name())
        try:
            os.rename(path, claim)
        except FileNotFoundError:
            return  # consumed meanwhile
        try:
            with open(claim, "rb") as fh:
                taken = Record.unpack(fh.read())
            if taken.put_at != record.put_at or taken.owner != record.owner:
                # A newer record replaced the one we judged: put it back untouched.
                with contextlib.suppress(FileExistsError):
                    os.link(claim, path)
                return
            if taken.kind == KIND_SLOT:
                with contextlib.suppress(ShmError, OSError):
                    reader.discard(taken.handle())
            elif taken.kind == KIND_SPILL:
                self.remove(os.path.join(spill_dir, taken.spill_name()), sized=True)
            (self.removed if dead else self.expired).append(path)
        except (OSError, ShmError) as exc:
            self.errors.append(f"{path}: {exc}")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)

    def report(self) -> SweepReport:
        return SweepReport(
            dry_run=self.dry_run,
            removed=tuple(self.removed),
            expired=tuple(self.expired),
            kept_live=self.kept_live,
            kept_foreign=self.kept_foreign,
            freed_bytes=self.freed,
            errors=tuple(self.errors),
        )


def sweep(
    dry_run: bool = False,
    *,
    shm_dir: str | None = None,
    spill_dir: str | None = None,
    expire_after: float | None = None,
) -> SweepReport:
    """List and remove leftovers of dead processes (what ``zmq-omni shm-sweep`` runs).

    Args:
        dry_run: only report what would be removed.
        shm_dir: the segment directory (default ``$ZMQ_OMNI_SHM_DIR`` or ``/dev/shm``).
        spill_dir: where spill files live (default the system temp dir).
        expire_after: also remove records of live owners older than this many
            seconds (unconsumed data), freeing their slots; None keeps them.

    Returns:
        A :class:`SweepReport`.
    """
    shm_dir = shm_dir or default_shm_dir()
    spill_dir = spill_dir or tempfile.gettempdir()
    sweeper = _Sweeper(dry_run)
    reader = SlotReader(directory=shm_dir, cache_size=8)
    try:
        # Records first: a dead owner's record points into segments removed just after.
        for directory in iter_namespace_dirs(shm_dir):
            sweeper.namespace(directory, expire_after, reader, spill_dir)
        sweeper.files(shm_dir)
        if os.path.realpath(spill_dir) != os.path.realpath(shm_dir):
            sweeper.files(spill_dir)
    finally:
        reader.close()
    report = sweeper.report()
    if report.removed or report.expired:
        _log.info(
            "shm sweep%s: %d removed, %d expired, %d bytes freed",
            " (dry run)" if dry_run else "",
            len(report.removed),
            len(report.expired),
            report.freed_bytes,
        )
    return report


_swept: set[str] = set()
_swept_lock = threading.Lock()


def sweep_dead_once(shm_dir: str | None = None) -> None:
    """Sweep the leftovers of dead processes from ``shm_dir``, once per process and directory.

    The connectors call it before they build a :class:`~zmq_omni.shm.SlotPool` (a pool itself sweeps
    nothing), so a stage that was killed leaves nothing behind once any stage starts again on the
    host, without anyone running ``zmq-omni shm-sweep``. It removes only what :func:`sweep` removes: objects of our
    naming scheme whose owner is provably dead. It never raises: a failed sweep is logged.
    """
    directory = os.path.realpath(shm_dir or default_shm_dir())
    with _swept_lock:
        if directory in _swept:
            return
        _swept.add(directory)
    try:
        report = sweep(shm_dir=directory)
    except (OSError, ShmError) as exc:
        _log.warning("sweeping leftovers of dead processes in %s failed: %s", directory, exc)
        return
    if report.removed:
        _log.info("removed %d leftovers of dead processes from %s", len(report.removed), directory)
