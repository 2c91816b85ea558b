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

# One module per side: _format holds what both sides share (the tags, the bounds, how a
# value's place is named), _encode and _decode the two directions.
from ._decode import decode as decode
from ._encode import (
    encode as encode,
    encode_array as encode_array,
    encode_buffers as encode_buffers,
)
from ._format import (
    DEPTH_LIMIT as DEPTH_LIMIT,
    MAX_DEPTH as MAX_DEPTH,
    MAX_ELEMENTS as MAX_ELEMENTS,
    MAX_INT_BYTES as MAX_INT_BYTES,
    MIN_ENCODED_BYTES as MIN_ENCODED_BYTES,
    NDARRAY as NDARRAY,
    VERSION as VERSION,
)

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
