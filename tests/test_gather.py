"""The gather family: gather, gatherv, scatter and scatterv (issue 15).

The binomial tree forced at worlds 1-17, 24, 27 and 32 over in-memory streams with small
chunks, at every root of the small worlds and a few of the large ones; sizes 0, 1, below the
world size, odd and across chunk boundaries; a spread of dtypes (bool, complex, float16
included), checked bitwise against numpy; uneven sizes with zeros on any rank; ``out=``;
bad arguments refused before any I/O; mismatches (dtype, count, shape, root, kind, ``out=``)
raised on every rank, none hanging; unbuffered streams; one rank cancelled; real processes
over tcp and unix at worlds 1-5; a rank SIGKILLed in the middle of a gather and of a
scatter; and a Hypothesis property over world size, root, counts and dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import trioring
from exact_inputs import make
from launched import run_killed, run_reports
from local_runs import errors_when_one_differs, force, on_every_rank
from trioring._algorithms import World, _tree_gather
from trioring._collectives import _decision, _scatter_header
from trioring._collectives._scatter import SHM_SCATTER_BYTES
from trioring._wire import Kind, OpSpec
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from trioring import Communicator

WORLDS = [*range(1, 18), 24, 27, 32]
#: 16 float32s per chunk: modest blocks cross chunk boundaries.
CHUNK_BYTES = 64
DTYPES = (
    "float64",
    "float32",
    "float16",
    "int8",
    "int32",
    "uint16",
    "uint64",
    "int64",
    "complex64",
    "complex128",
    "bool",
)
COLLECTIVES = ("gather", "gatherv", "scatter", "scatterv")
WORKER = Path(__file__).parent / "workers" / "gather_worker.py"


def data(seed: int, rank: int, shape: tuple[int, ...], dtype_name: str) -> np.ndarray[Any, Any]:
    dtype = np.dtype(dtype_name)
    return make(seed, rank, int(np.prod(shape)), dtype, "sum").reshape(shape)


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Bitwise the same array: dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


async def check_gather(
    comms: list[Communicator], seed: int, shape: tuple[int, ...], dtype_name: str, root: int
) -> None:
    n = len(comms)
    inputs = [data(seed, r, shape, dtype_name) for r in range(n)]
    arrays = [x.copy() for x in inputs]
    results: list[Any] = [None] * n

    async def one(comm: Communicator) -> None:
        results[comm.rank] = await comm.gather(arrays[comm.rank], root=root)

    await on_every_rank(comms, one)
    what = f"gather {dtype_name}{list(shape)} root {root} at world {n}"
    assert same(results[root], np.stack(inputs)), what
    for r in range(n):
        assert r == root or results[r] is None, (what, r)
        assert same(arrays[r], inputs[r]), (what, r)  # only read


async def check_gatherv(
    comms: list[Communicator],
    seed: int,
    rows: Sequence[int],
    trailing: tuple[int, ...],
    dtype_name: str,
    root: int,
) -> None:
    n = len(comms)
    inputs = [data(seed, r, (rows[r], *trailing), dtype_name) for r in range(n)]
    results: list[Any] = [None] * n

    async def one(comm: Communicator) -> None:
        results[comm.rank] = await comm.gatherv(inputs[comm.rank], root=root)

    await on_every_rank(comms, one)
    what = f"gatherv {dtype_name}{list(rows)}x{trailing} root {root} at world {n}"
    parts = results[root]
    assert len(parts) == n, what
    for r in range(n):
        assert same(parts[r], inputs[r]), (what, r)
        assert r == root or results[r] is None, (what, r)
    # Views, in rank order, into one contiguous buffer.
    base = parts[0].base if parts[0].base is not None else parts[0]
    assert all(np.shares_memory(p, base) or p.size == 0 for p in parts), what


async def check_scatter(
    comms: list[Communicator], seed: int, block: tuple[int, ...], dtype_name: str, root: int
) -> None:
    n = len(comms)
    blocks = data(seed, root, (n, *block), dtype_name)
    sent = blocks.copy()
    results: list[Any] = [None] * n

    async def one(comm: Communicator) -> None:
        mine = blocks if comm.rank == root else None
        results[comm.rank] = await comm.scatter(mine, root=root)

    await on_every_rank(comms, one)
    what = f"scatter {dtype_name}{[n, *block]} root {root} at world {n}"
    for r in range(n):
        assert same(results[r], sent[r]), (what, r)
        assert not np.shares_memory(results[r], blocks), (what, r)  # a new array
    assert same(blocks, sent), what  # only read


async def check_scatterv(
    comms: list[Communicator],
    seed: int,
    shapes: Sequence[tuple[int, ...]],
    dtype_name: str,
    root: int,
    *,
    method: str = "scatterv",
) -> None:
    n = len(comms)
    blocks = [data(seed, r, shapes[r], dtype_name) for r in range(n)]
    sent = [b.copy() for b in blocks]
    results: list[Any] = [None] * n

    async def one(comm: Communicator) -> None:
        mine = blocks if comm.rank == root else None
        results[comm.rank] = await getattr(comm, method)(mine, root=root)

    await on_every_rank(comms, one)
    what = f"{method} {dtype_name}{list(shapes)} root {root} at world {n}"
    for r in range(n):
        assert same(results[r], sent[r]), (what, r)
        assert same(blocks[r], sent[r]), (what, r)


def roots_of(n: int) -> Sequence[int]:
    return range(n) if n <= 6 else sorted({0, 1, n // 2, n - 3, n - 1})


def test_every_algorithm_is_covered() -> None:
    """The tree runs over sockets and is forced here; the one-host algorithms of gather and
    scatter are forced in real processes (tests/test_onehost_copies.py)."""
    onehost = {"gather": ("shm", "pipe", "cma"), "scatter": ("pipe", "cma")}
    for collective in COLLECTIVES:
        assert _decision.ALGORITHMS[collective] == (*onehost.get(collective, ()), "tree")
    assert _decision.gather() == "tree"
    assert _decision.scatter() == "tree"
    big = _decision.CMA_MIN_COPY_BYTES + 1
    assert _decision.gather(big, (False, True)) == "cma"
    assert _decision.gather(big, (True, True)) == "shm"
    assert _decision.gather(big, (False, False)) == "tree"
    # With a segment that cannot take the blocks, its pipe, unless cross-memory attach
    # from world 4 above CMA_MIN_COPY_BYTES; never the tree.
    for n in (2, 3, 4, 8):
        for cma in (False, True):
            for total in (1, big - 1, big):
                chosen = _decision.gather(total, (False, cma), segment=True, world_size=n)
                wanted = "cma" if cma and n >= 4 and total == big else "pipe"
                assert chosen == wanted, (n, cma, total)
    assert _decision.scatter(big, cma=True) == "cma"
    assert _decision.scatter(big - 1, cma=True) == "tree"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_scatter_takes_the_segment_when_the_other_ranks_blocks_fit(n: int) -> None:
    """The root's own block stays out of its slot, so the segment carries every scatter
    whose n - 1 other blocks fit beside the header, and nothing larger."""
    slot = SHM_SCATTER_BYTES
    block = slot // max(n - 1, 1)  # the largest block that fits, in bytes
    assert _decision.scatter(n * block, False, slot, n) == "shm"
    if n > 1:
        # With a segment but without cross-memory attach: its pipe.
        assert _decision.scatter(n * (block + 1), False, slot, n) == "pipe"
    assert _decision.scatter(n * block, True, -1, n) == "tree"  # no segment
    big = _decision.CMA_MIN_COPY_BYTES + n
    assert _decision.scatter(big, True, slot, n) == ("shm" if n == 1 else "cma")
    if n > 1:
        # With a segment, what it cannot carry reads by cross-memory attach (when every
        # rank agreed to it), from CMA_MIN_SCATTER_BYTES; without one, from
        # CMA_MIN_COPY_BYTES.
        over = n * (block + 1)
        assert over > _decision.CMA_MIN_SCATTER_BYTES
        assert _decision.scatter(over, True, slot, n) == "cma"
        assert _decision.scatter(over, False, slot, n) == "pipe"
        assert _decision.scatter(over, True, -1, n) == (
            "cma" if over > _decision.CMA_MIN_COPY_BYTES else "tree"
        )


@pytest.mark.parametrize("world_size", WORLDS)
async def test_every_world_size_and_root(world_size: int) -> None:
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, COLLECTIVES, "tree")
        for root in roots_of(n):
            seed = 10 * root
            for size in (0, 1, 37):
                await check_gather(comms, seed + size, (size,), "float32", root)
            await check_scatter(comms, seed, (37,), "float32", root)
            await check_scatter(comms, seed + 1, (2, 3), "int16", root)
            await check_scatter(comms, seed + 2, (0,), "float64", root)
            # Uneven, with zeros, one block across chunks, a total below the world size.
            for index, rows in enumerate(
                (
                    [(i * 7) % 5 for i in range(n)],
                    [0] * (n - 1) + [40],
                    [1 if i % 3 == 1 else 0 for i in range(n)],
                )
            ):
                await check_gatherv(comms, seed + index, rows, (), "float64", root)
                await check_scatterv(comms, seed + index, [(k,) for k in rows], "int32", root)
            await check_gatherv(comms, seed, [(i + root) % 3 for i in range(n)], (3,), "int8", root)
            shapes = [((i * 5) % 4, 2) for i in range(n)]
            await check_scatterv(comms, seed, shapes, "float32", root, method="scatter")
        assert len({c.seq for c in comms}) == 1


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
async def test_every_size_and_dtype(world_size: int) -> None:
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for d, dtype_name in enumerate(DTYPES):
            per_chunk = CHUNK_BYTES // np.dtype(dtype_name).itemsize
            sizes = (0, 1, n - 1, 2 * n + 1, per_chunk + 1, 3 * per_chunk + 5)
            for c, size in enumerate(sizes):
                root = (c + d) % n
                await check_gather(comms, c, (size,), dtype_name, root)
                await check_scatter(comms, c, (size,), dtype_name, root)
                rows = [(size + i) % (per_chunk + 3) for i in range(n)]
                await check_gatherv(comms, c, rows, (), dtype_name, root)
                await check_scatterv(comms, c, [(k,) for k in rows], dtype_name, root)


async def test_shapes() -> None:
    """Multi-dimensional blocks keep their shapes; 0-d arrays work where they make sense."""
    n = 3
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        await check_gather(comms, 0, (2, 3, 2), "float32", 1)
        await check_gather(comms, 1, (), "int64", 2)
        await check_scatter(comms, 2, (), "float64", 0)  # a 1-D array: one element each
        await check_scatter(comms, 3, (2, 0, 4), "uint16", 2)
        await check_gatherv(comms, 4, [2, 0, 1], (2, 2), "complex64", 0)
        await check_scatterv(comms, 5, [(), (), ()], "bool", 1)
        await check_scatterv(comms, 6, [(1, 2, 3), (0, 5, 1), (4, 1, 1)], "int8", 2)


async def test_ring_reads_and_writes_across_the_end_and_between_arrays() -> None:
    """The root's view of its blocks: a piece that runs past the end wraps to the start,
    one that spans arrays of a list goes through the spare chunk."""
    parts = [np.arange(3.0), np.zeros(0), np.arange(3.0, 7.0), np.arange(7.0, 8.0)]
    ring = _tree_gather._Ring(parts, [0, 3, 3, 7, 8], 8)
    for lo in range(8):
        for count in range(9):
            got = np.frombuffer(ring.read(lo, count), np.float64)
            assert got.tolist() == [float((lo + i) % 8) for i in range(count)], (lo, count)

    class Link:
        """Delivers 1.0, 2.0, ... into whatever it is asked to receive into."""

        async def recv(self, spec: Any, offset: int, into: memoryview) -> None:
            into[:] = np.arange(1.0, 1.0 + into.nbytes // 8).view(np.uint8).data

    for lo, count, expected in [
        (6, 4, [3, 4, 0, 0, 0, 0, 1, 2]),
        (2, 3, [0, 0, 1, 2, 3, 0, 0, 0]),
        (7, 1, [0, 0, 0, 0, 0, 0, 0, 1]),
        (8, 2, [1, 2, 0, 0, 0, 0, 0, 0]),
    ]:
        result = np.zeros(8)
        ring = _tree_gather._Ring([result], [0, 8], 4)
        await ring.receive(Link(), None, 0, lo, count)  # type: ignore[arg-type]
        assert result.tolist() == expected, (lo, count)


async def test_out() -> None:
    n = 3
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        got: dict[int, list[Any]] = {}
        outs = {
            "gather": np.full((3, 2, 2), -1, np.int32),
            "gatherv": np.full(6, -1.0),
            "scatter": [np.full((2, 1), -1, np.int16) for _ in range(n)],
            "list": [np.full(r, -1.0) for r in range(n)],
        }

        async def one(comm: Communicator) -> None:
            r = comm.rank
            x = np.arange(4, dtype=np.int32).reshape(2, 2) + 10 * r
            # A non-root's out= is ignored, whatever it is.
            bad = [1, 2] if r != 1 else outs["gather"]
            a = await comm.gather(x, root=1, out=bad)  # type: ignore[arg-type]
            b = await comm.gatherv(np.full(r + 1, float(r)), root=2, out=outs["gatherv"])
            blocks = np.arange(n * 2, dtype=np.int16).reshape(n, 2) if r == 0 else "ignored"
            c = await comm.scatter(blocks, out=outs["scatter"][r])  # type: ignore[arg-type]
            listed = [np.full(q, float(q)) for q in range(n)] if r == 0 else None
            d = await comm.scatter(listed, out=outs["list"][r])
            # In place on the root: x is the root's block of out=, and out= the root's block.
            out = np.zeros((n, 2), np.int64)
            e = await comm.gather(out[2] if r == 2 else np.full(2, r, np.int64), root=2, out=out)
            blocks2 = np.arange(n, dtype=np.float32) if r == 1 else None
            f = await comm.scatter(
                blocks2, root=1, out=blocks2[1:2] if blocks2 is not None else None
            )
            got[r] = [a, b, c, d, e, f]

        await on_every_rank(comms, one)
    for r in range(n):
        a, b, c, d, e, f = got[r]
        if r == 1:
            assert a is outs["gather"]
            assert a.reshape(3, 4).tolist() == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
        else:
            assert a is None
        if r == 2:
            assert [p.tolist() for p in b] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
            assert all(np.shares_memory(p, outs["gatherv"]) for p in b)
            assert e.tolist() == [[0, 0], [1, 1], [0, 0]]
        else:
            assert b is None
            assert e is None
        assert c is outs["scatter"][r]
        assert c.reshape(-1).tolist() == [2 * r, 2 * r + 1]
        assert d is outs["list"][r]
        assert d.tolist() == [float(r)] * r
        assert f.reshape(-1).tolist() == [float(r)]
        assert f.shape == ((1,) if r == 1 else ())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.gather(np.zeros(3), root=3), "root 3 is not a rank"),
        (lambda c: c.gather(np.zeros(3), root=True), "root must be an int"),
        (lambda c: c.gather([1.0, 2.0]), "expected a numpy.ndarray"),
        (lambda c: c.gather(np.zeros(4)[::2]), "not C-contiguous"),
        (lambda c: c.gather(np.zeros(3, np.float128)), "not supported"),
        (lambda c: c.gather(np.zeros(3), out=np.zeros(8)), "has 8 elements, expected 9"),
        (lambda c: c.gather(np.zeros(3), out=np.zeros(9, np.float32)), "dtype float32"),
        (lambda c: c.gather(np.zeros(3), out=np.zeros(18)[::2]), "out=: array is not C-contig"),
        (lambda c: c.gatherv(np.zeros(())), "at least one dimension"),
        (lambda c: c.gatherv(np.zeros(3), out=np.zeros(9, np.int8)), "dtype int8"),
        (lambda c: c.gatherv(np.zeros(3), root=-1), "root -1 is not a rank"),
        (lambda c: c.scatter(np.zeros((2, 3))), r"shape \(2, 3\); its first dimension"),
        (lambda c: c.scatter(np.zeros(())), "a 0-d array"),
        (lambda c: c.scatter(None), "got NoneType"),
        (lambda c: c.scatter([np.zeros(1)] * 2), "passes 2 arrays; expected world_size"),
        (lambda c: c.scatter([np.zeros(1), np.zeros(1, np.float32), np.zeros(1)]), "dtype"),
        (lambda c: c.scatter([np.zeros(1), np.zeros((1, 1)), np.zeros(1)]), "2 dimensions"),
        (lambda c: c.scatter([np.zeros(1), [1.0], np.zeros(1)]), r"blocks\[1\]: expected"),
        (lambda c: c.scatter(np.zeros((3, 2)), out=np.zeros(3)), "has 3 elements, expected 2"),
        (lambda c: c.scatter(np.zeros((3, 2)), out=np.zeros(2, np.int32)), "dtype int32"),
        (lambda c: c.scatterv(np.zeros((3, 2))), "scatterv takes a list"),
        (lambda c: c.scatterv([np.zeros(1)] * 4), "passes 4 arrays"),
    ],
)
async def test_bad_arguments_are_refused_before_io(
    call: Callable[[Communicator], Awaitable[Any]], message: str
) -> None:
    async with open_local_world(3) as comms:
        with pytest.raises(trioring.InvalidArgumentError, match=message):
            await call(comms[0])
        assert comms[0].seq == 0
        assert not comms[0].broken


async def test_bad_out_is_refused_before_io() -> None:
    async with open_local_world(3) as comms:
        comm = comms[0]
        read_only = np.zeros(2)
        read_only.setflags(write=False)
        blocks = np.zeros((3, 2))
        cases: list[tuple[Callable[[], Awaitable[Any]], str]] = [
            (lambda: comm.scatter(blocks, out=read_only), "out=: array is read-only"),
            (lambda: comm.scatter(blocks, out=blocks[1]), "out= overlaps the blocks"),
            (lambda: comm.scatter(None, root=1, out=read_only), "out=: array is read-only"),
            (lambda: comm.scatter(None, root=2, out=[0.0]), "out=: expected a numpy.ndarray"),
            (lambda: comm.scatterv(None, root=2, out=np.zeros(4)[::2]), "not C-contiguous"),
            (lambda: comm.gather(blocks[1], out=blocks), "x overlaps out= other than"),
            (lambda: comm.gatherv(blocks[1], out=blocks), "x overlaps out="),
        ]
        for call, message in cases:
            with pytest.raises(trioring.InvalidArgumentError, match=message):
                await call()
        assert comm.seq == 0
        assert not comm.broken


async def test_non_root_inputs_are_ignored() -> None:
    """As in mpi4py: a non-root's ``blocks`` (scatter) and ``out`` (gather) mean nothing."""
    n = 3
    async with open_local_world(n) as comms:
        got: dict[int, Any] = {}

        async def one(comm: Communicator) -> None:
            r = comm.rank
            junk: Any = "not an array" if r else np.arange(n * 2.0).reshape(n, 2)
            got[r] = await comm.scatter(junk)
            out: Any = {"a": 1} if r else None
            gathered = await comm.gather(np.full(1, r), out=out)
            assert (gathered is None) == (r != 0)
            if gathered is not None:
                assert gathered.tolist() == [[0], [1], [2]]

        await on_every_rank(comms, one)
    assert [got[r].tolist() for r in range(n)] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.gather(np.zeros(0)),
        lambda c: c.gather(np.ones((2, 2)), out=np.zeros(4)),
        lambda c: c.gatherv(np.ones((2, 3))),
        lambda c: c.scatter(np.ones((1, 3))),
        lambda c: c.scatter([np.ones(0)]),
        lambda c: c.scatterv([np.ones((2, 2), np.complex64)], out=np.zeros(4, np.complex64)),
    ],
)
async def test_world_of_one_checkpoints(call: Callable[[Communicator], Awaitable[Any]]) -> None:
    async with open_local_world(1) as (comm,):
        with trio.testing.assert_checkpoints():
            await call(comm)
        assert comm.seq == 1


async def test_world_of_one_results() -> None:
    async with open_local_world(1) as (comm,):
        x = np.arange(3.0)
        g = await comm.gather(x)
        assert g is not None
        assert g.tolist() == [[0.0, 1.0, 2.0]]
        parts = await comm.gatherv(x)
        assert parts is not None
        assert [p.tolist() for p in parts] == [[0.0, 1.0, 2.0]]
        s = await comm.scatter(x.reshape(1, 3))
        assert s.tolist() == [0.0, 1.0, 2.0]
        assert not np.shares_memory(s, x)
        v = await comm.scatterv([x[:2]])
        assert v.tolist() == [0.0, 1.0]


async def test_empty_calls_checkpoint_on_every_rank() -> None:
    async with open_local_world(2) as comms:

        async def one(comm: Communicator) -> None:
            root = comm.rank == 1
            with trio.testing.assert_checkpoints():
                await comm.gather(np.zeros(0), root=1)
            with trio.testing.assert_checkpoints():
                await comm.gatherv(np.zeros((0, 2)), root=1)
            with trio.testing.assert_checkpoints():
                await comm.scatter(np.zeros((2, 0)) if root else None, root=1)
            with trio.testing.assert_checkpoints():
                await comm.scatterv([np.zeros(0)] * 2 if root else None, root=1)

        await on_every_rank(comms, one)


# -- mismatches -------------------------------------------------------------------------------


def rows_of(c: Communicator, k: int) -> np.ndarray[Any, Any]:
    return np.zeros((c.world_size, k))


def listed(c: Communicator, root: int = 0) -> list[np.ndarray[Any, Any]] | None:
    return [np.zeros(3) for _ in range(c.world_size)] if c.rank == root else None


def bad_capacity(c: Communicator) -> np.ndarray[Any, Any] | None:
    return np.zeros(2 * c.world_size + 1) if c.rank == 1 else None


MISMATCHES: list[
    tuple[
        str,
        Callable[[Communicator], Awaitable[Any]],
        Callable[[Communicator], Awaitable[Any]],
        tuple[str, ...],
    ]
] = [
    (
        "gather-dtype",
        lambda c: c.gather(np.zeros(4, np.float32)),
        lambda c: c.gather(np.zeros(4, np.float64)),
        ("gather(root=0) float32[4]", "gather(root=0) float64[4]"),
    ),
    (
        "gather-count",
        lambda c: c.gather(np.zeros(4)),
        lambda c: c.gather(np.zeros(5)),
        ("float64[4]", "float64[5]"),
    ),
    (
        "gather-root",
        lambda c: c.gather(np.zeros(4), root=0),
        lambda c: c.gather(np.zeros(4), root=1),
        ("gather(root=0) float64[4]", "gather(root=1) float64[4]"),
    ),
    (
        "gather-kind",
        lambda c: c.gather(np.zeros(3)),
        lambda c: c.scatter(None),
        ("gather(root=0) float64[3]", "scatter(root=0)"),
    ),
    (
        "gather-v-kind",
        lambda c: c.gather(np.zeros(3)),
        lambda c: c.gatherv(np.zeros(3)),
        ("gather(root=0)", "gatherv(root=0)"),
    ),
    (
        "gatherv-dtype",
        lambda c: c.gatherv(np.zeros(c.rank, np.int32)),
        lambda c: c.gatherv(np.zeros(c.rank, np.int64)),
        ("gatherv(root=0) int32", "gatherv(root=0) int64"),
    ),
    (
        "gatherv-ndim",
        lambda c: c.gatherv(np.zeros(2)),
        lambda c: c.gatherv(np.zeros((1, 2))),
        ("gatherv(root=0)",),
    ),
    (
        "gatherv-trailing",
        lambda c: c.gatherv(np.zeros((c.rank, 2))),
        lambda c: c.gatherv(np.zeros((1, 3))),
        ("gatherv(root=0) float64[rows, 2] #1", "gatherv(root=0) float64[rows, 3] #1"),
    ),
    (
        "gatherv-root-out",
        # Whichever rank is odd: the root (rank 1) passes an out= one element too large.
        lambda c: c.gatherv(np.zeros(2), root=1, out=bad_capacity(c)),
        lambda c: c.gatherv(np.zeros(2), root=1, out=bad_capacity(c)),
        ("out= holds", "elements in all"),
    ),
    (
        "scatter-root",
        lambda c: c.scatter(rows_of(c, 2) if c.rank == 0 else None, root=0),
        lambda c: c.scatter(rows_of(c, 2), root=1),
        ("scatter(root=0)", "scatter(root=1)"),
    ),
    (
        "scatter-kind",
        lambda c: c.scatter(listed(c)),
        lambda c: c.scatterv(None),
        ("scatter(root=0)", "scatterv(root=0)"),
    ),
    (
        "scatter-out-dtype",
        lambda c: c.scatter(rows_of(c, 3) if c.rank == 0 else None),
        lambda c: c.scatter(None, out=np.zeros(3, np.float32)),
        ("out= has dtype float32, root 0 scatters float64",),
    ),
    (
        "scatter-out-count",
        lambda c: c.scatter(rows_of(c, 3) if c.rank == 0 else None),
        lambda c: c.scatter(None, out=np.zeros(4)),
        ("out= holds 4 elements, root 0's blocks hold 3",),
    ),
    (
        "scatter-list-out-count",
        lambda c: c.scatter(listed(c)),
        lambda c: c.scatter(None, out=np.zeros(4)),
        ("out= holds 4 elements, but root 0's block for this rank is float64[3]",),
    ),
    (
        "scatterv-out-dtype",
        lambda c: c.scatterv(listed(c), out=np.zeros(3)),
        lambda c: c.scatterv(None, out=np.zeros(3, np.complex128)),
        ("out= has dtype complex128, root 0 scatters float64",),
    ),
]


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize(
    ("case", "usual", "odd", "fragments"), MISMATCHES, ids=[m[0] for m in MISMATCHES]
)
async def test_mismatch_raises_on_every_rank(
    n: int,
    case: str,
    usual: Callable[[Communicator], Awaitable[Any]],
    odd: Callable[[Communicator], Awaitable[Any]],
    fragments: tuple[str, ...],
) -> None:
    for odd_rank in sorted({1, n // 2, n - 1}):
        async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
            errors = await errors_when_one_differs(comms, odd_rank, odd, usual)
        assert sorted(errors) == list(range(n)), (odd_rank, errors)
        for error in errors.values():
            assert isinstance(error, trioring.CollectiveMismatchError), repr(error)
            assert all(f in str(error) for f in fragments), str(error)


async def test_scatter_out_mismatch_writes_nothing() -> None:
    """An out= that does not fit is never written, whichever form the root scatters."""
    n = 4
    for blocks in (np.ones((n, 3)), [np.ones(3)] * n):
        out = np.full(4, 7.0)
        async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

            async def one(
                comm: Communicator, blocks: Any = blocks, out: np.ndarray[Any, Any] = out
            ) -> None:
                with pytest.raises(trioring.CollectiveMismatchError):
                    await comm.scatter(
                        blocks if comm.rank == 0 else None, out=out if comm.rank == 3 else None
                    )

            with trio.fail_after(10):
                await on_every_rank(comms, one)
        assert out.tolist() == [7.0] * 4


# -- streams, cancellation --------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
async def test_unbuffered_streams_do_not_deadlock(world_size: int) -> None:
    """Every collective over connections without any buffer (every send waits for its
    receive), across chunks, at two roots: a send before its receive would deadlock here."""
    n = world_size
    async with open_local_world(n, buffered=False, chunk_bytes=CHUNK_BYTES) as comms:
        with trio.fail_after(20):
            for root in (0, n - 1):
                await check_gather(comms, 1, (37,), "float32", root)
                await check_gatherv(comms, 2, [(i * 5) % 17 for i in range(n)], (2,), "int16", root)
                await check_scatter(comms, 3, (37,), "float32", root)
                shapes = [((i * 11) % 29,) for i in range(n)]
                await check_scatterv(comms, 4, shapes, "float64", root)
                await check_scatterv(comms, 5, shapes, "float64", root, method="scatter")


@pytest.mark.parametrize("collective", COLLECTIVES)
async def test_cancelling_one_rank_reaches_every_rank(
    collective: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Rank 0 is cancelled inside the call, while waiting for rank 2, which enters late:
    every other rank raises (in this call, or in its next one where it had all it needed
    before the cancellation), and rank 0's communicator is broken. (Virtual time.)"""
    n = 4
    errors: dict[int, BaseException] = {}
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

        async def call(comm: Communicator) -> None:
            x = np.ones(40, np.float32)
            root = comm.rank == 1
            if collective == "gather":
                await comm.gather(x, root=1)
            elif collective == "gatherv":
                await comm.gatherv(x[: comm.rank * 10], root=1)
            elif collective == "scatter":
                await comm.scatter(np.ones((n, 40)) if root else None, root=1)
            else:
                await comm.scatterv([x] * n if root else None, root=1)

        async def one(comm: Communicator) -> None:
            if comm.rank == 2:
                await trio.sleep(0.2)  # late: rank 0 is cancelled while the others wait
            try:
                if comm.rank == 0:
                    with trio.move_on_after(0.05):
                        await call(comm)
                    assert comm.broken
                else:
                    await call(comm)
                    await comm.barrier()
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    assert sorted(errors) == [1, 2, 3]
    for exc in errors.values():
        assert isinstance(exc, trioring.PeerAbortedError | trioring.PeerFailedError), repr(exc)


# -- a property ---------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 9),
    root_seed=st.integers(0, 1000),
    counts=st.lists(st.integers(0, 40), min_size=9, max_size=9),
    trailing=st.sampled_from([(), (1,), (3,)]),
    dtype=st.sampled_from(DTYPES),
    chunk_bytes=st.sampled_from([16, 64, 1024]),
    buffered=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_numpy(
    n: int,
    root_seed: int,
    counts: list[int],
    trailing: tuple[int, ...],
    dtype: str,
    chunk_bytes: int,
    buffered: bool,
    seed: int,
) -> None:
    root = root_seed % n
    rows = counts[:n]
    uneven = [data(seed, r, (rows[r], *trailing), dtype) for r in range(n)]
    even = [data(seed + 1, r, (rows[0], *trailing), dtype) for r in range(n)]
    got: dict[int, list[Any]] = {}

    async def one(comm: Communicator) -> None:
        r, is_root = comm.rank, comm.rank == root
        g = await comm.gather(even[r], root=root)
        v = await comm.gatherv(uneven[r], root=root)
        s = await comm.scatter(np.stack(even) if is_root else None, root=root)
        sv = await comm.scatterv(uneven if is_root else None, root=root)
        got[r] = [g, v, s, sv]

    async def main() -> None:
        with trio.fail_after(10):
            async with open_local_world(n, buffered=buffered, chunk_bytes=chunk_bytes) as comms:
                await on_every_rank(comms, one)
                assert all(c.seq == 4 for c in comms)

    trio.run(main)
    for r in range(n):
        g, v, s, sv = got[r]
        if r == root:
            assert same(g, np.stack(even))
            assert all(same(p, u) for p, u in zip(v, uneven, strict=True))
        else:
            assert g is None
            assert v is None
        assert same(s, even[r])
        assert same(sv, uneven[r])


# -- real processes ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", range(1, 6))
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_real_processes(tmp_path: Path, transport: str, world_size: int) -> None:
    reports = run_reports(
        WORKER, ["check", str(tmp_path)], tmp_path, world_size, transport=transport
    )
    for report in reports:
        assert report["errors"] == [], report["errors"]


@pytest.mark.parametrize(
    ("collective", "algorithm"),
    [
        *((c, a) for c in ("gather", "scatter") for a in ("tree", "cma", "cma-frames")),
        ("gatherv", "tree"),
        ("scatterv", "tree"),
    ],
)
def test_sigkill_during_the_collective(tmp_path: Path, collective: str, algorithm: str) -> None:
    """Rank 2 (rank 3's parent in the tree rooted at 0 at world 4) SIGKILLs itself in the
    middle of the call (by the tree: at its third data frame; by cross-memory attach: as it
    exposes its array to a gather's root, or before it reads its block of a scatter's
    root; ``cma-frames``: the same without a shared segment, the control going by frames):
    every survivor raises PeerFailedError naming it, promptly; none hangs. The one
    exception is documented: without a segment, a scatter's non-root that has read its
    block by cross-memory attach has all it needs and returns; the root and the rest of the
    world learn of the death, the root at once. (Through the segment every rank waits for
    every rank's done word, so all raise.)"""
    if algorithm.startswith("cma") and not trioring.is_available("cma"):
        pytest.skip("process_vm_readv is not permitted on this machine")
    victim = 2
    env = {"TRIORING_SHM": "0"} if algorithm == "cma-frames" else {}
    forced = algorithm.removesuffix("-frames")
    survivors = run_killed(
        WORKER, ["kill", str(tmp_path), collective, str(victim), forced], tmp_path, victim, env=env
    )
    for rank, report in survivors.items():
        had_its_block = collective == "scatter" and algorithm == "cma-frames" and rank != 0
        if had_its_block and report["error"] is None:
            continue  # see above
        assert report["error"] == "PeerFailedError", report
        assert report["peer"] == victim, report
        assert report["elapsed"] < 5.0, report


# -- scatter's out= through the shared segment ---------------------------------------------

SCATTER_OUT_WORKER = Path(__file__).parent / "workers" / "scatter_out_worker.py"


@pytest.mark.parametrize("n", [2, 3, 5])
def test_scatter_out_through_the_segment(tmp_path: Path, n: int) -> None:
    """Through the shared segment every rank folds every rank's header at once (not by a
    merge per peer): out= passed on some ranks is filled, and a bad one, or two, raise
    the same CollectiveMismatchError on every rank, naming the same rank, without
    writing into it (tests/workers/scatter_out_worker.py)."""
    if not trioring.is_available("shm"):
        pytest.skip(f"shm is not available here: {trioring.capabilities()}")
    reports = run_reports(SCATTER_OUT_WORKER, [str(tmp_path)], tmp_path, n)
    root, odd = n - 1, n - 2
    expected = {
        "dtype": f"out= has dtype float32, root {root} scatters float64",
        "count": f"out= holds 4 elements, root {root}'s blocks hold 3",
        "two-counts": f"out= holds 2 elements, root {root}'s blocks hold 3",
        "list-count": f"out= holds 4 elements, but root {root}'s block for this rank is float64[3]",
    }
    for r, report in enumerate(reports):
        assert all("shm" in features for features in report["features"]), report
        cases = report["cases"]
        for name in ("good", "good-list"):
            assert cases[name] == {"error": None, "right": True}, (r, name, cases[name])
        for name, fragment in expected.items():
            error = cases[name]["error"]
            assert error is not None, (r, name)
            assert error["type"] == "CollectiveMismatchError", (r, name, error)
            assert fragment in error["message"], (r, name, error["message"])
            if name != "list-count":
                # Decided by the fold, the same on every rank: whose out= is named (in its
                # own words, which a rank may raise as relayed from it, or a peer's).
                own = f"rank {odd}: scatter(root={root}) #1: this rank's out="
                named = f"rank {odd}'s out=" in error["message"] or own in error["message"]
                assert named, (r, name, error["message"])
        # The ranks whose out= was bad: untouched.
        if r == odd:
            assert all(cases[name]["right"] for name in expected), (r, cases)
        if r == 0:
            assert cases["two-counts"]["right"], (r, cases)


def _checked(n: int, rank: int, fields: list[int], root: int) -> str:
    """What _scatter_header.check_header makes of folded ``fields`` on ``rank``: "ok", or the
    error's type and message."""
    world = World(
        rank=rank, size=n, links={}, chunk_bytes=CHUNK_BYTES, scratch=np.zeros(0, np.uint8)
    )
    spec = OpSpec(Kind.SCATTER, 1, 0, 0, 0, root)
    try:
        _scatter_header.check_header(world, spec, list(fields), root)
    except trioring.TrioringError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(0, n - 1),
            st.booleans(),
            st.lists(
                st.none() | st.tuples(st.integers(1, 3), st.integers(2, 4)),
                min_size=n,
                max_size=n,
            ),
        )
    )
)
def test_scatter_fold_agrees_with_the_pairwise_merge(
    case: tuple[int, int, bool, list[Any]],
) -> None:
    """The segment's one-pass fold of every rank's header (_scatter_header.fold) decides what the
    sockets' dissemination decides by merging headers pairwise (_scatter_header.merge), whatever
    order the merges come in: the same verdict and message from the header check on every
    rank, so an out= mismatch reads the same over either; and, where an out= does not fit,
    the same extremes (where all fit, the fold does not look for them)."""
    n, root, listed, outs = case
    fields = (2, 1, 1, None) if listed else (2, 0, 1, (3,))  # float64 (code 2), 3 per rank
    starts = [
        _scatter_header.start_header(q, fields if q == root else None, outs[q]) for q in range(n)
    ]
    folded = _scatter_header.fold(
        [start[: _scatter_header.SHAPE].tolist() for start in starts], root
    )
    for order in (range(n), reversed(range(n))):
        merged = starts[root].copy()
        for q in order:
            _scatter_header.merge(merged, starts[q])
        exact = merged[: _scatter_header.SHAPE].tolist()
        for rank in range(n):
            assert _checked(n, rank, folded, root) == _checked(n, rank, exact, root)
        fit = all(out is None or (out[0] == 2 and (listed or out[1] == 3)) for out in outs)
        if not fit:
            assert folded == exact
        else:
            assert folded[: _scatter_header.DTYPE_MIN] == exact[: _scatter_header.DTYPE_MIN]
