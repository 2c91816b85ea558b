"""Ranks writing into their peers' arrays (``_onehost._push``), where every rank of the
host has a CPU, above the slots' sizes: a broadcast's root writes the end of the array into
each reader's while they read the rest, and each rank of an allreduce (a reduce) writes its
finished segment into every peer's (the root's). The calls still return only with every byte in place, and no
write lands in an array once its owner's call has ended, however it ended.

Real ranks (tests/launched.py) run tests/workers/push_worker.py, which tells every rank
that the host has 64 CPUs, so that the root pushes at every world size on any machine.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

import trioring
from launched import broadcast_pushes, push_expected, run_reports
from trioring._collectives import _decision, _limits
from trioring._onehost import _push

WORKER = Path(__file__).parent / "workers" / "push_worker.py"
#: Bytes of the worker's natural calls: 1 MiB + 4 (pushed on Intel CPUs only), and just
#: above the limits that other CPUs set for pushing (pushed wherever the ranks push).
NATURAL_SIZES = (
    4 * _push.PUSH_MIN_BYTES + 4,
    max(_limits.PIPE_LIMITS_ELSEWHERE.pushed_reduce, _limits.PIPE_LIMITS_ELSEWHERE.pushed_broadcast)
    + 4,
)
ONEHOST = trioring.is_available("push")


def run_natural(tmp_path: Path, n: int, **env: str) -> list[dict[str, Any]]:
    """The worker's natural mode at NATURAL_SIZES, with ``env``."""
    env["NATURAL_SIZES"] = ",".join(map(str, NATURAL_SIZES))
    return run_reports(WORKER, ["natural", str(tmp_path)], tmp_path, n, env=env)


def test_capability_row(monkeypatch: pytest.MonkeyPatch) -> None:
    row = next(row for row in trioring.capabilities() if row.name == "push")
    assert row.kind == "feature"
    assert row.available == trioring.is_available("push")
    assert (row.reason is None) == row.available
    if not (trioring.is_available("cma") and trioring.is_available("shm")):
        assert row.reason is not None
        assert row.reason.startswith("needs cma and shm: "), row.reason
    monkeypatch.setenv("TRIORING_PUSH", "0")
    row = next(row for row in trioring.capabilities() if row.name == "push")
    assert (row.available, row.reason) == (False, "turned off by TRIORING_PUSH=0")


def test_the_fence_is_a_lock_that_is_left_free() -> None:
    _push.fence()
    assert _push._FENCE.acquire(blocking=False)
    _push._FENCE.release()


@pytest.mark.parametrize("n", [2, 3])
def test_the_ranks_cpus_decide_and_every_rank_agrees(tmp_path: Path, n: int) -> None:
    """Unforced, at 1 MiB and just above 4 MiB: a broadcast is pushed exactly where the
    ranks' CPUs number one for every rank (they inherit this process's) and the pipe's
    limit for pushed broadcasts is below its size (at 1 MiB, on Intel CPUs only), goes
    through the pipe otherwise; an allreduce is pushed wherever the feature is and the
    pipe's limit for pushed reductions is below its size, the same on every rank."""
    reports = run_natural(tmp_path, n)
    assert [report["errors"] for report in reports] == [[]] * n
    push = push_expected(n)
    sizes = NATURAL_SIZES
    pushed = [broadcast_pushes(n) and b > _decision.PIPE_MAX_PUSHED_BROADCAST_BYTES for b in sizes]
    reduced = [push and b > _decision.pipe_reduce_limit(True) for b in sizes]
    for report in reports:
        assert ("push" in report["features"]) is push, report
        if not (trioring.is_available("cma") and trioring.is_available("shm")):
            continue
        calls = report["calls"]
        assert calls.get("cma_broadcast", 0) == sum(pushed), report
        assert calls.get("pipe_broadcast", 0) == len(sizes) - sum(pushed), report
        assert calls.get("push_into", 0) == (sum(pushed) if report["rank"] == 0 else 0), report
        assert calls.get("_reduce_pushed", 0) == sum(reduced), report
        # Unpushed, an allreduce goes through the pipe up to PIPE_MAX_REDUCE_BYTES, by
        # cross-memory attach above.
        piped = [
            not r and b <= _decision.PIPE_MAX_REDUCE_BYTES
            for b, r in zip(sizes, reduced, strict=True)
        ]
        assert calls.get("pipe_allreduce", 0) == sum(piped), report
        # A broadcast's root writes into its readers; an allreduce's ranks, into each other.
        root_writes = any(pushed) and report["rank"] == 0
        assert (report["writes"] > 0) is (root_writes or any(reduced)), report


def test_one_rank_turning_pushing_off_turns_it_off_everywhere(tmp_path: Path) -> None:
    reports = run_natural(tmp_path, 2, PUSH_OFF_RANK="1")
    assert [report["errors"] for report in reports] == [[], []]
    for report in reports:
        assert "push" not in report["features"], report
        assert report["writes"] == 0, report
        assert "_reduce_pushed" not in report["calls"], report


@pytest.mark.parametrize("n", [2, 3, 4])
def test_pushed_broadcasts_are_whole_and_never_written_after_they_return(
    tmp_path: Path, n: int
) -> None:
    """Every root in turn, odd sizes and four dtypes; half of the readers overwrite their
    array the moment the call returns and check after the next call that nothing wrote over
    that, the others check their result: a reader that returned before the root's writes
    landed, or a root that wrote after, spoils one or the other."""
    reports = run_reports(WORKER, ["stress", str(tmp_path)], tmp_path, n)
    assert [report["errors"] for report in reports] == [[]] * n
    if not ONEHOST:
        assert all(report["writes"] == 0 for report in reports)
        return
    for report in reports:
        # Every rank was a broadcast's root (roots rotate over 3n calls) and pushed, wrote
        # its segments of 3n allreduces into every peer's array, and of 3n reduces into
        # the root's (all but its own 3).
        assert report["calls"].get("push_into", 0) == 3, report
        assert report["calls"].get("_reduce_pushed", 0) == 6 * n, report
        assert report["writes"] >= 3 * (n - 1) + 3 * n * (n - 1) + 3 * (n - 1), report
        assert "pushed" not in report["calls"], report


@pytest.mark.skipif(not ONEHOST, reason="needs cross-memory writes and the shared segment")
@pytest.mark.parametrize("collective", ["broadcast", "allreduce", "reduce"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_cancelled_while_a_peer_writes_into_it_waits_for_the_write(
    tmp_path: Path, n: int, collective: str
) -> None:
    """Rank 1 is cancelled once rank 0 is in its first write into its array, which rank 0
    holds until rank 1 has marked itself gone, and 0.2 s more: rank 1's call ends
    only after that write (the sentinel it writes at once survives), rank 0 writes no more
    into rank 1, and every rank hears that rank 1 cancelled."""
    reports = run_reports(WORKER, [f"cancel-in-{collective}", str(tmp_path)], tmp_path, n)
    canceller, root = reports[1], reports[0]
    assert canceller["root_was_writing"] is True, canceller
    assert canceller["cancelled"] is True, canceller
    assert "error" not in canceller, canceller
    assert canceller["calls"].get("pushed") == 1, canceller
    assert canceller["sentinel_whole"] is True, canceller
    assert canceller["next"]["type"] == "CommunicatorBrokenError", canceller
    assert root["writes_into_1"] == 1, root
    for report in reports[:1] + reports[2:]:
        error = report.get("error") or report["next"]
        assert error["peer"] == 1, report
        assert "cancelled" in error["message"], report


@pytest.mark.skipif(not ONEHOST, reason="needs cross-memory writes and the shared segment")
@pytest.mark.parametrize("collective", ["broadcast", "allreduce", "reduce"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_write_that_fails_fails_the_call_naming_the_peer(
    tmp_path: Path, n: int, collective: str
) -> None:
    """Rank 0's first write fails as a write into a process that is gone fails: rank 0
    raises PeerFailedError naming rank 1 and the call, and every rank raises."""
    reports = run_reports(WORKER, [f"write-fails-in-{collective}", str(tmp_path)], tmp_path, n)
    error = reports[0]["error"]
    assert error["type"] == "PeerFailedError", reports[0]
    assert error["peer"] == 1, reports[0]
    assert error["collective"] == collective, reports[0]
    assert "could not write into the memory of peer rank 1" in error["message"], reports[0]
    for report in reports:
        assert "returned" not in report, report


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_a_reduce_by_cross_memory_attach_gives_its_root_the_larger_segment(n: int) -> None:
    """The segments of a reduce by cross-memory attach cover the array once, in rank
    order, and the root's (which writes nothing into a peer) is ``1 + 1 / (2 (n - 1))``
    times another's, to an element; an allreduce's are equal shares. Every rank works them
    out alone, so this is all that keeps their reads and writes apart."""
    from trioring._onehost._cma_reductions import _segment_bounds

    for total in (0, 1, n - 1, n, 1001, 1 << 20):
        assert _segment_bounds(total, n, None) == [q * total // n for q in range(n + 1)]
        for root in range(n):
            bounds = _segment_bounds(total, n, root)
            assert bounds[0] == 0
            assert bounds[-1] == total
            assert bounds == sorted(bounds)
            sizes = [b - a for a, b in itertools.pairwise(bounds)]
            share = total / (n + 1 / (2 * (n - 1)))
            for q, size in enumerate(sizes):
                expected = share * (1 + 1 / (2 * (n - 1))) if q == root else share
                assert abs(size - expected) < 2, (total, root, sizes)


@pytest.mark.skipif(not ONEHOST, reason="needs cross-memory writes and the shared segment")
@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduces_that_do_not_push_are_whole_too(tmp_path: Path, n: int) -> None:
    """Where one rank refuses pushing, every reduce forced by cross-memory attach reads:
    its other ranks reduce their (smaller) segments into new arrays, and the root reads
    them. The stress mode's reduces (every root in turn, odd sizes, four dtypes) still come
    out right on the roots that check them, and every other rank's input unchanged."""
    env = {"PUSH_OFF_RANK": "0", "TRIORING_ALGORITHM": "reduce=cma"}
    reports = run_reports(WORKER, ["stress", str(tmp_path)], tmp_path, n, env=env)
    assert [report["errors"] for report in reports] == [[]] * n
    for report in reports:
        assert "push" not in report["features"], report
        assert report["writes"] == 0, report
        assert "_reduce_pushed" not in report["calls"], report
        # The 3n reduces, and the allreduces that went by cross-memory attach too.
        assert report["calls"].get("_reduce_segments", 0) >= 3 * n, report
