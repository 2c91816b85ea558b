"""Waiting point-to-point calls that take frames off their sockets themselves
(trioring._p2p._reading.Reading._poll and _take_waiting): only whole frames, only while the
connection's reader is between frames, in order with what the reader takes, with the
reader's errors, and with the schedule point every call owes."""

from __future__ import annotations

import contextlib
import random
import socket
from typing import TYPE_CHECKING

import numpy as np
import pytest
import trio
import trio.testing

from trioring._errors import PeerFailedError, ProtocolError
from trioring._p2p import Endpoint, MessageKind, Scope
from trioring._p2p._frames import HEADER, FrameType, pack_message
from trioring._p2p._peer import READ_WHOLE_BYTES
from trioring._wire import DTYPE_CODES
from trioring.transports._socket import SocketConnection

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

COMM = 1
#: Long enough that a receive polls for as long as these tests write.
POLL = 0.05


def eager_frame(array: np.ndarray, tag: int, msg_id: int) -> bytes:
    """An EAGER frame of ``array`` as a peer writes it."""
    head = pack_message(
        FrameType.EAGER, MessageKind.ARRAY, DTYPE_CODES[array.dtype], array.shape, tag, COMM,
        msg_id, array.nbytes, array.size,
    )  # fmt: skip
    return head + array.tobytes()


@contextlib.asynccontextmanager
async def facing_a_raw_peer(*, spin: float = POLL) -> AsyncIterator[tuple[Endpoint, socket.socket]]:
    """Rank 0's endpoint, running, and the other end of its connection to rank 1 as a plain
    blocking socket the test writes frames into; the reader is parked between frames."""
    ours, theirs = socket.socketpair()
    endpoint = Endpoint(
        rank=0,
        connections={1: SocketConnection(trio.socket.from_stdlib_socket(ours))},
        spin_seconds=spin,
    )
    endpoint.register(Scope(COMM, 0, (0, 1)))
    with trio.fail_after(20), theirs:
        async with trio.open_nursery() as nursery:
            await nursery.start(endpoint.run)
            await trio.testing.wait_all_tasks_blocked()
            yield endpoint, theirs
            await endpoint.aclose()


async def recv(endpoint: Endpoint, tag: int = 0) -> np.ndarray:
    _, got = await endpoint.recv(Scope(COMM, 0, (0, 1)), 1, tag)
    return got


@pytest.mark.parametrize("spin", [0.0, POLL], ids=["one-look", "polling"])
@pytest.mark.parametrize("n", [10, 5000], ids=["small", "beyond-the-first-peek"])
async def test_a_frame_waiting_on_the_socket_is_taken_by_the_receive(spin: float, n: int) -> None:
    """A message on the socket when the receive starts is taken by the receive itself, at
    its first look (where polling is off too), which still checkpoints; a frame too large
    to take whole is left to the reader, and the one after it goes in order."""
    small = np.arange(n, dtype=np.int32)
    large = np.arange(READ_WHOLE_BYTES // 8 + 1, dtype=np.float64)
    async with facing_a_raw_peer(spin=spin) as (endpoint, theirs):
        theirs.sendall(eager_frame(small, 0, 1))
        with trio.testing.assert_checkpoints():
            np.testing.assert_array_equal(await recv(endpoint), small)
        assert endpoint.taken_by_waits == 1
        theirs.sendall(eager_frame(large, 0, 2) + eager_frame(small + 1, 0, 3))
        np.testing.assert_array_equal(await recv(endpoint), large)
        np.testing.assert_array_equal(await recv(endpoint), small + 1)
        assert endpoint.taken_by_waits in (1, 2)  # the last: the reader's or the receive's


async def test_a_frame_partly_there_is_left_to_the_reader() -> None:
    """A receive that finds a whole frame and the start of the next takes the whole one
    only: the rest stays on the socket, and the reader reads that frame whole."""
    first, second = np.arange(6, dtype=np.int64), np.arange(9, dtype=np.uint16)
    frame = eager_frame(second, 0, 2)
    for cut in (30, HEADER.size + 4, len(frame) - 1):
        async with facing_a_raw_peer(spin=0.0) as (endpoint, theirs):
            theirs.sendall(eager_frame(first, 0, 1) + frame[:cut])
            np.testing.assert_array_equal(await recv(endpoint), first)
            assert endpoint.taken_by_waits == 1

            async def second_one() -> None:
                np.testing.assert_array_equal(await recv(endpoint), second)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(second_one)
                await trio.testing.wait_all_tasks_blocked()
                theirs.sendall(frame[cut:])
            assert endpoint.taken_by_waits == 1


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_frames_cut_anywhere_arrive_whole_and_in_order(seed: int) -> None:
    """Frames written in pieces cut at random points, while a receive polls: whoever takes
    each frame (the receive, whole frames only, or the reader, which may be inside a frame
    when the receive looks), every message arrives whole and in order."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 100, 5000, 60_000, READ_WHOLE_BYTES + 8]) for _ in range(40)]
    arrays = [np.full(n // 4, i, np.int32) for i, n in enumerate(sizes)]
    frames = [eager_frame(a, 5, i + 1) for i, a in enumerate(arrays)]
    stream = b"".join(frames)
    # Half of the frame boundaries, and as many points anywhere.
    ends = np.cumsum([len(frame) for frame in frames])[:-1].tolist()
    cuts = sorted({*rng.sample(ends, len(ends) // 2), *rng.sample(range(1, len(stream)), 20)})
    async with facing_a_raw_peer() as (endpoint, theirs):

        async def write() -> None:
            for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
                theirs.sendall(stream[start:end])
                for _ in range(rng.randrange(1, 8)):
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            for array in arrays:
                np.testing.assert_array_equal(await recv(endpoint, 5), array)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GARBAGE!" * 10,
        HEADER.pack(b"TRP2", 1, 3, 0, 0, 0, 0, 0, 5, 0, 0, 0),
        HEADER.pack(b"TRP2", 1, 4, 0, 0, 0, 0, 0, 77, 10, 0, 10) + b"x" * 10,
    ],
    ids=["bad-magic", "cts-for-nothing", "data-for-unknown-id"],
)
async def test_garbage_seen_by_a_waiting_receive_is_a_protocol_error(garbage: bytes) -> None:
    """Garbage that a polling receive looks at fails the peer as the reader would (a DATA
    frame it leaves to the reader), and the connection closes."""
    async with facing_a_raw_peer() as (endpoint, theirs):
        theirs.sendall(garbage)
        with pytest.raises(ProtocolError, match="peer rank 1") as info:
            await recv(endpoint)
        assert info.value.peer == 1
        assert isinstance(endpoint.peer_error(1), ProtocolError)
        await trio.testing.wait_all_tasks_blocked()  # the reader closes the connection
        theirs.settimeout(10)
        try:
            rest = theirs.recv(100)
        except ConnectionResetError:  # (closed with the garbage unread)
            rest = b""
        assert rest == b""


async def test_a_peer_that_closes_while_a_receive_polls() -> None:
    async with facing_a_raw_peer() as (endpoint, theirs):

        async def close_soon() -> None:
            await trio.sleep(0.001)
            theirs.shutdown(socket.SHUT_RDWR)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_soon)
            with pytest.raises(PeerFailedError, match="peer rank 1"):
                await recv(endpoint)
