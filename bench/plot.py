"""Plots and a results table for docs/performance.md, from bench/compare.py's JSON.

    .venv/bin/python bench/plot.py bench/results/compare_w2.json bench/results/compare_w4.json

Writes ``docs/performance/busbw.svg`` (bus bandwidth against size, trioring beside each peer
in the JSON: Gloo, MPI over shared memory and MPI over TCP; one panel per collective and world
size), ``docs/performance/time.svg`` (time ratio trioring / peer, one panel per peer), and the
tables the page includes: ``bench/results/results.md`` (the full table),
``bench/results/targets.md`` (the performance targets against these measurements),
``bench/results/misses.md`` (each missed target's verdict: bench/verdicts.py) and, from
``bench/results/budget.json`` when it exists, ``bench/results/budget.md``. Where
``bench/results/paired_w*.json`` exist (bench/paired.py: trioring and Open MPI timed in the
same ranks), the targets table shows their ratios beside compare.py's. Files written
before the MPI peers (only ``gloo_us`` and ``ratio``) give the same plots and tables as
before; a file without Gloo (``compare.py --peers mpi-shm``) leaves Gloo out. Needs
matplotlib (the ``bench`` dependency group).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).parent.parent
OUT = ROOT / "docs" / "performance"
TABLES = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "src"))
from _machine import describe  # noqa: E402
from verdicts import MPI_TARGETS, find_cell, load_paired, misses  # noqa: E402

from trioring._bench import format_size  # noqa: E402
from trioring._bench_cases import CASES  # noqa: E402

#: The peers of bench/compare.py: (label, JSON key of the time, of trioring / peer, style).
PEERS = (
    ("Gloo", "gloo_us", "ratio", "s--"),
    ("MPI shm", "mpi_shm_us", "ratio_mpi_shm", "^-."),
    ("MPI tcp", "mpi_tcp_us", "ratio_mpi_tcp", "v:"),
)


def busbw(collective: str, size: int, n: int, us: float) -> float:
    """nccl-tests' bus bandwidth: 2 (n-1)/n for allreduce, (n-1)/n for the collectives that
    split the size into blocks, 1 for broadcast and reduce (trioring/_bench_cases.py)."""
    factor = CASES[collective].factor(n) if collective in CASES else 1.0
    return size / (us * 1e-6) / 1e9 * factor


def peers_in(cells: list[dict]) -> list[tuple[str, str, str, str]]:
    """The peers that some cell has a time for, in PEERS' order."""
    return [peer for peer in PEERS if any(peer[1] in c for c in cells)]


def load(paths: list[str]) -> list[dict]:
    cells = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for cell in data["cells"]:
            cell["socket_limit_GBps"] = data["socket_limit_GBps"]
            cell.setdefault("transport", "unix")
            cells.append(cell)
    return cells


def plot_busbw(cells: list[dict]) -> None:
    worlds = sorted({c["world_size"] for c in cells})
    collectives = ["allreduce", "broadcast"]
    fig, axes = plt.subplots(
        len(worlds), 2, figsize=(10, 3.6 * len(worlds)), squeeze=False, layout="constrained"
    )
    for row, n in enumerate(worlds):
        for col, collective in enumerate(collectives):
            ax = axes[row][col]
            mine = sorted(
                (c for c in cells if c["world_size"] == n and c["collective"] == collective),
                key=lambda c: c["size"],
            )
            if not mine:
                ax.set_title(f"{collective}, world {n}: not measured")
                ax.axis("off")
                continue
            sizes = [c["size"] for c in mine]
            series = [("trioring", "trioring_us", "o-")]
            series += [(name, key, style) for name, key, _, style in peers_in(mine)]
            for name, key, style in series:
                have = [c for c in mine if key in c]
                ax.plot(
                    [c["size"] for c in have],
                    [busbw(collective, c["size"], n, c[key]) for c in have],
                    style,
                    label=name,
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45)
            ax.set_title(f"{collective}, world {n}")
            ax.set_xlabel("array size (bytes)")
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.savefig(OUT / "busbw.svg", metadata={"Date": None})
    plt.close(fig)


def plot_ratio(cells: list[dict]) -> None:
    peers = peers_in(cells)
    fig, axes = plt.subplots(
        max(1, len(peers)), 1, figsize=(10, 4.5 * max(1, len(peers))), squeeze=False,
        layout="constrained",
    )  # fmt: skip
    sizes = sorted({c["size"] for c in cells if c["collective"] in ("allreduce", "broadcast")})
    for (label, _, ratio, _), [ax] in zip(peers, axes, strict=False):
        for n in sorted({c["world_size"] for c in cells}):
            for collective, style in (("allreduce", "o-"), ("broadcast", "s--")):
                mine = sorted(
                    (
                        c
                        for c in cells
                        if c["world_size"] == n and c["collective"] == collective and ratio in c
                    ),
                    key=lambda c: c["size"],
                )
                if not mine:
                    continue
                ax.plot(
                    [c["size"] for c in mine],
                    [c[ratio] for c in mine],
                    style,
                    label=f"{collective}, world {n}",
                )
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45)
        ax.set_yscale("log")
        ax.set_xlabel("array size (bytes)")
        ax.set_title(f"time of trioring / time of {label} (below 1: trioring is faster)")
        ax.set_ylabel("time ratio")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.savefig(OUT / "time.svg", metadata={"Date": None})
    plt.close(fig)


def table(cells: list[dict]) -> str:
    peers = peers_in(cells)
    spread = any("trioring_min_us" in c for c in cells)
    head = ["collective", "world", "size", "trioring over", "trioring (us)"]
    head += ["trioring range (us)"] if spread else []
    for label, _, _, _ in peers:
        head += [f"{label} (us)", "ratio" if label == "Gloo" else f"ratio {label}"]
    head.append("trioring busbw (GB/s)")
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---|" + "---:|" * (len(head) - 4)]
    order = {"unix": 0, "tcp": 1}
    for c in sorted(
        cells,
        key=lambda c: (order.get(c["transport"], 2), c["collective"], c["world_size"], c["size"]),
    ):
        bw = busbw(c["collective"], c["size"], c["world_size"], c["trioring_us"])
        row = [c["collective"], str(c["world_size"]), format_size(c["size"]), c["transport"]]
        row.append(f"{c['trioring_us']:.1f}")
        if spread:
            low, high = c.get("trioring_min_us"), c.get("trioring_max_us")
            row.append(f"{low:.1f}-{high:.1f}" if low is not None else "-")
        for _, key, ratio, _ in peers:
            row += [f"{c[key]:.1f}", f"{c[ratio]:.2f}"] if key in c else ["-", "-"]
        row.append(f"{bw:.2f}" if c["size"] else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# Against Gloo, never to regress: (collective, world size, size in bytes, trioring's
# transport, largest time ratio trioring / Gloo).
GLOO_TARGETS = [
    ("allreduce", 2, 4, "unix", 0.25),
    ("allreduce", 4, 4, "unix", 0.25),
    ("allreduce", 2, 4096, "unix", 0.25),
    ("allreduce", 4, 4096, "unix", 0.25),
    ("allreduce", 2, 4 * 1024**2, "unix", 0.5),
    ("allreduce", 4, 4 * 1024**2, "unix", 0.5),
    ("allreduce", 2, 64 * 1024**2, "unix", 0.6),
    ("allreduce", 4, 64 * 1024**2, "unix", 0.6),
    ("broadcast", 4, 64 * 1024**2, "unix", 0.8),
    ("barrier", 4, 0, "unix", 0.25),
    ("allreduce", 2, 64 * 1024**2, "tcp", 1.0),
]


def _floor(floor: dict | None, collective: str, n: int, size: int) -> str:
    """The Python floor (bench/floor.py) of a 4-byte allreduce or a barrier, where known."""
    if floor is None or size > 4 or collective not in ("allreduce", "barrier"):
        return ""
    for row in floor["floor"]:
        if row["world_size"] == n and row["variant"] == collective:
            return f"{row['median_us']:.1f}"
    return ""


def _paired(
    paired: list[dict], collective: str, n: int, size: int
) -> tuple[str, float | None, str, str]:
    """bench/paired.py's ratio for the cell as text (median of windows, and their range)
    and as a number, the floor of trioring's design in the same ranks (its time, and its
    ratio to Open MPI's), and that floor with a Trio schedule point (its time, and its
    ratio with the range over windows); empty and None where they did not run."""
    cell = find_cell(paired, collective, n, size, "unix")
    if cell is None:
        return "", None, "", ""
    text = f"{cell['ratio']:.2f} ({cell['ratio_min']:.2f}-{cell['ratio_max']:.2f})"
    floor = f"{cell['floor_us']:.1f} ({cell['floor_ratio']:.2f})" if "floor_us" in cell else ""
    scheduled = (
        f"{cell['floor_trio_us']:.1f} ({cell['floor_trio_ratio']:.2f}; "
        f"{cell['floor_trio_ratio_min']:.2f}-{cell['floor_trio_ratio_max']:.2f})"
        if "floor_trio_us" in cell
        else ""
    )
    return text, cell["ratio"], floor, scheduled


def _met(ratio: float, limit: float) -> str:
    return "yes" if ratio <= limit else "**no**"


def targets(cells: list[dict], floor: dict | None = None, paired: list[dict] | None = None) -> str:
    """The targets against MPI over shared memory (with the Python floor, bench/floor.py, as
    the limit where it applies, and bench/paired.py's ratio where it ran), then those
    against Gloo. "met" is judged on the ratio in the same ranks where bench/paired.py
    measured it (both sides in the same stretch of the machine's speed, see
    bench/modes.py), on compare.py's alternating launches elsewhere. The floor of the
    design (bench/_floor_worker.py, run by bench/paired.py up to 256 KiB) is trioring's
    shared-segment copies and reductions with nothing else, in the same ranks; the next
    column is that floor with the one schedule point a Trio call owes."""
    paired = paired or []
    lines = [
        "| case | target (time / MPI shm's) | measured, alternating launches | trioring (us) "
        "| spread over rounds (us) | MPI shm (us) | measured in the same ranks: median (range "
        "over windows) | limit: Python floor (us) | floor of the design, same ranks: us "
        "(its time / MPI shm's) | the same with a Trio schedule point: us (its time / MPI "
        "shm's; range over windows) | met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for collectives, worlds, sizes, limit in MPI_TARGETS:
        for collective in collectives:
            for n in worlds:
                for size in sizes:
                    cell = find_cell(cells, collective, n, size, "unix")
                    label = format_size(size) + (" B" if size < 1024 else "")
                    name = (
                        f"{collective} {label}, world {n}" if size else f"{collective}, world {n}"
                    )
                    limit_us = _floor(floor, collective, n, size)
                    same, same_ratio, design, scheduled = _paired(paired, collective, n, size)
                    if cell is None or "ratio_mpi_shm" not in cell:
                        met = "" if same_ratio is None else _met(same_ratio, limit)
                        lines.append(
                            f"| {name} | <= {limit} | not measured | | | | {same} | {limit_us} "
                            f"| {design} | {scheduled} | {met} |"
                        )
                        continue
                    ratio = cell["ratio_mpi_shm"] if same_ratio is None else same_ratio
                    met = _met(ratio, limit)
                    low, high = cell.get("trioring_min_us"), cell.get("trioring_max_us")
                    spread = f"{low:.1f}-{high:.1f}" if low is not None else ""
                    lines.append(
                        f"| {name} | <= {limit} | {cell['ratio_mpi_shm']:.2f} | "
                        f"{cell['trioring_us']:.1f} | {spread} | {cell['mpi_shm_us']:.1f} | "
                        f"{same} | {limit_us} | {design} | {scheduled} | {met} |"
                    )
    lines += [
        "",
        "| case | target (time / Gloo's) | measured | trioring (us) | Gloo (us) | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for collective, n, size, transport, limit in GLOO_TARGETS:
        cell = find_cell(cells, collective, n, size, transport)
        label = format_size(size) + (" B" if size < 1024 else "")
        name = f"{collective} {label}, world {n}" if size else f"{collective}, world {n}"
        name += f" ({transport})"
        if cell is None or "ratio" not in cell:
            lines.append(f"| {name} | <= {limit} | not measured | | | |")
            continue
        met = "yes" if cell["ratio"] <= limit else "**no**"
        lines.append(
            f"| {name} | <= {limit} | {cell['ratio']:.2f} | {cell['trioring_us']:.1f} | "
            f"{cell['gloo_us']:.1f} | {met} |"
        )
    return "\n".join(lines) + "\n"


def budget(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = ["| budget | measured |", "|---|---|"]
    for key, rows in data.items():
        if not key.startswith("memory"):
            continue
        extra = max(row["extra_peak_MiB"] for row in rows)
        seconds = max(row["seconds"] for row in rows)
        label = key.removeprefix("memory, ")
        lines.append(
            f"| 256 MiB float32 allreduce, world 4, {label}: extra peak RSS per rank "
            f"(S/world = 64 MiB) | {extra:.1f} MiB ({seconds * 1e3:.0f} ms) |"
        )
    overhead = data["overhead"]
    lines.append(
        f"| 10,000 back-to-back 4-byte allreduces, world 2 (budget < 1 s) | "
        f"{overhead['seconds']:.3f} s; a 1 ms ticker task in the same Trio run ticked "
        f"{overhead['ticker_ticks']} times meanwhile |"
    )
    return "\n".join(lines) + "\n"


def measured_on(paths: list[Path]) -> str:
    """A line naming the machine the first of ``paths`` that records one ran on (compare.py
    and paired.py write it), ending in a blank line; "" if none does."""
    for path in paths:
        line = describe(json.loads(path.read_text()).get("machine"))
        if line:
            return f"Measured on {line}.\n\n"
    return ""


def main() -> None:
    global OUT, TABLES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="files written by bench/compare.py --json")
    parser.add_argument("--plots", type=Path, default=OUT, help=f"where the SVGs go ({OUT})")
    parser.add_argument(
        "--tables", type=Path, default=TABLES, help=f"where the tables go ({TABLES})"
    )
    parser.add_argument(
        "--budget", type=Path, help="bench/budget.py's JSON (default: budget.json in --tables)"
    )
    args = parser.parse_args()
    OUT, TABLES = args.plots, args.tables
    cells = load(args.json)
    OUT.mkdir(parents=True, exist_ok=True)
    plotted = [c for c in cells if c["collective"] != "barrier" and c["transport"] == "unix"]
    plot_busbw(plotted)
    plot_ratio(plotted)
    TABLES.mkdir(parents=True, exist_ok=True)
    heading = measured_on([Path(path) for path in args.json])
    (TABLES / "results.md").write_text(heading + table(cells))
    floor_json = TABLES / "floor.json"
    floor = json.loads(floor_json.read_text()) if floor_json.exists() else None
    paired_json = sorted(TABLES.glob("paired_w*.json"))
    paired = load_paired(paired_json)
    heading = measured_on(paired_json) or heading
    (TABLES / "targets.md").write_text(heading + targets(cells, floor, paired))
    if paired:
        (TABLES / "misses.md").write_text(misses(paired))
    budget_json = args.budget or TABLES / "budget.json"
    if budget_json.exists():
        (TABLES / "budget.md").write_text(budget(budget_json))
    print(f"wrote busbw.svg and time.svg in {OUT}; results, targets and budget in {TABLES}")


if __name__ == "__main__":
    main()
