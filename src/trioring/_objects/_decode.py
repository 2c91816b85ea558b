"""Decoding: the codec's bytes back to Python objects, bounded and refusing anything that
:func:`~trioring._objects.encode` could not have produced (the format and the bounds: see
:mod:`trioring._objects`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, final

import numpy as np

from .._errors import ProtocolError
from .._wire import DTYPES
from ._format import (
    BYTES,
    COMPLEX,
    COMPLEX128,
    DICT,
    FALSE,
    FLOAT,
    FLOAT64,
    INT,
    LIST,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_INT_BYTES,
    MAX_NDIM,
    MIN_ENCODED_BYTES,
    NDARRAY,
    NONE,
    STR,
    TAG_NAMES,
    TRUE,
    TUPLE,
    U64,
    VERSION,
    check_bounds,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    #: What :func:`decode` reads.
    Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray[Any, Any]


@final
class _Decoder:
    __slots__ = ("copy", "data", "elements", "end", "max_depth", "max_int_bytes", "pos")

    def __init__(
        self, data: memoryview, max_depth: int, max_elements: int, max_int_bytes: int, copy: bool
    ) -> None:
        self.data = data
        self.pos = 0
        self.end = data.nbytes
        self.elements = max_elements  # left
        self.max_depth = max_depth
        self.max_int_bytes = max_int_bytes
        self.copy = copy

    def fail(self, message: str, at: int | None = None) -> ProtocolError:
        return ProtocolError(
            f"malformed object encoding at byte {self.pos if at is None else at} of "
            f"{self.end}: {message}"
        )

    def take(self, n: int, what: str) -> int:
        """Consume ``n`` bytes; return where they start."""
        start = self.pos
        if n > self.end - start:
            raise self.fail(f"{what} needs {n:,} bytes, {self.end - start:,} left")
        self.pos = start + n
        return start

    def uleb(self, what: str) -> int:
        data, pos, end = self.data, self.pos, self.end
        if pos < end and data[pos] < 0x80:  # one byte: most lengths are below 128
            self.pos = pos + 1
            return data[pos]
        result = shift = 0
        start = pos
        while True:
            if pos >= end:
                raise self.fail(f"truncated length of {what}", start)
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift >= 63:
                raise self.fail(f"length of {what} longer than 9 bytes", start)
        if byte == 0 and pos - start > 1:
            raise self.fail(f"non-minimal length of {what}", start)
        self.pos = pos
        return result

    def count(self, what: str, per_item: int) -> int:
        """A container's item count, which must fit the bytes and values left."""
        start = self.pos
        n = self.uleb(what)
        if n * per_item > self.end - self.pos:
            raise self.fail(
                f"{what} of {n:,} items cannot fit in the {self.end - self.pos:,} bytes left",
                start,
            )
        if n > self.elements:
            raise self.fail(f"{what} of {n:,} items: more values than the limit", start)
        return n

    def value(self, depth: int) -> Any:
        if self.elements <= 0:
            raise self.fail("more values than the limit (max_elements)")
        self.elements -= 1
        at = self.pos
        if at >= self.end:
            raise self.fail("a tag needs 1 bytes, 0 left")
        self.pos = at + 1
        tag = self.data[at]
        if tag == NONE:
            return None
        if tag == FALSE:
            return False
        if tag == TRUE:
            return True
        if tag == INT:
            return self.read_int()
        if tag == FLOAT:
            return FLOAT64.unpack_from(self.data, self.take(8, "a float"))[0]
        if tag == COMPLEX:
            real, imag = COMPLEX128.unpack_from(self.data, self.take(16, "a complex"))
            return complex(real, imag)
        if tag == STR:
            return self.read_str()
        if tag == BYTES:
            n = self.uleb("bytes")
            start = self.take(n, "bytes")
            return bytes(self.data[start : start + n])
        if tag in (LIST, TUPLE, DICT):
            if depth >= self.max_depth:
                raise self.fail(f"more than {self.max_depth} containers nested", at)
            if tag == DICT:
                return self.read_dict(depth + 1)
            items = []
            for _ in range(self.count(TAG_NAMES[tag], 1)):
                items.append(self.value(depth + 1))
            return items if tag == LIST else tuple(items)
        if tag == NDARRAY:
            return self.read_array()
        raise self.fail(f"unknown tag 0x{tag:02x}", at)

    def read_int(self) -> int:
        start = self.pos
        n = self.uleb("an int")
        if n == 0 or n > self.max_int_bytes:
            raise self.fail(f"int of {n:,} bytes (1..{self.max_int_bytes:,})", start)
        at = self.take(n, "an int")
        value = int.from_bytes(self.data[at : at + n], "little", signed=True)
        if (value if value >= 0 else ~value).bit_length() // 8 + 1 != n:
            raise self.fail("non-minimal int", start)
        return value

    def read_str(self) -> str:
        n = self.uleb("a str")
        at = self.take(n, "a str")
        try:
            return str(self.data[at : at + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"invalid UTF-8 in a str ({exc.reason})", at + exc.start) from None

    def read_dict(self, depth: int) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        n = self.count("dict", 3)
        for i in range(n):
            at = self.pos
            if self.pos < self.end and self.data[self.pos] not in (STR, INT):
                tag = self.data[self.pos]
                name = TAG_NAMES[tag] if tag < len(TAG_NAMES) else f"tag 0x{tag:02x}"
                raise self.fail(f"dict key of type {name} (keys are str or int)")
            key = self.value(depth)
            result[key] = self.value(depth)
            if len(result) != i + 1:
                raise self.fail(f"duplicate dict key {key!r:.60}", at)
        return result

    def read_array(self) -> np.ndarray[Any, Any]:
        start = self.pos
        head = self.take(2, "an array header")
        code, ndim = self.data[head], self.data[head + 1]
        if not 0 < code <= len(DTYPES):
            raise self.fail(f"unknown dtype code {code}", head)
        if ndim > MAX_NDIM:
            raise self.fail(f"array of {ndim} dimensions (at most {MAX_NDIM})", head + 1)
        dtype = DTYPES[code - 1]
        at = self.take(8 * ndim, "an array shape")
        shape = tuple(U64.unpack_from(self.data, at + 8 * i)[0] for i in range(ndim))
        # numpy's own limit: the product of the non-zero dimensions, in bytes, fits an intp.
        bound = dtype.itemsize
        for dim in shape:
            bound *= max(dim, 1)
            if bound > sys.maxsize:
                raise self.fail(f"array shape {shape} is too large", start)
        size = 1
        for dim in shape:
            size *= dim
        pad = self.take(-self.pos % 8, "array padding")
        if any(self.data[pad : self.pos]):
            raise self.fail("non-zero array padding", pad)
        nbytes = size * dtype.itemsize
        at = self.take(nbytes, f"{dtype.name} array of shape {shape}")
        raw = np.frombuffer(self.data, np.uint8, nbytes, at)
        if dtype.kind == "b" and nbytes and raw.max() > 1:
            raise self.fail("bool array holding bytes other than 0 and 1", at)
        array = raw.view(dtype).reshape(shape)
        return array.copy() if self.copy else array


def decode(
    buffer: Buffer,
    *,
    copy: bool = True,
    max_depth: int = MAX_DEPTH,
    max_elements: int = MAX_ELEMENTS,
    max_int_bytes: int = MAX_INT_BYTES,
) -> Any:
    """The object that ``buffer`` (bytes, a bytearray, a memoryview or a uint8 array, all
    of it) encodes; see :mod:`trioring._objects` for the format and the bounds.

    Args:
        buffer: the whole encoding (trailing bytes are an error).
        copy: with True (the default), every decoded array is a new, writable, aligned
            array of its own. With False, arrays are views into ``buffer`` (no copy;
            writable only if ``buffer`` is; aligned when ``buffer`` is 8-aligned), which
            they keep alive.
        max_depth: containers nested in one another, at most ``DEPTH_LIMIT`` (200).
        max_elements: values in all.
        max_int_bytes: bytes of one int.

    Raises:
        ProtocolError: ``buffer`` is not a valid encoding within the bounds (the message
            says what and at which byte). Nothing else, whatever the bytes.
        ValueError: a bound out of range.
    """
    check_bounds(max_depth, max_elements, max_int_bytes)
    data = buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)
    if data.format != "B" or data.ndim != 1:
        data = data.cast("B") if data.c_contiguous else memoryview(data.tobytes())
    decoder = _Decoder(data, max_depth, max_elements, max_int_bytes, copy)
    if data.nbytes < MIN_ENCODED_BYTES:
        raise decoder.fail(f"{data.nbytes} bytes is too short for an encoding", 0)
    if data[0] != VERSION:
        raise decoder.fail(f"unsupported version {data[0]} (this side reads {VERSION})", 0)
    decoder.pos = 1
    obj = decoder.value(0)
    if decoder.pos != decoder.end:
        raise decoder.fail(f"{decoder.end - decoder.pos:,} trailing bytes")
    return obj
