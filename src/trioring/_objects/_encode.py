"""Encoding: Python objects to the codec's bytes (the format: see
:mod:`trioring._objects`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import numpy as np

from .._errors import InvalidArgumentError
from .._util import is_torch_tensor
from .._wire import DTYPE_CODES
from ._format import (
    BYTES,
    COMPLEX,
    COMPLEX128,
    DICT,
    FALSE,
    FLOAT,
    FLOAT64,
    INLINE_ARRAY_BYTES,
    INT,
    LIST,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_INT_BYTES,
    NDARRAY,
    NONE,
    STR,
    TRUE,
    TUPLE,
    U64,
    VERSION,
    ValuePath,
    check_bounds,
    path_text,
    type_name,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    #: The pieces :func:`encode_buffers` returns.
    Piece: TypeAlias = bytes | bytearray | memoryview


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

    def refuse(self, path: ValuePath, message: str) -> InvalidArgumentError:
        text = path_text(path)
        if len(text) > 200:  # deep nesting: its start and its end say where
            text = f"{text[:90]} ... {text[-90:]}"
        return InvalidArgumentError(f"{text}: {message}")

    def value(self, value: object, path: ValuePath, depth: int) -> None:
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
            buf += FLOAT64.pack(value)
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
            buf += COMPLEX128.pack(value.real, value.imag)
        elif type(value) is np.ndarray:
            self.encode_array(value, path)
        else:
            raise self.refuse(path, self.unsupported(value))

    @staticmethod
    def unsupported(value: object) -> str:
        name = type_name(value)
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
        if is_torch_tensor(value):
            return f"{name} is not supported (send t.detach().cpu().numpy(), a numpy array)"
        # Say what does travel, where the reader looks: the message, not the docs.
        return (
            f"{name} is not supported (objects travel without pickle: None, bool, int, "
            "float, complex, str, bytes, list, tuple, dict with str or int keys, and numpy "
            "arrays; convert it to those, e.g. a dataclass with dataclasses.asdict)"
        )

    def encode_int(self, value: int, path: ValuePath) -> None:
        n = (value if value >= 0 else ~value).bit_length() // 8 + 1
        if n > self.max_int_bytes:
            raise self.refuse(
                path, f"int of {n:,} bytes is larger than the limit of {self.max_int_bytes:,}"
            )
        buf = self.buf
        buf.append(INT)
        _uleb(buf, n)
        buf += value.to_bytes(n, "little", signed=True)

    def encode_dict(self, value: dict[Any, Any], path: ValuePath, depth: int) -> None:
        buf = self.buf
        buf.append(DICT)
        _uleb(buf, len(value))
        for key, item in value.items():
            if type(key) is not str and type(key) is not int:
                raise self.refuse(
                    path,
                    f"dict key {key!r:.60} of type {type_name(key)} is not supported (keys "
                    "must be str or int)",
                )
            here = (path, key, None)
            self.value(key, here, depth)
            self.value(item, here, depth)

    def encode_array(self, value: np.ndarray[Any, Any], path: ValuePath) -> None:
        why = _refuse_array(value)
        if why is not None:
            raise self.refuse(path, why)
        buf = self.buf
        buf.append(NDARRAY)
        buf.append(DTYPE_CODES[value.dtype])
        buf.append(value.ndim)
        for dim in value.shape:
            buf += U64.pack(dim)
        buf += bytes(-(self.flushed + len(buf)) % 8)
        if not value.flags.c_contiguous:
            value = value.copy(order="C")
        raw = value.reshape(-1).view(np.uint8)
        if raw.nbytes <= INLINE_ARRAY_BYTES:
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
    check_bounds(max_depth, max_elements, max_int_bytes)
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
    """The encoding of ``obj`` (see :mod:`trioring._objects`), as one ``bytes``. Errors: see
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
