"""Pull mode: the sender keeps each payload and serves it once, on request, from a bound ROUTER.

A receiver sends FETCH ``[req_id, from_stage, to_stage, key, wait_ms, shm]``
from a DEALER; the server answers FETCH_REPLY ``[req_id, found, probe]``
followed by the payload frames when found, or ``[req_id, found, probe, loc]``
with no frames when the payload lies in the server's shared memory. With
``wait_ms > 0`` the server parks the request until the key is put or the wait
ends (a long poll, at most 60 s: the client asks again), so a receiver
waiting for data costs one round trip, not a polling loop. A FETCH_REPLY to
request id 0 (ids start at 1) answers no FETCH: the server sends it to learn
whether a peer with parked FETCHes is still connected, and clients ignore
it. A payload leaves the store when it is sent: each put is fetched at most
once. Unfetched payloads expire after ``pull_ttl_s`` and are reported as
failed puts.

Same-host fast path: a server with a slot pool names its probe segment
(``[segment, nonce]``, as push mode's PING does) in every reply; the client
attaches it in its own shm directory and, when it holds the nonce, sets ``shm``
in its later FETCHes. For those, a payload of at least the threshold is copied
once into a slot at fetch time and only the packed handle (``loc``) crosses
ZeroMQ; the client leases the slot and decodes views of it. A client's first
fetch from a server (verdict unknown) and every fetch by a client on another
host get frames. A server names its probe only to a client that sent the flag,
so clients of the previous version (five-field FETCH, two-field replies) keep
working; a client with the fast path on needs a server of this version (one
with ``shm: off`` sends the older FETCH).

Modules: :mod:`._pull_server` (the sending half, bound; its ROUTER in
:mod:`._pull_socket`, its long polls in :mod:`._pull_lot`, its stored payloads
in :mod:`._pull_store`) and :mod:`._pull_client` (the receiving half,
connecting), as push mode has ``_sender`` and ``_receiver``.
"""

from __future__ import annotations

__all__ = ["Slot"]

#: ``(from_stage, to_stage, key)``: where one payload is stored and fetched.
Slot = tuple[str, str, str]
