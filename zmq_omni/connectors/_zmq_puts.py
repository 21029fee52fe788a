"""``Sending``: the send side of a :class:`~zmq_omni.connectors.zmq.ZmqConnector`: ``put`` and ``try_put``.

What it owns: the push sender (its send window, peers and I/O), the push sender's
shared-memory pool, whether the last large put found no slot, and when a put last
failed (``health()`` reports it until a put goes through or ``degraded_hold_s`` passed).

A push-mode put goes to the sender's window (through shared memory when its
receiver reads ours); a put to an endpoint this process binds is expected there,
so that a get of it waits for it. A pull-mode put stores the payload in the
``Bound`` part's server until it is fetched (binding it at the first put).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..errors import (
    ClosedResourceError,
    DeliveryError,
    MessageTooLargeError,
    TransportError,
    TransportTimeoutError,
    ZmqOmniError,
)
from ..transport import PushSender, ShmSend, WouldBlock
from ..wire import encode, frames_nbytes
from ._expected_puts import expect
from ._shared_endpoint import has_served
from ._zmq_bind import shm_pool
from ._zmq_bound import Bound
from ._zmq_parts import Wiring

log = logging.getLogger("zmq_omni.connectors")

#: Marks the metadata of our push-mode puts: a ``get`` handed it waits for that put to arrive.
PUSH_METADATA_TAG = "zmq_omni.push"

PutResult = tuple[bool, int, dict[str, Any] | None]


class Sending:
    """The send side of one connector (see the module docstring); ``sender`` is None until built.

    Args:
        wiring: the connector's shared settings and rules.
        bound: the connector's bound part (pull mode stores there; push mode asks whether it is bound).
    """

    def __init__(self, wiring: Wiring, bound: Bound) -> None:
        self._wiring = wiring
        self._bound = bound
        self.sender: PushSender | None = None
        self.shm: ShmSend | None = None  # the push sender's pool (the bound pull server's is the endpoint's)
        self.shm_degraded = False  # the last large put found no shared-memory slot
        #: When a put last failed (None: one succeeded since), and why: written by put threads and the failure
        #: callback without a lock, so health() may pair one failure's time with another's text (a hint only).
        self.failed_at: float | None = None
        self.failure = ""

    # -- the sender ---------------------------------------------------------------------
    def start(self) -> None:
        """Build the push sender at construction and meet the receivers it can name (see :meth:`_meet_receivers`)."""
        self.sender = self._build_sender()
        self._meet_receivers()

    def _build_sender(self) -> PushSender:
        """The push sender and its shared-memory pool (in the constructor, or on the I/O thread)."""
        wiring = self._wiring
        cfg, driver = wiring.settings, wiring.driver
        assert driver is not None
        if cfg.shm != "off" and self.shm is None:
            self.shm = shm_pool(cfg, driver)
        return PushSender(
            driver,
            wiring.endpoints,
            sid=wiring.sid,
            put_timeout_s=cfg.put_timeout_s,
            delivery_timeout_s=cfg.delivery_timeout_s,
            heartbeat_s=cfg.heartbeat_s,
            peer_timeout_s=cfg.peer_timeout_s,
            max_unacked=cfg.max_unacked,
            max_unacked_bytes=cfg.max_unacked_bytes,
            hwm=cfg.hwm,
            counters=wiring.counters,
            on_failure=wiring.on_failure,
            curve=wiring.curve,
            shm=self.shm,
            batch_max_messages=cfg.batch_max_messages,
            batch_max_bytes=cfg.batch_max_bytes,
            batch_item_bytes=cfg.inline_threshold,
        )

    def _meet_receivers(self) -> None:
        """Have a sender built at construction connect to its receivers now, to learn their shm verdicts.

        The receivers it can name: ``to_stage`` when configured; else, for a ``sender`` or ``dual``
        connector (vllm-omni injects no ``to_stage``), every other stage of ``endpoints``. Never the
        stage it binds itself: a connector with no role and no ``stage_id`` binds ``to_stage`` in
        push mode, so it meets nobody. A put right after start then finds the verdict (and a slot)
        ready; see ``transport/_shm.py``. A stage it cannot reach yet (no endpoint, a socket ZeroMQ
        cannot make) is left to its first put, which reports that as it always does.

        Not over CURVE: CURVE is the path off the host, where no receiver can read our shared memory,
        and a stage whose allow-list leaves us out (one we never put to) would refuse the handshake
        and log it at every start.
        """
        wiring, sender = self._wiring, self.sender
        cfg = wiring.settings
        if sender is None or self.shm is None or self.shm.probe is None or wiring.curve is not None:
            return
        if cfg.to_stage is not None:
            stages = [cfg.to_stage]
        elif cfg.role in ("sender", "dual"):
            stages = wiring.endpoints.stages()
        else:
            return
        own = {wiring.bind_stage(None), cfg.from_stage}
        for stage in stages:
            if stage in own:
                continue
            try:
                sender.meet(stage)
            except ZmqOmniError as exc:  # ConfigError (no endpoint) or TransportError (no socket)
                log.debug("not meeting stage %s before a put to it: %s", stage, exc)

    def _ensure_sender(self) -> PushSender | None:
        """The push sender, built at the first put of a connector whose role is ``receiver``; None once closed.

        Raises:
            ConfigError: an endpoint it would connect to is plaintext TCP off the host (see ``docs/security.md``).
        """
        wiring = self._wiring
        with wiring.build_lock:
            if self.sender is None and not wiring.closed:
                wiring.require_reachable(list(wiring.endpoints.items()))
                self.sender = wiring.on_driver(self._build_sender)
                if wiring.watched:
                    self.hook_watches()
        return self.sender

    def hook_watches(self) -> None:
        """Point the send window's room signal at the watches."""
        if self.sender is not None:
            self.sender.on_window_change(self._wiring.notify_room)

    # -- put ------------------------------------------------------------------------------
    def _fail(self, from_stage: str, to_stage: str, key: str, error: ZmqOmniError) -> PutResult:
        self._wiring.record_failure("put", from_stage, to_stage, key, str(error), error)
        return False, 0, None

    def note_failure(self, to_stage: str, key: str, reason: str, error: ZmqOmniError | None) -> None:
        """A put failed (now, or later its delivery): ``health()`` is degraded until a put goes through.

        A put its receiver dropped because it cancelled the request says nothing about the link: not noted.
        """
        if isinstance(error, DeliveryError) and error.dropped == "cancelled":
            return
        self.failure = f"put of {key!r} to stage {to_stage!r} failed: {reason}"
        self.failed_at = time.monotonic()

    def put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        """The connector's ``put`` (see :meth:`~zmq_omni.connectors.zmq.ZmqConnector.put`)."""
        if self._wiring.can_wait():
            got = self._put(from_stage, to_stage, key, data, True)
        else:
            reason = "no room in the send window: a put on the thread of its event loop cannot wait for it"
            got = self._put_now(from_stage, to_stage, key, data, reason)
        assert got is not None
        return got

    def try_put(self, from_stage: str, to_stage: str, key: str, data: Any, give_up: bool) -> PutResult | None:
        """The connector's ``try_put`` (see :meth:`~zmq_omni.connectors.zmq.ZmqConnector.try_put`)."""
        if not give_up:
            try:
                return self._put(from_stage, to_stage, key, data, False)
            except WouldBlock:
                return None
        reason = "no room in the send window or ZeroMQ's queue within the caller's timeout"
        return self._put_now(from_stage, to_stage, key, data, reason)

    def _put_now(self, from_stage: str, to_stage: str, key: str, data: Any, reason: str) -> PutResult:
        """A put that never waits for room: without it, the put fails as a timeout saying ``reason``."""
        try:
            got = self._put(from_stage, to_stage, key, data, False)
        except WouldBlock:
            return self._fail(str(from_stage), str(to_stage), str(key), TransportTimeoutError(reason))
        assert got is not None
        return got

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any, block: bool) -> PutResult | None:
        if type(from_stage) is not str or type(to_stage) is not str or type(key) is not str:
            from_stage, to_stage, key = str(from_stage), str(to_stage), str(key)
        wiring, bound = self._wiring, self._bound
        if wiring.closed:
            return self._fail(from_stage, to_stage, key, ClosedResourceError("connector closed"))
        wiring.check_sockets_here("put")
        cfg = wiring.settings
        sender = self.sender
        if sender is None and bound.server is None:
            if cfg.mode == "push":  # a receiver putting downstream: its send side, built now
                sender = self._ensure_sender()
                if sender is None:
                    return self._fail(from_stage, to_stage, key, ClosedResourceError("connector closed"))
            else:
                bound.ensure_bound(from_stage)
        frames = encode(
            data, inline_threshold=cfg.inline_threshold, allow_pickle=cfg.allow_pickle, limits=wiring.limits
        )
        nbytes = len(frames[0]) if len(frames) == 1 else frames_nbytes(frames)  # frame 0 is bytes
        if nbytes > cfg.max_message_bytes:
            error = MessageTooLargeError(f"put of {nbytes} bytes > max_message_bytes {cfg.max_message_bytes}")
            return self._fail(from_stage, to_stage, key, error)
        shm = self.shm
        loc = None if shm is None or nbytes < shm.threshold else self._to_shm(to_stage, frames, nbytes, block)
        if loc is None and cfg.copy_on_put and len(frames) > 1:
            frames = [frames[0], *(bytes(frame) for frame in frames[1:])]
        try:
            if sender is not None:
                # A put to an endpoint this process binds is expected there: a get of it waits for it.
                # Also before the bind when ours binds there at a first get (by whichever of ours binds).
                target = wiring.endpoints.get(to_stage)
                expected = None
                if target is not None and (has_served() or bound.receiver is None):
                    until = time.monotonic() + cfg.metadata_get_timeout_s
                    unbound = bound.receiver is None and wiring.bind_stage(to_stage) == to_stage
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
                metadata = bound.store(from_stage, to_stage, key, frames, nbytes, block=block)
        except TransportError as exc:
            return self._fail(from_stage, to_stage, key, exc)
        if self.failed_at is not None:  # puts go through again: health() need not wait degraded_hold_s
            self.failed_at = None
        return True, nbytes, metadata

    def _to_shm(self, to_stage: str, frames: list[Any], nbytes: int, block: bool = True) -> bytes | None:
        """Write a large payload into a slot for a same-host receiver; the packed handle, or None (frames)."""
        shm, sender = self.shm, self.sender
        if shm is None or sender is None or nbytes < shm.threshold:
            return None
        cfg = self._wiring.settings
        wait_s = cfg.put_timeout_s if cfg.shm == "on" and block else 0.0
        if shm.probe is None or not sender.reads_shm(to_stage, wait_s):
            return None
        loc = shm.write(frames)
        if loc is None:
            self._wiring.counters.add("shm_fallbacks")
            self.shm_degraded = True
        else:
            self._wiring.counters.add("shm_puts")
            self.shm_degraded = False
        return loc

    # -- after the put --------------------------------------------------------------------
    def wait_delivered(self, timeout_s: float) -> bool | None:
        """Push mode: wait until every put so far is confirmed (True) or ``timeout_s``; None without a sender."""
        return None if self.sender is None else self.sender.wait_delivered(timeout_s)

    def forget(self, match: Callable[[str], bool]) -> None:
        """A cleanup: release our copies of delivered puts that match (puts on their way go on, #6670)."""
        if self.sender is not None:
            self.sender.forget(match)

    def stats(self) -> dict[str, Any] | None:
        """The push sender's counts and state (None without one)."""
        return None if self.sender is None else self.sender.stats()

    def close(self) -> list[str]:
        """Fail waiting puts and report what is unconfirmed: the keys lost (the pool closes with :meth:`close_pool`)."""
        return [] if self.sender is None else self.sender.close()

    def close_pool(self) -> None:
        """Close the shared-memory pool (once the driver stopped: nothing writes it any more)."""
        if self.shm is not None:
            self.shm.close()


def announces(metadata: Any, key: str) -> bool:
    """True when ``metadata`` is what one of our push-mode puts of ``key`` returned (or vllm-omni's ``{key: it}``)."""
    if not isinstance(metadata, dict):
        return False
    inner = metadata.get(key)
    if isinstance(inner, dict):
        metadata = inner
    return bool(metadata.get("transport") == PUSH_METADATA_TAG and metadata.get("key") == key)
