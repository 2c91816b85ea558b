"""The targets against Open MPI on two machines side by side: this project's 2-vCPU
machine (bench/results/paired_w2.json and paired_w4.json, written by ``make bench``) and a
machine with a core per rank (bench/results/cores16/, written by bench/manycore.sh).

    .venv/bin/python bench/manycore_table.py > bench/results/cores16/targets.md

Each ratio is bench/paired.py's: trioring's time over Open MPI's in the same ranks, the
median over windows; bold where it meets the target. The last column is the floor of the
design with a Trio schedule point on the machine with a core per rank (see the method of
docs/performance.md): where it is past the target, no Trio library built that way meets it
there either.
"""

from __future__ import annotations

import json
from pathlib import Path

from _machine import describe
from plot import MPI_TARGETS, find_cell, load_paired

from trioring._bench import format_size

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    there_w4 = json.loads((RESULTS / "cores16" / "paired_w4.json").read_text())
    library = there_w4["library"]
    here_w2 = json.loads((RESULTS / "paired_w2.json").read_text())
    for label, report in (("2 vCPUs", here_w2), ("16 cores", there_w4)):
        if line := describe(report.get("machine")):
            print(f"{label}: {line}.\n")
    print(
        "| case | target (time / MPI shm's) | 2 vCPUs: trioring (us), ratio | "
        f"16 cores: trioring (us), ratio ({library}) | 16 cores: floor + Trio, ratio |"
    )
    print("|---|---:|---:|---:|---:|")
    met = [0, 0]
    total = 0
    for n in (2, 4):
        here = load_paired([RESULTS / f"paired_w{n}.json"])
        there = load_paired([RESULTS / "cores16" / f"paired_w{n}.json"])
        for collectives, worlds, sizes, limit in MPI_TARGETS:
            for collective in collectives:
                for size in sizes:
                    if n not in worlds:
                        continue
                    a = find_cell(here, collective, n, size, "unix")
                    b = find_cell(there, collective, n, size, "unix")
                    if a is None or b is None:
                        raise SystemExit(f"no {collective} {size} at world {n}")
                    total += 1
                    shown = []
                    for i, cell in enumerate((a, b)):
                        ratio = f"{cell['ratio']:.2f}"
                        if cell["ratio"] <= limit:
                            met[i] += 1
                            ratio = f"**{ratio}**"
                        shown.append(f"{cell['trioring_us']:.1f}, {ratio}")
                    shown_size = f"{size} B" if size < 1024 else format_size(size)
                    name = "barrier" if collective == "barrier" else f"{collective} {shown_size}"
                    floor = f"{b['floor_trio_ratio']:.2f}" if "floor_trio_ratio" in b else ""
                    print(f"| {name}, world {n} | <= {limit} | {shown[0]} | {shown[1]} | {floor} |")
    print(f"\nMet: {met[0]} of {total} on the 2 vCPUs, {met[1]} of {total} with a core per rank.")


if __name__ == "__main__":
    main()
