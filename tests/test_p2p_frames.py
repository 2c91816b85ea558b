"""The point-to-point frame codec: round trips, and a decoder that only ever raises
ProtocolError on garbage."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

from trioring._errors import ProtocolError
from trioring._p2p._frames import (
    DIM,
    HEADER,
    FrameType,
    MessageKind,
    decode_header,
    decode_shape,
    pack_control,
    pack_credit,
    pack_data,
    pack_message,
)
from trioring._wire import DTYPE_CODES


def test_message_round_trip() -> None:
    code = DTYPE_CODES[np.dtype("float32")]
    data = pack_message(FrameType.RTS, MessageKind.ARRAY, code, (2, 3, 4), 7, 2**63, 9, 96, 24)
    frame = decode_header(data[: HEADER.size])
    assert frame.type is FrameType.RTS
    assert (frame.kind, frame.tag, frame.comm_id, frame.msg_id) == (1, 7, 2**63, 9)
    assert (frame.nbytes, frame.count, frame.ndim, frame.dtype) == (96, 24, 3, np.float32)
    assert decode_shape(data[HEADER.size :], frame) == (2, 3, 4)


def test_zero_d_and_control_round_trips() -> None:
    code = DTYPE_CODES[np.dtype("int64")]
    data = pack_message(FrameType.EAGER, MessageKind.ARRAY, code, (), 0, 1, 1, 8, 1)
    frame = decode_header(data)
    assert decode_shape(b"", frame) == ()
    assert decode_header(pack_data(5, 100, 40, 60)).offset == 40
    assert decode_header(pack_credit(1234)).count == 1234
    for ftype in (FrameType.CTS, FrameType.DONE, FrameType.WITHDRAW):
        assert decode_header(pack_control(ftype, 3)).type is ftype
    assert decode_header(pack_control(FrameType.PULL, 3)).type is FrameType.PULL
    code = DTYPE_CODES[np.dtype("uint8")]
    offered = pack_message(
        FrameType.RTS, MessageKind.ARRAY, code, (5,), 0, 1, 2, 5, 5, address=4096, guard=8192
    )
    frame = decode_header(offered[: HEADER.size])
    assert frame.offset == 4096
    assert decode_shape(offered[HEADER.size : HEADER.size + 8], frame) == (5,)
    assert DIM.unpack(offered[HEADER.size + 8 :]) == (8192,)


def _offered(ftype: FrameType, nbytes: int) -> bytes:
    """An EAGER or RTS header with an address (only an RTS of some bytes may have one)."""
    code = DTYPE_CODES[np.dtype("uint8")]
    frame = pack_message(ftype, MessageKind.ARRAY, code, (nbytes,), 0, 1, 2, nbytes, nbytes,
                         address=4096, guard=8192)  # fmt: skip
    return frame[: HEADER.size]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"XXXX" + pack_credit(1)[4:], "magic"),
        (pack_credit(1)[:4] + b"\x02" + pack_credit(1)[5:], "version"),
        (pack_credit(0), "CREDIT"),
        (pack_data(1, 10, 5, 6), "DATA of 6 bytes at 5"),
        (pack_control(FrameType.CTS, 0), "without a message id"),
        (pack_control(FrameType.PULL, 0), "without a message id"),
        (_offered(FrameType.EAGER, 8), "bad EAGER header \\(offset 4096"),
        (_offered(FrameType.RTS, 0), "bad RTS header \\(offset 4096"),
        (b"short", "header is 56 bytes"),
    ],
)
def test_bad_headers(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_header(data)


def test_shape_must_hold_the_count() -> None:
    code = DTYPE_CODES[np.dtype("uint8")]
    data = pack_message(FrameType.RTS, MessageKind.ARRAY, code, (2, 3), 0, 1, 1, 6, 6)
    frame = decode_header(data[: HEADER.size])
    with pytest.raises(ProtocolError, match="does not hold"):
        decode_shape(DIM.pack(2) + DIM.pack(4), frame)


def _valid_headers(rng: random.Random) -> list[bytes]:
    code = rng.randint(1, len(DTYPE_CODES))
    itemsize = list(DTYPE_CODES)[code - 1].itemsize
    count = rng.randint(0, 1000)
    return [
        pack_message(
            FrameType.EAGER, 1, code, (count,), rng.randint(0, 2**31 - 1), rng.getrandbits(64),
            rng.randint(1, 2**40), count * itemsize, count,
        )[: HEADER.size],
        pack_data(rng.randint(1, 99), 100, 10, 90),
        pack_control(FrameType(rng.randint(7, 9)), rng.randint(1, 2**64 - 1)),
        pack_credit(rng.randint(1, 2**40)),
    ]  # fmt: skip


def test_fuzz_decoder() -> None:
    """100,000 random and mutated headers: a valid frame or ProtocolError, nothing else."""
    rng = random.Random(20240611)
    valid = 0
    for i in range(100_000):
        if i % 4 == 0:
            data = bytearray(rng.randbytes(HEADER.size))
            data[:5] = b"TRP2\x01"  # get past the magic, to test the rest
        else:
            data = bytearray(rng.choice(_valid_headers(rng)))
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            frame = decode_header(bytes(data))
        except ProtocolError:
            continue
        valid += 1
        if frame.type in (FrameType.EAGER, FrameType.RTS):
            with contextlib.suppress(ProtocolError):
                decode_shape(rng.randbytes(DIM.size * frame.ndim), frame)
    assert valid > 1000  # the mutations leave many headers valid: the test reaches deep


def test_left_round_trip_and_stray_fields() -> None:
    from trioring._p2p._frames import (
        HEADER,
        MAGIC,
        MAX_LEFT_BYTES,
        VERSION,
        FrameType,
        Leaving,
        decode_header,
        decode_leaving,
        pack_left,
    )

    def round_trip(comm_id: int, why: Leaving | None) -> Leaving | None:
        data = pack_left(comm_id, why)
        frame = decode_header(data[: HEADER.size])
        assert (frame.type, frame.comm_id, frame.msg_id) == (FrameType.LEFT, comm_id, 0)
        assert len(data) == HEADER.size + frame.nbytes
        return decode_leaving(data[HEADER.size :], frame)

    assert round_trip(2**64 - 1, None) is None  # a plain close: nothing follows the header
    assert len(pack_left(7)) == HEADER.size
    why = Leaving("on ValueError: b\u00e4d batch", culprit=None)
    assert round_trip(7, why) == why
    assert round_trip(7, Leaving("on PeerFailedError: ...", culprit=0)) == Leaving(
        "on PeerFailedError: ...", culprit=0
    )
    assert round_trip(7, Leaving("", culprit=5)) == Leaving("", culprit=5)
    # Cut to the bound, in the middle of a two-byte character: the cut shows, nothing fails.
    cut = round_trip(7, Leaving("x" + "\u00e4" * MAX_LEFT_BYTES))
    assert cut == Leaving("x" + "\u00e4" * ((MAX_LEFT_BYTES - 1) // 2) + "\ufffd")
    for fields in [
        (0, 0, 0, 0, 5, 9, 0, 0, 0),  # a message id
        (0, 0, 0, 7, 5, 0, 0, 0, 0),  # a tag
        (0, 0, 0, 0, 5, 0, 0, 3, 0),  # an offset
        (0, 0, 0, 0, 5, 0, MAX_LEFT_BYTES + 1, 0, 0),  # too long a reason
        (0, 0, 0, 0, 5, 0, 0, 0, 2**32 + 1),  # no such rank
    ]:
        with pytest.raises(ProtocolError, match="LEFT"):
            decode_header(HEADER.pack(MAGIC, VERSION, FrameType.LEFT, *fields))
