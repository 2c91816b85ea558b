"""Which of trioring's targets against Open MPI a run meets, and for each one it misses,
whether the floor of the design proves the miss: the table ``bench/plot.py`` writes as
``bench/results/misses.md``, from ``bench/paired.py``'s JSON.

    .venv/bin/python bench/verdicts.py bench/results/paired_w2.json bench/results/paired_w4.json

A verdict per target, from the same-ranks windows of ``bench/paired.py`` (trioring, Open
MPI, and the floor of the design as a Trio call, its fourth side, in the same processes):

``met``          trioring's median ratio to Open MPI's time is within the target.
``proven``       the floor with its schedule point is past the target in every window, and
                 trioring's median is not below that floor's best window: no Trio library
                 built on these copies can meet it here, whatever its checks and call
                 identity cost.
``edge``         that floor is past the target in the median, but not in its best window.
``not bounded``  trioring beat the floor's best window, by a path the floor does not take
                 (the segment's pipe, or ranks writing into each other's arrays, where the
                 floor only reads by ``process_vm_readv``): it says nothing about that path.
``room``         the floor with its schedule point meets the target: what stands between
                 trioring and the target is trioring's own call, and the table says by how
                 many microseconds (trioring's median less the target's share of Open
                 MPI's, both from the same windows).

Only the standard library: the test suite runs it without the bench dependencies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# trioring's performance targets. Against MPI (mpi4py over Open MPI's shared-memory transport,
# the peer an HPC user compares with): (collectives, world sizes, sizes in bytes, largest time
# ratio trioring / MPI shm). Sizes of the collectives that split into blocks are the nominal
# ones: their smallest cell moves one element per rank.
MPI_TARGETS = [
    (("barrier",), (2, 4), (0,), 3.0),
    (("allreduce", "broadcast"), (2, 4), (4, 4096), 3.0),
    (("allreduce", "broadcast"), (2, 4), (64 * 1024, 256 * 1024), 1.0),
    (("allreduce", "broadcast"), (2, 4), (4 * 1024**2,), 0.8),
    (("allreduce",), (2, 4), (64 * 1024**2,), 0.5),
    (("broadcast",), (2, 4), (64 * 1024**2,), 0.8),
    *(
        ((c,), (2, 4), (size,), limit)
        for c in ("reduce", "allgather", "reduce_scatter", "gather", "scatter", "alltoall")
        for size, limit in ((4, 3.0), (64 * 1024, 1.0), (4 * 1024**2, 0.8))
    ),
]

#: The verdicts, in the order the table lists the misses.
VERDICTS = ("room", "edge", "not bounded", "proven")


def find_cell(cells: list[dict], collective: str, n: int, size: int, transport: str) -> dict | None:
    """The cell of ``size``, or for the collectives that split it into blocks (whose
    smallest cells move one element per rank) the smallest cell of at least ``size``."""
    mine = sorted(
        (
            c
            for c in cells
            if c["collective"] == collective
            and c["world_size"] == n
            and c["transport"] == transport
            and c["size"] >= size
        ),
        key=lambda c: c["size"],
    )
    if mine and (mine[0]["size"] == size or mine[0]["size"] <= max(size, 4) * n):
        return mine[0]
    return None


def load_paired(paths: list[Path]) -> list[dict]:
    """The cells of bench/paired.py's JSON files, in compare.py's terms (transport unix)."""
    cells = []
    for path in paths:
        for cell in json.loads(path.read_text())["cells"]:
            cells.append({**cell, "transport": "unix"})
    return cells


def verdict(cell: dict, limit: float) -> str:
    """The verdict (see the module's docstring) on a bench/paired.py cell for a target of
    ``limit`` (largest time ratio trioring / Open MPI); "not measured" where the cell has
    no floor with a schedule point and misses."""
    if cell["ratio"] <= limit:
        return "met"
    if "floor_trio_ratio" not in cell:
        return "not measured"
    if cell["ratio"] < cell["floor_trio_ratio_min"] and cell["floor_trio_ratio"] > limit:
        # Faster than the floor's best window: another path (the segment's pipe, or writes
        # into the peers' arrays, where the floor only reads), which it does not bound.
        return "not bounded"
    if cell["floor_trio_ratio_min"] > limit:
        return "proven"
    if cell["floor_trio_ratio"] > limit:
        return "edge"
    return "room"


def _name(collective: str, n: int, size: int) -> str:
    if not size:
        return f"{collective}, world {n}"
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale and size % scale == 0:
            return f"{collective} {size // scale} {unit}, world {n}"
    return f"{collective} {size} B, world {n}"


def judged(paired: list[dict]) -> list[tuple[str, float, dict | None, str]]:
    """Every target against Open MPI as (its name, its limit, its bench/paired.py cell or
    None, the verdict), in MPI_TARGETS' order."""
    rows = []
    for collectives, worlds, sizes, limit in MPI_TARGETS:
        for collective in collectives:
            for n in worlds:
                for size in sizes:
                    cell = find_cell(paired, collective, n, size, "unix")
                    mark = "not measured" if cell is None else verdict(cell, limit)
                    rows.append((_name(collective, n, size), limit, cell, mark))
    return rows


def misses(paired: list[dict]) -> str:
    """The summary line and the table of the missed targets (markdown), worst-placed last:
    those with room first, by how far trioring is over the target."""
    rows = judged(paired)
    count = {mark: sum(1 for row in rows if row[3] == mark) for mark in (*VERDICTS, "met")}
    missed = [row for row in rows if row[3] != "met"]
    unmeasured = sum(1 for row in rows if row[3] == "not measured")
    summary = (
        f"{count['met']} of the {len(rows)} targets against Open MPI met in the same ranks; "
        f"of the {len(missed)} missed, {count['proven']} proven by the floor of the design "
        f"with its schedule point, {count['edge']} at the edge, {count['not bounded']} not "
        f"bounded by it, {count['room']} with room"
    )
    summary += f", {unmeasured} not measured.\n\n" if unmeasured else ".\n\n"
    lines = [
        "| target | limit | trioring / MPI shm: median (range over windows) | floor + "
        "schedule point / MPI shm: median (best window) | verdict | trioring (us) | budget "
        "(us) | over by (us) |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]

    def order(row: tuple[str, float, dict | None, str]) -> tuple[int, float]:
        _, limit, cell, mark = row
        rank = VERDICTS.index(mark) if mark in VERDICTS else len(VERDICTS)
        over = 0.0 if cell is None else cell["trioring_us"] - limit * cell["mpi_us"]
        return rank, over

    for name, limit, cell, mark in sorted(missed, key=order):
        if cell is None:
            lines.append(f"| {name} | <= {limit} | | | {mark} | | | |")
            continue
        budget = limit * cell["mpi_us"]
        floor = (
            f"{cell['floor_trio_ratio']:.2f} ({cell['floor_trio_ratio_min']:.2f})"
            if "floor_trio_ratio" in cell
            else ""
        )
        lines.append(
            f"| {name} | <= {limit} | {cell['ratio']:.2f} ({cell['ratio_min']:.2f}-"
            f"{cell['ratio_max']:.2f}) | {floor} | {mark} | {cell['trioring_us']:.1f} | "
            f"{budget:.1f} | {cell['trioring_us'] - budget:.1f} |"
        )
    return summary + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path, help="files written by bench/paired.py")
    args = parser.parse_args()
    sys.stdout.write(misses(load_paired(args.json)))


if __name__ == "__main__":
    main()
