"""What a rank's peers hear about why it left, beyond the collective it was in.

A rank that leaves a communicator (its ``async with`` block ends on an exception, or a
collective broke it) says why in the point-to-point plane's LEFT frame, so that a peer's
``recv`` or ``send`` that waits for it raises with the reason, and names the rank whose
failure it only passed on. And a collective that Trio cancelled because a task beside it
failed says so: a peer told only "rank 0 cancelled allreduce #1" would look for a deadline.
In-process worlds; the autojump clock where a deadline is involved.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from local_runs import on_every_rank
from trioring._errors import echoed_ranks
from trioring.testing import open_local_world

_NOTHING_MORE = "nothing more comes from it, and it receives nothing more"


async def _vanish(comm: trioring.Communicator) -> None:
    """Close every connection of ``comm``'s collectives without a word, as a killed
    process's kernel does."""
    for link in comm._links.values():
        await trio.aclose_forcefully(link.connection)


async def _fail_beside(count: int) -> None:
    """Raise a RuntimeError from each of ``count`` tasks of a nursery, beside a task that
    their failure cancels: the nursery raises them in an exception group."""

    async def fail() -> None:
        raise RuntimeError("bad batch on rank 1")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        for _ in range(count):
            nursery.start_soon(fail)


@pytest.mark.parametrize("how", ["raise", "interrupt", "cancel", "group", "group of 2"])
async def test_a_receive_from_a_rank_that_left_on_an_exception_says_why(how: str) -> None:
    """An exception (or a cancellation) leaves rank 1's ``async with comm.dup()`` block
    while ranks 0 and 2 wait for a message from it there: they raise PeerFailedError naming
    rank 1 and what made it leave, as a collective's PeerAbortedError would."""
    errors: dict[int, BaseException] = {}
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            try:
                with trio.CancelScope() as scope:
                    async with comm.dup() as side:
                        if comm.rank == 1:
                            if how == "raise":
                                raise RuntimeError("bad batch on rank 1")
                            if how == "interrupt":
                                raise KeyboardInterrupt
                            if how.startswith("group"):
                                await _fail_beside(2 if how == "group of 2" else 1)
                            scope.cancel()
                            await trio.sleep_forever()
                        await side.recv(source=1, tag=3)
            except (Exception, KeyboardInterrupt) as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    why = {
        "raise": "on RuntimeError: bad batch on rank 1",
        "interrupt": "on KeyboardInterrupt",
        "cancel": "on a cancellation (by its caller's deadline or cancel scope)",
        "group": "on RuntimeError: bad batch on rank 1 (in an exception group)",
        "group of 2": "on RuntimeError: bad batch on rank 1 (the first of 2 in an exception group)",
    }[how]
    if how != "cancel":
        errors.pop(1)
    assert sorted(errors) == [0, 2], errors
    for rank, error in errors.items():
        assert isinstance(error, trioring.PeerFailedError), error
        assert (error.rank, error.peer) == (rank, 1), error
        assert str(error) == (
            f"rank {rank}: recv(source=1, tag=3) on dup #1 of world: rank 1 left this "
            f"communicator {why}; {_NOTHING_MORE}"
        ), error
        assert echoed_ranks(error) == frozenset({1})


async def test_a_rank_that_left_because_another_failed_passes_the_blame_on() -> None:
    """World ranks 1 and 2 share a split; rank 2 vanishes from it, so rank 1's barrier there
    raises PeerFailedError naming it, which leaves rank 1's blocks. Rank 0, waiting on the
    world's duplicate for a message from rank 1, hears that rank 1 left because of rank 2:
    the error's ``peer`` is rank 2, as ``trioring run`` and a relayed collective error say."""
    caught: list[trioring.PeerFailedError] = []
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            raises = pytest.raises(trioring.PeerFailedError)
            with raises if comm.rank == 1 else contextlib.nullcontext():
                async with comm.dup() as side, comm.split(color=min(comm.rank, 1)) as pair:
                    if comm.rank == 0:
                        with pytest.raises(trioring.PeerFailedError) as info:
                            await side.recv(source=1)
                        caught.append(info.value)
                    elif comm.rank == 1:
                        await pair.barrier()
                    else:
                        await _vanish(pair)

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    (error,) = caught
    assert (error.rank, error.peer) == (0, 2), error
    assert echoed_ranks(error) == frozenset({2})
    text = str(error)
    assert text.startswith(
        "rank 0: recv(source=1, tag=0) on dup #1 of world: rank 1 left this communicator "
        "because of rank 2, on PeerFailedError: rank 0: barrier #1: "
    ), text
    # The barrier's ranks were the split's: its rank 0 is world rank 1, its rank 1 world 2.
    assert "as world ranks: 0->1, 1->2]" in text, text
    assert text.endswith("; nothing more comes from rank 1, and it receives nothing more")


async def test_a_receive_from_a_rank_whose_collective_broke_the_communicator_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rank 0's allreduce on a duplicate hits its deadline (rank 1 never calls it: it waits
    for a message from rank 0 there instead), which breaks the duplicate on rank 0; when rank
    0 leaves the block, rank 1's receive raises, saying which collective broke and how."""
    caught: list[trioring.PeerFailedError] = []
    async with open_local_world(2) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            async with comm.dup() as side:
                if comm.rank == 0:
                    with trio.move_on_after(2.5):
                        await side.allreduce(np.ones(4))
                    assert side.broken
                else:
                    with pytest.raises(trioring.PeerFailedError) as info:
                        await side.recv(source=0, tag=1)
                    caught.append(info.value)

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    (error,) = caught
    assert (error.rank, error.peer) == (1, 0), error
    assert str(error) == (
        "rank 1: recv(source=0, tag=1) on dup #1 of world: rank 0 left this communicator when "
        "allreduce #1 was cancelled there after 2.5 s while waiting for rank 1; "
        f"{_NOTHING_MORE}"
    ), error


async def test_a_collective_cancelled_by_a_failure_beside_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 0's allreduce runs in a nursery beside a task that raises once every task is
    blocked (rank 0 waiting for ranks 1 and 2, which have not called yet): Trio cancels the
    allreduce. Its warning, and the error of every peer's allreduce, say that it was that
    failure, not a deadline, that cancelled it."""
    errors: dict[int, BaseException] = {}
    failed = trio.Event()
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            x = np.ones(4)
            try:
                async with comm.dup() as side:
                    if comm.rank == 0:
                        try:
                            async with trio.open_nursery() as nursery:
                                nursery.start_soon(side.allreduce, x)
                                await trio.testing.wait_all_tasks_blocked()
                                raise ValueError("bad batch")
                        finally:
                            failed.set()
                    await failed.wait()
                    await side.allreduce(x)
            except Exception as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10), caplog.at_level(logging.WARNING, logger="trioring"):
            await on_every_rank(comms, rank_main)
    cause = ", when code beside it raised ValueError('bad batch')"
    (warning,) = [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
    assert warning.startswith("rank 0: allreduce #1 cancelled after "), warning
    assert f"{cause}; ranks above are those of dup #1 of world" in warning, warning
    assert isinstance(errors.pop(0), ExceptionGroup)
    for rank, error in errors.items():
        assert isinstance(error, trioring.PeerAbortedError), error
        assert error.peer == 0, error
        assert str(error).startswith(f"rank {rank}: allreduce #1: rank 0 cancelled allreduce #1 ")
        assert str(error).endswith(cause), error
