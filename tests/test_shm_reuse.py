"""The shared segment's two slots are reused every other collective; a rank must not
overwrite a slot that a peer is still reading, even when the collective in between went by
the sockets and let it finish without hearing from that peer (see
tests/workers/shm_reuse_worker.py). Found by ``trioring bench --collective all`` at world
3, where a barrier after a scan raised CollectiveMismatchError: rank 2 read rank 1's
barrier #13018 in the slot of barrier #13016."""

from __future__ import annotations

from pathlib import Path

import pytest

import trioring
from launched import run_reports

WORKER = Path(__file__).parent / "workers" / "shm_reuse_worker.py"


@pytest.mark.skipif(not trioring.is_available("shm"), reason="no shared segment here")
def test_a_slot_is_not_reused_while_a_peer_reads_it(tmp_path: Path) -> None:
    reports = run_reports(WORKER, [str(tmp_path)], tmp_path, 3)
    for report in reports:
        assert "shm" in report["features"]
        assert report["error"] is None, report["error"]
        assert report["wrong"] == 0
