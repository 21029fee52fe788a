"""A real in-process backend: the contract without any transport.

Connectors built with the same ``namespace`` (default ``"default"``) in one
process share a mailbox, so a sender stage and a receiver stage running as
threads of one process talk through it. It is the test double shipped as a
backend (httpx ``MockTransport`` style): tests of adapters and schedulers use
it, and it passes the same contract suite as the socket backends.

``put`` encodes with the wire codec and keeps a private copy of the frames,
so the caller may reuse its arrays at once and unsupported types fail the
same way they would on a socket.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from ..config.extra import ConnectorExtra, foreign_keys
from ..config.fields import read_stage_id, read_str
from ..errors import ClosedResourceError
from ..wire import decode, encode
from .arrivals import ArrivalWatch, WatchSet
from .base import OmniConnectorBase, bounded_deadline, key_matches_prefix, key_matches_request

__all__ = ["InProcConnector"]

_Slot = tuple[str, str, str]  # (from_stage, to_stage, key)


class _Mailbox:
    """Payloads of one namespace, guarded by one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[_Slot, list[bytearray]] = {}
        self.watches = WatchSet()  # every connector's watches: a put notifies them all


_mailboxes: weakref.WeakValueDictionary[str, _Mailbox] = weakref.WeakValueDictionary()
_mailboxes_lock = threading.Lock()


def _mailbox(namespace: str) -> _Mailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(namespace)
        if box is None:
            box = _Mailbox()
            _mailboxes[namespace] = box
        return box


class InProcConnector(OmniConnectorBase):
    """Thread-safe, in-process connector (registered as ``"InProcConnector"``).

    Config keys (the ``extra`` dict):
        namespace: connectors with the same namespace share payloads (default ``"default"``).
        stage_id: informational, exposed as ``.stage_id`` with the type it was given.
        role, from_stage, to_stage: accepted (vllm-omni injects them) and ignored.

    Other keys are kept for other components (``config`` is the ``extra`` as given,
    a dict); a close match of one of the keys above is logged as a warning.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        foreign_keys(config or {}, ("namespace", "stage_id", "role", "from_stage", "to_stage"), "InProcConnector")
        #: The ``extra`` dict as given, every key kept (the typed settings are the attributes below).
        self.config = ConnectorExtra(config or {}, None)
        config = dict(config or {})
        self.namespace: str = read_str(config, "namespace", "default")
        self.stage_id: str | int | None = read_stage_id(config, "stage_id", "InProcConnector")
        # Holding a strong reference keeps the namespace's mailbox alive while any connector uses it.
        self._box = _mailbox(self.namespace)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Copy ``data`` into the namespace mailbox, replacing an unconsumed put of ``put_key``."""
        key = put_key
        frames = [bytearray(frame) for frame in encode(data)]
        nbytes = sum(len(frame) for frame in frames)
        if self._closed:
            self._record_failure(
                "put",
                str(from_stage),
                str(to_stage),
                str(key),
                "connector is closed",
                ClosedResourceError("put on a closed InProcConnector"),
            )
            return False, 0, None
        slot = (str(from_stage), str(to_stage), str(key))
        with self._box.cond:
            self._box.items[slot] = frames
            self._box.cond.notify_all()
            self._box.watches.notify((slot,))
        self._counters.add("puts")
        self._counters.add("bytes_sent", nbytes)
        return True, nbytes, {"key": slot[2], "size": nbytes}

    def _take(self, slot: _Slot) -> tuple[Any, int] | None:
        frames = self._box.items.pop(slot, None)
        if frames is None:
            return None
        nbytes = sum(len(frame) for frame in frames)
        self._counters.add("gets")
        self._counters.add("bytes_received", nbytes)
        return decode(frames), nbytes

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Take the payload of ``get_key`` if it is there; never blocks (a put is there once it returned)."""
        if self._closed:
            return None
        with self._box.cond:
            return self._take((str(from_stage), str(to_stage), str(get_key)))

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """Wait on the mailbox condition until the payload arrives or ``deadline`` passes."""
        deadline = bounded_deadline(deadline)
        slot = (str(from_stage), str(to_stage), str(get_key))
        with self._box.cond:
            while not self._closed:
                found = self._take(slot)
                if found is not None:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._counters.add("timeouts")
                    return None
                self._box.cond.wait(remaining)
        return None

    def watch_arrivals(self) -> ArrivalWatch:
        """A watch notified by every put of the namespace (any connector) and by this connector's close."""
        return self._register_watch(ArrivalWatch(), self._box.watches)

    def cleanup(self, request_id: str) -> bool:
        """Drop every unconsumed payload of the request: keys ``request_id``, ``request_id_*``, ``*_request_id``."""
        rid = str(request_id)
        with self._box.cond:
            doomed = [slot for slot in self._box.items if key_matches_request(slot[2], rid)]
            for slot in doomed:
                del self._box.items[slot]
        return bool(doomed)

    def cleanup_prefix(self, prefix: str) -> int:
        """Drop every unconsumed payload whose key is ``prefix`` + digits."""
        prefix = str(prefix)
        with self._box.cond:
            doomed = [slot for slot in self._box.items if key_matches_prefix(slot[2], prefix)]
            for slot in doomed:
                del self._box.items[slot]
        return len(doomed)

    def health(self) -> dict[str, Any]:
        """Counters plus how many payloads wait in the namespace."""
        with self._box.cond:
            pending = len(self._box.items)
        return {**super().health(), "pending": pending, "namespace": self.namespace}

    def close(self) -> None:
        """Mark closed and wake any waiter; payloads stay for other connectors of the namespace."""
        if self._closed:
            return
        self._closed = True
        with self._box.cond:
            self._box.cond.notify_all()
        self._notify_closed()
