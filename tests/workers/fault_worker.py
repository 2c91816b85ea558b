"""Worker for ``test_faults.py`` and ``bench/fault_latency.py``: one rank of a world into
which the test injects a fault. Run as ``fault_worker.py SCENARIO OUT_DIR INDEX [ARGS...]``
(see ``_worker_util`` for the marker files and the JSON report).

Every timed step records ``t0`` and ``t1``, ``time.monotonic()`` (CLOCK_MONOTONIC, one clock
for every process on the host) when it started and when it returned or raised, so the test
can measure latencies against the moment it injected the fault. A step that neither returns
nor raises within ``FAULT_HANG_S`` seconds (default 10) is cancelled and recorded as
``TooSlowError``: "this rank hung".

Scenarios (all but ``cycles`` first open a communicator from the environment and create the
``connected`` marker; ``agreed`` is a small allreduce and a barrier that must succeed):

- ``kill VICTIM PHASE GATED ELEMENTS``: ``agreed``, then one collective during which the test
  SIGKILLs ``VICTIM``. ``PHASE``: ``allreduce`` or ``broadcast`` (from root 0) of ``ELEMENTS``
  float32s; ``barrier``; or ``between``, where the victim stays idle between collectives
  (marker ``idle``) while the others enter a small allreduce. Each rank creates ``entering``
  just before its call; rank ``GATED`` (-1: none) calls only once the test created ``gate``.
  Then ``after`` and ``after2``, barriers on the broken communicator.
- ``exit VICTIM HOW``: ``agreed``; the others enter an allreduce (marker ``entering``); once
  all have, ``VICTIM`` writes the time to ``failing`` and fails by ``HOW``: ``exit0``
  (``sys.exit(0)``), ``exit3``, ``abort`` (``os.abort()``) or ``raise`` (an exception escapes
  the ``async with open_communicator``).
- ``stop VICTIM T``: ``agreed``, marker ``ready``; the test SIGSTOPs ``VICTIM`` and creates
  ``go``; the others run an allreduce under their own ``trio.fail_after(T)``.
- ``cancel CANCELLER GATED ELEMENTS AFTER [late]``: ``agreed``; every rank but these two
  enters an allreduce of ``ELEMENTS`` float32s; then the canceller enters it under
  ``trio.move_on_after(AFTER)`` and records the deadline; ``GATED`` enters once the canceller
  has given up (marker ``cancelled``), so the collective cannot complete before that. With
  ``late``, ``GATED`` waits until every other rank has reported the collective's outcome
  (marker ``reported``): they must learn of the cancel without it.
- ``mismatch ODD CASE GOOD``: ``GOOD`` correct collectives (small allreduce, broadcast from
  every root in turn, barrier), then one in which rank ``ODD`` differs by ``CASE`` (``op``,
  ``dtype``, ``count``, ``kind``, ``root``, ``skip``); a rank whose share of it completes runs
  a barrier next, which must raise. Then ``after``.
- ``open``: open, then a barrier (for rendezvous failures: the report holds ``open``).
- ``cycles COUNT EVERY``: open, allreduce, close, ``COUNT`` times on the same address; every
  ``EVERY``-th cycle one rank instead cancels a barrier or closes early, and both open anew.
  Records file descriptors, trio tasks and RSS before and after.
- ``soak SEED COUNT``: ``COUNT`` mixed collectives drawn from ``SEED`` (the same on every
  rank), each result checked against a reference computed locally; records the failures and
  a digest of every result.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _worker_util
import numpy as np
import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from _worker_util import Reporter

HANG_S = float(os.environ.get("FAULT_HANG_S", "10"))
#: Bound on waiting for a file that the test or another worker creates.
WAIT_S = 30.0
SMALL = 1000


def _now() -> float:
    return time.monotonic()


async def timed(
    reporter: Reporter,
    name: str,
    function: Callable[[], Awaitable[object]],
    *,
    hang_after: float | None = None,
    **extra: Any,
) -> BaseException | None:
    """Run ``function``, record how it ended and when (``t0``, ``t1``)."""
    t0 = _now()
    exc: BaseException | None = None
    try:
        with trio.fail_after(HANG_S if hang_after is None else hang_after):
            await function()
    except Exception as caught:
        exc = caught
    t1 = _now()
    reporter.record(name, t0, exc, t0=t0, t1=t1, **extra)
    return exc


async def wait_file(reporter: Reporter, filename: str) -> None:
    with trio.fail_after(WAIT_S):
        await reporter.wait_for(filename)


async def wait_files(reporter: Reporter, filenames: list[str]) -> None:
    with trio.fail_after(WAIT_S):
        for filename in filenames:
            await reporter.wait_for(filename)


async def agreed(comm: trioring.Communicator) -> None:
    n = comm.world_size
    array = np.full(SMALL, comm.rank + 1, np.float32)
    await comm.allreduce(array)
    if not (array == n * (n + 1) // 2).all():
        raise AssertionError(f"agreed allreduce: wrong result {array[:4]}")
    await comm.barrier()


async def after(reporter: Reporter, comm: trioring.Communicator) -> None:
    """Record whether the communicator is broken now, and what the next two barriers raise
    (the first one fails in its own right if this rank's share of the faulty collective
    completed before the fault reached it; the second one must find it broken)."""
    reporter.report["broken"] = comm.broken
    await timed(reporter, "after", comm.barrier)
    await timed(reporter, "after2", comm.barrier)


# -- kill ---------------------------------------------------------------------------------------


async def scenario_kill(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    victim, phase, gated, elements = int(args[0]), args[1], int(args[2]), int(args[3])
    if await timed(reporter, "agreed", lambda: agreed(comm)) is not None:
        return
    me = comm.rank
    call: Callable[[], Awaitable[None]]
    if phase in ("allreduce", "broadcast"):
        array = np.ones(elements, np.float32)  # allocated (and touched) before the marker
        if phase == "allreduce":

            async def call() -> None:
                await comm.allreduce(array)
        else:

            async def call() -> None:
                await comm.broadcast(array, root=0)

    elif phase == "barrier":
        call = comm.barrier
    elif phase == "between":
        if me == victim:
            reporter.mark("idle")
            await wait_file(reporter, "never")
            return
        small = np.ones(SMALL, np.float32)

        async def call() -> None:
            await comm.allreduce(small)

    else:
        raise ValueError(f"unknown phase {phase!r}")
    if me == gated:
        await wait_file(reporter, "gate")
    reporter.mark("entering")
    await timed(reporter, "collective", call)
    if me != victim:
        await after(reporter, comm)


# -- exit ---------------------------------------------------------------------------------------


async def scenario_exit(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    victim, how = int(args[0]), args[1]
    if await timed(reporter, "agreed", lambda: agreed(comm)) is not None:
        return
    if comm.rank != victim:
        small = np.ones(SMALL, np.float32)
        reporter.mark("entering")
        await timed(reporter, "collective", lambda: comm.allreduce(small))
        await after(reporter, comm)
        return
    others = [r for r in range(comm.world_size) if r != victim]
    await wait_files(reporter, [f"w{r}.entering" for r in others])
    reporter.write(f"w{reporter.index}.failing", repr(_now()).encode())
    if how == "exit0":
        sys.exit(0)
    elif how == "exit3":
        sys.exit(3)
    elif how == "abort":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.abort()
    elif how == "raise":
        raise RuntimeError("injected failure before the collective")
    raise ValueError(f"unknown way to fail {how!r}")


# -- stop ---------------------------------------------------------------------------------------


async def scenario_stop(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    victim, limit = int(args[0]), float(args[1])
    if await timed(reporter, "agreed", lambda: agreed(comm)) is not None:
        return
    reporter.mark("ready")
    if comm.rank == victim:
        await wait_file(reporter, "never")  # SIGSTOPped here, then killed
        return
    await wait_file(reporter, "go")
    small = np.ones(SMALL, np.float32)

    async def bounded() -> None:
        with trio.fail_after(limit):
            await comm.allreduce(small)

    await timed(reporter, "collective", bounded, hang_after=limit + 10)
    await after(reporter, comm)


# -- cancel -------------------------------------------------------------------------------------


async def scenario_cancel(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    canceller, gated, elements, cancel_after = (
        int(args[0]),
        int(args[1]),
        int(args[2]),
        float(args[3]),
    )
    late = args[4:] == ["late"]
    if await timed(reporter, "agreed", lambda: agreed(comm)) is not None:
        return
    array = np.ones(elements, np.float32)
    me = comm.rank
    if me == canceller:
        inside = [r for r in range(comm.world_size) if r not in (canceller, gated)]
        await wait_files(reporter, [f"w{r}.entering" for r in inside])
        reporter.mark("entering")
        escaped: BaseException | None = None
        t0 = _now()
        with trio.move_on_after(cancel_after) as scope:
            deadline = t0 + (scope.deadline - trio.current_time())
            try:
                await comm.allreduce(array)
            except BaseException as exc:
                escaped = exc
                raise
        reporter.record(
            "collective",
            t0,
            None,
            t0=t0,
            t1=_now(),
            deadline=deadline,
            cancelled_caught=scope.cancelled_caught,
            escaped=None if escaped is None else type(escaped).__name__,
            escaped_is_cancellation=_worker_util.is_cancellation(escaped),
        )
        reporter.mark("cancelled")
        await after(reporter, comm)
        return
    if me == gated:
        await wait_file(reporter, f"w{canceller}.cancelled")
        if late:
            others = [r for r in range(comm.world_size) if r not in (canceller, gated)]
            await wait_files(reporter, [f"w{r}.reported" for r in others])
    reporter.mark("entering")
    await timed(reporter, "collective", lambda: comm.allreduce(array))
    reporter.mark("reported")
    await after(reporter, comm)


# -- mismatch -----------------------------------------------------------------------------------


async def good_collectives(comm: trioring.Communicator, count: int) -> None:
    n, me = comm.world_size, comm.rank
    for k in range(count):
        if k % 3 == 0:
            array = np.full(16, k + me, np.float32)
            await comm.allreduce(array)
            expected = n * k + n * (n - 1) // 2
        elif k % 3 == 1:
            root = (k // 3) % n
            array = np.full(16, me, np.float32)
            await comm.broadcast(array, root=root)
            expected = root
        else:
            await comm.barrier()
            continue
        if not (array == expected).all():
            raise AssertionError(f"good collective #{k + 1}: got {array[:4]}, not {expected}")


def mismatch_roots(odd: int, world_size: int) -> tuple[int, int]:
    """(the root the odd rank names, the root the others name) in the ``root`` case: the
    others broadcast from rank 0, the odd rank from itself (rank 0 from rank 1)."""
    return (odd if odd != 0 else 1), 0


async def mismatched_call(comm: trioring.Communicator, odd: int, case: str) -> None:
    me_odd = comm.rank == odd
    array = np.ones(SMALL, np.float32)
    if case == "op":
        await comm.allreduce(array, op="max" if me_odd else "sum")
    elif case == "dtype":
        await comm.allreduce(np.ones(SMALL, np.float64) if me_odd else array)
    elif case == "count":
        await comm.allreduce(np.ones(SMALL + 1, np.float32) if me_odd else array)
    elif case == "kind":
        await (comm.broadcast(array, root=0) if me_odd else comm.allreduce(array))
    elif case == "root":
        odd_root, root = mismatch_roots(odd, comm.world_size)
        await comm.broadcast(array, root=odd_root if me_odd else root)
    elif case == "skip":
        # Everyone else runs a barrier and then this allreduce; the odd rank skips the barrier.
        if not me_odd:
            await comm.barrier()
        await comm.allreduce(array)
    else:
        raise ValueError(f"unknown mismatch case {case!r}")


async def scenario_mismatch(
    reporter: Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    odd, case, good = int(args[0]), args[1], int(args[2])
    if await timed(reporter, "good", lambda: good_collectives(comm, good)) is not None:
        return
    t0 = _now()
    raised_in = "mismatch"
    exc: BaseException | None = None
    try:
        with trio.fail_after(HANG_S):
            await mismatched_call(comm, odd, case)
    except Exception as caught:
        exc = caught
    if exc is None:
        # This rank's share completed without meeting the odd one: its next call must fail.
        raised_in = "next"
        try:
            with trio.fail_after(HANG_S):
                await comm.barrier()
        except Exception as caught:
            exc = caught
    reporter.record("mismatch", t0, exc, t0=t0, t1=_now(), raised_in=raised_in)
    await after(reporter, comm)


# -- open ---------------------------------------------------------------------------------------


async def scenario_open(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    await timed(reporter, "barrier", comm.barrier)


# -- cycles -------------------------------------------------------------------------------------


def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def count_objects() -> int:
    """The objects the garbage collector tracks (containers: lists, dicts, instances, tasks,
    frames) alive after a full collection; anything a leaked communicator, task or callback
    holds is among them. A leak of one list per cycle failed the test (+431 over the second
    half, against the bound of 250)."""
    gc.collect()
    return len(gc.get_objects())


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(child) for n in task.child_nurseries for child in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


async def scenario_cycles(reporter: Reporter, args: list[str]) -> None:
    count, every = int(args[0]), int(args[1])
    rank = int(os.environ["RANK"])
    report = reporter.report
    report.update(
        socket_dir=os.environ.get("TRIORING_SOCKET_DIR"),
        fds_start=count_fds(),
        tasks_start=count_tasks(),
        rss_start=rss_kib(),
    )
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    started = _now()
    for cycle in range(count):
        fault = None
        if every and cycle % every == every - 1:
            fault = ("cancel", "close")[(cycle // every) % 2]
        actor = (cycle // (2 * every)) % 2 if every else 0
        try:
            with trio.fail_after(HANG_S):
                async with trioring.open_communicator() as comm:
                    array = np.array([rank + 1, cycle], np.int64)
                    await comm.allreduce(array)
                    if array.tolist() != [3, 2 * cycle]:
                        failures.append(f"cycle {cycle}: allreduce gave {array.tolist()}")
                    if fault is not None:
                        outcomes[await _fault(reporter, comm, fault, cycle, actor)] += 1
                    else:
                        outcomes["ok"] += 1
        except Exception as exc:
            failures.append(f"cycle {cycle} ({fault}): {type(exc).__name__}: {exc}")
            break
        if cycle == 9:
            report.update(fds_warm=count_fds(), rss_warm=rss_kib())
        if cycle == count // 2 - 1:
            report.update(rss_half=rss_kib(), objects_half=count_objects())
    report.update(
        elapsed=_now() - started,
        cycles=count,
        outcomes=dict(outcomes),
        failures=failures,
        fds_end=count_fds(),
        tasks_end=count_tasks(),
        rss_end=rss_kib(),
        objects_end=count_objects(),
    )


async def _fault(
    reporter: Reporter, comm: trioring.Communicator, fault: str, cycle: int, actor: int
) -> str:
    """One faulty cycle; returns what happened on this rank, as ``role:outcome``."""
    if comm.rank == actor:
        if fault == "close":
            return "closer:closed"  # leaving the async with closes the communicator early
        with trio.move_on_after(0.005) as scope:
            await comm.barrier()
        if not (scope.cancelled_caught and comm.broken):
            return f"canceller:not-cancelled(caught={scope.cancelled_caught})"
        try:
            await comm.barrier()
        except trioring.CommunicatorBrokenError:
            outcome = "canceller:broken"
        else:
            outcome = "canceller:barrier-passed"
        reporter.mark(f"cancelled{cycle}")
        return outcome
    if fault == "cancel":
        with trio.fail_after(WAIT_S):
            await reporter.wait_for(f"w{actor}.cancelled{cycle}")
    try:
        await comm.barrier()
    except trioring.TrioringError as exc:
        return f"peer:{type(exc).__name__}"
    return "peer:barrier-passed"


# -- soak ---------------------------------------------------------------------------------------

SOAK_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64")
SOAK_OPS = ("sum", "mean", "min", "max", "prod")
_UFUNCS = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def soak_plan(seed: int, count: int, world_size: int) -> list[tuple[str, str, int, str, int]]:
    """The collectives of a soak, the same on every rank: (kind, dtype, count, op, root)."""
    rng = np.random.default_rng([seed, world_size])
    plan = []
    for _ in range(count):
        kind = str(rng.choice(["allreduce", "broadcast", "barrier"], p=[0.6, 0.25, 0.15]))
        if kind == "barrier":
            plan.append((kind, "", 0, "", 0))
            continue
        dtype = np.dtype(str(rng.choice(SOAK_DTYPES)))
        op = ""
        if kind == "allreduce":
            ops = [o for o in SOAK_OPS if not (o == "mean" and dtype.kind in "iu")]
            ops = [o for o in ops if not (o in ("min", "max") and dtype.kind == "c")]
            op = str(rng.choice(ops))
        # Sizes from 0 to 1 MiB, mostly small.
        bucket = rng.random()
        if bucket < 0.1:
            nbytes = 0
        elif bucket < 0.7:
            nbytes = int(rng.integers(1, 4096))
        elif bucket < 0.95:
            nbytes = int(rng.integers(4096, 64 * 1024))
        else:
            nbytes = int(rng.integers(64 * 1024, 1024 * 1024 + 1))
        root = int(rng.integers(world_size))
        plan.append((kind, dtype.name, nbytes // dtype.itemsize, op, root))
    return plan


def soak_input(seed: int, index: int, rank: int, dtype: str, count: int, op: str) -> np.ndarray:
    """Rank ``rank``'s input to collective ``index``: integer-valued, small enough that every
    sum, product, mean's sum, min and max is exact in the dtype, whatever the order."""
    rng = np.random.default_rng([seed, index, rank])
    dt = np.dtype(dtype)
    if op == "prod":
        lo, hi = (0, 3) if dt.kind == "u" else (-3, 3)
        if dt.kind == "c":
            lo, hi = -2, 2
    elif op in ("min", "max"):
        lo, hi = {"int8": (-128, 127), "uint8": (0, 255), "float16": (-1000, 1000)}.get(
            dtype, (-(10**6), 10**6)
        )
    else:  # sum, mean, broadcast
        lo, hi = {"int8": (-30, 30), "uint8": (0, 60)}.get(dtype, (-100, 100))
    values = rng.integers(lo, hi, size=count, endpoint=True)
    if dt.kind == "c":
        imag = rng.integers(lo, hi, size=count, endpoint=True)
        return (values + 1j * imag).astype(dt)
    return values.astype(dt)


def _canonical(array: np.ndarray) -> bytes:
    """The bytes of ``array``, with every -0.0 made +0.0 in complex arrays: a complex product
    of integer-valued factors is exact, but the sign of a zero part depends on the order of
    the factors, which the ring chooses (it is the same on every rank)."""
    if array.dtype.kind == "c":
        array = array + 0  # -0.0 + 0.0 == +0.0
    return array.tobytes()


async def scenario_soak(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    seed, count = int(args[0]), int(args[1])
    n, me = comm.world_size, comm.rank
    plan = soak_plan(seed, count, n)
    # The results as they are (bitwise identical on every rank, or the library broke its
    # contract); the checked results and the reference, both canonical.
    digest, checked, reference = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    failures: list[str] = []
    kinds: collections.Counter[str] = collections.Counter()
    mix: dict[str, set[Any]] = {"ops": set(), "dtypes": set(), "roots": set(), "nbytes": set()}
    t0 = _now()

    async def run() -> None:
        for index, (kind, dtype, size, op, root) in enumerate(plan):
            if kind != "barrier":
                mix["dtypes"].add(dtype)
                mix["nbytes"].add(size * np.dtype(dtype).itemsize)
                mix["ops" if kind == "allreduce" else "roots"].add(op or root)
            tag = f"{index}:{kind}:{dtype}:{size}:{op}:{root};".encode()
            for hashed in (digest, checked, reference):
                hashed.update(tag)
            if kind == "barrier":
                await comm.barrier()
                kinds[kind] += 1
                continue
            array = soak_input(seed, index, me, dtype, size, op)
            if kind == "broadcast":
                await comm.broadcast(array, root=root)
                expected = soak_input(seed, index, root, dtype, size, op)
            else:
                await comm.allreduce(array, op=op)
                expected = soak_input(seed, index, 0, dtype, size, op)
                with np.errstate(all="ignore"):
                    for other in range(1, n):
                        incoming = soak_input(seed, index, other, dtype, size, op)
                        _UFUNCS[op](expected, incoming, out=expected)
                    if op == "mean":
                        np.divide(expected, n, out=expected)
            kinds[kind] += 1
            got, want = _canonical(array), _canonical(expected)
            digest.update(array.tobytes())
            checked.update(got)
            reference.update(want)
            if got != want:
                wrong = int(np.count_nonzero(array != expected))
                failures.append(
                    f"#{index + 1} {kind}({op or f'root={root}'}) {dtype}[{size}]: "
                    f"{wrong} elements differ in value"
                )

    await timed(reporter, "soak", run, hang_after=600)
    reporter.report.update(
        elapsed=_now() - t0,
        completed=sum(kinds.values()),
        kinds=dict(kinds),
        ops=sorted(mix["ops"]),
        dtypes=sorted(mix["dtypes"]),
        roots=sorted(mix["roots"]),
        min_nbytes=min(mix["nbytes"], default=0),
        max_nbytes=max(mix["nbytes"], default=0),
        failures=failures[:20],
        failure_count=len(failures),
        digest=digest.hexdigest(),
        checked_digest=checked.hexdigest(),
        reference_digest=reference.hexdigest(),
    )


# -- main ---------------------------------------------------------------------------------------

SCENARIOS: dict[str, Any] = {
    "kill": scenario_kill,
    "exit": scenario_exit,
    "stop": scenario_stop,
    "cancel": scenario_cancel,
    "mismatch": scenario_mismatch,
    "open": scenario_open,
    "soak": scenario_soak,
}
#: Scenarios that open (and close) communicators themselves.
RAW_SCENARIOS: dict[str, Any] = {"cycles": scenario_cycles}


async def _run(reporter: Reporter, name: str, args: list[str]) -> None:
    if name in RAW_SCENARIOS:
        await RAW_SCENARIOS[name](reporter, args)
        return
    open_s = float(os.environ.get("WORKER_OPEN_TIMEOUT_S", "20"))
    t0 = _now()
    async with contextlib.AsyncExitStack() as stack:
        try:
            with trio.fail_after(open_s):
                comm = await stack.enter_async_context(trioring.open_communicator())
        except Exception as exc:
            reporter.record(
                "open", t0, exc, t0=t0, t1=_now(), traceback=traceback.format_exception(exc)
            )
            return
        reporter.record("open", t0, None, t0=t0, t1=_now(), transport=comm.transport)
        reporter.mark("connected")
        await SCENARIOS[name](reporter, comm, args)


def main() -> None:
    name, out_dir, index, *args = sys.argv[1:]
    _worker_util.run_reporting(_worker_util.Reporter(Path(out_dir), int(index)), _run, name, args)


if __name__ == "__main__":
    main()
