"""The ``trioring`` command line: ``trioring run``, ``trioring bench`` and ``trioring info``.

:func:`main` returns the process exit status instead of calling :func:`sys.exit`, so that the
console script (``trioring``) and ``python -m trioring`` share it and tests can call it.
Usage errors exit with status 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any

from trioring._bench_cases import CASES, DEFAULT_COLLECTIVES
from trioring._launcher import DEFAULT_GRACE, TRANSPORTS, LaunchSpec, run

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


def _nprocs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trioring", description="Trio-native collective communication for numpy arrays."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run_parser = commands.add_parser(
        "run",
        usage=(
            "%(prog)s -n N [--transport {unix,tcp}] [--grace SECONDS]\n"
            "       [--tag-output | --no-tag-output] [-m] [--] TARGET [ARGS...]"
        ),
        help="start N ranks of a Python script or module on this machine",
        description=(
            "Start N copies of a Python script (or module, with -m) with RANK, WORLD_SIZE, "
            "LOCAL_RANK, LOCAL_WORLD_SIZE and the rendezvous variables of the chosen transport "
            "set, and OMP_NUM_THREADS=1 when N > 1 and it is unset. If a rank fails, or the "
            "launcher gets SIGINT/SIGTERM/SIGHUP, the other ranks get SIGTERM, then SIGKILL "
            "after the grace period. Errors that only report another rank's failure print one "
            "line instead of a traceback. Exits with the first failing rank's status (128+N "
            "for signal N), or 0 when every rank succeeds."
        ),
    )
    run_parser.add_argument(
        "-n", "--nprocs", type=_nprocs, required=True, metavar="N", help="number of ranks"
    )
    run_parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="unix",
        help="unix: sockets in a private temporary directory (default); tcp: 127.0.0.1",
    )
    run_parser.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_GRACE,
        metavar="SECONDS",
        help=f"time between SIGTERM and SIGKILL when stopping ranks (default {DEFAULT_GRACE:g})",
    )
    tagging = run_parser.add_mutually_exclusive_group()
    tagging.add_argument(
        "--tag-output",
        dest="tag_output",
        action="store_true",
        default=None,
        help="prefix each line of output with [rank] (default: when N > 1 and stdout is a "
        "terminal)",
    )
    tagging.add_argument(
        "--no-tag-output",
        dest="tag_output",
        action="store_false",
        help="never prefix output; ranks write to the launcher's stdout/stderr directly",
    )
    run_parser.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="TARGET is a module name: run 'python -m TARGET ARGS...'",
    )
    # A flag rather than "-m MODULE" so that, as with "python -m", everything after the target
    # (options included) belongs to the program: REMAINDER only starts at the first positional.
    run_parser.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        metavar="[--] TARGET [ARGS...]",
        help="script path (or module name with -m) and its arguments",
    )
    run_parser.set_defaults(handler=functools.partial(_run, run_parser))

    bench_parser = commands.add_parser(
        "bench",
        help="benchmark the collectives on this machine (nccl-tests style)",
        description=(
            "Start N ranks on this machine and time the collectives over a range of sizes: "
            "median, p10 and p90 of the slowest rank per iteration, algorithm and bus "
            "bandwidth; every result is checked. Exits non-zero if any result was wrong."
        ),
    )
    bench_parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="start each timed call as soon as the last one returned and was checked; by "
        "default (like the OSU micro-benchmarks) a barrier after each check, outside the "
        "timed region, starts every call on all ranks together",
    )
    bench_parser.add_argument(
        "-n", "--nprocs", type=_nprocs, default=2, metavar="N", help="ranks to start (default 2)"
    )
    bench_parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="unix",
        help="unix (default; large arrays by cross-memory attach where available) or tcp",
    )
    bench_parser.add_argument(
        "--sizes",
        default="4:64M",
        help="LOW:HIGH in powers of 4 (default 4:64M), or a list like 4,4K,4M",
    )
    bench_parser.add_argument(
        "--collective",
        action="append",
        choices=(*CASES, "all"),
        help="collective to time (repeatable; 'all' for every one; default allreduce, "
        "broadcast and barrier). Sizes are nccl-tests': the larger of one rank's buffers",
    )
    bench_parser.add_argument(
        "--op",
        default="sum",
        choices=("sum", "mean", "min", "max", "prod", "band", "bor", "bxor"),
        help="reduce op of allreduce, reduce, reduce_scatter(v), scan and exscan (default sum)",
    )
    bench_parser.add_argument(
        "--dtype", default="float32", help="numpy dtype of the arrays (default float32)"
    )
    bench_parser.add_argument(
        "--json", metavar="FILE", help="also write the results as JSON to FILE ('-': stdout only)"
    )
    bench_parser.set_defaults(handler=_bench)

    info_parser = commands.add_parser(
        "info", help="show versions and the capability registry (which transports can run here)"
    )
    info_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info_parser.set_defaults(handler=_info)
    return parser


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    program: list[str] = list(args.program)
    # Some Python versions keep the "--" that separates launcher options from the target in
    # the REMAINDER list, some drop it. Only a leading one is ours; later ones are the target's.
    if program[:1] == ["--"]:
        program = program[1:]
    if not program:
        parser.error("missing TARGET (a script path, or a module name with -m)")
    if not args.module and not os.path.exists(program[0]):
        # Said once, rather than by every rank's interpreter.
        parser.error(f"no such script: {program[0]} (for a module, use -m)")
    spec = LaunchSpec.for_python(
        program[0],
        program[1:],
        module=args.module,
        nprocs=args.nprocs,
        transport=args.transport,
        grace=args.grace,
        tag_output=args.tag_output,
    )
    try:
        return run(spec)
    except OSError as exc:
        # Starting a rank failed (e.g. fds exhausted); every rank already started was killed.
        print(f"trioring run: cannot start ranks: {exc}", file=sys.stderr)
        return 1


def _collectives(chosen: list[str] | None) -> list[str]:
    if not chosen:
        return list(DEFAULT_COLLECTIVES)
    if "all" in chosen:
        return list(CASES)
    return list(dict.fromkeys(chosen))


def _bench(args: argparse.Namespace) -> int:
    from trioring._bench import parse_sizes

    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        print(f"trioring bench: {exc}", file=sys.stderr)
        return 2
    collectives = _collectives(args.collective)
    if args.op == "mean" and {"scan", "exscan"} & set(collectives):
        print(
            "trioring bench: scan and exscan have no 'mean' op; time them with another --op",
            file=sys.stderr,
        )
        return 2
    config = {
        "sizes": sizes,
        "collectives": collectives,
        "op": args.op,
        "dtype": args.dtype,
        "json": args.json,
        "json_only": args.json == "-",
        "progress": sys.stderr.isatty(),
        "back_to_back": args.back_to_back,
    }
    spec = LaunchSpec.for_python(
        "trioring._bench",
        module=True,
        nprocs=args.nprocs,
        transport=args.transport,
        tag_output=False,
    )
    os.environ["TRIORING_BENCH_CONFIG"] = json.dumps(config)
    return run(spec)


def _info_data() -> dict[str, Any]:
    # Imported here, not at module level: only "info" needs the core's public API, and the
    # launcher must keep working whatever state the rest of the package is in.
    import numpy
    import trio

    import trioring

    return {
        "versions": {
            "trioring": trioring.__version__,
            "trio": trio.__version__,
            "numpy": numpy.__version__,
            "python": platform.python_version(),
        },
        "capabilities": [
            {
                "name": cap.name,
                "kind": cap.kind,
                "available": cap.available,
                "reason": cap.reason,
                "description": cap.description,
            }
            for cap in trioring.capabilities()
        ],
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _describe(cap: dict[str, Any]) -> str:
    description = str(cap["description"])
    if not cap["available"] and cap["reason"]:
        return f"{description} [unavailable: {cap['reason']}]"
    return description


def _info(args: argparse.Namespace) -> int:
    data = _info_data()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    versions = data["versions"]
    print(
        _table(("component", "version"), [(name, str(value)) for name, value in versions.items()])
    )
    print()
    rows = [
        (cap["kind"], cap["name"], "yes" if cap["available"] else "no", _describe(cap))
        for cap in data["capabilities"]
    ]
    print(_table(("kind", "name", "available", "description"), rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)
