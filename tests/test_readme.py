"""What a new user runs first: the README's usage example and ``make demo``'s program, each
under ``trioring run`` on 4 ranks over Unix sockets, must run as shown and pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _run(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trioring", "run", "-n", "4", "--transport", "unix", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        # With PYTHONUNBUFFERED, print() writes a line and its newline separately, so the
        # lines of ranks that share the launcher's pipe could interleave mid-line.
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        check=False,
    )


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
