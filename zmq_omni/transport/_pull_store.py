"""What a pull server holds: payloads stored until fetched, and replies handed to ZeroMQ that have not left.

Plain records; :class:`~zmq_omni.transport._pull_server.PullServer` guards them with its lock.
"""

from __future__ import annotations

import weakref
from typing import Any

from ._pull_protocol import Slot

__all__ = ["GONE", "Leaving", "Stored"]


#: The owner of a reply still leaving once that owner was garbage-collected: its loss is counted, reported to none.
GONE = object()


class Stored:
    """A payload kept until fetched: its frames, size, expiry and owner."""

    __slots__ = ("expires", "frames", "nbytes", "owner")

    def __init__(self, frames: list[Any], nbytes: int, expires: float, owner: Any = None) -> None:
        self.frames = frames
        self.nbytes = nbytes
        self.expires = expires
        self.owner = owner


class Leaving:
    """A payload reply handed to ZeroMQ that has not left yet.

    Its frames are still being written (``tracker`` not done), or its
    shared-memory slot was not opened yet (``loc``, for as long as the pool
    keeps the slot). Its owner is held weakly: a connector that closed while
    the server goes on serving others must not be kept alive by a reply.
    ``tell``: the server's ``on_fetched`` is told once it has left.
    """

    __slots__ = ("_owner", "loc", "nbytes", "slot", "tell", "tracker")

    def __init__(self, slot: Slot, nbytes: int, tracker: Any, loc: bytes | None, owner: Any = None) -> None:
        self.slot = slot
        self.nbytes = nbytes
        self.tracker = tracker
        self.loc = loc
        self.tell = False
        self._owner = None if owner is None else weakref.ref(owner)

    def left(self, shm: Any) -> bool:
        """True once its frames were written (tracker done) and its shared-memory slot (``shm``'s) was opened."""
        if self.tracker is None or not self.tracker.done:  # being sent, or still being written
            return False
        return self.loc is None or shm is None or not shm.unopened(self.loc)

    @property
    def owner(self) -> Any:
        """The payload's owner; None when it had none, ``GONE`` once it was garbage-collected."""
        if self._owner is None:
            return None
        owner = self._owner()
        return GONE if owner is None else owner
