"""The one-host paths of the collectives that only copy: the shared segment's slots
(allgather, gather, alltoall, and reduce_scatter and reduce, up to the most each takes;
scatter, scatterv, allgatherv, gatherv and alltoallv on each side of where the decision
table stops taking them), its pipe (those, allgatherv and scatter, and the reductions:
reduce_scatter(v) and reduce) and cross-memory attach (the same; with its control through
the segment, and by frames where there is no segment), each forced at worlds 2-5 in real
processes over Unix sockets, on seeded inputs of several dtypes at sizes from empty to
several chunks, with every rank that is not checking overwriting its buffers the moment a
call returns (see tests/workers/onehost_worker.py). A call too large for the shared segment
is refused before any I/O. Which path the decision table picks is tested in each
collective's own file."""

from __future__ import annotations

from pathlib import Path

import pytest

import trioring
from launched import run_reports

WORKER = Path(__file__).parent / "workers" / "onehost_worker.py"
CASES = [
    *((c, "shm") for c in ("allgather", "gather", "alltoall")),
    # The reductions that take the whole slot, up to it (allreduce's share stops earlier).
    *((c, "shm") for c in ("reduce_scatter", "reduce")),
    *((c, "cma") for c in ("allgather", "allgatherv", "gather", "scatter", "alltoall")),
    # Cross-memory attach without a shared segment: its control goes by frames.
    *((c, "cma-frames") for c in ("allgather", "gather", "scatter", "alltoall")),
    # The reductions by cross-memory attach read like the copies do.
    *(
        (c, a)
        for c in ("reduce_scatter", "reduce_scatterv", "reduce")
        for a in ("cma", "cma-frames")
    ),
    # The segment's pipe, for every collective that may take it.
    *(
        (c, "pipe")
        for c in (
            "allgather",
            "allgatherv",
            "gather",
            "scatter",
            "alltoall",
            "reduce_scatter",
            "reduce_scatterv",
            "reduce",
        )
    ),
    # Only the root knows a scatter's size before its first round, so its segment path
    # cannot be forced: the worker scatters on each side of where the decision leaves it.
    # Likewise the uneven ones, whose sizes every rank learns with the counts.
    *((c, "auto") for c in ("scatter", "scatterv", "allgatherv", "gatherv", "alltoallv")),
]


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize(("collective", "algorithm"), CASES)
def test_forced_onehost_path(tmp_path: Path, collective: str, algorithm: str, n: int) -> None:
    feature = {"auto": "shm", "cma-frames": "cma", "pipe": "shm"}.get(algorithm, algorithm)
    if not trioring.is_available(feature):
        pytest.skip(f"{feature} is not available here: {trioring.capabilities()}")
    env = {"TRIORING_SHM": "0"} if algorithm == "cma-frames" else {}
    forced = algorithm.removesuffix("-frames")
    reports = run_reports(WORKER, [collective, forced, str(tmp_path)], tmp_path, n, env=env)
    errors = [error for report in reports for error in report["errors"]]
    assert not errors, "\n".join(errors)
    assert all(feature in report["features"] for report in reports)
    if algorithm == "cma-frames":
        assert all("shm" not in report["features"] for report in reports)
    elif algorithm == "cma":
        assert all("shm" in report["features"] for report in reports) is trioring.is_available(
            "shm"
        )
    if algorithm == "shm" and collective != "allgatherv":
        for report in reports:
            refused = report["refused"]
            assert refused is not None
            assert refused["seq_unchanged"]
            assert f"the forced {collective} algorithm 'shm' takes " in refused["message"]
