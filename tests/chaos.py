"""Chaos trials: random collectives with one or two random faults, judged on every rank.

Each trial forks a world (2-4 ranks: Unix sockets with the one-host paths, without the
shared segment, or without any of them; or TCP on loopback) of ``workers/chaos_worker.py``, whose ranks draw
the same plan from the trial's seed: a few collectives, on the world or on a
sub-communicator made from it, in half the trials beside a ``dup()`` of the world running
calls of its own in another task, and one fault on one rank, in a third of the trials a
second on another, and in a third one call on a ``dup()`` made for it, where the fault
may land while the ranks make or close it (see the worker). The trial passes when

- every rank's process ends within ``TRIAL_S`` (no hang; the worker also bounds each call);
- every result a rank got before it raised is right (the worker checks them against numpy);
- every rank but the victims either completed every call, where no fault took effect
  (a victim's cancel came after its call had ended, or its kill after its last call), or
  raised a trioring error at or after the first faulty call that names a victim (``rank V``,
  V its rank in the communicator the calls ran on, in the message or its notes), or, as
  the failure model allows, a ``PeerFailedError`` that names another rank whose connection
  ended without a word about why (a rank that gave up because of the victim in the middle
  of a frame to this one can say nothing on that connection; the collectives then look on
  the others for the cause, for a while). Those are counted apart, as imprecise;
- on the communicator beside, every rank completed every call, or its call there was
  cancelled because its first task failed, or it raised a trioring error that names the
  victims or a rank whose call there was so cancelled (and, in the first communicator, an
  error may name such a rank too: it gave up there because its task beside failed).

``test_chaos.py`` runs a fixed set of seeds. To hunt with more, run it as a script::

    .venv/bin/python tests/chaos.py --trials 200 [--seed 1000] [--minutes 20]

which prints every failing trial (its seed, plan and what was wrong) and a summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launched import forked_world, free_ports, load_module

WORKER = Path(__file__).parent / "workers" / "chaos_worker.py"
#: Bound on one trial's world, from the first fork to the last exit.
TRIAL_S = 45.0
#: How a trial's ranks connect: Unix sockets with every one-host path this machine allows,
#: with no shared segment (cross-memory attach over frames, and sockets), or plain; TCP on
#: loopback (no one-host paths: a reset often stands in for the end of a connection there).
VARIANTS: dict[str, dict[str, str]] = {
    "onehost": {},
    "no-shm": {"TRIORING_SHM": "0"},
    "plain": {"TRIORING_SHM": "0", "TRIORING_CMA": "0"},
    "tcp": {"TRIORING_TRANSPORT": "tcp", "MASTER_ADDR": "127.0.0.1"},
}
#: Worlds started again when rank 0 found the TCP port taken (by another program: the port
#: was free a moment before).
_PORT_TRIES = 3

if str(WORKER.parent) not in sys.path:
    sys.path.insert(0, str(WORKER.parent))  # the worker imports _worker_util beside it
_worker = load_module("trioring_tests_chaos_worker", WORKER)


def trial_params(seed: int) -> tuple[int, str]:
    """The world size and variant of trial ``seed``."""
    return 2 + seed % 3, list(VARIANTS)[(seed // 3) % len(VARIANTS)]


def run_trial(seed: int, out_dir: Path) -> tuple[list[str], list[str], dict[str, Any]]:
    """Run trial ``seed`` in ``out_dir``; what was wrong (empty: it passed), what was
    imprecise (see the module's docstring), and its plan."""
    n, variant = trial_params(seed)
    plan = _worker.plan(seed, n)
    for _ in range(_PORT_TRIES):
        env = dict(VARIANTS[variant])
        if "MASTER_ADDR" in env:
            env["MASTER_PORT"] = str(free_ports())
        codes, _ = forked_world(WORKER, [str(out_dir), str(seed)], out_dir, n, env, timeout=TRIAL_S)
        reports = {}
        for rank in range(n):
            path = out_dir / f"w{rank}.json"
            reports[rank] = json.loads(path.read_text()) if path.exists() else None
        if not any(_port_taken(report) for report in reports.values()):
            break
        for path in out_dir.glob("w*.json"):
            path.unlink()
    wrong, imprecise = judge(plan, n, codes, reports)
    return wrong, imprecise, {"n": n, "variant": variant, **plan}


def _port_taken(report: dict[str, Any] | None) -> bool:
    """Whether a rank's report says that its communicator could not open because the
    rendezvous port was taken."""
    error = report and report.get("error")
    return bool(error and error["type"] == "RendezvousError" and error["address_in_use"])


#: What a PeerFailedError says of a connection that ended without a word about why: the
#: collectives' words, and the point-to-point messages'.
_CONNECTION_ENDED = ("was closed by the peer", "its connection ended")


def _text(error: dict[str, Any]) -> str:
    return "\n".join([f"{error['type']}: {error['message']}", *error["notes"]])


def judge(
    plan: dict[str, Any],
    n: int,
    codes: dict[int, int | None],
    reports: dict[int, dict[str, Any] | None],
) -> tuple[list[str], list[str]]:
    """What was wrong with a trial's ending, given each rank's exit code and report, and
    what was imprecise."""
    wrong: list[str] = []
    imprecise: list[str] = []
    faults = _worker.faults(plan)
    for rank, code in codes.items():
        if code is None:
            wrong.append(f"rank {rank} still ran after {TRIAL_S:.0f} s: a hang")
    # Whether the others may complete every call: every fault came too late to matter.
    finished = True
    for victim, fault in faults.items():
        report = reports[victim]
        kills = fault["fault"] in ("kill", "kill_before")
        if codes[victim] not in ((0, -signal.SIGKILL, None) if kills else (0, None)):
            wrong.append(f"the victim, rank {victim}, exited with {codes[victim]}")
        if fault["fault"] == "kill":
            finished &= codes[victim] == 0 or bool(report and report.get("final"))
        elif fault["fault"] == "cancel":
            finished &= bool(report and not report.get("cancelled"))
        else:
            finished = False
        error = report and report.get("error")
        if (
            error
            and not report.get("raised")
            and (not error["trioring"] or error["type"] == "TooSlowError")
        ):
            wrong.append(f"the victim, rank {victim}, raised {_text(error)}")
    # The ranks that gave up in each communicator: the victims, and the ranks whose call
    # there was cancelled because their task beside failed. Errors may name any of them.
    gave_up = set(faults) | _cancelled(reports, None)
    beside_gave_up = set(faults) | _cancelled(reports, "beside")
    for rank in range(n):
        if rank in faults or codes[rank] is None:
            continue
        report = reports[rank]
        if codes[rank] != 0 or report is None:
            wrong.append(f"rank {rank} exited with {codes[rank]} (report: {report is not None})")
            continue
        _judge_first(plan, n, rank, report, finished, gave_up, wrong, imprecise)
    if plan["beside"]:
        _judge_beside(plan, codes, reports, beside_gave_up, wrong, imprecise)
    return wrong, imprecise


def _cancelled(reports: dict[int, dict[str, Any] | None], key: str | None) -> set[int]:
    """The ranks whose call in the first communicator (``key`` None) or the one beside it
    was cancelled because their other task failed."""
    return {
        rank
        for rank, report in reports.items()
        if report and "cancelled_at" in (report.get(key, {}) if key else report)
    }


def _judge_first(
    plan: dict[str, Any],
    n: int,
    rank: int,
    report: dict[str, Any],
    finished: bool,
    gave_up: set[int],
    wrong: list[str],
    imprecise: list[str],
) -> None:
    """Judge how the calls on the first communicator ended on ``rank``, not a victim."""
    faults = _worker.faults(plan)
    victims = set(faults)
    at = min(fault["at"] for fault in faults.values())  # the first call a fault can touch
    # The rank where the calls ran (errors name that rank, and add a note that maps a
    # split's ranks to the world's); an error while the split was made names world ranks.
    reversed_ranks = plan["comm"] == "reversed"
    error = report.get("error")
    if "cancelled_at" in report:
        if not report.get("beside", {}).get("error"):
            wrong.append(
                f"rank {rank}'s call {report['cancelled_at']} was cancelled, not by its task beside"
            )
        return
    if error is None:
        if report.get("completed") != len(plan["calls"]) + 1:
            wrong.append(f"rank {rank} neither completed nor raised")
        elif not finished:
            wrong.append(f"rank {rank} completed every call, but a fault took effect")
        return
    text = _text(error)
    where = report.get("failed_at", "close")
    first_open = plan["comm"] == "world" and not plan["beside"]
    named = {q for q in gave_up if q != rank}
    cascades = named - victims
    if where == "open":
        named = victims
    elif reversed_ranks:
        named = {n - 1 - q for q in named}
        cascades = {n - 1 - q for q in cascades}
    said = any(f"rank {q}" in text for q in named)
    # A rank that gave up because of its task beside may fail a call before the faults'.
    cascade = any(f"rank {q}" in text for q in cascades)
    if error["type"] == "TooSlowError":
        wrong.append(f"rank {rank} hung in call {where}: {text}")
    elif not error["trioring"]:
        wrong.append(f"rank {rank} raised a non-trioring error in call {where}: {text}")
    elif where == "open" and (at or first_open):
        wrong.append(f"rank {rank} raised while it opened its communicators: {text}")
    elif where == "close" or (where != "open" and where < at and not cascade):
        wrong.append(f"rank {rank} raised in call {where}, before the fault: {text}")
    elif not said:
        (imprecise if _lost(error) else wrong).append(
            f"rank {rank}'s error does not name any of ranks {sorted(named)} (the victims "
            f"are {sorted(victims)} in the world): {text}"
        )


def _judge_beside(
    plan: dict[str, Any],
    codes: dict[int, int | None],
    reports: dict[int, dict[str, Any] | None],
    gave_up: set[int],
    wrong: list[str],
    imprecise: list[str],
) -> None:
    """Judge how the calls on the communicator beside the first (a ``dup()`` of the world:
    the same ranks) ended on every rank: completed, cancelled by a failure of the rank's
    first communicator, or raised naming a rank that gave up there."""
    faults = _worker.faults(plan)
    last = len(plan["beside"]) + 1
    # A victim killed before it began the final barrier beside never published it.
    killed_early = [
        victim
        for victim in faults
        if codes[victim] == -signal.SIGKILL
        and not (reports[victim] or {}).get("beside", {}).get("final")
    ]
    for rank, code in codes.items():
        report = reports[rank]
        if code != 0 or report is None:
            continue  # the victim killed, or judged above
        entry = report.get("beside", {})
        error = entry.get("error")
        if "cancelled_at" in entry:
            if not (report.get("error") or report.get("raised")):
                wrong.append(
                    f"rank {rank}'s call {entry['cancelled_at']} beside was cancelled, not by its first task"
                )
        elif error is not None:
            text = _text(error)
            where = entry["failed_at"]
            named = gave_up - {rank}
            if error["type"] == "TooSlowError":
                wrong.append(f"rank {rank} hung in call {where} beside: {text}")
            elif not error["trioring"]:
                wrong.append(
                    f"rank {rank} raised a non-trioring error in call {where} beside: {text}"
                )
            elif not any(f"rank {q}" in text for q in named):
                (imprecise if _lost(error) else wrong).append(
                    f"rank {rank}'s error in call {where} beside does not name any of ranks "
                    f"{sorted(named)}: {text}"
                )
        elif entry.get("completed") != last:
            wrong.append(f"rank {rank} neither completed nor raised beside")
        elif killed_early:
            wrong.append(
                f"rank {rank} completed every call beside, but rank {killed_early[0]} was "
                "killed before the last"
            )


def _lost(error: dict[str, Any]) -> bool:
    """Whether ``error`` is a PeerFailedError saying that a connection ended without a word
    about why (see the module's docstring)."""
    return error["type"] == "PeerFailedError" and any(
        said in error["message"] for said in _CONNECTION_ENDED
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the first trial's seed")
    parser.add_argument("--minutes", type=float, default=30.0, help="stop starting trials after")
    parser.add_argument("--keep", type=Path, help="keep failing trials' directories here")
    args = parser.parse_args()
    stop = time.monotonic() + args.minutes * 60
    failed = ran = vague = 0
    for seed in range(args.seed, args.seed + args.trials):
        if time.monotonic() > stop:
            break
        out_dir = Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
        started = time.monotonic()
        wrong, imprecise, plan = run_trial(seed, out_dir)
        ran += 1
        vague += bool(imprecise)
        took = time.monotonic() - started
        for line in imprecise:
            print(f"VAGUE seed {seed}: {line}", flush=True)
        if wrong:
            failed += 1
            print(f"FAIL seed {seed} ({took:.1f} s): {json.dumps(plan)}", flush=True)
            for line in wrong:
                print("   ", line.replace("\n", "\n      "), flush=True)
            if args.keep:
                shutil.copytree(out_dir, args.keep / f"seed{seed}", dirs_exist_ok=True)
        else:
            print(
                f"ok   seed {seed} ({took:.1f} s) n={plan['n']} {plan['variant']} {plan['comm']} "
                f"{plan['fault']}@{plan['at']} {[c['collective'] for c in plan['calls']]}"
                + ("" if plan["dup_at"] is None else f" dup@{plan['dup_at']}")
                + (
                    f" beside {[c['collective'] for c in plan['beside']]}" if plan["beside"] else ""
                ),
                flush=True,
            )
        shutil.rmtree(out_dir, ignore_errors=True)
    print(f"{ran} trials, {failed} failed, {vague} imprecise", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
