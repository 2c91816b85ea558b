"""The shared-memory path for barriers and small collectives (``"shm"`` feature), across real
processes on Unix sockets: exact results, waits that park, other tasks during a wait,
mismatches with either path, a close from another task, and which collectives take how much
of a slot. The stress worker in test_fastpaths.py covers arrays overwritten on return and the
fallback when a rank refuses; test_faults.py covers killed and cancelling peers (many of its
worlds use this path).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import trioring
from launched import push_expected, threads_expected
from trioring._algorithms import World
from trioring._collectives import _allreduce, _broadcast, _decision, _gather, _reduce
from trioring._onehost import _shm, _shm_collectives, _shm_reductions

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import Worlds

SCRIPT = "shm_worker.py"

pytestmark = pytest.mark.skipif(
    not trioring.is_available("shm"), reason=f"shm unavailable: {_shm.unavailable_reason()}"
)


def error_of(report: dict[str, Any], step: str) -> dict[str, Any]:
    error: dict[str, Any] | None = report["steps"][step]["error"]
    assert error is not None, f"worker {report['index']}: {step} raised nothing"
    return error


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_results_are_bitwise_those_of_recursive_doubling(worlds: Worlds, world_size: int) -> None:
    world = worlds.start(SCRIPT, "exact", world_size=world_size, mode="unix-dir")
    threads = ["threads"] if threads_expected(world_size) else []
    push = ["push"] if push_expected(world_size) else []
    for report in world.finish():
        assert report["features"] == ["cma", *push, "shm", "spin", *threads] or report[
            "features"
        ] == [
            "shm",
            "spin",
        ], report["features"]
        assert report["errors"] == [], report["errors"]
        assert report["calls"] > 100


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("where", ["one per core", "one core for both"])
def test_ranks_pinned_to_cores(worlds: Worlds, where: str) -> None:
    """Ranks that a launcher pins one per core (mpirun binds 2 ranks so by default) may each
    run on one CPU, but their peers run on others: they poll and use the segment. Two ranks
    pinned to the same CPU do neither (a poll would only keep the peer off it); either way
    the results are exact."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    pins = cpus if where == "one per core" else [cpus[0], cpus[0]]
    world = worlds.start(
        SCRIPT,
        "exact",
        world_size=2,
        mode="unix-dir",
        env_overrides={index: {"WORKER_CPUS": str(cpu)} for index, cpu in enumerate(pins)},
    )
    for report in world.finish():
        features = set(report["features"])
        if where == "one per core":
            assert {"shm", "spin"} <= features, features
        else:
            assert not {"shm", "spin"} & features, features
        assert report["errors"] == [], report["errors"]
        assert report["calls"] > 100


def test_waits_that_park_still_complete(worlds: Worlds) -> None:
    world = worlds.start(SCRIPT, "late", world_size=3, mode="unix-dir")
    for report in world.finish():
        assert "shm" in report["features"]
        assert report["errors"] == [], report["errors"]


def test_a_store_wakes_a_parked_wait(worlds: Worlds) -> None:
    """A wait that has gone to sleep in the event loop ends on the peer's store, not on a
    timer: the worker sets the timer beyond the test's deadline."""
    world = worlds.start(SCRIPT, "woken", world_size=3, mode="unix-dir")
    for report in world.finish():
        assert "shm" in report["features"]
        assert report["errors"] == [], report["errors"]


def test_wake_parked_writes_each_park_once() -> None:
    """Two ranks' views of one segment in this process: a store wakes a parked peer once per
    park, through its eventfd, and a peer that is not parked costs no system call."""
    fd = _shm.create_segment(2)
    wakers = _shm.create_wakers(2)
    try:
        ranks = [
            _shm.SharedSlots(fd, r, 2, {}, wakers=[os.dup(w) for w in wakers], oversubscribed=False)
            for r in (0, 1)
        ]
    finally:
        os.close(fd)
        for waker in wakers:
            os.close(waker)
    zero, one = ranks

    def count(slots: _shm.SharedSlots) -> int:
        try:
            return os.eventfd_read(slots.waker)
        except BlockingIOError:
            return 0

    zero.wake_parked()
    assert count(one) == 0
    one.park()
    zero.wake_parked()
    zero.wake_parked()  # the same park: no second write
    assert count(one) == 1
    one.unpark()
    zero.wake_parked()
    assert count(one) == 0
    one.park()
    zero.wake_parked()
    one.unpark()  # empties the eventfd
    assert count(one) == 0
    for slots in ranks:
        slots.close()


def test_a_segment_without_wakers_parks_on_the_timer_alone() -> None:
    """Above WAKER_MAX_RANKS the segment comes without eventfds: parking and waking are
    then no-ops, and nothing is closed twice."""
    fd = _shm.create_segment(2)
    try:
        zero = _shm.SharedSlots(fd, 0, 2, {}, wakers=[], oversubscribed=False)
        one = _shm.SharedSlots(fd, 1, 2, {}, wakers=[], oversubscribed=False)
    finally:
        os.close(fd)
    one.park()
    zero.wake_parked()
    one.unpark()
    assert (zero.waker, zero.peer_parked) == (-1, [])
    for slots in (zero, one):
        slots.close()


def test_other_tasks_run_while_a_rank_waits_on_the_segment(worlds: Worlds) -> None:
    world = worlds.start(SCRIPT, "busy", world_size=2, mode="unix-dir")
    reports = world.finish()
    assert reports[0]["ticks"] == 100
    assert all("shm" in report["features"] for report in reports)


@pytest.mark.parametrize("other", ["barrier", "large"])
def test_mismatch_raises_on_every_rank(worlds: Worlds, other: str) -> None:
    """Rank 1 calls a barrier (also through the segment) or an allreduce too large for it
    (through the sockets) where ranks 0 and 2 allreduce 4 bytes: every rank raises, and the
    ranks that see the difference name both calls."""
    world = worlds.start(SCRIPT, "mismatch", world_size=3, mode="unix-dir", args=[other])
    reports = world.finish()
    theirs = "barrier" if other == "barrier" else "float32[262144]"
    for report in reports:
        assert report["steps"]["agreed"]["error"] is None
        error = error_of(report, "mismatched")
        assert error["type"] in ("CollectiveMismatchError", "PeerAbortedError"), error
    for report in reports:
        error = error_of(report, "mismatched")
        if error["type"] == "CollectiveMismatchError":
            assert "allreduce(sum) float32[1]" in error["message"], error
            assert theirs in error["message"], error
    assert any(error_of(r, "mismatched")["type"] == "CollectiveMismatchError" for r in reports)


def test_a_peer_that_gave_up_after_a_call_completed_it(worlds: Worlds) -> None:
    """Rank 1 finishes a barrier, then gives up (cancelled) in an allreduce, while rank 0 has
    not looked at the segment since it published the barrier. Rank 0's barrier completed
    (both ranks published it, and rank 1 saw that), so it returns; its allreduce, which rank
    1 published but gave up in, raises, naming rank 1 and the cancellation. (Found by CI:
    the mismatch test above, with a rank descheduled at the wrong moment, raised in its
    agreed barrier.)"""
    world = worlds.start(SCRIPT, "gave_up_later", world_size=2, mode="unix-dir")
    first, second = world.finish()
    for report in (first, second):
        assert report["steps"]["barrier"]["error"] is None, report["steps"]["barrier"]
    assert second["steps"]["next"]["error"] is None  # move_on_after caught the Cancelled
    assert second["broken"] is True
    error = error_of(first, "next")
    assert error["type"] == "PeerAbortedError", error
    assert error["peer"] == 1, error
    assert error["reason"] == "cancelled", error


def test_close_from_another_task_ends_a_wait(worlds: Worlds) -> None:
    world = worlds.start(SCRIPT, "closed", world_size=2, mode="unix-dir")
    report = world.finish()[0]
    error = error_of(report, "barrier")
    assert error["type"] == "CommunicatorClosedError", error


def test_a_segment_must_be_a_memfd(tmp_path: Path) -> None:
    """A descriptor from a peer is mapped only if it is a memfd (it has seals), never, say, a
    file that our writes would then land in."""
    with (tmp_path / "file").open("wb+") as file:
        file.truncate(_shm.segment_bytes(2))
        wakers = _shm.create_wakers(2)
        try:
            with pytest.raises(OSError, match="Invalid argument") as info:
                _shm.SharedSlots(file.fileno(), 0, 2, {}, wakers=wakers, oversubscribed=False)
            assert info.value.errno == errno.EINVAL
            # Nor is a file taken for a peer's eventfd, which this rank writes into.
            fd = _shm.create_segment(2)
            try:
                with pytest.raises(OSError, match="not an eventfd"):
                    _shm.SharedSlots(
                        fd, 0, 2, {}, wakers=[wakers[0], file.fileno()], oversubscribed=False
                    )
                slots = _shm.SharedSlots(fd, 0, 2, {}, wakers=wakers, oversubscribed=False)
            finally:
                os.close(fd)
        except BaseException:
            for waker in wakers:
                os.close(waker)
            raise
    assert slots.seqs[slots.own_word] == 0
    slots.close()
    assert slots.wakers == []  # closed with the slots


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_the_collectives_that_gained_take_the_whole_slot(
    monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    """The decision table sends reduces, and where no rank is crowded gathers, reduce_scatters
    and (where the slots take them in pieces) broadcasts through the slots up to the whole
    slot (SLOT_PAYLOAD_BYTES, and for the reductions their share of the scratch); allreduce
    and the other copying collectives stop at SHM_MAX_BYTES. A forced "shm" takes what the
    slot holds whatever the table's choice."""
    fd = _shm.create_segment(world_size)
    try:
        slots = _shm.SharedSlots(fd, 0, world_size, {}, wakers=[], oversubscribed=False)
    finally:
        os.close(fd)
    scratch = np.zeros(1 << 20, np.uint8)  # the default chunk_bytes
    world = World(
        rank=0, size=world_size, links={}, chunk_bytes=scratch.nbytes, scratch=scratch, shm=slots
    )
    _allreduce.shm_bytes(world)  # as a communicator does when it is made
    share = scratch.nbytes // _shm_reductions.reduce_temporaries(world_size)
    wide = min(_shm.SLOT_PAYLOAD_BYTES, share)
    assert world.slot_reduce_bytes == min(_shm.SHM_MAX_BYTES, share) < _shm.SLOT_PAYLOAD_BYTES
    assert world.slot_wide_reduce_bytes == wide
    # 2 log2 p arrays of scratch: the whole slot at worlds 2-3, 256 KiB at 4-7, less above.
    assert wide == {2: 512 << 10, 3: 512 << 10, 4: 256 << 10, 8: (1 << 20) // 6}[world_size]
    intel_pieces = 3 * _shm.BROADCAST_PIECE_MIN_BYTES
    for crowded in (False, True):
        slots.crowded = crowded
        assert _reduce.shm_limit(world) == wide
        narrow = world.slot_reduce_bytes if crowded else wide
        assert _reduce.shm_limit(world, scatter=True) == narrow
        blocks = _shm.SHM_MAX_BYTES if crowded else _shm.SLOT_PAYLOAD_BYTES
        assert _gather.shm_limit(world) == blocks
        assert _reduce.unrunnable("reduce_scatter", "shm", world, wide) is None
        assert "at most" in str(_reduce.unrunnable("reduce", "shm", world, wide + 1))
        for pieces in (intel_pieces, _shm.slot_pieces_from_bytes("AuthenticAMD")):
            monkeypatch.setattr(_shm_collectives, "_PIECES_FROM_BYTES", pieces)
            most = _shm.SHM_MAX_BYTES
            if pieces == intel_pieces and not crowded:
                most = _shm.SLOT_PAYLOAD_BYTES
            assert _broadcast.shm_limit(world) == most
            assert _broadcast.decide(world, most) == "shm"
            assert _broadcast.decide(world, most + 1) == "pipe"
            assert _broadcast.unrunnable("shm", world, _shm.SLOT_PAYLOAD_BYTES) is None
            assert "at most" in str(
                _broadcast.unrunnable("shm", world, _shm.SLOT_PAYLOAD_BYTES + 1)
            )
    assert _decision.shm_copy_bytes("gather") == _shm.SLOT_PAYLOAD_BYTES
    for collective in ("allgather", "alltoall", "scatter", "scan", "exscan"):
        assert _decision.shm_copy_bytes(collective) == _shm.SHM_MAX_BYTES
    assert _decision.copy_unrunnable("gather", "shm", world, _shm.SLOT_PAYLOAD_BYTES) is None
    world.shm = None
    assert _broadcast.shm_limit(world) == _reduce.shm_limit(world) == -1
    assert _gather.shm_limit(world) == -1
    slots.close()
