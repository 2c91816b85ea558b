"""Reading a large array from a peer in threads (``_cma_collectives.read_threads``): a
broadcast's readers read in ``READ_THREADS`` threads where the host's CPUs allow, and the
call still returns only when every byte is in place and no thread reads any more.

Real ranks (tests/launched.py) run tests/workers/threads_worker.py, which tells every rank
that the host has 64 CPUs, so that every world size reads in threads on any machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import trioring
from launched import run_reports, threads_expected
from trioring._collectives import _decision
from trioring._onehost import _cma_collectives
from trioring._onehost._shm import SHM_MAX_BYTES

WORKER = Path(__file__).parent / "workers" / "threads_worker.py"
ONEHOST = trioring.is_available("cma") and trioring.is_available("shm")
MIN = _cma_collectives.READ_THREADS_MIN_BYTES


def test_the_table_reads_in_threads_only_where_told() -> None:
    assert _decision.broadcast(MIN, SHM_MAX_BYTES, True, threads=True) == "cma"
    assert _decision.broadcast(MIN, SHM_MAX_BYTES, True, threads=False) == "pipe"
    assert _decision.broadcast(MIN, SHM_MAX_BYTES, False, threads=True) == "pipe"
    assert _decision.broadcast(SHM_MAX_BYTES, SHM_MAX_BYTES, True, threads=True) == "shm"
    assert _decision.broadcast(MIN, -1, True, threads=True) == "cma"
    assert _decision.broadcast(MIN, -1, False, threads=True) == "tree"


def test_capability_row(monkeypatch: pytest.MonkeyPatch) -> None:
    row = next(row for row in trioring.capabilities() if row.name == "threads")
    assert row.kind == "feature"
    assert row.available == trioring.is_available("threads")
    assert (row.reason is None) == row.available
    if not ONEHOST:
        assert row.reason is not None
        assert row.reason.startswith("needs cma and shm: "), row.reason
    monkeypatch.setenv("TRIORING_THREADS", "0")
    row = next(row for row in trioring.capabilities() if row.name == "threads")
    assert (row.available, row.reason) == (False, "turned off by TRIORING_THREADS=0")


@pytest.mark.parametrize("n", [2, 3])
def test_the_ranks_cpus_decide_and_every_rank_agrees(tmp_path: Path, n: int) -> None:
    """Unforced: a broadcast of the threshold's size reads in threads exactly where the
    ranks' CPUs number two for every reader (they inherit this process's), by the pipe
    otherwise; the feature says which, the same on every rank."""
    reports = run_reports(WORKER, ["natural", str(tmp_path)], tmp_path, n)
    assert [report["errors"] for report in reports] == [[]] * n
    threads = threads_expected(n, push=False)  # the worker turns pushing off
    for report in reports:
        assert ("threads" in report["features"]) is threads, report
        if ONEHOST:
            algorithm = "cma_broadcast" if threads else "pipe_broadcast"
            assert report["calls"].get(algorithm) == 1, report
            assert (report["calls"].get("_read_shares", 0) == 1) is (
                threads and report["rank"] != 0
            )


def test_one_rank_turning_threads_off_turns_them_off_everywhere(tmp_path: Path) -> None:
    reports = run_reports(
        WORKER, ["natural", str(tmp_path)], tmp_path, 2, env={"THREADS_OFF_RANK": "1"}
    )
    assert [report["errors"] for report in reports] == [[], []]
    for report in reports:
        assert "threads" not in report["features"], report
        assert "_read_shares" not in report["calls"], report
        if ONEHOST:
            assert report["calls"].get("pipe_broadcast") == 1, report


@pytest.mark.parametrize("n", [2, 3, 4])
def test_large_broadcasts_read_in_threads_are_whole_when_they_return(
    tmp_path: Path, n: int
) -> None:
    """Every root in turn, odd sizes and four dtypes; half of the ranks overwrite their
    array the moment the call returns, the others check theirs: a root that returned while
    a reader read, or a helper thread that wrote after the call, spoils a checked result."""
    reports = run_reports(WORKER, ["stress", str(tmp_path)], tmp_path, n)
    assert [report["errors"] for report in reports] == [[]] * n
    if not ONEHOST:
        assert all(report["calls"] == {} for report in reports)
        return
    for report in reports:
        # Every rank read as a non-root (roots rotate over 2n calls), in threads.
        assert report["calls"].get("_read_shares", 0) >= 1, report
        assert report["reads"]["helpers"] >= 1, report
        # Two reads at once (the worker has the first two meet): threads together.
        assert report["reads"]["most"] >= 2, report
        assert report["reads"]["now"] == 0, report


@pytest.mark.skipif(not ONEHOST, reason="needs cross-memory attach and the shared segment")
@pytest.mark.parametrize("n", [2, 3])
def test_a_reader_cancelled_while_its_helpers_read_stops_them_first(tmp_path: Path, n: int) -> None:
    """Rank 1's cancel scope is cancelled by its own first read, after its helper started
    (whose first read waits until the call is over, or half a second): the call ends only
    once the helper has (no read in flight), the helper stops after that read, the
    communicator is broken, and every other rank hears that rank 1 gave up."""
    reports = run_reports(WORKER, ["cancel", str(tmp_path)], tmp_path, n)
    canceller = reports[1]
    assert canceller["cancelled"] is True, canceller
    assert "error" not in canceller, canceller
    assert canceller["in_flight_after"] == 0, canceller
    assert canceller["helper_reads"] == 1, canceller  # told to stop after its first read
    assert canceller["next"]["type"] == "CommunicatorBrokenError", canceller
    assert "cancelled" in canceller["next"]["message"], canceller
    for report in reports[:1] + reports[2:]:
        error = report.get("error") or report["next"]
        assert error["peer"] == 1, report
        assert "cancelled" in error["message"], report


@pytest.mark.skipif(not ONEHOST, reason="needs cross-memory attach and the shared segment")
@pytest.mark.parametrize("n", [2, 3])
def test_a_helper_that_cannot_read_fails_the_call_naming_the_peer(tmp_path: Path, n: int) -> None:
    """Rank 1's helper thread fails its first read as a read from a process that is gone
    fails: rank 1 raises the peer's failure, naming rank 0 and the call, once no read is in
    flight, and every rank raises."""
    reports = run_reports(WORKER, ["helper-fails", str(tmp_path)], tmp_path, n)
    reader = reports[1]
    error = reader["error"]
    assert error["type"] == "PeerFailedError", reader
    assert error["peer"] == 0, reader
    assert error["collective"] == "broadcast", reader
    assert "could not read the memory of peer rank 0" in error["message"], reader
    assert reader["in_flight_after"] == 0, reader
    for report in reports:
        assert "returned" not in report or report["next"]["type"].endswith("Error"), report
