"""Point-to-point messages through the Communicator, in one process: sendrecv rings at worlds
2-8 on unbuffered streams, messages and collectives on one communicator at once, messages on
a parent and its children kept apart, objects, argument checks, and the state rules."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from local_runs import on_every_rank
from trioring._p2p import MessageKind
from trioring.testing import open_local_world


@pytest.mark.parametrize("n", range(2, 9))
async def test_sendrecv_ring_on_unbuffered_streams(n: int) -> None:
    """Every rank sends right and receives from the left at once; with streams that buffer
    nothing, a sendrecv that sent before receiving would deadlock at once."""
    size = 70_000  # 560 KB: rendezvous, several 64 KiB chunks
    async with open_local_world(n, buffered=False, chunk_bytes=64 * 1024) as comms:
        got: dict[int, np.ndarray] = {}

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            x = np.arange(size, dtype=np.float64) + 1000 * r
            small = np.array([r], dtype=np.int32)
            right, left = (r + 1) % n, (r - 1) % n
            got[r] = await comm.sendrecv(x, dest=right, source=left, sendtag=4)
            # And the other way round, small and eager, into a buffer.
            out = np.empty(1, dtype=np.int32)
            back = await comm.sendrecv(small, dest=left, source=right, out=out)
            assert back is out
            assert out[0] == right

        with trio.fail_after(60):
            await on_every_rank(comms, rank_code)
    for r in range(n):
        np.testing.assert_array_equal(
            got[r], np.arange(size, dtype=np.float64) + 1000 * ((r - 1) % n)
        )


async def test_messages_and_collectives_on_one_communicator_at_once() -> None:
    n = 3
    async with open_local_world(n) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            sums: list[float] = []

            async def collectives() -> None:
                for step in range(20):
                    x = np.array([float(r + step)])
                    await comm.allreduce(x)
                    sums.append(float(x[0]))

            async def messages() -> None:
                right, left = (r + 1) % n, (r - 1) % n
                for step in range(20):
                    await comm.send(np.array([r, step]), dest=right, tag=1)
                    got = await comm.recv(source=left, tag=1)
                    assert got.tolist() == [left, step]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(collectives)
                nursery.start_soon(messages)
            assert sums == [float(sum(range(n)) + n * step) for step in range(20)]

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)


async def test_parent_and_child_messages_do_not_mix() -> None:
    """Same source, same tag, same time: the parent's and the child's messages stay apart
    (each carries its communicator's id), and a child's ranks are its own."""
    async with open_local_world(4) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            async with comm.split(color=r // 2, key=-r) as pair:
                assert pair is not None
                # pair ranks: parent 1 -> 0, parent 0 -> 1 (key -r), and 3 -> 0, 2 -> 1.
                other = 1 - pair.rank
                peer_in_world = r ^ 1
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        lambda: comm.send(np.array([100 + r]), dest=peer_in_world, tag=5)
                    )
                    nursery.start_soon(lambda: pair.send(np.array([200 + r]), dest=other, tag=5))
                from_child = await pair.recv(source=other, tag=5)
                from_world = await comm.recv(source=peer_in_world, tag=5)
                assert from_child.tolist() == [200 + peer_in_world]
                assert from_world.tolist() == [100 + peer_in_world]

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)


async def test_objects_recv_any_and_order() -> None:
    n = 4
    async with open_local_world(n) as comms:
        collected: list[tuple[int, object]] = []

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            if r == 0:
                for _ in range(2 * (n - 1)):
                    src, msg = await comm.recv_any(tag=3)
                    collected.append((src, msg.tolist()))
                objects = [await comm.recv_object(source=1, tag=0) for _ in range(3)]
                assert objects == [
                    {"i": 0, "a": None},
                    {"i": 1, "a": [1, 2.5, "x", b"y", (3, 4)]},
                    {"i": 2, "a": {"k": True}},
                ]
                arr = await comm.recv_object(source=2)
                np.testing.assert_array_equal(arr["w"], np.arange(6).reshape(2, 3))
            else:
                await comm.send(np.array([r, 0]), dest=0, tag=3)
                await comm.send(np.array([r, 1]), dest=0, tag=3)
                if r == 1:
                    for i, a in enumerate([None, [1, 2.5, "x", b"y", (3, 4)], {"k": True}]):
                        await comm.send_object({"i": i, "a": a}, dest=0)
                if r == 2:
                    await comm.send_object({"w": np.arange(6).reshape(2, 3)}, dest=0)

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
    # Non-overtaking per source: each rank's step 0 comes before its step 1.
    for src in range(1, n):
        steps = [msg[1] for s, msg in collected if s == src]
        assert steps == [0, 1]
    assert all(msg[0] == s for s, msg in collected)


async def test_recv_any_object_hands_out_work_to_whoever_reports_first() -> None:
    """A coordinator and three workers with objects only (mpi4py's recv(ANY_SOURCE) without
    pickle): the coordinator learns who reported from recv_any_object and sends that worker
    its next task; an array message first in line raises and stays queued; a worker's
    bytes that are not an encoding raise ProtocolError naming it, the message consumed and
    the communicator usable."""
    n, tasks = 4, 9
    async with open_local_world(n) as comms:
        done: dict[int, int] = {}

        async def coordinator(comm: trioring.Communicator) -> None:
            for task in range(tasks + n - 1):
                source, report = await comm.recv_any_object(tag=1)
                assert isinstance(report, dict), report
                assert report["from"] == source
                if report["task"] is not None:
                    done[report["task"]] = source
                    assert report["square"] == report["task"] ** 2
                await comm.send_object(task if task < tasks else None, dest=source, tag=2)
            # An array first in line with the tag: refused, and it stays queued.
            with pytest.raises(trioring.InvalidArgumentError, match=r"recv_any_object\(tag=3\)"):
                await comm.recv_any_object(tag=3)
            source, array = await comm.recv_any(tag=3)
            assert (source, array.tolist()) == (1, [7])
            with pytest.raises(trioring.ProtocolError) as info:
                await comm.recv_any_object(tag=4)
            assert info.value.peer == 2
            assert "recv_any_object(tag=4): the message from rank 2 is not an object" in str(
                info.value
            )
            assert await comm.recv_any_object(tag=4) == (2, "fine")

        async def worker(comm: trioring.Communicator) -> None:
            r, task = comm.rank, None
            while True:
                square = None if task is None else task**2
                await comm.send_object({"from": r, "task": task, "square": square}, dest=0, tag=1)
                task = await comm.recv_object(source=0, tag=2)
                if task is None:
                    break
            if r == 1:
                await comm.send(np.array([7]), dest=0, tag=3)
            if r == 2:
                # Not an encoding: a list of 5 values with none after it.
                await comm._endpoint.send(
                    comm._scope,
                    0,
                    4,
                    np.frombuffer(b"\x01\x08\x05\x00", np.uint8),
                    kind=MessageKind.OBJECT,
                )
                await comm.send_object("fine", dest=0, tag=4)

        async def rank_code(comm: trioring.Communicator) -> None:
            await (coordinator if comm.rank == 0 else worker)(comm)

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
    assert sorted(done) == list(range(tasks))
    assert set(done.values()) <= {1, 2, 3}


async def test_checks_before_any_io_and_a_message_that_does_not_fit_stays_queued() -> None:
    async with open_local_world(2) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            if comm.rank == 0:
                with pytest.raises(trioring.InvalidArgumentError, match="dest"):
                    await comm.send(np.ones(2), dest=2)
                with pytest.raises(trioring.InvalidArgumentError, match="tag"):
                    await comm.send(np.ones(2), dest=1, tag=2**31)
                with pytest.raises(trioring.InvalidArgumentError, match="tag"):
                    await comm.recv(source=1, tag=-1)
                with pytest.raises(trioring.InvalidArgumentError, match="object is not supported"):
                    await comm.send_object(object(), dest=1)
                await comm.send(np.arange(10.0), dest=1, tag=8)
                await comm.send_object("hello", dest=1, tag=9)
            else:
                small = np.empty(5)
                with pytest.raises(trioring.InvalidArgumentError):
                    await comm.recv(source=0, tag=8, out=small)
                # Still there, whole.
                buf = np.empty(12)
                got = await comm.recv(source=0, tag=8, out=buf)
                assert got.tolist() == np.arange(10.0).tolist()
                with pytest.raises(trioring.InvalidArgumentError):
                    await comm.recv(source=0, tag=9)  # an object, not an array
                assert await comm.recv_object(source=0, tag=9) == "hello"

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)


async def test_every_call_checkpoints_even_to_oneself() -> None:
    async with open_local_world(1) as (comm,):
        with trio.testing.assert_checkpoints():
            await comm.send(np.ones(3), dest=0)
        with trio.testing.assert_checkpoints():
            assert (await comm.recv(source=0)).tolist() == [1.0, 1.0, 1.0]
        with trio.testing.assert_checkpoints():
            assert (await comm.sendrecv(np.ones(2), dest=0, source=0)).tolist() == [1.0, 1.0]


async def test_a_cancelled_recv_consumed_nothing() -> None:
    async with open_local_world(2) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            if comm.rank == 1:
                with trio.move_on_after(0.2) as scope:
                    await comm.recv(source=0, tag=1)
                assert scope.cancelled_caught
                await comm.send(np.zeros(1), dest=0, tag=2)  # "go"
                assert (await comm.recv(source=0, tag=1)).tolist() == [7.0]
            else:
                await comm.recv(source=1, tag=2)
                await comm.send(np.array([7.0]), dest=1, tag=1)
            await comm.barrier()  # the communicator is fine

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)


async def test_a_broken_communicator_refuses_messages() -> None:
    async with open_local_world(2) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            dtype = np.float64 if comm.rank == 0 else np.float32
            with pytest.raises(trioring.CollectiveError):
                await comm.allreduce(np.zeros(4, dtype))
            with pytest.raises(trioring.CommunicatorBrokenError):
                await comm.send(np.ones(1), dest=1 - comm.rank)
            with pytest.raises(trioring.CommunicatorBrokenError):
                await comm.recv(source=1 - comm.rank)

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
