"""Gets of :class:`~zmq_omni.connectors.zmq.ZmqConnector`: from the push receiver's mailbox, or fetched.

Push mode takes from the mailbox of the bound receiver (shared with the other
connectors of this process bound there), waiting on its condition when the call
may wait, and for a put of this very key this process has on its way there. A
wait ends at its deadline, at an arrival of its key, at the endpoint's seal, or
when this connector closes (its close wakes the mailbox's waiters, each of which
checks its own connector): no wait is cut into time slices. Pull
mode fetches from the sender (see ``_zmq_pull``). Arrivals can also be watched
(:meth:`ZmqGets.watch_arrivals`) or waited for (:meth:`ZmqGets.wait_for_change`).
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import DecodeError, ShmError, TransportTimeoutError, ZmqOmniError
from ._zmq_pull import ZmqPullFetch
from ._zmq_puts import announces
from .arrivals import ArrivalWatch
from .base import bounded_deadline, bounded_timeout


class ZmqGets(ZmqPullFetch):
    """``get`` and its kin, and the arrival watches, of a :class:`~zmq_omni.connectors.zmq.ZmqConnector`."""

    def watch_arrivals(self) -> ArrivalWatch:
        """A watch notified when items reach the push receiver's mailbox, when window room frees, and at close.

        A pull-mode receiver's items never arrive by themselves: wait for them on a
        :class:`FetchChannel` instead (see :meth:`open_fetch_channel`).
        """
        watch = self._register_watch(ArrivalWatch())
        self._hook_watches()
        return watch

    def get_wakeup_generation(self) -> int | None:
        """A counter that changes whenever items arrive in the push receiver's mailbox.

        None when this connector has no push receiver (pull mode or a sender): nothing
        arrives by itself there, so callers should wait in ``get_with_deadline``
        (pull mode's server-side long poll) instead of :meth:`wait_for_change`.
        """
        receiver = self._receiver
        return None if receiver is None else receiver.generation()

    def wait_for_change(self, gen: int, *, timeout: float) -> int:
        """Wait until the wakeup generation differs from ``gen`` (at most ``timeout``); return it then.

        Waits on the mailbox condition (no polling); returns ``gen`` unchanged after
        a timeout or ``close()``. Without a push receiver it waits ``timeout`` (or until closed).

        Raises:
            RuntimeError: driven by an event loop, a wait on the loop's own thread (or while no loop runs it).
        """
        timeout = bounded_timeout(timeout)
        if timeout > 0 and not self._can_wait():
            raise self._refuse_wait("wait_for_change", "the AsyncConnector's awaited get")
        receiver = self._receiver
        if receiver is not None:
            return receiver.wait_for_change(gen, timeout, self._is_closed)
        if not self._closed:
            self._idle.wait(timeout)
        return gen

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Take the object put under ``get_key``: ``(obj, nbytes)``, or None when it is not there (yet).

        Push mode: without metadata (or with metadata that is not ours, such as
        vllm-omni's ``{source_host, source_port}`` hints) it never waits. With the
        metadata one of our puts returned it waits up to ``metadata_get_timeout_s``
        for that put to arrive, and records a timeout failure if it does not
        (vllm-omni's orchestrator hands a stage that metadata and calls ``get`` once).
        Pull mode asks the sender (one round trip; at most ``fetch_timeout_s``
        when the sender does not answer). A connector without a role binds at its
        first push-mode ``get``.

        Driven by an event loop, on the loop's thread a push-mode ``get`` never
        waits, with metadata or not (``await AsyncConnector.get`` waits).

        Raises:
            RuntimeError: driven by an event loop, a pull-mode get (a round trip the loop does:
                await it), or a first get that binds, off the loop's thread.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if not self._can_wait():
            return self._get(from_stage, to_stage, key, metadata, None, wait_for_own=False)
        if metadata is not None and self._receiver_or_bind(to_stage) and announces(metadata, key):
            deadline = time.monotonic() + self.settings.metadata_get_timeout_s
            got = self._get(from_stage, to_stage, key, metadata, deadline)
            if got is None and not self._closed:
                self._record_failure(
                    "get",
                    from_stage,
                    to_stage,
                    key,
                    f"the put of {key!r} its metadata announced did not arrive within "
                    f"metadata_get_timeout_s={self.settings.metadata_get_timeout_s}s",
                    TransportTimeoutError(f"put of {key!r} not arrived", endpoint=self.endpoint),
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
        """Like :meth:`get`, waiting (on a condition, or a server-side long poll) until ``deadline``.

        Raises:
            RuntimeError: driven by an event loop, a deadline ahead on the loop's own thread (or while
                no loop runs it): ``await AsyncConnector.get(..., timeout=...)`` waits there.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        deadline = bounded_deadline(deadline)
        if not self._can_wait():
            if deadline > time.monotonic():
                raise self._refuse_wait("get_with_deadline", "await AsyncConnector.get(..., timeout=...)")
            return self._get(from_stage, to_stage, key, metadata, None, wait_for_own=False)
        return self._get(from_stage, to_stage, key, metadata, deadline)

    def _receiver_or_bind(self, to_stage: str) -> bool:
        """True when gets go to a push receiver, binding it first for a connector that binds lazily.

        A push-mode ``sender`` that gets binds its own stage's endpoint (``stage_id``, else its
        ``from_stage``), joining the connector of this process already bound there, if any.
        """
        if self._receiver is None and self.settings.mode == "push" and not self._closed:
            self._ensure_bound(to_stage)
        return self._receiver is not None

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
        if self._closed:
            return None
        if self._receiver is None and self._client is None:
            if self.settings.mode == "push":
                self._receiver_or_bind(to_stage)
            elif self._ensure_client() is None:  # a pull-mode sender's first get; None: closed meanwhile
                return None
        if self._receiver is not None:  # push-mode gets are counted by the mailbox
            return self._take(from_stage, to_stage, key, deadline, wait_for_own=wait_for_own)
        got = self._fetch(from_stage, to_stage, key, metadata, deadline)
        if got is not None:
            self._counters.add("gets")
            self._counters.add("bytes_received", got[1])
        return got

    def get_nowait(self, from_stage: str, to_stage: str, get_key: str) -> tuple[Any, int] | None:
        """``get`` by key that never waits, not even for a put of this key this process has on its way here.

        An addition to the contract: ``get`` waits for such a put (bounded by its window), which
        would hold up a caller that waits otherwise (``AsyncConnector``'s gets wait on their loop
        and look with this). Push mode; in pull mode (a round trip to the sender) it is :meth:`get`.
        """
        key = get_key
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if self._closed:
            return None
        if self._receiver is None and self._client is None:
            self._receiver_or_bind(to_stage)
        if self._receiver is None:
            return self._get(from_stage, to_stage, key, None, None, wait_for_own=False)
        return self._take(from_stage, to_stage, key, None, wait_for_own=False)

    def _take(
        self, from_stage: str, to_stage: str, key: str, deadline: float | None, *, wait_for_own: bool = True
    ) -> tuple[Any, int] | None:
        """A push-mode get from the receiver's mailbox (waiting until ``deadline``, if given); failures recorded.

        Without a deadline it never waits, except for a put of this very key that this process
        made and that has not arrived yet: it waits for that one, until its window ends.
        """
        receiver, shared = self._receiver, self._shared
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
                            return self._closed or slot not in slots

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
        return self._closed

    def _take_failed(self, from_stage: str, to_stage: str, key: str, exc: ZmqOmniError) -> None:
        """Record a take whose item's shared-memory payload is gone or malformed (the item is gone too)."""
        what = "shared-memory payload of" if isinstance(exc, ShmError | DecodeError) else "get of"
        self._record_failure("get", from_stage, to_stage, key, f"{what} {key!r}: {exc}", exc)
