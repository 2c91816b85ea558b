"""What a rank started by ``trioring run`` does differently: it reports failures that only
echo another rank's failure in one line, and tells the launcher so.

When one rank of a job fails, every other rank that was in a collective with it fails too,
with a :class:`~trioring.PeerFailedError` or :class:`~trioring.PeerAbortedError` naming it.
Printed in full, those tracebacks bury the one that matters (a crash on one rank of four
printed 130 lines and 9 tracebacks). So, in a process whose environment has
``TRIORING_RUN_DIR`` (which only the launcher sets), importing trioring wraps
:data:`sys.excepthook`:

* An uncaught exception that is such an echo (see :func:`echoed_ranks`) is printed as one
  line naming the error, its message and the rank it echoes, and the launcher is told,
  through a file ``<pid>.echo`` in ``TRIORING_RUN_DIR``, which ranks it blames. The launcher
  then waits for those ranks before naming the job's first failure, so the rank that really
  failed is named even when its peers exit before it (see ``_launcher._Supervisor``).
* Any other uncaught exception goes to the previous hook unchanged: the real failure keeps
  its full traceback. The launcher is told its one-line summary (type and message, through
  a file ``<pid>.error``), which it repeats beside its own summary of the job: with many
  ranks, the traceback that names what went wrong may be far above it.
* For a :class:`~trioring.CollectiveMismatchError`, seen or relayed, either file also
  carries the calls it names by world rank (a relayed one: this rank's own), from which the
  launcher tells whose call differs from the others'.
* A ``KeyboardInterrupt`` (Ctrl-C, which reaches every rank of a job started from a
  terminal) is printed as Python prints it, and the launcher is told nothing: it is no
  failure of the rank's own, and the rank exits by ``SIGINT``, which the launcher reads.
* Either way the process first ignores ``SIGTERM``: it is exiting already, and a ``SIGTERM``
  from the launcher stopping the job must not cut its report off half-way (the launcher's
  ``SIGKILL`` after the grace period still ends a rank that hangs in a hook).

A program that installs its own :data:`sys.excepthook` after importing trioring replaces ours;
its ranks then simply print and count as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import TYPE_CHECKING

from ._concurrency import first_leaf
from ._errors import CollectiveMismatchError, echoed_ranks, ranks_note, world_rank

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence
    from types import TracebackType

RUN_DIR_VARIABLE = "TRIORING_RUN_DIR"
ECHO_SUFFIX = ".echo"
ERROR_SUFFIX = ".error"
#: The longest error line handed to the launcher (a message may be long: a mismatch lists
#: every rank's call).
_ERROR_LINE_CHARS = 1000


def _ranks(ranks: Collection[int]) -> str:
    if len(ranks) == 1:
        return f"rank {next(iter(ranks))}"
    return "ranks " + ", ".join(map(str, sorted(ranks)))


def _summary(exc: BaseException) -> str:
    """The exception that says what ``exc`` is (see :func:`first_leaf`): its qualified type
    name and message, how many more like it there are, and the map of a sub-communicator's
    ranks where the error names them (the notes that carry it are not printed)."""
    leaf, count = first_leaf(exc)
    cls = type(leaf)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    more = f" (and {count - 1} more like it)" if count > 1 else ""
    note = ranks_note(leaf)
    mapped = f" [{note}]" if note else ""
    return f"{name}: {leaf}{more}{mapped}"


def error_line(exc: BaseException) -> str:
    """``exc`` in one line, as the launcher repeats it (see :func:`_summary`), at most
    ``_ERROR_LINE_CHARS`` long."""
    line = " ".join(_summary(exc).split())
    if len(line) > _ERROR_LINE_CHARS:
        line = line[: _ERROR_LINE_CHARS - 3] + "..."
    return line


def mismatched_calls(exc: BaseException) -> dict[str, str]:
    """For a :class:`~trioring.CollectiveMismatchError` (the first failure in ``exc``), each
    side's call by world rank (as JSON keys); empty for anything else."""
    leaf, _ = first_leaf(exc)
    if not isinstance(leaf, CollectiveMismatchError):
        return {}
    calls = {}
    for rank, call in leaf.calls.items():
        mapped = world_rank(leaf, rank)
        if mapped is None:
            return {}  # not ranks of that communicator: say nothing rather than wrong
        calls[str(mapped)] = call
    return calls


def note_calls(
    calls: dict[int, str], self_named: set[int], rank: int, named: Mapping[int, str]
) -> None:
    """Add to ``calls`` (rank -> its call) those that ``rank`` exited naming. Its own is
    the one it made, and replaces what a peer said of it; a peer's call it saw only in
    that peer's frames, where an uneven call (allgatherv, gatherv, alltoallv) carries its
    number of dimensions but not its shape: in those other words the same call would not
    group with the calls that the others named themselves (see :func:`odd_calls`).
    ``self_named``: the ranks whose own word is in ``calls``."""
    for peer, call in named.items():
        if peer != rank and peer not in self_named:
            calls[peer] = call
    if rank in named:
        calls[rank] = named[rank]
        self_named.add(rank)


def odd_calls(calls: Mapping[int, str]) -> str | None:
    """Whose call differs from the others', from every side of the mismatches the ranks
    reported (``calls``: rank -> its call): the ranks outside the one call that more ranks
    made than any other, if at least two made it; None where the reports cannot tell (a
    tie, or one rank against one)."""
    by_call: dict[str, list[int]] = {}
    for rank, call in sorted(calls.items()):
        by_call.setdefault(call, []).append(rank)
    if len(by_call) < 2:
        return None
    groups = sorted(by_call.items(), key=lambda item: -len(item[1]))
    (common, most), runner_up = groups[0], groups[1][1]
    if len(most) < 2 or len(most) == len(runner_up):
        return None
    odd = sorted(rank for _, ranks in groups[1:] for rank in ranks)
    whose = (
        f"rank {odd[0]}'s call differs" if len(odd) == 1 else f"the calls of {_ranks(odd)} differ"
    )
    others = "; ".join(f"{_ranks(ranks)}: {call}" for call, ranks in groups[1:])
    return f"{whose} from the other ranks' ({others}; {_ranks(most)}: {common})"


def left_early(echoes: Mapping[int, frozenset[int]], exits: Sequence[int | None]) -> list[str]:
    """What the launcher says of each rank that exited with code 0 while others failed
    waiting for it (``echoes``: rank -> the ranks its error only reports; ``exits``: each
    rank's exit code, None while running). Its exit was clean, so nothing else names it:
    a rank that returned early, or skipped a call the others made, closes its communicator
    under them."""
    lines = []
    for blamed in sorted(set().union(*echoes.values())):
        if 0 <= blamed < len(exits) and exits[blamed] == 0:
            waiting = [rank for rank, ranks in echoes.items() if blamed in ranks]
            lines.append(
                f"rank {blamed} exited with code 0 before {_ranks(waiting)}, which failed "
                "waiting for it"
            )
    return lines


def read_calls(run_dir: str, pid: int) -> dict[int, str]:
    """What the launcher reads of the calls, by world rank, of the mismatch that the
    process ``pid`` exited on (beside its error or its echo); empty if it named none."""
    calls: dict[int, str] = {}
    for suffix in (ERROR_SUFFIX, ECHO_SUFFIX):
        try:
            with open(os.path.join(run_dir, f"{pid}{suffix}"), encoding="utf-8") as file:
                named = json.load(file).get("calls", {})
            calls.update((int(rank), call) for rank, call in named.items() if type(call) is str)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return calls


def read_echo(run_dir: str, pid: int) -> frozenset[int] | None:
    """The ranks that the process ``pid`` said its failure only echoes (see :func:`install`), or
    None if it said nothing (a failure of its own, as far as we can tell)."""
    path = os.path.join(run_dir, f"{pid}{ECHO_SUFFIX}")
    try:
        with open(path, encoding="utf-8") as file:
            report = json.load(file)
        ranks = report["echoes"]
        if not (isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks)):
            return None
        return frozenset(ranks)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def read_error(run_dir: str, pid: int) -> str | None:
    """The one-line error that the process ``pid`` said it exited on (see :func:`install`), or
    None if it said none."""
    path = os.path.join(run_dir, f"{pid}{ERROR_SUFFIX}")
    try:
        with open(path, encoding="utf-8") as file:
            line = json.load(file)["error"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return line if isinstance(line, str) and line else None


def echo_line(exc: BaseException, ranks: frozenset[int]) -> str:
    return (
        f"{_summary(exc)} [traceback omitted by trioring run: this error only "
        f"reports that {_ranks(ranks)} failed]\n"
    )


def _ignore_sigterm() -> None:
    # Only the main thread may set handlers; the interpreter's final excepthook runs there.
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _tell_launcher(run_dir: str, suffix: str, report: dict[str, object]) -> None:
    # Named by pid, not rank: a process the rank started (inheriting its environment) never
    # speaks for it. Best effort: without an echo file, the launcher counts this rank's exit
    # as a failure of its own, which is what it did before; without an error file, it names
    # the failure without its message.
    path = os.path.join(run_dir, f"{os.getpid()}{suffix}")
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as file:
        json.dump(report, file)


def install() -> None:
    """Wrap :data:`sys.excepthook` as the module docstring says, if this process was started
    by ``trioring run``; otherwise do nothing. Idempotent."""
    run_dir = os.environ.get(RUN_DIR_VARIABLE, "").strip()
    if not run_dir or getattr(sys.excepthook, "_trioring_launched", False):
        return
    previous = sys.excepthook

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        _ignore_sigterm()
        if isinstance(exc, KeyboardInterrupt):
            # Ctrl-C, which a terminal sends to every rank and to the launcher alike: no
            # failure of this rank's own. It exits by SIGINT, which the launcher reads.
            previous(exc_type, exc, tb)
            return
        ranks = echoed_ranks(exc)
        # A mismatch's calls go with either report (a relayed one: this rank's own call).
        calls = mismatched_calls(exc)
        if ranks is None:
            report: dict[str, object] = {"error": error_line(exc)}
            if calls:
                report["calls"] = calls
            _tell_launcher(run_dir, ERROR_SUFFIX, report)
            previous(exc_type, exc, tb)
            return
        echo: dict[str, object] = {"echoes": sorted(ranks)}
        if calls:
            echo["calls"] = calls
        _tell_launcher(run_dir, ECHO_SUFFIX, echo)
        sys.stderr.write(echo_line(exc, ranks))
        sys.stderr.flush()

    excepthook._trioring_launched = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
