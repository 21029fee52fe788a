"""Which process of a stage binds the stage's endpoint on this host: the holder of its stage lock.

Every process of a stage (its replicas, its EngineCore and TP workers) is
built from the same connector ``extra`` and so names the same receive
endpoint. One of them binds it; the others are its local clients (they ask
the binder for keys). Who binds is decided by an advisory ``flock`` on a file
derived from the endpoint: the kernel gives it to one process at a time and
takes it back when that process exits, however it exits, so a successor is
elected without a timeout and a dead binder never blocks its stage.

The lock file is never removed: a file unlinked while another process waits
on it would let a third process lock a new file of the same name, and two
processes would bind. It holds the holder's pid, for messages only.

Paths, for endpoint ``E``:

- ``ipc://P``: the lock is ``P.lock`` and the binder's local service socket
  ``ipc://P.share``, next to the endpoint (same directory, same permissions);
- ``tcp://H:N``: ``stage-H-N.lock`` and ``ipc://.../stage-H-N.share`` in
  ``$ZMQ_OMNI_RUN_DIR`` (default ``<tmp>/zmq-omni-<uid>``, created mode 0700;
  one that is a symlink, not ours or reachable by group or others is refused):
  the processes of a stage on one host share the host's directory.

The lock's fd is closed in a forked child (``os.register_at_fork``), so a
child never keeps its parent's stage lock; :func:`close_inherited_sockets`
closes the child's copies of the bound sockets (the connectors' at-fork hook
calls it), so a child never keeps its parent's endpoint either.

Threads: a :class:`StageLock` belongs to the code that binds or gives up the
endpoint (one thread at a time); it has no lock of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
import warnings
import weakref
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["StageLock", "StagePaths", "close_inherited_sockets", "pid_alive", "stage_paths"]


@dataclass(frozen=True)
class StagePaths:
    """Where the stage lock and the binder's local service socket of one endpoint live."""

    lock: str
    service: str


def _run_dir() -> str:
    """The private directory of the stage locks of ``tcp://`` endpoints; refuses one another user could reach."""
    path = os.environ.get("ZMQ_OMNI_RUN_DIR") or os.path.join(tempfile.gettempdir(), f"zmq-omni-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"stage run directory {path} is not a directory (a symlink?); remove it or set ZMQ_OMNI_RUN_DIR"
        )
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"stage run directory {path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
            f"it must be ours (uid {os.getuid()}) and private (no group/other bits); "
            "fix it or set ZMQ_OMNI_RUN_DIR to a private directory"
        )
    return path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host lives, as the kernel says (a zombie counts dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


_HELD: weakref.WeakSet[StageLock] = weakref.WeakSet()


def _close_in_child() -> None:
    """A forked child closes its copies of the parent's lock fds (closing, not LOCK_UN: the lock is the parent's)."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def stage_paths(endpoint: str) -> StagePaths:
    """The lock file and service address of ``endpoint`` (``ipc://`` or ``tcp://``; see the module docstring)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        return StagePaths(f"{path}.lock", f"ipc://{path}.share")
    if endpoint.startswith("tcp://"):
        name = "stage-" + re.sub(r"[^A-Za-z0-9.-]", "_", endpoint[len("tcp://") :].replace(":", "-"))
        base = os.path.join(_run_dir(), name)
        return StagePaths(f"{base}.lock", f"ipc://{base}.share")
    raise ConfigError(f"no stage lock for {endpoint!r}: only ipc:// and tcp:// endpoints are shared by a stage")


class StageLock:
    """The right to bind one stage endpoint on this host, held by one process at a time.

    Args:
        endpoint: the stage's receive endpoint, as every process of the stage names it.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.paths = stage_paths(endpoint)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if no live process holds it; never waits. True when held (also when held already)."""
        if self._fd is not None:
            return True
        fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        _HELD.add(self)
        return True

    def holder(self) -> int | None:
        """The pid the lock file names (the last holder's; for messages), None when unreadable."""
        try:
            with open(self.paths.lock, "rb") as f:
                text = f.read(32).decode(errors="replace")
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def release(self) -> None:
        """Give the lock up (idempotent); the file stays (see the module docstring)."""
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __del__(self) -> None:
        if self._fd is not None:
            warnings.warn(f"StageLock of {self.endpoint} was never released", ResourceWarning, stacklevel=2)
            self.release()

    def __enter__(self) -> StageLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _socket_inodes(endpoints: list[str]) -> set[str]:
    """Inodes of this process's sockets at ``endpoints`` (listening, or accepted there), from ``/proc/net``."""
    paths, ports = set(), set()
    for endpoint in endpoints:
        if endpoint.startswith("ipc://"):
            paths.add(endpoint[len("ipc://") :])
        elif endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
            ports.add(int(endpoint.rsplit(":", 1)[-1]))
    inodes: set[str] = set()
    if paths:
        with contextlib.suppress(OSError), open("/proc/net/unix") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) >= 8 and fields[7] in paths:
                    inodes.add(fields[6])
    for table in ("/proc/net/tcp", "/proc/net/tcp6") if ports else ():
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) >= 10 and int(fields[1].rsplit(":", 1)[-1], 16) in ports:
                    inodes.add(fields[9])
    return inodes


def close_inherited_sockets(endpoints: list[str]) -> int:
    """In a forked child: close the inherited fds of the parent's sockets bound at ``endpoints``; how many.

    libzmq's listening and accepted sockets of a bound endpoint (and of its stage service) are fds
    the child inherits but never uses (a child has no libzmq I/O thread). Kept open, they outlive the
    parent: the next binder of the stage finds the address taken, and senders never see the parent
    gone. Found by inode in ``/proc/net/unix`` (ipc paths) and ``/proc/net/tcp*`` (tcp ports).
    """
    names = list(endpoints)
    for endpoint in endpoints:
        if endpoint.startswith("ipc://"):
            names.append(f"{endpoint}.share")
        elif endpoint.startswith("tcp://"):
            with contextlib.suppress(ConfigError, OSError):
                names.append(stage_paths(endpoint).service)
    inodes = _socket_inodes(names)
    closed = 0
    if not inodes:
        return 0
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                with contextlib.suppress(OSError):
                    os.close(int(name))
                    closed += 1
    return closed


os.register_at_fork(after_in_child=_close_in_child)
