"""The reduce family: reduce_scatter, reduce_scatterv and reduce (issue 15), reduce by the
binomial tree and by reduce-scatter + gather.

Every algorithm forced at worlds 1-17, 24, 27 and 32 over in-memory streams with small
chunks; sizes 0, 1, below the world size, odd and across chunk boundaries; a spread of dtypes
and every op, on integer-valued inputs (exact in any order) checked against numpy; random
float inputs checked bitwise against numpy computing the documented order of operations;
mismatches on every rank; the Gloo regressions (pytorch#162338: reduce_scatter ignores the
op; pytorch#76527: reduce writes partial sums into non-root buffers); sizes on both sides of
the decision table (a mismatch, never a hang); unbuffered streams; one rank cancelled; real
processes over tcp and unix; a rank SIGKILLed in the middle of each collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from exact_inputs import UFUNCS, make, ops_for
from launched import run_killed, run_reports
from local_runs import errors_when_one_differs, force, on_every_rank
from trioring._algorithms import tree_neighbours
from trioring._collectives import _decision, _reduce
from trioring._collectives._decision import CMA_MIN_COPY_BYTES
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
    "int64",
    "complex64",
    "bool",
)
WORKER = Path(__file__).parent / "workers" / "reduce_worker.py"


def reduced(inputs: Sequence[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    dtype = inputs[0].dtype
    with np.errstate(all="ignore"):
        expected = UFUNCS[op].reduce(np.stack(inputs), axis=0, dtype=dtype)
        if op == "mean":
            np.divide(expected, len(inputs), out=expected)
    return expected


async def check_reduce_scatterv(
    comms: list[Communicator], seed: int, counts: list[int], dtype_name: str, op: str
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, sum(counts), dtype, op) for r in range(n)]
    arrays = [a.copy() for a in inputs]
    results: list[Any] = [None] * n

    async def one(comm: Communicator) -> None:
        results[comm.rank] = await comm.reduce_scatterv(arrays[comm.rank], counts=counts, op=op)

    await on_every_rank(comms, one)
    expected = reduced(inputs, op)
    what = f"reduce_scatterv {dtype}{counts} {op} at world {n}"
    start = 0
    for r in range(n):
        assert results[r].dtype == dtype, what
        assert results[r].shape == (counts[r],), what
        assert np.array_equal(results[r], expected[start : start + counts[r]]), (what, r)
        assert arrays[r].tobytes() == inputs[r].tobytes(), what  # the input is only read
        start += counts[r]


async def check_reduce_scatter(
    comms: list[Communicator], seed: int, block: int, dtype_name: str, op: str
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, n * block, dtype, op).reshape(n, block) for r in range(n)]
    arrays = [a.copy() for a in inputs]
    results: list[Any] = [None] * n

    async def one(comm: Communicator) -> None:
        results[comm.rank] = await comm.reduce_scatter(arrays[comm.rank], op=op)

    await on_every_rank(comms, one)
    expected = reduced(inputs, op)
    what = f"reduce_scatter {dtype}[{n}x{block}] {op} at world {n}"
    for r in range(n):
        assert results[r].shape == (block,), what
        assert np.array_equal(results[r], expected[r]), (what, r)
        assert arrays[r].tobytes() == inputs[r].tobytes(), what


async def check_reduce(
    comms: list[Communicator], seed: int, count: int, dtype_name: str, op: str, root: int
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, count, dtype, op) for r in range(n)]
    arrays = [a.copy() for a in inputs]

    async def one(comm: Communicator) -> None:
        await comm.reduce(arrays[comm.rank], root=root, op=op)

    await on_every_rank(comms, one)
    what = f"reduce {dtype}[{count}] {op} root {root} at world {n}"
    assert np.array_equal(arrays[root], reduced(inputs, op)), what
    for r in range(n):
        if r != root:
            assert arrays[r].tobytes() == inputs[r].tobytes(), (what, r)


SCATTER_ALGORITHMS = ("recursive_halving", "ring")
REDUCE_ALGORITHMS = ("tree", "reduce_scatter_gather")


def fits(name: str, nbytes: int, world_size: int) -> bool:
    return name != "recursive_halving" or world_size == 1 or nbytes <= CHUNK_BYTES


def test_every_algorithm_is_covered() -> None:
    # In-process worlds have no shared segment or cross-memory attach: "shm", "pipe" and
    # "cma" run in test_real_processes (and tests/test_onehost_copies.py).
    onehost = ("shm", "pipe", "cma")
    assert _decision.ALGORITHMS["reduce_scatter"] == (*onehost, *SCATTER_ALGORITHMS)
    assert _decision.ALGORITHMS["reduce_scatterv"] == (*onehost, *SCATTER_ALGORITHMS)
    assert _decision.ALGORITHMS["reduce"] == (*onehost, *REDUCE_ALGORITHMS)


@pytest.mark.parametrize(
    ("nbytes", "world_size", "expected"),
    [
        (0, 4, "tree"),
        (_decision.SMALL_REDUCE_BYTES, 3, "tree"),
        (_decision.SMALL_REDUCE_BYTES + 1, 3, "reduce_scatter_gather"),
        (_decision.SMALL_REDUCE_BYTES + 1, 2, "tree"),
        (_decision.SMALL_REDUCE_BYTES + 1, 1, "tree"),
        (64 << 20, 32, "reduce_scatter_gather"),
    ],
)
def test_reduce_decision(nbytes: int, world_size: int, expected: str) -> None:
    assert _decision.reduce(nbytes, world_size) == expected


@pytest.mark.parametrize(
    ("nbytes", "small", "expected"),
    [
        (0, 64, "recursive_halving"),
        (64, 64, "recursive_halving"),
        (65, 64, "ring"),
        (
            _decision.SMALL_REDUCE_SCATTER_BYTES,
            _decision.SMALL_REDUCE_SCATTER_BYTES,
            "recursive_halving",
        ),
    ],
)
def test_reduce_scatter_decision(nbytes: int, small: int, expected: str) -> None:
    assert _decision.reduce_scatter(nbytes, small, -1) == expected
    # The shared segment, where there is one, takes what fits it, whatever the sizes above.
    assert _decision.reduce_scatter(nbytes, small, nbytes) == "shm"
    # What it cannot take goes through its pipe.
    assert _decision.reduce_scatter(nbytes + 1, nbytes + 1, nbytes) == "pipe"


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_the_pipe_and_cross_memory_attach_take_what_the_slots_do_not(world_size: int) -> None:
    """With a shared segment, reduce_scatter and reduce go through its pipe whatever its
    slots do not take, up to PIPE_MAX_REDUCE_BYTES with "cma" and at every size without;
    above, with "cma", they read directly. Without a segment, with "cma", reduce_scatter
    reads directly above CMA_MIN_REDUCE_SCATTER_BYTES, and reduce at world sizes of 3 and
    more above CMA_MIN_COPY_BYTES. Without either, the socket algorithms."""
    small = _decision.SMALL_REDUCE_SCATTER_BYTES
    limit = _decision.CMA_MIN_REDUCE_SCATTER_BYTES
    pipe_max = _decision.PIPE_MAX_REDUCE_BYTES
    segment = 65536
    for cma in (False, True):
        assert _decision.reduce_scatter(segment, small, segment, cma) == "shm"
        assert _decision.reduce_scatter(segment + 1, small, segment, cma) == "pipe"
        assert _decision.reduce_scatter(pipe_max, small, segment, cma) == "pipe"
        assert _decision.reduce(segment, world_size, segment, cma) == "shm"
        assert _decision.reduce(segment + 1, world_size, segment, cma) == "pipe"
        assert _decision.reduce(pipe_max, world_size, segment, cma) == "pipe"
        above = "cma" if cma else "pipe"
        assert _decision.reduce_scatter(pipe_max + 1, small, segment, cma) == above
        assert _decision.reduce(pipe_max + 1, world_size, segment, cma) == above
        assert _decision.reduce(64 << 20, world_size, segment, cma) == above
    assert _decision.reduce_scatter(limit, small, -1, True) == "recursive_halving"
    assert _decision.reduce_scatter(limit + 1, small, -1, True) == "cma"
    assert _decision.reduce_scatter(limit + 1, small, -1, False) == "ring"
    far = world_size >= 3
    assert _decision.reduce(CMA_MIN_COPY_BYTES, world_size, -1, True) == "tree"
    assert _decision.reduce(CMA_MIN_COPY_BYTES + 1, world_size, -1, True) == (
        "cma" if far else "tree"
    )
    assert _decision.reduce(CMA_MIN_COPY_BYTES + 1, world_size, -1, False) == "tree"


def test_reduce_takes_the_segment_where_it_fits() -> None:
    assert _decision.reduce(4096, 4, 4096) == "shm"
    assert _decision.reduce(4097, 4, 4096) == "pipe"
    assert _decision.reduce(0, 4, -1) == "tree"


async def test_communicator_follows_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from trioring._collectives import _reduce

    chosen: list[str] = []
    body = _reduce.reduce_scatter_body

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        chosen.append(name)
        return body(name, *args, **kwargs)

    monkeypatch.setattr(_reduce, "reduce_scatter_body", spy)
    async with open_local_world(3, chunk_bytes=CHUNK_BYTES) as comms:
        await check_reduce_scatter(comms, 0, 2, "float64", "sum")  # 48 bytes
        await check_reduce_scatter(comms, 0, 3, "float64", "sum")  # 72 bytes
        await check_reduce_scatterv(comms, 0, [3, 0, 6], "float64", "sum")
    assert chosen == ["recursive_halving"] * 3 + ["ring"] * 6


async def test_reduce_follows_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unforced, reduce runs the tree up to SMALL_REDUCE_BYTES and reduce-scatter + gather
    above, with the reduce-scatter that fits (recursive halving for one chunk at most)."""
    from trioring._collectives import _reduce

    chosen: list[str] = []
    halving: list[bool] = []
    body = _reduce.reduce_body
    scatter_gather = _reduce._algorithms.reduce_scatter_gather

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        chosen.append(name)
        return body(name, *args, **kwargs)

    async def spy_algorithm(*args: Any, **kwargs: Any) -> None:
        halving.append(kwargs["halving"])
        await scatter_gather(*args, **kwargs)

    monkeypatch.setattr(_reduce, "reduce_body", spy)
    monkeypatch.setattr(_reduce._algorithms, "reduce_scatter_gather", spy_algorithm)
    monkeypatch.setattr(_decision, "SMALL_REDUCE_BYTES", 32)
    async with open_local_world(3, chunk_bytes=CHUNK_BYTES) as comms:
        await check_reduce(comms, 0, 4, "float64", "sum", 0)  # 32 bytes: the tree
        await check_reduce(comms, 0, 8, "float64", "sum", 1)  # 64 bytes: one chunk
        await check_reduce(comms, 0, 9, "float64", "sum", 2)  # over one chunk: the ring
    async with open_local_world(2, chunk_bytes=CHUNK_BYTES) as comms:
        await check_reduce(comms, 0, 9, "float64", "sum", 1)  # world 2: the tree
    assert chosen == ["tree"] * 3 + ["reduce_scatter_gather"] * 6 + ["tree"] * 2
    assert halving == [True] * 3 + [False] * 3


async def test_forced_recursive_halving_refuses_large_arrays_before_io() -> None:
    async with open_local_world(2, chunk_bytes=CHUNK_BYTES) as comms:
        comm = comms[0]
        comm._force_algorithm("reduce_scatter", "recursive_halving")
        comm._force_algorithm("reduce_scatterv", "recursive_halving")
        message = r"at most chunk_bytes \(64\) bytes, not 80"
        with pytest.raises(trioring.InvalidArgumentError, match=message):
            await comm.reduce_scatter(np.zeros(10))
        with pytest.raises(trioring.InvalidArgumentError, match=message):
            await comm.reduce_scatterv(np.zeros(10), counts=[5, 5])
        assert comm.seq == 0
        assert not comm.broken


@pytest.mark.parametrize("world_size", WORLDS)
async def test_every_algorithm_at_every_world_size(world_size: int) -> None:
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in SCATTER_ALGORITHMS:
            force(comms, "reduce_scatter", name)
            force(comms, "reduce_scatterv", name)
            for seed, block in enumerate((0, 1, 37)):
                if fits(name, n * block * 4, n):
                    await check_reduce_scatter(comms, seed, block, "float32", "sum")
            if fits(name, n * 3 * 2, n):
                await check_reduce_scatter(comms, 3, 3, "int16", "max")
            # Uneven, with zeros, one block across chunks, a total below the world size.
            cases = [
                (4, [(i * 7) % 5 for i in range(n)], "float64", "sum"),
                (5, [0] * (n - 1) + [40], "float32", "min"),
                (6, [1 if i % 2 else 0 for i in range(n)], "int32", "prod"),
                (7, [1 if i % 3 == 1 else 0 for i in range(n)], "float64", "max"),
            ]
            for seed, counts, dtype, op in cases:
                if fits(name, sum(counts) * np.dtype(dtype).itemsize, n):
                    await check_reduce_scatterv(comms, seed, counts, dtype, op)
        roots = range(n) if n <= 5 else (0, 1, n // 2, n - 1)
        for name in REDUCE_ALGORITHMS:
            force(comms, "reduce", name)
            for root in roots:
                await check_reduce(comms, root, 37 if root % 2 else n, "float32", "sum", root)
        # Reduce-scatter + gather: empty, below the world size, and one chunk (recursive
        # halving), then across chunks and with blocks of several chunks (the ring).
        for seed, count in enumerate((0, 1, max(n - 1, 1), 16, 17, 5 * n + 3, 40 * n + 1)):
            await check_reduce(comms, seed, count, "float32", "sum", (seed * 5) % n)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
async def test_every_size_dtype_and_op(world_size: int) -> None:
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for d, dtype_name in enumerate(DTYPES):
            dtype = np.dtype(dtype_name)
            per_chunk = CHUNK_BYTES // dtype.itemsize
            ops = ops_for(dtype, bitwise=True)
            for c, count in enumerate((0, 1, n - 1, 2 * n + 1, per_chunk + 1, 3 * per_chunk + 5)):
                op = ops[(c + d) % len(ops)]
                counts = [(count + i) % (per_chunk + 3) for i in range(n)]
                for name in SCATTER_ALGORITHMS:
                    force(comms, "reduce_scatter", name)
                    force(comms, "reduce_scatterv", name)
                    if fits(name, n * count * dtype.itemsize, n):
                        await check_reduce_scatter(comms, c, count, dtype_name, op)
                    if fits(name, sum(counts) * dtype.itemsize, n):
                        await check_reduce_scatterv(comms, c, counts, dtype_name, op)
                # The block sizes that recursive halving takes at CHUNK_BYTES.
                small = [(i + c) % 2 for i in range(n)]
                if sum(small) * dtype.itemsize <= CHUNK_BYTES:
                    await check_reduce_scatterv(comms, c, small, dtype_name, op)
                for name in REDUCE_ALGORITHMS:
                    force(comms, "reduce", name)
                    await check_reduce(comms, c, count, dtype_name, op, (c + d) % n)


# -- order of operations ------------------------------------------------------------------


def ring_order(inputs: list[np.ndarray[Any, Any]], op: str, j: int) -> np.ndarray[Any, Any]:
    """Block j as the ring reduces it: x_j op (x_(j-1) op (... op x_(j+1)))."""
    n = len(inputs)
    ufunc = UFUNCS[op]
    acc = inputs[(j + 1) % n].copy()
    for step in range(2, n + 1):
        acc = ufunc(inputs[(j + step) % n], acc)
    if op == "mean":
        acc = np.divide(acc, n).astype(acc.dtype)
    return acc


def tree_order(inputs: list[np.ndarray[Any, Any]], op: str, root: int) -> np.ndarray[Any, Any]:
    """Root's result as the tree reduces it: own, then children smallest subtree first."""
    n = len(inputs)
    ufunc = UFUNCS[op]

    def partial(rank: int) -> np.ndarray[Any, Any]:
        acc = inputs[rank]
        for child in reversed(tree_neighbours(rank, n, root)[1]):
            acc = ufunc(acc, partial(child))
        return acc

    acc = partial(root)
    if op == "mean":
        acc = np.divide(acc, n).astype(acc.dtype)
    return acc


@pytest.mark.parametrize("world_size", [3, 6, 7])
@pytest.mark.parametrize("op", ["sum", "mean", "prod"])
async def test_float_order_is_documented_and_repeatable(world_size: int, op: str) -> None:
    """Random (not integer-valued) floats: bitwise numpy's result in the documented order,
    and bitwise the same in two runs."""
    n = world_size
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(n * 21).astype(np.float32) for _ in range(n)]
    runs: list[list[bytes]] = []
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, "reduce_scatter", "ring")
        for _ in range(2):
            results: list[Any] = [None] * n
            ys = [x.copy() for x in inputs]

            async def one(
                comm: Communicator, ys: list[Any] = ys, results: list[Any] = results
            ) -> None:
                results[comm.rank] = await comm.reduce_scatter(inputs[comm.rank], op=op)
                await comm.reduce(ys[comm.rank], root=n - 1, op=op)

            await on_every_rank(comms, one)
            blocks = [x.reshape(n, 21) for x in inputs]
            for j in range(n):
                expected = ring_order([b[j] for b in blocks], op, j)
                assert results[j].tobytes() == expected.tobytes(), j
            assert ys[n - 1].tobytes() == tree_order(inputs, op, n - 1).tobytes()
            runs.append([r.tobytes() for r in results] + [ys[n - 1].tobytes()])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("world_size", [2, 3, 4, 6, 7])
@pytest.mark.parametrize("op", ["sum", "mean", "prod"])
@pytest.mark.parametrize("count_per_rank", [2, 21])
async def test_reduce_scatter_gather_order_is_documented_and_repeatable(
    world_size: int, op: str, count_per_rank: int
) -> None:
    """Random floats reduced by reduce-scatter + gather: the root's result is, bitwise,
    block by block, what reduce_scatterv gives for the blocks ``[j m / n, (j+1) m / n)``
    by the same reduce-scatter (recursive halving for one chunk at most, else the ring,
    which numpy recomputes in the documented order); the same for every root, in two runs."""
    n = world_size
    total = n * count_per_rank + 1  # blocks of two sizes
    halving = total * 4 <= CHUNK_BYTES
    bounds = [i * total // n for i in range(n + 1)]
    counts = [bounds[i + 1] - bounds[i] for i in range(n)]
    rng = np.random.default_rng(13)
    inputs = [rng.standard_normal(total).astype(np.float32) for _ in range(n)]
    if op == "prod":
        inputs = [np.abs(x) + 0.5 for x in inputs]
    results: list[bytes] = []
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, "reduce", "reduce_scatter_gather")
        force(comms, "reduce_scatterv", "recursive_halving" if halving else "ring")
        blocks: list[Any] = [None] * n
        for root in (0, n - 1, 0):
            ys = [x.copy() for x in inputs]

            async def one(comm: Communicator, ys: list[Any] = ys, root: int = root) -> None:
                await comm.reduce(ys[comm.rank], root=root, op=op)
                blocks[comm.rank] = await comm.reduce_scatterv(
                    inputs[comm.rank], counts=counts, op=op
                )

            await on_every_rank(comms, one)
            results.append(ys[root].tobytes())
            assert ys[root].tobytes() == np.concatenate(blocks).tobytes(), root
            for r in range(n):
                if r != root:
                    assert ys[r].tobytes() == inputs[r].tobytes()
    assert results[0] == results[1] == results[2]
    if not halving:
        expected = np.concatenate(
            [ring_order([x[bounds[j] : bounds[j + 1]] for x in inputs], op, j) for j in range(n)]
        )
        assert results[0] == expected.tobytes()


@pytest.mark.parametrize("world_size", [3, 4, 6, 7])
async def test_recursive_halving_is_repeatable(world_size: int) -> None:
    """Random floats by recursive halving: bitwise the same in two runs, and within a few
    ulps of numpy's sum (the order differs)."""
    n = world_size
    rng = np.random.default_rng(12)
    inputs = [rng.standard_normal(n * 2).astype(np.float32) for _ in range(n)]
    runs: list[list[bytes]] = []
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, "reduce_scatter", "recursive_halving")
        for _ in range(2):
            results: list[Any] = [None] * n

            async def one(comm: Communicator, results: list[Any] = results) -> None:
                results[comm.rank] = await comm.reduce_scatter(inputs[comm.rank])

            await on_every_rank(comms, one)
            expected = np.sum(np.stack(inputs), axis=0).reshape(n, 2)
            for j in range(n):
                np.testing.assert_allclose(results[j], expected[j], rtol=1e-5, atol=1e-5)
            runs.append([r.tobytes() for r in results])
    assert runs[0] == runs[1]


# -- shapes, out= and input checks ---------------------------------------------------------


async def test_shapes_and_out() -> None:
    n = 3
    async with open_local_world(n) as comms:
        got: dict[int, list[Any]] = {}

        async def one(comm: Communicator) -> None:
            r = comm.rank
            a = await comm.reduce_scatter(np.ones((n, 4, 5), np.float64) * r)
            b = await comm.reduce_scatter(np.arange(n * 4, dtype=np.int32))
            c = await comm.reduce_scatter(np.zeros((2 * n, 2), np.float32))
            out = np.full((2, 2), -1, np.int32)
            d = await comm.reduce_scatter(np.arange(n * 4, dtype=np.int32), out=out)
            e = await comm.reduce_scatterv(np.ones(6, np.int64), counts=(3, 0, 3))
            out_v = np.empty((1, 0 if r == 0 else 3), np.int64)
            f = await comm.reduce_scatterv(np.ones(6, np.int64), counts=[0, 3, 3], out=out_v)
            got[r] = [a, b, c, d is out, d, e, f is out_v, f]

        await on_every_rank(comms, one)
    for r in range(n):
        a, b, c, d_is_out, d, e, f_is_out, f = got[r]
        assert a.shape == (4, 5)
        assert np.all(a == 3.0)
        assert b.shape == (4,)
        assert b.tolist() == [3 * (4 * r + i) for i in range(4)]
        assert c.shape == (4,)
        assert c.dtype == np.float32
        assert d_is_out
        assert d.reshape(-1).tolist() == b.tolist()
        assert e.shape == ((3,) if r != 1 else (0,))
        assert np.all(e == 3)
        assert f_is_out
        assert f.size == (0 if r == 0 else 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.reduce_scatter(np.zeros(7)), "do not split into 3 equal blocks"),
        (lambda c: c.reduce_scatter(np.zeros(6), op="avg"), "unknown op 'avg'"),
        (lambda c: c.reduce_scatter(np.zeros(6, np.int32), op="mean"), "op 'mean' needs"),
        (lambda c: c.reduce_scatter(np.zeros(6), out=np.zeros(2, np.float32)), "dtype float32"),
        (lambda c: c.reduce_scatter(np.zeros(6), out=np.zeros(3)), "has 3 elements"),
        (lambda c: c.reduce_scatter(np.zeros(6), out=np.zeros(4)[::2]), "not C-contiguous"),
        (lambda c: c.reduce_scatter(np.zeros(6), out=[0.0, 0.0]), "out=: expected a numpy.ndarray"),
        (lambda c: c.reduce_scatter(np.zeros(6)[::2].copy()[::-1]), "not C-contiguous"),
        (lambda c: c.reduce_scatterv(np.zeros(4), counts=[1, 1]), "counts has 2 entries"),
        (lambda c: c.reduce_scatterv(np.zeros(4), counts=[1, 1, 1]), "counts sum to 3"),
        (lambda c: c.reduce_scatterv(np.zeros(4), counts=[5, -1, 0]), "non-negative ints"),
        (lambda c: c.reduce_scatterv(np.zeros(4), counts=[2, 2, True]), "non-negative ints"),
        (lambda c: c.reduce_scatterv(np.zeros(4), counts=4), "sequence of 3 ints"),
        (lambda c: c.reduce(np.zeros(4), root=3), "root 3 is not a rank"),
        (lambda c: c.reduce(np.zeros(4, np.complex64), op="max"), "not defined for complex"),
        (lambda c: c.reduce(np.zeros(4).view(np.matrix)), "matrix is not supported"),
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


async def test_read_only_and_overlapping_out_are_refused() -> None:
    async with open_local_world(2) as comms:
        comm = comms[0]
        read_only = np.zeros(3)
        read_only.setflags(write=False)
        x = np.zeros(6)
        for out, message in (
            (read_only, "out=: array is read-only"),
            (x[:3], "overlaps the input"),
        ):
            with pytest.raises(trioring.InvalidArgumentError, match=message):
                await comm.reduce_scatter(x, out=out)
        assert comm.seq == 0
        assert not comm.broken


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.reduce_scatter(np.zeros(0)),
        lambda c: c.reduce_scatter(np.ones(3), op="max"),
        lambda c: c.reduce_scatterv(np.ones(2), counts=[2]),
        lambda c: c.reduce(np.ones(2), op="prod"),
        lambda c: c.reduce(np.zeros(0)),
    ],
)
async def test_world_of_one_checkpoints(call: Callable[[Communicator], Awaitable[Any]]) -> None:
    async with open_local_world(1) as (comm,):
        with trio.testing.assert_checkpoints():
            await call(comm)


async def test_empty_calls_checkpoint_on_every_rank() -> None:
    async with open_local_world(2) as comms:

        async def one(comm: Communicator) -> None:
            with trio.testing.assert_checkpoints():
                await comm.reduce_scatter(np.zeros(0))
            with trio.testing.assert_checkpoints():
                await comm.reduce_scatterv(np.zeros(0), counts=[0, 0])
            with trio.testing.assert_checkpoints():
                await comm.reduce(np.zeros(0), root=1)

        await on_every_rank(comms, one)


# -- the Gloo regressions -------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "prod"])
async def test_gloo_162338_reduce_scatter_honours_the_op(op: str) -> None:
    """pytorch#162338: Gloo's reduce_scatter ignores the op and always sums."""
    n = 4
    async with open_local_world(n) as comms:
        results: list[Any] = [None] * n
        inputs = [np.full((n, 3), float(r + 2)) for r in range(n)]

        async def one(comm: Communicator) -> None:
            results[comm.rank] = await comm.reduce_scatter(inputs[comm.rank], op=op)
            counts = [1, 0, 2, 0]
            v = await comm.reduce_scatterv(inputs[comm.rank][:, 0].copy()[:3], counts=counts, op=op)
            results[comm.rank] = (results[comm.rank], v)

        await on_every_rank(comms, one)
    expected = {"sum": 14.0, "mean": 3.5, "min": 2.0, "max": 5.0, "prod": 120.0}[op]
    for r in range(n):
        block, v = results[r]
        assert block.tolist() == [expected] * 3
        assert v.tolist() == [expected] * [1, 0, 2, 0][r]


@pytest.mark.parametrize("name", REDUCE_ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 4, 7])
async def test_gloo_76527_reduce_leaves_non_root_arrays_unchanged(
    world_size: int, name: str
) -> None:
    """pytorch#76527: Gloo's reduce writes partial sums into non-root buffers. Here, by
    both algorithms (reduce-scatter + gather by recursive halving and by the ring)."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, "reduce", name)
        for root in range(n):
            for op in ("sum", "max"):
                await check_reduce(comms, root, 50, "float64", op, root)
                await check_reduce(comms, root, 7, "float64", op, root)


# -- mismatches -------------------------------------------------------------------------------


#: Counts of six elements by world size: the same total, split two ways.
EVEN = {2: [3, 3], 3: [2, 2, 2]}
UNEVEN = {2: [1, 5], 3: [1, 2, 3]}
MISMATCHES: list[
    tuple[
        str,
        Callable[[Communicator], Awaitable[Any]],
        Callable[[Communicator], Awaitable[Any]],
        tuple[str, ...],
    ]
] = [
    (
        "dtype",
        lambda c: c.reduce_scatter(np.zeros(6, np.float32)),
        lambda c: c.reduce_scatter(np.zeros(6, np.float64)),
        ("reduce_scatter(sum) float32[6]", "reduce_scatter(sum) float64[6]"),
    ),
    (
        "count",
        lambda c: c.reduce_scatter(np.zeros(6)),
        lambda c: c.reduce_scatter(np.zeros(12)),
        ("float64[6]", "float64[12]"),
    ),
    (
        "op",
        lambda c: c.reduce_scatter(np.zeros(6)),
        lambda c: c.reduce_scatter(np.zeros(6), op="max"),
        ("reduce_scatter(sum)", "reduce_scatter(max)"),
    ),
    (
        "kind",
        lambda c: c.reduce_scatter(np.zeros(6)),
        lambda c: c.allreduce(np.zeros(6)),
        ("reduce_scatter(sum) float64[6]", "allreduce(sum) float64[6]"),
    ),
    (
        "counts",
        lambda c: c.reduce_scatterv(np.zeros(6), counts=EVEN[c.world_size]),
        lambda c: c.reduce_scatterv(np.zeros(6), counts=UNEVEN[c.world_size]),
        ("reduce_scatterv(sum, counts #", "float64[6]"),
    ),
    (
        "v-kind",
        lambda c: c.reduce_scatterv(np.zeros(6), counts=EVEN[c.world_size]),
        lambda c: c.reduce_scatter(np.zeros(6)),
        ("reduce_scatterv(sum", "reduce_scatter(sum) float64[6]"),
    ),
    (
        "root",
        lambda c: c.reduce(np.zeros(4), root=0),
        lambda c: c.reduce(np.zeros(4), root=1),
        ("reduce(sum, root=0) float64[4]", "reduce(sum, root=1) float64[4]"),
    ),
    (
        "reduce-op",
        lambda c: c.reduce(np.zeros(4), op="min"),
        lambda c: c.reduce(np.zeros(4), op="max"),
        ("reduce(min, root=0)", "reduce(max, root=0)"),
    ),
    (
        "reduce-kind",
        lambda c: c.reduce(np.zeros(4)),
        lambda c: c.broadcast(np.zeros(4)),
        ("reduce(sum, root=0) float64[4]", "broadcast(root=0) float64[4]"),
    ),
]


@pytest.mark.parametrize("n", [2, 3])
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
    await one_mismatch(n, None, usual, odd, fragments)


REDUCE_MISMATCHES = [m for m in MISMATCHES if m[0] in ("root", "reduce-op", "reduce-kind")]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("name", REDUCE_ALGORITHMS)
@pytest.mark.parametrize(
    ("case", "usual", "odd", "fragments"),
    REDUCE_MISMATCHES,
    ids=[m[0] for m in REDUCE_MISMATCHES],
)
async def test_reduce_mismatch_by_either_algorithm(
    n: int,
    name: str,
    case: str,
    usual: Callable[[Communicator], Awaitable[Any]],
    odd: Callable[[Communicator], Awaitable[Any]],
    fragments: tuple[str, ...],
) -> None:
    """Reduce's mismatches by each algorithm forced: reduce-scatter + gather has no
    agreement round of its own, its first frames carry the root."""
    await one_mismatch(n, name, usual, odd, fragments)


async def one_mismatch(
    n: int,
    name: str | None,
    usual: Callable[[Communicator], Awaitable[Any]],
    odd: Callable[[Communicator], Awaitable[Any]],
    fragments: tuple[str, ...],
) -> None:
    """Rank 1 runs ``odd``, the others ``usual``: every rank raises CollectiveMismatchError
    naming both sides, none hangs."""
    async with open_local_world(n) as comms:
        if name is not None:
            force(comms, "reduce", name)
        errors = await errors_when_one_differs(comms, 1, odd, usual)
    assert sorted(errors) == list(range(n))
    for exc in errors.values():
        assert isinstance(exc, trioring.CollectiveMismatchError), repr(exc)
        assert all(f in str(exc) for f in fragments), str(exc)


# -- real processes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("transport", "world_size"), [("tcp", 4), ("unix", 2), ("unix", 3), ("unix", 4)]
)
def test_real_processes(tmp_path: Path, transport: str, world_size: int) -> None:
    """Every algorithm (over unix, the shared segment's too) against numpy."""
    reports = run_reports(
        WORKER, ["check", str(tmp_path)], tmp_path, world_size, transport=transport
    )
    for report in reports:
        assert report["errors"] == [], report["errors"]


@pytest.mark.parametrize(
    ("collective", "algorithm", "victim"),
    [
        ("reduce_scatter", "ring", 3),
        ("reduce_scatter", "cma", 3),
        ("reduce_scatter", "cma-frames", 3),
        ("reduce", "tree", 2),
        ("reduce", "reduce_scatter_gather", 2),
        ("reduce", "cma", 2),
        ("reduce", "cma-frames", 2),
    ],
)
def test_sigkill_during_the_collective(
    tmp_path: Path, collective: str, algorithm: str, victim: int
) -> None:
    """A rank SIGKILLs itself in the middle of the collective (at its third reduction of a
    chunk; rank 2 has a child in reduce's tree at world 4): every survivor raises promptly,
    none hangs. ``cma-frames``: cross-memory attach without a shared segment."""
    if algorithm.startswith("cma") and not trioring.is_available("cma"):
        pytest.skip("process_vm_readv is not permitted on this machine")
    env = {"TRIORING_SHM": "0"} if algorithm == "cma-frames" else {}
    args = ["kill", str(tmp_path), collective, str(victim), algorithm.removesuffix("-frames")]
    for report in run_killed(WORKER, args, tmp_path, victim, env=env).values():
        assert report["error"] in ("PeerFailedError", "PeerAbortedError"), report
        assert report["elapsed"] < 5.0, report


@pytest.mark.parametrize("world_size", range(2, 10))
@pytest.mark.parametrize("odd_is_large", [True, False])
async def test_sizes_on_both_sides_of_the_table_are_a_mismatch(
    world_size: int, odd_is_large: bool
) -> None:
    """One rank's call is large (the ring) while the others' is small (recursive halving),
    or the other way round: every rank raises, whichever rank is the odd one, and none hangs
    (each algorithm's first frame goes to rank r + 1)."""
    n = world_size
    for odd_rank in range(n):
        errors: dict[int, BaseException] = {}
        async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

            async def one(
                comm: Communicator,
                odd_rank: int = odd_rank,
                errors: dict[int, BaseException] = errors,
            ) -> None:
                large = (comm.rank == odd_rank) == odd_is_large
                try:
                    await comm.reduce_scatter(np.zeros(n * (8 if large else 1)))
                except trioring.TrioringError as exc:
                    errors[comm.rank] = exc

            with trio.fail_after(10):
                await on_every_rank(comms, one)
        assert sorted(errors) == list(range(n)), (odd_rank, errors)
        assert all(isinstance(e, trioring.CollectiveMismatchError) for e in errors.values())


@pytest.mark.parametrize("world_size", range(2, 10))
@pytest.mark.parametrize("odd_is_large", [True, False])
async def test_reduce_sizes_on_both_sides_of_the_table_are_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, world_size: int, odd_is_large: bool
) -> None:
    """As above for reduce: one rank's call runs reduce-scatter + gather while the others
    run the tree (the threshold lowered to 8 bytes), or the other way round, with either
    reduce-scatter (the ring for the large array of 9 float64s, recursive halving for 8)."""
    monkeypatch.setattr(_decision, "SMALL_REDUCE_BYTES", 8)
    n = world_size
    for large_count in (8, 9):
        for odd_rank in range(n):
            errors: dict[int, BaseException] = {}
            async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

                async def one(
                    comm: Communicator,
                    odd_rank: int = odd_rank,
                    errors: dict[int, BaseException] = errors,
                    large_count: int = large_count,
                ) -> None:
                    large = (comm.rank == odd_rank) == odd_is_large
                    try:
                        await comm.reduce(np.zeros(large_count if large else 1), root=n - 1)
                    except trioring.TrioringError as exc:
                        errors[comm.rank] = exc

                with trio.fail_after(10):
                    await on_every_rank(comms, one)
            assert sorted(errors) == list(range(n)), (odd_rank, errors)
            assert all(isinstance(e, trioring.CollectiveMismatchError) for e in errors.values())


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
async def test_unbuffered_streams_do_not_deadlock(world_size: int) -> None:
    """Every algorithm over connections without any buffer (every send waits for its
    receive), across chunks: a send before its receive would deadlock here at once."""
    n = world_size
    async with open_local_world(n, buffered=False, chunk_bytes=CHUNK_BYTES) as comms:
        with trio.fail_after(20):
            for name in SCATTER_ALGORITHMS:
                force(comms, "reduce_scatter", name)
                force(comms, "reduce_scatterv", name)
                block = 37 if name == "ring" else 1
                await check_reduce_scatter(comms, 1, block, "float32", "sum")
                counts = [(i * 5) % 3 for i in range(n)] if name == "ring" else [1] * n
                await check_reduce_scatterv(comms, 2, counts, "float32", "max")
            for name in REDUCE_ALGORITHMS:
                force(comms, "reduce", name)
                await check_reduce(comms, 3, 41, "float32", "sum", n - 1)
                await check_reduce(comms, 4, 3, "float32", "sum", 0)


@pytest.mark.parametrize(
    "collective", ["reduce_scatter", "reduce_scatterv", "reduce", "reduce_scatter_gather"]
)
async def test_cancelling_one_rank_reaches_every_rank(
    collective: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Rank 0 is cancelled inside the call, while waiting for rank 2, which enters late:
    every other rank raises (in this call, or in its next one where the data it needed had
    all arrived), and rank 0's communicator is broken. (Virtual time.)"""
    n = 4
    errors: dict[int, BaseException] = {}
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, "reduce", "reduce_scatter_gather" if collective.endswith("gather") else "tree")

        async def call(comm: Communicator) -> None:
            x = np.ones(n * 40, np.float32)
            if collective == "reduce_scatter":
                await comm.reduce_scatter(x)
            elif collective == "reduce_scatterv":
                await comm.reduce_scatterv(x, counts=[40] * n)
            else:
                await comm.reduce(x, root=1)

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
                    # A rank may finish when everything it needed had arrived before the
                    # cancellation (rank 2, in the ring, from rank 1): its next call raises.
                    await comm.barrier()
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    assert sorted(errors) == [1, 2, 3]
    for exc in errors.values():
        assert isinstance(exc, trioring.PeerAbortedError | trioring.PeerFailedError), repr(exc)


@pytest.mark.parametrize("n", [2, 3])
async def test_a_counts_mismatch_notes_each_ranks_counts(n: int) -> None:
    """The frames carry only a CRC of reduce_scatterv's counts, so each rank's error has a
    note with its own counts (and their CRC, as the message shows it)."""
    errors: dict[int, BaseException] = {}
    async with open_local_world(n) as comms:

        async def one(comm: Communicator) -> None:
            counts = UNEVEN[n] if comm.rank == 1 else EVEN[n]
            try:
                await comm.reduce_scatterv(np.zeros(6), counts=counts)
            except trioring.CollectiveMismatchError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    assert sorted(errors) == list(range(n))
    for rank, exc in errors.items():
        counts = list(UNEVEN[n] if rank == 1 else EVEN[n])
        code = f"#{_reduce.counts_code(counts):08x}"
        assert getattr(exc, "__notes__", []) == [f"rank {rank}'s counts: {counts} ({code})"]
        # The message gives the CRCs of both sides of the mismatch, this rank's among them.
        assert f"counts {code}" in str(exc), str(exc)
