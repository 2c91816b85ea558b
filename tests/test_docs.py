"""The documentation's runnable examples run, and the site builds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"


def test_first_allreduce_under_trioring_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "trioring", "run", "-n", "4", "--no-tag-output"),
            str(EXAMPLES / "first_allreduce.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "mean over 4 ranks: [1.5 2.5 3.5" in result.stdout


def test_local_world_example() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "local_world.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "every rank got [6. 6. 6. 6.]" in result.stdout


def test_every_example_is_tested() -> None:
    tested = {"first_allreduce.py", "local_world.py"}
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested
