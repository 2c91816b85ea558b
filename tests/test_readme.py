"""What a new user runs first: the README's usage example and ``make demo``'s program, each
under ``trioring run`` on 4 ranks over Unix sockets, must run as shown and pass."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


#: Below pytest's 60 s limit, so that a run that stalls is reported with what its ranks
#: printed (pytest-timeout discards it); the demo takes 3.5 s here on an idle machine.
_LIMIT_SECONDS = 45


def _run(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trioring", "run", "-n", "4", "--transport", "unix"]
    with subprocess.Popen(
        [*command, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        # With PYTHONUNBUFFERED, print() writes a line and its newline separately, so the
        # lines of ranks that share the launcher's pipe could interleave mid-line.
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
    ) as launcher:
        try:
            stdout, stderr = launcher.communicate(timeout=_LIMIT_SECONDS)
        except subprocess.TimeoutExpired:
            # Ctrl-C, as a user would: the launcher stops every rank and says which.
            launcher.send_signal(signal.SIGINT)
            try:
                stdout, stderr = launcher.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                launcher.kill()
                stdout, stderr = launcher.communicate()
            pytest.fail(f"{script.name} did not finish in {_LIMIT_SECONDS} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)


def test_readme_usage_example(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    usage = readme[readme.index("## Usage") :]
    block = re.search(r"```python\n(.*?)```", usage, re.DOTALL)
    assert block is not None
    script = tmp_path / "script.py"
    script.write_text(block.group(1))
    result = _run(script, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line.split("] ", 1)[-1] for line in result.stdout.splitlines())
    assert lines == [f"{rank} 4 (4, 4) (250000,)" for rank in range(4)], result.stdout


def test_demo_checks_every_collective(tmp_path: Path) -> None:
    result = _run(ROOT / "examples" / "demo.py", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks passed on every rank" in result.stdout, result.stdout
    for name in ("allgatherv", "reduce_scatter", "gather", "scatter", "alltoall", "exscan"):
        assert re.search(rf"^\s+{name}\b", result.stdout, re.MULTILINE), (name, result.stdout)
