"""``Gets``: every get of a :class:`~zmq_omni.connectors.zmq.ZmqConnector`, from the mailbox or fetched.

What it owns: only the event that ends a wait for a change on a connector without a
push receiver (set at close). It takes from the ``Bound`` part's receiver and fetches
through the ``Fetching`` part. Push mode takes from the mailbox of the bound receiver (shared with the other
connectors of this process bound there), waiting on its condition when the call
may wait, and for a put of this very key this process has on its way there. A
wait ends at its deadline, at an arrival of its key, at the endpoint's seal, or
when this connector closes (its close wakes the mailbox's waiters, each of which
checks its own connector): no wait here is cut into time slices. A local
client of a shared stage endpoint (``transport/_stage_client.py``) takes from its
own mailbox the same way, but waits in short sleeps where the binder's silence or
a binder change is being settled (its docstring says where and why). Pull
mode fetches from the sender (see ``_zmq_pull``). Arrivals can also be waited for
(:meth:`Gets.wait_for_change`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import DecodeError, ShmError, TransportTimeoutError, ZmqOmniError
from ._zmq_bound import Bound
from ._zmq_parts import Wiring
from ._zmq_pull import Fetching
from ._zmq_puts import announces
from .base import bounded_deadline, bounded_timeout


class Gets:
    """``get`` and its kin of one connector (see the module docstring).

    Args:
        wiring: the connector's shared settings and rules.
        bound: its bound part (push-mode gets take from its receiver's mailbox).
        fetching: its pull-mode fetches.
    """

    def __init__(self, wiring: Wiring, bound: Bound, fetching: Fetching) -> None:
        self._wiring = wiring
        self._bound = bound
        self._fetching = fetching
        self._idle = threading.Event()  # set by close(): ends wait_for_change without a receiver

    def close(self) -> None:
        """The connector closed: end the waits for a change without a receiver (a receiver's seal ends the others)."""
        self._idle.set()

    def get_wakeup_generation(self) -> int | None:
        """The push receiver's arrival counter; None without one (see the connector's)."""
        receiver = self._bound.receiver
        return None if receiver is None else receiver.generation()

    def wait_for_change(self, gen: int, *, timeout: float) -> int:
        """Wait on the mailbox condition for an arrival, or until closed (see the connector's)."""
        wiring = self._wiring
        timeout = bounded_timeout(timeout)
        if timeout > 0 and not wiring.can_wait():
            raise wiring.refuse_wait("wait_for_change", "the AsyncConnector's awaited get")
        receiver = self._bound.receiver
        if receiver is not None:
            return receiver.wait_for_change(gen, timeout, self._is_closed)
        if not wiring.closed:
            self._idle.wait(timeout)
        return gen

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """The connector's ``get`` (see :meth:`~zmq_omni.connectors.zmq.ZmqConnector.get`).

        Push mode with the metadata of one of our puts: waits up to ``metadata_get_timeout_s`` for it,
        and keeps a timeout failure if it does not arrive. On an event loop's thread it never waits.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        wiring = self._wiring
        if not wiring.can_wait():
            return self._get(from_stage, to_stage, key, metadata, None, wait_for_own=False)
        if metadata is not None and self._bound.receiver_or_bind(to_stage) and announces(metadata, key):
            deadline = time.monotonic() + wiring.settings.metadata_get_timeout_s
            got = self._get(from_stage, to_stage, key, metadata, deadline)
            if got is None and not wiring.closed:
                wiring.record_failure(
                    "get",
                    from_stage,
                    to_stage,
                    key,
                    f"the put of {key!r} its metadata announced did not arrive within "
                    f"metadata_get_timeout_s={wiring.settings.metadata_get_timeout_s}s",
                    TransportTimeoutError(f"put of {key!r} not arrived", endpoint=self._bound.endpoint),
                )
            return got
        return self._get(from_stage, to_stage, key, metadata, None)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """The connector's ``get_with_deadline``: a take (or fetch) that may wait until ``deadline``."""
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        deadline = bounded_deadline(deadline)
        if not self._wiring.can_wait():
            if deadline > time.monotonic():
                raise self._wiring.refuse_wait("get_with_deadline", "await AsyncConnector.get(..., timeout=...)")
            return self._get(from_stage, to_stage, key, metadata, None, wait_for_own=False)
        return self._get(from_stage, to_stage, key, metadata, deadline)

    def _get(
        self,
        from_stage: str,
        to_stage: str,
        key: str,
        metadata: dict[str, Any] | None,
        deadline: float | None,
        *,
        wait_for_own: bool = True,
    ) -> tuple[Any, int] | None:
        wiring, bound, fetching = self._wiring, self._bound, self._fetching
        if wiring.closed:
            return None
        if bound.receiver is None and fetching.client is None:
            if wiring.settings.mode == "push":
                if bound.receiver_or_bind(to_stage) is None:  # closed meanwhile: nothing to bind for
                    return None
            elif fetching.ensure_client() is None:  # a pull-mode sender's first get; None: closed meanwhile
                return None
        if bound.receiver is not None:  # push-mode gets are counted by the mailbox
            return self._take(from_stage, to_stage, key, deadline, wait_for_own=wait_for_own)
        got = fetching.fetch(from_stage, to_stage, key, metadata, deadline)
        if got is not None:
            wiring.counters.add("gets")
            wiring.counters.add("bytes_received", got[1])
        return got

    def get_nowait(self, from_stage: str, to_stage: str, get_key: str) -> tuple[Any, int] | None:
        """A get by key that never waits, not even for our own put on its way here (see the connector's)."""
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        bound = self._bound
        if self._wiring.closed:
            return None
        if bound.receiver is None and self._fetching.client is None:
            bound.receiver_or_bind(to_stage)
        if bound.receiver is None:
            return self._get(from_stage, to_stage, key, None, None, wait_for_own=False)
        return self._take(from_stage, to_stage, key, None, wait_for_own=False)

    def _take(
        self, from_stage: str, to_stage: str, key: str, deadline: float | None, *, wait_for_own: bool = True
    ) -> tuple[Any, int] | None:
        """A push-mode get from the receiver's mailbox (waiting until ``deadline``, if given); failures recorded.

        Without a deadline it never waits, except for a put of this very key that this process
        made and that has not arrived yet: it waits for that one, until its window ends.
        """
        receiver, shared = self._bound.receiver, self._bound.shared
        assert receiver is not None and shared is not None
        try:
            if deadline is None:
                got = receiver.take(from_stage, to_stage, key)
                expected = shared.expected
                if expected.slots:
                    slot = (from_stage, to_stage, key)
                    until = expected.until(slot) if got is None and wait_for_own else None
                    if until is not None:
                        # Our own put of this key is on its way here: wait for it while it is expected (another
                        # connector of this endpoint taking it, or a cleanup, settles it and wakes this wait).
                        slots = expected.slots

                        def gone() -> bool:
                            return self._wiring.closed or slot not in slots

                        got = receiver.take(from_stage, to_stage, key, until, gone)
                    if got is not None:
                        expected.settle(slot)
                return got
            got = receiver.take(from_stage, to_stage, key, deadline, self._is_closed)
            if got is not None and shared.expected.slots:
                shared.expected.settle((from_stage, to_stage, key))
            return got
        except ZmqOmniError as exc:
            self._take_failed(from_stage, to_stage, key, exc)
            return None

    def _is_closed(self) -> bool:
        """True once this connector closed (a wait on a receiver other connectors still hold ends then)."""
        return self._wiring.closed

    def _take_failed(self, from_stage: str, to_stage: str, key: str, exc: ZmqOmniError) -> None:
        """Record a take whose item's shared-memory payload is gone or malformed (the item is gone too)."""
        what = "shared-memory payload of" if isinstance(exc, ShmError | DecodeError) else "get of"
        self._wiring.record_failure("get", from_stage, to_stage, key, f"{what} {key!r}: {exc}", exc)
