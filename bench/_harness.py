"""What the peers' workers (bench/_gloo_worker.py, bench/_mpi_worker.py,
bench/_floor_worker.py, bench/_p2p_peer.py) share: the iteration counts and warm-up of
trioring bench (trioring/_bench.py), the inputs of its copying collectives, and the sizes
and round trips of bench/p2p.py's ping-pong, copied here rather than imported, so that a
peer's harness does not load the library it is compared with."""

from __future__ import annotations

import numpy as np


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


def rows(n: int, k: int) -> np.ndarray:
    """Row i is ``i + 1``: every rank's block, as gathered (as trioring bench's)."""
    return np.repeat(np.arange(1, n + 1, dtype=np.float32), k).reshape(n, k)


def exchanged(n: int, k: int, source: int) -> np.ndarray:
    """What rank ``source`` sends in an alltoall: block j is ``source * n + j + 1``."""
    first = source * n + 1
    return np.repeat(np.arange(first, first + n, dtype=np.float32), k).reshape(n, k)


#: The ping-pong's message sizes (bench/p2p.py): around trioring's eager limit and chunk
#: (1 MiB).
P2P_SIZES = [8, 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 1024 * 1024 + 8, 16 * 1024 * 1024]


def p2p_inner(size: int) -> int:
    """Round trips per sample of the ping-pong."""
    return 20 if size <= 1024 * 1024 else 5


def p2p_buffers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ping-pong's message of ``size`` bytes (a pattern the echo is checked against),
    and the buffer the echo lands in."""
    message = (np.arange(size, dtype=np.uint8) * 7).view(np.uint8)
    return message, np.empty_like(message)
