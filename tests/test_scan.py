"""Scan and exscan (issue 15): inclusive and exclusive prefix reductions by recursive
doubling, and through the shared segment on one host in the same order of operations.

At worlds 1-17, 24, 27 and 32 over in-memory streams with small chunks; sizes 0, 1, odd and
across chunk boundaries; every dtype (bool, float16 and complex included) with every op it
takes, on inputs exact in any order, against numpy's accumulate over the ranks; random floats
bitwise against numpy computing the documented order of operations (and two runs bitwise the
same); exscan's identity on rank 0; mismatches (dtype, count, op, scan against exscan) on
every rank; bad arguments refused before any I/O; checkpoints; unbuffered streams; one rank
cancelled; real processes over tcp and unix at worlds 1-5; a rank SIGKILLed in the middle;
a Hypothesis property.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import trioring
from exact_inputs import UFUNCS, make, ops_for
from launched import run_killed, run_reports
from local_runs import force, on_every_rank
from trioring._collectives import _decision
from trioring._onehost._shm import SHM_MAX_BYTES
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from trioring import Communicator

WORLDS = [*range(1, 18), 24, 27, 32]
#: 16 float32s per chunk: modest arrays cross chunk boundaries.
CHUNK_BYTES = 64
DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
KINDS = ("scan", "exscan")
WORKER = Path(__file__).parent / "workers" / "scan_worker.py"


def scan_ops(dtype: np.dtype[Any]) -> tuple[str, ...]:
    """Every op scan takes for ``dtype``: allreduce's, less mean."""
    return tuple(op for op in ops_for(dtype, bitwise=True) if op != "mean")


def identity(dtype: np.dtype[Any], op: str, count: int) -> np.ndarray[Any, Any]:
    """What exscan leaves on rank 0, as the contract states it."""
    if op in ("sum", "bor", "bxor"):
        return np.zeros(count, dtype)
    if op == "prod":
        return np.ones(count, dtype)
    if op == "band":
        return np.full(count, True if dtype.kind == "b" else -1).astype(dtype)
    if dtype.kind == "b":
        return np.full(count, op == "min", dtype)
    if dtype.kind == "f":
        return np.full(count, np.inf if op == "min" else -np.inf, dtype)
    info = np.iinfo(dtype)
    return np.full(count, info.max if op == "min" else info.min, dtype)


def expected_prefixes(
    inputs: Sequence[np.ndarray[Any, Any]], op: str, kind: str
) -> list[np.ndarray[Any, Any]]:
    """Every rank's result by numpy: the accumulate over the ranks, shifted by one rank for
    exscan (whose rank 0 gets the identity)."""
    dtype, count = inputs[0].dtype, inputs[0].shape[0]
    with np.errstate(all="ignore"):
        accumulated = UFUNCS[op].accumulate(np.stack(inputs), axis=0, dtype=dtype)
    if kind == "scan":
        return list(accumulated)
    return [identity(dtype, op, count), *accumulated[:-1]]


async def check_scan(
    comms: list[Communicator], seed: int, count: int, dtype_name: str, op: str, kind: str
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, count, dtype, op) for r in range(n)]
    arrays = [a.copy() for a in inputs]

    async def one(comm: Communicator) -> None:
        await getattr(comm, kind)(arrays[comm.rank], op=op)

    await on_every_rank(comms, one)
    what = f"{kind} {dtype}[{count}] {op} at world {n}"
    for r, expected in enumerate(expected_prefixes(inputs, op, kind)):
        assert arrays[r].dtype == dtype, what
        assert np.array_equal(arrays[r], expected), (what, r, arrays[r], expected)


def test_the_table_takes_the_segment_for_what_fits_a_slot() -> None:
    """Recursive doubling, except through the shared segment for arrays that fit a slot."""
    assert _decision.ALGORITHMS["scan"] == ("recursive_doubling", "shm")
    assert _decision.ALGORITHMS["exscan"] == ("recursive_doubling", "shm")
    assert _decision.scan(4, shm=False) == "recursive_doubling"
    assert _decision.scan(4, shm=True) == "shm"
    assert _decision.scan(SHM_MAX_BYTES, shm=True) == "shm"
    assert _decision.scan(SHM_MAX_BYTES + 1, shm=True) == "recursive_doubling"


@pytest.mark.parametrize("world_size", WORLDS)
async def test_every_world_size(world_size: int) -> None:
    """Sizes 0, 1 and across chunks, in four dtype groups, forced as the table would."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        force(comms, KINDS, "recursive_doubling")
        for kind in KINDS:
            for seed, count in enumerate((0, 1, 37)):
                await check_scan(comms, seed, count, "float32", "sum", kind)
            await check_scan(comms, 3, 5, "int16", "max", kind)
            await check_scan(comms, 4, 70, "bool", "bor", kind)  # 70 bools: two chunks
            await check_scan(comms, 5, n, "uint8", "bxor", kind)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
async def test_every_dtype_op_and_size(world_size: int) -> None:
    """Every dtype with every op it takes, at sizes 0, 1, odd, and across one and several
    chunk boundaries (sizes rotated over the ops to keep the test short)."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for d, dtype_name in enumerate(DTYPES):
            dtype = np.dtype(dtype_name)
            per_chunk = CHUNK_BYTES // dtype.itemsize
            sizes = (0, 1, 2 * n + 1, per_chunk + 1, 3 * per_chunk + 5)
            for o, op in enumerate(scan_ops(dtype)):
                for kind in KINDS:
                    for c in range(2):
                        count = sizes[(d + o + c + (kind == "exscan")) % len(sizes)]
                        await check_scan(comms, 10 * d + o, count, dtype_name, op, kind)


async def test_the_issue_example() -> None:
    n = 4
    got: dict[int, tuple[list[int], list[int], list[bool]]] = {}
    async with open_local_world(n) as comms:

        async def one(comm: Communicator) -> None:
            r = comm.rank
            s = np.full(4, r + 1, np.int64)
            await comm.scan(s, op="sum")
            e = np.full(4, r + 1, np.int64)
            await comm.exscan(e, op="sum")
            flags = np.array([r % 2 == 0, True])
            await comm.allreduce(flags, op="band")
            got[r] = (s.tolist(), e.tolist(), flags.tolist())

        await on_every_rank(comms, one)
    for r in range(n):
        s, e, flags = got[r]
        assert s == [(r + 1) * (r + 2) // 2] * 4
        assert e == [r * (r + 1) // 2] * 4
        assert flags == [False, True]


async def test_shape_is_kept_and_only_the_element_count_must_agree() -> None:
    async with open_local_world(3) as comms:
        arrays = [np.ones((2, 3)), np.ones(6), np.ones((3, 1, 2))]

        async def one(comm: Communicator) -> None:
            await comm.scan(arrays[comm.rank])

        await on_every_rank(comms, one)
    assert [a.shape for a in arrays] == [(2, 3), (6,), (3, 1, 2)]
    assert [float(a.reshape(-1)[0]) for a in arrays] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("dtype_name", ["bool", "int8", "uint16", "int64", "uint64", "float16"])
async def test_exscan_gives_rank_0_the_identity_of_every_op(dtype_name: str) -> None:
    dtype = np.dtype(dtype_name)
    async with open_local_world(2) as comms:
        for op in scan_ops(dtype):
            arrays = [np.full(3, 7 if dtype.kind != "b" else True, dtype) for _ in comms]

            async def one(comm: Communicator, op: str = op, arrays: Any = arrays) -> None:
                await comm.exscan(arrays[comm.rank], op=op)

            await on_every_rank(comms, one)
            assert arrays[0].tobytes() == identity(dtype, op, 3).tobytes(), op
            assert np.array_equal(arrays[1], np.full(3, 7 if dtype.kind != "b" else True, dtype))


async def test_exscan_identity_in_a_world_of_one() -> None:
    async with open_local_world(1) as (comm,):
        for dtype_name, op, expected in [
            ("float64", "min", np.inf),
            ("float32", "max", -np.inf),
            ("complex64", "prod", 1),
            ("int32", "band", -1),
            ("uint8", "band", 255),
            ("int16", "min", 32767),
            ("uint32", "max", 0),
            ("bool", "min", True),
        ]:
            array = np.zeros(5, dtype_name) if op != "max" else np.ones(5, dtype_name)
            await comm.exscan(array, op=op)
            assert array.tolist() == [expected] * 5, (dtype_name, op)
            before = array.copy()
            await comm.scan(array, op=op)  # a world of one's scan is its own input
            assert array.tobytes() == before.tobytes()


# -- order of operations --------------------------------------------------------------------


def tree(inputs: Sequence[Any], combine: Callable[[Any, Any], Any], lo: int, size: int) -> Any:
    """T(lo, size): the balanced tree over ranks lo .. lo + size - 1, lower half on the
    left."""
    if size == 1:
        return inputs[lo]
    half = size // 2
    return combine(tree(inputs, combine, lo, half), tree(inputs, combine, lo + half, half))


def documented_order(
    inputs: Sequence[Any], combine: Callable[[Any, Any], Any], rank: int, kind: str
) -> Any:
    """Rank ``rank``'s result as the docstring writes it: T(b_j, 2^k_j) op (... op
    (T(b_1, 2^k_1) op x_r)) over the set bits k_i of the rank, x_r dropped for exscan
    (None for exscan's rank 0)."""
    acc = inputs[rank] if kind == "scan" else None
    for k in range(rank.bit_length()):
        if rank >> k & 1:
            below = tree(inputs, combine, (rank >> (k + 1)) << (k + 1), 1 << k)
            acc = below if acc is None else combine(below, acc)
    return acc


def random_floats(seed: int, rank: int, count: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng([seed, rank, 99])
    values = rng.standard_normal(count) * 3
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(count)
    return values.astype(dtype)


def test_the_documented_order_spelled_out() -> None:
    """The docstrings' examples, with symbols."""
    x = [f"x_{i}" for i in range(8)]

    def op(a: str, b: str) -> str:
        return f"({a} op {b})"

    low4 = "((x_0 op x_1) op (x_2 op x_3))"
    assert documented_order(x, op, 5, "scan") == f"({low4} op (x_4 op x_5))"
    assert documented_order(x, op, 6, "exscan") == f"({low4} op (x_4 op x_5))"
    assert documented_order(x, op, 7, "scan") == f"({low4} op ((x_4 op x_5) op (x_6 op x_7)))"
    assert documented_order(x, op, 3, "exscan") == "((x_0 op x_1) op x_2)"
    assert documented_order(x, op, 0, "scan") == "x_0"
    assert documented_order(x, op, 0, "exscan") is None


async def run_once(
    comms: list[Communicator], inputs: Sequence[np.ndarray[Any, Any]], op: str, kind: str
) -> list[bytes]:
    """Every rank's result of one call on copies of ``inputs``, as bytes."""
    arrays = [a.copy() for a in inputs]

    async def one(comm: Communicator) -> None:
        await getattr(comm, kind)(arrays[comm.rank], op=op)

    await on_every_rank(comms, one)
    return [a.tobytes() for a in arrays]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24])
async def test_random_floats_follow_the_documented_order_bitwise(world_size: int) -> None:
    """Random (non-integer) floats, where every order of operations gives different last
    bits: each rank's result is bitwise numpy's in the documented order, across chunks, and
    a second run gives bitwise the same."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for seed, (dtype_name, op, count) in enumerate(
            [
                ("float64", "sum", 21),
                ("float32", "sum", 37),
                ("float32", "prod", 5),
                ("float16", "sum", 40),
                ("complex128", "sum", 9),
                ("complex64", "prod", 3),
                ("float64", "min", 17),
            ]
        ):
            dtype = np.dtype(dtype_name)
            inputs = [random_floats(seed, r, count, dtype) for r in range(n)]
            for kind in KINDS:
                runs = [await run_once(comms, inputs, op, kind) for _ in range(2)]
                assert runs[0] == runs[1], (kind, dtype_name, op)
                for r in range(n):
                    expected = documented_order(inputs, UFUNCS[op], r, kind)
                    if expected is None:
                        expected = identity(dtype, op, count)
                    what = (kind, dtype_name, op, n, r)
                    assert runs[0][r] == expected.tobytes(), what
                if n >= 5 and (dtype_name, op) == ("float32", "sum"):
                    # The inputs tell orders apart: rank by rank from 0 gives other bits.
                    sequential = expected_prefixes(inputs, op, kind)
                    assert any(runs[0][r] != sequential[r].tobytes() for r in range(n))


# -- arguments, checkpoints -----------------------------------------------------------------


def _read_only() -> np.ndarray[Any, Any]:
    array = np.zeros(4)
    array.setflags(write=False)
    return array


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.scan(np.zeros(4), op="mean"), r"op 'mean' is not defined for scan .*rank \+ 1"),
        (lambda c: c.exscan(np.zeros(4), op="mean"), "op 'mean' is not defined for exscan"),
        (lambda c: c.scan(np.zeros(4, np.int32), op="mean"), "not defined for scan"),
        (lambda c: c.scan(np.zeros(4), op="avg"), "unknown op 'avg'"),
        (lambda c: c.scan(np.zeros(4, bool)), r"op 'sum' is not defined for dtype bool.*'bor'"),
        (lambda c: c.exscan(np.zeros(4, bool), op="prod"), "op 'prod' is not defined for dtype bool"),
        (lambda c: c.scan(np.zeros(4, np.complex64), op="min"), "not defined for complex"),
        (lambda c: c.exscan(np.zeros(4), op="band"), "op 'band' needs an integer or bool dtype, not float64"),
        (lambda c: c.scan(np.zeros(8)[::2]), "not C-contiguous"),
        (lambda c: c.scan(_read_only()), "read-only"),
        (lambda c: c.exscan([1.0, 2.0]), "expected a numpy.ndarray"),
        (lambda c: c.scan(np.zeros(4).view(np.matrix)), "matrix is not supported"),
        (lambda c: c.scan(np.zeros(4, ">f8")), "not in native byte order"),
        (lambda c: c.scan(np.zeros(4, "datetime64[s]")), "is not supported; supported dtypes"),
    ],
)  # fmt: skip
async def test_bad_arguments_are_refused_before_io(
    call: Callable[[Communicator], Awaitable[Any]], message: str
) -> None:
    """Refused on one rank with a message naming the rank and call, before any I/O: the
    communicator stays usable, and every rank's next scan is the first one."""
    async with open_local_world(3) as comms:
        with pytest.raises(trioring.InvalidArgumentError, match=message) as info:
            await call(comms[0])
        assert str(info.value).startswith("rank 0: ")
        assert info.value.collective in KINDS
        assert comms[0].seq == 0
        assert not comms[0].broken
        await check_scan(comms, 0, 5, "int32", "sum", "scan")
        assert all(comm.seq == 1 for comm in comms)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.scan(np.zeros(0)),
        lambda c: c.scan(np.ones(3), op="max"),
        lambda c: c.exscan(np.zeros(0)),
        lambda c: c.exscan(np.ones(3, bool), op="band"),
        lambda c: c.exscan(np.ones(2, np.complex64), op="prod"),
    ],
)
async def test_world_of_one_checkpoints(call: Callable[[Communicator], Awaitable[Any]]) -> None:
    async with open_local_world(1) as (comm,):
        with trio.testing.assert_checkpoints():
            await call(comm)


async def test_every_call_checkpoints_on_every_rank() -> None:
    async with open_local_world(3) as comms:

        async def one(comm: Communicator) -> None:
            for kind in KINDS:
                with trio.testing.assert_checkpoints():
                    await getattr(comm, kind)(np.zeros(0))
                with trio.testing.assert_checkpoints():
                    await getattr(comm, kind)(np.ones(3, np.int8), op="bor")

        await on_every_rank(comms, one)


# -- mismatches -------------------------------------------------------------------------------


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
        lambda c: c.scan(np.zeros(6, np.float32)),
        lambda c: c.scan(np.zeros(6, np.float64)),
        ("scan(sum) float32[6]", "scan(sum) float64[6]"),
    ),
    (
        "count",
        lambda c: c.exscan(np.zeros(6)),
        lambda c: c.exscan(np.zeros(12)),
        ("exscan(sum) float64[6]", "exscan(sum) float64[12]"),
    ),
    (
        "op",
        lambda c: c.scan(np.zeros(6, np.int32)),
        lambda c: c.scan(np.zeros(6, np.int32), op="bxor"),
        ("scan(sum) int32[6]", "scan(bxor) int32[6]"),
    ),
    (
        "kind",
        lambda c: c.scan(np.zeros(6)),
        lambda c: c.exscan(np.zeros(6)),
        (" scan(sum) float64[6]", "exscan(sum) float64[6]"),
    ),
    (
        "allreduce",
        lambda c: c.scan(np.zeros(6)),
        lambda c: c.allreduce(np.zeros(6)),
        ("scan(sum) float64[6]", "allreduce(sum) float64[6]"),
    ),
]


def involved(n: int, odd: int) -> set[int]:
    """The ranks whose scan waits on rank ``odd``'s frames, directly or through a partner's
    earlier rounds (and ``odd`` itself): those that meet a mismatch of ``odd``'s."""

    @functools.cache
    def waits_on(rank: int, rounds: int) -> frozenset[int]:
        ranks: set[int] = set()
        for k in range(rounds):
            partner = rank ^ (1 << k)
            if partner < n:
                ranks |= {partner} | waits_on(partner, k)
        return frozenset(ranks)

    rounds = (n - 1).bit_length()
    return {r for r in range(n) if r == odd or odd in waits_on(r, rounds)}


def test_in_a_power_of_two_world_every_rank_waits_on_every_rank() -> None:
    for n in (2, 4, 8, 16, 32):
        assert all(involved(n, odd) == set(range(n)) for odd in range(n))
    assert involved(3, 2) == {0, 2}  # rank 1's result does not depend on rank 2
    assert involved(6, 4) == {0, 1, 4, 5}


@pytest.mark.parametrize(
    ("n", "odd_rank"), [(2, 1), (3, 1), (3, 2), (4, 3), (5, 1), (5, 4), (6, 4), (8, 5)]
)
@pytest.mark.parametrize(
    ("case", "usual", "odd", "fragments"), MISMATCHES, ids=[m[0] for m in MISMATCHES]
)
async def test_mismatch_raises_on_every_involved_rank(
    n: int,
    odd_rank: int,
    case: str,
    usual: Callable[[Communicator], Awaitable[Any]],
    odd: Callable[[Communicator], Awaitable[Any]],
    fragments: tuple[str, ...],
) -> None:
    """Every rank whose exchanges meet the odd rank's call, directly or through a partner,
    raises CollectiveMismatchError naming both calls; nobody hangs. In a world that is not a
    power of two, a rank whose result does not depend on the odd rank (rank 1 of 3 when rank
    2 is odd) completes, correctly, and its next call raises. (Where the odd rank runs
    another collective, its frames go elsewhere: only the odd rank is sure to raise. And
    where that collective waits on a rank that completed, as a barrier on rank 4 of 5 waits
    on rank 3, only rank 3's next call or, over sockets, the abort frames that a long wait
    watches for end that wait; not tested here, over in-memory streams.)"""
    errors: dict[int, BaseException] = {}
    later: dict[int, BaseException] = {}
    done: list[int] = []
    all_done = trio.Event()
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

        async def one(comm: Communicator) -> None:
            try:
                await (odd if comm.rank == odd_rank else usual)(comm)
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc
            done.append(comm.rank)
            if len(done) == n:
                all_done.set()
            if comm.rank in errors:
                return
            await all_done.wait()  # the next call only once every rank is out of this one
            try:
                await comm.barrier()
            except trioring.TrioringError as exc:
                later[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    if case == "allreduce":
        assert odd_rank in errors
    else:
        assert sorted(errors) == sorted(involved(n, odd_rank))
    assert sorted([*errors, *later]) == list(range(n))
    for exc in errors.values():
        assert isinstance(exc, trioring.CollectiveMismatchError), repr(exc)
        assert all(f in str(exc) for f in fragments), str(exc)
    for exc in later.values():
        assert isinstance(exc, trioring.CollectiveMismatchError), repr(exc)


# -- streams, cancellation --------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
async def test_unbuffered_streams_do_not_deadlock(world_size: int) -> None:
    """Over connections without any buffer (every send waits for its receive), across
    chunks: a send before its receive would deadlock here at once."""
    n = world_size
    async with open_local_world(n, buffered=False, chunk_bytes=CHUNK_BYTES) as comms:
        with trio.fail_after(20):
            for kind in KINDS:
                await check_scan(comms, 1, 37, "float32", "sum", kind)
                await check_scan(comms, 2, 0, "float64", "max", kind)
                await check_scan(comms, 3, 100, "bool", "bxor", kind)


@pytest.mark.parametrize("kind", KINDS)
async def test_cancelling_one_rank_reaches_every_rank(
    kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Rank 0 is cancelled inside the call, while waiting for rank 2 (round 1), which enters
    late: every other rank raises promptly (in this call, or in its next one where the data
    it needed had all arrived), and rank 0's communicator is broken. (Virtual time.)"""
    n = 4
    errors: dict[int, tuple[BaseException, float]] = {}
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:

        async def one(comm: Communicator) -> None:
            x = np.ones(40, np.float32)
            if comm.rank == 2:
                await trio.sleep(0.2)  # late: rank 0 is cancelled while the others wait
            try:
                if comm.rank == 0:
                    with trio.move_on_after(0.05):
                        await getattr(comm, kind)(x)
                    assert comm.broken
                else:
                    await getattr(comm, kind)(x)
                    await comm.barrier()
            except trioring.TrioringError as exc:
                errors[comm.rank] = (exc, trio.current_time())

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    assert sorted(errors) == [1, 2, 3]
    for exc, when in errors.values():
        assert isinstance(exc, trioring.PeerAbortedError | trioring.PeerFailedError), repr(exc)
        assert when < 0.5, (exc, when)  # the late rank enters at 0.2
    rank_2, _ = errors[2]
    assert "rank 0 cancelled" in str(rank_2)


# -- real processes ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_real_processes(tmp_path: Path, transport: str, world_size: int) -> None:
    """Right results over both transports; over Unix sockets (the shared segment) the
    segment's scan ran, bitwise the same as recursive doubling's through the sockets."""
    reports = run_reports(
        WORKER, ["check", str(tmp_path)], tmp_path, world_size, transport=transport
    )
    for report in reports:
        assert report["errors"] == [], report["errors"]
        through_segment = "shm" in report["features"]
        assert through_segment == (transport == "unix" and world_size > 1), report
        assert (report["calls"].get("shm_scan", 0) > 0) == through_segment, report


@pytest.mark.parametrize(("kind", "victim"), [("scan", 2), ("exscan", 1)])
def test_sigkill_during_the_call(tmp_path: Path, kind: str, victim: int) -> None:
    """A rank SIGKILLs itself in the middle of the call (at its third reduction, in the
    second of 16 chunks), at world 4: every survivor raises PeerFailedError naming it,
    promptly, whether it talked to the victim or heard of it from a peer."""
    survivors = run_killed(WORKER, ["kill", str(tmp_path), kind, str(victim)], tmp_path, victim)
    for report in survivors.values():
        assert report["error"] == "PeerFailedError", report
        assert report["peer"] == victim, report
        assert f"rank {victim}" in report["message"], report
        assert report["elapsed"] < 5.0, report


# -- a property -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 11),
    count=st.integers(0, 40),
    dtype_name=st.sampled_from(DTYPES),
    op_index=st.integers(0, 6),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
    chunk_bytes=st.sampled_from([16, 48, 1024]),
    buffered=st.booleans(),
)
def test_property_matches_numpy(
    n: int,
    count: int,
    dtype_name: str,
    op_index: int,
    kind: str,
    seed: int,
    chunk_bytes: int,
    buffered: bool,
) -> None:
    """Any world, size, dtype, op, chunking and buffering: numpy's accumulate over the
    ranks."""
    dtype = np.dtype(dtype_name)
    ops = scan_ops(dtype)
    op = ops[op_index % len(ops)]

    async def main() -> None:
        with trio.fail_after(10):
            async with open_local_world(n, buffered=buffered, chunk_bytes=chunk_bytes) as comms:
                await check_scan(comms, seed, count, dtype_name, op, kind)

    trio.run(main)
