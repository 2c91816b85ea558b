"""split and dup in one process (worlds of 1 to 17 ranks over in-memory streams): who lands
where, nesting, concurrent collectives on parent and children from different tasks (in
opposite orders on different ranks), and what breaks what."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import trio

import trioring
from local_runs import on_every_rank
from trioring._p2p import EAGER_BYTES
from trioring.testing import open_local_world


def expected_groups(colors: list[int | None], keys: list[int]) -> dict[int, list[int]]:
    """color -> parent ranks in new-rank order (by key, ties by parent rank)."""
    groups: dict[int, list[int]] = {}
    for r in sorted(range(len(colors)), key=lambda r: (keys[r], r)):
        color = colors[r]
        if color is not None:
            groups.setdefault(color, []).append(r)
    return groups


@pytest.mark.parametrize("n", range(1, 18))
async def test_split_by_random_colors_and_keys(n: int) -> None:
    rng = random.Random(1000 + n)
    colors: list[int | None] = [rng.choice([None, 0, 1, 2, 5]) for _ in range(n)]
    keys = [rng.randrange(-3, 4) for _ in range(n)]
    groups = expected_groups(colors, keys)
    seen: dict[int, tuple[int, int, list[float]]] = {}

    async with open_local_world(n) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            async with comm.split(color=colors[r], key=keys[r]) as sub:
                if colors[r] is None:
                    assert sub is None
                    return
                assert sub is not None
                x = np.array([float(r), 1.0])
                await sub.allreduce(x)
                gathered = await sub.allgather(np.array([float(r)]))
                seen[r] = (sub.rank, sub.world_size, [*x.tolist(), *gathered.ravel().tolist()])

        await on_every_rank(comms, rank_code)
        # The parent is still usable, and in step on every rank.
        await on_every_rank(comms, lambda c: c.barrier())

    for color, members in groups.items():
        for new_rank, r in enumerate(members):
            sub_rank, size, values = seen[r]
            assert (sub_rank, size) == (new_rank, len(members))
            assert values[:2] == [float(sum(members)), float(len(members))]
            assert values[2:] == [float(m) for m in members], color
    assert set(seen) == {r for r in range(n) if colors[r] is not None}


async def test_nested_splits_and_dup() -> None:
    n = 8
    async with open_local_world(n) as comms:
        results: dict[int, tuple[float, float, float]] = {}

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            async with comm.split(color=r % 2) as half:
                assert half is not None
                async with half.split(color=half.rank // 2) as quarter:
                    assert quarter is not None
                    async with quarter.dup() as side:
                        a = np.array([float(r)])
                        b = np.array([float(r)])
                        c = np.array([float(r)])
                        await half.allreduce(a)
                        await quarter.allreduce(b)
                        await side.allreduce(c)
                        results[r] = (a[0], b[0], c[0])

        await on_every_rank(comms, rank_code)
    for r in range(n):
        half = [p for p in range(n) if p % 2 == r % 2]
        quarter = [p for p in half if half.index(p) // 2 == half.index(r) // 2]
        assert results[r] == (sum(half), sum(quarter), sum(quarter))


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_concurrent_collectives_in_opposite_orders(n: int) -> None:
    """Parent, dup and a split each run a collective from their own task; even ranks start
    them in one order, odd ranks in the other, and each task's order on its own
    communicator is consistent: nothing waits behind anything else."""
    big = 300_000  # 2.4 MB of float64: several chunks, more than any socket buffer
    async with open_local_world(n, buffered=False, chunk_bytes=64 * 1024) as comms:
        results: dict[tuple[int, str], np.ndarray] = {}

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            async with comm.dup() as side, comm.split(color=0, key=-r) as rev:
                assert side is not None
                assert rev is not None

                async def on_parent() -> None:
                    x = np.full(big, float(r))
                    await comm.allreduce(x)
                    results[r, "parent"] = x

                async def on_side() -> None:
                    results[r, "side"] = await side.allgather(np.array([r, r * r]))

                async def on_rev() -> None:
                    y = np.arange(big, dtype=np.float64) * (r + 1)
                    await rev.broadcast(y, root=0)  # rev's rank 0 is the parent's last
                    results[r, "rev"] = y[:3].copy()

                tasks = [on_parent, on_side, on_rev]
                if r % 2:
                    tasks.reverse()
                async with trio.open_nursery() as nursery:
                    for task in tasks:
                        nursery.start_soon(task)
                        await trio.lowlevel.checkpoint()

        with trio.fail_after(60):
            await on_every_rank(comms, rank_code)
    total = float(sum(range(n)))
    for r in range(n):
        assert np.all(results[r, "parent"] == total)
        assert results[r, "side"].tolist() == [[p, p * p] for p in range(n)]
        assert results[r, "rev"].tolist() == [0.0 * n, 1.0 * n, 2.0 * n]


async def test_cancel_in_child_breaks_child_only() -> None:
    """Ranks 0 and 1 time out in an allreduce on the child that rank 2 never joins; rank 2's
    next call on the child raises; the parent stays usable on every rank."""
    n = 3
    async with open_local_world(n) as comms:
        outcomes: dict[int, str] = {}
        both_cancelled = trio.Event()
        cancelled = 0

        async def rank_code(comm: trioring.Communicator) -> None:
            nonlocal cancelled
            r = comm.rank
            async with comm.dup() as side:
                assert side is not None
                if r < 2:
                    with trio.move_on_after(0.5):
                        await side.allreduce(np.ones(4))
                    with pytest.raises(trioring.CommunicatorBrokenError):
                        await side.barrier()
                    outcomes[r] = "cancelled"
                    cancelled += 1
                    if cancelled == 2:
                        both_cancelled.set()
                else:
                    await both_cancelled.wait()
                    with pytest.raises(trioring.CollectiveError) as info:
                        await side.barrier()
                    assert info.value.peer in (0, 1)
                    outcomes[r] = "told"
            x = np.array([float(r)])
            await comm.allreduce(x)
            assert x[0] == sum(range(n))

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
    assert outcomes == {0: "cancelled", 1: "cancelled", 2: "told"}


async def test_closing_parent_closes_children_and_not_the_reverse() -> None:
    async with open_local_world(2) as comms:
        errors: list[BaseException] = []
        rank0_done = trio.Event()

        async def rank_code(comm: trioring.Communicator) -> None:
            async with comm.dup() as side:
                assert side is not None
                async with comm.dup() as other:
                    assert other is not None
                await comm.barrier()  # closing `other` left the parent open
                if comm.rank == 1:
                    # Keeps `side` open: its closing would end rank 0's receive (LEFT).
                    await rank0_done.wait()
                if comm.rank == 0:
                    async with trio.open_nursery() as nursery:

                        async def pending() -> None:
                            try:
                                await side.recv(source=1, tag=9)
                            except trioring.CommunicatorClosedError as exc:
                                errors.append(exc)

                        nursery.start_soon(pending)
                        await trio.testing.wait_all_tasks_blocked()
                        await comm.aclose()
                    with pytest.raises(trioring.CommunicatorClosedError):
                        await side.barrier()
                    rank0_done.set()

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
    assert len(errors) == 1


async def test_busy_rule_is_per_communicator() -> None:
    async with open_local_world(2) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            async with comm.dup() as side:
                assert side is not None
                if comm.rank == 1:
                    await side.barrier()
                    await comm.barrier()
                    return
                async with trio.open_nursery() as nursery:
                    # Waits for rank 1, which is in side.barrier until we join it.
                    nursery.start_soon(comm.barrier)
                    await trio.testing.wait_all_tasks_blocked()
                    with pytest.raises(trioring.CommunicatorBusyError):
                        await comm.barrier()
                    await side.barrier()  # another communicator: not busy

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)


async def test_split_refuses_bad_arguments_before_any_io() -> None:
    async with open_local_world(1) as (comm,):
        with pytest.raises(trioring.InvalidArgumentError, match="color"):
            async with comm.split(color=-1):
                pass
        with pytest.raises(trioring.InvalidArgumentError, match="key"):
            async with comm.split(color=0, key="a"):  # type: ignore[arg-type]
                pass
        async with comm.split(color=0) as sub:
            assert sub is not None
            assert sub.world_size == 1
            await sub.barrier()


async def test_a_peer_closing_a_child_ends_the_calls_that_wait_for_it() -> None:
    """Rank 1 leaves a dup while rank 0 waits in a receive from it and in a send to it (a
    large one, which needs rank 1's receive): both raise PeerFailedError naming rank 1, at
    once, and recv_any raises once every other member has left."""
    async with open_local_world(3) as comms:
        raised: dict[str, trioring.PeerFailedError] = {}
        waiting = trio.Event()

        async def rank_code(comm: trioring.Communicator) -> None:
            async with comm.dup() as side:
                assert side is not None
                if comm.rank == 0:

                    async def expect(name: str, call: object) -> None:
                        with pytest.raises(trioring.PeerFailedError) as info:
                            await call  # type: ignore[misc]
                        raised[name] = info.value

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(expect, "recv", side.recv(source=1))
                        large = np.ones(EAGER_BYTES // 8 + 1)  # by rendezvous
                        nursery.start_soon(expect, "send", side.send(large, dest=1))
                        nursery.start_soon(expect, "recv_any", side.recv_any(tag=5))
                        await trio.testing.wait_all_tasks_blocked()
                        waiting.set()
                else:
                    await waiting.wait()
            await comm.barrier()

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
    assert raised["recv"].peer == 1
    assert raised["send"].peer == 1
    assert raised["recv_any"].peer in (1, 2)
    assert "closed this communicator" in str(raised["recv"])


async def test_a_cancelled_call_on_a_child_names_the_child_and_its_world_ranks(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """World ranks 1 and 3 form a child (ranks 0 and 1 of it); world rank 3 never calls, so
    world rank 1's allreduce there hits its deadline. The warning and the Cancelled's note
    say which communicator, whose ranks they count, and the world ranks behind them: "rank
    0" alone would point a reader at the wrong process."""
    caplog.set_level(logging.WARNING, logger="trioring")
    notes: list[str] = []
    async with open_local_world(4) as comms:
        told = trio.Event()

        async def rank_code(comm: trioring.Communicator) -> None:
            r = comm.rank
            async with comm.split(color=r % 2) as group:
                assert group is not None
                if r == 1:
                    try:
                        with trio.fail_after(5):
                            await group.allreduce(np.ones(4))
                    except trio.TooSlowError as exc:
                        # The Cancelled, or the group of the nursery it came through.
                        notes.extend(getattr(exc.__context__, "__notes__", []))
                    told.set()
                elif r == 3:
                    await told.wait()

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
    warnings = [
        record.getMessage()
        for record in caplog.records
        if record.name == "trioring" and record.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    warning = warnings[0]
    assert warning == (
        "rank 0: allreduce #1 cancelled after 5.0 s while waiting for rank 1; ranks above are "
        "those of split #1 of world (color 1); as world ranks: 0->1, 1->3"
    )
    assert notes == [warning]


async def test_a_closed_or_broken_sub_communicator_is_named() -> None:
    """A call on a sub-communicator that was closed, or broke, says which communicator: its
    rank and sequence number alone would read as the world's."""
    async with open_local_world(2) as comms:

        async def rank_code(comm: trioring.Communicator) -> None:
            async with comm.dup() as twin:
                dtype = np.float64 if comm.rank == 0 else np.float32
                with pytest.raises(trioring.CollectiveMismatchError):
                    await twin.allreduce(np.zeros(2, dtype))
                with pytest.raises(trioring.CommunicatorBrokenError) as broken:
                    await twin.barrier()
            assert str(broken.value).startswith(
                f"rank {comm.rank}: barrier #2: the communicator (dup #1 of world) is broken "
                "since collective #1 failed"
            ), broken.value
            with pytest.raises(trioring.CommunicatorClosedError) as closed:
                await twin.barrier()
            assert str(closed.value).startswith(
                f"rank {comm.rank}: barrier #2: the communicator (dup #1 of world) is closed"
            ), closed.value

        with trio.fail_after(30):
            await on_every_rank(comms, rank_code)
