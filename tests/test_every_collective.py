"""Every collective in real processes: worlds 1-5 and 8, over TCP, over Unix sockets with the
one-host paths (shared segment, cross-memory attach) where this machine allows them, and over
Unix sockets without them; each collective at sizes from empty to several chunks, on seeded
inputs checked against numpy, and bitwise identical on every rank where promised (see
tests/workers/every_collective_worker.py). Each collective's own file tests its algorithms,
mismatches and faults; this one checks that they all work together, in one communicator, on
the paths users run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import trioring
from launched import push_expected, run_reports, threads_expected

if TYPE_CHECKING:
    from collections.abc import Mapping

WORKER = Path(__file__).parent / "workers" / "every_collective_worker.py"
OFF = {"TRIORING_CMA": "0", "TRIORING_SHM": "0"}
#: Collectives per case of the worker (all but barrier, which ends the run), and its cases.
COLLECTIVES_PER_CASE = 15
CASES = 5


@pytest.mark.parametrize(
    ("transport", "env", "n"),
    [
        *(("unix", None, n) for n in (1, 2, 3, 4, 5, 8)),
        *(("tcp", None, n) for n in (1, 2, 3, 4, 5, 8)),
        *(("unix", OFF, n) for n in (2, 3, 4, 5, 8)),
    ],
    ids=lambda v: "plain" if v is OFF else None,
)
def test_every_collective(
    tmp_path: Path, transport: str, env: Mapping[str, str] | None, n: int
) -> None:
    reports = run_reports(WORKER, [str(tmp_path)], tmp_path, n, transport=transport, env=env)
    errors = [error for report in reports for error in report["errors"]]
    assert not errors, "\n".join(errors[:20])
    # Results every rank must hold identically: the same digest everywhere.
    assert len({report["digest"] for report in reports}) == 1
    assert all(report["seq"] == COLLECTIVES_PER_CASE * CASES + 1 for report in reports)
    features = {frozenset(report["features"]) - {"spin"} for report in reports}
    if transport == "tcp" or env is OFF or n == 1:
        assert features == {frozenset()}
    else:
        expected = {name for name in ("cma", "shm") if trioring.is_available(name)}
        if threads_expected(n):
            expected.add("threads")
        if push_expected(n):
            expected.add("push")
        assert features == {frozenset(expected)}
