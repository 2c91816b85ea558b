"""Worker for ``test_multiprocess.py``: one rank of a world that runs the collective matrix.

Run as ``matrix_worker.py matrix OUT_DIR INDEX``. Every rank runs :func:`cases` in order,
on inputs from :func:`make_input` (a function of the case index and the rank only, so the test
can recompute every rank's input), and saves each case's array after the collective to
``OUT_DIR/rank{RANK}.npz`` under the key ``c{index}``. The test imports this module for
:func:`cases` and :func:`make_input`, so it must stay importable without side effects.
"""

from __future__ import annotations

import io
import math
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import trio

from trioring._wire import DTYPES as WIRE_DTYPES

if TYPE_CHECKING:
    from _worker_util import Reporter

    import trioring

#: Every dtype trioring supports, from the one list of them (the wire's dtype codes), but
#: bool: the matrix's ops are the arithmetic ones, which bool refuses but for min and max
#: (tests/test_reduce.py runs bool's ops).
DTYPES = tuple(dtype.name for dtype in WIRE_DTYPES if dtype.kind != "b")
OPS = ("sum", "mean", "min", "max", "prod")
# 0-d, empty, fewer elements than ranks, 2-D, and a size no world size divides.
SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (1,), (3,), (4, 5), (1031,))
#: Float inputs of sum and mean lie in [-SUM_BOUND, SUM_BOUND] (each component, for complex).
SUM_BOUND = 2.0
MATRIX_TIMEOUT_S = 40.0


class Case(NamedTuple):
    kind: str  # "allreduce", "broadcast" or "barrier"
    dtype: str = ""
    shape: tuple[int, ...] = ()
    op: str = ""
    root: int = 0

    def __str__(self) -> str:
        if self.kind == "barrier":
            return "barrier"
        what = f"op={self.op}" if self.kind == "allreduce" else f"root={self.root}"
        return f"{self.kind}({what}) {self.dtype}{list(self.shape)}"


def refused(op: str, dtype: str) -> bool:
    """Whether ``allreduce(op=op)`` refuses ``dtype`` (mean of ints, min/max of complex)."""
    kind = np.dtype(dtype).kind
    return (op == "mean" and kind in "iu") or (op in ("min", "max") and kind == "c")


def cases(world_size: int) -> list[Case]:
    out: list[Case] = []
    for op in OPS:
        for dtype in DTYPES:
            if not refused(op, dtype):
                out += [Case("allreduce", dtype, shape, op) for shape in SHAPES]
        out.append(Case("barrier"))
    for root in range(world_size):
        for dtype in DTYPES:
            out += [Case("broadcast", dtype, shape, root=root) for shape in SHAPES]
        out.append(Case("barrier"))
    # Several 1 MiB chunks per array, and per ring segment too for the float64 sum (5.6 MB).
    out += [
        Case("allreduce", "float64", (700_003,), "sum"),
        Case("allreduce", "float32", (600_000,), "mean"),
        Case("allreduce", "int32", (700_001,), "max"),
        Case("allreduce", "complex64", (300_007,), "prod"),
        Case("barrier"),
        Case("broadcast", "float32", (600_000,), root=world_size - 1),
        Case("broadcast", "complex128", (150_001,), root=0),
        Case("barrier"),
    ]
    return out


def _floats(rng: np.random.Generator, case: Case, dtype: np.dtype[Any]) -> np.ndarray:
    shape = case.shape
    if case.op == "prod":
        # Magnitudes in [0.5, 2): a product of 4 neither overflows nor underflows.
        magnitude = rng.uniform(0.5, 2.0, shape)
        if dtype.kind == "c":
            return magnitude * np.exp(1j * rng.uniform(0, 2 * math.pi, shape))
        return magnitude * rng.choice([-1.0, 1.0], shape)
    bound = 100.0 if case.op in ("min", "max") else SUM_BOUND
    values = rng.uniform(-bound, bound, shape)
    if dtype.kind == "c":
        values = values + 1j * rng.uniform(-bound, bound, shape)
    return values


def make_input(case: Case, index: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s input for case number ``index`` (a writable, C-contiguous array)."""
    rng = np.random.default_rng([index, rank])
    dtype = np.dtype(case.dtype)
    if case.kind == "broadcast":
        # Arbitrary bytes (NaNs with payloads included): a broadcast must copy them exactly.
        size = math.prod(case.shape) * dtype.itemsize
        raw = rng.integers(0, 256, size, dtype=np.uint8)
        return raw.view(dtype).reshape(case.shape)
    if dtype.kind in "iu":
        # The whole range: sums and products wrap around, identically in any order.
        info = np.iinfo(dtype)
        return np.array(rng.integers(info.min, info.max, case.shape, dtype, endpoint=True))
    values = np.array(_floats(rng, case, dtype), dtype=dtype)
    # No zeros, so no -0.0/+0.0 ties whose min/max depends on the order of comparison.
    values[values == 0] = 1
    return values


async def matrix(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    with trio.fail_after(MATRIX_TIMEOUT_S):
        await _matrix(reporter, comm)


async def _matrix(reporter: Reporter, comm: trioring.Communicator) -> None:
    started = time.monotonic()
    # Refused combinations raise before any I/O and leave the communicator usable.
    refusals: dict[str, str] = {}
    for op in OPS:
        for dtype in DTYPES:
            if refused(op, dtype):
                try:
                    await comm.allreduce(np.ones(3, dtype), op=op)
                except Exception as exc:
                    refusals[f"{op}/{dtype}"] = type(exc).__name__
                else:
                    refusals[f"{op}/{dtype}"] = "no error"
    seq_after_refusals = comm.seq
    results: dict[str, np.ndarray] = {}
    for index, case in enumerate(cases(comm.world_size)):
        if case.kind == "barrier":
            await comm.barrier()
            continue
        array = make_input(case, index, comm.rank)
        if case.kind == "allreduce":
            await comm.allreduce(array, op=case.op)
        else:
            await comm.broadcast(array, root=case.root)
        results[f"c{index}"] = array
    buffer = io.BytesIO()
    np.savez(buffer, **results)
    reporter.write(f"rank{comm.rank}.npz", buffer.getvalue())
    reporter.record(
        "matrix",
        started,
        None,
        refusals=refusals,
        seq_after_refusals=seq_after_refusals,
        seq=comm.seq,
        broken=comm.broken,
    )


if __name__ == "__main__":
    import _worker_util

    _worker_util.main({"matrix": matrix})
