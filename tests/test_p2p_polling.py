"""Waiting point-to-point calls that take frames off their sockets themselves
(trioring._p2p._polling.Polling._poll and _take_waiting): only whole frames, only while the
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

from trioring._errors import InvalidArgumentError, PeerFailedError, ProtocolError
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
    its first look (where polling is off too), which still checkpoints; so is a large one
    waiting whole, and the one after it, in order."""
    small = np.arange(n, dtype=np.int32)
    large = np.arange(READ_WHOLE_BYTES // 8 + 1, dtype=np.float64)
    async with facing_a_raw_peer(spin=spin) as (endpoint, theirs):
        theirs.sendall(eager_frame(small, 0, 1))
        with trio.testing.assert_checkpoints():
            np.testing.assert_array_equal(await recv(endpoint), small)
        assert endpoint.taken_by_waits == 1
        theirs.sendall(eager_frame(large, 0, 2) + eager_frame(small + 1, 0, 3))
        with trio.testing.assert_checkpoints():
            np.testing.assert_array_equal(await recv(endpoint), large)
        assert endpoint.taken_by_waits >= 2
        np.testing.assert_array_equal(await recv(endpoint), small + 1)
        assert endpoint.taken_by_waits in (2, 3)  # the last: the reader's or the receive's


@pytest.mark.parametrize("spin", [0.0, POLL], ids=["one-look", "polling"])
async def test_a_large_message_waiting_whole_lands_in_out(spin: float) -> None:
    """A large EAGER message waiting whole on the socket is read by the receive straight
    into its ``out`` (the result is ``out``, or its view in the message's shape); without
    ``out`` into a new array; one for another tag stays queued, in its own array, and the
    receive's ``out`` stays untouched until its own message."""
    # (Each write fits the socket's buffer: the test writes with blocking calls.)
    large = np.arange(2 * (READ_WHOLE_BYTES // 16), dtype=np.float64).reshape(2, -1)
    async with facing_a_raw_peer(spin=spin) as (endpoint, theirs):
        out = np.zeros(large.size + 5)
        theirs.sendall(eager_frame(large, 0, 1))
        _, got = await endpoint.recv(Scope(COMM, 0, (0, 1)), 1, 0, out)
        assert got.shape == large.shape
        assert np.shares_memory(got, out)
        np.testing.assert_array_equal(got, large)
        assert not out[large.size :].any()
        theirs.sendall(eager_frame(large + 1, 0, 2))
        np.testing.assert_array_equal(await recv(endpoint), large + 1)
        assert endpoint.taken_by_waits == 2

        out = np.zeros_like(large)

        async def receive_tag_0() -> None:
            _, got = await endpoint.recv(Scope(COMM, 0, (0, 1)), 1, 0, out)
            assert got is out

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_tag_0)
            await trio.testing.wait_all_tasks_blocked()
            theirs.sendall(eager_frame(large + 2, 7, 3))  # for no posted receive
            await trio.testing.wait_all_tasks_blocked()
            assert not out.any()
            np.testing.assert_array_equal(await recv(endpoint, 7), large + 2)
            theirs.sendall(eager_frame(large + 3, 0, 4))
        np.testing.assert_array_equal(out, large + 3)


async def test_a_large_message_that_does_not_fit_out_stays_queued() -> None:
    """A large message waiting whole for a receive whose ``out`` does not fit it: the
    receive raises, nothing lands in that ``out``, and the message stays queued whole."""
    large = np.arange(READ_WHOLE_BYTES // 4 + 1, dtype=np.int32)
    async with facing_a_raw_peer() as (endpoint, theirs):
        theirs.sendall(eager_frame(large, 0, 1))
        wrong = np.zeros(large.size, np.float32)
        with pytest.raises(InvalidArgumentError, match="out is float32"):
            await endpoint.recv(Scope(COMM, 0, (0, 1)), 1, 0, wrong)
        assert not wrong.any()
        right = np.zeros_like(large)
        _, got = await endpoint.recv(Scope(COMM, 0, (0, 1)), 1, 0, right)
        assert got is right
        np.testing.assert_array_equal(right, large)


async def test_a_large_frame_that_stops_filling_is_left_to_the_reader() -> None:
    """A look that finds part of a large frame waits for the rest while it keeps coming,
    and leaves the frame to the reader once it stops (a writer that stalls, or a socket
    that cannot hold it whole): the poll then parks instead of looking on. (The looks are
    made by hand, before the reader, woken by the bytes, can run.)"""
    large = np.arange(READ_WHOLE_BYTES // 8 + 100, dtype=np.float64)
    frame = eager_frame(large, 0, 1)
    async with facing_a_raw_peer() as (endpoint, theirs):
        peer = endpoint._peers[1]
        theirs.sendall(frame[: len(frame) // 3])
        assert endpoint._take_waiting(peer) is False  # it is coming: look again
        theirs.sendall(frame[len(frame) // 3 : len(frame) // 2])
        assert endpoint._take_waiting(peer) is False
        assert endpoint._take_waiting(peer) is None  # it stopped: the reader's
        await trio.testing.wait_all_tasks_blocked()  # the reader, inside the frame
        assert endpoint._take_waiting(peer) is None
        theirs.sendall(frame[len(frame) // 2 :])
        np.testing.assert_array_equal(await recv(endpoint), large)
        assert endpoint.taken_by_waits == 0

        theirs.sendall(frame[: HEADER.size])
        assert endpoint._take_waiting(peer) is False
        theirs.sendall(frame[HEADER.size :])
        assert endpoint._take_waiting(peer) is True  # whole: taken, and queued
        np.testing.assert_array_equal(await recv(endpoint), large)
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
