"""What a slot's cache lines cost once the peer has read them: the measurement behind
``_shm_reductions.shm_allreduce`` reading each rank's own values from its array.

    .venv/bin/python bench/slot_lines.py [--kib 64,256] [--rounds 3000]

Two forked processes share one anonymous ``MAP_SHARED`` mapping, two slots each (by the
round's parity, as trioring's segment alternates them), and run trioring's shared-memory
allreduce with numpy and nothing else: each refills its array (as the benchmarks refill
theirs), copies it into its slot, bumps its counter, waits (polling, ``os.sched_yield``
between looks) for the peer's, and reduces the two in rank order into its array, either
reading both slots (``slots``: the way before) or its own values from its array
(``array``: the way now). The rounds take the ways in turn, and every result is checked
(a wrong one exits non-zero). Each process times its copy into the slot and its
reduction; rank 0 prints the medians over the rounds after the first tenth, per way.

Beside them, a copy of the same size into a third region that the peer never reads
(``unread``), timed in the same rounds: the difference from the copy into the slot is what
writing lines that the peer's core holds costs (it must give up its copy of each first).
Every design that copies in and out through shared memory pays that, the floor and Open
MPI's copy-in/copy-out path included.

On the 2-vCPU Intel machine of docs/performance.md (2026-12-07, two runs), medians (us;
copy into the slot, copy into unread memory, reduction reading both slots, reduction
reading the array): 64 KiB 3.5-3.7 / 1.8 / 6.8-6.9 / 4.1, 256 KiB 12.9 / 5.9 / 27.2 /
14.4-14.5. Reading one's own slot back costs what reading the peer's does: the lines the
peer read went over to its core.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time

import numpy as np

WAYS = ("slots", "array")
#: Give up (and exit non-zero) when a peer's counter has not moved for this long.
STALL_SECONDS = 10.0


def _wait(counters: np.ndarray, word: int, value: int) -> None:
    since = time.monotonic()
    while counters[word] < value:
        os.sched_yield()
        if time.monotonic() - since > STALL_SECONDS:
            raise SystemExit(f"slot_lines.py: the peer stalled at round {value}")


def _rank(r: int, count: int, rounds: int, buffer: mmap.mmap) -> dict[str, list[float]]:
    """Rank ``r``'s rounds: its timings per measurement."""
    counters = np.frombuffer(buffer, dtype=np.int64, count=8)  # posted 0, 1; read 0, 1
    data = np.frombuffer(buffer, dtype=np.float32, offset=4096, count=6 * count)
    slots = data[: 4 * count].reshape(2, 2, count)  # [parity, rank]
    unread = data[(4 + r) * count : (5 + r) * count]
    array = np.empty(count, np.float32)
    timings: dict[str, list[float]] = {
        name: [] for name in ("copy into the slot", "copy into unread memory", *WAYS)
    }
    clock = time.perf_counter
    for i in range(1, rounds + 1):
        way = WAYS[i % 2]
        array.fill(r + 1)
        start = clock()
        unread[...] = array
        copied = clock()
        rows = slots[i & 1]
        rows[r] = array
        published = clock()
        counters[r] = i
        _wait(counters, 1 - r, i)
        reduced_from = clock()
        if way == "slots":
            np.add(rows[0], rows[1], out=array)
        elif r == 0:
            np.add(array, rows[1], out=array)
        else:
            np.add(rows[0], array, out=array)
        end = clock()
        if array[0] != 3 or array[-1] != 3:
            raise SystemExit(f"slot_lines.py: rank {r} reduced wrongly in round {i}")
        # Both done reading this parity before either writes it again, two rounds on.
        counters[2 + r] = i
        _wait(counters, 3 - r, i)
        timings["copy into unread memory"].append(copied - start)
        timings["copy into the slot"].append(published - copied)
        timings[way].append(end - reduced_from)
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", default="64,256", help="sizes in KiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3000, help="rounds per size")
    args = parser.parse_args()
    for kib in (int(k) for k in args.kib.split(",")):
        count = kib * 1024 // 4
        buffer = mmap.mmap(-1, 4096 + 6 * count * 4)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank(1, count, args.rounds, buffer)
            except BaseException:
                code = 1
            os._exit(code)
        try:
            timings = _rank(0, count, args.rounds, buffer)
        finally:
            _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status):
            print("slot_lines.py: rank 1 failed", file=sys.stderr)
            return 1
        print(
            f"{kib} KiB, rank 0, median us: "
            + "  ".join(
                f"{name} {statistics.median(values[len(values) // 10 :]) * 1e6:.2f}"
                for name, values in timings.items()
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
