"""The gated fast paths (cross-memory attach, bounded polling) and their fallbacks.

Real ranks (tests/launched.py) run tests/workers/stress_worker.py, which overwrites arrays
the moment each collective returns (see its docstring), for worlds 2 to 4, with the fast
paths on, off, and refused by a single rank (then every rank must fall back).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from launched import run_reports
from trioring._collectives import _decision
from trioring._config import spin_seconds
from trioring._framing import Link
from trioring._onehost import _cma
from trioring._wire import HEADER, AbortKind, Kind, OpSpec, pack_data_header
from trioring.transports._socket import SocketConnection

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

WORKER = Path(__file__).parent / "workers" / "stress_worker.py"
ITERATIONS = 36
CMA_HERE = trioring.is_available("cma")
SHM_HERE = trioring.is_available("shm")


def run_stress(
    tmp_path: Path, n: int, *, env: dict[str, str] | None = None, transport: str = "unix"
) -> list[dict[str, object]]:
    return run_reports(
        WORKER, [str(ITERATIONS), str(tmp_path)], tmp_path, n, transport=transport, env=env
    )


@pytest.mark.parametrize("n", [2, 3, 4])
def test_arrays_overwritten_on_return_with_fast_paths(tmp_path: Path, n: int) -> None:
    reports = run_stress(tmp_path, n)
    assert all(report["errors"] == [] for report in reports)
    for report in reports:
        assert ("cma" in report["features"]) is CMA_HERE  # type: ignore[operator]
        assert ("shm" in report["features"]) is SHM_HERE  # type: ignore[operator]
        calls = report["calls"]
        assert isinstance(calls, dict)
        if SHM_HERE:
            # The stress's 1 MB calls go through the pipe (and its 2.5 MB ones where
            # PIPE_MAX_REDUCE_BYTES is 4 MiB: not on Intel CPUs), but allreduces and
            # reduces by cross-memory attach where the ranks push and the pipe's limit
            # for pushed reductions is below them (on Intel CPUs: see _limits.PipeLimits)...
            push = "push" in report["features"]  # type: ignore[operator]
            pushed = ("pipe_allreduce", "pipe_reduce")
            piped = _decision.pipe_reduce_limit(push) >= 1_000_001
            for name in ("pipe_reduce_scatter", *(pushed if piped else ())):
                assert calls.get(name, 0) >= 1, (name, calls)
            for name in pushed:
                assert (calls.get(name, 0) == 0) is not piped, (name, calls)
            # Its 200 KB and 256 KiB broadcasts go through the slots in pieces, where no
            # rank shares its CPUs with more ranks than it has (on any CPU: the worker
            # takes the Intel CPUs' rule).
            if not report["crowded"]:
                assert calls.get("_broadcast_pieces", 0) >= 1, calls
        if SHM_HERE and CMA_HERE:
            # ...and its 8 MB ones, above PIPE_MAX_REDUCE_BYTES, by cross-memory attach.
            for name in ("cma_allreduce", "cma_reduce_scatter", "cma_reduce"):
                assert calls.get(name, 0) >= 1, (name, calls)


def test_fallback_when_turned_off(tmp_path: Path) -> None:
    reports = run_stress(tmp_path, 3, env={"TRIORING_CMA": "0", "TRIORING_SPIN_US": "0"})
    assert [report["features"] for report in reports] == [[], [], []]
    assert all(report["errors"] == [] for report in reports)


def test_one_rank_refusing_makes_every_rank_fall_back(tmp_path: Path) -> None:
    reports = run_stress(tmp_path, 3, env={"STRESS_NO_CMA_RANK": "1"})
    assert all("cma" not in report["features"] for report in reports)  # type: ignore[operator]
    assert all(report["errors"] == [] for report in reports)


def test_one_rank_refusing_shm_makes_every_rank_fall_back(tmp_path: Path) -> None:
    reports = run_stress(tmp_path, 3, env={"STRESS_NO_SHM_RANK": "2"})
    assert all("shm" not in report["features"] for report in reports)  # type: ignore[operator]
    assert all(report["errors"] == [] for report in reports)


def test_tcp_never_uses_cross_memory_attach_or_shm(tmp_path: Path) -> None:
    reports = run_stress(tmp_path, 2, transport="tcp")
    for report in reports:
        assert "cma" not in report["features"]  # type: ignore[operator]
        assert "shm" not in report["features"]  # type: ignore[operator]
    assert all(report["errors"] == [] for report in reports)


def test_capability_rows() -> None:
    rows = {row.name: row for row in trioring.capabilities()}
    for name in ("cma", "shm", "spin"):
        assert rows[name].kind == "feature"
        assert rows[name].available == trioring.is_available(name)
        assert (rows[name].reason is None) == rows[name].available


def test_cma_turned_off_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIORING_CMA", "0")
    row = next(row for row in trioring.capabilities() if row.name == "cma")
    assert not row.available
    assert row.reason == "turned off by TRIORING_CMA=0"


def test_shm_turned_off_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIORING_SHM", "0")
    row = next(row for row in trioring.capabilities() if row.name == "shm")
    assert not row.available
    assert row.reason == "turned off by TRIORING_SHM=0"


def test_shm_needs_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIORING_SPIN_US", "0")
    row = next(row for row in trioring.capabilities() if row.name == "shm")
    assert not row.available
    assert row.reason is not None
    if SHM_HERE:
        assert "TRIORING_SPIN_US=0" in row.reason, row.reason


@pytest.mark.skipif(not CMA_HERE, reason="process_vm_readv is not permitted on this machine")
def test_cma_reads_and_reports_errors() -> None:
    source = np.arange(1000, dtype=np.int64)
    target = np.zeros_like(source)
    _cma.read_into(os.getpid(), source.ctypes.data, target.ctypes.data, source.nbytes)
    assert np.array_equal(source, target)
    with pytest.raises(_cma.CmaError) as info:
        _cma.read_into(os.getpid(), 8, target.ctypes.data, 8)  # unmapped address
    assert info.value.errno == errno.EFAULT
    with pytest.raises(_cma.CmaError) as info:
        _cma.read_into(2**22 + 12345, 8, ctypes.addressof(ctypes.c_int64()), 8)
    assert info.value.errno == errno.ESRCH


def test_data_address_is_where_the_data_is() -> None:
    """The cheap address (through the buffer protocol) is numpy's own for every array a
    collective may expose or fill, and the fallback covers the ones the buffer protocol
    refuses: read-only, empty, not contiguous."""
    base = np.arange(4096, dtype=np.float32)
    read_only = base.copy()
    read_only.flags.writeable = False
    arrays = {
        "whole": base,
        "offset view": base[17:1000],
        "2-d": base.reshape(64, 64),
        "read-only": read_only,
        "read-only view": read_only[5:],
        "empty": np.empty(0, np.float64),
        "strided": base[::2],
        "memmap-like bytes": base.view(np.uint8)[3:],
    }
    for name, array in arrays.items():
        assert _cma.data_address(array) == array.ctypes.data, name


def test_spin_setting() -> None:
    assert spin_seconds({"TRIORING_SPIN_US": "0"}) == 0.0
    assert spin_seconds({"TRIORING_SPIN_US": "120"}) == pytest.approx(120e-6)
    for bad in ("-1", "abc", "1e3", "20000"):
        with pytest.raises(trioring.ConfigurationError, match="TRIORING_SPIN_US"):
            spin_seconds({"TRIORING_SPIN_US": bad})


async def test_collectives_over_sockets_are_checkpoints_even_when_data_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks as tasks of one process over real Unix sockets: whichever rank finds its
    peer's frame already waiting completes without parking, and must still checkpoint."""
    monkeypatch.setenv("TRIORING_SOCKET_DIR", str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    results: dict[int, list[float]] = {}

    async def rank(r: int) -> None:
        async with trioring.open_communicator(rank=r, world_size=2, transport="unix") as comm:
            x = np.full(3, r + 1.0)
            for _ in range(20):
                with trio.testing.assert_checkpoints():
                    await comm.allreduce(x)
                with trio.testing.assert_checkpoints():
                    await comm.barrier()
                with trio.testing.assert_checkpoints():
                    await comm.broadcast(x, root=1)
            results[r] = x.tolist()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank, 0)
            nursery.start_soon(rank, 1)
    assert results[0] == results[1] == [3.0 * 2**19] * 3


async def test_two_long_waits_never_watch_the_same_link(autojump_clock: object) -> None:
    """Two receives on different links that both wait past the watch threshold in the same
    scheduler batch (the virtual clock jumps past it for both at once) must not both start a
    watcher on the one idle link: trio allows one reader per fd. An abort frame on the idle
    link then ends the receive that watches it with the aborting peer's reason; breaking, as
    the communicator would, ends the other."""
    spec = OpSpec(Kind.BARRIER, 7)
    errors: list[BaseException] = []
    async with socket_links(3) as (links, theirs):

        async def receive(link: Link) -> None:
            try:
                await link.recv(spec, 0, memoryview(b""))
            except trioring.TrioringError as exc:
                errors.append(exc)
                for each in links:
                    await each.connection.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive, links[0])
            nursery.start_soon(receive, links[1])
            await trio.sleep(1)  # both waits are long past the threshold; link 3 is watched
            await Link(3, 0, theirs[2]).send_abort(AbortKind.CANCELLED, 3, 7, "cancelled", 3)
    assert sorted(type(e).__name__ for e in errors) == [
        "CommunicatorClosedError",
        "PeerAbortedError",
    ]
    aborted = next(e for e in errors if isinstance(e, trioring.PeerAbortedError))
    assert aborted.peer == 3
    assert "rank 3 cancelled" in str(aborted)


@asynccontextmanager
async def socket_links(count: int) -> AsyncIterator[tuple[list[Link], list[SocketConnection]]]:
    """Links from rank 0 to peers 1..count over socketpairs, each watching the others, and
    the peers' ends of the sockets; all closed on exit."""
    ours, theirs = [], []
    for _ in range(count):
        a, b = socket.socketpair()
        ours.append(SocketConnection(trio.socket.from_stdlib_socket(a)))
        theirs.append(SocketConnection(trio.socket.from_stdlib_socket(b)))
    links = [Link(0, peer + 1, connection) for peer, connection in enumerate(ours)]
    for link in links:
        link.watch = links
    try:
        yield links, theirs
    finally:
        for connection in ours + theirs:
            await connection.aclose()


@pytest.mark.parametrize("frames_before", [0, 1, 3])
async def test_a_long_wait_sees_an_abort_behind_data_frames(
    autojump_clock: object, frames_before: int
) -> None:
    """A peer that sent its part of a step and then gave up leaves data frames in front of
    its abort frame. A receive waiting on another link must still end with that abort, read
    past the data frames by the watch on the idle link."""
    spec = OpSpec(Kind.ALLREDUCE, 5, dtype_code=1, count=4, op_code=1)
    async with socket_links(2) as (links, theirs):
        sender = Link(2, 0, theirs[1])
        for step in range(frames_before):
            await sender.send(spec, step, memoryview(bytes(16)))

        async def abort_later() -> None:
            await trio.sleep(1)  # long past the watch threshold
            await sender.send_abort(AbortKind.CANCELLED, 2, 5, "cancelled", 2)

        errors: list[trioring.TrioringError] = []

        async def receive() -> None:
            try:
                await links[0].recv(spec, 0, memoryview(bytearray(16)))
            except trioring.TrioringError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_later)
            nursery.start_soon(receive)
        [error] = errors
        assert isinstance(error, trioring.PeerAbortedError), error
        assert error.peer == 2
        assert "rank 2 cancelled" in str(error)


async def test_a_peer_that_finished_the_call_and_closed_leaves_it_to_complete(
    autojump_clock: object,
) -> None:
    """Rank 2 finished call 5, then closed its communicator: its closing notice (about call
    6) sits on its link while this rank still waits in call 5 for rank 1, long enough for a
    watch to read it. The watch leaves it unread, call 5 completes, and only a receive of
    call 6 from rank 2 raises it: the end of a program is not a failure."""
    spec = OpSpec(Kind.ALLREDUCE, 5, dtype_code=1, count=4, op_code=1)
    async with socket_links(2) as (links, theirs):
        closer = Link(2, 0, theirs[1])
        closer.send_closing(2, 6, "closed its communicator after collective #5")
        await theirs[1].aclose()
        # What a breaking call looks for on every link: not this notice (its cause is
        # elsewhere), which stays consumed there, as anything that look reads.
        async with socket_links(1) as (other, theirs_too):
            Link(1, 0, theirs_too[0]).send_closing(1, 6, "closed its communicator after #5")
            assert await other[0].pending_abort(spec) is None

        async def answer_later() -> None:
            await trio.sleep(1)  # long past the watch threshold
            await Link(1, 0, theirs[0]).send(spec, 0, memoryview(bytes(16)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_later)
            await links[0].recv(spec, 0, memoryview(bytearray(16)))
        with pytest.raises(trioring.PeerFailedError) as info:
            await links[1].recv(spec._replace(seq=6), 0, memoryview(bytearray(16)))
    assert info.value.peer == 2
    assert str(info.value) == (
        "rank 0: allreduce #6: rank 2 closed its communicator after collective #5"
    )


@pytest.mark.parametrize(
    ("kind", "subject", "said"),
    [
        (AbortKind.CANCELLED, 2, "rank 2 cancelled"),
        (AbortKind.FAILED, 1, "rank 1 failed (relayed by rank 2)"),
    ],
)
async def test_a_peer_that_finished_the_call_and_gave_up_in_the_next_leaves_it_to_complete(
    autojump_clock: object, kind: AbortKind, subject: int, said: str
) -> None:
    """Rank 2 finished call 5, then gave up in call 6 (cancelled, or it saw rank 1 fail
    there): its abort frame sits on its link while this rank still waits in call 5 for
    rank 1, long enough for a watch to read it. Call 5 may still complete, as the failure
    model promises a canceller's peers, on rank 1's frame (rank 1's own connection says
    whether it failed); the abort is left for a receive of call 6, which raises it. (Chaos
    seed 10 over TCP: a survivor still in a call that a killed rank had finished raised
    there on a peer's news about the next one.)"""
    spec = OpSpec(Kind.ALLREDUCE, 5, dtype_code=1, count=4, op_code=1)
    async with socket_links(2) as (links, theirs):
        await Link(2, 0, theirs[1]).send_abort(kind, subject, 6, "cancelled", 2)

        async def answer_later() -> None:
            await trio.sleep(1)  # long past the watch threshold
            await Link(1, 0, theirs[0]).send(spec, 0, memoryview(b"\x01" * 16))

        got = bytearray(16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_later)
            await links[0].recv(spec, 0, memoryview(got))
        assert bytes(got) == b"\x01" * 16
        with pytest.raises(trioring.CollectiveError) as info:
            await links[1].recv(spec._replace(seq=6), 0, memoryview(bytearray(16)))
    assert info.value.peer == subject
    assert said in str(info.value)


async def test_a_peer_that_closed_during_the_call_breaks_it(autojump_clock: object) -> None:
    """Rank 2 closed its communicator while call 5 ran there (another task closed it): a
    watch that reads its notice ends this rank's wait in call 5 on rank 1 with it."""
    spec = OpSpec(Kind.ALLREDUCE, 5, dtype_code=1, count=4, op_code=1)
    async with socket_links(2) as (links, theirs):
        Link(2, 0, theirs[1]).send_closing(2, 5, "closed its communicator during collective #5")
        with pytest.raises(trioring.PeerFailedError) as info:
            await links[0].recv(spec, 0, memoryview(bytearray(16)))
    assert info.value.peer == 2
    assert "rank 2 closed its communicator during collective #5" in str(info.value)


async def test_frames_read_ahead_by_a_watch_are_received_intact(autojump_clock: object) -> None:
    """Data frames that a watch read ahead (no abort came) are received afterwards exactly as
    if they had stayed in the socket: same bytes, same order, then the rest from the socket."""
    spec = OpSpec(Kind.ALLREDUCE, 9, dtype_code=1, count=4, op_code=1)
    payloads = [bytes([step + 1]) * 16 for step in range(3)]
    async with socket_links(2) as (links, theirs):
        sender = Link(2, 0, theirs[1])
        for step in range(2):
            await sender.send(spec, step, memoryview(payloads[step]))

        async def answer_later() -> None:
            await trio.sleep(1)  # the watch on the idle link has read both frames by now
            assert len(links[1]._ahead) == 2 * (HEADER.size + 16)
            await Link(1, 0, theirs[0]).send(spec, 0, memoryview(bytes(16)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_later)
            await links[0].recv(spec, 0, memoryview(bytearray(16)))
        await sender.send(spec, 2, memoryview(payloads[2]))
        for step in range(3):
            got = bytearray(16)
            await links[1].recv(spec, step, memoryview(got))
            assert bytes(got) == payloads[step]
        assert not links[1]._ahead


async def test_frames_in_pieces_or_with_odd_padding_take_the_general_path(
    autojump_clock: object,
) -> None:
    """A receive first reads the whole expected frame at once and compares its header with
    the one it expects, byte for byte. A frame that arrives in pieces (the split falling in
    the header or in the payload), or whose padding bytes are not zero, is not that: it must
    still be received by the general path, intact; and a frame of another collective must
    still raise the mismatch error naming both sides."""
    spec = OpSpec(Kind.ALLREDUCE, 5, dtype_code=10, count=2, op_code=1)

    def frame(step: int, payload: bytes, *, seq: int = 5, pad: bytes = b"\0\0\0") -> bytes:
        header = bytearray(HEADER.size)
        pack_data_header(header, OpSpec(Kind.ALLREDUCE, seq, 10, 2, 1), step, len(payload))
        header[9:12] = pad
        return bytes(header) + payload

    async with socket_links(1) as (links, theirs):
        peer = theirs[0]
        for step, split in enumerate((10, HEADER.size + 3)):
            payload = bytes(range(step * 8, step * 8 + 8))
            data = frame(step, payload)

            async def send_in_pieces(data: bytes = data, split: int = split) -> None:
                await peer.send_all(data[:split])
                await trio.sleep(1)  # the receiver has read the first piece and is waiting
                await peer.send_all(data[split:])

            got = bytearray(8)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_in_pieces)
                await links[0].recv(spec, step, memoryview(got))
            assert bytes(got) == payload
        await peer.send_all(frame(2, b"\x07" * 8, pad=b"\x01\x02\x03"))
        got = bytearray(8)
        await links[0].recv(spec, 2, memoryview(got))
        assert bytes(got) == b"\x07" * 8
        await peer.send_all(frame(3, bytes(8), seq=6))
        with pytest.raises(trioring.CollectiveMismatchError, match=r"#5, rank 1: .*#6"):
            await links[0].recv(spec, 3, memoryview(bytearray(8)))


async def test_a_polling_receive_lets_the_other_tasks_of_the_program_run() -> None:
    """While a receive polls for its frame (the bounded spin), other runnable tasks of the
    same program must still run, even one that shares the receive's scheduler batch (Trio's
    run queue does not show it then). Here the frame comes from such a task, and the poll
    may last an hour: the receive returns at once only if the poll lets that task run
    (otherwise pytest-timeout fails the test long before the poll gives up)."""
    spec = OpSpec(Kind.ALLREDUCE, 3, dtype_code=5, count=8, op_code=1)
    async with socket_links(1) as (links, theirs):
        links[0].spin_seconds = 3600.0

        async def send_soon() -> None:
            for _ in range(3):
                await trio.lowlevel.checkpoint()  # runnable all along, never waiting
            await Link(1, 0, theirs[0]).send(spec, 0, memoryview(b"abcdefgh"))

        got = bytearray(8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_soon)
            await links[0].recv(spec, 0, memoryview(got))
        assert bytes(got) == b"abcdefgh"


async def test_a_reset_connection_says_what_that_usually_means(autojump_clock: object) -> None:
    """The peer closed its socket with our frame unread in it: the kernel resets the
    connection (ECONNRESET, not an end of file), and the error says what that usually is,
    as it does for an end of file."""
    spec = OpSpec(Kind.ALLREDUCE, 5, dtype_code=1, count=4, op_code=1)
    async with socket_links(1) as (links, theirs):
        await links[0].send(spec, 0, memoryview(bytes(16)))  # which the peer never reads
        await theirs[0].aclose()
        with pytest.raises(trioring.PeerFailedError) as info:
            await links[0].recv(spec, 0, memoryview(bytearray(16)))
    assert str(info.value) == (
        "rank 0: allreduce #5: connection to peer rank 1 broke while receiving a frame "
        "header: receive failed: [Errno 104] Connection reset by peer (the peer exited, "
        "crashed or closed its communicator)"
    )
