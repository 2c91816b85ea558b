"""Whose call differs: a mismatch names every side's call in words that every rank uses
alike, so that ``trioring run`` can tell the one rank whose call is the odd one out.

The uneven collectives (allgatherv, gatherv, alltoallv) first exchange their counts, under
an identity whose count is the length of that vector: a rank sees only a peer's dtype and
number of dimensions in its frames, but knows its own trailing shape. Both name the call
``allgatherv float32[rows, 2] #1`` (``[rows, *]`` from a frame), and the launcher takes a
rank's own word on its call over what a peer saw of it.

The object collectives run array collectives as their steps (broadcast_object one or two
broadcasts, allgather_object an allgatherv): a rank names such a step with the method its
caller called, ``allgatherv uint8[rows] #1 (in allgather_object)``, in a mismatch, a
cancellation and every error about the call, since its caller never called an allgatherv.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from launched import run_launcher, write_script
from local_runs import errors_when_one_differs, on_every_rank
from trioring._launched import note_calls, odd_calls
from trioring._wire import DTYPE_CODES, Kind, OpSpec
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from trioring import Communicator

F32 = DTYPE_CODES[np.dtype(np.float32)]


def test_uneven_calls_are_named_by_their_shape_after_the_rows() -> None:
    # A rank's own call: its trailing shape.
    mine = OpSpec(Kind.ALLGATHERV, 4, F32, 3, trailing=(2,))
    assert mine.describe() == "allgatherv float32[rows, 2] #4"
    assert mine.describe(rows=5) == "allgatherv float32[5, 2] #4"
    # Its data frames carry a total, which changes nothing in the name.
    assert mine._replace(count=1000).describe() == "allgatherv float32[rows, 2] #4"
    gatherv = OpSpec(Kind.GATHERV, 1, F32, 2, root=3, trailing=())
    assert gatherv.describe() == "gatherv(root=3) float32[rows] #1"
    # From a peer's first frame: the number of dimensions (count - 1 for allgatherv and
    # gatherv, whose vector also holds the out= capacity; count for alltoallv).
    assert OpSpec(Kind.ALLGATHERV, 4, F32, 4).describe() == "allgatherv float32[rows, *, *] #4"
    assert OpSpec(Kind.GATHERV, 4, F32, 2, root=0).describe() == "gatherv(root=0) float32[rows] #4"
    assert OpSpec(Kind.ALLTOALLV, 4, F32, 2).describe() == "alltoallv float32[rows, *] #4"
    # A count no first frame carries (a data frame's total) is shown as it is.
    assert OpSpec(Kind.ALLGATHERV, 4, F32, 1000).describe() == "allgatherv float32[1000] #4"
    # The even collectives are named by their element count, as before.
    assert OpSpec(Kind.ALLGATHER, 4, F32, 6).describe() == "allgather float32[6] #4"
    # split and dup by their name alone: the colors and keys they exchange are their own.
    i64 = DTYPE_CODES[np.dtype(np.int64)]
    assert OpSpec(Kind.SPLIT, 2, i64, 2).describe() == "split #2"
    assert OpSpec(Kind.DUP, 3, i64, 2).describe() == "dup #3"


def test_a_ranks_own_word_on_its_call_wins_whatever_the_order() -> None:
    """Rank 2's float64 allgatherv: rank 0 saw it in a frame ("[rows, *]"), rank 2 named
    it itself; in either order of the ranks' exits the launcher keeps rank 2's own."""
    good = "allgatherv float32[rows, 2] #1"
    odd = "allgatherv float64[rows, 2] #1"
    reports = {
        0: {0: good, 2: "allgatherv float64[rows, *] #1"},
        1: {1: good},
        2: {2: odd, 0: "allgatherv float32[rows, *] #1"},
        3: {3: good},
    }
    for order in ([0, 1, 2, 3], [2, 0, 1, 3], [3, 2, 1, 0]):
        calls: dict[int, str] = {}
        self_named: set[int] = set()
        for rank in order:
            note_calls(calls, self_named, rank, reports[rank])
        assert calls == {0: good, 1: good, 2: odd, 3: good}, order
        assert odd_calls(calls) == (
            f"rank 2's call differs from the other ranks' (rank 2: {odd}; ranks 0, 1, 3: {good})"
        )
    # Where the rank itself never said, a peer's word stands.
    calls, self_named = {}, set()
    note_calls(calls, self_named, 0, reports[0])
    assert calls[2] == "allgatherv float64[rows, *] #1"


def _uneven_cases() -> list[Any]:
    """(what rank 2 calls, what the others call), by rank; rows differ by rank throughout."""

    def rows(c: Communicator, cols: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return np.ones((c.rank + 1, *cols), dtype)

    def blocks(c: Communicator, cols: tuple[int, ...], dtype: Any = np.float32) -> list[Any]:
        return [np.ones((k + 1, *cols), dtype) for k in range(c.world_size)]

    return [
        pytest.param(
            lambda c: c.allgatherv(rows(c, (3,))),
            lambda c: c.allgatherv(rows(c, (2,))),
            id="allgatherv-trailing",
        ),
        pytest.param(
            lambda c: c.allgatherv(rows(c, (2,), np.float64)),
            lambda c: c.allgatherv(rows(c, (2,))),
            id="allgatherv-dtype",
        ),
        pytest.param(
            lambda c: c.allgatherv(rows(c, (2, 1))),
            lambda c: c.allgatherv(rows(c, (2,))),
            id="allgatherv-ndim",
        ),
        pytest.param(
            lambda c: c.gatherv(rows(c, (3,)), root=0),
            lambda c: c.gatherv(rows(c, (2,)), root=0),
            id="gatherv-trailing",
        ),
        pytest.param(
            lambda c: c.gatherv(rows(c, (2,)), root=1),
            lambda c: c.gatherv(rows(c, (2,)), root=0),
            id="gatherv-root",
        ),
        pytest.param(
            lambda c: c.alltoallv(blocks(c, (3,))),
            lambda c: c.alltoallv(blocks(c, (2,))),
            id="alltoallv-trailing",
        ),
        pytest.param(
            lambda c: c.alltoallv(blocks(c, (2,), np.int32)),
            lambda c: c.alltoallv(blocks(c, (2,))),
            id="alltoallv-dtype",
        ),
        pytest.param(
            lambda c: c.alltoallv(blocks(c, ())),
            lambda c: c.alltoallv(blocks(c, (2,))),
            id="alltoallv-ndim",
        ),
    ]


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize(("odd", "good"), _uneven_cases())
async def test_every_rank_names_the_odd_uneven_call(
    n: int,
    odd: Callable[[Communicator], Awaitable[object]],
    good: Callable[[Communicator], Awaitable[object]],
) -> None:
    """Rank 2's uneven call differs from the others' in trailing shape, dtype, number of
    dimensions or root. Every rank raises; whatever each saw of it and in whichever order
    their reports come, the calls they name single out rank 2, and each rank names its own
    call as the others name it where they agree."""
    async with open_local_world(n) as comms:
        errors = await errors_when_one_differs(comms, 2, odd, good)
    assert sorted(errors) == list(range(n))
    reports = {}
    for rank, exc in errors.items():
        assert isinstance(exc, trioring.CollectiveMismatchError), repr(exc)
        assert rank in exc.calls, (rank, str(exc))
        reports[rank] = exc.calls
    for order in (sorted(reports), sorted(reports, reverse=True)):
        calls: dict[int, str] = {}
        self_named: set[int] = set()
        for rank in order:
            note_calls(calls, self_named, rank, reports[rank])
        whose = odd_calls(calls)
        assert whose is not None, calls
        assert whose.startswith("rank 2's call differs from the other ranks' (rank 2: "), whose


UNEVEN_SCRIPT = """
    import signal, sys
    import numpy as np
    import trio
    import trioring

    # Whose call differs is told from every failing rank's report together (the rank that
    # saw the mismatch need not have seen every other rank's call): the launcher's
    # SIGTERM, sent once the first of them has exited, must not cut a rank off before its
    # excepthook (which ignores SIGTERM from then on) runs. A rank that hangs still gets
    # SIGKILL after the grace period.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def main():
        async with trioring.open_communicator() as comm:
            r, n = comm.rank, comm.world_size
            cols = 3 if r == 2 else 2
            if sys.argv[1] == "allgatherv":
                await comm.allgatherv(np.ones((r + 1, cols), np.float32))
            elif sys.argv[1] == "broadcast_object":
                if r == 2:
                    await comm.allreduce(np.ones(1, np.int64))
                else:
                    await comm.broadcast_object({"lr": 0.1}, root=0)
            else:
                dtype = np.float64 if r == 2 else np.float32
                await comm.alltoallv([np.ones((k + 1, 2), dtype) for k in range(n)])

    trio.run(main)
"""


@pytest.mark.parametrize(
    ("collective", "odd", "good"),
    [
        ("allgatherv", "allgatherv float32[rows, 3] #1", "allgatherv float32[rows, 2] #1"),
        ("alltoallv", "alltoallv float64[rows, 2] #1", "alltoallv float32[rows, 2] #1"),
        (
            "broadcast_object",
            "allreduce(sum) int64[1] #1",
            "broadcast(root=0) uint8[4096] #1 (in broadcast_object)",
        ),
    ],
)
def test_trioring_run_names_the_rank_whose_uneven_call_differs(
    tmp_path: Path, collective: str, odd: str, good: str
) -> None:
    """Four processes over Unix sockets with the one-host paths: rank 2's allgatherv has
    another trailing shape (seen in the counts that every rank reads from the segment), or
    its alltoallv another dtype (seen in its frames), or it calls an allreduce where the
    others call broadcast_object. Whichever rank sees it first, the launcher says that rank
    2's call, and only rank 2's, differs, in the words of the method each rank called."""
    script = write_script(tmp_path, UNEVEN_SCRIPT)
    result = run_launcher(tmp_path, "-n", "4", "--grace", "30", str(script), collective)
    assert result.returncode == 1, result.stderr
    expected = f"trioring run: rank 2's call differs from the other ranks' (rank 2: {odd}; "
    expected += f"ranks 0, 1, 3: {good})"
    assert expected in result.stderr.splitlines(), result.stderr
    assert re.search(r"trioring run: rank \d exited with code 1 \(first failure\)", result.stderr)


def test_a_step_of_another_method_names_it() -> None:
    step = OpSpec(Kind.BROADCAST, 1, DTYPE_CODES[np.dtype(np.int64)], 1, root=0)
    assert step._replace(within="broadcast_object").describe() == (
        "broadcast(root=0) int64[1] #1 (in broadcast_object)"
    )
    assert step._replace(within="broadcast_object").named() == "broadcast #1 (in broadcast_object)"
    assert step.named() == "broadcast #1"
    uneven = OpSpec(Kind.ALLGATHERV, 2, DTYPE_CODES[np.dtype(np.uint8)], 2, trailing=())
    assert uneven._replace(within="allgather_object").describe() == (
        "allgatherv uint8[rows] #2 (in allgather_object)"
    )


@pytest.mark.parametrize(
    ("odd", "good", "step"),
    [
        pytest.param(
            lambda c: c.allreduce(np.ones(1, np.int64)),
            lambda c: c.broadcast_object({"lr": 0.1}, root=0),
            "broadcast(root=0) uint8[4096] #1 (in broadcast_object)",
            id="broadcast_object",
        ),
        pytest.param(
            lambda c: c.allgather(np.ones(3)),
            lambda c: c.allgather_object([c.rank]),
            "allgatherv uint8[rows] #1 (in allgather_object)",
            id="allgather_object",
        ),
        pytest.param(
            lambda c: c.gatherv(np.ones(2), root=0),
            lambda c: c.gather_object(c.rank, root=0),
            "gatherv(root=0) uint8[rows] #1 (in gather_object)",
            id="gather_object",
        ),
    ],
)
async def test_a_mismatch_names_the_object_method_that_was_called(
    odd: Callable[[Communicator], Awaitable[object]],
    good: Callable[[Communicator], Awaitable[object]],
    step: str,
) -> None:
    """Rank 2 calls an array collective where the others call an object collective: each
    of the others names its own call as the step of the method it called; rank 2's call,
    and what the others saw of it in rank 2's frames, are named plainly."""
    async with open_local_world(4) as comms:
        errors = await errors_when_one_differs(comms, 2, odd, good)
    assert sorted(errors) == [0, 1, 2, 3]
    for rank, exc in errors.items():
        assert isinstance(exc, trioring.CollectiveMismatchError), repr(exc)
        if rank in exc.calls:
            named = exc.calls[rank]
            assert (named == step) == (rank != 2), (rank, named)
        assert "(in " not in exc.calls.get(2, ""), str(exc)
    assert any(rank in exc.calls for rank, exc in errors.items() if rank != 2), errors


async def test_a_cancelled_step_names_the_object_method(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1's broadcast_object is cancelled while it waits for the root: its warning,
    the note on its Cancelled, the root's PeerAbortedError and rank 1's next call all name
    the broadcast as a step of broadcast_object. The task's later calls are its own again."""
    caplog.set_level(logging.WARNING, logger="trioring")
    step = "broadcast #1 (in broadcast_object)"
    async with open_local_world(2) as comms:
        root_may_start = trio.Event()
        cancelled: list[BaseException] = []
        root_error: list[BaseException] = []

        async def root(comm: Communicator) -> None:
            await root_may_start.wait()
            with pytest.raises(trioring.PeerAbortedError) as info:
                await comm.broadcast_object([1, 2], root=0)
            root_error.append(info.value)

        async def other(comm: Communicator, scope: trio.CancelScope) -> None:
            try:
                with scope:
                    await comm.broadcast_object(None, root=0)
            finally:
                root_may_start.set()
            assert scope.cancelled_caught
            with pytest.raises(trioring.CommunicatorBrokenError) as info:
                await comm.barrier()
            cancelled.append(info.value)

        scope = trio.CancelScope()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(root, comms[0])
                nursery.start_soon(other, comms[1], scope)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith(f"rank 1: {step} cancelled after ") for w in warnings), warnings
    assert f"rank 1 cancelled {step} after " in str(root_error[0]), str(root_error[0])
    broken = str(cancelled[0])
    assert broken.startswith("rank 1: barrier #2: the communicator is broken since"), broken
    assert step in broken, broken


async def test_another_tasks_call_is_not_named_a_step() -> None:
    """While one task of each rank is inside allgather_object (waiting: rank 0 joins it
    last), another task's allreduce on a dup of the communicator meets a mismatch: its
    errors name the allreduce alone, the method being the other task's."""
    errors: dict[int, BaseException] = {}
    mismatches_seen = trio.Event()

    async def objects(comm: Communicator) -> None:
        if comm.rank == 0:
            await mismatches_seen.wait()
        assert await comm.allgather_object(comm.rank) == [0, 1, 2]

    async def arrays(side: Communicator) -> None:
        dtype = np.float64 if side.rank == 2 else np.float32
        # Once ranks 1 and 2 are inside allgather_object, and rank 0 waits to join it.
        await trio.testing.wait_all_tasks_blocked()
        try:
            await side.allreduce(np.ones(2, dtype))
        except trioring.CollectiveMismatchError as exc:
            errors[side.rank] = exc
        if len(errors) == 3:
            mismatches_seen.set()

    async def rank(comm: Communicator) -> None:
        async with comm.dup() as side, trio.open_nursery() as nursery:
            nursery.start_soon(objects, comm)
            nursery.start_soon(arrays, side)

    async with open_local_world(3) as comms:
        with trio.fail_after(10):
            await on_every_rank(comms, rank)
    assert sorted(errors) == [0, 1, 2]
    for exc in errors.values():
        assert "allreduce(sum) float" in str(exc), str(exc)
        assert "(in " not in str(exc), str(exc)
