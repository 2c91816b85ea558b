"""Rough edges found by writing real programs from the docs (issue 14, item 5): each test here
failed before its fix.

* ``import trioring`` alone gives ``trioring.testing`` (and ``trioring.transports``);
* array types whose data or meaning would not survive a collective (np.matrix, masked arrays,
  other ndarray subclasses) are refused before any I/O, and the communicator stays usable;
* trioring called from asyncio says so instead of failing inside Trio;
* two ``open_communicator()`` calls at once for one rank fail at once, on every rank;
* under ``trioring run``, errors that only echo another rank's failure print one line (the
  launcher's own side of this, and OMP_NUM_THREADS, are in test_launcher.py);
* ``await comm.split(...)`` (and the other async context managers, awaited or entered with
  a plain ``with``) says to write ``async with``, where Python's message named only
  contextlib's class.

Processes are bounded: every launcher runs in a session of its own and is killed with its
whole process group if it outlives its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio

import trioring
from launched import LAUNCHER_DEADLINE_S, run_launcher, write_script
from trioring._concurrency import cancel_cause, first_leaf
from trioring._errors import (
    CollectiveMismatchError,
    CommunicatorBrokenError,
    PeerAbortedError,
    PeerFailedError,
)
from trioring._launched import echo_line, echoed_ranks, error_line, mismatched_calls, odd_calls
from trioring._wire import DTYPE_CODES, AbortKind, Kind, OpSpec, abort_error
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

#: Bound on one launcher run (see launched.run_launcher).
DEADLINE_S = LAUNCHER_DEADLINE_S


# -- 4. `import trioring` is enough for trioring.testing -------------------------------------


def test_plain_import_reaches_the_public_submodules() -> None:
    # In a fresh interpreter: here, other tests imported trioring.testing already.
    code = (
        "import trioring; "
        "print(trioring.testing.open_local_world.__module__, "
        "trioring.transports.TcpTransport.__module__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["trioring.testing", "trioring.transports"]


# -- 2. array types that would not survive a collective --------------------------------------


class _Tagged(np.ndarray):
    """An ndarray subclass of the kind a library might define."""


def _matrix() -> Any:
    with pytest.warns(PendingDeprecationWarning):
        return np.matrix([[1.0, 2.0], [3.0, 4.0]])


REFUSED: list[tuple[str, Callable[[], Any], str]] = [
    ("matrix", _matrix, r"numpy\.matrix is not supported: it stays 2-D .* np\.asarray\(m\)"),
    (
        "masked",
        lambda: np.ma.array([1.0, 2.0, 3.0, 4.0], mask=[False, True, False, False]),
        r"MaskedArray is not supported: its mask would be ignored.*a\.filled\(0\).*getmaskarray",
    ),
    (
        "recarray",
        lambda: np.recarray((4,), dtype=np.float64),
        r"recarray is not supported: .* pass np\.asarray\(a\)",
    ),
    (
        "subclass",
        lambda: np.zeros(4).view(_Tagged),
        r"_Tagged is not supported: .*only numpy\.ndarray and numpy\.memmap",
    ),
    ("object", lambda: np.array([1, None, 2, 3], dtype=object), r"dtype object is not supported"),
    (
        "structured",
        lambda: np.zeros(4, dtype=[("a", "f4"), ("b", "i4")]),
        r"structured dtype .* reduce or broadcast each field",
    ),
]


@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
@pytest.mark.parametrize(("name", "make", "message"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_arrays_that_would_not_survive_are_refused_before_any_io(
    collective: str, name: str, make: Callable[[], Any], message: str
) -> None:
    del name
    async with open_local_world(2) as comms:
        with trio.fail_after(10):
            for comm in comms:
                # Alone, without its peer: a refusal must not wait for (or send to) anyone.
                with pytest.raises(trioring.InvalidArgumentError, match=message) as info:
                    await getattr(comm, collective)(make())
                assert info.value.rank == comm.rank
                assert info.value.collective == collective
                assert not comm.broken
                assert comm.seq == 0
            # Still usable, and the refused call used no sequence number.
            arrays = [np.full(4, comm.rank + 1.0) for comm in comms]
            async with trio.open_nursery() as nursery:
                for comm, array in zip(comms, arrays, strict=True):
                    nursery.start_soon(comm.allreduce, array)
            assert [a.tolist() for a in arrays] == [[3.0] * 4] * 2
            assert [comm.seq for comm in comms] == [1, 1]


async def test_accepted_array_shapes_and_memmaps(tmp_path: Path) -> None:
    """A 0-d array, an empty one, and a memmap (a plain buffer in a mapped file) all work in
    place."""
    makers: list[Callable[[int], np.ndarray[Any, Any]]] = [
        lambda rank: np.array(rank + 1.0),
        lambda rank: np.zeros((0, 3)),
        lambda rank: np.memmap(tmp_path / f"m{rank}", dtype="f8", mode="w+", shape=(2, 3)),
    ]
    async with open_local_world(2) as comms:
        with trio.fail_after(10):
            for make in makers:
                arrays = [make(comm.rank) for comm in comms]
                for rank, array in enumerate(arrays):
                    array[...] = rank + 1.0
                async with trio.open_nursery() as nursery:
                    for comm, array in zip(comms, arrays, strict=True):
                        nursery.start_soon(comm.allreduce, array)
                for array in arrays:
                    assert type(array) is type(arrays[0])
                    assert np.all(np.asarray(array) == 3.0)


# -- 5. called from asyncio -------------------------------------------------------------------


def test_open_communicator_from_asyncio_says_so() -> None:
    async def main() -> None:
        async with trioring.open_communicator(rank=0, world_size=1):
            pass  # pragma: no cover - must not get here

    with pytest.raises(
        trioring.ConfigurationError,
        match=r"^trioring needs Trio \(trio\.run\); open_communicator\(\) was called from "
        r"asyncio\. .*asyncio\.to_thread\(trio\.run, main\)",
    ):
        asyncio.run(main())


def test_open_local_world_from_asyncio_says_so() -> None:
    async def main() -> None:
        async with open_local_world(2):
            pass  # pragma: no cover - must not get here

    with pytest.raises(
        trioring.ConfigurationError,
        match=r"trioring\.testing\.open_local_world\(\) was called from asyncio",
    ):
        asyncio.run(main())


def test_open_communicator_without_any_event_loop_says_so() -> None:
    opening = trioring.open_communicator(rank=0, world_size=1).__aenter__()
    with pytest.raises(trioring.ConfigurationError, match=r"was called outside trio\.run"):
        opening.send(None)


# -- 6. a context manager awaited, or entered with a plain `with` -----------------------------


async def test_open_communicator_awaited_says_to_use_async_with() -> None:
    # Python's own message named only contextlib's _AsyncGeneratorContextManager.
    with pytest.raises(
        TypeError,
        match=r"^trioring\.open_communicator\(\) is an async context manager and cannot be "
        r"awaited: write 'async with trioring\.open_communicator\(\) as \.\.\.:'$",
    ):
        await trioring.open_communicator(rank=0, world_size=1, transport="tcp")  # type: ignore[misc]
    with (
        pytest.raises(TypeError, match=r"cannot be used with a plain 'with': write 'async with"),
        trioring.open_communicator(rank=0, world_size=1, transport="tcp"),  # type: ignore[attr-defined]
    ):
        pass  # pragma: no cover - must not get here
    with pytest.raises(TypeError, match=r"^trioring\.testing\.open_local_world\(\.\.\.\) is an"):
        await open_local_world(2)  # type: ignore[misc]
    # Nothing was opened: no open is in progress for rank 0, and it opens now.
    with trio.fail_after(10):
        async with trioring.open_communicator(rank=0, world_size=1, transport="tcp") as comm:
            await comm.barrier()


async def test_split_and_dup_awaited_say_to_use_async_with() -> None:
    with trio.fail_after(10):
        async with open_local_world(2) as comms:

            async def rank_code(comm: trioring.Communicator) -> None:
                with pytest.raises(
                    TypeError,
                    match=r"^comm\.split\(color=\.\.\.\) is an async context manager and "
                    r"cannot be awaited: write 'async with comm\.split\(color=\.\.\.\) as",
                ):
                    await comm.split(color=0)  # type: ignore[misc]
                with pytest.raises(TypeError, match=r"^comm\.dup\(\) is an async context manager"):
                    await comm.dup()  # type: ignore[misc]
                # Neither started the collective: the next call is #1 on every rank, and
                # the real split works.
                await comm.barrier()
                assert comm._seq == 1
                async with comm.split(color=comm.rank) as sub:
                    assert sub is not None
                    assert sub.world_size == 1

            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(rank_code, comm)


# -- 3. two open_communicator() calls at once -------------------------------------------------


async def test_concurrent_open_in_one_process_fails_at_once() -> None:
    """A world of one rank needs no I/O at all, so both calls would succeed; the second is
    refused anyway, as it would be in a world of several ranks (where it cannot work)."""
    outcomes: list[str] = []

    async def open_one() -> None:
        try:
            async with trioring.open_communicator(rank=0, world_size=1, transport="tcp"):
                outcomes.append("opened")
        except trioring.ConcurrentOpenError as exc:
            outcomes.append(str(exc))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_one)
            nursery.start_soon(open_one)
    assert len(outcomes) == 2
    assert "opened" in outcomes
    (refused,) = (outcome for outcome in outcomes if outcome != "opened")
    assert refused.startswith("rank 0: another open_communicator() call of this process is ")
    assert "one after another on one communicator" in refused
    # Once the first is open, the same settings open again.
    async with (
        trioring.open_communicator(rank=0, world_size=1, transport="tcp") as first,
        trioring.open_communicator(rank=0, world_size=1, transport="tcp") as second,
    ):
        await first.barrier()
        await second.barrier()


async def test_local_worlds_may_open_concurrently() -> None:
    async def world() -> None:
        async with open_local_world(3) as comms, trio.open_nursery() as nursery:
            for comm in comms:
                nursery.start_soon(comm.barrier)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world)
            nursery.start_soon(world)


CONCURRENT_OPEN = """
    import json, os, sys, time
    import trio, trioring

    async def open_one():
        async with trioring.open_communicator() as comm:
            await comm.barrier()

    async def main():
        start = time.monotonic()
        errors = []
        try:
            # Without the check, the ranks other than 0 waited for a rank 0 that had failed.
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(open_one)
                    nursery.start_soon(open_one)
        except BaseExceptionGroup as group:
            errors = [[type(e).__name__, str(e)] for e in group.exceptions]
        except Exception as exc:
            errors = [[type(exc).__name__, str(exc)]]
        report = {"errors": errors, "elapsed": time.monotonic() - start}
        with open(f"rank{os.environ['RANK']}.json", "w") as file:
            json.dump(report, file)

    trio.run(main)
"""


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_concurrent_open_fails_at_once_on_every_rank(tmp_path: Path, transport: str) -> None:
    script = write_script(tmp_path, CONCURRENT_OPEN)
    result = run_launcher(tmp_path, "-n", "3", "--transport", transport, str(script))
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [name for name, _ in report["errors"]] == ["ConcurrentOpenError"], report
        message = report["errors"][0][1]
        assert message.startswith(f"rank {rank}: another open_communicator() call of this ")
        assert "[job run-" in message
        assert report["elapsed"] < 10, report  # at once: nobody waited for a peer


SEQUENTIAL_OPEN = """
    import json, os
    import numpy as np, trio, trioring

    async def main():
        with trio.fail_after(30):
            await body()

    async def body():
        # Same environment three times: the second while the first is open, the third after
        # both closed; collectives on the two open ones run at the same time.
        async with trioring.open_communicator() as a:
            async with trioring.open_communicator() as b:
                x, y = np.ones(8), np.full(8, 2.0)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(a.allreduce, x)
                    nursery.start_soon(b.allreduce, y)
        async with trioring.open_communicator() as c:
            await c.barrier()
        with open(f"rank{os.environ['RANK']}.json", "w") as file:
            json.dump({"x": x.tolist(), "y": y.tolist()}, file)

    trio.run(main)
"""


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_opening_again_once_open_works(tmp_path: Path, transport: str) -> None:
    script = write_script(tmp_path, SEQUENTIAL_OPEN)
    result = run_launcher(tmp_path, "-n", "3", "--transport", transport, str(script))
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {"x": [3.0] * 8, "y": [6.0] * 8}


# -- 6. short failure reports under trioring run ----------------------------------------------


def test_echoes_are_errors_that_only_report_another_ranks_failure() -> None:
    failed = PeerFailedError("rank 0: allreduce #3: peer rank 2 closed", rank=0, peer=2)
    aborted = PeerAbortedError("rank 1: rank 3 cancelled", reason="cancelled", rank=1, peer=3)
    assert echoed_ranks(failed) == frozenset({2})
    assert echoed_ranks(aborted) == frozenset({3})
    broken = CommunicatorBrokenError("rank 0: broken since #3", rank=0)
    broken.__cause__ = failed
    assert echoed_ranks(broken) == frozenset({2})
    assert echoed_ranks(ExceptionGroup("g", [failed, aborted])) == frozenset({2, 3})
    # A failure of its own: not an echo.
    assert echoed_ranks(ValueError("bad batch")) is None
    assert echoed_ranks(ExceptionGroup("g", [failed, ValueError("bad batch")])) is None
    assert echoed_ranks(CommunicatorBrokenError("broken by cancel", rank=0)) is None
    assert echoed_ranks(PeerFailedError("rank 0: who knows", rank=0)) is None
    assert echoed_ranks(PeerFailedError("rank 0: about me", rank=0, peer=0)) is None
    mismatch = CollectiveMismatchError("rank 0: mismatch with rank 1", rank=0, peer=1)
    assert echoed_ranks(mismatch) is None  # this rank saw the mismatch itself
    mismatch._trioring_abort = (2, 1, "mismatch", 1)  # news of it from rank 1's abort frame
    assert echoed_ranks(mismatch) == frozenset({1})
    assert echo_line(ExceptionGroup("g", [failed, aborted]), frozenset({2, 3})) == (
        "trioring.PeerFailedError: rank 0: allreduce #3: peer rank 2 closed (and 1 more like "
        "it) [traceback omitted by trioring run: this error only reports that ranks 2, 3 "
        "failed]\n"
    )
    # In a sub-communicator whose ranks 0 and 1 are the world's 1 and 3: its rank 1 is the
    # world's rank 3, and the one line says how its ranks map.
    sub = PeerFailedError("rank 0: barrier #2: rank 1 failed", rank=0, peer=1)
    sub._trioring_world_ranks = (1, 3)
    sub.add_note("ranks above are those of split #1 of world (color 1); as world ranks: 0->1, 1->3")
    assert echoed_ranks(sub) == frozenset({3})
    assert echo_line(sub, frozenset({3})) == (
        "trioring.PeerFailedError: rank 0: barrier #2: rank 1 failed [ranks above are those of "
        "split #1 of world (color 1); as world ranks: 0->1, 1->3] [traceback omitted by "
        "trioring run: this error only reports that rank 3 failed]\n"
    )
    later = CommunicatorBrokenError("rank 0: broken since #2", rank=0)
    later.__cause__ = sub
    assert echoed_ranks(later) == frozenset({3})
    assert "as world ranks: 0->1, 1->3] [traceback omitted" in echo_line(later, frozenset({3}))


def test_the_launchers_error_line() -> None:
    """What a rank tells ``trioring run`` of a failure of its own: one line, the first
    leaf of a group, a sub-communicator's map of ranks, at most 1000 characters."""
    assert error_line(ValueError("bad\n  batch")) == "ValueError: bad batch"
    group = ExceptionGroup("g", [KeyError("k"), ValueError("v")])
    assert error_line(group) == "KeyError: 'k' (and 1 more like it)"
    sub = CollectiveMismatchError("rank 0: barrier #2, rank 1: allreduce #2", rank=0, peer=1)
    sub._trioring_world_ranks = (1, 3)
    sub.add_note("ranks above are those of split #1 of world (color 1); as world ranks: 0->1, 1->3")
    assert error_line(sub) == (
        "trioring.CollectiveMismatchError: rank 0: barrier #2, rank 1: allreduce #2 [ranks "
        "above are those of split #1 of world (color 1); as world ranks: 0->1, 1->3]"
    )
    long = error_line(RuntimeError("x" * 5000))
    assert len(long) == 1000
    assert long.endswith("...")
    # A failure beside a cancelled sibling, as a nursery may raise them: the failure.
    assert error_line(BaseExceptionGroup("g", [_a_cancelled(), ValueError("v")])) == "ValueError: v"


def _a_cancelled() -> trio.Cancelled:
    """A real :class:`trio.Cancelled` (it has no public constructor)."""
    caught: list[trio.Cancelled] = []

    async def main() -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await trio.lowlevel.checkpoint()
            except trio.Cancelled as exc:
                caught.append(exc)
                raise

    trio.run(main)
    return caught[0]


def test_the_exception_that_says_what_a_group_is() -> None:
    """first_leaf: the first leaf, depth first, that is not a cancellation, and how many
    such leaves there are; all cancelled: the first; not a group: itself."""
    error = KeyError("k")
    assert first_leaf(error) == (error, 1)
    inner, later = KeyError("inner"), ValueError("later")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [inner]), later])
    assert first_leaf(nested) == (inner, 2)
    cancelled, other = _a_cancelled(), _a_cancelled()
    assert first_leaf(BaseExceptionGroup("g", [cancelled, later])) == (later, 1)
    assert first_leaf(BaseExceptionGroup("g", [cancelled, other])) == (cancelled, 2)


def _cancelled_by(how: str) -> BaseException:
    """The Cancelled that Trio raises in a task cancelled ``how``: a sibling's failure, the
    nursery's own block raising, a scope cancelled with or without a reason, a deadline."""
    caught: list[BaseException] = []

    async def victim(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            task_status.started()
            await trio.sleep_forever()
        except trio.Cancelled as exc:
            caught.append(exc)
            raise

    async def fail() -> None:
        raise ValueError("bad batch")

    async def main() -> None:
        with contextlib.suppress(ValueError, ExceptionGroup):
            async with trio.open_nursery() as nursery:
                await nursery.start(victim)
                if how == "sibling":
                    nursery.start_soon(fail)
                elif how == "block":
                    raise ValueError("bad batch")
                elif how == "long":
                    raise ValueError("x" * 1000)
                elif how == "deadline":
                    nursery.cancel_scope.deadline = trio.current_time()
                else:
                    nursery.cancel_scope.cancel(reason="shutting down" if how == "reason" else None)

    trio.run(main)
    return caught[0]


@pytest.mark.parametrize(
    ("how", "cause"),
    [
        ("sibling", ", when code beside it raised ValueError('bad batch')"),
        ("block", ", when code beside it raised ValueError('bad batch')"),
        ("reason", ", by its cancel scope (shutting down)"),
        # Trio's reason, cut: "Code block inside nursery contextmanager raised exception "
        # is 58 characters, then the repr.
        ("long", ", when code beside it raised ValueError('" + "x" * (500 - 58 - 12) + "..."),
        ("plain", ""),
        ("deadline", ""),
    ],
)
def test_what_cancelled_a_call(how: str, cause: str) -> None:
    """cancel_cause: what Trio says cancelled a task, as the end of a cancelled collective's
    message; nothing where the message's time already says it (a deadline) or nothing was
    said. Also through an exception group of cancellations, and nothing for an error."""
    cancelled = _cancelled_by(how)
    assert cancel_cause(cancelled) == cause
    assert cancel_cause(BaseExceptionGroup("g", [cancelled])) == cause
    assert cancel_cause(ValueError("x")) == ""


HOOKED = """
    import os, signal, sys
    import trioring

    kind = sys.argv[1]
    print(os.getpid(), flush=True)
    if kind == "echo":
        raise trioring.PeerFailedError("rank 1: barrier #2: rank 0 failed", rank=1, peer=0)
    if kind == "hook-then-sigterm":
        error = trioring.PeerFailedError("rank 1: barrier #2: rank 0 failed", rank=1, peer=0)
        sys.excepthook(type(error), error, None)
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)
        sys.exit(0)
    raise ValueError("a failure of its own")
"""


@pytest.mark.parametrize("launched", [True, False])
@pytest.mark.parametrize("kind", ["echo", "own"])
def test_excepthook_under_the_launcher(tmp_path: Path, kind: str, launched: bool) -> None:
    script = write_script(tmp_path, HOOKED)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRIORING_RUN_DIR"}
    if launched:
        env["TRIORING_RUN_DIR"] = str(run_dir)
    result = subprocess.run(
        [sys.executable, str(script), kind],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    pid = int(result.stdout)
    note = run_dir / f"{pid}.echo"
    if kind == "echo" and launched:
        assert result.stderr == (
            "trioring.PeerFailedError: rank 1: barrier #2: rank 0 failed [traceback omitted by "
            "trioring run: this error only reports that rank 0 failed]\n"
        )
        assert json.loads(note.read_text()) == {"echoes": [0]}
    elif launched:
        # A failure of its own: the full traceback, and its one line for the launcher.
        assert result.stderr.startswith("Traceback (most recent call last):\n")
        assert [path.name for path in run_dir.iterdir()] == [f"{pid}.error"]
        error = json.loads((run_dir / f"{pid}.error").read_text())
        assert error == {"error": "ValueError: a failure of its own"}
    else:
        assert result.stderr.startswith("Traceback (most recent call last):\n")
        assert not list(run_dir.iterdir())


def test_excepthook_ignores_sigterm_once_reporting(tmp_path: Path) -> None:
    """A rank that is printing why it exits is not cut off by the launcher's SIGTERM."""
    script = write_script(tmp_path, HOOKED)
    result = subprocess.run(
        [sys.executable, str(script), "hook-then-sigterm"],
        env={**os.environ, "TRIORING_RUN_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] == "True"


CRASH = """
    import numpy as np, trio, trioring

    async def main():
        async with trioring.open_communicator() as comm:
            x = np.ones(1000)
            for step in range(10):
                if comm.rank == 2 and step == 3:
                    raise ValueError("bad batch on rank 2")
                await comm.allreduce(x)

    trio.run(main)
"""


CRASH_IN_SPLIT = """
    import numpy as np, trio, trioring

    async def main():
        async with trioring.open_communicator() as comm:
            x = np.ones(1000)
            async with comm.split(color=comm.rank % 2) as half:
                for step in range(10):
                    if comm.rank == 2 and step == 3:
                        raise ValueError("bad batch on rank 2")
                    await half.allreduce(x)
            await comm.barrier()

    trio.run(main)
"""


BAD_CALL = """
    import numpy as np, trio, trioring

    async def main():
        async with trioring.open_communicator() as comm:
            x = np.ones(1000)
            for step in range(10):
                await comm.allreduce(x, op="average" if comm.rank == 2 and step == 3 else "sum")

    trio.run(main)
"""
#: What rank 2 raises, as its traceback's last line ends and as its peers' reason says.
RAISED = {
    "world": "ValueError: bad batch on rank 2",
    "split": "ValueError: bad batch on rank 2",
    "bad call": "InvalidArgumentError: rank 2: allreduce #4: unknown op 'average'",
}


@pytest.mark.parametrize(
    ("script_text", "case"),
    [(CRASH, "world"), (CRASH_IN_SPLIT, "split"), (BAD_CALL, "bad call")],
    ids=["world", "split", "bad-call"],
)
def test_a_crash_on_one_rank_of_four_is_reported_once(
    tmp_path: Path, script_text: str, case: str
) -> None:
    """Rank 2 raises between collectives while the others wait in one with it (in the world,
    or in the half of a split that it shares with rank 0, where it is rank 1), or makes a
    call that raises before any I/O (a trioring error, which carries the job id). The output
    is rank 2's traceback, at most one line for each other rank, and the launcher's summary,
    which names rank 2 as the first failure and says what became of every other rank."""
    script = write_script(tmp_path, script_text)
    started = time.monotonic()
    # A long grace period: rank 2 is never stopped before it has reported, however slow.
    result = run_launcher(tmp_path, "-n", "4", "--tag-output", "--grace", "30", str(script))
    assert time.monotonic() - started < DEADLINE_S
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.stderr
    assert "[2] Traceback (most recent call last):" in lines
    raised = RAISED[case]
    assert any(
        line.startswith(f"[2] {raised}") or line.startswith(f"[2] trioring.{raised}")
        for line in lines
    ), result.stderr
    for rank in (0, 1, 3):
        own = [line for line in lines if line.startswith(f"[{rank}] ")]
        assert len(own) <= 1, result.stderr
        for line in own:
            assert line.endswith("this error only reports that rank 2 failed]"), line
            assert f"it left its communicator on {raised}" in line, line
            # The reason leaves out rank 2's job id: the line has its own.
            assert line.count("[job ") == 1, line
            if script_text is CRASH_IN_SPLIT and rank == 0:
                # Its error names rank 2 as the half's rank 1, and says so.
                assert "rank 1 aborted" in line, line
                assert "as world ranks: 0->0, 1->2]" in line, line
    summary = re.fullmatch(
        r"trioring run: rank 2 exited with code 1 \(first failure\); (.*)", lines[-1]
    )
    assert summary is not None, result.stderr
    # Every other rank is accounted for: failed because of rank 2, or terminated.
    assert sorted(int(n) for n in re.findall(r"\d+", summary.group(1))) == [0, 1, 3], lines[-1]
    assert len(lines) < 25, result.stderr


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        (
            {0: "a", 1: "a", 2: "b", 3: "a"},
            "rank 2's call differs from the other ranks' (rank 2: b; ranks 0, 1, 3: a)",
        ),
        (
            {0: "a", 1: "b", 2: "c", 3: "a", 4: "a"},
            "the calls of ranks 1, 2 differ from the other ranks' (rank 1: b; rank 2: c; ranks 0, 3, 4: a)",
        ),
        # One rank against one, a tie, or all alike: the reports cannot tell.
        ({0: "a", 1: "b"}, None),
        ({0: "a", 1: "a", 2: "b", 3: "b"}, None),
        ({0: "a", 1: "a"}, None),
        ({}, None),
    ],
)
def test_whose_call_differs(calls: dict[int, str], expected: str | None) -> None:
    assert odd_calls(calls) == expected


def test_a_mismatch_reports_its_calls_by_world_rank() -> None:
    """A mismatch in a sub-communicator names its own ranks: trioring run is told world ranks."""
    error = trioring.CollectiveMismatchError("m", calls={0: "x", 1: "y"}, rank=0, peer=1)
    assert mismatched_calls(error) == {"0": "x", "1": "y"}
    error._trioring_world_ranks = (3, 5)
    assert mismatched_calls(ExceptionGroup("g", [error])) == {"3": "x", "5": "y"}
    error._trioring_world_ranks = (3,)  # ranks it cannot map: nothing rather than wrong
    assert mismatched_calls(error) == {}
    assert mismatched_calls(ValueError("v")) == {}


def test_a_relayed_mismatch_carries_this_ranks_own_call() -> None:
    """A rank that learns of a mismatch from a peer's abort frame knows one call of it, its
    own: it tells trioring run so, which can then count it with the ranks that agree."""
    spec = OpSpec(Kind.BROADCAST, 3, DTYPE_CODES[np.dtype(np.float64)], 16, 0, 0)
    error = abort_error(1, 0, spec, AbortKind.MISMATCH, 0, 3, "rank 0: ..., rank 3: ...", 0)
    assert isinstance(error, trioring.CollectiveMismatchError)
    assert error.calls == {1: "broadcast(root=0) float64[16] #3"}
    assert echoed_ranks(error) == frozenset({0})
    assert mismatched_calls(error) == {"1": "broadcast(root=0) float64[16] #3"}
