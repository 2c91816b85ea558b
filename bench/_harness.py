"""What the peers' workers (bench/_gloo_worker.py, bench/_mpi_worker.py) share: the
iteration counts and warm-up of trioring bench (trioring/_bench.py), copied here rather than
imported, so that a peer's harness does not load the library it is compared with."""

from __future__ import annotations


def iterations(size: int) -> int:
    """Timed calls per cell, as trioring bench's."""
    if size <= 64 * 1024:
        return 200
    if size <= 4 * 1024**2:
        return 40
    return 10


def warmup_iterations(count: int) -> int:
    """Untimed calls before the timed ones, as trioring bench's."""
    return max(3, count // 5)
