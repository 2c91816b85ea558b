"""Unit-level checks: configuration, registry, transports, framing, tree shape."""

from __future__ import annotations

import functools
import os
import socket
import stat
import sys
import textwrap
from typing import TYPE_CHECKING

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioring
from trioring import _algorithms
from trioring._algorithms import tree_neighbours
from trioring._collectives._alltoall import _checked_incoming
from trioring._collectives._counts import checked_rows
from trioring._communicator import DEFAULT_CHUNK_BYTES
from trioring._concurrency import run_with_grace
from trioring._config import Config, resolve
from trioring._framing import Link
from trioring._onehost import _shm, _shm_collectives
from trioring._onehost._cpus import Cpus, cpu_vendor, spin_for
from trioring._wire import HEADER, Kind, OpSpec
from trioring.transports import (
    MemoryTransport,
    SocketConnection,
    StreamConnection,
    TcpTransport,
    Transport,
    TransportContext,
    UnixTransport,
)

if TYPE_CHECKING:
    from pathlib import Path

BASE_ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def resolve_env(env: dict[str, str], **kwargs: object) -> object:
    args: dict[str, object] = {
        "rank": None,
        "world_size": None,
        "master_addr": None,
        "master_port": None,
        "transport": None,
    }
    args.update(kwargs)
    return resolve(env=env, **args)  # type: ignore[arg-type]


# -- configuration --------------------------------------------------------------------------


def test_config_from_environment() -> None:
    config = resolve_env(BASE_ENV)
    assert config == resolve_env(
        {}, rank=1, world_size=4, master_addr="127.0.0.1", master_port=29500
    )
    assert config.transport == "tcp"  # type: ignore[attr-defined]


def test_arguments_beat_environment() -> None:
    config = resolve_env(BASE_ENV, rank=3, transport="unix")
    assert config.rank == 3  # type: ignore[attr-defined]
    assert config.transport == "unix"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": None}, "RANK is not set: pass rank= to open_communicator"),
        ({"WORLD_SIZE": None}, "WORLD_SIZE is not set"),
        ({"RANK": "abc"}, "RANK='abc' is not an integer"),
        ({"RANK": "-1"}, "RANK=-1 is out of range"),
        ({"RANK": "4"}, "rank 4 is out of range for world size 4"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is out of range"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        (
            {"TRIORING_TRANSPORT": "unix", "TRIORING_SOCKET_DIR": "/nonexistent/trioring"},
            "TRIORING_SOCKET_DIR='/nonexistent/trioring' is not an existing directory",
        ),
    ],
)
def test_bad_environment(change: dict[str, str | None], message: str) -> None:
    env = {**BASE_ENV, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(trioring.ConfigurationError, match=message.replace("(", r"\(")):
        resolve_env(env)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": True}, "rank= must be an int"),
        ({"rank": "1"}, "rank= must be an int"),
        ({"world_size": 2.0}, "world_size= must be an int"),
        ({"master_addr": ""}, "master_addr= must be a non-empty string"),
        ({"transport": ""}, "transport= must be a transport name"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(trioring.ConfigurationError, match=message):
        resolve_env(BASE_ENV, **kwargs)


def test_world_of_one_and_socket_dir_need_no_address(tmp_path: Path) -> None:
    assert resolve_env({"RANK": "0", "WORLD_SIZE": "1"}).master_addr is None  # type: ignore[attr-defined]
    env = {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "TRIORING_TRANSPORT": "unix",
        "TRIORING_SOCKET_DIR": str(tmp_path),
    }
    assert resolve_env(env).rendezvous_over_socket_dir  # type: ignore[attr-defined]


async def test_open_communicator_fails_before_io(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRIORING_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(trioring.ConfigurationError, match="RANK is not set"):
        async with trioring.open_communicator(world_size=2):
            pass  # pragma: no cover
    with pytest.raises(trioring.ConfigurationError, match="unknown transport 'carrier-pigeon'"):
        async with trioring.open_communicator(rank=0, world_size=1, transport="carrier-pigeon"):
            pass  # pragma: no cover


async def test_open_communicator_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    async with trioring.open_communicator(rank=0, world_size=1) as comm:
        x = np.arange(4.0)
        await comm.allreduce(x, op="mean")
        await comm.broadcast(x)
        await comm.barrier()
        assert comm.rank == 0
        assert comm.world_size == 1
        assert comm.transport == "tcp"
        np.testing.assert_array_equal(x, np.arange(4.0))
    assert comm.closed


# -- capability registry ----------------------------------------------------------------------


def test_capabilities_lists_builtins() -> None:
    rows = {row.name: row for row in trioring.capabilities()}
    assert {"tcp", "unix", "memory"} <= rows.keys()
    for name in ("tcp", "unix", "memory"):
        assert rows[name].available
        assert rows[name].reason is None
        assert rows[name].kind == "transport"
        assert trioring.is_available(name)
    assert not trioring.is_available("no-such-thing")


class _Unavailable(MemoryTransport):
    name = "test-unavailable"  # type: ignore[misc]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "needs a quantum link"


async def test_unavailable_transport_says_why() -> None:
    trioring.register_transport(_Unavailable, replace=True)
    assert not trioring.is_available("test-unavailable")
    row = next(r for r in trioring.capabilities() if r.name == "test-unavailable")
    assert row.reason == "needs a quantum link"
    assert row.origin == "registered"
    with pytest.raises(trioring.TransportUnavailable, match="needs a quantum link") as info:
        async with trioring.open_communicator(rank=0, world_size=1, transport="test-unavailable"):
            pass  # pragma: no cover
    assert info.value.transport == "test-unavailable"
    with pytest.raises(trioring.ConfigurationError, match="already registered"):
        trioring.register_transport(_Unavailable)
    with pytest.raises(trioring.ConfigurationError, match="not a trioring.transports.Transport"):
        trioring.register_transport(int)  # type: ignore[arg-type]


PLUGIN = '''
import trio
from trioring.transports import TcpTransport

CONNECTS = []

class LoopbackPlugin(TcpTransport):
    """A third-party transport: TCP that counts its connections."""
    name = "loopback-plugin"
    description = "test plugin"

    async def connect(self, address):
        CONNECTS.append(address)
        return await super().connect(address)

class Broken:
    pass
'''


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed-looking distribution declaring entry points, on sys.path."""
    (tmp_path / "trioring_test_plugin.py").write_text(PLUGIN)
    info = tmp_path / "trioring_test_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: trioring-test-plugin\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [trioring.transports]
            loopback-plugin = trioring_test_plugin:LoopbackPlugin
            broken-plugin = trioring_test_plugin:Broken
            missing-plugin = trioring_test_plugin_missing:Nope
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("trioring_test_plugin", None)


async def test_entry_point_transport_is_found_and_used(plugin_dist: Path) -> None:
    rows = {row.name: row for row in trioring.capabilities()}
    assert rows["loopback-plugin"].available
    assert rows["loopback-plugin"].origin == "trioring-test-plugin"
    assert not rows["broken-plugin"].available
    assert "is not a trioring.transports.Transport" in (rows["broken-plugin"].reason or "")
    assert not rows["missing-plugin"].available
    assert "failed to load" in (rows["missing-plugin"].reason or "")

    import trioring_test_plugin  # type: ignore[import-not-found]

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = [np.full(3, r + 1.0) for r in range(2)]

    async def rank_main(rank: int) -> None:
        async with trioring.open_communicator(
            rank=rank,
            world_size=2,
            master_addr="127.0.0.1",
            master_port=port,
            transport="loopback-plugin",
        ) as comm:
            assert comm.transport == "loopback-plugin"
            await comm.allreduce(results[rank])

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for rank in range(2):
                nursery.start_soon(rank_main, rank)
    for result in results:
        np.testing.assert_array_equal(result, [3.0, 3.0, 3.0])
    # Data connections went through the plugin: rank 1 connected to rank 0 twice, once for
    # the collectives and once for point-to-point messages.
    assert len(trioring_test_plugin.CONNECTS) == 2


# -- transports -------------------------------------------------------------------------------


async def exchange(transport: Transport) -> None:
    """The Connection contract, checked the same way for every transport."""
    listener = await transport.listen()
    async with listener:
        client = await transport.connect(listener.address)
        server = await listener.accept()
        payload = np.arange(300_000, dtype=np.uint8)
        received = np.zeros_like(payload)

        async def send() -> None:
            await client.send_all(b"", payload.data[:1000], payload.data[1000:])

        async def receive() -> None:
            view = received.data
            while view.nbytes:
                got = await server.recv_into(view)
                assert got > 0
                view = view[got:]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(receive)
        assert received.tobytes() == payload.tobytes()
        with trio.testing.assert_checkpoints():
            await client.send_all()
        # Clean close on one side: end of file on the other.
        await client.aclose()
        await client.aclose()
        assert await server.recv_into(memoryview(bytearray(10))) == 0
        with pytest.raises(trio.ClosedResourceError):
            await client.send_all(b"x")
        await server.aclose()


async def test_tcp_transport_contract() -> None:
    await exchange(TcpTransport(TransportContext(rank=0, world_size=1)))


async def test_unix_transport_contract(tmp_path: Path) -> None:
    await exchange(UnixTransport(TransportContext(rank=0, world_size=1, socket_dir=str(tmp_path))))


async def test_unix_connections_take_a_whole_chunk_without_waiting(tmp_path: Path) -> None:
    # Both ends ask for a send buffer that holds a whole chunk: with the default (208 KiB)
    # every larger frame waited for the receiver midway. The kernel caps the request at
    # net.core.wmem_max and doubles what it grants.
    with open("/proc/sys/net/core/wmem_max") as file:
        wmem_max = int(file.read())
    expected = 2 * min(DEFAULT_CHUNK_BYTES, wmem_max)
    transport = UnixTransport(TransportContext(rank=0, world_size=1, socket_dir=str(tmp_path)))
    async with await transport.listen() as listener:
        client = await transport.connect(listener.address)
        server = await listener.accept()
        for connection in (client, server):
            assert isinstance(connection, SocketConnection)
            granted = connection.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            assert granted >= expected
        await client.aclose()
        await server.aclose()


async def test_memory_transport_contract() -> None:
    await exchange(MemoryTransport(TransportContext(rank=0, world_size=1)))


async def test_broken_connection_raises_broken_resource(tmp_path: Path) -> None:
    transport = UnixTransport(TransportContext(rank=0, world_size=1, socket_dir=str(tmp_path)))
    async with await transport.listen() as listener:
        client = await transport.connect(listener.address)
        server = await listener.accept()
        await server.aclose()
        with pytest.raises(trio.BrokenResourceError):  # noqa: PT012 - the kernel buffers a while
            for _ in range(1000):
                await client.send_all(bytes(65536))
        await client.aclose()


async def test_unix_private_directory_and_permissions() -> None:
    transport = UnixTransport(TransportContext(rank=3, world_size=4))
    listener = await transport.listen()
    path = listener.address
    directory = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    await listener.aclose()
    assert not os.path.exists(path)
    transport.close()
    assert not os.path.exists(directory)


async def test_unix_stale_socket_replaced_live_socket_and_files_kept(tmp_path: Path) -> None:
    transport = UnixTransport(TransportContext(rank=0, world_size=1))
    stale = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(stale)
    dead.close()  # the file stays, as after a SIGKILL
    async with await transport.listen(stale):
        # A live socket at the path is never removed.
        with pytest.raises(OSError, match="in use"):
            await transport.listen(stale)
    regular = tmp_path / "regular"
    regular.write_text("precious")
    with pytest.raises(OSError):  # noqa: PT011
        await transport.listen(str(regular))
    assert regular.read_text() == "precious"


async def test_unix_path_too_long(tmp_path: Path) -> None:
    transport = UnixTransport(TransportContext(rank=0, world_size=1))
    with pytest.raises(OSError, match="limit is 107"):
        await transport.listen(str(tmp_path / ("x" * 120)))


# -- framing ----------------------------------------------------------------------------------


async def test_garbage_is_a_protocol_error() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    link = Link(0, 1, StreamConnection(ours))
    await theirs.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(48))
    with pytest.raises(
        trioring.ProtocolError, match="rank 0: allreduce #7: from peer rank 1: bad frame header"
    ):
        await link.recv(OpSpec(Kind.ALLREDUCE, 7, 10, 4, 1), 0, memoryview(bytearray(16)))


async def test_unexpected_chunk_is_a_protocol_error() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    receiving = Link(0, 1, StreamConnection(ours))
    sending = Link(1, 0, StreamConnection(theirs))
    spec = OpSpec(Kind.ALLREDUCE, 1, 10, 4, 1)
    await sending.send(spec, 2, memoryview(bytes(8)))
    with pytest.raises(trioring.ProtocolError, match="expected the chunk at element 0 of 16 bytes"):
        await receiving.recv(spec, 0, memoryview(bytearray(16)))


async def test_abort_reason_length_is_bounded_before_allocation() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    link = Link(0, 1, StreamConnection(ours))
    header = HEADER.pack(b"TRNG", 1, 2, 2, 0, 0, 1, 1, 0, 0, 2**62)
    await theirs.send_all(header)
    with pytest.raises(trioring.ProtocolError, match="too long"):
        await link.recv(OpSpec(Kind.BARRIER, 1), 0, memoryview(b""))


async def test_eof_mid_payload_is_peer_failure() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    receiving = Link(0, 1, StreamConnection(ours))
    spec = OpSpec(Kind.BROADCAST, 3, 10, 4, 0, 0)
    header = HEADER.pack(b"TRNG", 1, 1, 2, 0, 10, 0, 3, 4, 0, 16)
    await theirs.send_all(header + bytes(5))
    await theirs.aclose()
    with pytest.raises(trioring.PeerFailedError, match="after 5 of 16 bytes of a payload") as info:
        await receiving.recv(spec, 0, memoryview(bytearray(16)))
    assert (info.value.rank, info.value.peer, info.value.collective, info.value.seq) == (
        0,
        1,
        "broadcast",
        3,
    )


# -- algorithms -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", range(1, 18))
def test_binomial_tree_reaches_everyone_once(size: int) -> None:
    for root in range(size):
        parents = {}
        for rank in range(size):
            parent, children = tree_neighbours(rank, size, root)
            for child in children:
                assert tree_neighbours(child, size, root)[0] == rank
            parents[rank] = parent
        assert parents[root] is None
        assert all(parents[r] is not None for r in range(size) if r != root)
        # Depth is at most ceil(log2(size)).
        for rank in range(size):
            depth, node = 0, rank
            while parents[node] is not None:
                node, depth = parents[node], depth + 1  # type: ignore[assignment]
            assert depth <= max(0, (size - 1).bit_length())


# -- grace periods ----------------------------------------------------------------------------


async def _stalled_step(clock: trio.testing.MockClock, done: list[str]) -> None:
    # The process stalls (the clock jumps past the whole grace) after the task started and
    # before its first checkpoint came back: what a loaded machine did to abort notices.
    clock.jump(10.0)
    await trio.lowlevel.checkpoint()
    done.append("sent")


async def test_a_stall_does_not_use_up_the_grace(mock_clock: trio.testing.MockClock) -> None:
    done: list[str] = []
    assert await run_with_grace(0.25, functools.partial(_stalled_step, mock_clock, done))
    assert done == ["sent"]
    # The single deadline it replaced cancels the same task (so the test above can fail).
    done.clear()
    with trio.move_on_after(0.25):
        await _stalled_step(mock_clock, done)
    assert done == []


async def test_grace_cancels_what_is_still_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    finished: list[str] = []

    async def quick() -> None:
        await trio.sleep(0.01)
        finished.append("quick")

    async def stuck() -> None:
        await trio.sleep_forever()

    start = trio.current_time()
    assert not await run_with_grace(0.25, quick, stuck)
    assert finished == ["quick"]
    assert trio.current_time() - start == pytest.approx(0.25)
    # Nothing to run, or all of it done early: no wait at all for the grace.
    start = trio.current_time()
    assert await run_with_grace(0.25)
    assert await run_with_grace(0.25, quick)
    assert trio.current_time() - start == pytest.approx(0.01)


async def test_cancelling_the_caller_cancels_the_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def stuck() -> None:
        await trio.sleep_forever()

    with trio.move_on_after(0.05) as scope:
        await run_with_grace(10.0, stuck)
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(0.05)


# -- where ranks run --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mine", "peers", "polls", "oversubscribed"),
    [
        # Unpinned, as many ranks as CPUs, or more.
        ({0, 1}, [{0, 1}], True, False),
        ({0, 1}, [{0, 1}] * 3, True, True),
        # Pinned one per core (mpirun's default for 2 ranks), at worlds 2 and 4.
        ({0}, [{1}], True, False),
        ({2}, [{0}, {1}, {3}], True, False),
        # Two ranks on one CPU: the peer could not answer while we poll.
        ({0}, [{0}], False, True),
        # Four ranks pinned two per core: the same, for each pair.
        ({0}, [{1}, {0}, {1}], False, True),
        # Pinned, with a peer free to run anywhere (it need not wait for our CPU).
        ({0}, [{0, 1}], True, False),
        # Peers not known (TCP, or an affinity that could not be read): our own CPUs decide.
        ({0}, None, False, True),
        ({0, 1}, None, True, False),
    ],
)
def test_where_ranks_run_decides_polling_and_yielding(
    mine: set[int], peers: list[set[int]] | None, polls: bool, oversubscribed: bool
) -> None:
    cpus = Cpus(frozenset(mine), None if peers is None else tuple(map(frozenset, peers)))
    assert cpus.polling_helps is polls
    world_size = 1 + (len(peers) if peers is not None else 1)
    assert cpus.oversubscribed(world_size) is oversubscribed
    config = Config(
        rank=0,
        world_size=world_size,
        transport="unix",
        master_addr=None,
        master_port=None,
        socket_dir=None,
        spin_seconds=5e-5,
    )
    assert spin_for(config, cpus) == (5e-5 if polls else 0.0)
    # TRIORING_SPIN_US, where given, is used as it is.
    assert spin_for(attrs.evolve(config, spin_given=True), cpus) == 5e-5


def test_broadcast_pieces_are_quarters_of_powers_of_two() -> None:
    """A broadcast is copied in pieces of a quarter of it, rounded down to a power of two
    (so that the pipe's ring holds whole pieces), from 64 KiB to the pipe's 1 MiB chunks;
    where some rank is crowded, in the pipe's chunks (through the slots: whole)."""
    pieces = _shm.broadcast_piece_bytes
    kib = 1024
    for nbytes, expected in [
        (0, 64 * kib),
        (4, 64 * kib),
        (192 * kib, 64 * kib),
        (256 * kib, 64 * kib),
        (600_004, 128 * kib),
        (1024 * kib, 256 * kib),
        (1024 * kib - 4, 128 * kib),
        (3 * 1024 * kib, 512 * kib),
        (4 * 1024 * kib, 1024 * kib),
        (64 * 1024 * kib, 1024 * kib),
    ]:
        assert pieces(nbytes, crowded=False) == expected, nbytes
        assert pieces(nbytes, crowded=True) == _shm.PIPE_CHUNK_BYTES, nbytes
    assert (_shm.PIPE_CHUNKS * _shm.PIPE_CHUNK_BYTES) % _shm.BROADCAST_PIECE_MIN_BYTES == 0


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "HygonGenuine", ""])
def test_broadcasts_through_the_slots_take_pieces_on_intel_cpus_only(vendor: str) -> None:
    """On Intel CPUs more than three pieces go piece by piece; elsewhere no slot holds more
    than the limit, so the slots copy whole. This machine follows its vendor's rule."""
    assert _shm.slot_pieces_from_bytes("GenuineIntel") == 3 * _shm.BROADCAST_PIECE_MIN_BYTES
    assert _shm.slot_pieces_from_bytes(vendor) >= _shm.SHM_MAX_BYTES
    assert _shm.slot_pieces_from_bytes(cpu_vendor()) == _shm_collectives._PIECES_FROM_BYTES


# -- the uneven collectives' counts ------------------------------------------------------------


def _counts_world(rank: int, size: int) -> _algorithms.World:
    """A world for the count checks, which read only its rank and size (and its links' job
    id, of which there is none here)."""
    return _algorithms.World(
        rank=rank, size=size, links={}, chunk_bytes=0, scratch=np.zeros(0, np.uint8)
    )


@pytest.mark.parametrize("rank", [0, 2])
def test_allgatherv_counts_agree_or_raise_naming_the_peer(rank: int) -> None:
    """The vectors ``[rows, out= capacity or -1, *trailing]`` (and, through the segment,
    words after them) of every rank: the usual call's rows whichever check answers; a
    capacity on one rank only, or the right total, passes; a negative count is a
    ProtocolError naming its sender, a different trailing shape or a wrong capacity a
    CollectiveMismatchError naming the odd rank."""
    world = _counts_world(rank, 3)
    spec = OpSpec(Kind.ALLGATHERV, 9, 10, 3, trailing=(2,))
    extra = [7, 40]  # what follows the vector through the segment: address, bytes
    usual = [[5, -1, 2, *extra], [0, -1, 2, *extra], [3, -1, 2, *extra]]
    assert checked_rows(world, spec, usual, 3) == [5, 0, 3]
    out_on_one = [row[:] for row in usual]
    out_on_one[1][1] = 16  # (5 + 0 + 3) rows of 2
    assert checked_rows(world, spec, out_on_one, 3) == [5, 0, 3]
    assert checked_rows(world, spec, out_on_one, 3, root=1) == [5, 0, 3]

    negative = [row[:] for row in usual]
    negative[1][0] = -4
    with pytest.raises(
        trioring.ProtocolError, match=r"from peer rank 1: impossible counts \[-4, -1, 2\]"
    ):
        checked_rows(world, spec, negative, 3)
    other_shape = [row[:] for row in usual]
    other_shape[1][2] = 3
    with pytest.raises(
        trioring.CollectiveMismatchError, match="rank 1: allgatherv float32"
    ) as info:
        checked_rows(world, spec, other_shape, 3)
    assert info.value.peer == 1
    wrong_out = [row[:] for row in usual]
    wrong_out[2][1] = 15
    with pytest.raises(trioring.CollectiveMismatchError, match="rank 2: out= holds 15 elements"):
        checked_rows(world, spec, wrong_out, 3)
    # A gatherv checks its root's out= only.
    assert checked_rows(world, spec, wrong_out, 3, root=0) == [5, 0, 3]


def test_alltoallv_counts_agree_or_raise_naming_the_peer() -> None:
    """The ``[rows, *trailing]`` every rank sends this one: the rows, or the error naming
    the sender of a negative count or of another trailing shape."""
    world = _counts_world(1, 3)
    spec = OpSpec(Kind.ALLTOALLV, 4, 10, 1)
    assert _checked_incoming(world, spec, [[2], [0], [7]], ()) == [2, 0, 7]
    with pytest.raises(trioring.ProtocolError, match=r"from peer rank 2: impossible counts \[-1\]"):
        _checked_incoming(world, spec, [[2], [0], [-1]], ())
    assert _checked_incoming(world, spec, [[2, 3], [0, 3], [1, 3]], (3,)) == [2, 0, 1]
    with pytest.raises(trioring.CollectiveMismatchError) as info:
        _checked_incoming(world, spec, [[2, 3], [0, 3], [1, 4]], (3,))
    assert info.value.peer == 2
    with pytest.raises(
        trioring.ProtocolError, match=r"from peer rank 0: impossible counts \[1, -3\]"
    ):
        _checked_incoming(world, spec, [[1, -3], [0, 3], [1, 3]], (3,))
