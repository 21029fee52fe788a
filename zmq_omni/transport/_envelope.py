"""The transport envelope: a fixed preamble and a small msgpack header in front of the wire frames.

Every message this room sends starts with one frame laid out as::

    preamble (8 B): magic b"ZT" | version u8 | kind u8 | header length u32 (little endian)
    header:         msgpack array, its shape fixed by ``kind`` (see below)
    payload:        for DATA and FETCH_REPLY, frame 0 of the wire codec (its own preamble follows)

and, for DATA and FETCH_REPLY, the wire codec's out-of-band buffer frames after it.
Putting the transport header in the same frame as the codec header keeps a
small message a single ZeroMQ frame.

Headers by kind:

* ``DATA``        ``[sid, seq, low, from_stage, to_stage, key, loc]`` or ``[..., loc, incarnation]``;
  ``loc`` is the location table of the buffer frames, ``None`` meaning "each buffer is the
  next ZeroMQ frame", or the bytes of a packed :class:`~zmq_omni.shm.SlotHandle`
  (the same-host fast path: the whole wire encoding lies in the sender's shared
  memory and the message is this one frame). ``incarnation`` (str), on a resend only:
  the receiver incarnation it was sent again for; any other incarnation drops it.
* ``BATCH``       ``[sid, low, to_stage, entries]`` or ``[..., entries, incarnation]``: several small
  puts in one frame (no payload after the header). ``entries`` is a flat list of ``4 * m``
  fields, ``m >= 2``, one ``seq, from_stage, key, wire`` quadruple per put in put order; ``wire``
  (bin) is the codec's frame 0 of a single-frame encoding. Each put is validated,
  de-duplicated and acknowledged exactly as if it had come in its own ``DATA`` message;
  ``incarnation`` as for ``DATA`` (the whole BATCH is dropped).
* ``PING``        ``[sid, n, low]`` or ``[sid, n, low, probe]``; ``probe`` is ``[segment, nonce]``,
  a shared-memory segment the receiver may attach to prove it shares the sender's ``/dev/shm``.
* ``REPLY``       ``[incarnation, n, arrived, consumed]``, ``[..., shm]`` or ``[..., shm, batch_bytes]``;
  ``n`` is the answered ping or -1 for a plain acknowledgement (-2, -3: one whose consumed seqs were
  dropped unconsumed: unclaimed past the receiver's ttl, or cancelled; an older sender reads any
  negative ``n`` as a plain acknowledgement); ``arrived``/``consumed`` are
  ``[[first, last], ...]`` seq ranges; ``shm`` is the probe verdict (``true``: send handles,
  ``false``: send frames, ``null``: not probed); ``batch_bytes`` is the largest ``BATCH`` frame the
  receiver accepts (0 or absent: it takes no ``BATCH``, so a sender never batches to an older receiver).
* ``HEALTH``      ``[]``; ``HEALTH_REPLY`` ``[health dict]``
* ``FETCH``       ``[req_id, from_stage, to_stage, key, wait_ms]`` or ``[..., shm]``; ``shm`` (bool) says
  whether the fetcher read the server's probe segment (true: a large payload may come as a slot handle);
  its presence asks the server to name its probe in the reply.
* ``FETCH_REPLY`` ``[req_id, found]``, ``[req_id, found, probe]`` or ``[req_id, found, probe, loc]``;
  ``probe`` is the server's ``[segment, nonce]`` (or null), ``loc`` a packed
  :class:`~zmq_omni.shm.SlotHandle`: the payload lies in the server's shared memory and no frame follows.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import Any

import msgpack

from ..errors import DecodeError
from ..wire import brief, check_shape

__all__ = [
    "DEFAULT_MAX_KEY_BYTES",
    "PREAMBLE_SIZE",
    "Kind",
    "check_key",
    "check_ranges",
    "check_types",
    "from_ranges",
    "pack",
    "to_ranges",
    "unpack",
]

MAGIC = b"ZT"
VERSION = 1
_PREAMBLE = struct.Struct("<2sBBI")
PREAMBLE_SIZE = _PREAMBLE.size

#: Longest transport header accepted (keys and stage ids are short; seq lists are bounded by the window).
MAX_HEADER_BYTES = 4 << 20
#: Deepest nesting of arrays and maps in a transport header (the deepest legitimate one, a REPLY's
#: seq ranges or a health dict, is 4 levels).
MAX_HEADER_DEPTH = 32
#: Most msgpack objects a transport header may hold: a BATCH of the most puts, with room to spare.
MAX_HEADER_OBJECTS = 4 * 65536 + 1024


class Kind(IntEnum):
    """Message kinds of the transport protocol."""

    DATA = 1
    PING = 2
    REPLY = 3
    HEALTH = 4
    HEALTH_REPLY = 5
    FETCH = 6
    FETCH_REPLY = 7
    BATCH = 8


#: Numbers of header fields each kind may carry (trailing fields are optional, for older peers).
_ARITY = {
    Kind.DATA: (7, 8),
    Kind.PING: (3, 4),
    Kind.REPLY: (4, 5, 6),
    Kind.HEALTH: (0,),
    Kind.HEALTH_REPLY: (1,),
    Kind.FETCH: (5, 6),
    Kind.FETCH_REPLY: (2, 3, 4),
    Kind.BATCH: (4, 5),
}

# The hot kinds skip the shape scan below MAX_HEADER_OBJECTS bytes (it would cost more than the
# unpacking): their fields are scalars and one flat list, each checked for its exact type (no walk
# of a nested value) before anything else reads them; msgpack itself builds any nesting without recursion.
_FLAT_KINDS = frozenset((Kind.DATA, Kind.BATCH))

_KINDS = {kind.value: kind for kind in Kind}  # a dict lookup: Kind(n) costs ~0.5 us per message

_packb: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack
_unpackb = msgpack.unpackb


def pack(kind: Kind, header: Sequence[Any], payload: bytes | memoryview | None = None) -> bytes:
    """Frame 0 of a message: preamble, msgpack ``header`` and (optionally) the codec's frame 0."""
    body = _packb(header)
    if payload is None:
        return _PREAMBLE.pack(MAGIC, VERSION, kind, len(body)) + body
    return b"".join((_PREAMBLE.pack(MAGIC, VERSION, kind, len(body)), body, payload))


def unpack(frame: bytes | memoryview) -> tuple[Kind, list[Any], memoryview]:
    """Split frame 0 into ``(kind, header, payload view)``; anything malformed raises ``DecodeError``."""
    view = memoryview(frame)
    if view.nbytes < PREAMBLE_SIZE:
        raise DecodeError(f"transport frame of {view.nbytes} bytes is shorter than the preamble")
    magic, version, kind_no, size = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise DecodeError(f"transport frame starts with {bytes(magic)!r}, not {MAGIC!r}")
    if version != VERSION:
        raise DecodeError(f"transport version {version} is not supported (this side speaks {VERSION})")
    kind = _KINDS.get(kind_no)
    if kind is None:
        raise DecodeError(f"unknown transport message kind {kind_no}")
    end = PREAMBLE_SIZE + size
    if size > MAX_HEADER_BYTES or end > view.nbytes:
        raise DecodeError(f"transport header length {size} exceeds the frame ({view.nbytes} bytes)")
    body = view[PREAMBLE_SIZE:end]
    if size > MAX_HEADER_OBJECTS or kind not in _FLAT_KINDS:
        check_shape(body, MAX_HEADER_DEPTH, MAX_HEADER_OBJECTS)
    try:
        # msgpack's defaults (raw=False, strict_map_key=True, use_list=True) are the rules here; keywords cost.
        header = _unpackb(body)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"transport header is not valid msgpack: {exc!r}") from exc
    if not isinstance(header, list) or len(header) not in _ARITY[kind]:
        want = " or ".join(map(str, _ARITY[kind]))
        raise DecodeError(f"{kind.name} header must be a list of {want} fields, got {brief(header)}")
    return kind, header, view[end:]


def check_types(header: Sequence[Any], types: tuple[type, ...], what: str) -> None:
    """Raise ``DecodeError`` unless each header field has exactly its expected type.

    Exact types (msgpack only produces these), so ``bool`` never passes for ``int``.
    """
    if tuple(map(type, header)) != types:
        got = ", ".join(type(value).__name__ for value in header)
        want = ", ".join(t.__name__ for t in types)
        raise DecodeError(f"{what} header has types ({got}), expected ({want})")


#: The longest key (UTF-8 bytes) a receiver or pull server accepts unless configured otherwise (``max_key_bytes``).
DEFAULT_MAX_KEY_BYTES = 4096


def check_key(key: str, max_key_bytes: int) -> None:
    """Raise ``DecodeError`` when ``key`` is longer than ``max_key_bytes`` in UTF-8 (every key a peer sends).

    A key is hashed, cut and compared on its way to the mailbox and the tombstones: its length is
    bounded before any of that. The encoding is measured only for keys whose character count leaves
    the answer open (a character takes one to four bytes).
    """
    size = len(key)
    if size > max_key_bytes or (size * 4 > max_key_bytes and len(key.encode("utf-8", "surrogatepass")) > max_key_bytes):
        raise DecodeError(f"key of {size} characters is longer than max_key_bytes {max_key_bytes}")


def to_ranges(seqs: Iterable[int]) -> list[list[int]]:
    """Compress sequence numbers into sorted ``[first, last]`` runs (acks stay small under load)."""
    ordered = sorted(set(seqs))
    if not ordered:
        return []
    if ordered[-1] - ordered[0] + 1 == len(ordered):  # one run, the usual case: no Python loop
        return [[ordered[0], ordered[-1]]]
    out: list[list[int]] = []
    for seq in ordered:
        if out and seq <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], seq)
        else:
            out.append([seq, seq])
    return out


def from_ranges(ranges: Any, limit: int) -> list[int]:
    """Expand ``[first, last]`` runs, refusing more than ``limit`` numbers (hostile acks)."""
    out: list[int] = []
    for run in check_ranges(ranges, limit):
        out.extend(run)
    return out


def check_ranges(ranges: Any, limit: int) -> list[range]:
    """Validate ``[first, last]`` runs as :func:`from_ranges` does, without expanding them."""
    if not isinstance(ranges, list):
        raise DecodeError("seq ranges must be a list")
    out: list[range] = []
    total = 0
    for item in ranges:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(type(v) is int for v in item)
            or item[0] > item[1]
            or item[0] < 0
        ):
            raise DecodeError(f"bad seq range {brief(item)}")
        total += item[1] - item[0] + 1
        if total > limit:
            raise DecodeError(f"seq ranges name more than {limit} messages")
        out.append(range(item[0], item[1] + 1))
    return out
