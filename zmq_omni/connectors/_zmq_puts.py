"""The send side of :class:`~zmq_omni.connectors.zmq.ZmqConnector`: ``put`` and ``try_put``.

A push-mode put goes to the sender's window (through shared memory when its
receiver reads ours); a put to an endpoint this process binds is expected there,
so that a get of it waits for it. A pull-mode put stores the payload in the bound
server until it is fetched.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import ClosedResourceError, MessageTooLargeError, TransportError, TransportTimeoutError, ZmqOmniError
from ..transport import WouldBlock
from ..wire import encode, frames_nbytes
from ._expected_puts import expect
from ._shared_endpoint import has_served
from ._zmq_parts import ZmqParts

#: Marks the metadata of our push-mode puts: a ``get`` handed it waits for that put to arrive.
PUSH_METADATA_TAG = "zmq_omni.push"


class ZmqSending(ZmqParts):
    """``put`` and ``try_put`` of a :class:`~zmq_omni.connectors.zmq.ZmqConnector` (see the module docstring)."""

    def _fail_put(self, from_stage: str, to_stage: str, key: str, error: ZmqOmniError) -> tuple[bool, int, None]:
        self._record_failure("put", from_stage, to_stage, key, str(error), error)
        return False, 0, None

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Send ``data`` to ``to_stage`` under ``put_key``; ``(True, nbytes, metadata)`` once ZeroMQ has it.

        Push mode returns when the put is in the send window and handed to
        ZeroMQ, not when it is acknowledged; a delivery that is never confirmed,
        or a put its receiver dropped unconsumed (its request cancelled there, or
        unclaimed past its ``unclaimed_ttl_s``), is reported later through
        :meth:`drain_failures` (a ``DeliveryError``; ``dropped`` says which). Large arrays are sent
        without copying and pinned until the receiver consumed them: do not
        modify them in place after ``put`` unless ``copy_on_put`` is set, or
        the put took the same-host fast path (its bytes were copied into
        shared memory; ``health()["shm_puts"]`` counts those).

        A pull-mode connector without a role, or with role ``receiver``, binds its
        server at its first put (joining the connector of this process bound there,
        if any); a push-mode ``receiver`` builds its sender then.

        Driven by an event loop, on the loop's thread: a put that finds no room
        fails at once (``await AsyncConnector.put`` waits for room).

        Raises:
            EncodeError: ``data`` holds an unsupported type (a programming error).
            ConfigError: a ``receiver``'s first put finds an endpoint it may not reach in plaintext
                (see ``docs/security.md``), or its bind finds other settings on that address.
            TransportError: a first put had to bind and the bind failed (the endpoint is named).
            RuntimeError: driven by an event loop, called on another thread than the loop's.
        """
        if self._can_wait():
            got = self._put(from_stage, to_stage, put_key, data, True)
        else:
            reason = "no room in the send window: a put on the thread of its event loop cannot wait for it"
            got = self._put_now(from_stage, to_stage, put_key, data, reason)
        assert got is not None
        return got

    def try_put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any, give_up: bool = False
    ) -> tuple[bool, int, dict[str, Any] | None] | None:
        """:meth:`put` without waiting for window room: None (nothing sent, nothing kept) when there is none.

        For callers that wait on an event loop: they retry when an
        :class:`~zmq_omni.connectors.base.ArrivalWatch` of :meth:`watch_arrivals`
        reports room. With ``give_up`` a full window fails the put as
        :meth:`put` does after ``put_timeout_s`` (a ``TransportTimeoutError``
        kept for the adapters). A put refused at ZeroMQ's high-water mark is
        None too. It may still wait, briefly, while another thread holds the
        peer's socket (bounded by ``put_timeout_s``). With ``shm: on`` the first
        put to a peer does not wait for its shared-memory verdict (it goes as frames).
        """
        if not give_up:
            try:
                return self._put(from_stage, to_stage, put_key, data, False)
            except WouldBlock:
                return None
        reason = "no room in the send window or ZeroMQ's queue within the caller's timeout"
        return self._put_now(from_stage, to_stage, put_key, data, reason)

    def _put_now(
        self, from_stage: str, to_stage: str, key: str, data: Any, reason: str
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """A put that never waits for room: without it, the put fails as a timeout saying ``reason``."""
        try:
            got = self._put(from_stage, to_stage, key, data, False)
        except WouldBlock:
            return self._fail_put(str(from_stage), str(to_stage), str(key), TransportTimeoutError(reason))
        assert got is not None
        return got

    def _put(
        self, from_stage: str, to_stage: str, key: str, data: Any, block: bool
    ) -> tuple[bool, int, dict[str, Any] | None] | None:
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        if self._closed:
            return self._fail_put(from_stage, to_stage, key, ClosedResourceError("connector closed"))
        self._check_sockets_here("put")
        cfg = self.settings
        sender = self._sender
        if sender is None and self._server is None:
            if cfg.mode == "push":  # a receiver putting downstream: its send side, built now
                sender = self._ensure_sender()
                if sender is None:
                    return self._fail_put(from_stage, to_stage, key, ClosedResourceError("connector closed"))
            else:
                self._ensure_bound(from_stage)
        frames = encode(data, inline_threshold=cfg.inline_threshold, allow_pickle=cfg.allow_pickle, limits=self._limits)
        nbytes = len(frames[0]) if len(frames) == 1 else frames_nbytes(frames)  # frame 0 is bytes
        if nbytes > cfg.max_message_bytes:
            return self._fail_put(
                from_stage,
                to_stage,
                key,
                MessageTooLargeError(f"put of {nbytes} bytes > max_message_bytes {cfg.max_message_bytes}"),
            )
        shm = self._shm_send
        loc = None if shm is None or nbytes < shm.threshold else self._to_shm(to_stage, frames, nbytes, block)
        if loc is None and cfg.copy_on_put and len(frames) > 1:
            frames = [frames[0], *(bytes(frame) for frame in frames[1:])]
        try:
            if sender is not None:
                # A put to an endpoint this process binds is expected there: a get of it waits for it.
                # Also before the bind when ours binds there at a first get (by whichever of ours binds).
                target = self._endpoints.get(to_stage)
                expected = None
                if target is not None and (has_served() or self._receiver is None):
                    until = time.monotonic() + cfg.metadata_get_timeout_s
                    unbound = self._receiver is None and self._bind_stage(to_stage) == to_stage
                    expected = expect(target, (from_stage, to_stage, key), until, unbound=unbound)
                try:
                    sender.send(from_stage, to_stage, key, frames, nbytes, loc, block=block)
                except BaseException:
                    if expected is not None:
                        expected.settle((from_stage, to_stage, key))
                    if loc is not None and shm is not None:
                        shm.discard(loc)
                    raise
                metadata: dict[str, Any] = {"key": key, "size": nbytes, "transport": PUSH_METADATA_TAG}
            else:
                server = self._server
                assert server is not None
                # The payload is ours in the shared store: our flush waits for it, its failures come back to us.
                metadata = server.store(from_stage, to_stage, key, frames, nbytes, block=block, owner=self)
        except TransportError as exc:
            return self._fail_put(from_stage, to_stage, key, exc)
        if self._put_failed_at is not None:  # puts go through again: health() need not wait degraded_hold_s
            self._put_failed_at = None
        return True, nbytes, metadata

    def _to_shm(self, to_stage: str, frames: list[Any], nbytes: int, block: bool = True) -> bytes | None:
        """Write a large payload into a slot for a same-host receiver; the packed handle, or None (frames)."""
        shm, sender = self._shm_send, self._sender
        if shm is None or sender is None or nbytes < shm.threshold:
            return None
        wait_s = self.settings.put_timeout_s if self.settings.shm == "on" and block else 0.0
        if shm.probe is None or not sender.reads_shm(to_stage, wait_s):
            return None
        loc = shm.write(frames)
        if loc is None:
            self._counters.add("shm_fallbacks")
            self._shm_degraded = True
        else:
            self._counters.add("shm_puts")
            self._shm_degraded = False
        return loc


def announces(metadata: Any, key: str) -> bool:
    """True when ``metadata`` is what one of our push-mode puts of ``key`` returned (or vllm-omni's ``{key: it}``)."""
    if not isinstance(metadata, dict):
        return False
    inner = metadata.get(key)
    if isinstance(inner, dict):
        metadata = inner
    return bool(metadata.get("transport") == PUSH_METADATA_TAG and metadata.get("key") == key)
