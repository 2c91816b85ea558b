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


def _run_world(tmp_path: Path, n: int, transport: str, **env: str) -> list[dict[str, object]]:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "trioring", "run", "-n", str(n)),
            *("--transport", transport, "--no-tag-output", str(WORKER)),
        ],
        env=clean_env(**env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S - 10,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == list(range(n)), result.stdout[-2000:]
    for report in reports:
        assert report["world_size"] == n
        assert report["allreduce_ok"], report
        assert report["broadcast_ok"], report
    # "cma" and "shm" are agreed on at opening, identically by every rank ("spin" is local).
    assert len({tuple(f for f in r["features"] if f != "spin") for r in reports}) == 1  # type: ignore[attr-defined]
    return reports


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S)
@pytest.mark.parametrize("n", [64, 128])
def test_large_world_over_unix_sockets(tmp_path: Path, n: int) -> None:
    # 64: the most ranks whose segment comes with eventfds (WAKER_MAX_RANKS); 128: without.
    reports = _run_world(tmp_path, n, "unix")
    assert {"cma", "shm"} <= set(reports[0]["features"])  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S)
def test_64_ranks_without_the_one_host_paths(tmp_path: Path) -> None:
    reports = _run_world(tmp_path, 64, "unix", TRIORING_SHM="0", TRIORING_CMA="0")
    assert not {"cma", "shm"} & set(reports[0]["features"])  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S)
def test_64_ranks_over_tcp(tmp_path: Path) -> None:
    _run_world(tmp_path, 64, "tcp")
