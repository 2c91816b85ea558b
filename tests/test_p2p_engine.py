"""The point-to-point engine (trioring._p2p): matching, eager and rendezvous, flow control,
cancellation and failures, over in-memory, lockstep and socket connections."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

from trioring._errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    PeerFailedError,
    ProtocolError,
    TrioringError,
)
from trioring._p2p import (
    CMA_EAGER_BYTES,
    TAG_BOUND,
    Endpoint,
    MessageKind,
    Scope,
    _engine,
    _reading,
)
from trioring._p2p._frames import HEADER, Leaving, pack_left
from trioring._p2p._peer import _READS_PER_YIELD, FrameReader
from trioring._p2p._reading import Reading
from trioring.transports._abc import Connection
from trioring.transports._memory import StreamConnection
from trioring.transports._socket import SocketConnection

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from trioring._p2p._matching import CommState, Message, PostedRecv
    from trioring.transports._abc import BytesLike

COMM = 1


def memory_pair() -> tuple[Connection, Connection]:
    a, b = trio.testing.memory_stream_pair()
    return StreamConnection(a), StreamConnection(b)


def lockstep_pair() -> tuple[Connection, Connection]:
    a, b = trio.testing.lockstep_stream_pair()
    return StreamConnection(a), StreamConnection(b)


def socket_pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return (
        SocketConnection(trio.socket.from_stdlib_socket(a)),
        SocketConnection(trio.socket.from_stdlib_socket(b)),
    )


PAIRS = {"memory": memory_pair, "lockstep": lockstep_pair, "socket": socket_pair}


class Gated(Connection):
    """A connection whose receiving side reads at most ``allowed`` bytes in all (None: no
    limit): lets a test stop a reader at a chosen point of the byte stream."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.allowed: int | None = None
        self.read = 0
        self.sends_allowed: int | None = None
        self.sends = 0
        self._changed = trio.Event()

    def allow(self, allowed: int | None) -> None:
        self.allowed = allowed
        self._changed.set()
        self._changed = trio.Event()

    def allow_sends(self, sends: int | None) -> None:
        """Let at most ``sends`` calls of send_all start in all (None: no limit)."""
        self.sends_allowed = sends
        self._changed.set()
        self._changed = trio.Event()

    async def send_all(self, *buffers: BytesLike) -> None:
        while self.sends_allowed is not None and self.sends >= self.sends_allowed:
            await self._changed.wait()
        self.sends += 1
        await self.inner.send_all(*buffers)

    async def recv_into(self, buffer: memoryview) -> int:
        while self.allowed is not None and self.read >= self.allowed:
            await self._changed.wait()
        if self.allowed is not None:
            buffer = buffer[: self.allowed - self.read]
        got = await self.inner.recv_into(buffer)
        self.read += got
        return got

    async def aclose(self) -> None:
        await self.inner.aclose()


class World:
    def __init__(self, endpoints: list[Endpoint], scopes: list[Scope]) -> None:
        self.endpoints = endpoints
        self.scopes = scopes

    async def send(self, src: int, dest: int, tag: int, array: np.ndarray, **kw: object) -> None:
        await self.endpoints[src].send(self.scopes[src], dest, tag, array, **kw)  # type: ignore[arg-type]

    async def send_then_set(
        self, sent: trio.Event, src: int, dest: int, tag: int, array: np.ndarray
    ) -> None:
        """:meth:`send`, then set ``sent``: for tests that watch when a send returns."""
        await self.send(src, dest, tag, array)
        sent.set()

    async def recv(
        self, dst: int, source: int | None, tag: int, out: np.ndarray | None = None, **kw: object
    ) -> tuple[int, np.ndarray]:
        return await self.endpoints[dst].recv(self.scopes[dst], source, tag, out, **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def open_world(
    size: int,
    pair: Callable[[], tuple[Connection, Connection]] = memory_pair,
    *,
    wrap: Callable[[int, int, Connection], Connection] | None = None,
    register: bool = True,
    pull: bool = False,
    peer_pids: list[dict[int, int] | None] | None = None,
    **sizes: int,
) -> AsyncIterator[World]:
    """``size`` endpoints, fully connected, running, with the world registered as COMM.
    ``pull``: as where the ranks agreed on cross-memory attach (rendezvous by PULL), each
    peer's pid being this process's; ``peer_pids`` gives each endpoint's pids instead."""
    if pull:
        peer_pids = [{p: os.getpid() for p in range(size) if p != r} for r in range(size)]
    connections: list[dict[int, Connection]] = [{} for _ in range(size)]
    for i in range(size):
        for j in range(i + 1, size):
            a, b = pair()
            connections[i][j] = wrap(i, j, a) if wrap else a
            connections[j][i] = wrap(j, i, b) if wrap else b
    endpoints = [
        Endpoint(
            rank=r,
            connections=connections[r],
            peer_pids=None if peer_pids is None else peer_pids[r],
            **sizes,
        )
        for r in range(size)
    ]
    scopes = [Scope(COMM, r, tuple(range(size))) for r in range(size)]
    if register:
        for endpoint, scope in zip(endpoints, scopes, strict=True):
            endpoint.register(scope)
    # A deadlock fails the test at once (with autojump_clock) or after 20 s.
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for endpoint in endpoints:
                await nursery.start(endpoint.run)
            yield World(endpoints, scopes)
            for endpoint in endpoints:
                await endpoint.aclose()


def sample(shape: tuple[int, ...], dtype: str = "float64", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray(rng.random(shape) * 100).astype(dtype)


# -- basic delivery -----------------------------------------------------------------------


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("nbytes", [0, 8, 1000, 100_000])
@pytest.mark.parametrize("recv_first", [False, True])
@pytest.mark.parametrize("pull", [False, True], ids=["data", "pull"])
async def test_send_recv(pair: str, nbytes: int, recv_first: bool, pull: bool) -> None:
    """Eager (small) and rendezvous (large, several chunks or one PULL), receive before or
    after."""
    data = sample((nbytes // 8,))
    async with open_world(2, PAIRS[pair], eager_bytes=4096, chunk_bytes=16384, pull=pull) as w:
        got: list[tuple[int, np.ndarray]] = []

        async def receive() -> None:
            got.append(await w.recv(1, 0, 5))

        async def send() -> None:
            await w.send(0, 1, 5, data)

        async with trio.open_nursery() as nursery:
            first, second = (receive, send) if recv_first else (send, receive)
            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(second)
        assert got[0][0] == 0
        np.testing.assert_array_equal(got[0][1], data)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "float16", "complex128", "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3, 4), (1,) * 32])
async def test_shapes_and_dtypes(dtype: str, shape: tuple[int, ...]) -> None:
    data = sample(shape, dtype, seed=3)
    async with open_world(2, eager_bytes=16) as w:
        for _ in range(2):  # eager, then (eager limit passed or not) again
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.send, 0, 1, 1, data)
                _, got = await w.recv(1, 0, 1)
            assert got.shape == shape
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("nbytes", [80, 8000])
async def test_recv_into_out(nbytes: int) -> None:
    data = sample((nbytes // 8,))
    async with open_world(2, eager_bytes=1000, chunk_bytes=512) as w:
        out = np.zeros(nbytes // 8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send, 0, 1, 1, data)
            _, got = await w.recv(1, 0, 1, out)
        assert got is out
        np.testing.assert_array_equal(out, data)
        # A bigger out: a view of its start, with the message's shape.
        big = np.full(nbytes // 8 + 5, -1.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send, 0, 1, 1, data.reshape(-1, 2))
            _, got = await w.recv(1, 0, 1, big)
        assert got.shape == (nbytes // 16, 2)
        assert np.shares_memory(got, big)
        np.testing.assert_array_equal(got, data.reshape(-1, 2))
        assert (big[nbytes // 8 :] == -1).all()


@pytest.mark.parametrize("nbytes", [80, 8000])
async def test_misfits_stay_queued(nbytes: int) -> None:
    """Truncation, a dtype mismatch and an object/array mismatch raise InvalidArgumentError
    before any byte lands; the message then goes whole to a receive that fits."""
    data = sample((nbytes // 8,))
    async with open_world(2, eager_bytes=1000, chunk_bytes=512) as w:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send, 0, 1, 2, data)
            await trio.testing.wait_all_tasks_blocked()
            small = np.zeros(nbytes // 8 - 1)
            with pytest.raises(InvalidArgumentError, match="truncation"):
                await w.recv(1, 0, 2, small)
            assert (small == 0).all()
            with pytest.raises(InvalidArgumentError, match="float32"):
                await w.recv(1, 0, 2, np.zeros(nbytes, np.float32))
            with pytest.raises(
                InvalidArgumentError, match="kind object matched a message of kind array"
            ):
                await w.recv(1, 0, 2, kind=MessageKind.OBJECT)
            _, got = await w.recv(1, 0, 2)
        np.testing.assert_array_equal(got, data)
        # An object message meets an array receive.
        payload = np.frombuffer(b"pickled", np.uint8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(w.send, 0, 1, 3, payload, kind=MessageKind.OBJECT))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(
                InvalidArgumentError, match="kind array matched a message of kind object"
            ):
                await w.recv(1, 0, 3)
            _, got = await w.recv(1, 0, 3, kind=MessageKind.OBJECT)
        assert got.tobytes() == b"pickled"


async def test_posted_misfit_raises_and_message_waits() -> None:
    async with open_world(2) as w:
        async with trio.open_nursery() as nursery:

            async def too_small() -> None:
                with pytest.raises(InvalidArgumentError, match="truncation"):
                    await w.recv(1, 0, 1, np.zeros(2))

            nursery.start_soon(too_small)
            await trio.testing.wait_all_tasks_blocked()
            await w.send(0, 1, 1, np.arange(5.0))
        _, got = await w.recv(1, 0, 1)
        np.testing.assert_array_equal(got, np.arange(5.0))


async def test_argument_checks() -> None:
    async with open_world(2) as w:
        ep, scope = w.endpoints[0], w.scopes[0]
        bad_calls = [
            ep.send(scope, 2, 0, np.zeros(1)),
            ep.send(scope, 1, TAG_BOUND, np.zeros(1)),
            ep.send(scope, 1, -1, np.zeros(1)),
            ep.send(scope, 1, 0, np.zeros(1, dtype="U3")),
            ep.send(scope, 1, 0, np.zeros(1), kind=MessageKind.OBJECT),
            ep.recv(scope, 5, 0),
            ep.recv(scope, 1, 0, np.zeros(4)[::2]),
            ep.recv(scope, 1, 0, np.zeros(2, dtype=object)),
            ep.send(Scope(99, 0, (0, 1)), 1, 0, np.zeros(1)),
        ]
        readonly = np.zeros(3)
        readonly.flags.writeable = False
        bad_calls.append(ep.recv(scope, 1, 0, readonly))
        for call in bad_calls:
            with trio.testing.assert_checkpoints(), pytest.raises(InvalidArgumentError):
                await call


@pytest.mark.parametrize("pair", ["memory", "socket"])
async def test_checkpoints(pair: str) -> None:
    """Every call is a schedule point, also a send that a socket takes at once (written
    without a pass through the scheduler, which it then takes at its end)."""
    async with open_world(2, PAIRS[pair]) as w:
        with trio.testing.assert_checkpoints():
            await w.send(0, 1, 0, np.zeros(3))  # eager
        with trio.testing.assert_checkpoints():
            await w.recv(1, 0, 0)  # already queued
        with trio.testing.assert_checkpoints():
            await w.send(0, 0, 0, np.zeros(3))  # to itself, buffered
        with trio.testing.assert_checkpoints():
            await w.recv(0, 0, 0)
        with trio.testing.assert_checkpoints():
            await w.endpoints[0].aclose()
        with trio.testing.assert_checkpoints(), pytest.raises(CommunicatorClosedError):
            await w.send(0, 1, 0, np.zeros(3))


@pytest.mark.parametrize("pair", ["memory", "socket"])
async def test_a_cancelled_call_consumes_nothing_before_it_starts(pair: str) -> None:
    async with open_world(2, PAIRS[pair]) as w:
        await w.send(0, 1, 0, np.ones(2))
        with trio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(trio.Cancelled):
                await w.recv(1, 0, 0)
            with pytest.raises(trio.Cancelled):
                await w.send(0, 1, 0, np.ones(2) * 2)
        _, got = await w.recv(1, 0, 0)
        np.testing.assert_array_equal(got, np.ones(2))
        with trio.move_on_after(0.01):
            await w.recv(1, 0, 0)
            pytest.fail("the cancelled send was delivered")


async def test_a_burst_over_a_socket_arrives_whole_and_in_order() -> None:
    """Eager messages written back to back over a socket, each sender overwriting its array
    as soon as its send returns (the frame went out synchronously, or was copied into the
    socket), reach the receiver whole, in order, with their credit coming back; from two
    tasks on two tags at once, while a rendezvous message crosses them."""
    count = 300
    async with open_world(2, socket_pair, eager_bytes=4096, chunk_bytes=16384) as w:
        large = sample((5000,), seed=7)  # 40 KB: by rendezvous, in three chunks

        async def burst(tag: int) -> None:
            array = np.empty(64, np.int64)
            for i in range(count):
                array.fill(tag * 1000 + i)
                await w.send(0, 1, tag, array)
                array.fill(-1)  # at once: the message must not change

        async with trio.open_nursery() as nursery:
            nursery.start_soon(burst, 1)
            nursery.start_soon(burst, 2)
            nursery.start_soon(w.send, 0, 1, 3, large)
            for tag in (1, 2):
                for i in range(count):
                    _, got = await w.recv(1, 0, tag)
                    np.testing.assert_array_equal(got, np.full(64, tag * 1000 + i))
            _, got = await w.recv(1, 0, 3)
            np.testing.assert_array_equal(got, large)
        await trio.testing.wait_all_tasks_blocked()
        assert w.endpoints[1]._peers[0].buffered == 0


async def test_the_reader_of_a_socket_yields_while_bytes_keep_coming() -> None:
    """A socket's reader takes what is there without a pass through the scheduler, but
    passes through it after 16 such reads in a row, so that a peer that keeps the socket
    full cannot hold the thread; a read that finds nothing parks (a schedule point too)."""
    a, b = socket_pair()
    reader = FrameReader(b)
    chunk = memoryview(bytearray(8))
    await a.send_all(bytes(range(8)) * 40)
    for _ in range(_READS_PER_YIELD - 1):
        with trio.testing.assert_no_checkpoints():
            await reader.read_into(chunk)
        assert bytes(chunk) == bytes(range(8))
    with trio.testing.assert_checkpoints():
        await reader.read_into(chunk)
    with trio.testing.assert_no_checkpoints():
        await reader.read_into(chunk)
    # 23 chunks are left: a read of 30 takes them and parks for the other 7.
    rest = bytearray(8 * 30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.read_into, memoryview(rest))
        await trio.testing.wait_all_tasks_blocked()
        await a.send_all(bytes(range(8, 16)) * 7)
    assert rest == bytes(range(8)) * 23 + bytes(range(8, 16)) * 7
    await a.aclose()
    await b.aclose()


# -- sending to oneself, any source, rings ------------------------------------------------


@pytest.mark.parametrize("nbytes", [8, 100_000])
async def test_self_send(nbytes: int) -> None:
    data = sample((nbytes // 8,))
    async with open_world(1, eager_bytes=1000) as w:
        out = np.zeros_like(data)

        async def sendrecv() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.send, 0, 0, 9, data)
                _, got = await w.recv(0, 0, 9, out)
                assert got is out

        await sendrecv()
        np.testing.assert_array_equal(out, data)
        if nbytes > 1000:  # a large one waits for its receive: cancellable, then gone
            with trio.move_on_after(0.01):
                await w.send(0, 0, 9, data)
            with trio.move_on_after(0.01):
                await w.recv(0, 0, 9)
                pytest.fail("the cancelled self-send was delivered")


async def test_recv_any() -> None:
    async with open_world(4, eager_bytes=64) as w:
        async with trio.open_nursery() as nursery:
            for src in (1, 2, 3):
                nursery.start_soon(w.send, src, 0, 4, np.full(src * 10, src))
            seen = {}
            for _ in range(3):
                source, got = await w.recv(0, None, 4)
                assert (got == source).all()
                assert got.size == source * 10
                seen[source] = got
        assert sorted(seen) == [1, 2, 3]


@pytest.mark.parametrize("size", [2, 3, 5, 8])
@pytest.mark.parametrize("nbytes", [800, 80_000])
async def test_ring_on_lockstep_streams(size: int, nbytes: int) -> None:
    """Everyone sends right and receives from the left at once, several rounds: a send that
    needed its receive to start first would deadlock on lockstep streams."""
    async with open_world(size, lockstep_pair, eager_bytes=1024, chunk_bytes=8192) as w:
        results: dict[int, np.ndarray] = {}

        async def rank(r: int) -> None:
            value = np.full(nbytes // 8, float(r))
            for _ in range(3):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(w.send, r, (r + 1) % size, 0, value)
                    _, value = await w.recv(r, (r - 1) % size, 0)
            results[r] = value

        async with trio.open_nursery() as nursery:
            for r in range(size):
                nursery.start_soon(rank, r)
        for r in range(size):
            np.testing.assert_array_equal(results[r], np.full(nbytes // 8, float((r - 3) % size)))


async def test_concurrent_large_sends_interleave() -> None:
    async with open_world(2, lockstep_pair, eager_bytes=0, chunk_bytes=100) as w:
        datas = [sample((1000,), seed=i) for i in range(4)]
        got: dict[int, np.ndarray] = {}

        async def receive(tag: int) -> None:
            got[tag] = (await w.recv(1, 0, tag))[1]

        async with trio.open_nursery() as nursery:
            for tag, data in enumerate(datas):
                nursery.start_soon(w.send, 0, 1, tag, data)
                nursery.start_soon(receive, tag)
        for tag, data in enumerate(datas):
            np.testing.assert_array_equal(got[tag], data)


# -- ordering -----------------------------------------------------------------------------

_plans = st.lists(
    st.tuples(
        st.integers(0, 2),  # source
        st.integers(0, 1),  # tag
        st.sampled_from([0, 8, 200, 3000]),  # nbytes: eager to several chunks
    ),
    min_size=1,
    max_size=24,
)


@settings(
    max_examples=60,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=_plans, senders=st.integers(1, 3), any_source=st.booleans(), data=st.data())
def test_non_overtaking(
    plan: list[tuple[int, int, int]], senders: int, any_source: bool, data: st.DataObject
) -> None:
    """Messages of one (source, tag) arrive in the order one task sent them, whatever the
    interleaving of senders, receivers, eager and rendezvous messages."""
    yields = data.draw(st.lists(st.integers(0, 3), min_size=64, max_size=64))
    window = data.draw(st.sampled_from([1024, 8192, 1 << 20]))

    async def main() -> None:
        async with open_world(
            4, memory_pair, eager_bytes=256, window_bytes=window, chunk_bytes=1024
        ) as w:
            pause = iter(yields * 100)
            # Each (source, tag) stream is sent by one task, in order; streams of one source
            # are spread over ``senders`` tasks.
            streams: dict[tuple[int, int], list[np.ndarray]] = {}
            for i, (src, tag, nbytes) in enumerate(plan):
                streams.setdefault((src + 1, tag), []).append(np.full(nbytes // 8, float(i)))

            async def sender(keys: list[tuple[int, int]]) -> None:
                for src, tag in keys:
                    for array in streams[src, tag]:
                        for _ in range(next(pause)):
                            await trio.lowlevel.checkpoint()
                        await w.send(src, 0, tag, array)

            got: dict[tuple[int, int], list[float]] = {k: [] for k in streams}

            async def receiver(key: tuple[int, int]) -> None:
                for _ in streams[key]:
                    for _ in range(next(pause)):
                        await trio.lowlevel.checkpoint()
                    source, array = await w.recv(0, key[0], key[1])
                    got[source, key[1]].append(array[0] if array.size else math.nan)

            keys = sorted(streams)
            async with trio.open_nursery() as nursery:
                for i in range(senders):
                    nursery.start_soon(sender, keys[i::senders])
                if any_source:
                    # One receiver per tag takes messages from any source.
                    for tag in (0, 1):
                        count = sum(len(v) for (s, t), v in streams.items() if t == tag)

                        async def take(tag: int = tag, count: int = count) -> None:
                            for _ in range(count):
                                source, array = await w.recv(0, None, tag)
                                got[source, tag].append(array[0] if array.size else math.nan)

                        nursery.start_soon(take)
                else:
                    for key in keys:
                        nursery.start_soon(receiver, key)
            for key, arrays in streams.items():
                expected = [a[0] if a.size else math.nan for a in arrays]
                np.testing.assert_array_equal(got[key], expected)

    trio.run(main)


async def test_earliest_posted_receive_wins() -> None:
    async with open_world(2) as w:
        order: list[str] = []

        async def receive(name: str, source: int | None) -> None:
            _, got = await w.recv(1, source, 0)
            order.append(f"{name}={int(got[0])}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive, "any", None)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(receive, "zero", 0)
            await trio.testing.wait_all_tasks_blocked()
            await w.send(0, 1, 0, np.array([1]))
            await w.send(0, 1, 0, np.array([2]))
        assert order == ["any=1", "zero=2"]


# -- flow control -------------------------------------------------------------------------


async def test_flow_control_bounds_buffered_bytes() -> None:
    """With nobody receiving, a sender of many small messages runs out of credit and goes
    on by rendezvous; the receiver never buffers more than the window."""
    window = 4096
    async with open_world(2, eager_bytes=512, window_bytes=window) as w:
        receiver = w.endpoints[1]._peers[0]
        peak = 0
        count = 200
        async with trio.open_nursery() as nursery:

            async def send_all() -> None:
                for i in range(count):
                    nursery.start_soon(w.send, 0, 1, 0, np.full(50, i, np.int64))
                    await trio.lowlevel.checkpoint()

            nursery.start_soon(send_all)
            for _ in range(50):
                await trio.testing.wait_all_tasks_blocked()
                peak = max(peak, receiver.held)
            assert 0 < receiver.buffered <= receiver.held <= window
            assert len(receiver.inbound) > 0  # rendezvous messages wait
            assert w.endpoints[0]._peers[1].credit < 400 + 256
            values = []
            for _ in range(count):
                _, got = await w.recv(1, 0, 0)
                values.append(int(got[0]))
                peak = max(peak, receiver.held)
        assert sorted(values) == list(range(count))
        assert peak <= window
        # All the credit comes back, once the rest is owed.
        await trio.testing.wait_all_tasks_blocked()
        assert receiver.buffered == 0


# -- cancellation -------------------------------------------------------------------------


async def test_recv_cancelled_before_match_is_withdrawn(autojump_clock: trio.abc.Clock) -> None:
    async with open_world(2) as w:
        with trio.move_on_after(1):
            await w.recv(1, 0, 0)
        await w.send(0, 1, 0, np.array([42]))
        _, got = await w.recv(1, 0, 0)
        assert got[0] == 42


def _gate_receiver(
    gates: dict[tuple[int, int], Gated],
) -> Callable[[int, int, Connection], Connection]:
    def wrap(me: int, other: int, conn: Connection) -> Connection:
        gated = Gated(conn)
        gates[me, other] = gated
        return gated

    return wrap


async def received_again_whole(w: World, data: np.ndarray, sent: trio.Event) -> None:
    """After rank 1's receive of ``data`` from rank 0 REJECTed it: the send waits for a new
    CTS, and the next receive gets the message whole, into its own ``out``."""
    await trio.testing.wait_all_tasks_blocked()
    assert not sent.is_set()
    fresh = np.zeros_like(data)
    _, got = await w.recv(1, 0, 0, fresh)
    assert got is fresh
    np.testing.assert_array_equal(fresh, data)


async def test_recv_cancelled_mid_transfer_rejects(autojump_clock: trio.abc.Clock) -> None:
    """A receive cancelled while its rendezvous data arrives: REJECT, and the message is
    delivered whole to the next receive; the send returns once, delivered."""
    gates: dict[tuple[int, int], Gated] = {}
    data = sample((1000,))  # 8000 bytes, 8 chunks of 1000
    async with open_world(2, wrap=_gate_receiver(gates), eager_bytes=0, chunk_bytes=1000) as w:
        gate = gates[1, 0]
        rts = HEADER.size + 8
        gate.allow(rts + 3 * (HEADER.size + 1000) + 500)  # RTS, 3.5 chunks
        sent = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send_then_set, sent, 0, 1, 0, data)
            out = np.zeros(1000)
            with trio.move_on_after(5):
                await w.recv(1, 0, 0, out)
            assert not sent.is_set()
            assert (out[:100] == data[:100]).all()  # out was partly written (documented)
            gate.allow(None)
            await received_again_whole(w, data, sent)
        assert sent.is_set()


@pytest.mark.parametrize("pull", [False, True], ids=["data", "pull"])
async def test_send_cancelled_waiting_for_cts_withdraws(
    autojump_clock: trio.abc.Clock, pull: bool
) -> None:
    async with open_world(2, eager_bytes=0, pull=pull) as w:
        with trio.move_on_after(1) as scope:
            await w.send(0, 1, 0, np.arange(10.0))
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        assert not w.endpoints[1]._peers[0].inbound  # withdrawn
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send, 0, 1, 0, np.arange(3.0))
            _, got = await w.recv(1, 0, 0)
        np.testing.assert_array_equal(got, np.arange(3.0))


async def test_send_cancelled_between_chunks_withdraws(autojump_clock: trio.abc.Clock) -> None:
    """The sender is cancelled after some DATA went: WITHDRAW; the receive that had matched
    waits again and gets the next message."""
    gates: dict[tuple[int, int], Gated] = {}
    async with open_world(2, wrap=_gate_receiver(gates), eager_bytes=0, chunk_bytes=1000) as w:
        gates[0, 1].allow_sends(3)  # the RTS and two chunks; the third chunk's write waits
        result: list[np.ndarray] = []

        async def receive() -> None:
            result.append((await w.recv(1, 0, 0))[1])

        async def reopen() -> None:
            await trio.sleep(2)
            gates[0, 1].allow_sends(None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            nursery.start_soon(reopen)
            with trio.move_on_after(1) as scope:
                await w.send(0, 1, 0, sample((1000,)))
            assert scope.cancelled_caught
            assert trio.current_time() == 2  # the frame being written was finished first
            await trio.testing.wait_all_tasks_blocked()
            assert not result
            assert not w.endpoints[1]._peers[0].inbound
            nursery.start_soon(w.send, 0, 1, 0, np.arange(4.0))
        np.testing.assert_array_equal(result[0], np.arange(4.0))


@pytest.mark.parametrize("pull", [False, True], ids=["data", "pull"])
async def test_send_after_last_chunk_waits_for_done(
    autojump_clock: trio.abc.Clock, pull: bool
) -> None:
    """Once all DATA (or the PULL) is written, a cancelled send still returns when it is
    delivered: with PULL the receiver may be reading the sender's array."""
    gates: dict[tuple[int, int], Gated] = {}
    data = sample((500,))
    async with open_world(
        2, wrap=_gate_receiver(gates), eager_bytes=0, chunk_bytes=1000, pull=pull
    ) as w:
        gates[0, 1].allow(HEADER.size)  # the sender reads the CTS, and no DONE for now
        outcome: list[str] = []

        async def send() -> None:
            with trio.move_on_after(1) as scope:
                await w.send(0, 1, 0, data)
            outcome.append("cancelled" if scope.cancelled_caught else "sent")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            _, got = await w.recv(1, 0, 0)
            np.testing.assert_array_equal(got, data)
            await trio.sleep(10)
            assert not outcome  # deadline passed, still waiting for DONE
            gates[0, 1].allow(None)
        assert outcome == ["sent"]


@contextlib.asynccontextmanager
async def _rejecting_world(pull: bool) -> AsyncIterator[tuple[World, dict[tuple[int, int], Gated]]]:
    """Two ranks with gated connections for a 2000-element message that rank 1 will
    REJECT: rank 1's reader stops in the first DATA frame (or before the PULL), and rank
    0 gets the CTS but not (yet) what follows it. The gates, by (from, to), let the rest
    through."""
    gates: dict[tuple[int, int], Gated] = {}
    async with open_world(
        2, wrap=_gate_receiver(gates), eager_bytes=0, chunk_bytes=1000, pull=pull
    ) as w:
        gates[1, 0].allow(HEADER.size + 8 + (HEADER.size // 2 if pull else HEADER.size + 100))
        gates[0, 1].allow(HEADER.size)  # the sender gets the CTS, not the REJECT (yet)
        yield w, gates


@pytest.mark.parametrize("pull", [False, True], ids=["data", "pull"])
async def test_recv_cancelled_after_matching_unsent_cts(
    autojump_clock: trio.abc.Clock, pull: bool
) -> None:
    """Cancel a receive, then another, while the message is rejected: still delivered whole
    (the receiver's reader stops in the first DATA frame, or before the PULL)."""
    data = sample((2000,))
    async with _rejecting_world(pull) as (w, gates), trio.open_nursery() as nursery:
        nursery.start_soon(w.send, 0, 1, 0, data)
        with trio.move_on_after(1):
            await w.recv(1, 0, 0)
        gates[1, 0].allow(None)
        with trio.move_on_after(1):
            await w.recv(1, 0, 0)  # matches the rejected message; no RESTART yet
        gates[0, 1].allow(None)
        _, got = await w.recv(1, 0, 0)
        np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("pull", [False, True], ids=["data", "pull"])
async def test_leaving_while_a_rejected_message_waits_for_its_restart(
    autojump_clock: trio.abc.Clock, pull: bool
) -> None:
    """A receive cancelled after its CTS REJECTs the message; the receiver then leaves the
    communicator before the sender's RESTART arrives. The RESTART is still expected (not a
    protocol violation that ends the connection), so the sender's send hears why the
    receiver left, and the connection carries the next communicator's messages. Found by
    the chaos trials (seed 344: a sendrecv ring whose receive was cancelled when its send
    failed, and the rank left on that error; its peer saw a bare closed connection)."""
    data = sample((2000,))
    async with _rejecting_world(pull) as (w, gates):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(PeerFailedError, match="rank 1 left this communicator on "):
                    await w.send(0, 1, 0, data)

            nursery.start_soon(send)
            with trio.move_on_after(1):
                await w.recv(1, 0, 0)  # REJECTs the message
            gates[1, 0].allow(None)
            await w.endpoints[1].leave(
                COMM, CommunicatorClosedError, Leaving("on ValueError: bad batch")
            )
            gates[0, 1].allow(None)  # the REJECT reaches the sender, which writes RESTART
        await trio.testing.wait_all_tasks_blocked()
        assert w.endpoints[1].peer_error(0) is None
        assert w.endpoints[0].peer_error(1) is None
        assert not w.endpoints[1]._peers[0].inbound
        after = [Scope(2, r, (0, 1)) for r in range(2)]
        for endpoint, scope in zip(w.endpoints, after, strict=True):
            endpoint.register(scope)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.endpoints[0].send, after[0], 1, 0, data)
            _, got = await w.endpoints[1].recv(after[1], 0, 0)
        np.testing.assert_array_equal(got, data)


# -- cross-memory attach (PULL) -----------------------------------------------------------


def _count_pulls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every message that a receive copies out of its sender's memory
    (Reading._copy_out, wrapped)."""
    pulls: list[int] = []
    original = Reading._copy_out

    async def counted(self: Reading, comm: CommState, recv: PostedRecv, message: Message) -> None:
        pulls.append(message.nbytes)
        await original(self, comm, recv, message)

    monkeypatch.setattr(Reading, "_copy_out", counted)
    return pulls


@pytest.mark.parametrize("pair", ["memory", "socket"])
async def test_pull_arrays_are_free_once_sends_return(
    pair: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendezvous messages of odd sizes by PULL, in steps (small here), both ways at once:
    each array is overwritten as soon as its send returns, and every receive still gets
    what was sent; every message went by PULL."""
    monkeypatch.setattr(_reading, "_PULL_STEP_BYTES", 4096)
    pulls = _count_pulls(monkeypatch)
    sizes = [int(n) for n in np.random.default_rng(5).integers(1, 3000, 30)]
    async with open_world(2, PAIRS[pair], eager_bytes=0, pull=True) as w:

        async def sender(src: int, dest: int) -> None:
            buffer = np.empty(max(sizes))
            for i, n in enumerate(sizes):
                buffer[:n] = np.arange(n) + 1000.0 * i + src
                await w.send(src, dest, 0, buffer[:n])
                buffer[:] = -1.0

        async def receiver(dst: int, src: int) -> None:
            out = np.empty(max(sizes))
            for i, n in enumerate(sizes):
                _, got = await w.recv(dst, src, 0, out)
                np.testing.assert_array_equal(got, np.arange(n) + 1000.0 * i + src)

        async with trio.open_nursery() as nursery:
            for a, b in ((0, 1), (1, 0)):
                nursery.start_soon(sender, a, b)
                nursery.start_soon(receiver, b, a)
    assert sorted(pulls) == sorted(8 * n for n in sizes * 2)


async def test_pull_receive_cancelled_between_steps_rejects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receive cancelled while its PULL copies (between two steps): the reader stops
    copying, REJECT, and the next receive gets the message whole; the send returns once."""
    monkeypatch.setattr(_reading, "_PULL_STEP_BYTES", 1000)
    data = sample((1000,)) + 1.0  # 8000 bytes, 8 steps; no zero anywhere
    async with open_world(2, eager_bytes=0, pull=True) as w:
        sent = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send_then_set, sent, 0, 1, 0, data)
            out = np.zeros(1000)
            with trio.CancelScope() as scope:

                async def cancel_once_the_first_step_landed() -> None:
                    while not out[0]:
                        await trio.lowlevel.checkpoint()
                    scope.cancel()

                nursery.start_soon(cancel_once_the_first_step_landed)
                await w.recv(1, 0, 0, out)
            assert scope.cancelled_caught
            assert out[0] == data[0]
            assert not out[-1]  # it stopped copying
            await received_again_whole(w, data, sent)
        assert sent.is_set()


async def test_pull_from_a_sender_that_gave_up_during_the_copy_delivers_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sender closes its communicator after its PULL, while the receiver still copies
    its array, and reuses the array as soon as its send raises; the receiver's reader is
    held back (as a busy connection would), so it learns of that only from the guard, which
    tells it that its copy may be torn: the receive does not return it, and raises once the
    sender's LEFT comes."""
    monkeypatch.setattr(_reading, "_PULL_STEP_BYTES", 1000)
    data = sample((8000,)) + 1.0  # 64000 bytes, 64 steps; no zero anywhere
    out = np.zeros(8000)
    gates: dict[tuple[int, int], Gated] = {}

    def closed(what: str) -> TrioringError:
        return CommunicatorClosedError(f"closed during {what}")

    async with (
        open_world(2, wrap=_gate_receiver(gates), eager_bytes=0, pull=True) as w,
        trio.open_nursery() as nursery,
    ):
        # The RTS (a dimension and the guard's address) and the PULL, nothing after them.
        gates[1, 0].allow(HEADER.size + 8 + 8 + HEADER.size)

        async def send() -> None:
            with pytest.raises(CommunicatorClosedError, match=r"during send\(dest=1, tag=0\)"):
                await w.send(0, 1, 0, data)
            data[:] = -1.0  # reused at once

        async def close_the_senders_communicator_during_the_copy() -> None:
            inbound = w.endpoints[1]._peers[0].inbound
            while not (inbound and all(m.committed for m in inbound.values())):
                await trio.lowlevel.checkpoint()
            assert not out[-1]  # still copying
            await w.endpoints[0].leave(COMM, closed)
            await trio.testing.wait_all_tasks_blocked()
            gates[1, 0].allow(None)

        nursery.start_soon(send)
        nursery.start_soon(close_the_senders_communicator_during_the_copy)
        with pytest.raises(PeerFailedError, match="rank 0 closed this communicator"):
            await w.recv(1, 0, 0, out)
    assert (data == -1.0).all()
    assert (out == -1.0).any()  # the copy was torn indeed: without the guard it was returned


@pytest.mark.parametrize("pull", [False, True], ids=["data", "pull"])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("polling", [False, True], ids=["memory", "socket-polling"])
async def test_rendezvous_under_random_cancellation(
    monkeypatch: pytest.MonkeyPatch, pull: bool, seed: int, polling: bool
) -> None:
    """Both ways at once, every send and receive under a random deadline (none every fourth
    try) and tried again while cancelled, the copies in small steps: each message arrives
    once, whole and in order; also over sockets with waits that poll, taking frames off
    the sockets themselves. (A receive cancelled in a step after its sender had withdrawn
    the message once stayed posted, and took the next message to nobody.)"""
    monkeypatch.setattr(_reading, "_PULL_STEP_BYTES", 512)
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(1, 1000, 60)]
    over = {"pair": socket_pair, "spin_seconds": 0.0005} if polling else {}
    async with open_world(2, eager_bytes=0, chunk_bytes=512, pull=pull, **over) as w:  # type: ignore[arg-type]

        async def tried(call: Callable[[], Awaitable[object]]) -> object:
            for attempt in range(1, 101):
                deadline = math.inf if attempt % 4 == 0 else float(rng.uniform(0, 0.002))
                with trio.move_on_after(deadline):
                    return await call()
            raise AssertionError("cancelled 100 times")

        async def sender(src: int, dest: int) -> None:
            for i, n in enumerate(sizes):
                array = np.arange(n) + 1000.0 * i + src
                await tried(functools.partial(w.send, src, dest, 0, array))
                array[:] = -1.0

        async def receiver(dst: int, src: int) -> None:
            out = np.empty(max(sizes))
            for i, n in enumerate(sizes):
                _, got = await tried(functools.partial(w.recv, dst, src, 0, out))  # type: ignore[misc]
                np.testing.assert_array_equal(got, np.arange(n) + 1000.0 * i + src)

        async with trio.open_nursery() as nursery:
            for a, b in ((0, 1), (1, 0)):
                nursery.start_soon(sender, a, b)
                nursery.start_soon(receiver, b, a)
        if polling:
            assert sum(endpoint.taken_by_waits for endpoint in w.endpoints) > 0


def _pid_of_a_process_that_exited() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return int(process.stdout)


async def test_pull_from_a_process_that_is_gone_fails_its_peer() -> None:
    """The sender's process is gone when the receiver copies (ESRCH): both ranks' calls
    raise PeerFailedError naming the other, the receiver's saying why."""
    pids: list[dict[int, int] | None] = [{1: os.getpid()}, {0: _pid_of_a_process_that_exited()}]
    async with (
        open_world(2, eager_bytes=0, peer_pids=pids) as w,
        trio.open_nursery() as nursery,
    ):

        async def send() -> None:
            with pytest.raises(PeerFailedError, match=r"rank 0: send\(dest=1, tag=0\) #1"):
                await w.send(0, 1, 0, np.arange(10.0))

        nursery.start_soon(send)
        with pytest.raises(PeerFailedError, match="from its memory: No such process") as info:
            await w.recv(1, 0, 0)
        assert info.value.peer == 0
        assert "rank 1: recv(source=0, tag=0)" in str(info.value)


async def test_pull_where_cross_memory_attach_was_not_agreed_is_a_protocol_error() -> None:
    """A PULL to a rank that has no pid for its sender breaks the protocol."""
    async with (
        open_world(2, eager_bytes=0, peer_pids=[{1: os.getpid()}, None]) as w,
        trio.open_nursery() as nursery,
    ):

        async def send() -> None:
            with pytest.raises(PeerFailedError):
                await w.send(0, 1, 0, np.arange(10.0))

        nursery.start_soon(send)
        with pytest.raises(ProtocolError, match="did not agree on cross-memory attach"):
            await w.recv(1, 0, 0)


@pytest.mark.parametrize("crowded", [False, True], ids=["a-cpu-each", "crowded"])
async def test_eager_limit_between_cross_memory_ranks(crowded: bool) -> None:
    """Between ranks that agreed on cross-memory attach, a message above CMA_EAGER_BYTES
    goes eagerly (its send returns before any receive) where each rank has a CPU, and by
    rendezvous (its send waits for the receive) where ranks outnumber their CPUs."""
    data = sample(((CMA_EAGER_BYTES + 8) // 8,))
    async with open_world(2, PAIRS["socket"], pull=True, crowded=crowded) as w:
        sent = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send_then_set, sent, 0, 1, 0, data)
            await trio.testing.wait_all_tasks_blocked()
            assert sent.is_set() is not crowded
            _, got = await w.recv(1, 0, 0)
        np.testing.assert_array_equal(got, data)


# -- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["memory", "socket"])
async def test_peer_failure_fails_pending_calls(pair: str) -> None:
    async with open_world(3, PAIRS[pair], eager_bytes=0) as w:
        lost: list[tuple[int, TrioringError]] = []
        w.endpoints[0].on_peer_lost = lambda world, error: lost.append((world, error))
        errors: list[BaseException] = []

        async def expect_failure(call: Callable[[], object]) -> None:
            try:
                await call()  # type: ignore[misc]
            except PeerFailedError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_failure, lambda: w.recv(0, 1, 3))
            nursery.start_soon(expect_failure, lambda: w.recv(0, None, 3))
            nursery.start_soon(expect_failure, lambda: w.send(0, 1, 3, np.zeros(10)))
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(1):
                await w.endpoints[1].aclose()
        assert len(errors) == 3
        for exc in errors:
            assert isinstance(exc, PeerFailedError)
            assert exc.peer == 1
            assert "rank 0" in str(exc)
            assert "peer rank 1" in str(exc)
            assert "its connection ended" in str(exc)
        messages = " ".join(str(exc) for exc in errors)
        for what in ("recv(source=1, tag=3)", "recv_any(tag=3)", "send(dest=1, tag=3) #1"):
            assert what in messages
        assert [world for world, _ in lost] == [1]
        assert w.endpoints[0].peer_error(1) is lost[0][1]
        with pytest.raises(PeerFailedError, match=r"send\(dest=1, tag=0\)"):
            await w.send(0, 1, 0, np.zeros(1))
        # The other peer still works.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.send, 2, 0, 0, np.ones(3))
            _, got = await w.recv(0, 2, 0)
        np.testing.assert_array_equal(got, np.ones(3))


async def test_messages_that_arrived_stay_receivable_after_failure() -> None:
    async with open_world(2) as w:
        await w.send(1, 0, 0, np.arange(3))
        await w.endpoints[1].aclose()
        await trio.testing.wait_all_tasks_blocked()
        _, got = await w.recv(0, 1, 0)
        np.testing.assert_array_equal(got, np.arange(3))
        with pytest.raises(PeerFailedError):
            await w.recv(0, 1, 0)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GARBAGE!" * 10,
        HEADER.pack(b"TRP2", 1, 4, 0, 0, 0, 0, 0, 77, 10, 0, 10) + b"x" * 10,
        HEADER.pack(b"TRP2", 1, 3, 0, 0, 0, 0, 0, 5, 0, 0, 0),
    ],
    ids=["bad-magic", "data-for-unknown-id", "cts-for-nothing"],
)
async def test_garbage_is_a_protocol_error(garbage: bytes) -> None:
    ours, theirs = memory_pair()
    endpoint = Endpoint(rank=0, connections={1: ours})
    scope = Scope(COMM, 0, (0, 1))
    endpoint.register(scope)
    async with trio.open_nursery() as nursery:
        await nursery.start(endpoint.run)

        async def pending() -> None:
            with pytest.raises(ProtocolError, match="peer rank 1") as info:
                await endpoint.recv(scope, 1, 0)
            assert info.value.peer == 1

        nursery.start_soon(pending)
        await trio.testing.wait_all_tasks_blocked()
        await theirs.send_all(garbage)
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(endpoint.peer_error(1), ProtocolError)
        await endpoint.aclose()


class OpensOnAFailedWrite(Gated):
    """Reads nothing until a write fails: as a reader that had not yet got to the bytes the
    peer wrote before it closed, when this rank's write found the connection gone."""

    def __init__(self, inner: Connection) -> None:
        super().__init__(inner)
        self.allowed = 0  # from the start: a reader already in a read would get past it

    async def send_all(self, *buffers: BytesLike) -> None:
        try:
            await super().send_all(*buffers)
        except trio.BrokenResourceError:
            self.allow(None)
            raise


@pytest.mark.parametrize("nbytes", [8, 100_000], ids=["eager", "rendezvous"])
@pytest.mark.parametrize("pending", [False, True], ids=["alone", "with-a-pending-recv"])
async def test_a_send_that_finds_the_peer_gone_says_why_it_left(nbytes: int, pending: bool) -> None:
    """A peer that leaves a communicator says why (LEFT), then closes: a send to it whose
    write finds the connection gone before this rank's reader has read that LEFT raises what
    the LEFT says, as later calls do, not only that the connection ended; and so does a
    receive from it that was waiting meanwhile."""
    gates: dict[tuple[int, int], Gated] = {}

    def wrap(me: int, other: int, conn: Connection) -> Connection:
        gated = gates[me, other] = OpensOnAFailedWrite(conn) if me == 0 else Gated(conn)
        return gated

    def closed(what: str) -> TrioringError:
        return CommunicatorClosedError(f"closed during {what}")

    why = Leaving("on ValueError: bad batch", culprit=None)
    async with open_world(2, socket_pair, wrap=wrap, eager_bytes=1000) as w:
        left = "rank 1 left this communicator on ValueError: bad batch"
        async with trio.open_nursery() as nursery:
            if pending:

                async def recv() -> None:
                    with pytest.raises(PeerFailedError, match=left):
                        await w.recv(0, 1, 5)

                nursery.start_soon(recv)
            await trio.testing.wait_all_tasks_blocked()
            await w.endpoints[1].leave(COMM, closed, why)
            await w.endpoints[1].aclose()
            with pytest.raises(PeerFailedError, match=left) as raised:
                await w.send(0, 1, 0, np.zeros(nbytes // 8))
        assert raised.value.peer == 1
        assert "send(dest=1, tag=0)" in str(raised.value)


async def test_a_peer_gone_silent_fails_the_calls_within_the_drain(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A write that finds the peer gone lets the reader read on for what the peer said
    before it went, but not for ever: where nothing more comes (here a reader held back for
    good), the send and a receive waiting on the peer fail within ``_DRAIN_SECONDS``."""

    def wrap(me: int, other: int, conn: Connection) -> Connection:
        gated = Gated(conn)
        if me == 0:
            gated.allowed = 0
        return gated

    async with open_world(2, socket_pair, wrap=wrap) as w:
        async with trio.open_nursery() as nursery:

            async def recv() -> None:
                with pytest.raises(PeerFailedError, match="its connection ended"):
                    await w.recv(0, 1, 5)

            nursery.start_soon(recv)
            await trio.testing.wait_all_tasks_blocked()
            await w.endpoints[1].aclose()
            start = trio.current_time()
            with pytest.raises(PeerFailedError, match="its connection ended"):
                await w.send(0, 1, 0, np.zeros(1))
            assert trio.current_time() - start <= 2 * _engine._DRAIN_SECONDS
        assert trio.current_time() - start <= 2 * _engine._DRAIN_SECONDS


@pytest.mark.parametrize("unread", [False, True], ids=["end", "reset"])
async def test_a_left_read_right_before_the_end_of_the_connection_is_what_calls_say(
    unread: bool,
) -> None:
    """The peer's LEFT and the end of its connection (a reset where the peer closed with our
    RTS unread), read in one go (both waiting in the socket, so the reader takes them
    without passing through the scheduler): the send that waits for the peer raises what
    the LEFT says, not the bare end that came next. Found by the chaos trials (seed 344,
    about 1 run in 60)."""
    ours, theirs = socket.socketpair()
    endpoint = Endpoint(
        rank=0,
        connections={1: SocketConnection(trio.socket.from_stdlib_socket(ours))},
        eager_bytes=0,
    )
    scope = Scope(COMM, 0, (0, 1))
    endpoint.register(scope)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(endpoint.run)

            async def send() -> None:
                with pytest.raises(PeerFailedError, match="rank 1 left this communicator on "):
                    await endpoint.send(scope, 1, 0, np.arange(100.0))  # an RTS: waits

            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            if not unread:
                theirs.recv(65536)
            theirs.sendall(pack_left(COMM, Leaving("on ValueError: bad batch")))
            theirs.close()
            await trio.testing.wait_all_tasks_blocked()
            await endpoint.aclose()


async def test_unregister_fails_pending_calls() -> None:
    async with open_world(2, eager_bytes=0) as w:

        def error(what: str) -> TrioringError:
            return CommunicatorClosedError(f"closed during {what}")

        async with trio.open_nursery() as nursery:

            async def recv() -> None:
                with pytest.raises(
                    CommunicatorClosedError, match=r"during recv\(source=1, tag=0\)"
                ):
                    await w.recv(0, 1, 0)

            async def send() -> None:
                with pytest.raises(CommunicatorClosedError, match=r"during send\(dest=1, tag=0\)"):
                    await w.send(0, 1, 0, np.zeros(4))

            nursery.start_soon(recv)
            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            w.endpoints[0].unregister(COMM, error)
        with pytest.raises(CommunicatorClosedError, match="during recv_any"):
            await w.recv(0, None, 0)
        # Messages for it are dropped from now on, and their credit comes back.
        w.endpoints[1].unregister(COMM, error)
        await trio.testing.wait_all_tasks_blocked()


async def test_messages_before_registration_are_adopted() -> None:
    async with open_world(2, register=False, eager_bytes=100) as w:
        child = [Scope(77, r, (1, 0), "split #1 of world") for r in range(2)]
        w.endpoints[0].register(child[1])  # world rank 0 is rank 1 of the child
        await w.endpoints[0].send(child[1], 0, 5, np.arange(4))  # small: eager
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.endpoints[0].send, child[1], 0, 6, np.arange(400))  # RTS
            await trio.testing.wait_all_tasks_blocked()
            w.endpoints[1].register(child[0])
            source, got = await w.endpoints[1].recv(child[0], 1, 5)
            assert source == 1
            np.testing.assert_array_equal(got, np.arange(4))
            _, got = await w.endpoints[1].recv(child[0], None, 6)
            np.testing.assert_array_equal(got, np.arange(400))


async def test_aclose_fails_pending_calls() -> None:
    async with open_world(2) as w:
        async with trio.open_nursery() as nursery:

            async def recv() -> None:
                with pytest.raises(CommunicatorClosedError):
                    await w.recv(0, 1, 0)

            nursery.start_soon(recv)
            await trio.testing.wait_all_tasks_blocked()
            await w.endpoints[0].aclose()
            await w.endpoints[0].aclose()  # idempotent
        with pytest.raises(CommunicatorClosedError):
            await w.recv(0, 1, 0)


async def test_messages_for_a_closed_comm_are_dropped_and_credited() -> None:
    async with open_world(2, eager_bytes=1000, window_bytes=8192) as w:
        w.endpoints[1].unregister(COMM, lambda what: CommunicatorClosedError(what))
        for _ in range(7):  # 7 * (800 + 256) bytes, within the window
            await w.send(0, 1, 0, np.zeros(100))
        await trio.testing.wait_all_tasks_blocked()
        receiver = w.endpoints[1]._peers[0]
        assert receiver.buffered == 0
        assert receiver.owed == receiver.held == 7 * 1056
        # (An RTS for it would be dropped too, and its send wait until its own communicator
        # is closed: a communicator is closed on all its members.)
        # The credit owed is given back with the next frame the receiver writes.
        w.endpoints[1].register(Scope(2, 1, (0, 1)))
        w.endpoints[0].register(Scope(2, 0, (0, 1)))
        await w.endpoints[1].send(Scope(2, 1, (0, 1)), 0, 0, np.zeros(1))
        await trio.testing.wait_all_tasks_blocked()
        assert receiver.held == 0
        assert w.endpoints[0]._peers[1].credit == 8192


async def test_withdrawn_message_puts_its_receive_first_in_line(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A receive whose rendezvous message is withdrawn waits again ahead of later ones."""
    gates: dict[tuple[int, int], Gated] = {}
    async with open_world(2, wrap=_gate_receiver(gates), eager_bytes=0, chunk_bytes=1000) as w:
        gates[0, 1].allow_sends(2)  # the RTS and one chunk
        order: list[str] = []

        async def receive(name: str) -> None:
            _, got = await w.recv(1, 0, 0)
            order.append(f"{name}={got.size}")

        async def reopen() -> None:
            await trio.sleep(2)
            gates[0, 1].allow_sends(None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive, "first")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(receive, "second")
            nursery.start_soon(reopen)
            with trio.move_on_after(1):
                await w.send(0, 1, 0, np.zeros(1000))
            await trio.testing.wait_all_tasks_blocked()
            assert not order
            await w.send(0, 1, 0, np.zeros(3))
            await w.send(0, 1, 0, np.zeros(5))
        assert order == ["first=3", "second=5"]


class SlowToReturn(Connection):
    """A connection whose send_all returns only after every other task has run: the
    peer's answer to a frame arrives (and our reader handles it) while the sender is still
    in the write that carried the frame, as a real socket allows under load."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner

    async def send_all(self, *buffers: BytesLike) -> None:
        await self.inner.send_all(*buffers)
        await trio.testing.wait_all_tasks_blocked()

    async def recv_into(self, buffer: memoryview) -> int:
        return await self.inner.recv_into(buffer)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("recv_first", [False, True])
async def test_answer_during_the_write_of_its_request(recv_first: bool) -> None:
    """Regression: a CTS read while the RTS's write was still in its checkpoint found no
    send registered, was taken for the answer to a withdrawn send and dropped, and the
    send waited for ever (seen as a 1-in-6 hang of a 64 MiB send between processes)."""
    data = sample((50_000,))
    async with open_world(
        2, wrap=lambda i, j, c: SlowToReturn(c), eager_bytes=1024, chunk_bytes=65536
    ) as w:
        got: list[tuple[int, np.ndarray]] = []

        async def receive() -> None:
            got.append(await w.recv(1, 0, 2))

        async with trio.open_nursery() as nursery:
            if recv_first:
                nursery.start_soon(receive)
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(w.send, 0, 1, 2, data)
            if not recv_first:
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(receive)
        assert got[0][0] == 0
        np.testing.assert_array_equal(got[0][1], data)
