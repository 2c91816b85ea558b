"""One rank of tests/test_every_collective.py: every collective of the Communicator, each at
sizes from empty to several chunks, on seeded inputs, checked against numpy.

``trioring run -n N --transport T every_collective_worker.py OUT_DIR``. Every rank makes
every rank's inputs (the same seeds), so it knows every result; the report
(``rank{RANK}.json``) lists what was wrong, the features the communicator used, the number
of collectives run (its sequence number at the end), and a digest of every result that the
collective promises to be bitwise identical on every rank.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

import trioring

sys.path.insert(0, str(Path(__file__).parent.parent))
from exact_inputs import make

if TYPE_CHECKING:
    from collections.abc import Callable

UFUNCS: dict[str, np.ufunc] = {
    "sum": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
#: (elements per rank or per block, dtype, op): empty, one, odd, and 300,001 float32s
#: (1.2 MB: over the 1 MiB chunk and over the size where cross-memory attach takes over).
CASES = [
    (0, "float32", "sum"),
    (1, "int64", "max"),
    (7, "bool", "bor"),
    (333, "float64", "min"),
    (300_001, "float32", "sum"),
]


class Checker:
    def __init__(self, comm: trioring.Communicator) -> None:
        self.n, self.r = comm.world_size, comm.rank
        self.errors: list[str] = []
        self.digest = hashlib.sha256()

    def expect(self, what: str, got: Any, want: Any, *, identical: bool = False) -> None:
        if isinstance(want, list):
            ok = isinstance(got, list) and len(got) == len(want)
            ok = ok and all(_same(g, w) for g, w in zip(got, want, strict=False))
        elif want is None:
            ok = got is None
        else:
            ok = _same(got, want)
        if not ok:
            self.errors.append(f"rank {self.r}: {what}: wrong result")
        if identical:
            for part in got if isinstance(got, list) else [got]:
                self.digest.update(np.ascontiguousarray(part).tobytes())


def _same(got: Any, want: np.ndarray[Any, Any]) -> bool:
    return (
        isinstance(got, np.ndarray)
        and got.dtype == want.dtype
        and got.shape == want.shape
        and np.array_equal(got, want)
    )


def inputs(seed: int, n: int, count: int, dtype: str, op: str) -> list[np.ndarray[Any, Any]]:
    return [make(seed, q, count, np.dtype(dtype), op) for q in range(n)]


def uneven(count: int, n: int, q: int) -> int:
    """Rank q's share in the uneven variants: some ranks send nothing."""
    return 0 if q % 3 == 1 else count + q


async def run_all(comm: trioring.Communicator, check: Checker) -> None:
    n, r = check.n, check.r
    for seed, (count, dtype, op) in enumerate(CASES):
        ufunc: Callable[..., Any] = UFUNCS[op]
        label = f"{dtype}[{count}] {op}"
        xs = inputs(seed, n, count, dtype, op)
        total = ufunc.reduce(np.stack(xs), axis=0)
        root = (seed + 1) % n

        a = xs[r].copy()
        await comm.allreduce(a, op=op)
        check.expect(f"allreduce {label}", a, total, identical=True)
        a = xs[r].copy()
        await comm.broadcast(a, root=root)
        check.expect(f"broadcast {label}", a, xs[root], identical=True)
        a = xs[r].copy()
        await comm.reduce(a, root=root, op=op)
        check.expect(f"reduce {label}", a, total if r == root else xs[r])
        a = xs[r].copy()
        await comm.scan(a, op=op)
        check.expect(f"scan {label}", a, ufunc.reduce(np.stack(xs[: r + 1]), axis=0))
        if r:
            a = xs[r].copy()
            await comm.exscan(a, op=op)
            check.expect(f"exscan {label}", a, ufunc.reduce(np.stack(xs[:r]), axis=0))
        else:
            await comm.exscan(xs[r].copy(), op=op)  # rank 0's identity: tests/test_scan.py

        check.expect(
            f"allgather {label}", await comm.allgather(xs[r]), np.stack(xs), identical=True
        )
        check.expect(
            f"gather {label}",
            await comm.gather(xs[r], root=root),
            np.stack(xs) if r == root else None,
        )
        blocks = inputs(seed + 100, n, count, dtype, op)
        scattered = await comm.scatter(np.stack(blocks) if r == root else None, root=root)
        check.expect(f"scatter {label}", scattered, blocks[r])
        rows = [inputs(seed + 200 + q, n, count, dtype, op) for q in range(n)]
        sent = np.stack(rows[r])
        check.expect(
            f"alltoall {label}", await comm.alltoall(sent), np.stack([rows[q][r] for q in range(n)])
        )
        parts = inputs(seed + 300, n, n * count, dtype, op)  # n blocks of count per rank
        check.expect(
            f"reduce_scatter {label}",
            await comm.reduce_scatter(parts[r], op=op),
            ufunc.reduce(np.stack(parts), axis=0)[r * count : (r + 1) * count],
        )

        # The uneven variants: rank q's share is uneven(count, n, q), zero on some ranks.
        shares = [uneven(count, n, q) for q in range(n)]
        vs = [make(seed + 400, q, shares[q], np.dtype(dtype), op) for q in range(n)]
        check.expect(f"allgatherv {label}", await comm.allgatherv(vs[r]), vs, identical=True)
        check.expect(
            f"gatherv {label}",
            await comm.gatherv(vs[r], root=root),
            vs if r == root else None,
        )
        got = await comm.scatterv(vs if r == root else None, root=root)
        check.expect(f"scatterv {label}", got, vs[r])
        sends = [
            [
                make(seed + 500 + q, p, uneven(count, n, (q + p) % n), np.dtype(dtype), op)
                for p in range(n)
            ]
            for q in range(n)
        ]
        check.expect(
            f"alltoallv {label}",
            await comm.alltoallv(sends[r]),
            [sends[q][r] for q in range(n)],
        )
        whole = make(seed + 600, r, sum(shares), np.dtype(dtype), op)
        alls = [make(seed + 600, q, sum(shares), np.dtype(dtype), op) for q in range(n)]
        start = sum(shares[:r])
        check.expect(
            f"reduce_scatterv {label}",
            await comm.reduce_scatterv(whole, counts=shares, op=op),
            ufunc.reduce(np.stack(alls), axis=0)[start : start + shares[r]],
        )
    await comm.barrier()


async def main(out_dir: Path) -> None:
    async with trioring.open_communicator() as comm:
        check = Checker(comm)
        await run_all(comm, check)
        report = {
            "errors": check.errors,
            "features": sorted(comm.features),
            "seq": comm.seq,
            "digest": check.digest.hexdigest(),
        }
        (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
