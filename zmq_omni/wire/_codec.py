"""Encode objects to ``[header, buffer, ...]`` frames and back, without copying large arrays.

The byte layout is specified in ``docs/wire-format.md``; the constants below
are the ones that document names. In short: frame 0 is a 9-byte preamble
followed by one msgpack object; arrays, tensors, numpy scalars, tuples, big
ints, records (msgspec Structs, dataclasses), registered types, slices, images
and (opt-in) pickles are msgpack extension types or marked lists; an array whose size is
at or above the inline threshold is carried by its own frame, referenced by
index, and that frame is a view of the array's memory.

Speed matters on two paths. Small metadata dicts (hundreds of bytes, at 100k+
messages/s) go through msgpack's C packer and unpacker untouched: the Python
hooks only run for the few types msgpack cannot carry natively, and a preamble
flag lets the decoder skip them altogether when the header holds none. Large
arrays are never copied, so their cost is a constant per array; bounded memos
of out-of-band descriptors (by dtype, shape and frame index) keep that
constant small for the shapes a pipeline sends again and again.

The pieces: the format's numbers in :mod:`._format`, the encoder in
:mod:`._encoder`, the decoder in :mod:`._decoder`; this module holds the entry
points (:func:`encode`, :func:`decode`, :func:`decode_each`,
:func:`frames_nbytes`) and re-exports the format's names.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any, Final

import msgpack

from ..errors import DecodeError, EncodeError
from ._decoder import _Decoding, _reject_ext
from ._encoder import _NO_FRAMES, _Encoder, _type_name
from ._format import (
    _KNOWN_FLAGS,
    _MARKS,
    _N_CACHED_PREAMBLES,
    _PREAMBLE,
    _PREAMBLES,
    DEFAULT_INLINE_THRESHOLD,
    EXT_ARRAY,
    EXT_BIGINT,
    EXT_CUSTOM,
    EXT_IMAGE,
    EXT_PICKLE,
    EXT_RECORD,
    EXT_SCALAR,
    EXT_SLICE,
    EXT_TENSOR,
    EXT_TUPLE,
    FLAG_EXT,
    FLAG_OBJECT,
    FLAG_PICKLE,
    FLAG_TUPLE,
    IMAGE_MODE_BITS,
    LAYOUT_FORTRAN,
    LAYOUT_OUT_OF_BAND,
    MAGIC,
    PREAMBLE_SIZE,
    WIRE_VERSION,
)
from ._limits import DecodeLimits
from ._shape import _COPY_TO_COUNT, CONTAINER_MAP, flat_ext_map, walk_shape

# The entry points, and the format's names (defined in _format), importable from here.
__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "EXT_ARRAY",
    "EXT_BIGINT",
    "EXT_CUSTOM",
    "EXT_IMAGE",
    "EXT_PICKLE",
    "EXT_RECORD",
    "EXT_SCALAR",
    "EXT_SLICE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "FLAG_EXT",
    "FLAG_OBJECT",
    "FLAG_PICKLE",
    "FLAG_TUPLE",
    "IMAGE_MODE_BITS",
    "LAYOUT_FORTRAN",
    "LAYOUT_OUT_OF_BAND",
    "MAGIC",
    "PREAMBLE_SIZE",
    "WIRE_VERSION",
    "decode",
    "encode",
    "frames_nbytes",
]

# An encoding with at least this many bytes of inline arrays, and at most this many others, is walked at once.
_WALK_INLINE_BYTES: Final = 1024
# A longer header's container bytes are counted in two parts, this many bytes first (see _many_containers).
_COUNT_FIRST: Final = 512
_DEFAULT_LIMITS = DecodeLimits()
_unpackb = msgpack.unpackb
# Frame 0 of a plain-msgpack encoding (no extension types, no out-of-band frames) starts with exactly this.
_PLAIN_PREAMBLE: Final = _PREAMBLE.pack(MAGIC, WIRE_VERSION, 0, 0)


_local = threading.local()


def encode(
    obj: object,
    *,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    allow_pickle: bool = False,
    limits: DecodeLimits | None = None,
) -> list[bytes | memoryview]:
    """Encode ``obj`` into frames: ``[header, buffer_1, ..., buffer_n]``.

    ``header`` (``bytes``) is the preamble plus a msgpack description of the
    object tree. Every numpy array or torch CPU tensor of at least
    ``inline_threshold`` bytes becomes one of the following frames, in the
    order the arrays appear in the tree: a flat ``uint8`` ``memoryview`` over
    the array's own memory (C- or Fortran-contiguous arrays are not copied;
    other strided arrays are copied once into a C-contiguous buffer).
    Smaller arrays are copied into the header.

    The frames alias the caller's arrays: do not modify those arrays until
    the frames have been sent (with ``copy=False``, until ZeroMQ released
    them) or dropped.

    Args:
        obj: None, bool, int (any size), float, str, bytes, bytearray,
            memoryview, list, tuple, dict (str or int keys), numpy arrays and
            scalars of the allowed dtypes, torch CPU tensors; subclasses of
            these travel as their base type.
        inline_threshold: size in bytes from which an array gets its own frame.
        allow_pickle: pickle objects of any other type instead of raising.
            The receiver must opt in too. Only for trusted peers.
        limits: the receiving side's header depth and object limits (default
            ``DecodeLimits()``): an object tree they would reject is refused here,
            so the put fails at once instead of being dropped on arrival.

    Returns:
        The frames, ready for ``socket.send_multipart(frames, copy=False)``.

    Raises:
        EncodeError: an object (named in the message) cannot be encoded, or its
            tree is deeper or has more objects than ``limits`` allow.
    """
    try:
        encoder: _Encoder = _local.encoder
    except AttributeError:
        encoder = _local.encoder = _Encoder()
    if encoder.busy:
        encoder = _Encoder()
    if inline_threshold < 0:
        raise EncodeError(f"inline_threshold must be >= 0, got {inline_threshold}")
    frames: list[bytes | memoryview] = [b""]
    encoder.frames = frames
    encoder.flags = 0
    encoder.threshold = inline_threshold
    encoder.inline = 0
    encoder.allow_pickle = allow_pickle
    encoder.busy = True
    try:
        body = encoder.pack(obj)
    except EncodeError:
        raise
    except Exception as exc:
        raise EncodeError(f"cannot encode {_type_name(obj)}: {exc}") from exc
    finally:
        encoder.busy = False
        # Drop the references so this thread's encoder does not pin the arrays.
        encoder.frames = _NO_FRAMES
    lim = _DEFAULT_LIMITS if limits is None else limits
    # Bytes of inline arrays look like msgpack containers (one in seven at random), so counting them would only
    # send a header that holds some to the walk anyway; when the rest of the header is short, walk it at once.
    inline = encoder.inline
    if (
        len(body) > lim.max_objects
        or (inline >= _WALK_INLINE_BYTES and len(body) - inline <= _WALK_INLINE_BYTES)
        or body.translate(CONTAINER_MAP).count(1) > lim.max_depth
    ) and not flat_ext_map(body, lim.max_depth, lim.max_objects):
        try:
            walk_shape(body, lim.max_depth, lim.max_objects)
        except DecodeError as exc:
            raise EncodeError(f"cannot encode {_type_name(obj)}: a receiver would refuse it ({exc})") from None
    n_oob = len(frames) - 1
    if n_oob < _N_CACHED_PREAMBLES:
        frames[0] = _PREAMBLES[encoder.flags][n_oob] + body
    elif n_oob > 0xFFFFFFFF:
        raise EncodeError(f"too many out-of-band arrays ({n_oob})")
    else:
        frames[0] = _PREAMBLE.pack(MAGIC, WIRE_VERSION, encoder.flags, n_oob) + body
    return frames


def _many_containers(body: bytes, depth: int) -> bool:
    """Whether more than ``depth`` bytes of ``body`` may open an array or a map (then the walk decides).

    The first ``_COUNT_FIRST`` bytes are counted alone first: an inline array's bytes look like containers
    (one in seven at random), so a header holding one passes ``depth`` there and its rest is never counted
    (counting runs at about 2 ns a byte; the walk skips an array's bytes whole).
    """
    first = body[:_COUNT_FIRST].translate(CONTAINER_MAP).count(1)
    return first > depth or first + body[_COUNT_FIRST:].translate(CONTAINER_MAP).count(1) > depth


def _check_view(body: memoryview, depth: int, objects: int) -> None:
    """:func:`check_shape` for a long header (a byte view): its first ``_COUNT_FIRST`` bytes counted alone first.

    A header this long nearly always holds an inline array, whose bytes look like containers: when the first
    part already has too many, the walk (which skips an array's bytes whole) runs without the whole header
    being copied and counted first.
    """
    size = body.nbytes
    if size <= depth:
        return
    if size <= objects and size <= _COPY_TO_COUNT:
        first = body[:_COUNT_FIRST].tobytes().translate(CONTAINER_MAP).count(1)
        if first <= depth and first + body[_COUNT_FIRST:].tobytes().translate(CONTAINER_MAP).count(1) <= depth:
            return
    walk_shape(body.cast("B"), depth, objects)


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size in bytes of a frame set (any buffer-protocol objects)."""
    total = 0
    for frame in frames:
        cls = type(frame)
        if cls is bytes or cls is bytearray:
            total += len(frame)
        elif cls is memoryview:
            total += frame.nbytes
        else:
            total += memoryview(frame).nbytes
    return total


def decode_each(
    frames: Sequence[bytes], *, allow_pickle: bool = False, limits: DecodeLimits | None = None, device: Any = None
) -> list[Any]:
    """Decode many single-frame encodings (frame 0 only, ``bytes``), each on its own.

    Each item of the result is the decoded object, or the :class:`DecodeError`
    that decoding that frame raised (the others are decoded all the same):
    ``[decode([f]) or its DecodeError for f in frames]``, with a faster path for
    plain-msgpack frames, which small metadata puts are.

    Args:
        frames: frame 0 of each encoding; one that refers to out-of-band frames
            gets a DecodeError (it has none here).
        allow_pickle: accept pickled objects (trusted peers only).
        limits: bounds on each frame; defaults to ``DecodeLimits()``.
        device: as for :func:`decode`.

    Returns:
        One item per frame, in order. Nothing is raised for a bad frame.
    """
    lim = _DEFAULT_LIMITS if limits is None else limits
    largest = min(lim.max_header_bytes, lim.max_total_bytes - PREAMBLE_SIZE)
    plain, skip, unpackb, reject = _PLAIN_PREAMBLE, PREAMBLE_SIZE, _unpackb, _reject_ext
    depth, objects = lim.max_depth, lim.max_objects
    out: list[Any] = []
    add = out.append
    for frame in frames:
        if type(frame) is bytes and frame.startswith(plain) and len(frame) - skip <= largest:
            try:
                # As decode's plain path: msgpack bounds every declared length by the input's.
                body = frame[skip:]
                if len(body) > objects or body.translate(CONTAINER_MAP).count(1) > depth:
                    walk_shape(body, depth, objects)
                add(unpackb(body, ext_hook=reject, raw=False, strict_map_key=False))
            except DecodeError as exc:
                add(exc)
            except Exception as exc:
                add(DecodeError(f"invalid header: {exc!r}"))
            continue
        try:
            add(decode([frame], allow_pickle=allow_pickle, limits=lim, device=device))
        except DecodeError as exc:
            add(exc)
    return out


def _single_frame_state(limits: DecodeLimits) -> _Decoding:
    """The shared decoding state of one-frame encodings whose preamble declares only ``FLAG_EXT``.

    Decoding such a header never changes its state: an out-of-band array reference
    fails (there is no frame 1), tuple and object markers and pickles are refused
    (their flags are absent), and inline arrays, tensors, scalars and big ints read
    nothing but the limits. So it needs neither a state of its own nor the checks
    after the parse (no marker can be open, no frame unused), and any thread may
    use it at once. The last one made is kept with its limits, compared by identity
    (a connector decodes with the same limits object every time; hashing the
    dataclass would cost more than building a state).
    """
    global _last_single_frame_state
    state = _Decoding((b"",), 1, FLAG_EXT, False, limits, 0)
    _last_single_frame_state = (limits, state)
    return state


_last_single_frame_state: tuple[DecodeLimits, _Decoding]
_single_frame_state(_DEFAULT_LIMITS)


_PREAMBLE_CHECK = struct.Struct("<4sBI")
_MAGIC_AND_VERSION: Final = MAGIC + bytes((WIRE_VERSION,))
_SLICE_HEADER_MAX: Final = 4096


def _reject_preamble(head: Any, flags: int, n_oob: int, count: int, size: int, lim: DecodeLimits) -> None:
    """Raise the DecodeError that says what is wrong with a preamble that failed the quick check."""
    magic, version = bytes(memoryview(head)[:3]), memoryview(head)[3]
    if magic != MAGIC:
        raise DecodeError(f"frame 0 starts with {magic!r}, not the zmq_omni magic {MAGIC!r}")
    if version != WIRE_VERSION:
        raise DecodeError(f"wire version {version} is not supported (this decoder speaks {WIRE_VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise DecodeError(f"unknown preamble flags {flags:#04x}")
    if n_oob != count - 1:
        raise DecodeError(f"preamble declares {n_oob} out-of-band frames, got {count - 1}")
    if n_oob and not flags & FLAG_EXT:
        raise DecodeError(f"{n_oob} out-of-band frames but no extension types to refer to them")
    if flags & (FLAG_TUPLE | FLAG_PICKLE | FLAG_OBJECT) and not flags & FLAG_EXT:
        raise DecodeError(f"preamble flags {flags:#04x} set TUPLE, PICKLE or OBJECT without EXT")
    if n_oob > lim.max_frames:
        raise DecodeError(f"{n_oob} out-of-band frames, limit is {lim.max_frames}")
    if size > lim.max_header_bytes:
        raise DecodeError(f"header of {size} bytes, limit is {lim.max_header_bytes}")
    if size + PREAMBLE_SIZE > lim.max_total_bytes:
        raise DecodeError(f"frame 0 of {size + PREAMBLE_SIZE} bytes, limit is {lim.max_total_bytes}")
    if flags & FLAG_PICKLE:
        raise DecodeError("pickled content rejected: this decoder has not opted in (allow_pickle=False)")
    raise DecodeError("invalid preamble")  # pragma: no cover - the quick check and this list agree


def decode(
    frames: Sequence[Any], *, allow_pickle: bool = False, limits: DecodeLimits | None = None, device: Any = None
) -> Any:
    """Decode a frame set produced by :func:`encode`.

    Large arrays come back as numpy arrays (torch tensors for encoded
    tensors, when torch is installed) that view the given frames' memory:
    writable when the frame buffer is writable (``zmq.Frame``, shared
    memory), read-only over ``bytes``. Each view keeps its frame alive.
    Inline arrays are private, writable copies.

    Args:
        frames: frame 0 and every out-of-band frame, in order; each any
            buffer-protocol object (``bytes``, ``memoryview``, ``zmq.Frame``).
        allow_pickle: accept pickled objects (trusted peers only).
        limits: bounds on the frame set; defaults to ``DecodeLimits()``.
        device: a ``torch.device`` (or its name) to move decoded tensors
            onto; ``None`` leaves them on the CPU (viewing the frames).
            Validate a configured name with ``resolve_device`` first.

    Returns:
        The decoded object.

    Raises:
        DecodeError: the frames are not a valid encoding, violate ``limits``,
            or carry pickles without ``allow_pickle``. Nothing else is raised.
    """
    lim = _DEFAULT_LIMITS if limits is None else limits
    try:
        count = len(frames)
        head = frames[0]
        magic, flags, n_oob = _PREAMBLE_CHECK.unpack_from(head)
        # Copying a small header is cheaper than a memoryview slice, and its shape is checked faster as bytes.
        if type(head) is bytes and len(head) <= _SLICE_HEADER_MAX:
            body: bytes | memoryview = head[PREAMBLE_SIZE:]
            size = len(body)
        else:
            body = memoryview(head)[PREAMBLE_SIZE:]
            size = body.nbytes
            if lim.max_depth < size <= _SLICE_HEADER_MAX - PREAMBLE_SIZE:  # (a shorter one is never counted)
                body = body.tobytes()
    except Exception as exc:
        raise DecodeError(f"frame 0 is not a zmq_omni preamble: {exc!r}") from exc
    if (
        magic != _MAGIC_AND_VERSION
        or flags & ~_KNOWN_FLAGS
        or n_oob != count - 1
        or ((n_oob or flags & (FLAG_TUPLE | FLAG_PICKLE | FLAG_OBJECT)) and not flags & FLAG_EXT)
        or n_oob > lim.max_frames
        or size > lim.max_header_bytes
        or size + PREAMBLE_SIZE > lim.max_total_bytes
        or (flags & FLAG_PICKLE and not allow_pickle)
    ):
        _reject_preamble(head, flags, n_oob, count, size, lim)
    try:
        # Depth and object count before msgpack builds anything. Inlined here, check_shape's first test for
        # the usual small header: too few bytes that may open an array or a map to nest past the limit; or a
        # put's usual header, a flat map of arrays (flat_ext_map: cheaper than counting its array's bytes).
        depth, objects = lim.max_depth, lim.max_objects
        if isinstance(body, memoryview):
            _check_view(body, depth, objects)
        elif size > lim.max_objects or (
            body.translate(CONTAINER_MAP).count(1) > lim.max_depth and not flat_ext_map(body, depth, objects)
            if size <= _COUNT_FIRST
            else not flat_ext_map(body, depth, objects) and _many_containers(body, depth)
        ):
            walk_shape(body, depth, objects)
        if not flags:
            # Plain msgpack: the metadata-only hot path.
            # msgpack bounds every declared length by the input's length when no limit is
            # given (max_*_len=-1 means len(body)), so a forged count cannot make it allocate.
            return _unpackb(body, ext_hook=_reject_ext, strict_map_key=False)
        if count == 1 and flags == FLAG_EXT and device is None:
            # Inline arrays, scalars, big ints and nothing else (a small put's usual header): no hook
            # here changes its state (see _single_frame_state), so one state per limits serves every call.
            last = _last_single_frame_state  # one read: another thread may replace it meanwhile
            state = last[1] if last[0] is lim else _single_frame_state(lim)
            return _unpackb(body, ext_hook=state.ext_hook, strict_map_key=False)
        state = _Decoding(frames, count, flags, allow_pickle, lim, size + PREAMBLE_SIZE, device)
        list_hook = state.list_hook if flags & _MARKS else None
        obj = _unpackb(body, ext_hook=state.ext_hook, list_hook=list_hook, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"invalid header: {exc!r}") from exc
    if state.open_marks:
        raise DecodeError("tuple marker or object marker outside the first slot of a list")
    if state.next_frame != count:
        raise DecodeError(f"header refers to {state.next_frame - 1} of {count - 1} out-of-band frames")
    return obj
