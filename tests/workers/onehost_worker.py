"""One rank of tests/test_onehost_copies.py: a copying collective (allgather, allgatherv,
gather, scatter, alltoall), or reduce_scatter(v) or reduce, forced onto a one-host path
(``shm``, ``pipe`` or ``cma``), or a scatter, scatterv, allgatherv, gatherv or alltoallv
left to the decision table (``auto``: on each side of where the shared segment's slots stop
taking them), at sizes from empty to several chunks, on seeded inputs, checked exactly, with each
rank's buffers overwritten the moment the call returns (a peer still reading them would get
garbage).

``trioring run -n N --transport unix onehost_worker.py COLLECTIVE ALGORITHM OUT_DIR``; the
report (``rank{RANK}.json``) lists what was wrong, the features, and what a call too large
for the forced path raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import trio

import trioring
from trioring._collectives import _decision
from trioring._collectives._scatter import SHM_SCATTER_BYTES
from trioring._onehost._shm import PIPE_CHUNK_BYTES, PIPE_CHUNKS, SHM_MAX_BYTES

DTYPES = ("float32", "int8", "float64", "bool", "complex64")


def make(seed: int, rank: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    return np.random.default_rng([seed, rank]).integers(-9, 9, count).astype(dtype)


def slot_limit(comm: trioring.Communicator, collective: str) -> int:
    """The most bytes a forced ``shm`` call of ``collective`` takes here (a reduction's
    whole input): the whole slot for gather, the reductions' share of the slot and the
    scratch for reduce and reduce_scatter, SHM_MAX_BYTES for the others."""
    if collective in ("reduce", "reduce_scatter"):
        return comm._world.slot_wide_reduce_bytes
    return _decision.shm_copy_bytes(collective)


def counts(algorithm: str, collective: str, n: int, itemsize: int, limit: int) -> list[int]:
    """Block sizes: for the shared segment up to what a rank may write to its slot
    (``limit`` bytes); for a scatter left to the decision table, each side of where the
    root's slot (which holds the other ranks' blocks, not its own) stops carrying it."""
    if algorithm == "cma":
        return [0, 1, 5, 1000, 300_001]
    if algorithm == "pipe":
        # The last: a block of more than the whole ring, ending in a partial chunk.
        wrapping = [PIPE_CHUNKS * PIPE_CHUNK_BYTES // itemsize + 3] if itemsize == 4 else []
        return [0, 1, 5, 1000, 300_001, *wrapping]
    if algorithm == "auto" and collective == "scatter":
        most = SHM_SCATTER_BYTES // ((n - 1) * itemsize)
        return [0, 1, 5, most - 1, most, most + 1]
    if algorithm == "auto":
        # The uneven ones: each side of where a rank's data stops fitting its slot beside
        # its counts (1-d blocks: allgatherv's counts take 4 int64s, gatherv's 2,
        # alltoallv's 2 per rank), so that some ranks' blocks fit and others' do not.
        if collective == "scatterv":
            # The root's slot: its header, a flag, the shapes, the others' blocks.
            most = (SHM_SCATTER_BYTES - 8 - 8 * n) // itemsize // (n - 1)
            return [0, 1, 5, most - 2, most - 1, most, most + 1]
        words = {"allgatherv": 4, "gatherv": 2, "alltoallv": 2 * n}[collective]
        most = (SHM_MAX_BYTES - 8 * words) // itemsize
        if collective == "alltoallv":
            most //= n - 1
        return [0, 1, 5, most - 2, most - 1, most, most + 1]
    # Blocks a rank writes to its slot; a reduce_scatter's whole input (n blocks) counts.
    whole = {"alltoall": n - 1, "reduce_scatter": n}.get(collective, 1)
    return [0, 1, 5, limit // (itemsize * whole)]


async def one(
    comm: trioring.Communicator, collective: str, seed: int, count: int, dtype: str
) -> bool:
    n, r = comm.world_size, comm.rank
    root = seed % n
    checker = (seed + r) % 2 == 0  # the others overwrite their buffers at once
    xs = [make(seed, q, count, dtype) for q in range(n)]
    mine = xs[r].copy()
    if collective == "allgather":
        want: Any = np.stack(xs)
        if seed % 2:
            # In place: x is this rank's block of out=, which is what its peers read.
            out = np.full((n, count), 7, dtype)
            out[r] = mine
            got = await comm.allgather(out[r], out=out)
            # Overwriting the result overwrites the block the peers read.
            mine = None if checker else got
        else:
            got = await comm.allgather(mine)
    elif collective == "allgatherv":
        # Rank q's block has count + q rows (none on every third rank), so that at some
        # counts the lower ranks' blocks fit their slots and the higher ones' do not.
        shares = [make(seed, q, (count + q) * (q % 3 != 2), dtype) for q in range(n)]
        mine = shares[r].copy()
        got = await comm.allgatherv(mine)
        mine.fill(0)
        return not checker or all(np.array_equal(g, w) for g, w in zip(got, shares, strict=True))
    elif collective == "gatherv":
        # As for allgatherv.
        shares = [make(seed, q, (count + q) * (q % 3 != 2), dtype) for q in range(n)]
        mine = shares[r].copy()
        got = await comm.gatherv(mine, root=root)
        mine.fill(0)
        if r != root:
            return got is None
        return all(np.array_equal(g, w) for g, w in zip(got, shares, strict=True))
    elif collective == "scatterv":
        # Rank q's block has count + (q + seed) % 3 rows (none where that is 2), so that
        # at some counts the root's slot takes them and at others it does not; the
        # ranks pass out= on some calls, which ends the call with a barrier.
        sizes = [(count + (q + seed) % 3) * ((q + seed) % 3 != 2) for q in range(n)]
        blocks_v = [make(seed + 1, q, sizes[q], dtype) for q in range(n)]
        mine_v = [block.copy() for block in blocks_v] if r == root else None
        if seed % 2:
            got = await comm.scatterv(mine_v, root=root, out=np.empty(sizes[r], dtype))
        else:
            got = await comm.scatterv(mine_v, root=root)
        for block in mine_v or []:
            block.fill(0)
        return bool(got.dtype == blocks_v[r].dtype and np.array_equal(got, blocks_v[r]))
    elif collective == "alltoallv":
        # Rank p sends count + (p + 2 q) % 3 rows to rank q (none where p + q is 4).
        def rows(p: int, q: int) -> int:
            return (count + (p + 2 * q) % 3) * (p + q != 4)

        sent = [make(seed + 10 * q, r, rows(r, q), dtype) for q in range(n)]
        mine_v = [block.copy() for block in sent]
        got = await comm.alltoallv(mine_v)
        for block in mine_v:
            block.fill(0)
        want_v = [make(seed + 10 * r, q, rows(q, r), dtype) for q in range(n)]
        return not checker or all(np.array_equal(g, w) for g, w in zip(got, want_v, strict=True))
    elif collective == "gather":
        # The root passes no out=, a separate one, or one whose own block is its x.
        form = seed % 3 if r == root else 0
        if form:
            out = np.full((n, count), 7, dtype)
            if form == 2:
                out[r] = mine
                mine = out[r]
            got = await comm.gather(mine, root=root, out=out)
            if form == 2:
                mine = None  # part of the result now
        else:
            got = await comm.gather(mine, root=root)
        want = np.stack(xs) if r == root else None
    elif collective == "scatter":
        blocks = np.stack([make(seed + 1, q, count, dtype) for q in range(n)])
        mine = blocks.copy() if r == root else None
        # Some ranks pass out= (the segment folds every rank's header then), some not.
        out = np.full(count, 7, dtype) if (seed + r) % 3 == 0 else None
        got = await comm.scatter(mine, root=root, out=out)
        if out is not None and got is not out:
            return False
        want = blocks[r]
    elif collective in ("reduce_scatter", "reduce_scatterv"):
        if dtype == "bool":
            return True  # no sum of bools
        xs = [make(seed, q, n * count, dtype) for q in range(n)]
        mine = xs[r].copy()
        if collective == "reduce_scatter":
            got = await comm.reduce_scatter(mine)
            lo, hi = r * count, (r + 1) * count
        else:
            # Uneven blocks: rank 0's empty, the last one's the largest.
            shares = [0, *([n * count // (n - 1)] * (n - 1))]
            shares[-1] += n * count - sum(shares)
            got = await comm.reduce_scatterv(mine, counts=shares)
            lo = sum(shares[:r])
            hi = lo + shares[r]
        want = np.sum(np.stack(xs), axis=0, dtype=dtype)[lo:hi]
    elif collective == "reduce":
        if dtype == "bool":
            return True
        xs = [make(seed, q, count, dtype) for q in range(n)]
        mine = xs[r].copy()
        await comm.reduce(mine, root=root)
        # The root's array is the result; the others' must be as they were.
        got = mine.copy()
        want = np.sum(np.stack(xs), axis=0, dtype=dtype) if r == root else xs[r]
    else:
        sent = np.stack([make(seed + 10 * q, r, count, dtype) for q in range(n)])
        mine = sent.copy()
        got = await comm.alltoall(mine)
        want = np.stack([make(seed + 10 * r, q, count, dtype) for q in range(n)])
    if mine is not None:
        mine.fill(0)
    if not checker:
        return True
    if want is None:
        return got is None
    return bool(got.dtype == want.dtype and np.array_equal(got.reshape(want.shape), want))


async def main(collective: str, algorithm: str, out_dir: Path) -> None:
    errors: list[str] = []
    async with trioring.open_communicator() as comm:
        if algorithm != "auto":
            comm._force_algorithm(collective, algorithm)
        seed = 0
        for dtype in DTYPES:
            itemsize = np.dtype(dtype).itemsize
            limit = slot_limit(comm, collective)
            for count in counts(algorithm, collective, comm.world_size, itemsize, limit):
                seed += 1
                if not await one(comm, collective, seed, count, dtype):
                    errors.append(f"rank {comm.rank}: {collective} {dtype}[{count}] #{seed}")
        refused = None
        if algorithm == "shm" and collective != "allgatherv":
            before = comm.seq
            try:
                # One byte (or, for a reduce_scatter, one block of one) too many.
                await one(comm, collective, 999, slot_limit(comm, collective) + 1, "uint8")
            except trioring.InvalidArgumentError as exc:
                refused = {"message": str(exc), "seq_unchanged": comm.seq == before}
        await comm.barrier()
        report = {"errors": errors, "features": sorted(comm.features), "refused": refused}
        (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], Path(sys.argv[3]))
