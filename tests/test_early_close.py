"""A rank that closes its communicator with no error while the others still use it (it
returned early, skipped a call they made, or caught a cancellation and went on) tells them:
they raise PeerFailedError saying that it closed, after or during which collective, and
``trioring run`` names it although it exited with code 0. Real processes under ``trioring
run``, over Unix sockets (with the shared segment, and without it) and TCP.

And the end of every program, where ranks close right after their last collective while
others still finish it, must not turn into a failure: a notice about the collective after
a rank's last one is no news to a peer still finishing that last one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from launched import run_launcher, write_script

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

#: transport, and TRIORING_SHM: the segment (its waits look at the connection once a peer
#: marked itself broken there) or the sockets alone (their frames, and the watches of
#: idle links during a long wait).
TRANSPORTS = [("unix", "1"), ("unix", "0"), ("tcp", "0")]


def _failing_job(
    tmp_path: Path, source: str, transport: str, shm: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``source`` on 4 ranks, which must fail; with the lines its ranks printed that
    start with "rank " (whole, by --tag-output: where PYTHONUNBUFFERED is set, a print's
    newline is a write of its own, which another rank's line may come between)."""
    script = write_script(tmp_path, source)
    result = run_launcher(
        tmp_path,
        *("-n", "4", "--tag-output", "--transport", transport, "--grace", "30", str(script)),
        env={"TRIORING_SHM": shm},
    )
    assert result.returncode == 1, result.stderr
    lines = [line.partition("] ")[2] for line in result.stdout.splitlines() if "] rank " in line]
    return result, lines


RETURNS_EARLY = """
    import signal
    import numpy as np
    import trio
    import trioring

    # The test expects every failing rank's own line: the launcher's SIGTERM, sent once the
    # first of them has exited, must not cut a rank off between its failure and its print
    # (trioring's excepthook ignores SIGTERM only from the uncaught error on). A rank that
    # hangs still gets SIGKILL after the grace period.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def main():
        async with trioring.open_communicator() as comm:
            x = np.ones(1000, np.float32)
            await comm.allreduce(x)
            if comm.rank == 1:
                return  # the bug: the others make a second call
            try:
                await comm.allreduce(x)
            except trioring.PeerFailedError as exc:
                print(f"rank {comm.rank} peer {exc.peer}: {exc}", flush=True)
                raise

    trio.run(main)
"""


@pytest.mark.parametrize(("transport", "shm"), TRANSPORTS)
def test_a_rank_that_returns_early_is_named_by_every_other(
    tmp_path: Path, transport: str, shm: str
) -> None:
    result, lines = _failing_job(tmp_path, RETURNS_EARLY, transport, shm)
    assert sorted(line.split()[1] for line in lines) == ["0", "2", "3"], result.stdout
    for line in lines:
        rank = line.split()[1]
        assert line.startswith(
            f"rank {rank} peer 1: rank {rank}: allreduce #2: rank 1 closed "
            "its communicator after collective #1"
        ), line
    assert result.stderr.rstrip().endswith(
        "rank 1 exited with code 0 before ranks 0, 2, 3, which failed waiting for it"
    ), result.stderr


CLOSES_DURING = """
    import numpy as np
    import trio
    import trioring

    async def main():
        async with trioring.open_communicator() as comm:
            x = np.ones(1000, np.float32)
            await comm.allreduce(x)
            if comm.rank != 2:
                try:
                    await comm.allreduce(x)
                except trioring.PeerFailedError as exc:
                    print(f"rank {comm.rank} peer {exc.peer}: {exc}", flush=True)
                    raise
                return
            # Rank 2 waits in the second call for a peer that the test holds back, and
            # closes the communicator from another task meanwhile.
            async def second():
                try:
                    await comm.allreduce(x)
                except trioring.CommunicatorClosedError:
                    pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(second)
                await trio.sleep(0.2)
                await comm.aclose()

    trio.run(main)
"""


@pytest.mark.parametrize(("transport", "shm"), TRANSPORTS)
def test_a_rank_that_closes_during_a_collective_is_named(
    tmp_path: Path, transport: str, shm: str
) -> None:
    """Rank 2 closes the communicator while its second allreduce waits: every other rank
    waiting in that allreduce raises, saying rank 2 closed it during collective #2. (Rank 3
    holds the others back: it would enter the second call only after rank 2 has closed.)"""
    source = CLOSES_DURING.replace(
        "            if comm.rank != 2:\n",
        "            if comm.rank == 3:\n"
        "                await trio.sleep(0.6)\n"
        "            if comm.rank != 2:\n",
    )
    result, lines = _failing_job(tmp_path, source, transport, shm)
    # Rank 3, still asleep when they fail, is stopped by the launcher then.
    assert {line.split()[1] for line in lines} >= {"0", "1"}, result.stdout
    for line in lines:
        assert "rank 2 closed its communicator during collective #2" in line, line


ENDS_TOGETHER = """
    import random, sys
    import numpy as np
    import trio
    import trioring

    async def main():
        rounds = int(sys.argv[1])
        rng = random.Random()
        for _ in range(rounds):
            async with trioring.open_communicator() as comm:
                x = np.ones(256 * 1024, np.float32)
                for _ in range(3):
                    await comm.allreduce(x)
                    x[:] = 1
                    # Uneven speeds, so that ranks reach their close at different times
                    # while others still finish the last call.
                    await trio.sleep(rng.random() * 0.003)
            print("round done", flush=True)

    trio.run(main)
"""


@pytest.mark.parametrize(("transport", "shm"), [("unix", "1"), ("unix", "0")])
def test_ranks_that_close_right_after_the_last_call_do_not_fail_the_others(
    tmp_path: Path, transport: str, shm: str
) -> None:
    """Ten worlds of 4 on 2 cores, one after another, each ending right after three ring
    allreduces of 1 MiB (by the sockets, or the segment's pipe), the ranks at slightly
    different times: every rank completes every world."""
    script = write_script(tmp_path, ENDS_TOGETHER)
    result = run_launcher(
        tmp_path,
        *("-n", "4", "--transport", transport, str(script), "10"),
        env={
            "TRIORING_SHM": shm,
            **({"TRIORING_ALGORITHM": "allreduce=ring"} if shm == "0" else {}),
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("round done") == 40, result.stdout
