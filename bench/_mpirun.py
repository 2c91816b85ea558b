"""What the benchmarks' MPI sides (bench/compare.py, bench/paired.py) pass to Open MPI's
mpirun so that its traffic stays on this host's loopback."""

from __future__ import annotations

import re
import subprocess
import sys


def loopback_args(mpirun: str) -> list[str]:
    """Open MPI 4's setting that keeps mpirun's own channel to its ranks on loopback
    (``--mca oob_tcp_if_include lo``); none for Open MPI 5, whose runtime (PRRTE) refuses a
    channel on loopback alone ("No network interfaces were found for out-of-band
    communications") and needs none on one host: its ranks connect to it at 127.0.0.1
    (seen with ``ss -tanp`` under Open MPI 5.0.11, mpi4py's PyPI build; Debian 13 ships
    Open MPI 5), and it opens no connection to another address."""
    try:
        shown = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        shown = ""
    match = re.search(r"\(Open MPI\) (\d+)\.", shown)
    if match and int(match.group(1)) >= 5:
        return []
    return ["--mca", "oob_tcp_if_include", "lo"]


if __name__ == "__main__":
    # For the Makefile's check of mpi4py: the arguments for the mpirun on PATH (or argv[1]).
    print(" ".join(loopback_args(sys.argv[1] if len(sys.argv) > 1 else "mpirun")))
