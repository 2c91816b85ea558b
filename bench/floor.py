"""The Python floor: the least a 4-byte allreduce between Python processes costs here.

    .venv/bin/python bench/floor.py [--n 2,4] [--calls 20000] [--json out.json]

N processes (forked, sharing one anonymous MAP_SHARED page made before the fork) run the
smallest exchange one can write in Python: one "allreduce" is each rank writing its 4-byte
value and bumping its counter, waiting until every peer's counter reached the same value
(polling, with ``os.sched_yield`` between looks), and summing the values. The "barrier"
variant bumps and waits with no payload. No event loop, no frames, no system call but the
yield: what is left is the interpreter and the scheduler, so no Python collective on this
machine can be faster. Each variant runs twice: lean (plain ints through
``memoryview.cast``) and with numpy scalar indexing (``array[i]``), to show what numpy's
per-element overhead costs at this scale.

Reported: the median time per call of the slowest rank (each call timed on every rank, the
max over ranks per call, as the benchmarks do), p10, p90 and the mean (about the wall time
over the number of calls: the median is lower when a few calls wait for a descheduled
rank), back to back, after a tenth as many untimed calls; at most ``--calls`` calls or about ``--seconds`` of them. Each rank's
value lives in one of two slots, by the call's parity: a rank reaches call c + 2 only after
every peer bumped to c + 1, that is, finished reading call c, so no value is overwritten
while a peer may still read it. Relies on x86-64's store order (the value is visible before
the counter), as trioring's shared segment does.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pickle
import time
from array import array
from pathlib import Path

import numpy as np

#: One 64-byte line per rank, 8 of them; then the stop word.
LINE = 64
STOP = 8 * LINE


def rank_loop(q, v, r: int, n: int, calls: int, payload: bool, seconds: float) -> array:
    """Rank ``r``'s loop over the page, seen as uint64 words ``q`` and int32 words ``v``
    (memoryviews or numpy arrays: the only difference between the variants): counters at
    word 0 of each rank's line, the two value slots at int32 4 and 5 (bytes 16 and 20)."""
    mine, stop_at = r * LINE // 8, STOP // 8
    counters = [p * LINE // 8 for p in range(n) if p != r]
    values = [p * LINE // 4 + 4 for p in range(n)]
    yield_, clock = os.sched_yield, time.perf_counter
    times = array("d", bytes(8 * calls))
    value = r + 1
    deadline = clock() + seconds
    c = total = 0
    while c < calls and c < q[stop_at]:
        start = clock()
        c += 1
        if payload:
            v[values[r] + (c & 1)] = value
        q[mine] = c
        for counter in counters:
            while q[counter] < c:
                yield_()
        if payload:
            total = 0
            for slot in values:
                total += v[slot + (c & 1)]
        times[c - 1] = clock() - start
        if r == 0 and start > deadline and q[stop_at] > c + 1:
            q[stop_at] = c + 1  # everyone makes call c + 1, then stops
    if payload and total != n * (n + 1) // 2:
        raise SystemExit(f"rank {r}: sum {total}, expected {n * (n + 1) // 2}")
    return times[:c]


def rank_lean(page: mmap.mmap, r: int, n: int, calls: int, payload: bool, seconds: float) -> array:
    """The loop with plain ints, through ``memoryview.cast``."""
    q, v = memoryview(page).cast("Q"), memoryview(page).cast("i")
    try:
        return rank_loop(q, v, r, n, calls, payload, seconds)
    finally:
        q.release()
        v.release()


def rank_numpy(page: mmap.mmap, r: int, n: int, calls: int, payload: bool, seconds: float) -> array:
    """The same loop through numpy arrays over the page, indexed one element at a time."""
    q, v = np.frombuffer(page, dtype=np.uint64), np.frombuffer(page, dtype=np.int32)
    return rank_loop(q, v, r, n, calls, payload, seconds)


VARIANTS = {
    "allreduce": (rank_lean, True),
    "barrier": (rank_lean, False),
    "allreduce, numpy indexing": (rank_numpy, True),
    "barrier, numpy indexing": (rank_numpy, False),
}


def measure(n: int, variant: str, calls: int, seconds: float) -> dict:
    """Fork ``n`` ranks over a fresh page; the slowest rank's time per call."""
    loop, payload = VARIANTS[variant]
    warmup = calls // 10
    page = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous and MAP_SHARED: the children share it
    memoryview(page).cast("Q")[STOP // 8] = 2**63
    children = []
    for r in range(n):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            os.close(read)
            status = 0
            try:
                times = loop(page, r, n, warmup + calls, payload, seconds)
                with os.fdopen(write, "wb") as out:
                    pickle.dump(times[warmup:].tolist(), out)
            except BaseException as error:  # any failure ends the child
                print(f"floor: rank {r}: {error!r}", flush=True)
                status = 1
            os._exit(status)
        os.close(write)
        children.append((pid, read))
    per_rank = []
    for pid, read in children:
        with os.fdopen(read, "rb") as source:
            data = source.read()
        _, status = os.waitpid(pid, 0)
        if status or not data:
            raise SystemExit(f"floor: a rank of {variant!r} at world {n} failed")
        per_rank.append(pickle.loads(data))
    page.close()
    count = min(len(t) for t in per_rank)
    slowest = np.max([np.asarray(t[:count]) for t in per_rank], axis=0)
    return {
        "world_size": n,
        "variant": variant,
        "calls": count,
        "median_us": float(np.median(slowest)) * 1e6,
        "p10_us": float(np.percentile(slowest, 10)) * 1e6,
        "p90_us": float(np.percentile(slowest, 90)) * 1e6,
        "mean_us": float(np.mean(slowest)) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="2,4", help="comma list of world sizes (default 2,4)")
    parser.add_argument("--calls", type=int, default=20_000, help="timed calls at most")
    parser.add_argument("--seconds", type=float, default=3.0, help="stop after about this long")
    parser.add_argument("--json")
    args = parser.parse_args()
    worlds = [int(w) for w in args.n.split(",")]
    if any(not 2 <= w <= 8 for w in worlds):
        raise SystemExit("floor: world sizes from 2 to 8")
    print(
        f"# Python floor on {os.cpu_count()} cores: shared page, sched_yield polling, back to back"
    )
    print(
        f"{'world':>5} {'variant':>26} {'calls':>6} {'median us':>10} {'p10 us':>8} "
        f"{'p90 us':>8} {'mean us':>8}"
    )
    rows = []
    for n in worlds:
        for variant in VARIANTS:
            row = measure(n, variant, args.calls, args.seconds)
            rows.append(row)
            print(f"{n:>5} {variant:>26} {row['calls']:>6} {row['median_us']:>10.2f} "
                  f"{row['p10_us']:>8.2f} {row['p90_us']:>8.2f} {row['mean_us']:>8.2f}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"floor": rows}, indent=1))


if __name__ == "__main__":
    main()
