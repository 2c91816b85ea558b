"""trioring vs torch.distributed's Gloo backend and mpi4py over Open MPI, alternating runs.

    .venv/bin/python bench/compare.py -n 2 --sizes 4,4K,4M,64M --rounds 3 --json out.json
    .venv/bin/python bench/compare.py -n 4 --peers mpi-shm --collective all --markdown

Each round runs, in turn, `trioring bench` (Unix transport by default) and each peer over
the same grid:

- ``gloo``: torch.distributed's Gloo backend under torchrun, TCP on loopback
  (bench/_gloo_worker.py; Gloo has no other transport);
- ``mpi-shm``: mpi4py over Open MPI's shared-memory transport (the ``vader`` BTL, with the
  ``ob1`` PML), under mpirun (bench/_mpi_worker.py);
- ``mpi-tcp``: the same over Open MPI's TCP transport on loopback.

It reports for each cell the median over rounds of each side's median, the spread of
trioring's round medians (min-max), and the ratios trioring / peer (below 1 means trioring
is faster; trioring / mpi-shm is the headline). Also measures the raw limit of a Unix socket
between two processes on this machine. Gloo needs torch (the `interop` dependency group:
`pip install --group interop`), the MPI peers Open MPI's mpirun and mpi4py (`make bench`
installs all of them); a peer left out of --peers is not needed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from _machine import describe, machine
from _mpirun import loopback_args

HERE = Path(__file__).parent
#: The collectives that Gloo and MPI have too (bench/_gloo_worker.py, bench/_mpi_worker.py),
#: for --collective all.
GLOO_COLLECTIVES = (
    "allreduce", "broadcast", "barrier", "reduce", "allgather", "reduce_scatter", "gather",
    "scatter", "alltoall",
)  # fmt: skip
PEERS = ("gloo", "mpi-shm", "mpi-tcp")
LABELS = {"trioring": "trioring", "gloo": "Gloo", "mpi-shm": "MPI shm", "mpi-tcp": "MPI tcp"}
#: Open MPI's transports for each MPI peer: the ob1 point-to-point layer over shared memory
#: (vader) or TCP, and mpirun's own channel to its ranks on loopback too.
MPI_MCA = {
    "mpi-shm": ["--mca", "pml", "ob1", "--mca", "btl", "self,vader"],
    "mpi-tcp": ["--mca", "pml", "ob1", "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"],
}  # fmt: skip
#: Seconds one job (one side of one round) may take.
JOB_TIMEOUT = 1800


def key(peer: str) -> str:
    """The peer's name in the JSON keys: mpi-shm -> mpi_shm."""
    return peer.replace("-", "_")


def run_job(args: list[str], env: dict[str, str] | None = None) -> str:
    """Run one side of a round in a process group of its own, which a timeout kills whole
    (mpirun's and torchrun's ranks included); its stdout, or exit with its stderr."""
    with subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise SystemExit(f"timed out after {JOB_TIMEOUT} s: {' '.join(args)}") from None
    if process.returncode:
        tail = "\n".join((out + err).strip().splitlines()[-30:])
        raise SystemExit(f"failed (exit {process.returncode}): {' '.join(args)}\n{tail}")
    return out


def run_trioring(
    n: int, sizes: str, collectives: list[str], transport: str, back_to_back: bool
) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [sys.executable, "-m", "trioring", "bench", "-n", str(n), "--sizes", sizes]
        args += ["--transport", transport, "--json", out.name]
        args += ["--back-to-back"] if back_to_back else []
        for collective in collectives:
            args += ["--collective", collective]
        run_job(args)
        return json.loads(Path(out.name).read_text())["results"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_gloo(n: int, sizes: list[int], collectives: list[str], back_to_back: bool) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    stdout = run_job(
        [
            str(torchrun), f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(HERE / "_gloo_worker.py"),
            ",".join(map(str, sizes)), ",".join(collectives),
            *(["--back-to-back"] if back_to_back else []),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    match = re.search(r"GLOO-RESULTS (.*)", stdout)
    assert match, stdout
    return json.loads(match.group(1))


def run_mpi(
    peer: str, mpirun: str, n: int, sizes: list[int], collectives: list[str], back_to_back: bool
) -> tuple[list[dict], str]:
    """One MPI job: its rows, and the MPI library's name."""
    stdout = run_job(
        [
            mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(n), "--bind-to", "none",
            *MPI_MCA[peer], *loopback_args(mpirun),
            sys.executable, str(HERE / "_mpi_worker.py"),
            ",".join(map(str, sizes)), ",".join(collectives),
            *(["--back-to-back"] if back_to_back else []),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    match = re.search(r"MPI-RESULTS (.*)", stdout)
    assert match, stdout
    library = re.search(r"MPI-LIBRARY (.*)", stdout)
    return json.loads(match.group(1)), library.group(1).strip() if library else "MPI"


def missing(peer: str, mpirun: str | None) -> str | None:
    """Why ``peer`` cannot run here, with how to install what it needs; None if it can."""
    if peer == "gloo":
        if importlib.util.find_spec("torch") is None:
            return (
                "gloo needs torch: `make bench` installs it, or `pip install --group interop` "
                "(or leave it out: --peers mpi-shm,mpi-tcp)"
            )
        if not Path(sys.executable).with_name("torchrun").exists():
            return f"gloo needs torchrun next to {sys.executable} (it comes with torch)"
        return None
    needs = []
    if mpirun is None:
        needs.append(
            "Open MPI's mpirun (Debian: `apt-get install openmpi-bin libopenmpi-dev`, or --mpirun PATH)"
        )
    if importlib.util.find_spec("mpi4py") is None:
        needs.append("mpi4py (`pip install --group bench`, or `pip install mpi4py`)")
    if needs:
        return (
            f"{peer} needs {' and '.join(needs)}; `make bench` installs both "
            "(or leave it out: e.g. --peers gloo)"
        )
    return None


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


def parse_peers(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    for peer in peers:
        if peer not in PEERS:
            raise SystemExit(f"unknown peer {peer!r}: choose from {', '.join(PEERS)} (or none)")
    return list(dict.fromkeys(peers))


def ratio_order(peers: list[str]) -> list[str]:
    """The ratio columns: trioring / mpi-shm (the headline) first, then the others."""
    return sorted(peers, key=lambda p: p != "mpi-shm")


def print_table(table: list[dict], peers: list[str], markdown: bool) -> None:
    from trioring._bench import format_size

    ratios = ratio_order(peers)
    if markdown:
        head = ["collective", "size", "trioring (us)", "trioring range (us)"]
        head += [f"{LABELS[p]} (us)" for p in peers]
        head += [f"trioring / {LABELS[p]}" for p in ratios]
        print("| " + " | ".join(head) + " |")
        print("|---|---:|" + "---:|" * (len(head) - 2))
        for cell in table:
            line = [cell["collective"], format_size(cell["size"]), f"{cell['trioring_us']:.1f}"]
            line.append(f"{cell['trioring_min_us']:.1f}-{cell['trioring_max_us']:.1f}")
            line += [f"{cell[key(p) + '_us']:.1f}" for p in peers]
            line += [f"{cell[ratio_key(p)]:.2f}" for p in ratios]
            print("| " + " | ".join(line) + " |")
        return
    head = f"{'collective':>14} {'size':>8} {'trioring us':>12} {'(min-max)':>17}"
    head += "".join(f" {p + ' us':>11}" for p in peers)
    head += "".join(f" {'t/' + p:>10}" for p in ratios)
    print(head)
    for cell in table:
        spread = f"{cell['trioring_min_us']:.1f}-{cell['trioring_max_us']:.1f}"
        line = f"{cell['collective']:>14} {format_size(cell['size']):>8} "
        line += f"{cell['trioring_us']:>12.1f} {spread:>17}"
        line += "".join(f" {cell[key(p) + '_us']:>11.1f}" for p in peers)
        line += "".join(f" {cell[ratio_key(p)]:>10.2f}" for p in ratios)
        print(line)


def ratio_key(peer: str) -> str:
    """The JSON key of trioring / peer: ``ratio`` for Gloo (as before the MPI peers)."""
    return "ratio" if peer == "gloo" else f"ratio_{key(peer)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--sizes", default="4,4K,4M,64M")
    parser.add_argument(
        "--collective",
        action="append",
        help="repeatable; 'all' for every collective the peers have too (default allreduce, "
        "broadcast, barrier)",
    )
    parser.add_argument("--transport", default="unix", help="trioring's (default unix)")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma list of {', '.join(PEERS)}, or none (default all); a peer left out "
        "need not be installed",
    )
    parser.add_argument("--mpirun", help="Open MPI's mpirun (default: mpirun on PATH)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="no barrier between timed calls, on every side (see trioring bench --help)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from trioring._bench import parse_sizes

    peers = parse_peers(args.peers)
    mpirun = args.mpirun or shutil.which("mpirun")
    problems = [problem for peer in peers if (problem := missing(peer, mpirun))]
    if problems:
        raise SystemExit("\n".join(f"error: {problem}" for problem in problems))
    collectives = args.collective or ["allreduce", "broadcast", "barrier"]
    if "all" in collectives:
        collectives = list(GLOO_COLLECTIVES)
    unmatched = [c for c in collectives if c not in GLOO_COLLECTIVES]
    if peers and unmatched:
        raise SystemExit(
            f"error: {', '.join(unmatched)}: not in the peers' set ({', '.join(GLOO_COLLECTIVES)}); "
            "run it with --peers none, or with `trioring bench`"
        )
    sizes = parse_sizes(args.sizes)
    sides = ["trioring", *peers]
    cells: dict[tuple[str, int], dict[str, list[float]]] = {}
    library = ""
    for round_ in range(args.rounds):
        for side in sides:
            if side == "trioring":
                rows = run_trioring(
                    args.n, args.sizes, collectives, args.transport, args.back_to_back
                )
            elif side == "gloo":
                rows = run_gloo(args.n, sizes, collectives, args.back_to_back)
            else:
                assert mpirun is not None
                rows, library = run_mpi(side, mpirun, args.n, sizes, collectives, args.back_to_back)
            for row in rows:
                cell = cells.setdefault(
                    (row["collective"], row["size"]), {key(s): [] for s in sides}
                )
                cell[key(side)].append(row["median_us"])
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    limit = socket_limit()
    table = []
    for (collective, size), rounds in cells.items():
        absent = [s for s in sides if not rounds[key(s)]]
        if absent:
            raise SystemExit(f"error: {collective} {size} B: no result from {', '.join(absent)}")
        ours = median(rounds["trioring"])
        cell = {"collective": collective, "size": size, "world_size": args.n,
                "transport": args.transport, "trioring_us": ours,
                "trioring_min_us": min(rounds["trioring"]),
                "trioring_max_us": max(rounds["trioring"])}  # fmt: skip
        for peer in peers:
            theirs = median(rounds[key(peer)])
            cell[key(peer) + "_us"] = theirs
            cell[ratio_key(peer)] = ours / theirs
        cell["rounds"] = rounds
        table.append(cell)
    versions = []
    if "gloo" in peers:
        versions.append(f"Gloo over TCP (torch {importlib.metadata.version('torch')})")
    if set(peers) & {"mpi-shm", "mpi-tcp"}:
        versions.append(
            f"{library} via mpi4py {importlib.metadata.version('mpi4py')} "
            "(mpi-shm: btl vader, mpi-tcp: btl tcp on lo; pml ob1)"
        )
    note = "back to back" if args.back_to_back else "a barrier between calls"
    summary = (
        f"world {args.n}, trioring over {args.transport}; {'; '.join(versions) or 'no peers'}; "
        f"medians of {args.rounds} alternating rounds, trioring's min-max over rounds; {note}; "
        f"Unix socket limit here: {limit:.2f} GB/s; on {describe(machine())}"
    )
    print(summary + "\n" if args.markdown else "# " + summary)
    print_table(table, peers, args.markdown)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "socket_limit_GBps": limit,
                    "back_to_back": args.back_to_back,
                    "peers": peers,
                    "mpi_library": library or None,
                    "machine": machine(),
                    "cells": table,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
