"""Push mode: confirmed delivery from senders (DEALER) to a receiver's ROUTER.

Socket layout, per (sender connector, receiving stage):

* a **data** DEALER (identity ``d<sid>``) carries DATA and PING messages. Any
  put thread may send on it, one at a time under the peer's ``data_lock``;
  nothing is ever received on it;
* a **control** DEALER (identity ``c<sid>``), owned by the I/O thread, receives
  the receiver's REPLY messages (acknowledgements and pongs);
* the receiver binds one ROUTER, owned by its I/O thread.

Why DEALER/ROUTER rather than PUSH/PULL plus a separate ack channel: the
receiver can answer on the same endpoint it binds (senders need no endpoint
of their own), a DEALER blocks at its high-water mark exactly like PUSH, and
the ROUTER learns who sent what. Why a second DEALER: the I/O thread must
poll for acknowledgements while put threads send, and a ZeroMQ socket may not
be polled and sent on concurrently.

Delivery protocol (seq numbers are per sender and receiving stage):

1. The receiver acknowledges **arrival** (cumulative, batched per drain of its
   socket) and **consumption** (when ``get`` takes the item, or a re-put or
   ``cleanup`` drops it). Arrival stops the delivery deadline; consumption
   frees the sender's copy. Items dropped unconsumed (``unclaimed_ttl_s``, a
   tombstone, ``cleanup``) are acknowledged in a REPLY of their own whose ``n``
   says why (``DROPPED_UNCLAIMED``, ``DROPPED_CANCELLED``), then repeated as
   consumed in pongs like any other consumption. The sender reports each put
   it still retains that such a REPLY names as failed (a
   :class:`~zmq_omni.errors.DeliveryError` whose ``dropped`` says why): it
   returned ok, but nothing will read it.
2. Every ``heartbeat_s`` the sender sends PING ``n`` on the data DEALER, behind
   the data it already sent. The receiver flushes its acks and answers with a
   pong naming ``n`` and its incarnation id. ZeroMQ keeps per-connection
   order, so a message sent before ping ``n`` and still unacknowledged when
   pong ``n`` arrives was lost on a broken connection: it is resent.
3. A new incarnation id means a new receiver process/connector: everything
   not yet consumed is sent again; the new receiver de-duplicates by
   ``(sid, seq)``. A resend names the incarnation it is sent for, and any
   other incarnation drops it unread: one still queued on the data DEALER when
   its receiver closed may have been delivered there, and the next receiver
   has no dedupe state for it (it is sent again once that one is heard). The
   only duplicates an application can see are items the old receiver handed
   to ``get`` whose consumption ack was lost with it.
4. A receiver silent for ``peer_timeout_s`` is presumed gone: what it held
   unconsumed becomes undelivered again, with a fresh delivery deadline.
5. Undelivered past its deadline: the put is reported as failed (a
   :class:`~zmq_omni.errors.DeliveryError`), forgotten, and the data DEALER is
   recreated so ZeroMQ's queue cannot deliver it later.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ZmqOmniError

__all__ = ["DROPPED_CANCELLED", "DROPPED_UNCLAIMED", "DROP_COUNTERS", "FailureCallback"]

# A REPLY whose ``n`` is one of these is a plain acknowledgement whose consumed seqs the receiver
# dropped unconsumed, and why. A sender of an older version takes any negative ``n`` for a plain
# acknowledgement, so it frees its window all the same; a current one also counts them.
DROPPED_UNCLAIMED = -2  # no get took them within unclaimed_ttl_s
DROPPED_CANCELLED = -3  # cleanup, cleanup_prefix or abandon_get dropped them, or a tombstone did on arrival
#: The sender's counter for each code.
DROP_COUNTERS = {DROPPED_UNCLAIMED: "receiver_dropped_unclaimed", DROPPED_CANCELLED: "receiver_dropped_cancelled"}

#: ``(op, from_stage, to_stage, key, reason, error)`` -- how the transport reports a failure for good.
FailureCallback = Callable[[str, str, str, str, str, ZmqOmniError], None]

_MAX_DRAIN = 512  # messages handled per wake-up
_BATCH_OVERHEAD = 512  # bytes of a BATCH frame beyond its entries' costs (preamble, sid, low, to_stage)
