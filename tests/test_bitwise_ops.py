"""The bitwise ops (band, bor, bxor) and the bool dtype (issue 15) in the collectives that
reduce: allreduce by every algorithm (recursive doubling and the ring over in-memory
streams; the one-host shm and cma paths in real processes), reduce, reduce_scatter and
reduce_scatterv, against numpy on inputs with every bit in play; the dtype rules and how
their refusals read; mismatched bitwise ops on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from exact_inputs import BITWISE, UFUNCS, make, ops_for
from launched import run_reports
from local_runs import force, on_every_rank
from trioring._wire import OP_NAMES, Kind, OpSpec
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from trioring import Communicator

#: 64 bytes per chunk: modest arrays cross chunk boundaries.
CHUNK_BYTES = 64
INTEGERS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
DTYPES = (*INTEGERS, "bool")
WORLDS = [1, 2, 3, 4, 5, 7, 8, 9, 13]
WORKER = Path(__file__).parent / "workers" / "scan_worker.py"
CMA_HERE = trioring.is_available("cma")
SHM_HERE = trioring.is_available("shm")


def bitwise_ops(dtype: np.dtype[Any]) -> tuple[str, ...]:
    """The ops under test for ``dtype``: the bitwise ones, and bool's min and max."""
    return tuple(op for op in ops_for(dtype, bitwise=True) if op in BITWISE or dtype.kind == "b")


def reduced(inputs: Sequence[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    return UFUNCS[op].reduce(np.stack(inputs), axis=0, dtype=inputs[0].dtype)


def fits(name: str, nbytes: int, world_size: int) -> bool:
    """Whether the algorithm takes an array of ``nbytes`` at CHUNK_BYTES."""
    limited = name in ("recursive_doubling", "recursive_halving")
    return not limited or world_size == 1 or nbytes <= CHUNK_BYTES


def test_the_inputs_put_every_bit_in_play() -> None:
    """make() gives the bitwise ops inputs whose reductions are neither all zeros nor all
    ones at small worlds, the sign bit included."""
    for dtype_name in INTEGERS:
        dtype = np.dtype(dtype_name)
        bits = dtype.itemsize * 8
        for op in BITWISE:
            result = reduced([make(1, r, 64, dtype, op) for r in range(3)], op)
            ones = np.unpackbits(result.view(np.uint8)).reshape(64, bits).sum(axis=0)
            assert (ones > 0).all(), (dtype_name, op, ones)
            assert (ones < 64).all(), (dtype_name, op, ones)
    for op in bitwise_ops(np.dtype(bool)):
        result = reduced([make(1, r, 64, np.dtype(bool), op) for r in range(3)], op)
        assert 0 < result.sum() < 64, op


async def check_allreduce(
    comms: list[Communicator], seed: int, count: int, dtype_name: str, op: str
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    inputs = [make(seed, r, count, dtype, op) for r in range(n)]
    arrays = [a.copy() for a in inputs]

    async def one(comm: Communicator) -> None:
        await comm.allreduce(arrays[comm.rank], op=op)

    await on_every_rank(comms, one)
    what = f"allreduce {dtype}[{count}] {op} at world {n}"
    assert np.array_equal(arrays[0], reduced(inputs, op)), what
    assert all(a.tobytes() == arrays[0].tobytes() for a in arrays), what


async def check_reduce_family(
    comms: list[Communicator], seed: int, block: int, dtype_name: str, op: str
) -> None:
    """reduce_scatter of ``block`` elements per rank, reduce_scatterv of uneven blocks, and
    reduce to the last rank, against numpy."""
    n = len(comms)
    dtype = np.dtype(dtype_name)
    counts = [(block + 3 * q) % (block + 2) for q in range(n)]
    inputs = [make(seed, r, n * block, dtype, op) for r in range(n)]
    inputs_v = [make(seed + 1, r, sum(counts), dtype, op) for r in range(n)]
    results: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]]
    results = {}

    async def one(comm: Communicator) -> None:
        r = comm.rank
        scattered = await comm.reduce_scatter(inputs[r].copy(), op=op)
        scattered_v = await comm.reduce_scatterv(inputs_v[r].copy(), counts=counts, op=op)
        array = inputs[r].copy()
        await comm.reduce(array, root=n - 1, op=op)
        results[r] = (scattered, scattered_v, array)

    await on_every_rank(comms, one)
    expected, expected_v = reduced(inputs, op), reduced(inputs_v, op)
    what = f"{dtype}[{n}x{block}] {op} at world {n}"
    start = 0
    for r in range(n):
        scattered, scattered_v, array = results[r]
        assert np.array_equal(scattered, expected[r * block : (r + 1) * block]), (what, r)
        assert np.array_equal(scattered_v, expected_v[start : start + counts[r]]), (what, r)
        start += counts[r]
        if r == n - 1:
            assert np.array_equal(array, expected), what
        else:
            assert array.tobytes() == inputs[r].tobytes(), what  # non-root: only read


@pytest.mark.parametrize("world_size", WORLDS)
async def test_allreduce_by_every_socket_algorithm(world_size: int) -> None:
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in ("recursive_doubling", "ring"):
            force(comms, "allreduce", name)
            for d, dtype_name in enumerate(DTYPES):
                dtype = np.dtype(dtype_name)
                per_chunk = CHUNK_BYTES // dtype.itemsize
                for o, op in enumerate(bitwise_ops(dtype)):
                    for c, count in enumerate((0, 1, n + 2, 2 * per_chunk + 3)):
                        if fits(name, count * dtype.itemsize, n):
                            seed = 100 * d + 10 * o + c
                            await check_allreduce(comms, seed, count, dtype_name, op)


@pytest.mark.parametrize("world_size", WORLDS)
async def test_reduce_scatter_and_reduce(world_size: int) -> None:
    """Both reduce-scatter algorithms (recursive halving where a chunk holds the array) and
    the tree reduce."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in ("recursive_halving", "ring"):
            force(comms, ("reduce_scatter", "reduce_scatterv"), name)
            for d, dtype_name in enumerate(DTYPES):
                dtype = np.dtype(dtype_name)
                for o, op in enumerate(bitwise_ops(dtype)):
                    block = 1 if name == "recursive_halving" else 5 + (d + o) % 3
                    if not fits(name, (n * block + 2) * dtype.itemsize, n):
                        continue
                    await check_reduce_family(comms, 10 * d + o, block, dtype_name, op)


@pytest.mark.skipif(not (SHM_HERE or CMA_HERE), reason="no one-host path here")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_host_algorithms_in_real_processes(tmp_path: Path, world_size: int) -> None:
    """shm and cma (each where it is available) forced for allreduce, with recursive
    doubling and the ring, then reduce_scatter and reduce, in real processes: numpy's answer,
    bitwise the same on every rank."""
    reports = run_reports(WORKER, ["bitwise", str(tmp_path)], tmp_path, world_size)
    for report in reports:
        assert report["errors"] == [], report["errors"]
        calls = report["calls"]
        if SHM_HERE:
            assert "shm" in report["features"]
            assert calls.get("shm_allreduce", 0) > 0, calls
        if CMA_HERE:
            assert "cma" in report["features"]
            assert calls.get("cma_allreduce", 0) > 0, calls


async def test_reduce_op_members_and_the_wire() -> None:
    """ReduceOp.BAND and "band" are interchangeable, and frames name the op."""
    assert OP_NAMES[-3:] == ("band", "bor", "bxor")
    assert trioring.ReduceOp.BAND == "band"
    code = OP_NAMES.index("bxor") + 1
    assert OpSpec(Kind.ALLREDUCE, 3, 14, 2, code).describe() == "allreduce(bxor) bool[2] #3"
    async with open_local_world(2) as comms:
        arrays = [np.array([True, False, r == 0]) for r in range(2)]

        async def one(comm: Communicator) -> None:
            await comm.allreduce(arrays[comm.rank], op=trioring.ReduceOp.BXOR)

        await on_every_rank(comms, one)
    assert [a.tolist() for a in arrays] == [[False, False, True]] * 2


# -- refusals ---------------------------------------------------------------------------------


def _calls(array: np.ndarray[Any, Any], op: str) -> list[Callable[[Communicator], Any]]:
    """Every reducing collective of ``array`` (2 elements) with ``op`` ("": the default)."""
    kwargs = {} if op == "" else {"op": op}
    return [
        lambda c: c.allreduce(array, **kwargs),
        lambda c: c.reduce(array, **kwargs),
        lambda c: c.reduce_scatter(array, **kwargs),
        lambda c: c.reduce_scatterv(array, counts=[1, 1], **kwargs),
        lambda c: c.scan(array, **kwargs),
        lambda c: c.exscan(array, **kwargs),
    ]


COLLECTIVES = ("allreduce", "reduce", "reduce_scatter", "reduce_scatterv", "scan", "exscan")
REFUSALS = [
    (
        "bool",
        "",
        r"op 'sum' is not defined for dtype bool \(numpy would give a logical or/and, not a "
        r"count\); use 'bor', 'band', 'bxor', 'min' or 'max', or convert to an integer dtype",
    ),
    ("bool", "sum", "op 'sum' is not defined for dtype bool .*use 'bor'"),
    ("bool", "prod", "op 'prod' is not defined for dtype bool .*use 'bor'"),
    ("float32", "band", "op 'band' needs an integer or bool dtype, not float32"),
    ("float16", "bor", "op 'bor' needs an integer or bool dtype, not float16"),
    ("complex64", "bxor", "op 'bxor' needs an integer or bool dtype, not complex64"),
    ("float64", "bitand", "unknown op 'bitand'; expected one of .*'band', 'bor', 'bxor'"),
]


@pytest.mark.parametrize(("dtype_name", "op", "message"), REFUSALS)
async def test_refusals_read_well_in_every_collective(
    dtype_name: str, op: str, message: str
) -> None:
    """Refused before any I/O, with the rank, the call and what to do instead; the
    communicator stays usable."""
    async with open_local_world(2) as comms:
        comm = comms[0]
        for collective, call in zip(COLLECTIVES, _calls(np.zeros(2, dtype_name), op), strict=True):
            with pytest.raises(trioring.InvalidArgumentError, match=message) as info:
                await call(comm)
            assert str(info.value).startswith(f"rank 0: {collective} #1: "), str(info.value)
            assert info.value.collective == collective
        assert comm.seq == 0
        assert not comm.broken


async def test_bool_mean_is_refused() -> None:
    async with open_local_world(1) as (comm,):
        for call in _calls(np.zeros(2, bool), "mean")[:4]:
            with pytest.raises(trioring.InvalidArgumentError, match="op 'mean' is not defined"):
                await call(comm)


@pytest.mark.parametrize("op", ["band", "bor", "bxor", "min", "max"])
async def test_world_of_one_checkpoints(op: str) -> None:
    async with open_local_world(1) as (comm,):
        flags = np.array([True, False])
        for call in _calls(flags, op)[:3]:
            with trio.testing.assert_checkpoints():
                await call(comm)
        assert flags.tolist() == [True, False]


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_a_different_bitwise_op_is_a_mismatch_on_every_rank(n: int) -> None:
    errors: dict[int, BaseException] = {}
    async with open_local_world(n) as comms:

        async def one(comm: Communicator) -> None:
            try:
                await comm.allreduce(np.ones(4, np.uint8), op="bor" if comm.rank == 1 else "band")
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    assert sorted(errors) == list(range(n))
    for exc in errors.values():
        assert isinstance(exc, trioring.CollectiveMismatchError), repr(exc)
        assert "allreduce(band) uint8[4]" in str(exc), str(exc)
        assert "allreduce(bor) uint8[4]" in str(exc), str(exc)


async def test_unbuffered_streams() -> None:
    async with open_local_world(4, buffered=False, chunk_bytes=CHUNK_BYTES) as comms:
        with trio.fail_after(20):
            for name in ("recursive_doubling", "ring"):
                force(comms, "allreduce", name)
                count = 40 if name == "ring" else 8
                await check_allreduce(comms, 1, count, "bool", "band")
                await check_allreduce(comms, 2, count // 8, "int64", "bxor")
            await check_reduce_family(comms, 3, 9, "uint16", "bor")
