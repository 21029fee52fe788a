"""Shared-memory segments: create, attach, release, and the free-space check.

A segment is a file in a tmpfs directory (``/dev/shm`` by default) mapped
with ``mmap``. We open the files ourselves instead of using
``multiprocessing.shared_memory``: before Python 3.13 every process that
*attaches* a ``SharedMemory`` registers it with the resource tracker, which
unlinks it (and warns about a "leak") when the attaching process exits, under
the feet of the creator and its other readers (bpo-38119, gh-82300). Plain
``os.open`` + ``mmap`` registers nothing; ownership is carried by the name
instead (see :mod:`zmq_omni.shm._owner`) and enforced by :func:`~zmq_omni.shm.sweep`.

Segments are created with ``posix_fallocate`` so a full tmpfs fails the create
with ``ENOSPC`` (a :class:`~zmq_omni.errors.ShmSpaceError`) instead of killing a
later writer with ``SIGBUS``, and mapped with ``MAP_POPULATE`` so the page
faults are paid once, at creation or first attach, not on every reuse.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from pathlib import Path

from ..errors import ShmError, ShmSpaceError
from ._owner import is_our_name, make_name

__all__ = ["DEFAULT_SHM_DIR", "Segment", "check_free_space", "default_shm_dir", "free_bytes"]

_log = logging.getLogger("zmq_omni.shm")

#: Where segments live unless configured otherwise.
DEFAULT_SHM_DIR = "/dev/shm"

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def default_shm_dir() -> str:
    """The segment directory: ``$ZMQ_OMNI_SHM_DIR`` when set, else ``/dev/shm``."""
    return os.environ.get("ZMQ_OMNI_SHM_DIR") or DEFAULT_SHM_DIR


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still allocate in ``directory`` (``statvfs``)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_free_space(directory: str, nbytes: int, min_free_bytes: int) -> None:
    """Raise :class:`ShmSpaceError` unless ``nbytes`` fit and leave ``min_free_bytes`` free.

    The floor keeps headroom for other users of ``/dev/shm`` (NCCL, PyTorch
    dataloaders, vLLM's own broadcast queue): we would rather fall back to
    frames than starve them.
    """
    try:
        avail = free_bytes(directory)
    except OSError as exc:
        raise ShmSpaceError(f"cannot stat {directory}: {exc}") from exc
    if avail - nbytes < min_free_bytes:
        raise ShmSpaceError(f"{directory} has {avail} bytes free; {nbytes} requested with a floor of {min_free_bytes}")


class Segment:
    """One mapped shared-memory file. Create with :meth:`create` or :meth:`attach`.

    Attributes:
        name: the file name (``zomni_...``), which names the owner.
        path: the full path of the file.
        size: the mapped size in bytes.
        mm: the mapping (read-write, shared).
        fd: the open file descriptor, kept for ``flock`` leases.
    """

    def __init__(self, name: str, path: str, fd: int, mm: mmap.mmap, *, owned: bool) -> None:
        self.name = name
        self.path = path
        self.fd = fd
        self.mm = mm
        self.size = len(mm)
        self.owned = owned
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def create(cls, size: int, *, directory: str | None = None, min_free_bytes: int = 0) -> Segment:
        """Create, reserve and map a fresh segment of ``size`` bytes owned by this process.

        Raises:
            ShmSpaceError: the directory has not enough free space (checked
                before and enforced by ``posix_fallocate``).
            ShmError: any other failure to create or map the file.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        directory = directory or default_shm_dir()
        check_free_space(directory, size, min_free_bytes)
        name = make_name()
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise shm_error(f"cannot create {path}", exc) from exc
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(path)
            raise shm_error(f"cannot reserve {size} bytes in {path}", exc) from exc
        return cls(name, path, fd, mm, owned=True)

    @classmethod
    def attach(cls, name: str, *, directory: str | None = None) -> Segment:
        """Map an existing segment by name (never registers it anywhere).

        Raises:
            FileNotFoundError: no such segment (it was released or swept).
            ShmError: ``name`` is not one of ours, or mapping failed.
        """
        if not is_our_name(name):
            # Names arrive from other processes: never open an arbitrary path.
            raise ShmError(f"refusing to attach {name!r}: not a zmq_omni segment name")
        directory = directory or default_shm_dir()
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise ShmError(f"cannot map {path}: {exc}") from exc
        return cls(name, path, fd, mm, owned=False)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def is_unlinked(self) -> bool:
        """True when the file was removed (our mapping then only pins memory)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def unlink(self) -> None:
        """Remove the file; mappings (ours and readers') stay valid until closed."""
        _unlink_quietly(self.path)

    def close(self) -> None:
        """Unmap and close the descriptor. Idempotent.

        When arrays still view the mapping, ``mmap.close`` refuses (BufferError);
        the mapping is then left to the garbage collector, which unmaps it when
        the last view is gone.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)

    def __repr__(self) -> str:
        return f"<Segment {self.name} size={self.size}{' owned' if self.owned else ''}>"


def shm_error(what: str, exc: OSError) -> ShmError:
    """The ShmError for an OSError on shared memory: ShmSpaceError when the tmpfs is full."""
    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
        return ShmSpaceError(f"{what}: {exc.strerror}")
    return ShmError(f"{what}: {exc}")


def _unlink_quietly(path: str) -> None:
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        _log.warning("cannot unlink %s: %s", path, exc)
