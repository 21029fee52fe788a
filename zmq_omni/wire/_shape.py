"""Bound a msgpack object's nesting depth and object count before anything is built from it.

msgpack's unpacker materialises a header whole: it has per-container length
limits but none on depth or on the total number of objects. Deep nesting
breaks every later walk that recurses (``repr``, ``==``, the caller's own
code: ``RecursionError``), and a header of one-byte objects decodes into some
70 bytes of Python objects per wire byte. :func:`check_shape` reads the
encoding's type bytes alone (never a string's or an extension's payload),
iteratively, and stops at the first container that breaks a bound, so its
cost is bounded by the limits, not by the input.

Most headers never reach the scan: a header of ``n`` bytes holds at most
``n`` objects, and it can only nest ``d`` deep if ``d`` of its bytes are
container type bytes (``0x80-0x9f``, ``0xdc-0xdf``); counting those is two C
passes (``bytes.translate``, ``bytes.count``, about 0.2 us for 100 bytes). Only
a header that could break a bound is walked.
"""

from __future__ import annotations

import reprlib
from itertools import islice
from typing import Any, Final

from ..errors import DecodeError

__all__ = ["CONTAINER_MAP", "brief", "check_shape", "walk_shape"]

# Total encoded size of each msgpack type whose size the first byte fixes; 0 for the rest
# (containers, str/bin/ext with a length field, and the never-used 0xc1).
_FIXED = [0] * 256
for _b in range(0x00, 0x80):  # positive fixint
    _FIXED[_b] = 1
for _b in range(0xE0, 0x100):  # negative fixint
    _FIXED[_b] = 1
for _b in range(0xA0, 0xC0):  # fixstr
    _FIXED[_b] = 1 + (_b & 0x1F)
for _b, _size in (
    (0xC0, 1),  # nil
    (0xC2, 1),  # false
    (0xC3, 1),  # true
    (0xCA, 5),  # float 32
    (0xCB, 9),  # float 64
    (0xCC, 2),  # uint 8
    (0xCD, 3),
    (0xCE, 5),
    (0xCF, 9),
    (0xD0, 2),  # int 8
    (0xD1, 3),
    (0xD2, 5),
    (0xD3, 9),
    (0xD4, 3),  # fixext 1 (type byte + 1)
    (0xD5, 4),
    (0xD6, 6),
    (0xD7, 10),
    (0xD8, 18),
):
    _FIXED[_b] = _size
_FIXED_T: Final = tuple(_FIXED)
# By encoded size: the type bytes of every fixed-size encoding of that size (``bytes.lstrip`` sets).
_SAME_SIZE: Final = tuple(bytes(b for b in range(256) if _FIXED[b] == size) for size in range(33))
del _FIXED

_CONTAINER_BYTES: Final = frozenset((*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF))
#: ``data.translate(CONTAINER_MAP).count(1)``: how many bytes of ``data`` may open an array or a map.
CONTAINER_MAP: Final = bytes(1 if b in _CONTAINER_BYTES else 0 for b in range(256))
# Above this, a memoryview header is scanned rather than copied to be counted.
_COPY_TO_COUNT: Final = 64 << 10


def check_shape(data: bytes | memoryview, max_depth: int, max_objects: int) -> None:
    """Raise :class:`DecodeError` if the msgpack object at the start of ``data`` breaks a bound.

    Args:
        data: one msgpack-encoded object (trailing bytes are left to the unpacker).
        max_depth: most arrays and maps open at once (``[[1]]`` is 2 deep; a scalar 0).
        max_objects: most objects in all (every array, map, key, value and scalar counts one;
            an extension type's payload is one object).

    A truncated or malformed encoding is left to the unpacker, which rejects it; this
    only answers whether decoding it could break a bound.
    """
    size = len(data) if type(data) is bytes else memoryview(data).nbytes
    if size <= max_objects:
        if size <= max_depth:
            return
        if type(data) is bytes:
            if data.translate(CONTAINER_MAP).count(1) <= max_depth:
                return
        elif size <= _COPY_TO_COUNT and bytes(data).translate(CONTAINER_MAP).count(1) <= max_depth:
            return
    walk_shape(data if type(data) is bytes else memoryview(data).cast("B"), max_depth, max_objects)


_FIXEXT_SIZES: Final = (3, 4, 6, 10, 18)  # fixext 1, 2, 4, 8, 16 (0xd4-0xd8): type byte, code, data


def flat_ext_map(data: bytes, max_depth: int, max_objects: int) -> bool:
    """True when ``data`` is a map of up to 15 short-str keys to extension values, ending where it does.

    Such a header (``{"data": array}``, a put's usual one) is one level deep and decodes into
    ``1 + 2 * entries`` objects: within the bounds here, it needs no walk. False says nothing.
    """
    try:
        n = data[0] - 0x80
        if not 0 < n <= 15 or max_depth < 1 or 2 * n + 1 > max_objects:
            return False
        pos = 1
        for _ in range(n):
            key = data[pos]
            if not 0xA0 <= key <= 0xBF:
                return False
            pos += 1 + (key & 0x1F)
            b = data[pos]
            if b == 0xC7:
                pos += 3 + data[pos + 1]
            elif b == 0xC8:
                pos += 4 + int.from_bytes(data[pos + 1 : pos + 3], "big")
            elif b == 0xC9:
                pos += 6 + int.from_bytes(data[pos + 1 : pos + 5], "big")
            elif 0xD4 <= b <= 0xD8:
                pos += _FIXEXT_SIZES[b - 0xD4]
            else:
                return False
    except IndexError:
        return False  # truncated: the walk (or the unpacker) decides
    return pos == len(data)


def walk_shape(data: Any, max_depth: int, max_objects: int) -> None:
    """:func:`check_shape` without its first test: walk the type bytes of ``data``'s first object.

    For callers that counted the container bytes themselves and found too many (``data`` is
    ``bytes`` or a byte-format ``memoryview``). Raises at the first bound it breaks.
    """
    fixed, same_size = _FIXED_T, _SAME_SIZE
    as_bytes = type(data) is bytes
    pos = 0
    declared = 1  # objects the containers opened so far announce, plus the top one
    remaining = 1  # objects still to read at the innermost open level
    enclosing: list[int] = []  # remaining counts of the levels around it
    push = enclosing.append
    pop = enclosing.pop
    try:
        while True:
            while remaining:
                remaining -= 1
                b = data[pos]
                step = fixed[b]
                if step:
                    pos += step
                    continue
                if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
                    if b <= 0x9F:
                        n = b & 0x0F
                        pos += 1
                    elif b == 0xDC:
                        n = int.from_bytes(data[pos + 1 : pos + 3], "big")
                        pos += 3
                    else:
                        n = int.from_bytes(data[pos + 1 : pos + 5], "big")
                        pos += 5
                    step = fixed[data[pos]] if n > 4 else 0
                    if step:
                        # A list starting with a run of items of one encoded size (floats, ints of one
                        # width): their type bytes lie ``step`` apart; strip the run in one C call.
                        run = data[pos : pos + step * n : step]
                        if not as_bytes:
                            run = bytes(run)
                        skip = len(run) - len(run.lstrip(same_size[step]))
                        if len(enclosing) >= max_depth:
                            raise DecodeError(f"header nests deeper than the limit of {max_depth} arrays and maps")
                        declared += n
                        if declared > max_objects:
                            raise DecodeError(f"header decodes into more than the limit of {max_objects} objects")
                        pos += step * skip
                        push(remaining)
                        remaining = n - skip
                        continue
                elif 0x80 <= b <= 0x8F:
                    n = (b & 0x0F) * 2
                    pos += 1
                elif b == 0xDE:
                    n = int.from_bytes(data[pos + 1 : pos + 3], "big") * 2
                    pos += 3
                elif b == 0xDF:
                    n = int.from_bytes(data[pos + 1 : pos + 5], "big") * 2
                    pos += 5
                else:
                    # str/bin/ext with a length field: skip the payload. 0xc1 is left to the unpacker.
                    if b in (0xC4, 0xD9):
                        pos += 2 + data[pos + 1]
                    elif b in (0xC5, 0xDA):
                        pos += 3 + int.from_bytes(data[pos + 1 : pos + 3], "big")
                    elif b in (0xC6, 0xDB):
                        pos += 5 + int.from_bytes(data[pos + 1 : pos + 5], "big")
                    elif b == 0xC7:
                        pos += 3 + data[pos + 1]
                    elif b == 0xC8:
                        pos += 4 + int.from_bytes(data[pos + 1 : pos + 3], "big")
                    elif b == 0xC9:
                        pos += 6 + int.from_bytes(data[pos + 1 : pos + 5], "big")
                    else:
                        return
                    continue
                if len(enclosing) >= max_depth:
                    raise DecodeError(f"header nests deeper than the limit of {max_depth} arrays and maps")
                declared += n
                if declared > max_objects:
                    raise DecodeError(f"header decodes into more than the limit of {max_objects} objects")
                push(remaining)
                remaining = n
            if not enclosing:
                return
            remaining = pop()
    except IndexError:
        return  # truncated: the unpacker says so


class _Brief(reprlib.Repr):
    """``reprlib`` bounded for hostile values: a few levels, a few items, short strings and bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 6
        self.maxstring = self.maxother = 40
        self.maxlong = 40

    def repr_bytes(self, x: bytes, level: int) -> str:
        return self._short(x)

    def repr_bytearray(self, x: bytearray, level: int) -> str:
        return self._short(x)

    def repr_memoryview(self, x: memoryview, level: int) -> str:
        return f"<memoryview of {x.nbytes} bytes>"

    def repr_ExtType(self, x: Any, level: int) -> str:
        return f"ExtType({x.code!r}, {self.repr1(x.data, level - 1)})"

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        # reprlib's own sorts the keys first: a walk of the whole dict.
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(key, level - 1)}: {self.repr1(x[key], level - 1)}" for key in islice(x, self.maxdict)]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"

    def _short(self, x: bytes | bytearray) -> str:
        if len(x) <= self.maxstring:
            return repr(x)
        return f"{x[: self.maxstring]!r}... ({len(x)} bytes)"


_brief = _Brief().repr


def brief(value: object) -> str:
    """A short repr of a received value for an error message: bounded work, whatever its size or depth."""
    return _brief(value)
