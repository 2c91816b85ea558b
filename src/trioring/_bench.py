"""``trioring bench``: an nccl-tests style benchmark of the collectives on this machine.

The launcher side (:func:`bench_command`) starts N ranks of this module
(``python -m trioring._bench``) with :func:`trioring._launcher.launch`; each rank runs
:func:`rank_main`. Every iteration is timed on every rank; the time of an iteration is the
slowest rank's. Every result is checked outside the timed region (what each collective's
inputs are, what its sizes mean and how its result is checked: :mod:`._bench_cases`); a
wrong result makes the run fail.

After each check, every rank enters a barrier (not timed), as the OSU micro-benchmarks do:
otherwise one rank's check (a pass over the whole array) would run while the others are
timing their next call, and on a machine with fewer cores than ranks it takes CPU from them.
``back_to_back`` leaves the barrier out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import trio

import trioring

from ._bench_cases import CASES

SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = text[-1:] if text[-1:] in SIZE_SUFFIXES and not text[-1:].isdigit() else ""
    number = text[: len(text) - len(suffix)]
    if not number.isdigit():
        raise ValueError(f"not a size: {text!r} (use e.g. 4, 4K, 64M)")
    return int(number) * SIZE_SUFFIXES[suffix]


def parse_sizes(text: str) -> list[int]:
    """``"4:64M"`` (powers of 4 from 4 bytes to 64 MiB, like nccl-tests' -f 4), or a comma
    list ``"4,4K,4M"``."""
    if ":" in text:
        low, high = (parse_size(part) for part in text.split(":", 1))
        if low < 1 or high < low:
            raise ValueError(f"bad size range {text!r}")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= 4
        return sizes
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(size: int) -> str:
    for suffix, factor in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)


def _iterations(size: int) -> int:
    # Enough samples for a stable median without making 64 MiB runs take minutes.
    if size <= 64 * 1024:
        return 200
    if size <= 4 * 1024**2:
        return 40
    return 10


def warmup_iterations(iterations: int) -> int:
    """Untimed calls before the timed ones: a fifth as many, at least 3, as the OSU
    micro-benchmarks skip (200 of 1,000 small, 10 of 100 large). The first cell of a run
    comes right after the ranks started and connected: with 3, its median ran 3-40 % slower
    than the same cell measured again at once (4 B, world 4, three runs)."""
    return max(3, iterations // 5)


async def _measure(
    comm: trioring.Communicator,
    collective: str,
    size: int,
    op: str,
    dtype: np.dtype[Any],
    *,
    back_to_back: bool,
) -> dict[str, Any]:
    n = comm.world_size
    case = CASES[collective]
    count = max(1, size // dtype.itemsize) if collective != "barrier" else 0
    cell = case.prepare(comm, count, dtype, op)
    iterations = _iterations(size)
    warmup = warmup_iterations(iterations)
    times = np.zeros(warmup + iterations, dtype=np.float64)
    errors = 0
    for i in range(len(times)):
        cell.reset()
        start = time.perf_counter()
        result = await cell.call()
        times[i] = time.perf_counter() - start
        if not cell.check(result):
            errors += 1
        if not back_to_back:
            await comm.barrier()
    times = times[warmup:]
    # The time of an iteration is its slowest rank's; errors are summed over ranks.
    await comm.allreduce(times, op="max")
    total_errors = np.array([errors], dtype=np.int64)
    await comm.allreduce(total_errors)
    median = float(np.median(times))
    algbw = cell.nbytes / median / 1e9 if cell.nbytes else 0.0
    return {
        "collective": collective,
        "size": cell.nbytes,
        "count": cell.nbytes // dtype.itemsize,
        "dtype": dtype.name,
        "op": op if case.reduces else None,
        "world_size": n,
        "transport": comm.transport,
        "iterations": iterations,
        "median_us": median * 1e6,
        "p10_us": float(np.percentile(times, 10)) * 1e6,
        "p90_us": float(np.percentile(times, 90)) * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * case.factor(n),
        "errors": int(total_errors[0]),
        "back_to_back": back_to_back,
    }


HEADER = (
    f"{'collective':>15} {'size':>8} {'count':>10} {'dtype':>8} {'op':>5} "
    f"{'median us':>11} {'p10 us':>10} {'p90 us':>10} {'algbw GB/s':>10} {'busbw GB/s':>10} "
    f"{'errors':>6}"
)


def format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['collective']:>15} {format_size(row['size']):>8} {row['count']:>10} "
        f"{row['dtype']:>8} {row['op'] or '-':>5} {row['median_us']:>11.1f} "
        f"{row['p10_us']:>10.1f} {row['p90_us']:>10.1f} {row['algbw_GBps']:>10.3f} "
        f"{row['busbw_GBps']:>10.3f} {row['errors']:>6}"
    )


async def rank_main(config: dict[str, Any]) -> int:
    dtype = np.dtype(config["dtype"])
    rows = []
    async with trioring.open_communicator() as comm:
        plan = [
            (collective, size)
            for collective in config["collectives"]
            for size in (config["sizes"] if collective != "barrier" else [0])
        ]
        if comm.rank == 0 and not config["json_only"]:
            print(
                f"# trioring bench: {comm.world_size} ranks, transport {comm.transport}",
                flush=True,
            )
            print(HEADER, flush=True)
        for index, (collective, size) in enumerate(plan):
            if comm.rank == 0 and config["progress"]:
                print(
                    f"\r[{index + 1}/{len(plan)}] {collective} {format_size(size)} ...",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            row = await _measure(
                comm,
                collective,
                size,
                config["op"],
                dtype,
                back_to_back=config["back_to_back"],
            )
            rows.append(row)
            if comm.rank == 0 and not config["json_only"]:
                if config["progress"]:
                    print("\r\033[K", end="", file=sys.stderr, flush=True)
                print(format_row(row), flush=True)
    if comm.rank == 0 and config["json"]:
        output = json.dumps({"results": rows}, indent=1)
        if config["json"] == "-":
            print(output, flush=True)
        else:
            await trio.Path(config["json"]).write_text(output)
    return 1 if any(row["errors"] for row in rows) else 0


def main() -> int:
    config = json.loads(os.environ["TRIORING_BENCH_CONFIG"])
    return trio.run(rank_main, config)


if __name__ == "__main__":
    sys.exit(main())
