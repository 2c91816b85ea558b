"""A safe codec for Python objects: the bytes that the object collectives
(:meth:`trioring.Communicator.broadcast_object` and the other ``*_object`` methods)
send. It never pickles, and decoding runs no code of the sender's choosing: a peer's bytes
can only ever become the plain values listed here, within documented bounds.

**What it takes.** ``None``, ``bool``, ``int`` (of any size up to ``MAX_INT_BYTES`` of
two's complement), ``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``
with ``str`` or ``int`` keys, and ``numpy.ndarray`` of a supported dtype
(:data:`trioring._wire.DTYPE_CODES`: int8..int64, uint8..uint64, float16/32/64,
complex64/128, bool; native byte order) of any shape, 0-d included, sent as raw bytes in C
order (a non-contiguous array is copied into C order first). Types are matched exactly, not
by ``isinstance``: subclasses (an ``IntEnum``, a ``str`` subclass, ``np.float64``, which is
a ``float`` subclass, ``np.memmap``, masked arrays) and everything else (sets, custom
classes, ``bytearray``, dict keys of other types, ``bool`` keys, object dtypes) are refused
by :func:`encode` with an :class:`~trioring.InvalidArgumentError` naming the type and where
it is, e.g. ``obj["cfg"][2]: set is not supported``. So a round trip gives back exactly the
types that went in: a tuple stays a tuple, ``True`` stays a ``bool``, floats (NaN payloads,
infinities, ``-0.0``) are bit-exact, dicts keep their order and key types, arrays their
dtype and shape. Objects that appear twice in the input (or shared sub-lists) are encoded
twice and come back as separate objects; a container that contains itself is refused as too
deep.

**Bounds.** Decoding untrusted bytes is bounded, and :func:`encode` refuses, before any I/O,
whatever :func:`decode` would refuse with the same bounds (so an object that encodes always
decodes on the receiving rank):

- ``max_depth`` (default ``MAX_DEPTH``, 100): containers nested in one another;
- ``max_elements`` (default ``MAX_ELEMENTS``, 1,000,000): values in all, every scalar,
  container, dict key and array counting one (send bulk numbers as numpy arrays: an array
  of any size is one value);
- ``max_int_bytes`` (default ``MAX_INT_BYTES``, 1 MiB): the two's complement of one int;
- the total size is the message itself: every length is checked against the bytes that are
  there before anything is allocated, so decoding allocates at most about the size of its
  input, plus Python's overhead for at most ``max_elements`` values.

:func:`decode` raises :class:`~trioring.ProtocolError` (and nothing else) for anything that
is not exactly an encoding that :func:`encode` could have produced: an unknown version or
tag, truncated input, trailing bytes, a length or count beyond the bytes left, a
non-minimal LEB128 or int, invalid UTF-8, an unknown dtype code, too many dimensions, a
shape whose byte size overflows or does not match the bytes, non-zero padding, a ``bool``
array holding bytes other than 0 and 1, a dict key that is neither ``str`` nor ``int``, a
duplicate dict key, or a bound exceeded. The encoding of a value is therefore unique.

**Format** (version 1). One version byte (``0x01``), then one value. A value is a tag byte
and its payload; ``uleb`` is an unsigned LEB128 (minimal: no trailing ``0x80 0x00``, at
most 9 bytes)::

    0x00 None
    0x01 False
    0x02 True
    0x03 int       uleb n, then n bytes of two's complement, little-endian (n >= 1, minimal)
    0x04 float     8 bytes, IEEE 754 binary64, little-endian
    0x05 complex   16 bytes: real, then imaginary part, as float
    0x06 str       uleb n, then n bytes of UTF-8 (strict: no lone surrogates)
    0x07 bytes     uleb n, then n bytes
    0x08 list      uleb count, then count values
    0x09 tuple     uleb count, then count values
    0x0A dict      uleb count, then count pairs of key (a str or int value) and value
    0x0B ndarray   dtype code u8, ndim u8 (<= 64), ndim dimensions as u64 little-endian,
                   zero bytes up to the next multiple of 8 from the start of the encoding,
                   then prod(shape) * itemsize bytes of data in C order, native byte order
                   (little-endian on every platform trioring runs on)

The padding puts every array's data at an offset that is a multiple of 8 from the start of
the encoding, so that ``decode(buffer, copy=False)`` returns aligned views when the buffer
itself is 8-aligned (numpy's allocations are).
"""

from __future__ import annotations

import struct
import sys
from typing import TYPE_CHECKING, Any, final

import numpy as np

from ._errors import InvalidArgumentError, ProtocolError
from ._wire import DTYPE_CODES, DTYPES

if TYPE_CHECKING:
    from typing import TypeAlias

    #: What :func:`decode` reads, and the pieces :func:`encode_buffers` returns.
    Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray[Any, Any]
    Piece: TypeAlias = bytes | bytearray | memoryview

__all__ = [
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_INT_BYTES",
    "VERSION",
    "decode",
    "encode",
    "encode_array",
    "encode_buffers",
]

VERSION = 1
#: Default bounds (see the module docstring).
MAX_DEPTH = 100
MAX_ELEMENTS = 1_000_000
MAX_INT_BYTES = 1 << 20
#: The largest ``max_depth`` either side accepts: the codec recurses once per level.
DEPTH_LIMIT = 200
#: The smallest encoding: the version byte and one tag (``None``, ``False``, ``True``).
MIN_ENCODED_BYTES = 2
#: numpy's limit on dimensions (64 since numpy 2).
MAX_NDIM = 64
#: Arrays up to this size are copied into the header buffer; larger ones travel as their
#: own buffer in :func:`encode_buffers` (no copy until the buffers are joined).
_INLINE_ARRAY_BYTES = 4096

NONE, FALSE, TRUE, INT, FLOAT, COMPLEX, STR, BYTES, LIST, TUPLE, DICT, NDARRAY = range(12)
_FLOAT = struct.Struct("<d")
_COMPLEX = struct.Struct("<dd")
_U64 = struct.Struct("<Q")
_TAG_NAMES = (
    *("None", "False", "True", "int", "float", "complex"),
    *("str", "bytes", "list", "tuple", "dict", "ndarray"),
)
if sys.byteorder != "little":  # pragma: no cover - trioring's wire format is little-endian
    raise ImportError("trioring's object codec needs a little-endian machine")


def _type_name(value: object) -> str:
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _key_path(key: str | int) -> str:
    if type(key) is str:
        escaped = key.replace("\\", "\\\\").replace('"', '\\"')
        return f'["{escaped}"]'
    return f"[{key}]"


#: Where a value is inside the encoded object: the name of the whole (a str), or (where its
#: container is, the index of a list or tuple item) or (where its dict is, the key, None).
#: Rendered as text (``obj["cfg"][2]``) only when a value is refused: building that text
#: for every value took 9 % of the encoding of a 3-key dict (15.5 against 14.1 us) and 20 %
#: of a list of 1,000 ints' (1326 against 1054 us; 2 vCPUs, AMD EPYC).
_Path = str | tuple[Any, ...]


def _path_text(path: _Path) -> str:
    """``path`` as the text an error shows: ``obj["cfg"][2]``."""
    steps: list[str] = []
    while type(path) is tuple:
        if len(path) == 2:
            path, index = path
            steps.append(f"[{index}]")
        else:
            path, key, _ = path
            steps.append(_key_path(key))
    assert type(path) is str
    return path + "".join(reversed(steps))


def _check_bounds(max_depth: int, max_elements: int, max_int_bytes: int) -> None:
    if not 0 <= max_depth <= DEPTH_LIMIT:
        raise ValueError(f"max_depth must be in 0..{DEPTH_LIMIT}, not {max_depth}")
    if max_elements < 1 or max_int_bytes < 1:
        raise ValueError("max_elements and max_int_bytes must be at least 1")


# -- encoding ---------------------------------------------------------------------------------


def _uleb(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _refuse_array(value: np.ndarray[Any, Any]) -> str | None:
    """Why ``value`` (an exact ndarray) cannot be encoded, or None."""
    dtype = value.dtype
    if dtype in DTYPE_CODES:
        return None
    if dtype.hasobject and dtype.names is None:
        return "numpy.ndarray of dtype object is not supported (its elements are objects)"
    if dtype.names is not None:
        return f"numpy.ndarray of structured dtype {dtype} is not supported"
    if dtype.byteorder not in "=|" and dtype.newbyteorder("=") in DTYPE_CODES:
        return (
            f"numpy.ndarray of dtype {dtype.str} is not in native byte order; convert with "
            f".astype({dtype.name!r})"
        )
    supported = ", ".join(dt.name for dt in DTYPE_CODES)
    return f"numpy.ndarray of dtype {dtype} is not supported; supported dtypes: {supported}"


@final
class _Encoder:
    __slots__ = (
        *("buf", "elements", "flushed", "max_depth", "max_elements", "max_int_bytes"),
        "parts",
    )

    def __init__(self, max_depth: int, max_elements: int, max_int_bytes: int) -> None:
        self.parts: list[Piece] = []
        self.buf = bytearray((VERSION,))
        self.flushed = 0  # bytes in self.parts
        self.elements = 0
        self.max_depth = max_depth
        self.max_elements = max_elements
        self.max_int_bytes = max_int_bytes

    def refuse(self, path: _Path, message: str) -> InvalidArgumentError:
        text = _path_text(path)
        if len(text) > 200:  # deep nesting: its start and its end say where
            text = f"{text[:90]} ... {text[-90:]}"
        return InvalidArgumentError(f"{text}: {message}")

    def value(self, value: object, path: _Path, depth: int) -> None:
        self.elements += 1
        if self.elements > self.max_elements:
            raise self.refuse(
                path,
                f"more than {self.max_elements:,} values in all; send bulk data as numpy "
                "arrays (an array counts as one value)",
            )
        buf = self.buf
        if value is None:
            buf.append(NONE)
        elif type(value) is bool:
            buf.append(TRUE if value else FALSE)
        elif type(value) is int:
            self.encode_int(value, path)
        elif type(value) is float:
            buf.append(FLOAT)
            buf += _FLOAT.pack(value)
        elif type(value) is str:
            try:
                data = value.encode()
            except UnicodeEncodeError:
                raise self.refuse(
                    path, "str that is not valid Unicode (a lone surrogate) is not supported"
                ) from None
            buf.append(STR)
            _uleb(buf, len(data))
            buf += data
        elif type(value) is bytes:
            buf.append(BYTES)
            _uleb(buf, len(value))
            buf += value
        elif type(value) is list or type(value) is tuple or type(value) is dict:
            if depth >= self.max_depth:
                raise self.refuse(
                    path,
                    f"more than {self.max_depth} containers nested in one another (or a "
                    "container that contains itself)",
                )
            if type(value) is dict:
                self.encode_dict(value, path, depth + 1)
            else:
                buf.append(LIST if type(value) is list else TUPLE)
                _uleb(buf, len(value))
                for i, item in enumerate(value):
                    self.value(item, (path, i), depth + 1)
        elif type(value) is complex:
            buf.append(COMPLEX)
            buf += _COMPLEX.pack(value.real, value.imag)
        elif type(value) is np.ndarray:
            self.encode_array(value, path)
        else:
            raise self.refuse(path, self.unsupported(value))

    @staticmethod
    def unsupported(value: object) -> str:
        name = _type_name(value)
        if isinstance(value, np.generic):
            return f"{name} is not supported (a numpy scalar: convert with .item(), or send np.asarray(x))"
        if isinstance(value, np.ndarray):
            return f"{name} is not supported (an ndarray subclass: send np.asarray(x))"
        if isinstance(value, (bool, int, float, complex, str, bytes, list, tuple, dict)):
            base = next(
                t
                for t in (int, float, complex, str, bytes, list, tuple, dict)
                if isinstance(value, t)
            )
            return (
                f"{name} is not supported (a subclass of {base.__name__}: convert it with "
                f"{base.__name__}(x))"
            )
        if isinstance(value, (set, frozenset)):
            return f"{name} is not supported (convert it to a list or a tuple)"
        # Say what does travel, where the reader looks: the message, not the docs.
        return (
            f"{name} is not supported (objects travel without pickle: None, bool, int, "
            "float, complex, str, bytes, list, tuple, dict with str or int keys, and numpy "
            "arrays; convert it to those, e.g. a dataclass with dataclasses.asdict)"
        )

    def encode_int(self, value: int, path: _Path) -> None:
        n = (value if value >= 0 else ~value).bit_length() // 8 + 1
        if n > self.max_int_bytes:
            raise self.refuse(
                path, f"int of {n:,} bytes is larger than the limit of {self.max_int_bytes:,}"
            )
        buf = self.buf
        buf.append(INT)
        _uleb(buf, n)
        buf += value.to_bytes(n, "little", signed=True)

    def encode_dict(self, value: dict[Any, Any], path: _Path, depth: int) -> None:
        buf = self.buf
        buf.append(DICT)
        _uleb(buf, len(value))
        for key, item in value.items():
            if type(key) is not str and type(key) is not int:
                raise self.refuse(
                    path,
                    f"dict key {key!r:.60} of type {_type_name(key)} is not supported (keys "
                    "must be str or int)",
                )
            here = (path, key, None)
            self.value(key, here, depth)
            self.value(item, here, depth)

    def encode_array(self, value: np.ndarray[Any, Any], path: _Path) -> None:
        why = _refuse_array(value)
        if why is not None:
            raise self.refuse(path, why)
        buf = self.buf
        buf.append(NDARRAY)
        buf.append(DTYPE_CODES[value.dtype])
        buf.append(value.ndim)
        for dim in value.shape:
            buf += _U64.pack(dim)
        buf += bytes(-(self.flushed + len(buf)) % 8)
        if not value.flags.c_contiguous:
            value = value.copy(order="C")
        raw = value.reshape(-1).view(np.uint8)
        if raw.nbytes <= _INLINE_ARRAY_BYTES:
            buf += raw.data
        else:
            self.parts.append(buf)
            self.parts.append(raw.data)
            self.flushed += len(buf) + raw.nbytes
            self.buf = bytearray()

    def finish(self) -> list[Piece]:
        if self.buf:
            self.parts.append(self.buf)
        return self.parts


def encode_buffers(
    obj: object,
    *,
    path: str = "obj",
    max_depth: int = MAX_DEPTH,
    max_elements: int = MAX_ELEMENTS,
    max_int_bytes: int = MAX_INT_BYTES,
) -> list[Piece]:
    """The encoding of ``obj`` as a list of buffers whose concatenation is
    :func:`encode`'s result. Large arrays are not copied: their buffers are views of the
    arrays' data (of a C-order copy for a non-contiguous one), valid while the arrays are
    unchanged.

    Raises:
        InvalidArgumentError: ``obj`` holds a value of an unsupported type, or exceeds a
            bound; the message names the type and its path inside ``obj``
            (``obj["cfg"][2]: set is not supported``), which starts with ``path``.
        ValueError: a bound out of range (``max_depth`` in ``0..200``, the others >= 1).
    """
    _check_bounds(max_depth, max_elements, max_int_bytes)
    encoder = _Encoder(max_depth, max_elements, max_int_bytes)
    encoder.value(obj, path, 0)
    return encoder.finish()


def encode(
    obj: object,
    *,
    max_depth: int = MAX_DEPTH,
    max_elements: int = MAX_ELEMENTS,
    max_int_bytes: int = MAX_INT_BYTES,
) -> bytes:
    """The encoding of ``obj`` (see the module docstring), as one ``bytes``. Errors: see
    :func:`encode_buffers`."""
    parts = encode_buffers(
        obj, max_depth=max_depth, max_elements=max_elements, max_int_bytes=max_int_bytes
    )
    return b"".join(parts)


def encode_array(obj: object, path: str = "obj") -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    """The encoding of ``obj`` (with the default bounds) as a new, writable uint8 array:
    what the object collectives send. Each byte is copied once: an object without large
    arrays is encoded straight into the array's memory. Errors: see
    :func:`encode_buffers`."""
    parts = encode_buffers(obj, path=path)
    if len(parts) == 1 and type(parts[0]) is bytearray:
        # The encoder's own buffer, which nothing else references: the array can be it.
        return np.frombuffer(parts[0], np.uint8)
    out = np.empty(sum(memoryview(part).nbytes for part in parts), np.uint8)
    at = 0
    for part in parts:
        piece = np.frombuffer(part, np.uint8)
        out[at : at + piece.size] = piece
        at += piece.size
    return out


# -- decoding ---------------------------------------------------------------------------------


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
            return _FLOAT.unpack_from(self.data, self.take(8, "a float"))[0]
        if tag == COMPLEX:
            real, imag = _COMPLEX.unpack_from(self.data, self.take(16, "a complex"))
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
            for _ in range(self.count(_TAG_NAMES[tag], 1)):
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
                name = _TAG_NAMES[tag] if tag < len(_TAG_NAMES) else f"tag 0x{tag:02x}"
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
        shape = tuple(_U64.unpack_from(self.data, at + 8 * i)[0] for i in range(ndim))
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
    of it) encodes; see the module docstring for the format and the bounds.

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
    _check_bounds(max_depth, max_elements, max_int_bytes)
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
