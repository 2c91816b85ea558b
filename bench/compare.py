"""trioring vs torch.distributed's Gloo backend on this machine, alternating runs.

    .venv/bin/python bench/compare.py -n 2 --sizes 4,4K,4M,64M --rounds 3 --json out.json

For each round, run `trioring bench` (Unix transport by default) and a Gloo job (torchrun,
TCP on loopback) over the same grid; report the median over rounds of each cell's median and
the ratio trioring / Gloo (below 1 means trioring is faster). Also measures the raw limit of
a Unix socket between two processes on this machine. Needs torch (the `interop` dependency
group: `pip install --group interop`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).parent
#: The collectives that Gloo has too (bench/_gloo_worker.py), for --collective all.
GLOO_COLLECTIVES = (
    "allreduce", "broadcast", "barrier", "reduce", "allgather", "reduce_scatter", "gather",
    "scatter", "alltoall",
)  # fmt: skip


def run_trioring(
    n: int, sizes: str, collectives: list[str], transport: str, back_to_back: bool
) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [sys.executable, "-m", "trioring", "bench", "-n", str(n), "--sizes", sizes]
        args += ["--transport", transport, "--json", out.name]
        args += ["--back-to-back"] if back_to_back else []
        for collective in collectives:
            args += ["--collective", collective]
        subprocess.run(args, check=True, capture_output=True, timeout=1800)
        return json.loads(Path(out.name).read_text())["results"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_gloo(n: int, sizes: list[int], collectives: list[str], back_to_back: bool) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun), f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(HERE / "_gloo_worker.py"),
            ",".join(map(str, sizes)), ",".join(collectives),
            *(["--back-to-back"] if back_to_back else []),
        ],
        capture_output=True, text=True, timeout=1800, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    match = re.search(r"GLOO-RESULTS (.*)", result.stdout)
    assert match, result.stdout + result.stderr
    return json.loads(match.group(1))


def socket_limit(total: int = 1 << 30, chunk: int = 4 << 20) -> float:
    """GB/s of a Unix stream socket between two processes (send / recv_into)."""
    left, right = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        left.close()
        buffer = memoryview(bytearray(chunk))
        sent = 0
        while sent < total:
            sent += right.send(buffer)
        os._exit(0)
    right.close()
    buffer = memoryview(bytearray(chunk))
    received = 0
    start = time.perf_counter()
    while received < total:
        received += left.recv_into(buffer)
    elapsed = time.perf_counter() - start
    os.waitpid(pid, 0)
    left.close()
    return total / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--sizes", default="4,4K,4M,64M")
    parser.add_argument(
        "--collective",
        action="append",
        help="repeatable; 'all' for every collective Gloo has too (default allreduce, "
        "broadcast, barrier)",
    )
    parser.add_argument("--transport", default="unix")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="no barrier between timed calls, on either side (see trioring bench --help)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from trioring._bench import format_size, parse_sizes

    collectives = args.collective or ["allreduce", "broadcast", "barrier"]
    if "all" in collectives:
        collectives = list(GLOO_COLLECTIVES)
    sizes = parse_sizes(args.sizes)
    cells: dict[tuple[str, int], dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for name, rows in (
            (
                "trioring",
                run_trioring(args.n, args.sizes, collectives, args.transport, args.back_to_back),
            ),
            ("gloo", run_gloo(args.n, sizes, collectives, args.back_to_back)),
        ):
            for row in rows:
                cell = cells.setdefault(
                    (row["collective"], row["size"]), {"trioring": [], "gloo": []}
                )
                cell[name].append(row["median_us"])
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    limit = socket_limit()
    print(
        f"# world {args.n}, trioring over {args.transport}, Gloo over TCP; medians of "
        f"{args.rounds} alternating rounds; {'back to back' if args.back_to_back else 'a barrier between calls'}; "
        f"Unix socket limit here: {limit:.2f} GB/s"
    )
    print(f"{'collective':>14} {'size':>8} {'trioring us':>12} {'gloo us':>10} {'ratio':>6}")
    table = []
    for (collective, size), cell in cells.items():
        ours, theirs = median(cell["trioring"]), median(cell["gloo"])
        table.append({"collective": collective, "size": size, "world_size": args.n,
                      "transport": args.transport, "trioring_us": ours, "gloo_us": theirs,
                      "ratio": ours / theirs, "rounds": cell})  # fmt: skip
        print(f"{collective:>14} {format_size(size):>8} {ours:>12.1f} {theirs:>10.1f} "
              f"{ours / theirs:>6.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"socket_limit_GBps": limit, "back_to_back": args.back_to_back, "cells": table},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
