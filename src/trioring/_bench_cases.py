"""What ``trioring bench`` times for each collective, and how it checks every result.

Sizes follow nccl-tests' conventions (its ``doc/PERFORMANCE.md``): a cell's size is the
larger of one rank's buffers, so the whole array for allreduce, broadcast, reduce, scan and
exscan; what each rank *receives* in all for allgather(v) and gather(v) (the root's, for
gather); what each rank *sends* in all for reduce_scatter(v), scatter(v) (the root's) and
alltoall(v). Those collectives split the size into ``world_size`` blocks, so it is rounded
down to a multiple of ``world_size`` elements (at least one per block), and the table shows
the size actually moved. Bus bandwidth is the algorithm bandwidth times nccl-tests' factor:
``2 (n-1)/n`` for allreduce, ``(n-1)/n`` for allgather, reduce_scatter, alltoall, gather and
scatter (what a rank must move at least, over its link), 1 for broadcast, reduce and the
scans.

Every rank's input is a constant, ``rank + 1`` (for ``prod``: 2 on rank 0, 1 elsewhere,
so products stay small), or for the copying collectives a value that names source and
destination; the expected result is worked out from those constants, so every result is
checked exactly, outside the timed region.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any, final

import attrs
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._communicator import Communicator

__all__ = ["CASES", "DEFAULT_COLLECTIVES", "Case", "Prepared"]

DEFAULT_COLLECTIVES = ("allreduce", "broadcast", "barrier")


@final
@attrs.frozen
class Prepared:
    """One cell's buffers: ``reset`` refills the inputs (untimed), ``call`` is the timed
    collective, ``check`` says whether its result was right."""

    nbytes: int
    reset: Callable[[], None]
    call: Callable[[], Awaitable[Any]]
    check: Callable[[Any], bool]


@final
@attrs.frozen
class Case:
    name: str
    #: Whether ``--op`` applies to it.
    reduces: bool
    #: Bus bandwidth over algorithm bandwidth, by world size.
    factor: Callable[[int], float]
    prepare: Callable[[Communicator, int, np.dtype[Any], str], Prepared]


def _value(rank: int, op: str) -> int:
    return 1 + (rank == 0) if op == "prod" else rank + 1


_COMBINE: dict[str, Callable[[int, int], int]] = {
    "min": min,
    "max": max,
    "prod": operator.mul,
    "band": operator.and_,
    "bor": operator.or_,
    "bxor": operator.xor,
}


def _reduced(op: str, ranks: range) -> float:
    """The op over the constant inputs of ``ranks``."""
    values = [_value(q, op) for q in ranks]
    if op in ("sum", "mean"):
        return sum(values) / len(values) if op == "mean" else sum(values)
    return functools.reduce(_COMBINE[op], values)


def _identity(op: str, dtype: np.dtype[Any]) -> float:
    """What exscan leaves on rank 0: the op's identity in ``dtype``."""
    if op in ("sum", "bor", "bxor"):
        return 0
    if op == "prod":
        return 1
    if op == "band":
        return -1 if dtype.kind == "i" else int(np.iinfo(dtype).max)
    info = np.finfo(dtype) if dtype.kind in "fc" else np.iinfo(dtype)
    extreme = info.max if op == "min" else info.min
    return float(np.inf if op == "min" else -np.inf) if dtype.kind == "f" else int(extreme)


def _blocks(count: int, n: int) -> int:
    return max(1, count // n)


def _allreduce(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    array = np.empty(count, dtype)
    expected = _reduced(op, range(comm.world_size))
    return Prepared(
        array.nbytes,
        lambda: array.fill(_value(comm.rank, op)),
        lambda: comm.allreduce(array, op=op),
        lambda _: bool(np.all(array == expected)),
    )


def _broadcast(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    # From the last rank: rank 0 is special in too many implementations to be the only root.
    n, array = comm.world_size, np.empty(count, dtype)
    return Prepared(
        array.nbytes,
        lambda: array.fill(comm.rank + 1),
        lambda: comm.broadcast(array, root=n - 1),
        lambda _: bool(np.all(array == n)),
    )


def _barrier(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    return Prepared(0, lambda: None, comm.barrier, lambda _: True)


def _reduce(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r, array = comm.world_size, comm.rank, np.empty(count, dtype)
    # Non-root arrays must come back unchanged, so they are checked too.
    expected = _reduced(op, range(n)) if r == n - 1 else _value(r, op)
    return Prepared(
        array.nbytes,
        lambda: array.fill(_value(r, op)),
        lambda: comm.reduce(array, root=n - 1, op=op),
        lambda _: bool(np.all(array == expected)),
    )


def _rows(n: int, k: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """Row i is ``i + 1``: the blocks of every rank, as gathered."""
    return np.repeat(np.arange(1, n + 1, dtype=dtype), k).reshape(n, k)


def _allgather(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k = _blocks(count, n)
    x, out, expected = np.full(k, r + 1, dtype), np.empty((n, k), dtype), _rows(n, k, dtype)
    return Prepared(
        out.nbytes,
        lambda: out.fill(0),
        lambda: comm.allgather(x, out=out),
        lambda _: bool(np.array_equal(out, expected)),
    )


def _allgatherv(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k = _blocks(count, n)
    x, out, expected = np.full(k, r + 1, dtype), np.empty(n * k, dtype), _rows(n, k, dtype)
    return Prepared(
        out.nbytes,
        lambda: out.fill(0),
        lambda: comm.allgatherv(x, out=out),
        lambda parts: bool(np.array_equal(np.stack(parts), expected)),
    )


def _reduce_scatter(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k = _blocks(count, n)
    array, out = np.full(n * k, _value(r, op), dtype), np.empty(k, dtype)
    expected = _reduced(op, range(n))
    return Prepared(
        array.nbytes,
        lambda: out.fill(0),
        lambda: comm.reduce_scatter(array, op=op, out=out),
        lambda _: bool(np.all(out == expected)),
    )


def _reduce_scatterv(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k = _blocks(count, n)
    array, out = np.full(n * k, _value(r, op), dtype), np.empty(k, dtype)
    expected, counts = _reduced(op, range(n)), [k] * n
    return Prepared(
        array.nbytes,
        lambda: out.fill(0),
        lambda: comm.reduce_scatterv(array, counts=counts, op=op, out=out),
        lambda _: bool(np.all(out == expected)),
    )


def _gather(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k, root = _blocks(count, n), n - 1
    x, expected = np.full(k, r + 1, dtype), _rows(n, k, dtype)
    out = np.empty((n, k), dtype) if r == root else None
    return Prepared(
        n * x.nbytes,
        lambda: None if out is None else out.fill(0),
        lambda: comm.gather(x, root=root, out=out),
        lambda got: got is None if r != root else bool(np.array_equal(got, expected)),
    )


def _gatherv(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k, root = _blocks(count, n), n - 1
    x, expected = np.full(k, r + 1, dtype), _rows(n, k, dtype)
    return Prepared(
        n * x.nbytes,
        lambda: None,
        lambda: comm.gatherv(x, root=root),
        lambda got: got is None if r != root else bool(np.array_equal(np.stack(got), expected)),
    )


def _scatter(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k, root = _blocks(count, n), n - 1
    blocks = _rows(n, k, dtype) if r == root else None
    out = np.empty(k, dtype)
    return Prepared(
        n * out.nbytes,
        lambda: out.fill(0),
        lambda: comm.scatter(blocks, root=root, out=out),
        lambda _: bool(np.all(out == r + 1)),
    )


def _scatterv(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k, root = _blocks(count, n), n - 1
    parts = list(_rows(n, k, dtype)) if r == root else None
    return Prepared(
        n * k * dtype.itemsize,
        lambda: None,
        lambda: comm.scatterv(parts, root=root),
        lambda got: bool(np.all(got == r + 1)) and got.shape == (k,),
    )


def _exchanged(n: int, k: int, source: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """What rank ``source`` sends in an alltoall: block j is ``source * n + j + 1``."""
    return np.repeat(np.arange(source * n + 1, source * n + n + 1, dtype=dtype), k).reshape(n, k)


def _alltoall(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k = _blocks(count, n)
    x, out = _exchanged(n, k, r, dtype), np.empty((n, k), dtype)
    expected = np.stack([_exchanged(n, k, q, dtype)[r] for q in range(n)])
    return Prepared(
        x.nbytes,
        lambda: out.fill(0),
        lambda: comm.alltoall(x, out=out),
        lambda _: bool(np.array_equal(out, expected)),
    )


def _alltoallv(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    n, r = comm.world_size, comm.rank
    k = _blocks(count, n)
    parts = list(_exchanged(n, k, r, dtype))
    expected = np.stack([_exchanged(n, k, q, dtype)[r] for q in range(n)])
    return Prepared(
        n * k * dtype.itemsize,
        lambda: None,
        lambda: comm.alltoallv(parts),
        lambda got: bool(np.array_equal(np.stack(got), expected)),
    )


def _scan(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    r, array = comm.rank, np.empty(count, dtype)
    expected = _reduced(op, range(r + 1))
    return Prepared(
        array.nbytes,
        lambda: array.fill(_value(r, op)),
        lambda: comm.scan(array, op=op),
        lambda _: bool(np.all(array == expected)),
    )


def _exscan(comm: Communicator, count: int, dtype: np.dtype[Any], op: str) -> Prepared:
    r, array = comm.rank, np.empty(count, dtype)
    expected = _reduced(op, range(r)) if r else _identity(op, dtype)
    return Prepared(
        array.nbytes,
        lambda: array.fill(_value(r, op)),
        lambda: comm.exscan(array, op=op),
        lambda _: bool(np.all(array == np.asarray(expected).astype(dtype))),
    )


def _one(n: int) -> float:
    return 1.0


def _share(n: int) -> float:
    return (n - 1) / n


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("allreduce", True, lambda n: 2 * (n - 1) / n, _allreduce),
        Case("broadcast", False, _one, _broadcast),
        Case("barrier", False, _one, _barrier),
        Case("reduce", True, _one, _reduce),
        Case("allgather", False, _share, _allgather),
        Case("allgatherv", False, _share, _allgatherv),
        Case("reduce_scatter", True, _share, _reduce_scatter),
        Case("reduce_scatterv", True, _share, _reduce_scatterv),
        Case("gather", False, _share, _gather),
        Case("gatherv", False, _share, _gatherv),
        Case("scatter", False, _share, _scatter),
        Case("scatterv", False, _share, _scatterv),
        Case("alltoall", False, _share, _alltoall),
        Case("alltoallv", False, _share, _alltoallv),
        Case("scan", True, _one, _scan),
        Case("exscan", True, _one, _exscan),
    )
}
