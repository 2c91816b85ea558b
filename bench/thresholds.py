"""Where one algorithm of a collective overtakes another: the measurement behind the size
limits of the decision table (src/trioring/_collectives/_decision.py).

    trioring run -n 4 bench/thresholds.py alltoall pairwise,cma 64K,256K,1M,4M [ROUNDS] [--each]

Every rank forces each named algorithm in turn, in alternating order from round to round,
times ``INNER`` back-to-back calls of the collective on each size (sizes and inputs as
``trioring bench``'s: src/trioring/_bench_cases.py, which also checks every result), and
rank 0 prints, per size, the median over rounds of each algorithm's time per call (the
slowest rank's), their spread (p10-p90 over rounds) and the winner. Alternating in one run
is what makes the comparison fair on a shared machine: whatever else runs slows both.

``--each`` times every call on its own instead, between a reset of its arrays and a check
of its result and a barrier, none of them timed: the way ``trioring bench`` and
bench/paired.py time the calls that the targets judge. The reset and the check leave the
caches as a program's own work would, and that can change the winner: a 4 MiB allgather at
world 2 took 242-342 us by cross-memory attach against 324-473 through the pipe back to
back, but 384-482 against 654-702 timed each alone (see PIPE_FAMILY in _decision.py).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import trio

import trioring
from trioring._bench import parse_sizes
from trioring._bench_cases import CASES

INNER = 10


async def main(
    collective: str, algorithms: list[str], sizes: list[int], rounds: int, back_to_back: bool
) -> int:
    case = CASES[collective]
    dtype = np.dtype("float32")
    async with trioring.open_communicator() as comm:
        times = np.zeros((len(sizes), len(algorithms), rounds))
        wrong = 0
        for round_ in range(rounds):
            order = list(range(len(algorithms)))
            if round_ % 2:
                order.reverse()
            for s, size in enumerate(sizes):
                cell = case.prepare(comm, max(1, size // dtype.itemsize), dtype, "sum")
                for a in order:
                    comm._force_algorithm(collective, algorithms[a])
                    cell.reset()
                    wrong += not cell.check(await cell.call())  # warm-up, checked
                    await comm.barrier()
                    if back_to_back:
                        start = time.perf_counter()
                        for _ in range(INNER):
                            await cell.call()
                        times[s, a, round_] = (time.perf_counter() - start) / INNER
                        continue
                    each = np.zeros(INNER)
                    for i in range(INNER):
                        cell.reset()
                        start = time.perf_counter()
                        result = await cell.call()
                        each[i] = time.perf_counter() - start
                        wrong += not cell.check(result)
                        await comm.barrier()
                    # The slowest rank's time for each call, then the median call.
                    await comm.allreduce(each, op="max")
                    times[s, a, round_] = np.median(each)
        await comm.allreduce(times, op="max")
        errors = np.array([wrong], np.int64)
        await comm.allreduce(errors)
        if comm.rank == 0:
            timing = "back to back" if back_to_back else "each timed alone"
            print(f"# {collective}, world {comm.world_size}, {comm.transport}, "
                  f"features {sorted(comm.features)}, {rounds} rounds of {INNER} calls, "
                  f"{timing}")  # fmt: skip
            for s, size in enumerate(sizes):
                cells = []
                for a, name in enumerate(algorithms):
                    med, lo, hi = np.percentile(times[s, a], [50, 10, 90]) * 1e6
                    cells.append(f"{name} {med:9.1f} us ({lo:.0f}-{hi:.0f})")
                best = algorithms[int(np.argmin(np.median(times[s], axis=1)))]
                print(f"{size:>9} B  " + "  ".join(cells) + f"  -> {best}")
            if errors[0]:
                print(f"{int(errors[0])} WRONG RESULTS")
        return 1 if errors[0] else 0


if __name__ == "__main__":
    args = [arg for arg in sys.argv[1:] if arg != "--each"]
    name, algos, size_list = args[0], args[1].split(","), parse_sizes(args[2])
    rounds = int(args[3]) if args[3:] else 15
    sys.exit(trio.run(main, name, algos, size_list, rounds, "--each" not in sys.argv))
