"""The frames of the point-to-point plane, and a decoder that trusts nothing.

Every frame starts with a fixed 56-byte little-endian header::

    magic "TRP2" | version u8 | frame type u8 | kind u8 | dtype u8 | ndim u8 | 3 pad bytes
    tag u32 | comm id u64 | msg id u64 | nbytes u64 | offset u64 | count u64

=========  ====================================================================================
EAGER      a whole small message: ``ndim`` u64 dimensions, then ``nbytes`` of payload.
           ``count`` is the element count, ``offset`` 0.
RTS        "ready to send" a message of ``nbytes``: ``ndim`` u64 dimensions follow, no payload.
           Where the ranks agreed on cross-memory attach (one host), ``offset`` is the address
           of the message in the sender's memory and one more u64 follows the dimensions:
           the address of its guard, a u64 that holds the msg id while the sender keeps the
           bytes unchanged and 0 once it gave up the send (0 for neither: plain DATA).
CTS        receiver -> sender: a receive matched message ``msg id``; send its DATA.
DATA       ``count`` payload bytes of message ``msg id`` at byte ``offset`` (of ``nbytes``).
PULL       sender -> receiver, instead of DATA for an RTS with addresses, after the CTS: the
           receiver may keep what it copies (copied already, or still copying) out of the
           sender's memory; the sender keeps the bytes unchanged until DONE or REJECT.
DONE       receiver -> sender: all of message ``msg id`` landed; the send is complete.
CREDIT     receiver -> sender: ``count`` more bytes of eager credit.
WITHDRAW   sender -> receiver: message ``msg id`` is cancelled; forget it.
REJECT     receiver -> sender: the receive of ``msg id`` was cancelled after its CTS; the
           receiver discards the message's DATA until RESTART.
RESTART    sender -> receiver: no more DATA of ``msg id`` follows from before the REJECT; the
           message waits for a CTS again.
LEFT       the sender closed communicator ``comm id``, or left it on an error, or it broke
           there: it sends nothing more on it and receives nothing more, so the receiver's
           calls that wait for it on that communicator raise. The only frame besides EAGER
           and RTS with a comm id. ``nbytes`` of UTF-8 follow (at most ``MAX_LEFT_BYTES``):
           why it left, none for a plain close; ``count`` is 1 + the world rank whose
           failure it left because of, 0 for none.
=========  ====================================================================================

Message ids count per sender and connection, from 1. Fields a frame type does not use must be
zero, so that the decoder can reject garbage early (a stray byte stream rarely passes).
"""

from __future__ import annotations

import enum
import struct
from typing import final

import attrs
import numpy as np

from .._errors import ProtocolError
from .._wire import DTYPES

MAGIC = b"TRP2"
VERSION = 1
HEADER = struct.Struct("<4sBBBBB3xIQQQQQ")
assert HEADER.size == 56
DIM = struct.Struct("<Q")
#: Tags are ``0 <= tag < TAG_BOUND`` (as MPI guarantees at least 32767, we give 31 bits).
TAG_BOUND = 2**31
#: numpy's own limit on dimensions.
MAX_NDIM = 32
#: No message can be larger than this: 2**56 bytes is far beyond any machine's memory, and
#: keeps every sum of sizes exact in a u64.
MAX_MESSAGE_BYTES = 2**56
#: The most a LEFT frame says of why its sender left (as an ABORT frame's reason).
MAX_LEFT_BYTES = 4096
_UINT8_CODE = DTYPES.index(np.dtype("uint8")) + 1


class FrameType(enum.IntEnum):
    EAGER = 1
    RTS = 2
    CTS = 3
    DATA = 4
    DONE = 5
    CREDIT = 6
    WITHDRAW = 7
    REJECT = 8
    RESTART = 9
    LEFT = 10
    PULL = 11


class MessageKind(enum.IntEnum):
    """What a message carries: the endpoint never looks inside an OBJECT payload."""

    ARRAY = 1
    OBJECT = 2  # uint8 bytes of trioring._objects' codec


_FRAME_TYPES: dict[int, FrameType] = {int(t): t for t in FrameType}
#: The frames about one message id that carry nothing else.
_ID_ONLY = frozenset(
    {
        FrameType.CTS,
        FrameType.DONE,
        FrameType.WITHDRAW,
        FrameType.REJECT,
        FrameType.RESTART,
        FrameType.PULL,
    }
)


@final
@attrs.define
class Frame:
    """A decoded, validated frame header. (Not frozen: a frozen class's ``__init__`` took
    0.83 us against 0.23, for every frame of every message.)"""

    type: FrameType
    kind: int = 0
    dtype_code: int = 0
    ndim: int = 0
    tag: int = 0
    comm_id: int = 0
    msg_id: int = 0
    nbytes: int = 0
    offset: int = 0
    count: int = 0

    @property
    def dtype(self) -> np.dtype[np.generic]:
        return DTYPES[self.dtype_code - 1]


def _bad(detail: str) -> ProtocolError:
    # Without rank or peer: the endpoint raises its own ProtocolError from this one.
    return ProtocolError(detail)


def decode_header(data: bytes | bytearray | memoryview) -> Frame:
    """Decode and validate one header (exactly ``HEADER.size`` bytes). Raises
    :class:`ProtocolError` for anything a correct peer never sends."""
    if len(data) != HEADER.size:
        raise _bad(f"a frame header is {HEADER.size} bytes, got {len(data)}")
    (magic, version, code, kind, dtype, ndim, tag, comm_id, msg_id, nbytes, offset, count) = (
        HEADER.unpack(data)
    )
    if magic != MAGIC:
        raise _bad(f"bad magic {bytes(magic)!r} (not a trioring peer?)")
    if version != VERSION:
        raise _bad(f"unsupported frame version {version}")
    ftype = _FRAME_TYPES.get(code)  # (FrameType(code) costs as much as the rest)
    if ftype is None:
        raise _bad(f"unknown frame type {code}")
    if ftype in (FrameType.EAGER, FrameType.RTS):
        if kind not in (MessageKind.ARRAY, MessageKind.OBJECT):
            raise _bad(f"unknown message kind {kind}")
        if not 0 < dtype <= len(DTYPES):
            raise _bad(f"unknown dtype code {dtype}")
        if kind == MessageKind.OBJECT and dtype != _UINT8_CODE:
            raise _bad("an object message must be uint8 bytes")
        if ndim > MAX_NDIM:
            raise _bad(f"{ndim} dimensions (at most {MAX_NDIM})")
        if tag >= TAG_BOUND:
            raise _bad(f"tag {tag} out of range")
        if nbytes >= MAX_MESSAGE_BYTES or nbytes != count * DTYPES[dtype - 1].itemsize:
            raise _bad(f"{count} elements of {DTYPES[dtype - 1].name} are not {nbytes} bytes")
        if not msg_id or (offset and (ftype is FrameType.EAGER or not nbytes)):
            raise _bad(f"bad {ftype.name} header (offset {offset}, msg id {msg_id})")
        return Frame(ftype, kind, dtype, ndim, tag, comm_id, msg_id, nbytes, offset, count)
    if ftype is FrameType.LEFT:
        if kind or dtype or ndim or tag or msg_id or offset:
            raise _bad("LEFT frame with fields other than the comm id, size and culprit set")
        if nbytes > MAX_LEFT_BYTES or count > 2**32:
            raise _bad(f"LEFT frame with {nbytes} bytes of reason, culprit field {count}")
        return Frame(ftype, comm_id=comm_id, nbytes=nbytes, count=count)
    if kind or dtype or ndim or tag or comm_id:
        raise _bad(f"{ftype.name} frame with message fields set")
    if ftype is FrameType.CREDIT:
        if msg_id or nbytes or offset or not 0 < count < MAX_MESSAGE_BYTES:
            raise _bad(f"bad CREDIT frame (count {count})")
        return Frame(ftype, count=count)
    if not msg_id:
        raise _bad(f"{ftype.name} frame without a message id")
    if ftype is FrameType.DATA:
        if nbytes >= MAX_MESSAGE_BYTES or offset + count > nbytes:
            raise _bad(f"DATA of {count} bytes at {offset} of a {nbytes}-byte message")
        return Frame(ftype, msg_id=msg_id, nbytes=nbytes, offset=offset, count=count)
    assert ftype in _ID_ONLY
    if nbytes or offset or count:
        raise _bad(f"{ftype.name} frame with size fields set")
    return Frame(ftype, msg_id=msg_id)


def decode_shape(data: bytes | bytearray | memoryview, frame: Frame) -> tuple[int, ...]:
    """Decode the ``frame.ndim`` dimensions after an EAGER or RTS header; they must multiply
    to the header's element count."""
    if len(data) != DIM.size * frame.ndim:
        raise _bad(f"{frame.ndim} dimensions are {DIM.size * frame.ndim} bytes, got {len(data)}")
    shape = tuple(dim for (dim,) in DIM.iter_unpack(data))
    product = 1
    for dim in shape:
        product *= dim
    if product != frame.count:
        raise _bad(f"shape {shape} does not hold {frame.count} elements")
    return shape


def pack_message(
    ftype: FrameType,
    kind: int,
    dtype_code: int,
    shape: tuple[int, ...],
    tag: int,
    comm_id: int,
    msg_id: int,
    nbytes: int,
    count: int,
    *,
    address: int = 0,
    guard: int = 0,
) -> bytes:
    """The header and shape of an EAGER or RTS frame (an EAGER's payload follows); an RTS
    with ``address`` (of the message) and ``guard`` offers cross-memory attach."""
    head = HEADER.pack(
        MAGIC, VERSION, ftype, kind, dtype_code, len(shape), tag, comm_id, msg_id, nbytes,
        address, count,
    )  # fmt: skip
    dims = b"".join(DIM.pack(dim) for dim in shape)
    return head + dims + DIM.pack(guard) if address else head + dims


def pack_data(msg_id: int, nbytes: int, offset: int, count: int) -> bytes:
    """The header of a DATA frame of ``count`` bytes at ``offset`` of an ``nbytes`` message."""
    return HEADER.pack(MAGIC, VERSION, FrameType.DATA, 0, 0, 0, 0, 0, msg_id, nbytes, offset, count)


def pack_control(ftype: FrameType, msg_id: int) -> bytes:
    """A CTS, DONE, WITHDRAW, REJECT, RESTART or PULL frame."""
    assert ftype in _ID_ONLY
    return HEADER.pack(MAGIC, VERSION, ftype, 0, 0, 0, 0, 0, msg_id, 0, 0, 0)


def pack_credit(amount: int) -> bytes:
    """A CREDIT frame giving back ``amount`` bytes of eager credit."""
    return HEADER.pack(MAGIC, VERSION, FrameType.CREDIT, 0, 0, 0, 0, 0, 0, 0, 0, amount)


@final
@attrs.frozen
class Leaving:
    """Why a rank left a communicator, as its LEFT frame says: ``text`` completes "rank 2
    left this communicator ..." ("on ValueError: bad batch"); ``culprit``, a world rank, is
    set when it left only because that rank failed (its failure is what to report)."""

    text: str
    culprit: int | None = None


def pack_left(comm_id: int, why: Leaving | None = None) -> bytes:
    """A LEFT frame: this rank closed communicator ``comm_id`` (``why`` None), or left it
    for the reason ``why`` (cut to ``MAX_LEFT_BYTES``)."""
    text = b"" if why is None else why.text.encode("utf-8", "replace")[:MAX_LEFT_BYTES]
    culprit = 0 if why is None or why.culprit is None else why.culprit + 1
    head = HEADER.pack(
        MAGIC, VERSION, FrameType.LEFT, 0, 0, 0, 0, comm_id, 0, len(text), 0, culprit
    )
    return head + text


def decode_leaving(data: bytes | bytearray | memoryview, frame: Frame) -> Leaving | None:
    """The reason that follows a LEFT header (``frame.nbytes`` bytes), None for a plain
    close. A cut in the middle of a character shows as a replacement character."""
    if not frame.nbytes and not frame.count:
        return None
    culprit = frame.count - 1 if frame.count else None
    return Leaving(bytes(data).decode("utf-8", "replace"), culprit)
