"""Every algorithm of every collective, forced, at every world size that matters.

The decision table (``trioring._collectives._decision``) picks one algorithm per call; the
forcing knob (``Communicator._force_algorithm``, ``TRIORING_ALGORITHM``) replaces that
choice, so that each algorithm runs here at world sizes 1 to 17, 24, 27 and 32, not only
where the table would pick it. The socket algorithms run in one process over in-memory
streams (``open_local_world``) with small chunks; the one-host ones (``shm``, ``cma``) need
real processes on one host (tests/workers/forced_worker.py, started by tests/launched.py).

Inputs are integer-valued (from a seeded generator), so every order of operations gives the
exact result and results can be checked against numpy; every rank's result must also be
bitwise the same.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import pytest

import trioring
from exact_inputs import UFUNCS, make, ops_for
from launched import run_reports
from local_runs import force, on_every_rank
from trioring import _config
from trioring._collectives import _allreduce, _decision, _limits
from trioring._collectives._decision import (
    CMA_MIN_BYTES,
    PIPE_MAX_REDUCE_BYTES,
    SMALL_ALLREDUCE_BYTES,
)
from trioring._onehost._cpus import cpu_vendor
from trioring._onehost._shm import SHM_MAX_BYTES, SLOT_PAYLOAD_BYTES
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from trioring import Communicator

WORLDS = [*range(1, 18), 24, 27, 32]
#: Small chunks, so that modest arrays cross chunk boundaries (and recursive doubling's limit,
#: the scratch buffer of one chunk, is low).
CHUNK_BYTES = 64
SOCKET_ALGORITHMS = {
    "allreduce": ("recursive_doubling", "ring"),
    "broadcast": ("tree",),
    "barrier": ("dissemination",),
}
DTYPES = ("float64", "float32", "float16", "int8", "int32", "uint16", "int64", "complex64")
CMA_HERE = trioring.is_available("cma")
SHM_HERE = trioring.is_available("shm")


def test_every_algorithm_is_covered() -> None:
    """The socket algorithms here and the one-host ones below are all the table has."""
    for collective, names in _decision.ALGORITHMS.items():
        if collective not in SOCKET_ALGORITHMS:
            continue  # a newer family, forced in its own tests/test_<family>.py
        assert set(names) == {*SOCKET_ALGORITHMS[collective], "shm"} | (
            {"cma"} if collective != "barrier" else set()
        ) | ({"pipe"} if collective != "barrier" else set()), collective


def fits(collective: str, name: str, nbytes: int, world_size: int) -> bool:
    return not (
        collective == "allreduce"
        and name == "recursive_doubling"
        and world_size > 1
        and nbytes > CHUNK_BYTES
    )


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
    with np.errstate(all="ignore"):
        expected = UFUNCS[op].reduce(np.stack(inputs), axis=0, dtype=dtype)
        if op == "mean":
            np.divide(expected, n, out=expected)
    what = f"allreduce {dtype}[{count}] {op} at world {n}"
    assert np.array_equal(arrays[0], expected), what
    assert all(a.tobytes() == arrays[0].tobytes() for a in arrays), what


async def check_broadcast(
    comms: list[Communicator], seed: int, count: int, dtype_name: str, root: int
) -> None:
    n = len(comms)
    dtype = np.dtype(dtype_name)
    arrays = [make(seed, r, count, dtype, "sum") for r in range(n)]
    expected = arrays[root].tobytes()

    async def one(comm: Communicator) -> None:
        await comm.broadcast(arrays[comm.rank], root=root)

    await on_every_rank(comms, one)
    assert all(a.tobytes() == expected for a in arrays), f"broadcast at world {n} root {root}"


async def check_barrier(comms: list[Communicator]) -> None:
    entered: list[int] = []
    left_early: list[int] = []

    async def one(comm: Communicator) -> None:
        entered.append(comm.rank)
        await comm.barrier()
        if len(entered) < len(comms):
            left_early.append(comm.rank)

    await on_every_rank(comms, one)
    assert left_early == []


@pytest.mark.parametrize("world_size", WORLDS)
async def test_every_algorithm_at_every_world_size(world_size: int) -> None:
    """Each socket algorithm at two sizes (below the world size, and odd across chunks where
    the algorithm takes that many), every root for broadcast up to 8 ranks, some after."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in SOCKET_ALGORITHMS["allreduce"]:
            force(comms, "allreduce", name)
            # float32: 16 elements per chunk; 2 chunks and 5 more if the algorithm takes it.
            for seed, count in enumerate((max(n - 1, 1), 37)):
                if fits("allreduce", name, count * 4, n):
                    await check_allreduce(comms, seed, count, "float32", "sum")
            await check_allreduce(comms, 7, 3, "int16", "max")
        force(comms, "broadcast", "tree")
        roots = range(n) if n <= 8 else (0, 1, n // 2, n - 1)
        for root in roots:
            await check_broadcast(comms, root, 37 if root % 2 else n, "float64", root)
        force(comms, "barrier", "dissemination")
        await check_barrier(comms)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
async def test_every_size_dtype_and_op(world_size: int) -> None:
    """Sizes 0, 1, below the world size, odd, and across one and several chunk boundaries,
    in every dtype group and op, by every socket algorithm that takes them."""
    n = world_size
    async with open_local_world(n, chunk_bytes=CHUNK_BYTES) as comms:
        for name in SOCKET_ALGORITHMS["allreduce"]:
            force(comms, "allreduce", name)
            for d, dtype_name in enumerate(DTYPES):
                dtype = np.dtype(dtype_name)
                per_chunk = CHUNK_BYTES // dtype.itemsize
                counts = (0, 1, n - 1, 2 * n + 1, per_chunk, per_chunk + 1, 3 * per_chunk + 5)
                ops = ops_for(dtype)
                for c, count in enumerate(counts):
                    if fits("allreduce", name, count * dtype.itemsize, n):
                        op = ops[(c + d) % len(ops)]
                        await check_allreduce(comms, c, count, dtype_name, op)
        force(comms, "broadcast", "tree")
        for c, count in enumerate((0, 1, n - 1, 17, 3 * 8 + 5, 100)):
            await check_broadcast(comms, c, count, DTYPES[c % len(DTYPES)], c % n)


async def test_forced_algorithm_that_cannot_run_raises_before_io() -> None:
    """No shared segment or cross-memory attach between in-memory ranks, and no array over
    one chunk for recursive doubling: refused on entry, the communicator still usable."""
    async with open_local_world(2, chunk_bytes=CHUNK_BYTES) as comms:
        comm = comms[0]
        cases: list[tuple[str, str, Callable[[], Awaitable[None]], str]] = [
            ("allreduce", "shm", lambda: comm.allreduce(np.zeros(1)), '"shm" feature'),
            ("allreduce", "cma", lambda: comm.allreduce(np.zeros(1)), '"cma" feature'),
            (
                "allreduce",
                "recursive_doubling",
                lambda: comm.allreduce(np.zeros(9)),
                r"at most chunk_bytes \(64\) bytes, not 72",
            ),
            ("broadcast", "shm", lambda: comm.broadcast(np.zeros(1)), '"shm" feature'),
            ("broadcast", "pipe", lambda: comm.broadcast(np.zeros(1)), '"shm" feature'),
            ("broadcast", "cma", lambda: comm.broadcast(np.zeros(1)), '"cma" feature'),
            ("barrier", "shm", comm.barrier, '"shm" feature'),
        ]
        for collective, name, call, message in cases:
            comm._force_algorithm(collective, name)
            with pytest.raises(trioring.InvalidArgumentError, match=message) as info:
                await call()
            assert info.value.collective == collective
            assert comm.seq == 0
            assert not comm.broken
            comm._force_algorithm(collective, None)
        # Eight doubles fit one chunk: recursive doubling takes them.
        force(comms, "allreduce", "recursive_doubling")
        await check_allreduce(comms, 0, 8, "float64", "sum")


async def test_unknown_names_are_configuration_errors() -> None:
    async with open_local_world(1) as (comm,):
        with pytest.raises(trioring.ConfigurationError, match="unknown collective 'gossip'"):
            comm._force_algorithm("gossip", "tree")
        with pytest.raises(
            trioring.ConfigurationError,
            match="allreduce has no algorithm 'tree'; expected one of shm, pipe, cma, "
            "recursive_doubling, ring",
        ):
            comm._force_algorithm("allreduce", "tree")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", {}),
        (" allreduce=ring ", {"allreduce": "ring"}),
        (
            "allreduce=ring, broadcast = tree,barrier=shm",
            {"allreduce": "ring", "broadcast": "tree", "barrier": "shm"},
        ),
    ],
)
def test_environment_variable(raw: str, expected: dict[str, str]) -> None:
    assert _decision.parse_forced({"TRIORING_ALGORITHM": raw}) == expected
    config = _config.resolve(
        rank=0,
        world_size=1,
        master_addr=None,
        master_port=None,
        transport=None,
        env={"TRIORING_ALGORITHM": raw},
    )
    assert dict(config.algorithms) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("ring", "expected comma-separated COLLECTIVE=ALGORITHM pairs"),
        ("allreduce=", "expected comma-separated COLLECTIVE=ALGORITHM pairs"),
        ("allreduce=ring,", "expected comma-separated COLLECTIVE=ALGORITHM pairs"),
        ("allreduce=bruck", "allreduce has no algorithm 'bruck'"),
        ("gossip=ring", "unknown collective 'gossip'"),
        ("allreduce=ring,allreduce=shm", "allreduce is forced twice"),
    ],
)
def test_environment_variable_errors(raw: str, message: str) -> None:
    with pytest.raises(
        trioring.ConfigurationError, match=f"^TRIORING_ALGORITHM={raw!r}: {message}"
    ):
        _decision.parse_forced({"TRIORING_ALGORITHM": raw})


@pytest.mark.parametrize(
    ("nbytes", "shm", "cma", "expected"),
    [
        (4, True, True, "shm"),
        (SHM_MAX_BYTES // 4, True, False, "shm"),
        (SHM_MAX_BYTES // 4 + 1, True, True, "pipe"),
        (SHM_MAX_BYTES // 4 + 1, True, False, "pipe"),
        (SHM_MAX_BYTES // 4 + 1, False, True, "recursive_doubling"),
        (4, False, False, "recursive_doubling"),
        (CMA_MIN_BYTES, False, True, "recursive_doubling"),
        (CMA_MIN_BYTES + 1, False, True, "cma"),
        (SMALL_ALLREDUCE_BYTES, False, False, "recursive_doubling"),
        (SMALL_ALLREDUCE_BYTES + 1, False, False, "ring"),
        (PIPE_MAX_REDUCE_BYTES, True, True, "pipe"),
        (PIPE_MAX_REDUCE_BYTES + 1, True, True, "cma"),
        (64 << 20, True, True, "cma"),
        (64 << 20, True, False, "pipe"),
        (64 << 20, False, True, "cma"),
    ],
)
def test_allreduce_decision(nbytes: int, shm: bool, cma: bool, expected: str) -> None:
    # The shared segment's share at world 2..3 of the default scratch: SHM_MAX_BYTES // 4.
    shm_bytes = SHM_MAX_BYTES // 4 if shm else -1
    chosen = _decision.allreduce(nbytes, shm_bytes, cma, SMALL_ALLREDUCE_BYTES)
    assert chosen == expected


@pytest.mark.parametrize(
    ("nbytes", "shm_bytes", "cma", "expected"),
    [
        (0, SHM_MAX_BYTES, True, "shm"),
        (SHM_MAX_BYTES, SHM_MAX_BYTES, True, "shm"),
        (SHM_MAX_BYTES + 1, SHM_MAX_BYTES, True, "pipe"),
        (SHM_MAX_BYTES + 1, SHM_MAX_BYTES, False, "pipe"),
        (SHM_MAX_BYTES + 1, SLOT_PAYLOAD_BYTES, True, "shm"),
        (SLOT_PAYLOAD_BYTES, SLOT_PAYLOAD_BYTES, True, "shm"),
        (SLOT_PAYLOAD_BYTES + 1, SLOT_PAYLOAD_BYTES, True, "pipe"),
        (64 * 1024 * 1024, SHM_MAX_BYTES, True, "pipe"),
        (SHM_MAX_BYTES + 1, -1, True, "tree"),
        (CMA_MIN_BYTES + 1, -1, True, "cma"),
        (CMA_MIN_BYTES + 1, -1, False, "tree"),
    ],
)
def test_broadcast_decision(nbytes: int, shm_bytes: int, cma: bool, expected: str) -> None:
    assert _decision.broadcast(nbytes, shm_bytes, cma) == expected


MiB = 1 << 20


@pytest.mark.parametrize(
    ("vendor", "expected"),
    [
        ("GenuineIntel", (2 * MiB, 2 * MiB, 0, 0, 0)),
        ("AuthenticAMD", (4 * MiB, 8 * MiB, _limits.ANY_SIZE, 4 * MiB, 4 * MiB)),
        ("HygonGenuine", (4 * MiB, 8 * MiB, _limits.ANY_SIZE, 4 * MiB, 4 * MiB)),
        ("", (4 * MiB, 8 * MiB, _limits.ANY_SIZE, 4 * MiB, 4 * MiB)),
    ],
)
def test_the_pipes_limits_go_by_cpu_vendor(
    vendor: str, expected: tuple[int, int, int, int, int]
) -> None:
    """(reduce, allgather, alltoall, pushed_reduce, pushed_broadcast)."""
    limits = _limits.pipe_limits(vendor)
    assert attrs.astuple(limits) == expected


def test_this_machines_pipe_limits_are_its_vendors() -> None:
    info = Path("/proc/cpuinfo")
    named = re.search(r"^vendor_id\s*:\s*(\S+)", info.read_text(), re.M) if info.exists() else None
    assert cpu_vendor() == (named.group(1) if named else "")
    limits = _limits.pipe_limits(cpu_vendor())
    assert limits == _limits.PIPE_LIMITS
    assert (limits.reduce, limits.allgather, limits.alltoall) == (
        PIPE_MAX_REDUCE_BYTES,
        _decision.PIPE_MAX_ALLGATHER_BYTES,
        _decision.PIPE_MAX_ALLTOALL_BYTES,
    )
    assert limits.pushed_reduce == _decision.PIPE_MAX_PUSHED_REDUCE_BYTES
    assert limits.pushed_broadcast == _decision.PIPE_MAX_PUSHED_BROADCAST_BYTES
    # Every reduction takes it: the pipe up to it, cross-memory attach above.
    for nbytes, algorithm in ((PIPE_MAX_REDUCE_BYTES, "pipe"), (PIPE_MAX_REDUCE_BYTES + 4, "cma")):
        assert _decision.allreduce(nbytes, 1024, True, SMALL_ALLREDUCE_BYTES) == algorithm
        assert _decision.reduce_scatter(nbytes, SMALL_ALLREDUCE_BYTES, 1024, True) == algorithm
        assert _decision.reduce(nbytes, 4, 1024, True) == algorithm


def test_pushing_ranks_take_the_pipes_pushed_limit_for_allreduce_and_reduce() -> None:
    """Where the ranks push, allreduce and reduce leave the pipe above
    PIPE_MAX_PUSHED_REDUCE_BYTES (0 on Intel CPUs: every call the slots cannot take goes by
    cross-memory attach); reduce_scatter, which never pushes, keeps PIPE_MAX_REDUCE_BYTES;
    without cross-memory attach the pipe takes them all."""
    limit = _decision.pipe_reduce_limit(True)
    assert limit == _decision.PIPE_MAX_PUSHED_REDUCE_BYTES
    assert _decision.pipe_reduce_limit(False) == PIPE_MAX_REDUCE_BYTES
    slots = 1024
    for nbytes in (slots + 4, limit, limit + 4, 64 * MiB):
        if nbytes <= slots:
            continue  # the slots' (a limit of 0)
        expected = "pipe" if nbytes <= limit else "cma"
        small = SMALL_ALLREDUCE_BYTES
        assert _decision.allreduce(nbytes, slots, True, small, push=True) == expected
        assert _decision.reduce(nbytes, 4, slots, True, push=True) == expected
        assert _decision.allreduce(nbytes, slots, False, small, push=True) == "pipe"
        assert _decision.reduce(nbytes, 4, slots, False, push=True) == "pipe"


def test_barrier_decision() -> None:
    assert _decision.barrier(shm=True) == "shm"
    assert _decision.barrier(shm=False) == "dissemination"


@pytest.mark.parametrize(
    ("world_size", "chunk_bytes", "count", "expected"),
    [
        (2, 1024 * 1024, 1, "recursive_doubling"),
        (5, 1024 * 1024, 1000, "recursive_doubling"),
        (5, 64, 8, "recursive_doubling"),
        (5, 64, 9, "ring"),
        (3, 64 * 1024, 64 * 1024 // 8 + 1, "ring"),
    ],
)
async def test_communicator_follows_the_table(
    monkeypatch: pytest.MonkeyPatch, world_size: int, chunk_bytes: int, count: int, expected: str
) -> None:
    """Unforced, a communicator runs what the table says (float64 arrays)."""
    chosen: list[str] = []
    body = _allreduce.body

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        chosen.append(name)
        return body(name, *args, **kwargs)

    monkeypatch.setattr(_allreduce, "body", spy)
    async with open_local_world(world_size, chunk_bytes=chunk_bytes) as comms:
        await check_allreduce(comms, 0, count, "float64", "sum")
    assert chosen == [expected] * world_size


# -- the one-host algorithms, across real processes --------------------------------------------

WORKER = Path(__file__).parent / "workers" / "forced_worker.py"


def run_worker(
    tmp_path: Path, n: int, mode: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    return run_reports(WORKER, [mode, str(tmp_path)], tmp_path, n, env=env)


@pytest.mark.skipif(not (SHM_HERE or CMA_HERE), reason="no one-host path here")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_host_algorithms_forced(tmp_path: Path, world_size: int) -> None:
    """Every algorithm, shm and cma included, forced at sizes from 0 to 1.2 MB."""
    for report in run_worker(tmp_path, world_size, "all"):
        assert report["errors"] == [], report["errors"]
        calls = report["calls"]
        if SHM_HERE:
            assert "shm" in report["features"]
            for name in ("shm_allreduce", "shm_broadcast", "shm_barrier"):
                assert calls.get(name, 0) > 0, (name, calls)
        if CMA_HERE:
            assert "cma" in report["features"]
            for name in ("cma_allreduce", "cma_broadcast"):
                # Forced at small sizes too, where the table would never pick it.
                assert calls.get(name, 0) >= 6, (name, calls)
        if SHM_HERE:
            # Forced at every size, from empty arrays to one that wraps the ring.
            assert calls.get("pipe_broadcast", 0) >= 8, calls
            assert calls.get("pipe_allreduce", 0) >= 24, calls
            # A broadcast through the slots of more than three pieces goes piece by piece
            # (256 KiB and 196,612 bytes, forced "shm"); through the pipe, its chunks are
            # a quarter of it (a power of two from 64 KiB to 1 MiB); unless some rank
            # shares its CPUs with more ranks than it has, which every rank agreed on (on
            # any CPU: the worker takes the Intel CPUs' rule, and flips crowded both ways).
            assert report["crowded"] is (world_size > len(os.sched_getaffinity(0))), report
            assert calls.get("_broadcast_pieces", 0) >= 2, calls
            assert {64 << 10, 128 << 10, 256 << 10, 1 << 20} <= set(report["chunks"]), report


@pytest.mark.skipif(not (SHM_HERE and CMA_HERE), reason="needs both one-host paths")
def test_environment_variable_reaches_every_rank(tmp_path: Path) -> None:
    """TRIORING_ALGORITHM forces cross-memory attach for a 12-byte allreduce and broadcast,
    and dissemination for the barrier, where the table would pick the shared segment."""
    env = {"TRIORING_ALGORITHM": "allreduce=cma,broadcast=cma,barrier=dissemination"}
    for report in run_worker(tmp_path, 3, "env", env):
        assert report["errors"] == [], report["errors"]
        # check_allreduce broadcasts its result once more to compare ranks.
        assert report["calls"] == {"cma_allreduce": 1, "cma_broadcast": 2}, report["calls"]
