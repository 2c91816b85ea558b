"""The project's memory and per-call overhead budgets, measured on this machine.

    .venv/bin/python bench/budget.py [--json out.json]

1. Peak RSS of a 256 MiB float32 allreduce at world 4, per rank, beyond what the process
   held before the call (the array itself included in the baseline):
   through the shared segment's pipe (forced: the default up to PIPE_MAX_REDUCE_BYTES), by
   cross-memory attach (the default above it, where every rank agreed to it) and with the
   socket ring (TRIORING_SHM=0 TRIORING_CMA=0). The budget is S/world + a few chunks.
2. Wall time of 10,000 back-to-back 4-byte allreduces at world 2 (budget: < 1 s), over
   Unix sockets, while another Trio task ticks in the same run (its tick count is shown, to
   see that the loop does not starve it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MIB = 1024 * 1024


def rank_memory(out: Path) -> None:
    import numpy as np
    import trio

    import trioring

    async def main() -> None:
        async with trioring.open_communicator() as comm:
            array = np.full(256 * MIB // 4, comm.rank + 1, dtype=np.float32)
            await comm.allreduce(np.ones(1, dtype=np.float32))
            await comm.allreduce(np.ones(MIB, dtype=np.float32))  # warm every path up
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            start = time.perf_counter()
            await comm.allreduce(array)
            elapsed = time.perf_counter() - start
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            n = comm.world_size
            if not np.all(array == n * (n + 1) / 2):
                raise SystemExit(f"rank {comm.rank}: wrong allreduce result")
            row = {"rank": comm.rank, "extra_peak_MiB": (peak - before) / MIB,
                   "seconds": elapsed, "features": sorted(comm.features)}  # fmt: skip
            (out / f"memory{comm.rank}.json").write_text(json.dumps(row))

    trio.run(main)


def rank_overhead(out: Path) -> None:
    import numpy as np
    import trio

    import trioring

    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.001)
                ticks += 1

        async with trioring.open_communicator() as comm, trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            x = np.ones(1, dtype=np.float32)
            for _ in range(100):
                await comm.allreduce(x)
            ticks = 0
            start = time.perf_counter()
            for _ in range(10_000):
                await comm.allreduce(x)
            elapsed = time.perf_counter() - start
            nursery.cancel_scope.cancel()
        if comm.rank == 0:
            row = {"seconds": elapsed, "ticker_ticks": ticks}
            (out / "overhead.json").write_text(json.dumps(row))

    trio.run(main)


def launch(n: int, mode: str, out: Path, env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "-m", "trioring", "run", "-n", str(n), __file__, mode, str(out)],
        check=True,
        timeout=600,
        env={**os.environ, **env},
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("memory", "overhead"):
        {"memory": rank_memory, "overhead": rank_overhead}[sys.argv[1]](Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    import tempfile

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        paths = (
            ("pipe", {"TRIORING_ALGORITHM": "allreduce=pipe"}),
            ("cma", {"TRIORING_ALGORITHM": "allreduce=cma"}),
            ("socket ring", {"TRIORING_SHM": "0", "TRIORING_CMA": "0"}),
        )
        for label, env in paths:
            launch(4, "memory", out, env)
            rows = [json.loads((out / f"memory{r}.json").read_text()) for r in range(4)]
            results[f"memory, {label}"] = rows
            extra = max(row["extra_peak_MiB"] for row in rows)
            seconds = max(row["seconds"] for row in rows)
            print(f"256 MiB allreduce, world 4, {label} ({rows[0]['features']}): "
                  f"extra peak RSS per rank <= {extra:.1f} MiB (S/world = 64 MiB), "
                  f"{seconds * 1e3:.0f} ms")  # fmt: skip
        launch(2, "overhead", out, {})
        row = json.loads((out / "overhead.json").read_text())
        results["overhead"] = row
        print(f"10,000 4-byte allreduces, world 2: {row['seconds']:.3f} s "
              f"(a 1 ms ticker task in the same run ticked {row['ticker_ticks']} times)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
