"""Plots and a results table for docs/performance.md, from bench/compare.py's JSON.

    .venv/bin/python bench/plot.py bench/results/compare_w2.json bench/results/compare_w4.json

Writes ``docs/performance/busbw.svg`` (bus bandwidth against size, trioring and Gloo, one
panel per collective and world size), ``docs/performance/time.svg`` (time ratio trioring /
Gloo), and the tables the page includes, next to the JSON: ``bench/results/results.md`` (the
full table), ``bench/results/targets.md`` (the performance targets against these
measurements) and, from ``bench/results/budget.json`` when it exists,
``bench/results/budget.md``. Needs matplotlib (the ``bench`` dependency group).
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
from trioring._bench import format_size  # noqa: E402


def busbw(collective: str, size: int, n: int, us: float) -> float:
    factor = 2 * (n - 1) / n if collective == "allreduce" else 1.0
    return size / (us * 1e-6) / 1e9 * factor


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
            sizes = [c["size"] for c in mine]
            for name, key, style in (("trioring", "trioring_us", "o-"), ("Gloo", "gloo_us", "s--")):
                ax.plot(
                    sizes,
                    [busbw(collective, c["size"], n, c[key]) for c in mine],
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
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    for n in sorted({c["world_size"] for c in cells}):
        for collective, style in (("allreduce", "o-"), ("broadcast", "s--")):
            mine = sorted(
                (c for c in cells if c["world_size"] == n and c["collective"] == collective),
                key=lambda c: c["size"],
            )
            ax.plot(
                [c["size"] for c in mine],
                [c["ratio"] for c in mine],
                style,
                label=f"{collective}, world {n}",
            )
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xscale("log", base=2)
    sizes = sorted({c["size"] for c in cells})
    ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45)
    ax.set_yscale("log")
    ax.set_xlabel("array size (bytes)")
    ax.set_title("time of trioring / time of Gloo (below 1: trioring is faster)")
    ax.set_ylabel("time ratio")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(OUT / "time.svg", metadata={"Date": None})
    plt.close(fig)


def table(cells: list[dict]) -> str:
    lines = [
        "| collective | world | size | trioring over | trioring (us) | Gloo (us) | ratio "
        "| trioring busbw (GB/s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    order = {"unix": 0, "tcp": 1}
    for c in sorted(
        cells,
        key=lambda c: (order.get(c["transport"], 2), c["collective"], c["world_size"], c["size"]),
    ):
        bw = busbw(c["collective"], c["size"], c["world_size"], c["trioring_us"])
        bw_text = f"{bw:.2f}" if c["size"] else "-"
        lines.append(
            f"| {c['collective']} | {c['world_size']} | {format_size(c['size'])} | "
            f"{c['transport']} | {c['trioring_us']:.1f} | {c['gloo_us']:.1f} | {c['ratio']:.2f} "
            f"| {bw_text} |"
        )
    return "\n".join(lines) + "\n"


# The performance targets: (collective, world size, size in bytes, trioring's transport, largest
# time ratio vs Gloo).
TARGETS = [
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


def targets(cells: list[dict]) -> str:
    index = {(c["collective"], c["world_size"], c["size"], c["transport"]): c for c in cells}
    lines = [
        "| case | target (time / Gloo's) | measured | trioring (us) | Gloo (us) | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for collective, n, size, transport, limit in TARGETS:
        cell = index.get((collective, n, size, transport))
        label = format_size(size) + (" B" if size < 1024 else "")
        name = f"{collective} {label}, world {n}" if size else f"{collective}, world {n}"
        name += f" ({transport})"
        if cell is None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="files written by bench/compare.py --json")
    args = parser.parse_args()
    cells = load(args.json)
    OUT.mkdir(parents=True, exist_ok=True)
    plotted = [c for c in cells if c["collective"] != "barrier" and c["transport"] == "unix"]
    plot_busbw(plotted)
    plot_ratio(plotted)
    TABLES.mkdir(parents=True, exist_ok=True)
    (TABLES / "results.md").write_text(table(cells))
    (TABLES / "targets.md").write_text(targets(cells))
    budget_json = TABLES / "budget.json"
    if budget_json.exists():
        (TABLES / "budget.md").write_text(budget(budget_json))
    print(f"wrote busbw.svg and time.svg in {OUT}; results, targets and budget in {TABLES}")


if __name__ == "__main__":
    main()
