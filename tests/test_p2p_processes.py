"""Point-to-point messages and sub-communicators in real processes (tests/launched.py): issue
16's code as a user writes it, over Unix sockets and TCP; large messages by cross-memory
attach (PULL) and without; a rank SIGKILLed during a large send and a pending receive; a
killed rank breaks the world and every sub-communicator that contains it, on every
survivor, and no other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trioring
from launched import push_expected, run_killed, run_reports, threads_expected

WORKER = Path(__file__).parent / "workers" / "groups_worker.py"
CMA_HERE = trioring.is_available("cma")


@pytest.mark.parametrize(("transport", "n"), [("unix", 4), ("unix", 3), ("tcp", 3)])
def test_issue_snippet(tmp_path: Path, transport: str, n: int) -> None:
    reports = run_reports(WORKER, ["snippet", str(tmp_path)], tmp_path, n, transport=transport)
    assert reports[1]["a"] == np.arange(10.0).tolist()
    assert reports[1]["a_dtype"] == "float64"
    assert reports[1]["buf"] == (np.arange(10.0) * 2).tolist()
    total = float(sum(range(n)))
    for r, report in enumerate(reports):
        left = (r - 1) % n
        assert report["halo"] == [float(left)] * 5
        assert report["any"] == [left, [left * 100]]
        members = [p for p in range(n) if p % 2 == r % 2]
        assert report["half"] == [members.index(r), len(members), [float(sum(members))] * 5]
        assert report["big"] == [total, total]
        assert report["small"] == [[p, 10 * p] for p in range(n)]
        assert report["wide"] == [float(n - 1), float(n - 1)]
        assert report["cfg"] == {"lr": 0.1, "layers": [64, 64], "name": "run-7"}
        assert report["stats"] == [[p, 0.5, [0.0] * 4] for p in range(n)]
        assert report["rows"] == ([["ok", p] for p in range(n)] if r == 0 else None)
        assert report["obj"] == {"step": 3, "from": left}
        if transport == "unix" and len(members) > 1:
            # The one-host paths keep working in a sub-communicator whose ranks all qualify;
            # "threads" where the half's CPUs are enough for its fewer readers (each
            # communicator counts its own ranks' CPUs, as it judges crowding).
            half, world = set(report["half_features"]), set(report["features"])
            assert half - {"threads"} == world - {"threads"}, report
            assert ("threads" in half) is threads_expected(len(members)), report
            assert ("push" in half) is push_expected(len(members)), report


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("cma", [True, False], ids=["cma", "cma-off"])
def test_large_messages_by_cross_memory_attach(tmp_path: Path, n: int, cma: bool) -> None:
    """Messages above the eager limit go by PULL where the ranks agreed on cross-memory
    attach (else by DATA frames), each rank sending and receiving at once, arrays
    overwritten as soon as their send returns: every message arrives whole."""
    env = {} if cma else {"TRIORING_CMA": "0"}
    reports = run_reports(WORKER, ["pull", str(tmp_path)], tmp_path, n, env=env)
    for report in reports:
        assert report["wrong"] == [], report
        used = "cma" in report["features"]
        assert used is (cma and CMA_HERE), report
        assert report["pulls"] == (report["messages"] if used else 0), report
        assert report["messages"] == 9, report


@pytest.mark.parametrize(("n", "seed"), [(2, 1), (3, 2)])
@pytest.mark.parametrize("cma", [True, False], ids=["cma", "cma-off"])
def test_large_messages_under_random_cancellation(
    tmp_path: Path, n: int, seed: int, cma: bool
) -> None:
    """Every large send and receive under a random deadline, tried again while cancelled:
    each message arrives once, whole and in order, by PULL as by DATA frames."""
    env = {} if cma else {"TRIORING_CMA": "0"}
    reports = run_reports(WORKER, ["pull-cancel", str(tmp_path), str(seed)], tmp_path, n, env=env)
    for report in reports:
        assert report["wrong"] == [], report
        assert ("cma" in report["features"]) is (cma and CMA_HERE), report


@pytest.mark.parametrize("n", [2, 3, 4])
def test_eager_messages_land_whole_in_out(tmp_path: Path, n: int) -> None:
    """Eager messages of odd sizes up to the eager limit, received into one ``out`` buffer
    overwritten after every check while each rank also sends, its arrays overwritten as
    soon as each send returns: every message lands whole, whether a polling receive took it
    off the socket (into ``out`` straight) or the reader did."""
    reports = run_reports(WORKER, ["eager", str(tmp_path)], tmp_path, n)
    for report in reports:
        assert report["wrong"] == [], report
        assert report["messages"] == 21, report
    # Which of the two took each message depends on the scheduler (how many of them a
    # receive found whole on the socket): tests/test_p2p_polling.py makes each case happen.


@pytest.mark.parametrize(("n", "seed"), [(2, 1), (4, 2)])
def test_eager_messages_under_random_cancellation(tmp_path: Path, n: int, seed: int) -> None:
    """Every eager send and receive under a random deadline, tried again while cancelled:
    each message arrives once, whole and in order, into the receive's ``out``."""
    reports = run_reports(WORKER, ["eager-cancel", str(tmp_path), str(seed)], tmp_path, n)
    for report in reports:
        assert report["wrong"] == [], report


def test_killed_during_large_send_and_pending_recv(tmp_path: Path) -> None:
    victim = 2
    survivors = run_killed(WORKER, ["kill-p2p", str(tmp_path), str(victim)], tmp_path, victim, n=3)
    for rank, report in survivors.items():
        assert report["error"] == "PeerFailedError", (rank, report)
        assert report["peer"] == victim, report
        assert f"rank {victim}" in report["message"], report
        assert report["elapsed"] < 10.0, report


def test_killed_rank_breaks_every_communicator_that_contains_it(tmp_path: Path) -> None:
    victim = 3
    survivors = run_killed(
        WORKER, ["kill-groups", str(tmp_path), str(victim)], tmp_path, victim, n=4
    )
    for rank, report in survivors.items():
        for name in ("world", "dup"):
            assert report[name]["error"] is not None, (rank, name, report)
            assert report[name]["elapsed"] < 10.0, report
        if rank % 2 == victim % 2:
            assert report["half"]["error"] is not None, (rank, report)
            # The half's ranks: the victim is rank 1 of the odd half.
            assert report["half"]["peer"] in (1, None), report
        else:
            assert report["half"]["error"] is None, (rank, report)
