"""Who owns a shared-memory object, and is that owner still alive.

Every file the shm room creates carries its creator in its name::

    zomni_{uid}_{pidns}_{pid}_{start}_{rand}

``pidns`` is the inode of the creator's PID namespace and ``start`` the
process start time in clock ticks since boot (``/proc/<pid>/stat`` field 22).
A pid alone is not an identity: pids are reused, and containers sharing
``/dev/shm`` (``--ipc=host``) see different pids for the same process. With the
namespace and the start time, "the owner is dead" is only ever concluded about
a process of our own PID namespace whose pid is gone or now names another
process.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from functools import cache

__all__ = ["PREFIX", "Owner", "is_our_name", "make_name", "parse_name", "self_owner"]

#: Every shm-room object name starts with this.
PREFIX = "zomni_"

_NAME_RE = re.compile(r"^zomni_(\d+)_(\d+)_(\d+)_(\d+)_([0-9a-f]{8,32})$")


@dataclass(frozen=True)
class Owner:
    """The identity of a process: uid, PID namespace, pid and start time."""

    uid: int
    pidns: int
    pid: int
    start: int

    def tag(self) -> str:
        """``{uid}_{pidns}_{pid}_{start}``, the owner part of a name."""
        return f"{self.uid}_{self.pidns}_{self.pid}_{self.start}"

    def is_local(self) -> bool:
        """True when the owner lives in our PID namespace (so its pid means something to us)."""
        return self.pidns == _pid_namespace()

    def is_alive(self) -> bool:
        """True unless the owner is provably dead.

        An owner from another PID namespace counts as alive: we cannot see it,
        so we must not remove its objects.
        """
        if not self.is_local():
            return True
        start = process_start_time(self.pid)
        # -1: the process exists but /proc hides it from us; never call that dead.
        return start is not None and start in (self.start, -1)


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:  # hidepid: the process exists but is not ours to read
        return -1
    # The command name may hold spaces and parentheses; fields restart after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    # Field 22 overall is index 19 after the pid and comm fields are dropped.
    return int(fields[19])


@cache
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_SELF: dict[int, Owner] = {}


def self_owner() -> Owner:
    """The :class:`Owner` of the calling process (recomputed after a fork)."""
    pid = os.getpid()
    owner = _SELF.get(pid)
    if owner is None:
        start = process_start_time(pid)
        owner = Owner(os.getuid(), _pid_namespace(), pid, start if start is not None else 0)
        _SELF.clear()
        _SELF[pid] = owner
    return owner


def make_name(owner: Owner | None = None) -> str:
    """A fresh, unique object name owned by ``owner`` (default: this process)."""
    owner = owner or self_owner()
    return f"{PREFIX}{owner.tag()}_{secrets.token_hex(8)}"


def parse_name(name: str) -> Owner | None:
    """The owner encoded in ``name``, or None when ``name`` is not one of ours."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    uid, pidns, pid, start, _ = match.groups()
    return Owner(int(uid), int(pidns), int(pid), int(start))


def is_our_name(name: str) -> bool:
    """True when ``name`` follows the shm room's naming scheme."""
    return _NAME_RE.match(name) is not None
