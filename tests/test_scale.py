"""Large worlds on one host: 64 and 128 processes under ``trioring run`` (2 cores are enough;
they only take a while). Machines with 64-192 cores are common, and every world size up to
there must open and compute correctly.

Regression: 64 ranks used to fail in every try, with "expected the shared segment's frame
during setup" or connections reset, also with the one-host paths off: set-up waits on an
oversubscribed machine outlast the 20 ms after which a waiting link watches the others for
abort frames by reading their frames ahead, and the watch took the frame that the set-up then
read straight off the socket.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clean_env import clean_env

WORKER = Path(__file__).parent / "workers" / "scale_worker.py"
#: 128 ranks take about 40 s on 2 busy cores (most of it starting 128 interpreters).
DEADLINE_S = 240


def _run_world(tmp_path: Path, n: int, *modes: str) -> dict[str, list[dict[str, object]]]:
    """Launch ``n`` ranks over Unix sockets, each opening the communicators of ``modes`` (see
    the worker); return each mode's reports, checked."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "trioring", "run", "-n", str(n)),
            *("--transport", "unix", "--no-tag-output", str(WORKER), *modes),
        ],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S - 10,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_mode: dict[str, list[dict[str, object]]] = {}
    for mode in modes:
        reports = by_mode[mode] = [r for r in lines if r["mode"] == mode]
        assert sorted(r["rank"] for r in reports) == list(range(n)), (mode, result.stdout[-2000:])
        for report in reports:
            assert report["world_size"] == n
            assert report["allreduce_ok"], report
            assert report["broadcast_ok"], report
        # "cma" and "shm" are agreed on at opening, identically by every rank ("spin" is
        # local).
        assert len({tuple(f for f in r["features"] if f != "spin") for r in reports}) == 1  # type: ignore[attr-defined]
    return by_mode


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S)
def test_64_ranks_with_and_without_the_one_host_paths_and_over_tcp(tmp_path: Path) -> None:
    # 64: the most ranks whose segment comes with eventfds (WAKER_MAX_RANKS). The three
    # communicators are open at once in each rank, about 200 connections per rank.
    reports = _run_world(tmp_path, 64, "unix", "plain", "tcp")
    assert {"cma", "shm"} <= set(reports["unix"][0]["features"])  # type: ignore[arg-type]
    assert not {"cma", "shm"} & set(reports["plain"][0]["features"])  # type: ignore[arg-type]
    assert {r["transport"] for r in reports["tcp"]} == {"tcp"}
    assert {r["transport"] for r in reports["unix"]} == {"unix"}


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S)
def test_128_ranks_over_unix_sockets(tmp_path: Path) -> None:
    # Beyond WAKER_MAX_RANKS: a segment without eventfds, whose parked waits end on the timer.
    reports = _run_world(tmp_path, 128, "unix")
    assert {"cma", "shm"} <= set(reports["unix"][0]["features"])  # type: ignore[arg-type]
