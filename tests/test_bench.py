"""`trioring bench` end to end: runs, checks every result, and reports a full table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import trioring
from launched import load_module
from trioring._bench import format_size, parse_sizes
from trioring._bench_cases import CASES


def test_parse_sizes() -> None:
    assert parse_sizes("4:64M") == [4 * 4**i for i in range(13)]
    assert parse_sizes("4,4K,1M") == [4, 4096, 1024**2]
    assert parse_sizes("1KiB,2MB") == [1024, 2 * 1024**2]
    assert [format_size(s) for s in (4, 4096, 1024**2, 3000)] == ["4", "4K", "1M", "3000"]
    with pytest.raises(ValueError, match="not a size"):
        parse_sizes("lots")


@pytest.mark.parametrize(
    ("nprocs", "transport", "back_to_back"), [(2, "unix", False), (3, "tcp", True)]
)
def test_bench_runs_and_checks_results(
    tmp_path: Path, nprocs: int, transport: str, back_to_back: bool
) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "trioring", "bench", "-n", str(nprocs)),
            *("--transport", transport, "--sizes", "4,64K", "--json", str(out)),
            *(["--back-to-back"] if back_to_back else []),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["collective"], r["size"]) for r in rows] == [
        ("allreduce", 4),
        ("allreduce", 65536),
        ("broadcast", 4),
        ("broadcast", 65536),
        ("barrier", 0),
    ]
    for row in rows:
        assert row["errors"] == 0
        assert row["world_size"] == nprocs
        assert row["transport"] == transport
        assert row["back_to_back"] is back_to_back
        assert 0 < row["p10_us"] <= row["median_us"] <= row["p90_us"]
    assert "busbw GB/s" in result.stdout


@pytest.mark.parametrize(("nprocs", "transport"), [(3, "unix"), (4, "tcp")])
def test_bench_times_and_checks_every_collective(
    tmp_path: Path, nprocs: int, transport: str
) -> None:
    """``--collective all``: every collective runs, its results checked on every rank, and
    the sizes are nccl-tests' (the larger of one rank's buffers, rounded down to whole
    blocks of ``nprocs`` elements where the collective splits it)."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "trioring", "bench", "-n", str(nprocs), "--sizes", "4,4K"),
            *("--transport", transport, "--collective", "all", "--op", "max", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["results"]
    whole = {"allreduce", "broadcast", "reduce", "scan", "exscan"}
    expected = []
    for name, case in CASES.items():
        if name == "barrier":
            sizes = [0]
        elif name in whole:
            sizes = [4, 4096]
        else:  # blocks of 1024 // nprocs float32s, at least one
            sizes = [4 * nprocs, 4 * nprocs * (1024 // nprocs)]
        expected += [(name, size, "max" if case.reduces else None) for size in sizes]
    assert [(row["collective"], row["size"], row["op"]) for row in rows] == expected
    assert all(row["errors"] == 0 for row in rows)


def _run_bench_script(name: str, ranks: int, *args: str) -> str:
    """``bench/<name>`` under ``trioring run -n ranks --tag-output``; its output, once it
    has exited 0."""
    script = Path(__file__).resolve().parents[1] / "bench" / name
    result = subprocess.run(
        [
            *(sys.executable, "-m", "trioring", "run", "-n", str(ranks), "--tag-output"),
            *(str(script), *args),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_reuse_script_runs() -> None:
    """bench/reuse.py, briefly: both ways run, every result is checked (a wrong one exits
    non-zero), and rank 0 reports each size."""
    stdout = _run_bench_script("reuse.py", 2, "--sizes", "4K,1M", "--calls", "6")
    for size in ("4K", "1M"):
        line = f"allgather {size}, world 2: new array "
        assert any(line in row and " us, out= " in row for row in stdout.splitlines()), stdout


def test_p2p_script_runs() -> None:
    """bench/p2p.py, briefly: the ping-pong checks every echo (a wrong one exits non-zero)
    and rank 0 reports every size, in its table and as the JSON that bench/p2p_compare.py
    reads."""
    stdout = _run_bench_script("p2p.py", 2, "2")
    line = next(row for row in stdout.splitlines() if "P2P-RESULTS " in row)
    medians = json.loads(line.split("P2P-RESULTS ", 1)[1])
    sizes = [8, 1024, 64 * 1024, 256 * 1024, 1024**2, 1024**2 + 8, 16 * 1024**2]
    assert [int(size) for size in medians] == sizes, medians
    assert all(seconds > 0 for seconds in medians.values()), medians


def test_imbalance_script_runs() -> None:
    """bench/imbalance.py, briefly: it runs and its results are right."""
    stdout = _run_bench_script(
        "imbalance.py", 3, "--calls", "12", "--rounds", "1", "--work-ms", "0.2"
    )
    assert "turns:" in stdout, stdout


def test_percall_script_runs() -> None:
    """bench/percall.py reaches into the communicator's internals to time its layers apart:
    a short run keeps it in step with them (and checks its results)."""
    stdout = _run_bench_script("percall.py", 2, "--calls", "30")
    for rank in (0, 1):
        assert f"rank {rank}: ladder" in stdout, stdout
        assert f"rank {rank}: phases" in stdout, stdout
    assert stdout.count("the schedule point where taken after the reduction") == 2, stdout


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_critical_path_script_runs(collective: str) -> None:
    """bench/critical_path.py wraps the shared segment's steps in timers: a short run keeps
    it in step with them (and checks the results, which it does on every call). Every mark
    of a broadcast and a reduce is met on both ranks, and none is lost to the barrier
    between calls, which goes through the same steps. Each call's one schedule point is
    timed too (in its wait or before it returns), and the per-rank summaries are printed."""
    stdout = _run_bench_script(
        "critical_path.py", 2, "--collective", collective, "--size", "64K", "--calls", "20"
    )
    marks = ("start", "run", "claim>", "claim<", "publish>", "publish<", "wait>", "wait<")
    for rank in (0, 1):
        lines = [line for line in stdout.splitlines() if f"rank {rank}: {collective}" in line]
        assert len(lines) == 1, stdout
        assert all(f" {mark} " in lines[0] for mark in (*marks, "done", "point>")), lines[0]
        fields = lines[0].split("the later start: ")[1].split()
        times = {fields[i]: float(fields[i + 1]) for i in range(0, len(fields), 2)}
        assert times["claim>"] <= times["claim<"] <= times["publish>"] <= times["wait<"], times
        assert times["point>"] <= times["point<"] <= times["end"], times
        assert f"rank {rank}: its wait ended " in stdout, stdout
        assert f"rank {rank}: the schedule point took " in stdout, stdout
    assert "the ranks started " in stdout, stdout


def test_placement_script_runs() -> None:
    """bench/placement.py, briefly: every call counted after the first twelfth falls in
    one placement, each placement accounts for every rank, and the blocks are printed."""
    stdout = _run_bench_script(
        "placement.py", 3, "--collective", "allreduce", "--size", "4K", "--calls", "24"
    )
    lines = stdout.splitlines()
    assert any("allreduce 4096 B, world 3, 22 calls," in line for line in lines), stdout
    rows = [line.split("] ", 1)[-1] for line in lines if " calls, median " in line]
    assert rows, stdout
    counted = 0
    for row in rows:
        where, rest = row.rsplit(":", 1)
        counted += int(rest.split()[0])
        assert sum(int(part) for part in where.split("(")[0].strip().split("+")) == 3, row
    assert counted == 22, stdout
    assert any("blocks of 40 calls, in order: " in line for line in lines), stdout


@pytest.mark.parametrize("collective", ["allgather", "gather", "scatter", "alltoall"])
def test_phases_script_runs(collective: str) -> None:
    """bench/phases.py wraps three functions of the cross-memory attach path in timers: a
    short run of each collective it covers keeps it in step with them (and checks the
    results, which it does on every call)."""
    if not trioring.is_available("cma"):
        pytest.skip(f"cma is not available here: {trioring.capabilities()}")
    stdout = _run_bench_script(
        "phases.py", 2, "--collective", collective, "--size", "64K", "--calls", "10"
    )
    for rank in (0, 1):
        lines = [line for line in stdout.splitlines() if f"rank {rank}: {collective}" in line]
        assert len(lines) == 1, stdout
        assert "by cma, world 2" in lines[0], stdout
        assert all(f" {phase} " in lines[0] for phase in ("before", "expose", "read", "finish"))


def _run_forking_script(name: str, *args: str, timeout: float) -> str:
    """``bench/<name>``, a script that forks its ranks itself; its output, once it has
    exited 0. In its own session, so that if it overruns, its forked ranks (which poll for
    a peer that never comes) go down with it."""
    script = Path(__file__).resolve().parents[1] / "bench" / name
    process = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"bench/{name} overran its deadline:\n{stdout}{stderr}")
    assert process.returncode == 0, stdout + stderr
    return stdout


def test_slot_lines_script_runs() -> None:
    """bench/slot_lines.py, briefly: its two forked processes check every reduction (a wrong
    one, or a peer that stalls, exits non-zero) and it reports every measurement per size."""
    stdout = _run_forking_script("slot_lines.py", "--kib", "1,64", "--rounds", "40", timeout=60)
    lines = stdout.splitlines()
    assert [line.split(",")[0] for line in lines] == ["1 KiB", "64 KiB"], stdout
    for name in ("copy into the slot", "copy into unread memory", "slots", "array"):
        assert all(f" {name} " in line for line in lines), stdout


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_floor_worker_results(ranks: int) -> None:
    """bench/_floor_worker.py, the floor that bench/paired.py times beside trioring and Open
    MPI, is only a floor if it does the whole work: forked ranks run every collective at
    three sizes up to its 256 KiB slot, and at two above it by bench/_copy_floor.py's
    single copies (odd counts, one across its reductions' chunks), back to back, both as
    plain calls and as Trio calls with their schedule point (paired.py's fourth side), and
    it fails on any wrong result or a rank that does not finish."""
    stdout = _run_forking_script(
        "_floor_worker.py", "--check", str(ranks), "--seconds", "30", timeout=45
    )
    assert f"world {ranks}: every result right" in stdout, stdout
    # Forked siblings may read each other's memory unless Yama says otherwise.
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if not scope.exists() or scope.read_text().strip() == "0":
        assert "single copies (process_vm_readv): checked" in stdout, stdout


def _paired_cell(
    collective: str, n: int, size: int, ratio: float, floor: tuple[float, float] | None
) -> dict[str, object]:
    """A cell as bench/paired.py writes it (Open MPI at 10 us), with the floor with its
    schedule point at (median, best window) times Open MPI's."""
    cell: dict[str, object] = {
        "collective": collective,
        "world_size": n,
        "size": size,
        "transport": "unix",
        "trioring_us": 10.0 * ratio,
        "mpi_us": 10.0,
        "ratio": ratio,
        "ratio_min": ratio * 0.9,
        "ratio_max": ratio * 1.1,
    }
    if floor is not None:
        cell["floor_trio_ratio"], cell["floor_trio_ratio_min"] = floor
    return cell


def test_verdicts_judge_each_miss_by_the_floor() -> None:
    """bench/verdicts.py, which the performance page's table of misses comes from: a met
    target, a miss the floor with its schedule point proves (past the target in every
    window), one at the edge (past it in the median only), one with room (the floor meets
    it), one the floor does not bound (trioring beat its best window), and one without a
    floor; the summary counts them, and the misses with room come first, least over first."""
    verdicts = load_module(
        "bench_verdicts", Path(__file__).resolve().parents[1] / "bench" / "verdicts.py"
    )
    limit = 1.0
    cases = {
        "met": (0.9, (0.5, 0.4)),
        "proven": (2.0, (1.5, 1.2)),
        "edge": (2.0, (1.2, 0.9)),
        "room": (1.5, (0.8, 0.7)),
        "not bounded": (1.1, (1.4, 1.2)),
        "not measured": (1.5, None),
    }
    for expected, (ratio, floor) in cases.items():
        cell = _paired_cell("broadcast", 2, 65536, ratio, floor)
        assert verdicts.verdict(cell, limit) == expected, expected
    # Trioring a little faster than the floor's median but not than its best window: the
    # same single copies, within the floor's own spread, so still proven.
    close = _paired_cell("gather", 4, 4 * 1024**2, 1.46, (1.50, 1.42))
    assert verdicts.verdict(close, 0.8) == "proven"

    cells = [
        _paired_cell("broadcast", 2, 65536, 0.9, (0.5, 0.4)),  # met
        _paired_cell("broadcast", 4, 65536, 1.3, (0.8, 0.7)),  # room, 3 us over
        _paired_cell("allreduce", 2, 65536, 1.2, (0.8, 0.7)),  # room, 2 us over
        _paired_cell("allreduce", 4, 65536, 2.0, (1.5, 1.2)),  # proven
    ]
    text = verdicts.misses(cells)
    assert text.startswith(
        "1 of the 62 targets against Open MPI met in the same ranks; of the 61 missed, "
        "1 proven by the floor of the design with its schedule point, 0 at the edge, 0 not "
        "bounded by it, 2 with room, 58 not measured."
    ), text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "world" in line]
    assert [row.split(" | ")[0] for row in rows[:3]] == [
        "| allreduce 64 KiB, world 2",
        "| broadcast 64 KiB, world 4",
        "| allreduce 64 KiB, world 4",
    ]
    assert rows[0].endswith("| room | 12.0 | 10.0 | 2.0 |"), rows[0]
    assert not any("broadcast 64 KiB, world 2" in row for row in rows)
