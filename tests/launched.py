"""Run a worker script under ``trioring run`` and read the JSON report each rank wrote
(``rank{r}.json`` in ``out_dir``), for tests whose ranks all report the same way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

#: Bound on one launched world, start to exit.
TIMEOUT_S = 120


def run_reports(
    worker: Path,
    worker_args: Sequence[str],
    out_dir: Path,
    n: int,
    *,
    transport: str = "unix",
    env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``n`` ranks; every rank must exit 0. Its own process group, killed
    whole if it overruns."""
    args = [sys.executable, "-m", "trioring", "run", "-n", str(n), "--transport", transport]
    args += ["--no-tag-output", str(worker), *worker_args]
    process = subprocess.Popen(
        args,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def run_killed(
    worker: Path,
    worker_args: Sequence[str],
    out_dir: Path,
    victim: int,
    *,
    n: int = 4,
    env: Mapping[str, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """Run ``worker`` on ``n`` ranks over Unix sockets, one of which (``victim``) SIGKILLs
    itself; the launcher must report a failure and the victim must have written nothing.
    The survivors' reports (``rank{r}.json``), by rank."""
    args = [sys.executable, "-m", "trioring", "run", "-n", str(n), "--transport", "unix"]
    args += ["--no-tag-output", str(worker), *worker_args]
    process = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert process.returncode != 0, process.stdout + process.stderr
    assert not (out_dir / f"rank{victim}.json").exists()
    return {
        rank: json.loads((out_dir / f"rank{rank}.json").read_text())
        for rank in range(n)
        if rank != victim
    }
