"""A deadline that fires inside a collective names the ranks the collective was waiting for
(issue 14): in a WARNING on the ``trioring`` logger, in a note on the ``Cancelled`` that
leaves the collective, in the next call's ``CommunicatorBrokenError`` and, through the abort
frame, in the peers' ``PeerAbortedError``.

In one process (``open_local_world``, virtual time, so the elapsed times are exact), then
across real processes over TCP and over Unix sockets with the shared segment (see
``workers/deadline_worker.py``).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from trioring import _algorithms
from trioring._framing import Link
from trioring._onehost import _shm
from trioring._wire import Kind, OpSpec
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from conftest import World, Worlds

SCRIPT = "deadline_worker.py"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "trioring" and record.levelno == logging.WARNING
    ]


# -- in one process ------------------------------------------------------------------------


async def allreduce_noting_escape(
    comm: trioring.Communicator, array: np.ndarray[Any, Any], escaped: dict[int, BaseException]
) -> None:
    try:
        await comm.allreduce(array)
    except BaseException as exc:
        escaped[comm.rank] = exc
        raise


async def test_every_deadline_fires_at_once_and_each_rank_names_whom_it_waited_for(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 2 never enters allreduce #2; ranks 0 and 1 have the same 5 s deadline, which
    fires on both at once, so neither hears of the other's cancellation. With recursive
    doubling on three ranks, rank 0 waits for the array rank 2 folds in, and rank 1 for its
    exchange with rank 0: each says so, with the exact virtual time."""
    caplog.set_level(logging.WARNING, logger="trioring")
    escaped: dict[int, BaseException] = {}
    broken: dict[int, str] = {}
    array = np.ones(4, np.float32)
    async with open_local_world(3) as comms:
        done = trio.Event()

        async def rank_main(comm: trioring.Communicator) -> None:
            await comm.allreduce(array.copy())
            if comm.rank == 2:
                await done.wait()
                return
            with pytest.raises(trio.TooSlowError), trio.fail_after(5):
                await allreduce_noting_escape(comm, array.copy(), escaped)
            assert trio.current_time() == 5
            with pytest.raises(trioring.CommunicatorBrokenError) as info:
                await comm.barrier()
            broken[comm.rank] = str(info.value)
            if len(broken) == 2:
                done.set()

        async with trio.open_nursery() as nursery:
            for comm in comms:
                nursery.start_soon(rank_main, comm)

    expected = {
        0: "rank 0: allreduce #2 cancelled after 5.0 s while waiting for rank 2",
        1: "rank 1: allreduce #2 cancelled after 5.0 s while waiting for rank 0",
    }
    assert sorted(warnings_of(caplog)) == [expected[0], expected[1]]
    for rank, message in expected.items():
        exc = escaped[rank]
        assert isinstance(exc, trio.Cancelled | BaseExceptionGroup), exc
        assert getattr(exc, "__notes__", []) == [message]
        assert broken[rank] == (
            f"rank {rank}: barrier #3: the communicator is broken since "
            f"{message.removeprefix(f'rank {rank}: ').replace(' cancelled', ' was cancelled', 1)}"
            "; open a new communicator"
        )


async def test_a_peer_hears_whom_the_cancelled_rank_was_waiting_for(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Only rank 0 has a deadline: rank 1, waiting for rank 0, gets its abort frame, whose
    reason says what rank 0 was waiting for; rank 2, which enters late, hears it too
    (from rank 0 or relayed by rank 1). ``reason`` stays ``"cancelled"``."""
    caplog.set_level(logging.WARNING, logger="trioring")
    errors: dict[int, trioring.CollectiveError] = {}
    array = np.ones(4, np.float32)
    async with open_local_world(3) as comms:
        cancelled = trio.Event()

        async def rank_main(comm: trioring.Communicator) -> None:
            await comm.allreduce(array.copy())
            if comm.rank == 0:
                with pytest.raises(trio.TooSlowError), trio.fail_after(2.5):
                    await comm.allreduce(array.copy())
                cancelled.set()
                return
            if comm.rank == 2:
                await cancelled.wait()
                await trio.sleep(1)
            with pytest.raises(trioring.PeerAbortedError) as info:
                await comm.allreduce(array.copy())
            errors[comm.rank] = info.value

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(rank_main, comm)

    news = "rank 0 cancelled allreduce #2 after 2.5 s while waiting for rank 2"
    assert warnings_of(caplog) == [
        "rank 0: allreduce #2 cancelled after 2.5 s while waiting for rank 2"
    ]
    assert str(errors[1]) == f"rank 1: allreduce #2: {news}"
    assert (errors[1].peer, errors[1].reason) == (0, "cancelled")
    assert str(errors[2]) in (
        f"rank 2: allreduce #2: {news}",
        f"rank 2: allreduce #2: {news} (relayed by rank 1)",
    )
    assert (errors[2].peer, errors[2].reason) == (0, "cancelled")


async def test_a_short_scope_is_reported_in_milliseconds(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Any cancel scope is reported, not only a deadline; under a tenth of a second the
    time is in milliseconds, where tenths of seconds would say "0.0 s"."""
    caplog.set_level(logging.WARNING, logger="trioring")
    async with open_local_world(2) as comms:

        async def rank0() -> None:
            with trio.move_on_after(0.0125):
                await comms[0].barrier()

        async def rank1() -> None:
            await trio.sleep(1)
            with pytest.raises(trioring.PeerAbortedError):
                await comms[1].barrier()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank0)
            nursery.start_soon(rank1)
    assert warnings_of(caplog) == [
        "rank 0: barrier #1 cancelled after 12.5 ms while waiting for rank 1"
    ]


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        ((), ""),
        ((3,), " while waiting for rank 3"),
        ((1, 4), " while waiting for ranks 1 and 4"),
        ((5, 2, 1), " while waiting for ranks 1, 2 and 5"),
        ((1, 2, 3, 5), " while waiting for rank 1 and 3 others"),
    ],
)
async def test_the_ranks_waited_for_are_named_in_order(
    autojump_clock: trio.testing.MockClock, waiting: tuple[int, ...], expected: str
) -> None:
    """What the waits left behind, worded: receives and sends of this very call only (a
    leftover from another call names nobody), at most three ranks by name."""
    spec = OpSpec(Kind.ALLREDUCE, 7, dtype_code=10, count=1, op_code=1)
    links = {peer: Link(0, peer, None) for peer in range(1, 6)}  # type: ignore[arg-type]
    world = _algorithms.World(
        rank=0, size=6, links=links, chunk_bytes=64, scratch=np.zeros(0, np.uint8)
    )
    for index, peer in enumerate(waiting):
        if index % 2:
            links[peer].send_waiting = spec
        else:
            links[peer].receive_waiting = spec
    links[(set(links) - set(waiting)).pop()].receive_waiting = OpSpec(Kind.ALLREDUCE, 6)
    assert _algorithms.interrupted_wait(world, spec) == expected
    links[1].waits.begin(7)
    await trio.sleep(3)
    assert _algorithms.interrupted_wait(world, spec) == " after 3.0 s" + expected


# -- across processes ------------------------------------------------------------------------

_JOB = re.compile(r" \[job [^\]]+\]$")
_MODES = [
    pytest.param("tcp", id="tcp"),
    pytest.param(
        "unix-dir",
        id="unix-shm",
        marks=pytest.mark.skipif(
            not trioring.is_available("shm"), reason=f"no shm: {_shm.unavailable_reason()}"
        ),
    ),
]


def _step(report: dict[str, Any], name: str) -> dict[str, Any]:
    step: dict[str, Any] = report["steps"][name]
    return step


def _error(report: dict[str, Any], name: str) -> dict[str, Any]:
    error: dict[str, Any] | None = _step(report, name)["error"]
    assert error is not None, f"rank {report['index']}: {name} raised nothing"
    return error


def _finish(world: World) -> list[dict[str, Any]]:
    reports = world.finish()
    for report in reports:
        for step in ("open", "agreed"):
            assert _step(report, step)["error"] is None, report
    return reports


def _bare(message: str) -> str:
    return _JOB.sub("", message)


def _check_cancelled(report: dict[str, Any], waited_for: str, name: str = "allreduce") -> str:
    """The rank's deadline fired in ``name`` #2 (allreduce, broadcast or reduce) while it waited
    for ``waited_for`` (``"rank 2"``, ``"ranks 2 and 3"``): its one WARNING says so, and so
    do the note on what escaped the call and the next call's error. Returns the news its
    peers get."""
    rank = report["index"]
    warnings = [_bare(message) for level, message in report["log"] if level == "WARNING"]
    assert len(warnings) == 1, warnings
    match = re.fullmatch(
        rf"rank {rank}: {name} #2 cancelled after (\d+\.\d) s while waiting for {waited_for}",
        warnings[0],
    )
    assert match is not None, warnings
    assert 1.0 <= float(match[1]) < 5.0, warnings  # real time, on a loaded machine
    step = _step(report, name)
    assert step["error"]["type"] == "TooSlowError", step
    assert step["escaped_is_cancellation"], step
    assert [_bare(note) for note in step["escaped_notes"]] == warnings, step
    broken = _error(report, "barrier")
    assert broken["type"] == "CommunicatorBrokenError", broken
    assert broken["cause_is_cancellation"], broken
    assert _bare(broken["message"]) == (
        f"rank {rank}: barrier #3: the communicator is broken since {name} #2 was "
        f"cancelled after {match[1]} s while waiting for {waited_for}; open a new communicator"
    )
    return f"rank {rank} cancelled {name} #2 after {match[1]} s while waiting for {waited_for}"


def _check_told(report: dict[str, Any], canceller: int, news: str, name: str = "allreduce") -> None:
    """The rank's ``name`` #2 ended with ``canceller``'s abort frame, saying ``news``."""
    rank = report["index"]
    error = _error(report, name)
    assert error["type"] == "PeerAbortedError", error
    assert (error["peer"], error["reason"]) == (canceller, "cancelled"), error
    assert _bare(error["message"]) == f"rank {rank}: {name} #2: {news}", error
    assert not [message for level, message in report["log"] if level == "WARNING"], report["log"]


@pytest.mark.parametrize("mode", _MODES)
def test_across_processes_one_deadline(worlds: Worlds, mode: str) -> None:
    """Rank 2 stays out of allreduce #2; only rank 0 has a deadline. Rank 0 names rank 2
    (over TCP it waits for the array rank 2 folds in; on the shared segment for rank 2's
    publication), and rank 1, waiting without a deadline, is told exactly that."""
    world = worlds.start(SCRIPT, "deadline", world_size=3, mode=mode, args=["0", "2"])
    reports = _finish(world)
    if mode == "unix-dir":
        assert all("shm" in report["features"] for report in reports), reports
    news = _check_cancelled(reports[0], waited_for="rank 2")
    _check_told(reports[1], 0, news)
    assert _error(reports[2], "allreduce")["type"] in ("PeerAbortedError", "PeerFailedError")


@pytest.mark.parametrize("mode", _MODES)
def test_across_processes_every_deadline_fires(worlds: Worlds, mode: str) -> None:
    """Rank 2 stays out of allreduce #2; ranks 0 and 1 both have a 1 s deadline. Each rank
    whose own deadline fired names whom it waited for (rank 2 on the shared segment; over
    TCP rank 1 waits for its exchange with rank 0, which waits for rank 2); a rank whose
    peer's abort frame came first is told what that peer waited for."""
    world = worlds.start(SCRIPT, "deadline", world_size=3, mode=mode, args=["0,1", "2"])
    reports = _finish(world)
    waited_for = {0: "rank 2", 1: "rank 2" if mode == "unix-dir" else "rank 0"}
    fired = [
        rank
        for rank in (0, 1)
        if _step(reports[rank], "allreduce")["error"]["type"] == "TooSlowError"
    ]
    assert fired, [_step(reports[rank], "allreduce") for rank in (0, 1)]
    news = {rank: _check_cancelled(reports[rank], waited_for[rank]) for rank in fired}
    for rank in {0, 1} - set(fired):
        (canceller,) = fired
        _check_told(reports[rank], canceller, news[canceller])


@pytest.mark.skipif(not trioring.is_available("shm"), reason=f"no shm: {_shm.unavailable_reason()}")
def test_on_the_shared_segment_every_late_rank_is_named(worlds: Worlds) -> None:
    """Ranks 2 and 3 stay out; rank 0, the one with a deadline, was waiting on the segment
    for both of them, and says so; rank 1 is told."""
    world = worlds.start(SCRIPT, "deadline", world_size=4, mode="unix-dir", args=["0", "2,3"])
    reports = _finish(world)
    assert all("shm" in report["features"] for report in reports), reports
    news = _check_cancelled(reports[0], waited_for="ranks 2 and 3")
    _check_told(reports[1], 0, news)


@pytest.mark.skipif(not trioring.is_available("shm"), reason=f"no shm: {_shm.unavailable_reason()}")
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["broadcast", "reduce"])
def test_a_rank_that_waits_for_copies_names_the_rank_it_waited_for(
    worlds: Worlds, name: str, world_size: int
) -> None:
    """The last rank stays out of call #2: a broadcast whose root it is, or a reduce to
    rank 0. Rank 0, the one with a deadline, waits for copies that never come (the root's,
    or its peers'), so it takes its schedule point right after its publication
    (``shm_point``; unless it shares its CPUs with more ranks than it has, as at world 3
    on 2 cores), not as its wait's first look; either way it says it waited for that
    rank, and rank 1 is told (at world 2, when it comes)."""
    absent = world_size - 1
    world = worlds.start(
        SCRIPT, "deadline", world_size=world_size, mode="unix-dir", args=["0", str(absent), name]
    )
    reports = _finish(world)
    assert all("shm" in report["features"] for report in reports), reports
    news = _check_cancelled(reports[0], waited_for=f"rank {absent}", name=name)
    _check_told(reports[1], 0, news, name=name)
