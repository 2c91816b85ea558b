"""Allgather and allgatherv: every algorithm forced at every world size that matters (recursive
doubling at the powers of two, and refused before any I/O at the others), the
sizes and dtypes that break things, ``out=``, the checks before any I/O, mismatches on every
rank, real processes over TCP and Unix, a SIGKILL mid-collective, and the Gloo regressions
named in issue 15 (pytorch#85234: empty inputs to allgather crash; pytorch#156627: uneven
allgather refused).

Inputs are integer-valued (from a seeded generator) and results are checked against numpy
and compared bitwise across ranks; a NaN-payload test checks that only copies happen.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from exact_inputs import make as exact
from local_runs import errors_when_one_differs, force as force_on, on_every_rank
from trioring._collectives import _decision
from trioring._collectives._decision import SMALL_ALLGATHER_BYTES, SMALL_POW2_ALLGATHER_BYTES
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from conftest import Worlds
    from trioring import Communicator

WORLDS = [*range(1, 18), 24, 27, 32]
#: Small chunks, so that modest arrays cross chunk boundaries.
CHUNK_BYTES = 64
ALGORITHMS = ("bruck", "recursive_doubling", "ring")
FAMILIES = ("allgather", "allgatherv")
DTYPES = ("float64", "float32", "float16", "int8", "int32", "uint16", "int64", "complex64")
WORKER = "allgather_worker.py"


def make(seed: int, rank: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    return exact(seed, rank, int(np.prod(shape)), dtype, "sum").reshape(shape)


def force(comms: list[Communicator], name: str | None) -> None:
    force_on(comms, FAMILIES, name)


def runs(name: str | None, world_size: int) -> bool:
    """Whether the algorithm ``name`` (None: the table's) runs at ``world_size``."""
    return name != "recursive_doubling" or world_size & (world_size - 1) == 0


def algorithms_at(world_size: int) -> list[str]:
    return [name for name in ALGORITHMS if runs(name, world_size)]


async def check_allgather(
    comms: list[Communicator], seed: int, shape: tuple[int, ...], dtype_name: str, *, out: bool
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, shape, dtype) for r in range(n)]
    given = [np.full(n * inputs[0].size, 99, dtype) for _ in range(n)]
    results: dict[int, np.ndarray] = {}

    async def one(comm: Communicator) -> None:
        if out:
            results[comm.rank] = await comm.allgather(inputs[comm.rank], out=given[comm.rank])
            assert results[comm.rank] is given[comm.rank]
        else:
            results[comm.rank] = await comm.allgather(inputs[comm.rank])

    await on_every_rank(comms, one)
    expected = np.stack(inputs)
    what = f"allgather {dtype}{list(shape)} at world {n}, out={out}"
    for r in range(n):
        got = results[r]
        if out:
            assert np.array_equal(got.reshape(expected.shape), expected), what
        else:
            assert got.shape == (n, *shape), what
            assert np.array_equal(got, expected), what
        assert got.tobytes() == results[0].tobytes(), what


async def check_allgatherv(
    comms: list[Communicator],
    seed: int,
    rows: list[int],
    trailing: tuple[int, ...],
    dtype_name: str,
    *,
    out: bool,
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, (rows[r], *trailing), dtype) for r in range(n)]
    total = sum(a.size for a in inputs)
    given = [np.full(total, 99, dtype) for _ in range(n)]
    results: dict[int, list[np.ndarray]] = {}

    async def one(comm: Communicator) -> None:
        x = inputs[comm.rank]
        if out:
            results[comm.rank] = await comm.allgatherv(x, out=given[comm.rank])
        else:
            results[comm.rank] = await comm.allgatherv(x)

    await on_every_rank(comms, one)
    what = f"allgatherv {dtype}{rows}x{list(trailing)} at world {n}, out={out}"
    for r in range(n):
        parts = results[r]
        assert len(parts) == n, what
        for i in range(n):
            assert parts[i].shape == inputs[i].shape, what
            assert parts[i].dtype == dtype, what
            assert np.array_equal(parts[i], inputs[i]), what
            assert parts[i].tobytes() == results[0][i].tobytes(), what
        if out:
            assert all(np.shares_memory(p, given[r]) for p in parts if p.size), what
            assert np.array_equal(given[r], np.concatenate([a.reshape(-1) for a in inputs])), what


def uneven(n: int, seed: int) -> list[int]:
    """Row counts: 0 on some ranks, uneven on the others."""
    rng = np.random.default_rng(seed)
    return [int(v) for v in rng.integers(0, 5, n)]


def test_every_algorithm_is_covered() -> None:
    """Every algorithm that runs over sockets is forced here; the one-host ones (tested in
    real processes, tests/test_onehost_copies.py) are the rest."""
    assert _decision.ALGORITHMS["allgather"] == ("shm", "pipe", "cma", *ALGORITHMS)
    assert _decision.ALGORITHMS["allgatherv"] == ("pipe", "cma", *ALGORITHMS)


@pytest.mark.parametrize(
    ("nbytes", "world_size", "expected"),
    [
        (0, 3, "bruck"),
        (SMALL_ALLGATHER_BYTES, 3, "bruck"),
        (SMALL_ALLGATHER_BYTES + 1, 3, "ring"),
        (SMALL_ALLGATHER_BYTES + 1, 24, "ring"),
        (0, 1, "recursive_doubling"),
        (0, 2, "recursive_doubling"),
        (SMALL_POW2_ALLGATHER_BYTES, 32, "recursive_doubling"),
        (SMALL_POW2_ALLGATHER_BYTES + 1, 4, "ring"),
        (SMALL_ALLGATHER_BYTES, 6, "bruck"),
    ],
)
def test_decision(nbytes: int, world_size: int, expected: str) -> None:
    assert _decision.allgather(nbytes, world_size) == expected
    # Cross-memory attach, when agreed, above CMA_MIN_COPY_BYTES; the shared segment
    # whenever the caller says it takes the blocks.
    cma = "cma" if nbytes > _decision.CMA_MIN_COPY_BYTES else expected
    assert _decision.allgather(nbytes, world_size, (False, True)) == cma
    assert _decision.allgather(nbytes, world_size, (True, True)) == "shm"
    # With a segment that cannot take the blocks, its pipe: at any size without
    # cross-memory attach; with it, from world 3 up to PIPE_MAX_ALLGATHER_BYTES, and
    # cross-memory attach otherwise (at world 2 whatever the slots cannot take).
    assert _decision.allgather(nbytes, world_size, (False, False), segment=True) == "pipe"
    small = world_size >= 3 and nbytes <= _decision.PIPE_MAX_ALLGATHER_BYTES
    pipe_or_cma = "pipe" if small else "cma"
    assert _decision.allgather(nbytes, world_size, (False, True), segment=True) == pipe_or_cma
    assert _decision.allgather(nbytes, 2, (False, True), segment=True) == "cma"
    big = _decision.PIPE_MAX_ALLGATHER_BYTES + 1
    assert _decision.allgather(big, world_size, (False, True), segment=True) == "cma"
    assert _decision.allgather(big, world_size, (False, False), segment=True) == "pipe"


@pytest.mark.parametrize(
    ("limit", "cases"),
    [
        # Intel's: the pipe up to 2 MiB gathered in all from world 3, cma above.
        (2 << 20, [(3, 2 << 20, "pipe"), (4, (2 << 20) + 64, "cma"), (2, 1 << 20, "cma")]),
        # Elsewhere (the EPYC machine's): up to 8 MiB.
        (8 << 20, [(3, 4 << 20, "pipe"), (8, 8 << 20, "pipe"), (4, 16 << 20, "cma")]),
    ],
)
def test_the_pipe_takes_allgathers_from_world_3_up_to_its_limit(
    monkeypatch: pytest.MonkeyPatch, limit: int, cases: list[tuple[int, int, str]]
) -> None:
    monkeypatch.setattr(_decision, "PIPE_MAX_ALLGATHER_BYTES", limit)
    for world_size, nbytes, expected in cases:
        assert _decision.allgather(nbytes, world_size, (False, True), segment=True) == expected
        assert _decision.allgather(nbytes, world_size, (False, False), segment=True) == "pipe"


@pytest.mark.parametrize(("world_size", "expected"), [(3, "bruck"), (4, "recursive_doubling")])
async def test_communicator_follows_the_table(
    monkeypatch: pytest.MonkeyPatch, world_size: int, expected: str
) -> None:
    """Unforced, both collectives run what the table says (a small and a large call, the
    limits lowered: SMALL_ALLGATHER_BYTES to 64, SMALL_POW2_ALLGATHER_BYTES to 128)."""
    from trioring._collectives import _allgather

    chosen: list[tuple[int, int, str]] = []
    decide = _allgather.decide

    def spy(nbytes: int, n: int, onehost: tuple[bool, bool], *, segment: bool) -> str:
        # A local world has no one-host paths.
        assert onehost == (False, False)
        assert not segment
        name = decide(nbytes, n, onehost, segment=segment)
        chosen.append((nbytes, n, name))
        return name

    monkeypatch.setattr(_decision, "SMALL_ALLGATHER_BYTES", 64)
    monkeypatch.setattr(_decision, "SMALL_POW2_ALLGATHER_BYTES", 128)
    monkeypatch.setattr(_allgather, "decide", spy)
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        await check_allgather(comms, 0, (2,), "float64", out=False)  # 16 n bytes
        await check_allgather(comms, 0, (20,), "float64", out=False)  # 160 n bytes
        await check_allgatherv(comms, 0, [1] * n, (), "float64", out=False)
    assert [name for _, _, name in chosen] == [expected] * n + ["ring"] * n + [expected] * n


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world_size", [n for n in WORLDS if n & (n - 1)])
async def test_forced_recursive_doubling_refuses_other_world_sizes(
    family: str, world_size: int
) -> None:
    """Recursive doubling forced at a world size that is not a power of two: refused
    before any I/O (on the one rank that calls), the communicator still usable."""
    async with open_local_world(world_size) as comms:
        force(comms, "recursive_doubling")
        comm = comms[0]
        call = comm.allgather if family == "allgather" else comm.allgatherv
        message = rf"'recursive_doubling' needs a power-of-two world size, not {world_size}"
        with pytest.raises(trioring.InvalidArgumentError, match=message) as info:
            await call(np.zeros(3))
        assert info.value.collective == family
        assert comm.seq == 0
        assert not comm.broken
        force(comms, None)
        await check_allgather(comms, 0, (3,), "float32", out=False)


@pytest.mark.parametrize("world_size", WORLDS)
async def test_every_algorithm_at_every_world_size(world_size: int) -> None:
    """Each algorithm of both collectives: a size below the world size and one across
    chunks, then uneven rows (some empty) with a trailing shape."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in algorithms_at(n):
            force(comms, name)
            await check_allgather(comms, 1, (max(n - 1, 1),), "float32", out=False)
            await check_allgather(comms, 2, (37,), "int16", out=n % 2 == 0)
            await check_allgatherv(comms, 3, uneven(n, n), (3,), "float64", out=n % 2 == 1)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
async def test_every_size_and_dtype(world_size: int) -> None:
    """Sizes 0, 1, below the world size, odd, and across one and several chunk boundaries,
    in a spread of dtypes, with and without ``out=``, by both algorithms; the table's own
    choice too."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in (*algorithms_at(n), None):
            force(comms, name)
            for d, dtype_name in enumerate(DTYPES):
                per_chunk = CHUNK_BYTES // np.dtype(dtype_name).itemsize
                counts = (0, 1, n - 1, 2 * n + 1, per_chunk, per_chunk + 1, 3 * per_chunk + 5)
                for c, count in enumerate(counts):
                    await check_allgather(comms, c, (count,), dtype_name, out=(c + d) % 2 == 0)
                rows = [(r * 7 + d) % (per_chunk + 3) for r in range(n)]
                await check_allgatherv(comms, d, rows, (), dtype_name, out=d % 2 == 0)
            await check_allgather(comms, 9, (2, 3, 5), "float32", out=False)
            await check_allgatherv(comms, 9, [1] * n, (2, 3), "int32", out=True)
            await check_allgatherv(comms, 10, uneven(n, 10), (0,), "float32", out=False)


@pytest.mark.parametrize("world_size", [2, 3, 4, 7, 8])
async def test_unbuffered_streams_do_not_deadlock(world_size: int) -> None:
    """Over connections without any buffer (every send waits for its receive), each
    algorithm finishes: no rank waits for its own send before it receives."""
    n = world_size
    async with open_local_world(n, buffered=False, chunk_bytes=CHUNK_BYTES) as comms:
        for name in algorithms_at(n):
            force(comms, name)
            with trio.fail_after(10):
                await check_allgather(comms, 1, (3 * n + 1,), "float64", out=False)
                await check_allgatherv(comms, 2, [r * 5 for r in range(n)], (2,), "int32", out=True)


async def test_issue_example_code() -> None:
    """The lines of issue 15's example for these two collectives, at worlds 1 to 4."""
    for n in range(1, 5):
        async with open_local_world(n) as comms:

            async def one(comm: Communicator) -> None:
                n, r = comm.world_size, comm.rank
                x = np.arange(6, dtype=np.float32) + r
                g = await comm.allgather(x)
                assert g.shape == (n, 6)
                assert all(np.array_equal(g[i], np.arange(6) + i) for i in range(n))
                assert await comm.allgather(x, out=g) is g
                parts = await comm.allgatherv(x[: r + 1])
                assert len(parts) == n
                assert all(np.array_equal(parts[i], (np.arange(6) + i)[: i + 1]) for i in range(n))

            await on_every_rank(comms, one)


async def test_results_are_copies_bitwise() -> None:
    """Random bytes as float64 (NaNs with payloads, negative zeros, denormals): every rank
    holds bitwise every rank's input, by both algorithms."""
    for n in (4, 5):
        await _copies_bitwise(n)


async def _copies_bitwise(n: int) -> None:
    inputs = [np.random.default_rng(r).bytes(8 * 41) for r in range(n)]
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in algorithms_at(n):
            force(comms, name)
            got: dict[int, bytes] = {}

            async def one(comm: Communicator, got: dict[int, bytes] = got) -> None:
                x = np.frombuffer(inputs[comm.rank], np.float64)  # read-only input
                g = await comm.allgather(x)
                parts = await comm.allgatherv(x[: comm.rank * 3])
                got[comm.rank] = g.tobytes() + b"".join(p.tobytes() for p in parts)

            await on_every_rank(comms, one)
            expected = b"".join(inputs) + b"".join(inputs[r][: r * 3 * 8] for r in range(n))
            assert all(got[r] == expected for r in range(n))


async def test_in_place_block_of_out() -> None:
    """``x`` may be this rank's block of ``out`` (in place)."""
    n = 3
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        buffers = [np.zeros((n, 20), np.int64) for _ in range(n)]
        for r in range(n):
            buffers[r][r] = np.arange(20) * (r + 1)

        async def one(comm: Communicator) -> None:
            g = buffers[comm.rank]
            assert await comm.allgather(g[comm.rank], out=g) is g

        await on_every_rank(comms, one)
        expected = np.stack([np.arange(20) * (r + 1) for r in range(n)])
        assert all(np.array_equal(b, expected) for b in buffers)


# -- Gloo regressions --------------------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHMS)
async def test_empty_inputs_pytorch_85234(name: str) -> None:
    """pytorch#85234: empty inputs to Gloo's allgather crash. Here: size 0 on every rank,
    and (allgatherv) on some ranks, at world 4, by both algorithms."""
    async with open_local_world(4, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, name)
        await check_allgather(comms, 0, (0,), "float32", out=False)
        await check_allgather(comms, 0, (3, 0), "float32", out=True)
        await check_allgatherv(comms, 0, [0, 0, 0, 0], (), "float32", out=False)
        await check_allgatherv(comms, 0, [0, 2, 0, 1], (2,), "float32", out=True)


@pytest.mark.parametrize("name", ALGORITHMS)
async def test_uneven_sizes_pytorch_156627(name: str) -> None:
    """pytorch#156627: Gloo refuses allgather of uneven sizes. Here allgatherv takes them,
    the sizes found by trioring, across chunk boundaries."""
    async with open_local_world(4, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, name)
        await check_allgatherv(comms, 1, [1, 100, 17, 0], (), "float32", out=False)
        await check_allgatherv(comms, 2, [5, 0, 33, 2], (3,), "int8", out=True)


# -- checks before I/O, checkpoints -------------------------------------------------------


BAD_ALLGATHER: list[tuple[Callable[[int], dict[str, Any]], str]] = [
    (lambda n: {"x": [1.0, 2.0]}, "expected a numpy.ndarray"),
    (lambda n: {"x": np.zeros((4, 4))[:, 0]}, "not C-contiguous"),
    (lambda n: {"x": np.zeros(3, np.float32), "out": np.zeros(3 * n, np.float64)}, "dtype"),
    (lambda n: {"x": np.zeros(3, np.float32), "out": np.zeros(3 * n + 1, np.float32)}, "holds"),
    (
        lambda n: {"x": np.zeros(3, np.float32), "out": np.zeros((3 * n, 2), np.float32)[:, 0]},
        "out=: array is not C-contiguous",
    ),
    (
        lambda n: {"x": np.zeros(3, np.float32), "out": np.zeros(3 * n, np.float32)[::-1]},
        "C-contiguous",
    ),
]


@pytest.mark.parametrize(("args", "fragment"), BAD_ALLGATHER)
async def test_allgather_refuses_before_io(
    args: Callable[[int], dict[str, Any]], fragment: str
) -> None:
    async with open_local_world(2) as comms:
        comm = comms[0]
        kwargs = args(2)
        with pytest.raises(trioring.InvalidArgumentError, match=fragment):
            await comm.allgather(kwargs.pop("x"), **kwargs)
        assert comm.seq == 0
        assert not comm.broken
        await check_allgather(comms, 0, (3,), "float32", out=False)


async def test_refusals_before_io() -> None:
    async with open_local_world(2) as comms:
        comm = comms[0]
        readonly = np.zeros(8, np.float32)
        readonly.flags.writeable = False
        out = np.zeros(8, np.float32)
        cases: list[tuple[Callable[[], Awaitable[object]], str]] = [
            (lambda: comm.allgather(np.zeros(4, np.float32), out=readonly), "out=: .*read-only"),
            (lambda: comm.allgather(out[4:], out=out), "overlaps"),
            (lambda: comm.allgather(out[1:5], out=out), "overlaps"),
            (lambda: comm.allgatherv(np.array(1, np.float32)), "at least one dimension"),
            (lambda: comm.allgatherv(out[:2], out=out), "overlaps"),
            (lambda: comm.allgatherv(np.zeros(2, np.int8), out=out), "dtype"),
            (lambda: comm.allgatherv(np.zeros(2, ">f4")), "native byte order"),
        ]
        for call, fragment in cases:
            with pytest.raises(trioring.InvalidArgumentError, match=fragment):
                await call()
        assert comm.seq == 0
        assert not comm.broken
    async with open_local_world(1) as (only,):
        with pytest.raises(trioring.InvalidArgumentError, match="world of one"):
            await only.allgatherv(np.zeros(3), out=np.zeros(4))


async def test_checkpoints() -> None:
    """Every path is a checkpoint: a world of one, size 0."""
    async with open_local_world(1) as (comm,):
        with trio.testing.assert_checkpoints():
            g = await comm.allgather(np.arange(3))
        assert g.shape == (1, 3)
        with trio.testing.assert_checkpoints():
            parts = await comm.allgatherv(np.arange(6).reshape(3, 2))
        assert len(parts) == 1
        assert np.array_equal(parts[0], np.arange(6).reshape(3, 2))
        with trio.testing.assert_checkpoints():
            await comm.allgather(np.zeros(0), out=np.zeros(0))
        out = np.zeros(0)
        with trio.testing.assert_checkpoints():
            parts = await comm.allgatherv(np.zeros((0, 4)), out=out)
        assert parts[0].shape == (0, 4)
    async with open_local_world(2) as comms:
        with trio.testing.assert_checkpoints():
            await on_every_rank(comms, lambda c: c.allgather(np.zeros(0)))


# -- mismatches ---------------------------------------------------------------------------


def _odd_calls() -> list[Any]:
    x = np.zeros(6, np.float32)
    return [
        pytest.param(
            lambda c: c.allgather(x),
            lambda c: c.allgather(x.astype(np.float64)),
            ("allgather float32[6]", "allgather float64[6]"),
            id="allgather-dtype",
        ),
        pytest.param(
            lambda c: c.allgather(x),
            lambda c: c.allgather(x[:5]),
            ("allgather float32[6]", "allgather float32[5]"),
            id="allgather-count",
        ),
        pytest.param(
            lambda c: c.allgather(x),
            lambda c: c.allreduce(x),
            ("allgather", "allreduce(sum)"),
            id="allgather-kind",
        ),
        pytest.param(
            lambda c: c.allgather(x),
            lambda c: c.allgatherv(x),
            ("allgather", "allgatherv"),
            id="allgather-allgatherv",
        ),
        pytest.param(
            lambda c: c.allgatherv(x[: c.rank]),
            lambda c: c.allgatherv(x[:2].astype(np.int32)),
            ("allgatherv float32", "allgatherv int32"),
            id="allgatherv-dtype",
        ),
        pytest.param(
            lambda c: c.allgatherv(x[: c.rank]),
            lambda c: c.allgatherv(x.reshape(2, 3)),
            ("allgatherv float32", "allgatherv float32"),
            id="allgatherv-ndim",
        ),
        pytest.param(
            lambda c: c.allgatherv(x.reshape(3, 2)),
            lambda c: c.barrier(),
            ("allgatherv", "barrier"),
            id="allgatherv-kind",
        ),
    ]


@pytest.mark.parametrize(("n", "name"), [(n, name) for n in (2, 3, 4) for name in algorithms_at(n)])
@pytest.mark.parametrize(("good", "odd", "fragments"), _odd_calls())
async def test_mismatch_raises_everywhere(
    n: int,
    name: str,
    good: Callable[[Communicator], Awaitable[object]],
    odd: Callable[[Communicator], Awaitable[object]],
    fragments: tuple[str, str],
) -> None:
    """Rank 1 differs; every rank raises (nobody hangs), the ranks that compared frames
    with it raise CollectiveMismatchError naming both sides (at world 2: both)."""
    async with open_local_world(n) as comms:
        force(comms, name)
        errors = await errors_when_one_differs(comms, 1, odd, good)
    assert sorted(errors) == list(range(n))
    mismatches = [e for e in errors.values() if isinstance(e, trioring.CollectiveMismatchError)]
    assert mismatches
    if n == 2:
        assert len(mismatches) == 2
    for exc in mismatches:
        assert all(f in str(exc) for f in fragments), str(exc)


@pytest.mark.parametrize("world_size", range(2, 10))
@pytest.mark.parametrize("odd_is_large", [True, False])
async def test_sizes_on_both_sides_of_the_table_are_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, world_size: int, odd_is_large: bool
) -> None:
    """One rank's allgather is large (the ring) while the others' is small (recursive
    doubling at a power of two, else Bruck), or the other way round, and also Bruck
    against recursive doubling: every rank raises, whichever rank is the odd one, and none
    hangs. (The limits lowered: SMALL_POW2_ALLGATHER_BYTES to 8 bytes per rank,
    SMALL_ALLGATHER_BYTES to 16.)"""
    n = world_size
    monkeypatch.setattr(_decision, "SMALL_POW2_ALLGATHER_BYTES", 8 * n)
    monkeypatch.setattr(_decision, "SMALL_ALLGATHER_BYTES", 16 * n)
    for small, large in ((1, 3), (1, 2), (2, 3)):  # float64s per rank
        for odd_rank in range(n):
            errors: dict[int, BaseException] = {}
            async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

                async def one(
                    comm: Communicator,
                    odd_rank: int = odd_rank,
                    errors: dict[int, BaseException] = errors,
                    sizes: tuple[int, int] = (small, large),
                ) -> None:
                    is_large = (comm.rank == odd_rank) == odd_is_large
                    try:
                        await comm.allgather(np.zeros(sizes[is_large]))
                    except trioring.TrioringError as exc:
                        errors[comm.rank] = exc

                with trio.fail_after(10):
                    await on_every_rank(comms, one)
            assert sorted(errors) == list(range(n)), (small, large, odd_rank, errors)
            assert all(isinstance(e, trioring.CollectiveError) for e in errors.values())


@pytest.mark.parametrize("n", [2, 4])
async def test_allgatherv_shape_and_out_mismatch_on_every_rank(n: int) -> None:
    """Trailing shapes that differ, or one rank's ``out=`` of the wrong size, are seen by
    every rank in the exchanged counts: every rank raises CollectiveMismatchError naming
    itself and the rank that differs (rank 1, whose ``out=`` is wrong, names itself twice:
    its call and its ``out=``)."""
    for case in ("trailing", "out"):
        errors: dict[int, BaseException] = {}
        async with open_local_world(n) as comms:

            async def one(
                comm: Communicator, case: str = case, errors: dict[int, BaseException] = errors
            ) -> None:
                r = comm.rank
                try:
                    if case == "trailing":
                        await comm.allgatherv(np.zeros((r, 3 if r != 1 else 4), np.float32))
                    else:
                        total = n * 2
                        out = np.zeros(total + (1 if r == 1 else 0), np.float32)
                        await comm.allgatherv(np.zeros(2, np.float32), out=out)
                except trioring.CollectiveError as error:
                    errors[comm.rank] = error

            with trio.fail_after(10):
                await on_every_rank(comms, one)
        assert sorted(errors) == list(range(n)), case
        for r, exc in errors.items():
            assert isinstance(exc, trioring.CollectiveMismatchError), (case, exc)
            other = 0 if r == 1 else 1
            text = str(exc)
            assert f"rank {r}: allgatherv float32" in text, text
            if case == "trailing":
                # Named by their trailing shapes: the rows may differ by rank.
                theirs = f"allgatherv float32[rows, {3 if other != 1 else 4}] #1"
                assert f"rank {other}: {theirs}" in text, text
                assert exc.calls == {
                    r: f"allgatherv float32[rows, {3 if r != 1 else 4}] #1",
                    other: theirs,
                }, exc.calls
            else:
                assert f"rank 1: out= holds {n * 2 + 1} elements" in text, text
                assert exc.calls == {}, exc.calls  # not about the calls themselves
        for comm in comms:
            assert comm.broken


# -- real processes -----------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "n"), [("tcp", 3), ("unix-dir", 3), ("unix-dir", 4)])
def test_real_processes(worlds: Worlds, mode: str, n: int) -> None:
    """Every algorithm of both collectives that runs at world 3 and 4 (recursive doubling),
    checked in each worker against numpy and across ranks by digests, over TCP and over
    Unix sockets."""
    world = worlds.start(WORKER, "check", world_size=n, mode=mode)
    reports = world.finish()
    for report in reports:
        assert report["errors"] == [], report
    assert len({report["digest"] for report in reports}) == 1


def test_sigkill_during_allgather(worlds: Worlds) -> None:
    """SIGKILL rank 2 while ranks 0, 1 and 2 are inside a large ring allgather at world 4;
    rank 3 enters only after the kill, so the collective cannot complete without rank 2.
    Every survivor raises a CollectiveError promptly (never hangs), and its next call
    raises CommunicatorBrokenError."""
    n, victim, gated = 4, 2, 3
    world = worlds.start(WORKER, "kill", world_size=n, mode="unix-dir", args=[str(gated)])
    world.wait_for("entering", [r for r in range(n) if r != gated])
    killed = world.workers[victim]
    killed.popen.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    (world.out_dir / "gate").touch()
    survivors = [r for r in range(n) if r != victim]
    for report in world.finish(survivors):
        steps = report["steps"]
        assert steps["agreed"]["error"] is None, steps
        error = steps["allgather"]["error"]
        assert error is not None, steps
        assert "CollectiveError" in error["mro"], error
        assert steps["after"]["error"]["type"] == "CommunicatorBrokenError", steps


@pytest.mark.parametrize("family", FAMILIES)
def test_cancel_one_ranks_call(worlds: Worlds, family: str) -> None:
    """Rank 0's deadline cancels its call while ranks 1 and 2 wait (for rank 3, which
    enters only afterwards): they raise PeerAbortedError naming rank 0, promptly, and rank 3
    raises a CollectiveError when it comes."""
    n = 4
    world = worlds.start(WORKER, "cancel", world_size=n, mode="unix-dir", args=[family])
    world.wait_for("reported", [0, 1, 2])
    (world.out_dir / "gate").touch()
    reports = world.finish()
    assert reports[0]["steps"]["call"]["cancelled"] is True, reports[0]
    for r in (1, 2):
        error = reports[r]["steps"]["call"]["error"]
        assert error is not None, reports[r]
        assert error["type"] == "PeerAbortedError", error
        assert error["peer"] == 0, error
        assert reports[r]["steps"]["call"]["elapsed"] < 5, reports[r]
    assert "CollectiveError" in reports[3]["steps"]["call"]["error"]["mro"], reports[3]
