"""One rank of tests/test_gather.py's scatter ``out=`` checks through the shared segment.

``trioring run -n N --transport unix scatter_out_worker.py OUT_DIR``: for each case of
``CASES``, on a communicator of its own (``dup``, so that the mismatch that breaks it leaves
the world usable), a scatter from root ``n - 1`` in which some ranks pass ``out=``: good
ones everywhere (the result is checked), or bad ones on one or two ranks (every rank must
raise). The report (``rank{RANK}.json``) holds, per case, the error's type and message (or
None) and whether the result was right (after an error: whether ``out=`` is untouched),
and the communicators' features.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import trio

import trioring

#: Each case: a name, whether the root scatters a list, and each rank's ``out=`` as
#: (dtype, element count), or None for none, given (rank, world size); blocks of 3 float64.
CASES = {
    # Good out= on every other rank: the fold takes the path that compares them.
    "good": (False, lambda r, n: ("float64", 3) if r % 2 else None),
    "good-list": (True, lambda r, n: ("float64", 3) if r % 2 == 0 else None),
    # The bad out= on rank n - 2, never the root (whose own is refused before any I/O).
    "dtype": (False, lambda r, n: ("float32", 3) if r == n - 2 else ("float64", 3)),
    "count": (False, lambda r, n: ("float64", 4) if r == n - 2 else None),
    # Two bad ones (at world 2 only rank 0's 2): the least count is named, the same on
    # every rank.
    "two-counts": (False, lambda r, n: {0: ("float64", 5), n - 2: ("float64", 2)}.get(r)),
    "list-count": (True, lambda r, n: ("float64", 4) if r == n - 2 else ("float64", 3)),
}


async def main(out_dir: Path) -> None:
    report: dict[str, Any] = {"cases": {}, "features": []}
    async with trioring.open_communicator() as comm:
        n, r = comm.world_size, comm.rank
        root = n - 1
        for name, (listed, outs) in CASES.items():
            blocks = np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 1
            mine = (list(blocks.copy()) if listed else blocks.copy()) if r == root else None
            spec = outs(r, n)
            out = None if spec is None else np.full(spec[1], 7, spec[0])
            error = None
            right = None
            async with comm.dup() as side:
                report["features"].append(sorted(side.features))
                with trio.fail_after(20):
                    try:
                        got = await side.scatter(mine, root=root, out=out)
                    except trioring.TrioringError as exc:
                        error = {"type": type(exc).__name__, "message": str(exc)}
                        # The test asks this of the ranks whose out= was bad: never written.
                        right = out is None or bool(np.all(out == 7))
                    else:
                        right = (out is None or got is out) and bool(np.array_equal(got, blocks[r]))
            report["cases"][name] = {"error": error, "right": right}
        await comm.barrier()
    (out_dir / f"rank{r}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
