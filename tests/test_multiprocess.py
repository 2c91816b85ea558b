"""Collectives across real processes, over every way ranks can meet on one host.

Each world runs ``tests/workers/matrix_worker.py`` once per rank: every reduce op on every
dtype it accepts, on shapes from 0-d and empty to several 1 MiB chunks, then a broadcast of
every dtype and shape from every root, with barriers in between. Inputs depend only on the
case number and the rank, so this process recomputes all of them and checks each result
against numpy, and checks that every rank ended with the very same bytes.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from launched import load_module

if TYPE_CHECKING:
    from conftest import Worlds

WORKERS_DIR = Path(__file__).parent / "workers"


matrix = load_module("matrix_worker", WORKERS_DIR / "matrix_worker.py")

_UFUNCS = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def expected(case: Any, index: int, world_size: int) -> np.ndarray:
    """What every rank must hold after case ``index``, computed in the case's dtype."""
    inputs = [matrix.make_input(case, index, rank) for rank in range(world_size)]
    if case.kind == "broadcast":
        result: np.ndarray = inputs[case.root]
        return result
    dtype = np.dtype(case.dtype)
    with np.errstate(all="ignore"):
        result = np.asarray(_UFUNCS[case.op].reduce(np.stack(inputs), axis=0, dtype=dtype))
        if case.op == "mean":
            result = np.asarray(result / np.array(world_size, dtype=dtype))
    assert result.dtype == dtype
    return result


def exact(case: Any) -> bool:
    """Integer arithmetic (wrapping included), min, max and copies do not depend on the
    order of operations; float sums and products do."""
    return (
        case.kind == "broadcast" or case.op in ("min", "max") or np.dtype(case.dtype).kind in "iu"
    )


def tolerances(case: Any, world_size: int) -> dict[str, float]:
    """Bounds on the difference between two orders of reduction in the case's dtype."""
    eps = float(np.finfo(np.dtype(case.dtype)).eps)
    if case.op == "prod":
        return {"rtol": 8 * world_size * eps, "atol": 0.0}
    # Every partial sum is below world_size * SUM_BOUND in magnitude (per component).
    atol = 2 * world_size * eps * world_size * matrix.SUM_BOUND * 2
    if case.op == "mean":
        atol /= world_size
    return {"rtol": 4 * world_size * eps, "atol": atol}


def check_results(out_dir: Path, world_size: int) -> None:
    results = [np.load(out_dir / f"rank{rank}.npz") for rank in range(world_size)]
    cases = matrix.cases(world_size)
    problems: list[str] = []
    checked = 0
    for index, case in enumerate(cases):
        if case.kind == "barrier":
            continue
        key = f"c{index}"
        got = [result[key] for result in results]
        want = expected(case, index, world_size)
        where = f"case {index} {case}"
        if any(g.dtype != want.dtype or g.shape != want.shape for g in got):
            problems.append(f"{where}: got {[(g.dtype, g.shape) for g in got]}")
            continue
        if any(g.tobytes() != got[0].tobytes() for g in got[1:]):
            differing = [r for r, g in enumerate(got) if g.tobytes() != got[0].tobytes()]
            problems.append(
                f"{where}: ranks {differing} differ from rank 0 (not bitwise identical)"
            )
            continue
        if exact(case):
            if got[0].tobytes() != want.tobytes():
                bad = np.flatnonzero(
                    got[0].reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8)
                )
                problems.append(f"{where}: wrong result (first differing byte {bad[:1]})")
        else:
            try:
                np.testing.assert_allclose(got[0], want, **tolerances(case, world_size))
            except AssertionError as exc:
                problems.append(f"{where}: {exc}")
        checked += 1
    assert not problems, f"{len(problems)} of {checked} cases failed:\n" + "\n".join(problems[:20])
    assert checked == sum(case.kind != "barrier" for case in cases)


@pytest.mark.parametrize(
    ("mode", "world_size"),
    [
        *(("tcp", n) for n in (1, 2, 3, 4)),
        *(("unix-dir", n) for n in (1, 2, 3, 4)),
        *(("unix-tcp", n) for n in (2, 3, 4)),
    ],
)
def test_collective_matrix(worlds: Worlds, mode: str, world_size: int) -> None:
    world = worlds.start("matrix_worker.py", "matrix", world_size=world_size, mode=mode)
    reports = world.finish()

    cases = matrix.cases(world_size)
    refusable = {
        f"{op}/{dtype}" for op in matrix.OPS for dtype in matrix.DTYPES if matrix.refused(op, dtype)
    }
    assert len(refusable) == 12  # mean of 8 integer dtypes, min and max of 2 complex ones
    for rank, report in enumerate(reports):
        opened = report["steps"]["open"]
        assert opened["error"] is None, opened["error"]
        assert (opened["rank"], opened["world_size"]) == (rank, world_size)
        assert opened["transport"] == ("tcp" if mode == "tcp" else "unix")
        step = report["steps"]["matrix"]
        assert step["error"] is None, step["error"]
        # Refusals are InvalidArgumentError, before any I/O: no sequence number is used.
        assert step["refusals"] == dict.fromkeys(refusable, "InvalidArgumentError")
        assert step["seq_after_refusals"] == 0
        # One sequence number per collective, barriers included; nothing broke.
        assert step["seq"] == len(cases)
        assert not step["broken"]
    check_results(world.out_dir, world_size)


def test_check_results_detects_wrong_results(tmp_path: Path) -> None:
    """The checker itself: an exact result off by one, a float sum off by a little more
    than the tolerance allows, or one rank's bytes differing, are all caught."""
    world_size = 2
    cases = matrix.cases(world_size)
    arrays = [
        {
            f"c{index}": expected(case, index, world_size)
            for index, case in enumerate(cases)
            if case.kind != "barrier"
        }
        for _ in range(world_size)
    ]
    for rank in range(world_size):
        np.savez(tmp_path / f"rank{rank}.npz", **arrays[rank])
    check_results(tmp_path, world_size)

    # An integer sum off by one, identical on both ranks.
    index = next(
        i
        for i, c in enumerate(cases)
        if c.kind == "allreduce" and c.dtype == "int64" and c.shape == (3,)
    )
    for rank in range(world_size):
        arrays[rank][f"c{index}"] = arrays[rank][f"c{index}"] + np.int64(1)
        np.savez(tmp_path / f"rank{rank}.npz", **arrays[rank])
    with pytest.raises(AssertionError, match="wrong result"):
        check_results(tmp_path, world_size)
    arrays[1][f"c{index}"] = arrays[1][f"c{index}"] - np.int64(1)
    np.savez(tmp_path / "rank1.npz", **arrays[1])
    with pytest.raises(AssertionError, match="not bitwise identical"):
        check_results(tmp_path, world_size)
    arrays[0][f"c{index}"] = arrays[1][f"c{index}"]

    # A float16 sum that misses part of one rank's contribution.
    index = next(
        i
        for i, c in enumerate(cases)
        if c.op == "sum" and c.dtype == "float16" and c.shape == (1031,)
    )
    for rank in range(world_size):
        arrays[rank][f"c{index}"] = arrays[rank][f"c{index}"] + np.float16(0.125)
        np.savez(tmp_path / f"rank{rank}.npz", **arrays[rank])
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_results(tmp_path, world_size)


def test_a_world_whose_port_was_taken_is_started_again(worlds: Worlds) -> None:
    """The harness's answer to the free-port race: the first port handed out is taken (by a
    listener here, which rank 1 even connects to), so rank 0 cannot listen; the world is
    killed and started again on another port, where it works."""
    original = worlds.free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(16)
        ports = iter([taken.getsockname()[1]])
        worlds.free_port = lambda: next(ports, None) or original()
        world = worlds.start("matrix_worker.py", "matrix", world_size=2, mode="tcp")
        reports = world.finish()
        assert next(ports, None) is None  # the taken port was used first
    assert all(report["steps"]["matrix"]["error"] is None for report in reports), reports
    check_results(world.out_dir, 2)
