"""Shared memory for same-host transfers: segments, a reused slot pool, mailboxes, the sweep.

No sockets here. The pieces, from the bottom up:

* :class:`Segment` -- a tmpfs file mapped with ``mmap``, named after its owner
  (uid, PID namespace, pid, start time); never registered with
  ``multiprocessing.resource_tracker``;
* :class:`SlotPool` / :class:`SlotReader` -- the sender's reused, pre-faulted
  slots and the receiver's zero-copy leases on them; a slot is reused only when
  the last array viewing it is gone (or its holder died);
* :class:`Mailbox` -- key-addressed records in a directory, claimed exactly
  once by atomic rename (the :class:`~zmq_omni.connectors.shm.SharedMemoryConnector`
  transport);
* :func:`sweep` -- removes leftovers of dead processes (``zmq-omni shm-sweep``);
  :func:`sweep_dead_once` runs it once per process and directory, called by
  the connectors before they build a slot pool;
* :class:`Owner`, :func:`make_name`, :func:`parse_name`, :func:`is_our_name` --
  the owner carried in every name; :class:`DirWatch` / :class:`DirEvents` --
  sleeping until a directory changes (inotify).
"""

from __future__ import annotations

from ._owner import Owner, is_our_name, make_name, parse_name, self_owner
from ._watch import DirEvents, DirWatch
from .mailbox import Mailbox, Record, entry_address, namespace_dir
from .pool import SlotHandle, SlotPool, SlotReader
from .segment import DEFAULT_SHM_DIR, Segment, check_free_space, default_shm_dir, free_bytes
from .sweep import SweepReport, sweep, sweep_dead_once

__all__ = [
    "DEFAULT_SHM_DIR",
    "DirEvents",
    "DirWatch",
    "Mailbox",
    "Owner",
    "Record",
    "Segment",
    "SlotHandle",
    "SlotPool",
    "SlotReader",
    "SweepReport",
    "check_free_space",
    "default_shm_dir",
    "entry_address",
    "free_bytes",
    "is_our_name",
    "make_name",
    "namespace_dir",
    "parse_name",
    "self_owner",
    "sweep",
    "sweep_dead_once",
]
