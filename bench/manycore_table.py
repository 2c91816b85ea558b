"""The targets against Open MPI on two machines side by side: this project's 2-vCPU
machine (bench/results/paired_w2.json and paired_w4.json, written by ``make bench``) and a
machine with a core per rank (bench/results/cores16/, written by bench/manycore.sh).

    .venv/bin/python bench/manycore_table.py > bench/results/cores16/targets.md
    .venv/bin/python bench/manycore_table.py --other bench/results/epyc \
        --label "2 vCPUs, EPYC" > bench/results/epyc/targets.md

``--other`` names another machine's bench/paired.py results (paired_w2.json and
paired_w4.json) in place of cores16's: the same table for any two machines.

Each ratio is bench/paired.py's: trioring's time over Open MPI's in the same ranks, the
median over windows; bold where it meets the target. The last column is the floor of the
design with a Trio schedule point on the machine with a core per rank (see the method of
docs/performance.md): where it is past the target, no Trio library built that way meets it
there either.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _machine import describe
from verdicts import MPI_TARGETS, find_cell, load_paired

from trioring._bench import format_size

RESULTS = Path(__file__).parent / "results"


def main(other: Path, label: str, here_label: str) -> None:
    there_w4 = json.loads((other / "paired_w4.json").read_text())
    library = there_w4["library"]
    here_w2 = json.loads((RESULTS / "paired_w2.json").read_text())
    for name, report in ((here_label, here_w2), (label, there_w4)):
        if line := describe(report.get("machine")):
            print(f"{name}: {line}.\n")
    print(
        f"| case | target (time / MPI shm's) | {here_label}: trioring (us), ratio | "
        f"{label}: trioring (us), ratio ({library}) | {label}: floor + Trio, ratio |"
    )
    print("|---|---:|---:|---:|---:|")
    met = [0, 0]
    proven = 0
    total = 0
    for n in (2, 4):
        here = load_paired([RESULTS / f"paired_w{n}.json"])
        there = load_paired([other / f"paired_w{n}.json"])
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
                    proven += b.get("floor_trio_ratio", 0) > limit
                    print(f"| {name}, world {n} | <= {limit} | {shown[0]} | {shown[1]} | {floor} |")
    print(
        f"\nMet: {met[0]} of {total} on the {here_label}, {met[1]} of {total} on the {label}; "
        f"there the floor with a Trio schedule point was past the target in {proven} cells."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, default=RESULTS / "cores16")
    parser.add_argument("--label", default="16 cores")
    parser.add_argument("--here-label", default="2 vCPUs")
    args = parser.parse_args()
    main(args.other, args.label, args.here_label)
