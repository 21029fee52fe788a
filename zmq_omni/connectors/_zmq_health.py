"""``health()`` of :class:`~zmq_omni.connectors.zmq.ZmqConnector`: counters, state, and why it is degraded.

The reasons and the fields are listed in ``docs/zmq-connector.md``. A failed put
keeps the connector degraded for ``degraded_hold_s`` unless a put succeeds
meanwhile (``_record_failure`` notes it; a put that goes through clears it).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from ..errors import DeliveryError, ZmqOmniError
from ._zmq_parts import ZmqParts


class ZmqHealth(ZmqParts):
    """The health report of a :class:`~zmq_omni.connectors.zmq.ZmqConnector` (see the module docstring)."""

    def _record_failure(
        self,
        op: Literal["put", "get"],
        from_stage: str,
        to_stage: str,
        key: str,
        reason: str,
        error: ZmqOmniError | None = None,
    ) -> None:
        """Keep the failure (see the base class); a failed put also makes ``health()`` degraded for a while."""
        super()._record_failure(op, from_stage, to_stage, key, reason, error)
        # A put its receiver dropped because it cancelled the request says nothing about the link.
        cancelled = isinstance(error, DeliveryError) and error.dropped == "cancelled"
        if op == "put" and not self._closed and not cancelled:
            self._put_failure = f"put of {key!r} to stage {to_stage!r} failed: {reason}"
            self._put_failed_at = time.monotonic()

    def health(self) -> dict[str, Any]:
        """Status, counters (puts, gets, bytes, errors, timeouts, resends, rejected_frames, ...) and state."""
        # Hot-path counts live under the locks the transport already holds; fold them in here.
        sending = self._sender.stats() if self._sender else self._server.stats() if self._server else None
        receiving = self._receiver.stats() if self._receiver else None
        if sending is not None:
            self._counters.set("puts", sending["puts"])
            self._counters.set("bytes_sent", sending["bytes_sent"])
            if "batches_sent" in sending:
                self._counters.set("batches_sent", sending["batches_sent"])
        if receiving is not None:
            self._counters.set("gets", receiving["gets"])
            self._counters.set("bytes_received", receiving["bytes_received"])
            self._counters.set("batches_received", receiving["batches_received"])
        base = super().health()
        if self._shared is not None:  # what the bound part counted (shared by the connectors bound there)
            for name, value in self._shared.counters.snapshot().items():
                base[name] = base.get(name, 0) + value
        for name in ("resends", "rejected_frames", "rejected_keys", "duplicates_dropped", "delivery_failures"):
            base.setdefault(name, 0)
        if self._sender is not None:  # what its receivers dropped unconsumed (and acknowledged, freeing the window)
            for name in ("receiver_dropped_unclaimed", "receiver_dropped_cancelled"):
                base.setdefault(name, 0)
        cfg = self.settings
        base.update({"stage_id": self.stage_id, "role": cfg.role, "mode": cfg.mode, "endpoint": self.endpoint})
        base["pending"] = 0 if sending is None else sending["pending"]
        if sending is not None:
            base["pending_bytes"] = sending["pending_bytes"]
            for name in ("undelivered", "peers"):
                if name in sending:
                    base[name] = sending[name]
        if receiving is not None and self._receiver is not None:
            for name in (
                "mailbox",
                "mailbox_oldest_s",
                "tombstones",
                "dropped_unclaimed",
                "dropped_late",
                "dropped_cleanup",
                "tombstones_evicted",
            ):
                base[name] = receiving[name]
            base.setdefault("acks_dropped", 0)  # REPLYs ZeroMQ could not route (their content waits for the next)
            base.setdefault("acks_given_up", 0)  # ...arrivals such REPLYs named once 4 in a row to one sender failed
            base["incarnation"] = self._receiver.incarnation
        reasons = self._reasons(sending, receiving)
        if reasons:
            base["reasons"] = reasons
            if base["status"] == "ok":
                base["status"] = "degraded"
        self._shm_health(base)
        return base

    def _reasons(self, sending: dict[str, Any] | None, receiving: dict[str, Any] | None) -> list[str]:
        """Why ``health()`` is degraded now (empty: it is not); see ``docs/zmq-connector.md``.

        A full send window (or pull store), a window nearly full for five heartbeats, items
        unclaimed for half of ``unclaimed_ttl_s``, items dropped unclaimed within
        ``degraded_hold_s``, and a put that failed within ``degraded_hold_s`` with none
        succeeding since.
        """
        cfg, now = self.settings, time.monotonic()
        problems = []
        if sending is not None:
            if sending.get("window_full"):
                problems.append(
                    f"send window full ({sending['pending']} puts, {sending['pending_bytes']} bytes unconsumed; "
                    f"max_unacked={cfg.max_unacked}, max_unacked_bytes={cfg.max_unacked_bytes})"
                )
            elif sending.get("window_high_s", 0.0) >= 5 * cfg.heartbeat_s:
                problems.append(
                    f"send window nearly full for {sending['window_high_s']:.1f}s "
                    f"({sending['pending']} puts, {sending['pending_bytes']} bytes unconsumed)"
                )
        if receiving is not None:
            # Late arrivals under a tombstone are the expected end of a cancelled stream: counted, not degraded.
            dropped = receiving["dropped_unclaimed"]
            if dropped > self._unclaimed_seen:
                self._unclaimed_seen, self._unclaimed_at = dropped, now
            if self._unclaimed_at and now - self._unclaimed_at < cfg.degraded_hold_s:
                problems.append(
                    f"{dropped} items dropped unclaimed after unclaimed_ttl_s={cfg.unclaimed_ttl_s}s "
                    f"(the last {now - self._unclaimed_at:.1f}s ago)"
                )
            if receiving["mailbox_oldest_s"] >= cfg.unclaimed_ttl_s / 2:
                problems.append(
                    f"an item waits unclaimed for {receiving['mailbox_oldest_s']:.1f}s "
                    f"(dropped at unclaimed_ttl_s={cfg.unclaimed_ttl_s}s)"
                )
        failed_at = self._put_failed_at
        if failed_at is not None and now - failed_at < cfg.degraded_hold_s:
            problems.append(f"{self._put_failure} ({now - failed_at:.1f}s ago; no put succeeded since)")
        return problems

    def _shm_health(self, base: dict[str, Any]) -> None:
        """The fast path's state: policy, pool, fallbacks, verdicts; ``degraded`` while large transfers cannot use it.

        Degraded: our pool cannot take large puts, or, with ``shm: on``, a receiver we put to cannot read
        our shared memory (push) or we cannot read a server's (pull).
        """
        base["shm"] = self.settings.shm
        for name in ("shm_puts", "shm_fallbacks", "shm_stale"):
            base.setdefault(name, 0)
        problems = []
        if self._client is not None and self._shm_receive is not None:
            # A pull receiver learns each server's verdict from its first reply.
            servers = self._client.shm_verdicts()
            base["shm_servers"] = servers
            unread = sorted(endpoint for endpoint, readable in servers.items() if not readable)
            if unread and self.settings.shm == "on":
                problems.append(f"we cannot read the shared memory of pull servers {unread}: their replies are frames")
        shm = self._shm_send  # a push sender's pool, or the bound pull server's
        if shm is None and self._shared is not None:
            shm = self._shared.shm_send
        if shm is not None:
            base.update({f"shm_{k}": v for k, v in shm.stats().items()})
            if shm.error is not None:
                problems.append(shm.error)
            if self._shm_degraded:
                problems.append(
                    "large puts fall back to frames: no shared-memory slot (shm_dir full or pool at its limit)"
                )
            if self.settings.shm == "on":
                # Only stages we put to: a sender meets every stage it can name as it is built (for the
                # verdict before its first put), among them stages it never sends to, which may well be
                # on another host.
                peers = base.get("peers", {}).items()
                refused = [stage for stage, p in peers if p.get("shm") is False and p.get("puts")]
                if refused:
                    problems.append(f"receivers of stages {refused} cannot read our shared memory")
        if problems:
            base["shm_problems"] = problems
            base.setdefault("reasons", []).extend(problems)
            if base["status"] == "ok":
                base["status"] = "degraded"
