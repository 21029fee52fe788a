"""``HealthReport``: ``health()`` of a :class:`~zmq_omni.connectors.zmq.ZmqConnector`.

Counters, state, and why it is degraded.

What it owns: the receiver's drops last seen (``dropped_unclaimed`` keeps the connector
degraded for ``degraded_hold_s`` after it grows). Everything else it reads from the
other parts: the ``Sending`` part's stats and last put failure (a failed put keeps the
connector degraded for ``degraded_hold_s`` unless a put succeeds meanwhile), the
``Bound`` part's receiver or server and its endpoint's counters, the ``Fetching``
part's shared-memory verdicts. The reasons and the fields are listed in
``docs/zmq-connector.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ._zmq_bound import Bound
from ._zmq_parts import Wiring
from ._zmq_pull import Fetching
from ._zmq_puts import Sending


class HealthReport:
    """The health report of one connector (see the module docstring).

    Args:
        wiring: the connector's shared settings and counters.
        sending, bound, fetching: the parts it reports on.
        stage_id: the connector's stage id, as given.
        counted: the connector's status and counters (``OmniConnectorBase.health``), read after the
            transport's own counts were folded into the counters.
    """

    def __init__(
        self,
        wiring: Wiring,
        sending: Sending,
        bound: Bound,
        fetching: Fetching,
        *,
        stage_id: Any,
        counted: Callable[[], dict[str, Any]],
    ) -> None:
        self._wiring = wiring
        self._sending = sending
        self._bound = bound
        self._fetching = fetching
        self._stage_id = stage_id
        self._counted = counted
        # Written by whichever thread runs health() (a user's, or the endpoint's I/O thread answering a HEALTH
        # probe), without a lock: two at once may keep either's view; the next call corrects it (a hint only).
        self._unclaimed_seen = 0  # the receiver's dropped_unclaimed last seen
        self._unclaimed_at = 0.0  # when it last grew

    def health(self) -> dict[str, Any]:
        """Status, counters (puts, gets, bytes, errors, timeouts, resends, rejected_frames, ...) and state."""
        counters, bound = self._wiring.counters, self._bound
        # Hot-path counts live under the locks the transport already holds; fold them in here.
        sending = self._sending.stats()
        if sending is None and bound.server is not None:
            sending = bound.server.stats()
        receiver = bound.receiver
        receiving = None if receiver is None else receiver.stats()
        if sending is not None:
            counters.set("puts", sending["puts"])
            counters.set("bytes_sent", sending["bytes_sent"])
            if "batches_sent" in sending:
                counters.set("batches_sent", sending["batches_sent"])
        if receiving is not None:
            counters.set("gets", receiving["gets"])
            counters.set("bytes_received", receiving["bytes_received"])
            counters.set("batches_received", receiving["batches_received"])
        base = self._counted()
        if bound.shared is not None:  # what the bound part counted (shared by the connectors bound there)
            for name, value in bound.shared.counters.snapshot().items():
                base[name] = base.get(name, 0) + value
        for name in (
            "resends",
            "rejected_frames",
            "rejected_keys",
            "duplicates_dropped",
            "stale_resends_dropped",
            "delivery_failures",
        ):
            base.setdefault(name, 0)
        if (
            self._sending.sender is not None
        ):  # what its receivers dropped unconsumed (and acknowledged, freeing the window)
            for name in ("receiver_dropped_unclaimed", "receiver_dropped_cancelled"):
                base.setdefault(name, 0)
        cfg = self._wiring.settings
        base.update({"stage_id": self._stage_id, "role": cfg.role, "mode": cfg.mode, "endpoint": bound.endpoint})
        base["pending"] = 0 if sending is None else sending["pending"]
        if sending is not None:
            base["pending_bytes"] = sending["pending_bytes"]
            for name in ("undelivered", "peers"):
                if name in sending:
                    base[name] = sending[name]
        if receiving is not None and receiver is not None:
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
            base["incarnation"] = receiver.incarnation
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
        cfg, now = self._wiring.settings, time.monotonic()
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
        failed_at = self._sending.failed_at
        if failed_at is not None and now - failed_at < cfg.degraded_hold_s:
            problems.append(f"{self._sending.failure} ({now - failed_at:.1f}s ago; no put succeeded since)")
        return problems

    def _shm_health(self, base: dict[str, Any]) -> None:
        """The fast path's state: policy, pool, fallbacks, verdicts; ``degraded`` while large transfers cannot use it.

        Degraded: our pool cannot take large puts, or, with ``shm: on``, a receiver we put to cannot read
        our shared memory (push) or we cannot read a server's (pull).
        """
        cfg = self._wiring.settings
        base["shm"] = cfg.shm
        for name in ("shm_puts", "shm_fallbacks", "shm_stale"):
            base.setdefault(name, 0)
        problems = []
        servers = self._fetching.shm_verdicts()  # a pull receiver learns each server's verdict from its first reply
        if servers is not None:
            base["shm_servers"] = servers
            unread = sorted(endpoint for endpoint, readable in servers.items() if not readable)
            if unread and cfg.shm == "on":
                problems.append(f"we cannot read the shared memory of pull servers {unread}: their replies are frames")
        shm = self._sending.shm  # a push sender's pool, or the bound pull server's
        if shm is None and self._bound.shared is not None:
            shm = self._bound.shared.shm_send
        if shm is not None:
            base.update({f"shm_{k}": v for k, v in shm.stats().items()})
            if shm.error is not None:
                problems.append(shm.error)
            if self._sending.shm_degraded:
                problems.append(
                    "large puts fall back to frames: no shared-memory slot (shm_dir full or pool at its limit)"
                )
            if cfg.shm == "on":
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
