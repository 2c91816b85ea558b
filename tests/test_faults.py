"""Fault injection across real processes on one host (issue 3; reliability notes §5-6).

Each rank is a process forked by the session's fork server (``forked_worlds`` in conftest)
running ``tests/workers/fault_worker.py``, which records every step's outcome and its
``time.monotonic()`` start and end (CLOCK_MONOTONIC, shared by all processes on the host).
The test injects the fault (SIGKILL, SIGSTOP, an exit, a cancel, a mismatched call, a broken
environment), synchronising only through marker files polled with a deadline and through the
collectives themselves, and then checks what every rank raised and how long it took to know.

Acceptance numbers (the issue's): a dead peer is reported by every survivor within
``DETECT_MAX_S`` and by the median survivor within ``DETECT_MEDIAN_S`` (G1); a hung peer makes
the survivors' own deadline fire within [T - 0.1 s, T + 1 s] and never earlier (G2); a
cancelled or mismatched collective is reported by every rank within 1 s (rows 4 and 6).
The terminal summary lists the measured latencies per row.

Which survivors can name the failed rank: those that exchange frames with it directly in the
collective ("adjacent": ring neighbours for a large allreduce, recursive-doubling partners for
one of at most ``SMALL_ALLREDUCE_BYTES``, tree parent and children for broadcast, dissemination
partners for barrier) must; the others hear of it through relayed abort notices and may name a
relaying rank instead, which is recorded, not asserted.

Where the library's contract lets a rank finish a collective that another rank abandoned (a
broadcast leaf that has all the data; a small allreduce whose exchanges were all done before
the fault: docs/explanation/failure-model.md), the test accepts that, and requires the rank's
next call to raise instead.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import time
from typing import TYPE_CHECKING, Any

import pytest

import trioring
from trioring._algorithms import tree_neighbours
from trioring._collectives._decision import SMALL_ALLREDUCE_BYTES

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import ForkedWorlds, World

SCRIPT = "fault_worker.py"
#: G1: every survivor reports a dead peer within this...
DETECT_MAX_S = 2.0
#: ...and the median survivor within this.
DETECT_MEDIAN_S = 0.2
#: Rows 4 and 6: every rank reports a cancelled or mismatched collective within this.
REPORT_S = 1.0
#: Rows 3 and 7: the callers' own deadline, and the window it must fire in (G2).
DEADLINE_S = 1.5
EARLY_S = 0.1
LATE_S = 1.0
#: 64 MiB of float32: a collective that takes long enough to be killed in the middle of.
LARGE = 16 * 1024 * 1024
#: Bytes of the workers' small allreduces (fault_worker.SMALL float32s).
SMALL_BYTES = 1000 * 4
#: The cancellation row's arrays: small (every frame is sent whole at once, so every link
#: can carry the abort notice) and 16 MB (frames are cut off mid-payload).
CANCEL_SIZES = {"small": 1000, "large": 4_000_000}
CANCEL_AFTER_S = 0.2
#: Row 6: correct collectives before the mismatched one, and the worker's hang guard there.
GOOD_COLLECTIVES = 500
MISMATCH_HANG_S = 3.0
#: Row 11: open/close cycles (set TRIORING_TEST_CYCLES to change), every CYCLE_FAULT_EVERY-th
#: one faulty; RSS may grow by at most CYCLE_RSS_GROWTH_KIB over all of them.
CYCLES = int(os.environ.get("TRIORING_TEST_CYCLES", "1000"))
CYCLE_FAULT_EVERY = 100
CYCLE_RSS_GROWTH_KIB = 40 * 1024
#: ... and by at most this much over the second half of them. Measured (2 ranks, unix, 1200
#: cycles without faults): RSS grows by about 16 MiB over the first 300 cycles (the
#: allocator's arenas and trio's deadline heap settle; each world now also has its
#: point-to-point connections and their read buffers) and by 3 MiB over the other 900.
#: Over the second half of the 1000 cycles here it grew by -11 to +5 MiB in 12 runs, and by
#: 6.2 MiB once in CI, on the same code: the allocator's noise reaches the 6 MiB this used to
#: allow, so RSS only bounds large leaks and CYCLE_OBJECTS_LATE_GROWTH catches small ones.
CYCLE_RSS_LATE_GROWTH_KIB = 8 * 1024
#: How many more Python objects may be alive (after a full collection) at the end than half
#: way: a leak of anything Python-level leaves one or more per cycle, 500 or more in all.
#: Measured: -69 to +4 in 6 runs.
CYCLE_OBJECTS_LATE_GROWTH = 250
#: Row 12: (world size, transport, collectives); 10,000 in all.
SOAK = [(2, "unix-dir", 3000), (3, "tcp", 3000), (4, "unix-dir", 4000)]
SOAK_SEED = 20240603
#: Polling interval while waiting to inject a fault (the test's own, not the workers').
POLL_S = 0.001


def positions(world_size: int) -> list[int]:
    """The failing ranks to try: first, middle, last."""
    return sorted({0, world_size // 2, world_size - 1})


#: (world size, failing rank) for every row: worlds 2 and 4, failing rank first, middle, last.
WORLD_CASES = [(n, rank) for n in (2, 4) for rank in positions(n)]


def _case_id(world_size: int, rank: int) -> str:
    return f"w{world_size}-r{rank}"


WORLD_IDS = [_case_id(n, rank) for n, rank in WORLD_CASES]


# -- reading reports ----------------------------------------------------------------------------


def step(report: dict[str, Any], name: str) -> dict[str, Any]:
    steps: dict[str, Any] = report["steps"]
    assert name in steps, f"worker {report['index']} has no step {name!r}: {steps}"
    recorded: dict[str, Any] = steps[name]
    return recorded


def error_of(report: dict[str, Any], name: str) -> dict[str, Any]:
    error: dict[str, Any] | None = step(report, name)["error"]
    assert error is not None, f"worker {report['index']}: {name} raised nothing"
    return error


def assert_ok(report: dict[str, Any], *names: str) -> None:
    for name in names:
        error = step(report, name)["error"]
        assert error is None, f"worker {report['index']}: {name} raised {error}"


def assert_broken_after(
    report: dict[str, Any], steps: tuple[str, ...] = ("after", "after2")
) -> None:
    """The communicator broke and stays broken: the next calls raise CommunicatorBrokenError."""
    if steps[0] == "after":
        assert report.get("broken") is True, f"worker {report['index']}: not broken"
    for name in steps:
        error = error_of(report, name)
        assert error["type"] == "CommunicatorBrokenError", (name, error)


def wait_for_files(world: World, files: list[Path], timeout: float = 30.0) -> None:
    """Poll (every POLL_S) until every file exists; fail at once if a worker exits first."""
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in files):
        for worker in world.workers:
            if worker.popen.poll() is not None:
                report = worker.file("json").read_text() if worker.has("json") else "(none)"
                pytest.fail(
                    f"worker {worker.index} exited early ({worker.popen.returncode}); report: "
                    f"{report}\nlog:\n{worker.log_text()}"
                )
        if time.monotonic() > deadline:
            missing = [path.name for path in files if not path.exists()]
            pytest.fail(f"timed out waiting for {missing}")
        time.sleep(POLL_S)


def record(
    latencies: dict[str, list[tuple[float, bool | None]]],
    row: str,
    values: dict[int, float],
    named: dict[int, bool] | None = None,
) -> None:
    rows = latencies.setdefault(row, [])
    rows.extend((value, None if named is None else named[rank]) for rank, value in values.items())
    shown = {rank: round(value * 1000, 1) for rank, value in values.items()}
    print(f"{row}: latency ms by rank {shown}" + (f", names the culprit {named}" if named else ""))


def ring_neighbours(rank: int, world_size: int) -> set[int]:
    return {(rank - 1) % world_size, (rank + 1) % world_size} - {rank}


def barrier_partners(rank: int, world_size: int) -> set[int]:
    partners, distance = set(), 1
    while distance < world_size:
        partners |= {(rank + distance) % world_size, (rank - distance) % world_size}
        distance *= 2
    return partners - {rank}


def _doubling_partners(rank: int, world_size: int) -> set[int]:
    """Whom ``rank`` exchanges with in ``_algorithms.recursive_doubling_allreduce``."""
    p = 1 << (world_size.bit_length() - 1)
    if rank >= p:
        return {rank - p}
    partners, distance = set(), 1
    while distance < p:
        partners.add(rank ^ distance)
        distance *= 2
    if rank < world_size - p:
        partners.add(rank + p)
    return partners


def allreduce_adjacent(rank: int, world_size: int, nbytes: int) -> set[int]:
    """The ranks that exchange frames with ``rank`` in an allreduce of ``nbytes`` bytes."""
    if nbytes > SMALL_ALLREDUCE_BYTES:
        return ring_neighbours(rank, world_size)
    return {
        other
        for other in range(world_size)
        if other != rank
        and (
            other in _doubling_partners(rank, world_size)
            or rank in _doubling_partners(other, world_size)
        )
    }


def tree_adjacent(rank: int, world_size: int, root: int) -> set[int]:
    parent, children = tree_neighbours(rank, world_size, root)
    return set(children) | ({parent} if parent is not None else set())


def check_dead_peer_reported(
    reports: dict[int, dict[str, Any]],
    dead: int,
    t_fault: float,
    adjacent: set[int],
    latencies: dict[str, list[tuple[float, bool | None]]],
    row: str,
    *,
    may_complete: bool = False,
) -> None:
    """Rows 1 and 2: every survivor's collective raised PeerFailedError (or a relayed
    PeerAbortedError), promptly; the adjacent ones name the dead rank.

    With ``may_complete`` (broadcast, and a barrier through the shared segment), a survivor that is not adjacent may instead return
    normally, if its share completed before the failure (it holds all the data: a leaf whose
    parent forwarded everything); its next call must then raise, and counts instead. (In an
    allreduce every result needs the dead rank's data, so nobody may return.)"""
    took: dict[int, float] = {}
    named: dict[int, bool] = {}
    errors: dict[int, dict[str, Any]] = {}
    for rank, report in reports.items():
        assert_ok(report, "open", "agreed")
        where = "collective"
        if step(report, "collective")["error"] is None:
            completed = f"rank {rank}: the collective returned normally though rank {dead} died"
            assert may_complete, completed
            assert rank not in adjacent, completed
            assert report["broken"] is False, report
            where = "after"
        failed = step(report, where)
        error = errors[rank] = error_of(report, where)
        assert error["type"] in ("PeerFailedError", "PeerAbortedError"), (rank, error)
        assert error["rank"] == rank, error
        assert error["peer"] is not None, error
        assert error["peer"] != rank, error
        assert f"rank {error['peer']}" in error["message"], error
        took[rank] = failed["t1"] - t_fault
        assert took[rank] > 0, f"rank {rank} raised before the fault: {error}"
        named[rank] = error["peer"] == dead
        assert_broken_after(report, ("after", "after2") if where == "collective" else ("after2",))
    record(latencies, row, took, named)
    for rank in sorted(adjacent):
        # Known imprecision (issue 3 note): a survivor may report the echo of the failure, a
        # neighbour that broke in reaction and relayed the news, instead of the dead rank.
        # It must then at least name a rank that really broke; the table records precision.
        blamed = errors[rank]["peer"]
        assert named[rank] or blamed in errors, (
            f"rank {rank} exchanges frames with rank {dead} but blamed rank "
            f"{blamed}, which did not fail: {errors[rank]['message']}"
        )
    assert max(took.values()) <= DETECT_MAX_S, took
    assert statistics.median(took.values()) <= DETECT_MEDIAN_S, took


# -- row 1: a peer SIGKILLed mid-collective or between collectives ---------------------------------


def _gate(phase: str, world_size: int, victim: int) -> int:
    """The rank that enters the collective only after the victim died (-1: none).

    Barrier: the victim's left neighbour, so the victim is stuck in the first round, having
    sent one token (the other survivors need tokens it never sent). Broadcast (64 MiB goes
    through a tree in ~20 ms, too fast to kill into reliably): a child of the victim, or its
    parent when it is a leaf, so the victim cannot finish its part before it dies."""
    if phase == "barrier":
        return (victim - 1) % world_size
    if phase == "broadcast":
        parent, children = tree_neighbours(victim, world_size, 0)
        gated = children[0] if children else parent
        assert gated is not None
        return gated
    return -1


KILL_CASES = [
    pytest.param(phase, n, victim, id=f"{phase}-{_case_id(n, victim)}")
    for phase in ("allreduce", "broadcast", "barrier", "between")
    for n, victim in WORLD_CASES
] + [
    pytest.param("allreduce", 8, victim, id=f"allreduce-{_case_id(8, victim)}")
    for victim in (0, 4, 7)
]


@pytest.mark.parametrize(("phase", "world_size", "victim"), KILL_CASES)
def test_sigkill(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    phase: str,
    world_size: int,
    victim: int,
) -> None:
    """SIGKILL one rank while the others are inside a collective with it: ``allreduce`` or
    ``broadcast`` (root 0) of 64 MiB, a ``barrier``, or ``between`` (the victim is idle
    between collectives while the others wait for it in an allreduce). The kill comes as soon
    as every rank (but the gated one, see ``_gate``) has announced it is entering.

    In a broadcast, a rank outside the victim's part of the tree may legitimately finish (it
    got all the data and its subtree acknowledged) before the victim dies; then its next call
    must raise. In the other collectives no survivor can finish without the victim."""
    mode = "tcp" if (phase, world_size) in (("allreduce", 2), ("between", 4)) else "unix-dir"
    gated = _gate(phase, world_size, victim)
    world = forked_worlds.start(
        SCRIPT,
        "kill",
        world_size=world_size,
        mode=mode,
        args=[str(victim), phase, str(gated), str(LARGE)],
    )
    markers = [
        world.workers[r].file("idle" if (phase == "between" and r == victim) else "entering")
        for r in range(world_size)
        if r != gated
    ]
    wait_for_files(world, markers)
    killed = world.workers[victim]
    t_kill = killed.popen.send_signal(signal.SIGKILL)
    assert t_kill is not None, f"rank {victim} had exited before the kill:\n{killed.log_text()}"
    # Reaped: its sockets are closed. Only then may the gated rank go in (a SIGKILL takes a
    # moment to land, and a rank entering before that could legitimately complete with it).
    assert killed.wait() == -signal.SIGKILL
    if gated >= 0:
        (world.out_dir / "gate").touch()
    survivors = [r for r in range(world_size) if r != victim]
    reports = dict(zip(survivors, world.finish(survivors), strict=True))
    # Through the shared segment (see docs/explanation/failure-model.md), a barrier whose
    # ranks had all published before the kill completes everywhere, the victim's entry
    # included; then the next call raises. Nobody exchanges frames with the victim there.
    shm_barrier = phase == "barrier" and mode != "tcp" and trioring.is_available("shm")
    if phase == "broadcast":
        adjacent = tree_adjacent(victim, world_size, 0)
    elif shm_barrier:
        adjacent = set()
    elif phase == "barrier":
        adjacent = barrier_partners(victim, world_size)
    else:
        nbytes = LARGE * 4 if phase == "allreduce" else SMALL_BYTES
        adjacent = allreduce_adjacent(victim, world_size, nbytes)
    check_dead_peer_reported(
        reports,
        victim,
        t_kill,
        adjacent,
        fault_latencies,
        f"1 sigkill {phase} w{world_size}",
        may_complete=phase == "broadcast" or shm_barrier,
    )


# -- row 2: a peer exits, aborts or raises before the collective the others are in ---------------

EXIT_CODES = {"exit0": 0, "exit3": 3, "abort": -signal.SIGABRT, "raise": 1}
#: What the survivors hear made the victim leave (os.abort() leaves no time to say anything).
LEFT_ON = {
    "exit0": "SystemExit: 0",
    "exit3": "SystemExit: 3",
    "raise": "RuntimeError: injected failure before the collective",
}


@pytest.mark.parametrize(("world_size", "victim"), WORLD_CASES, ids=WORLD_IDS)
@pytest.mark.parametrize("how", list(EXIT_CODES))
def test_peer_exits_before_the_collective(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    how: str,
    world_size: int,
    victim: int,
) -> None:
    """The others are inside an allreduce; the victim, instead of joining, calls
    ``sys.exit(0)``, ``sys.exit(3)`` or ``os.abort()``, or raises out of its
    ``async with open_communicator``. Latency counts from just before it did so."""
    world = forked_worlds.start(
        SCRIPT,
        "exit",
        world_size=world_size,
        mode="tcp" if world_size == 2 else "unix-dir",
        args=[str(victim), how],
    )
    failed = world.workers[victim]
    assert failed.wait() == EXIT_CODES[how], failed.log_text()
    if how == "raise":
        assert "RuntimeError: injected failure" in failed.log_text()
    t_fail = float(failed.file("failing").read_text())
    survivors = [r for r in range(world_size) if r != victim]
    reports = dict(zip(survivors, world.finish(survivors), strict=True))
    check_dead_peer_reported(
        reports,
        victim,
        t_fail,
        allreduce_adjacent(victim, world_size, SMALL_BYTES),
        fault_latencies,
        f"2 {how} w{world_size}",
    )
    if how in LEFT_ON:
        # An exception that leaves the victim's ``async with`` is told to the peers before
        # it closes (directly or relayed): each says what made it leave.
        for rank, report in reports.items():
            error = error_of(report, "collective")
            assert error["type"] == "PeerAbortedError", (rank, error)
            assert f"it left its communicator on {LEFT_ON[how]}" in error["message"], error


# -- row 3: a peer stopped with SIGSTOP -----------------------------------------------------------


@pytest.mark.parametrize(("world_size", "victim"), WORLD_CASES, ids=WORLD_IDS)
def test_sigstopped_peer_hits_the_callers_deadline(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    world_size: int,
    victim: int,
) -> None:
    """The victim is SIGSTOPped (alive, silent); the others run an allreduce under their own
    ``trio.fail_after(DEADLINE_S)``. Nothing may fire early (a stopped peer is not a dead
    one); each survivor's deadline fires within [T - 0.1 s, T + 1 s], or, a few ms earlier
    than its own, another survivor's cancel reaches it as that survivor's abort notice. After
    that their communicators are broken."""
    world = forked_worlds.start(
        SCRIPT,
        "stop",
        world_size=world_size,
        mode="tcp" if world_size == 2 else "unix-dir",
        args=[str(victim), str(DEADLINE_S)],
    )
    world.wait_for("ready")
    stopped = world.workers[victim]
    assert stopped.popen.send_signal(signal.SIGSTOP) is not None
    (world.out_dir / "go").touch()
    survivors = [r for r in range(world_size) if r != victim]
    reports = dict(zip(survivors, world.finish(survivors), strict=True))
    took: dict[int, float] = {}
    own_deadline = []
    for rank, report in reports.items():
        assert_ok(report, "open", "agreed")
        collective = step(report, "collective")
        error = error_of(report, "collective")
        took[rank] = collective["t1"] - collective["t0"]
        if error["type"] == "TooSlowError":
            own_deadline.append(rank)
        else:
            # Another survivor's deadline fired first and it said so; never the stopped rank.
            assert error["type"] in ("PeerAbortedError", "PeerFailedError"), (rank, error)
            assert error["peer"] in set(survivors) - {rank}, (rank, error)
            if error["type"] == "PeerAbortedError":
                assert error["reason"] == "cancelled", error
        assert_broken_after(report)
    record(fault_latencies, f"3 sigstop deadline w{world_size}", took)
    assert own_deadline, f"no survivor's own deadline fired: {reports}"
    for rank, elapsed in took.items():
        assert DEADLINE_S - EARLY_S <= elapsed <= DEADLINE_S + LATE_S, (rank, elapsed)
    assert stopped.popen.poll() is None, "the stopped rank should still exist (teardown kills it)"


# -- row 4: one rank cancels its collective -------------------------------------------------------


@pytest.mark.parametrize(("world_size", "canceller"), WORLD_CASES, ids=WORLD_IDS)
@pytest.mark.parametrize("size", list(CANCEL_SIZES))
def test_cancelled_collective_aborts_every_peer(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    size: str,
    world_size: int,
    canceller: int,
) -> None:
    check_cancel(forked_worlds, fault_latencies, size, world_size, canceller, late=False)


@pytest.mark.parametrize("canceller", positions(4), ids=[f"w4-r{r}" for r in positions(4)])
@pytest.mark.parametrize("size", list(CANCEL_SIZES))
def test_cancel_reaches_ranks_waiting_for_a_late_peer(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    size: str,
    canceller: int,
) -> None:
    """As above, but the gated rank enters only after every other rank has reported: ranks
    that were waiting for the gated one must learn of the cancel from the canceller's abort
    frame alone (or from a rank that relayed it), within 1 s."""
    check_cancel(forked_worlds, fault_latencies, size, 4, canceller, late=True)


def check_cancel(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    size: str,
    world_size: int,
    canceller: int,
    *,
    late: bool,
) -> None:
    """The canceller leaves an allreduce by ``trio.move_on_after(0.2)``. One other rank (not
    adjacent to it in the ring where there is one) joins only after that, so the canceller
    cannot have finished; the rest were inside already. Every other rank raises
    PeerAbortedError (reason "cancelled") naming the canceller, or, where the abort notice
    could not be sent or read, PeerFailedError naming it, within 1 s of the cancel (of its own
    entry, for the late rank).

    With a small array (recursive doubling) the canceller has contributed its data in the
    first exchange before it gave up, so a rank whose exchanges were all done may return a
    complete result (as documented); its next call must then raise, naming the canceller."""
    gated = 1 - canceller if world_size == 2 else (canceller + 2) % world_size
    world = forked_worlds.start(
        SCRIPT,
        "cancel",
        world_size=world_size,
        mode="tcp" if world_size == 2 else "unix-dir",
        args=[
            str(canceller),
            str(gated),
            str(CANCEL_SIZES[size]),
            str(CANCEL_AFTER_S),
            *(["late"] if late else []),
        ],
    )
    reports = dict(enumerate(world.finish()))
    for report in reports.values():
        assert_ok(report, "open", "agreed")

    cancelled = step(reports[canceller], "collective")
    assert cancelled["cancelled_caught"], cancelled
    assert cancelled["escaped_is_cancellation"], cancelled
    deadline = cancelled["deadline"]
    assert cancelled["t1"] - deadline <= REPORT_S, cancelled
    assert_broken_after(reports[canceller])
    assert error_of(reports[canceller], "after")["cause_is_cancellation"]

    took: dict[int, float] = {}
    named: dict[int, bool] = {}
    errors = {}
    for rank, report in reports.items():
        if rank == canceller:
            continue
        where = "collective"
        if step(report, "collective")["error"] is None:
            assert CANCEL_SIZES[size] * 4 <= SMALL_ALLREDUCE_BYTES, (
                f"rank {rank} completed an allreduce that rank {canceller} abandoned"
            )
            assert report["broken"] is False, report
            where = "after"
        failed = step(report, where)
        error = errors[rank] = error_of(report, where)
        assert error["rank"] == rank, error
        took[rank] = failed["t1"] - max(deadline, failed["t0"])
        named[rank] = error["peer"] == canceller
        assert_broken_after(report, ("after", "after2") if where == "collective" else ("after2",))
    record(fault_latencies, f"4 cancel {size}{' late' if late else ''} w{world_size}", took, named)
    for rank, error in errors.items():
        if error["type"] == "PeerAbortedError":
            assert error["reason"] == "cancelled", error
        else:
            assert error["type"] == "PeerFailedError", (rank, error)
        assert error["peer"] == canceller, (
            f"rank {rank} blamed rank {error['peer']} for rank {canceller}'s cancel: "
            f"{error['type']}: {error['message']}"
        )
        assert took[rank] <= REPORT_S, (rank, took[rank])


# -- row 6: mismatched collectives after 500 good ones --------------------------------------------


def mismatch_sides(case: str, odd: int) -> tuple[str, str]:
    """How the odd rank's call and the others' call describe themselves (both must appear in a
    mismatch report). Must agree with ``fault_worker.mismatched_call``."""
    seq = f"#{GOOD_COLLECTIVES + 1}"
    f32 = f"float32[1000] {seq}"
    if case == "op":
        return f"allreduce(max) {f32}", f"allreduce(sum) {f32}"
    if case == "dtype":
        return f"allreduce(sum) float64[1000] {seq}", f"allreduce(sum) {f32}"
    if case == "count":
        return f"allreduce(sum) float32[1001] {seq}", f"allreduce(sum) {f32}"
    if case == "kind":
        return f"broadcast(root=0) {f32}", f"allreduce(sum) {f32}"
    if case == "root":
        # fault_worker.mismatch_roots: the odd rank names itself (rank 0 names 1), the others 0.
        return f"broadcast(root={odd if odd != 0 else 1}) {f32}", f"broadcast(root=0) {f32}"
    assert case == "skip"  # the odd rank skips a barrier and calls the allreduce after it
    return f"allreduce(sum) {f32}", f"barrier {seq}"


MISMATCH_CASES = ["op", "dtype", "count", "kind", "root", "skip"]


def mismatch_adjacent(case: str, odd: int, world_size: int) -> set[int]:
    """The ranks that exchange frames with the odd one in the call the others make."""
    if case == "root":
        return tree_adjacent(odd, world_size, 0)
    if case == "skip":
        return barrier_partners(odd, world_size)
    return allreduce_adjacent(odd, world_size, SMALL_BYTES)


@pytest.mark.parametrize(("world_size", "odd"), WORLD_CASES, ids=WORLD_IDS)
@pytest.mark.parametrize("case", MISMATCH_CASES)
def test_mismatch_after_good_collectives(
    forked_worlds: ForkedWorlds,
    fault_latencies: dict[str, list[tuple[float, bool | None]]],
    case: str,
    world_size: int,
    odd: int,
) -> None:
    """500 correct collectives, then rank ``odd`` calls a different one: another reduce op,
    dtype, element count, kind (broadcast instead of allreduce) or root, or it skips a
    barrier. Every rank raises a TrioringError within 1 s of entering the mismatched call (in
    it, or, if its share completed without meeting the odd rank, in its next call); the odd
    rank and those that exchange frames with it in the others' call raise
    CollectiveMismatchError naming both sides."""
    world = forked_worlds.start(
        SCRIPT,
        "mismatch",
        world_size=world_size,
        mode="tcp" if world_size == 2 else "unix-dir",
        args=[str(odd), case, str(GOOD_COLLECTIVES)],
        env_overrides={r: {"FAULT_HANG_S": str(MISMATCH_HANG_S)} for r in range(world_size)},
    )
    reports = dict(enumerate(world.finish()))
    took: dict[int, float] = {}
    errors = {}
    for rank, report in reports.items():
        assert_ok(report, "open", "good")
        mismatch = step(report, "mismatch")
        errors[rank] = error_of(report, "mismatch")
        took[rank] = mismatch["t1"] - mismatch["t0"]
    record(fault_latencies, f"6 mismatch {case} w{world_size}", took)
    for rank, error in errors.items():
        assert error["trioring"], f"rank {rank} hung or failed otherwise: {error}"
        assert error["rank"] == rank, error
        assert_broken_after(reports[rank])
    odd_side, other_side = mismatch_sides(case, odd)
    for rank in sorted(mismatch_adjacent(case, odd, world_size) | {odd}):
        error = errors[rank]
        assert error["type"] == "CollectiveMismatchError", (rank, error)
        assert odd_side in error["message"], (rank, error["message"])
        assert other_side in error["message"], (rank, error["message"])
    for rank, elapsed in took.items():
        assert elapsed <= REPORT_S, (rank, elapsed, errors[rank]["type"])


# -- row 7: bad environments ----------------------------------------------------------------------


def test_rendezvous_port_taken_by_another_program(forked_worlds: ForkedWorlds) -> None:
    """Another program listens on MASTER_PORT: rank 0 fails at once with RendezvousError
    naming the address. (Rank 1 reaches that program instead, which never answers the
    handshake; it waits, as documented, until its own deadline.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen(8)
        port = foreign.getsockname()[1]
        out_dir = forked_worlds.out_dir()
        workers = []
        for rank in (0, 1):
            env = forked_worlds.world_env("tcp", 2, rank, port=port, socket_dir=None)
            env["WORKER_OPEN_TIMEOUT_S"] = str(DEADLINE_S)
            workers.append(forked_worlds.spawn(SCRIPT, ["open", str(out_dir), str(rank)], env))
        for worker in workers:
            assert worker.wait() == 0, worker.log_text()
        report0, report1 = (worker.report() for worker in workers)
    opened = step(report0, "open")
    error = error_of(report0, "open")
    assert error["type"] == "RendezvousError", error
    assert error["address_in_use"], error
    assert f"127.0.0.1:{port}" in error["message"], error
    assert opened["t1"] - opened["t0"] <= REPORT_S, opened
    late = error_of(report1, "open")
    assert late["type"] == "TooSlowError", late


@pytest.mark.parametrize(
    ("world_size", "missing", "mode"),
    [(2, 1, "unix-dir"), (4, 2, "unix-dir"), (4, 0, "tcp")],
    ids=["w2-missing-1", "w4-missing-2", "w4-missing-0"],
)
def test_missing_rank_is_named_when_the_deadline_fires(
    forked_worlds: ForkedWorlds, world_size: int, missing: int, mode: str
) -> None:
    """Only N-1 ranks start, each with its own ``trio.fail_after`` around
    ``open_communicator``. Rank 0's is T: it fires within [T - 0.1 s, T + 1 s] and rank 0
    logs which ranks never joined. The others' deadlines are a second later, so that rank 0
    deterministically gives up first: they must then raise RendezvousError at once (not
    wait for their own deadline). Without rank 0, every rank's own deadline T fires and each
    logs that rank 0 never answered."""
    present = [r for r in range(world_size) if r != missing]
    limits = {r: DEADLINE_S if (r == 0 or missing == 0) else DEADLINE_S + LATE_S for r in present}
    world = forked_worlds.start(
        SCRIPT,
        "open",
        world_size=world_size,
        mode=mode,
        ranks=present,
        env_overrides={i: {"WORKER_OPEN_TIMEOUT_S": str(limits[r])} for i, r in enumerate(present)},
    )
    reports = dict(zip(present, world.finish(), strict=True))
    logs = {r: world.workers[i].log_text() for i, r in enumerate(present)}
    rank0_gave_up = None
    if missing != 0:
        opened = step(reports[0], "open")
        error = error_of(reports[0], "open")
        assert error["type"] == "TooSlowError", error
        assert DEADLINE_S - EARLY_S <= opened["t1"] - opened["t0"] <= DEADLINE_S + LATE_S, opened
        assert f"ranks {missing} never joined" in logs[0], logs[0]
        rank0_gave_up = opened["t0"] + DEADLINE_S  # (its t1 comes after it closed everything)
    for rank in present:
        if rank == 0:
            continue
        opened = step(reports[rank], "open")
        error = error_of(reports[rank], "open")
        if rank0_gave_up is None:
            assert error["type"] == "TooSlowError", (rank, error)
            elapsed = opened["t1"] - opened["t0"]
            assert DEADLINE_S - EARLY_S <= elapsed <= DEADLINE_S + LATE_S, (rank, elapsed)
            assert "rank 0 never answered" in logs[rank], (rank, logs[rank])
        else:
            assert error["type"] == "RendezvousError", (rank, error)
            assert f"rank {rank}: rendezvous with rank 0 failed" in error["message"], error
            assert -EARLY_S <= opened["t1"] - rank0_gave_up <= REPORT_S, (rank, opened)


def test_rank_not_below_world_size_in_a_world(forked_worlds: ForkedWorlds) -> None:
    """WORLD_SIZE=2 with ranks 0 and 2: the process with RANK=2 fails at once with
    ConfigurationError naming RANK, without waiting; rank 0 waits for rank 1 until its
    deadline and then names it. (The single-process cases of bad variables are in
    test_multiprocess_errors.py.)"""
    world = forked_worlds.start(
        SCRIPT,
        "open",
        world_size=2,
        mode="unix-dir",
        ranks=[2, 0],
        env_overrides={i: {"WORKER_OPEN_TIMEOUT_S": str(DEADLINE_S)} for i in range(2)},
    )
    bad, good = world.finish()
    opened = step(bad, "open")
    error = error_of(bad, "open")
    assert error["type"] == "ConfigurationError", error
    assert "RANK" in error["message"], error
    assert opened["t1"] - opened["t0"] < DEADLINE_S - EARLY_S, opened
    waited = step(good, "open")
    assert error_of(good, "open")["type"] == "TooSlowError"
    assert DEADLINE_S - EARLY_S <= waited["t1"] - waited["t0"] <= DEADLINE_S + LATE_S, waited
    assert "ranks 1 never joined" in world.workers[1].log_text()


# -- row 11: open/close cycles, faults included ---------------------------------------------------


def test_open_close_cycles_leak_nothing(forked_worlds: ForkedWorlds) -> None:
    """Two processes open a world-2 communicator on the same socket directory, allreduce,
    and close it, CYCLES times. Every 100th cycle is faulty: one rank cancels a barrier (its
    peer then raises), or closes at once (its peer's barrier raises); both then open a new
    communicator on the same address. Afterwards: no failed cycle, the same number of file
    descriptors and trio tasks as before the first, RSS grown by less than 20 MiB, and no
    socket file left in the directory."""
    world = forked_worlds.start(
        SCRIPT,
        "cycles",
        world_size=2,
        mode="unix-dir",
        args=[str(CYCLES), str(CYCLE_FAULT_EVERY)],
    )
    reports = world.finish(timeout=240)
    faults = CYCLES // CYCLE_FAULT_EVERY
    cancels, closes = (faults + 1) // 2, faults // 2
    for rank, report in enumerate(reports):
        assert report["failures"] == [], report["failures"]
        assert report["cycles"] == CYCLES
        outcomes = dict(report["outcomes"])
        assert outcomes.pop("ok") == CYCLES - faults, report["outcomes"]
        acted = outcomes.pop("canceller:broken", 0) + outcomes.pop("closer:closed", 0)
        suffered = outcomes.pop("peer:PeerAbortedError", 0) + outcomes.pop(
            "peer:PeerFailedError", 0
        )
        assert outcomes == {}, f"rank {rank}: unexpected outcomes {report['outcomes']}"
        assert acted + suffered == faults, report["outcomes"]
        assert report["fds_end"] == report["fds_start"], report
        assert report["tasks_end"] == report["tasks_start"], report
        assert report["rss_end"] - report["rss_start"] < CYCLE_RSS_GROWTH_KIB, report
        # A leak grows without end; the allocator's caches fill up once. So the second half
        # of the cycles may add only a little (a leak of 16 KiB per cycle would add 8 MiB;
        # the object count catches smaller ones).
        assert report["rss_end"] - report["rss_half"] < CYCLE_RSS_LATE_GROWTH_KIB, report
        assert report["objects_end"] - report["objects_half"] < CYCLE_OBJECTS_LATE_GROWTH, report
        print(
            f"rank {rank}: {CYCLES} cycles in {report['elapsed']:.1f} s "
            f"({CYCLES / report['elapsed']:.0f}/s), fds {report['fds_start']}->"
            f"{report['fds_end']}, tasks {report['tasks_start']}->{report['tasks_end']}, "
            f"RSS {report['rss_start']}->{report['rss_warm']} (after 10)->{report['rss_half']} "
            f"(half way)->{report['rss_end']} KiB, objects {report['objects_half']}->"
            f"{report['objects_end']}, "
            f"{report['outcomes']}"
        )
    assert sum(r["outcomes"].get("canceller:broken", 0) for r in reports) == cancels
    assert sum(r["outcomes"].get("closer:closed", 0) for r in reports) == closes
    socket_dir = reports[0]["socket_dir"]
    assert socket_dir is not None
    assert os.path.isdir(socket_dir)
    assert sorted(os.listdir(socket_dir)) == [], "socket files left behind"


# -- row 12: soak ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "mode", "count"), SOAK, ids=[f"w{n}-{m}-{c}" for n, m, c in SOAK]
)
def test_soak_mixed_collectives_are_exact(
    forked_worlds: ForkedWorlds, world_size: int, mode: str, count: int
) -> None:
    """``count`` mixed collectives (allreduce sum/mean/min/max/prod, broadcast from varying
    roots, barrier; 0..1 MiB, mostly small; int8/uint8/int32/int64/float16/float32/float64/
    complex64), drawn from one seed on every rank, with integer-valued inputs so that every
    result is exact. Each rank checks each result against a reference it computes itself;
    every rank must end with zero failures and the same digest of all its results."""
    world = forked_worlds.start(
        SCRIPT, "soak", world_size=world_size, mode=mode, args=[str(SOAK_SEED), str(count)]
    )
    reports = world.finish(timeout=240)
    for rank, report in enumerate(reports):
        assert_ok(report, "open", "soak")
        assert report["completed"] == count, report
        assert report["failure_count"] == 0, (rank, report["failures"])
        assert report["checked_digest"] == report["reference_digest"], rank
    assert len({report["digest"] for report in reports}) == 1, "ranks hold different results"
    # The plan (the same on every rank) really mixes what it claims to.
    mixed = reports[0]
    assert set(mixed["kinds"]) == {"allreduce", "broadcast", "barrier"}, mixed["kinds"]
    assert set(mixed["ops"]) == {"sum", "mean", "min", "max", "prod"}, mixed["ops"]
    assert {"int32", "float32", "float64"} <= set(mixed["dtypes"]), mixed["dtypes"]
    assert set(mixed["roots"]) == set(range(world_size)), mixed["roots"]
    assert mixed["min_nbytes"] == 0
    assert mixed["max_nbytes"] > 512 * 1024
    elapsed = max(report["elapsed"] for report in reports)
    print(
        f"soak w{world_size} {mode}: {count} collectives in {elapsed:.1f} s, {reports[0]['kinds']}"
    )
