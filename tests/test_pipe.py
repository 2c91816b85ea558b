"""The shared segment's pipe (``_onehost._pipe``) when a call through it goes wrong, across
real processes: a rank dies, cancels or disagrees in the middle of the stream, and every
other rank raises, naming it, instead of waiting on a word that will never move.

Results through the pipe (every world size 2-5, ring wrap-around, empty arrays) are checked
by tests/test_algorithms_forced.py (forced) and tests/test_fastpaths.py (chosen by the table,
arrays overwritten on return)."""

from __future__ import annotations

from pathlib import Path

import pytest

import trioring
from launched import run_killed, run_reports

WORKER = Path(__file__).parent / "workers" / "pipe_worker.py"

pytestmark = pytest.mark.skipif(
    not trioring.is_available("shm"), reason="no shared segment on this machine"
)


COLLECTIVES = [
    "broadcast",
    "allreduce",
    "reduce",
    "reduce_scatter",
    "allgather",
    "gather",
    "scatter",
    "alltoall",
]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("victim", [0, 2], ids=["root", "other"])
def test_sigkill_in_the_stream(tmp_path: Path, victim: int, collective: str) -> None:
    """A rank dies at its third chunk (rank 0, the root of the rooted collectives, or rank
    2): every survivor raises PeerFailedError naming it within seconds, whether it was
    waiting on the victim's produced or consumed word, on a rank stuck behind it, or on the
    done words."""
    args = ["kill", str(tmp_path), str(victim), collective]
    survivors = run_killed(WORKER, args, tmp_path, victim)
    for report in survivors.values():
        assert report["error"] == "PeerFailedError", report
        assert report["peer"] == victim, report
        assert report["broken"], report
        assert report["elapsed"] < 5.0, report


def test_sigkill_between_the_pieces_of_a_broadcast_through_the_slots(tmp_path: Path) -> None:
    """The root of a 256 KiB broadcast through the slots dies after its third piece of
    four: the others, each waiting for the fourth, raise PeerFailedError naming it, as
    they would had it died before publishing."""
    survivors = run_killed(WORKER, ["kill", str(tmp_path), "0", "slot_broadcast"], tmp_path, 0)
    for report in survivors.values():
        assert report["error"] == "PeerFailedError", report
        assert report["peer"] == 0, report
        assert report["broken"], report
        assert report["elapsed"] < 5.0, report


@pytest.mark.parametrize("victim", [0, 3], ids=["root", "receiver"])
def test_cancel_in_the_stream(tmp_path: Path, victim: int) -> None:
    """A rank whose caller cancels it mid-stream is cancelled (its communicator broken), and
    every other rank raises PeerAbortedError naming it."""
    reports = run_reports(WORKER, ["cancel", str(tmp_path), str(victim)], tmp_path, 4)
    for rank, report in enumerate(reports):
        assert report["broken"], report
        assert report["elapsed"] < 5.0, report
        if rank == victim:
            assert report["cancelled"], report
            assert report["error"] is None, report
        else:
            assert report["error"] == "PeerAbortedError", report
            assert report["peer"] == victim, report
            assert f"rank {victim}" in report["message"], report


def test_two_roots_raise_everywhere(tmp_path: Path) -> None:
    """Rank 1 streams as the root while the others take rank 0 for it: both write the ring,
    nobody copies a chunk out, every rank raises CollectiveMismatchError."""
    reports = run_reports(WORKER, ["mismatch", str(tmp_path), "1"], tmp_path, 4)
    for report in reports:
        assert report["error"] == "CollectiveMismatchError", report
        assert "root" in report["message"], report
        assert report["elapsed"] < 5.0, report
