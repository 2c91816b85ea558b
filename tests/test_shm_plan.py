"""The order of operations of the shared segment's reductions (allreduce, reduce and
reduce_scatter through the segment), without processes: the plan of
``_onehost._shm_collectives`` applied to stacked rows must give bitwise what recursive
doubling over sockets gives every rank, at every world size from 2 to 17, and stay within
the scratch it claims to need. tests/test_shm.py checks the same across real processes at
worlds 2 to 5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from local_runs import force, on_every_rank
from trioring._algorithms import World
from trioring._onehost._shm_reductions import _reduce_plan, reduce_temporaries
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from trioring import Communicator

WORLD_SIZES = [2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17]


def inputs(n: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    """Rows of values whose sums and products round differently in different orders."""
    rng = np.random.default_rng([n, count])
    rows = rng.standard_normal((n, count)) * 10.0 ** rng.integers(-3, 4, (n, count))
    if np.dtype(dtype).kind == "c":
        rows = rows + 1j * rng.standard_normal((n, count))
    return rows.astype(dtype)


def planned(
    rows: np.ndarray[Any, Any],
    ufunc: np.ufunc,
    own: int = -1,
    mine: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """``rows`` reduced by the segment's plan, with exactly the scratch it claims to need;
    with ``own``, as a reduce's root does: row ``own`` is never read, ``mine`` stands for it
    and takes the result (in place)."""
    n, count = rows.shape
    scratch = np.zeros(reduce_temporaries(n) * rows.nbytes // n, np.uint8)
    world = World(rank=0, size=n, links={}, chunk_bytes=scratch.nbytes, scratch=scratch)
    out = np.empty(count, rows.dtype) if mine is None else mine
    steps = _reduce_plan(world, rows, own).steps
    if own >= 0:
        assert sum(x is None for a, b, _ in steps for x in (a, b)) == 1
        assert not any(x is not None and np.shares_memory(x, rows[own]) for s in steps for x in s)
    with np.errstate(all="ignore"):
        for a, b, into in steps:
            ufunc(
                mine if a is None else a,
                mine if b is None else b,
                out=out if into is None else into,
            )
    return out


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize(
    ("dtype", "op", "ufunc"),
    [
        ("float32", "sum", np.add),
        ("float64", "prod", np.multiply),
        ("complex64", "prod", np.multiply),
    ],
)
async def test_plan_is_recursive_doublings_order(
    n: int, dtype: str, op: str, ufunc: np.ufunc
) -> None:
    for count in (1, 3, 1000):
        rows = inputs(n, count, dtype)
        results: list[bytes] = [b""] * n
        async with open_local_world(n) as comms:
            force(comms, "allreduce", "recursive_doubling")

            async def one(
                comm: Communicator, results: list[bytes] = results, rows: Any = rows
            ) -> None:
                x = rows[comm.rank].copy()
                await comm.allreduce(x, op=op)
                results[comm.rank] = x.tobytes()

            await on_every_rank(comms, one)
        assert len(set(results)) == 1
        assert planned(rows, ufunc).tobytes() == results[0], (n, dtype, op, count)


@pytest.mark.parametrize("n", [*WORLD_SIZES, 31, 32, 33, 64])
def test_plan_never_works_in_place_and_reads_every_row_once(n: int) -> None:
    rows = np.arange(n, dtype=np.float64).reshape(n, 1) + 1
    scratch = np.zeros(reduce_temporaries(n) * 8, np.uint8)
    world = World(rank=0, size=n, links={}, chunk_bytes=scratch.nbytes, scratch=scratch)
    steps = _reduce_plan(world, rows).steps
    # n rows take n - 1 operations; the last one writes the caller's array (None).
    assert len(steps) == n - 1
    assert [into is None for _, _, into in steps] == [False] * (n - 2) + [True]
    row_reads = 0
    for a, b, into in steps:
        assert into is None or not (np.shares_memory(a, into) or np.shares_memory(b, into))
        row_reads += sum(np.shares_memory(x, rows) for x in (a, b))
    assert row_reads == n
    assert planned(rows, np.add).tolist() == [n * (n + 1) / 2]


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize(("dtype", "ufunc"), [("float32", np.add), ("float64", np.multiply)])
def test_a_rank_reads_its_own_array_where_it_lies(n: int, dtype: str, ufunc: np.ufunc) -> None:
    """A reduce's root (any rank) leaves its slot row unwritten, and every rank of an
    allreduce leaves its row unread; each gives its own array as both its leaf and the
    result: the plan never reads that row, and the result is bitwise the plan's from the
    rows alone, where the leaf meets the top of the tree in place included."""
    rows = inputs(n, 1000, dtype)
    expected = planned(rows, ufunc).tobytes()
    for own in range(n):
        slots = rows.copy()
        slots[own] = np.nan  # what the root no longer writes there
        result = planned(slots, ufunc, own, rows[own].copy())
        assert result.tobytes() == expected, (n, own)
