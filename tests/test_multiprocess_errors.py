"""Failures across real processes: mismatched collectives, cancellation, invalid environments,
inconsistent worlds and a killed peer. Every rank must raise a precise ``TrioringError``
promptly; none may hang.

Each rank runs ``tests/workers/scenario_worker.py``, which records every step's exception
(type, message, attributes) and duration in a JSON report instead of raising it. A rank that
hangs is cancelled by the worker after ``HANG_S`` seconds and recorded as ``TooSlowError``.
"""

from __future__ import annotations

import re
import signal
import socket
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from conftest import Worlds

#: Generous bound on how long any error may take to surface (they take milliseconds).
PROMPT_S = 5.0
#: The worker's move_on_after in the cancellation scenario (scenario_worker.CANCEL_AFTER_S).
CANCEL_AFTER_S = 0.2


def steps(report: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = report["steps"]
    return result


def error_of(report: dict[str, Any], step: str) -> dict[str, Any]:
    """The error the worker recorded for ``step``; fails the test if there is none."""
    recorded = steps(report)[step]
    error: dict[str, Any] | None = recorded["error"]
    assert error is not None, f"worker {report['index']}: {step} raised nothing"
    return error


def assert_ok(report: dict[str, Any], *names: str) -> None:
    for name in names:
        error = steps(report)[name]["error"]
        assert error is None, f"worker {report['index']}: {name} raised {error}"


def assert_broken_after(report: dict[str, Any], step: str) -> None:
    error = error_of(report, step)
    assert error["type"] == "CommunicatorBrokenError", error


# -- (i) mismatched collectives -------------------------------------------------------------

#: How rank 1 differs from the others, and two fragments naming each side in the message.
MISMATCHES = {
    "dtype": ("float32", "float64"),
    "count": ("float32[1000]", "float32[1001]"),
    "op": ("allreduce(sum)", "allreduce(max)"),
    "kind-broadcast": ("allreduce(sum)", "broadcast(root=0)"),
    "kind-barrier": ("allreduce(sum)", "barrier"),
    "root": ("broadcast(root=0)", "broadcast(root=1)"),
}
# What each rank called in the mismatched collective: (rank 1's, the others').
_CALLED = {"kind-broadcast": ("broadcast", "allreduce"), "kind-barrier": ("barrier", "allreduce")}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_collective_raises_on_every_rank(
    worlds: Worlds, case: str, world_size: int
) -> None:
    """Rank 1 calls a collective that differs from the others' (seq 3, after two agreed
    ones). Every rank raises promptly: in that collective, or, for a rank whose share of it
    completed without reading from a disagreeing rank (a broadcast leaf under the other
    root), in its next one, which it learns is doomed. Nobody hangs."""
    world = worlds.start(
        "scenario_worker.py", "mismatch", world_size=world_size, mode="tcp", args=[case]
    )
    reports = world.finish()
    ours, theirs = MISMATCHES[case]
    called = _CALLED.get(case, ("broadcast",) * 2 if case == "root" else ("allreduce",) * 2)
    errors = []
    for rank, report in enumerate(reports):
        assert_ok(report, "open", "agreed")
        mismatch = steps(report)["mismatch"]
        error = mismatch["error"]
        if error is None:
            # Only where this rank's share was complete without the disagreeing rank.
            assert world_size > 2, f"rank {rank}: the mismatched {called} returned normally"
            assert rank != 1, "the rank that differs returned normally"
            late = error_of(report, "after")
            assert late["type"] in ("CollectiveMismatchError", "PeerFailedError"), late
            assert steps(report)["after"]["elapsed"] < PROMPT_S
            continue
        # Mismatches are found, or relayed, or seen as a peer leaving; nothing else.
        assert error["type"] in ("CollectiveMismatchError", "PeerFailedError"), (rank, error)
        assert "TrioringError" in error["mro"]
        assert mismatch["elapsed"] < PROMPT_S
        assert (error["rank"], error["seq"]) == (rank, 3), error  # barrier, allreduce, this
        assert error["collective"] == called[0 if rank == 1 else 1], error
        assert error["peer"] not in (None, rank), error
        assert_broken_after(report, "after")
        errors.append(error)
    mismatches = [e for e in errors if e["type"] == "CollectiveMismatchError"]
    assert mismatches, errors
    if world_size == 2:
        assert len(mismatches) == 2, errors
    # Every mismatch message names both sides. (With disagreeing roots, a rank that completed
    # the broadcast as a leaf of root 0 may be the first to notice, in its next call: then the
    # sides are rank 1's broadcast and that rank's barrier, relayed to the others.)
    other_sides = (ours, "barrier #4") if case == "root" else (ours,)
    for error in mismatches:
        assert theirs in error["message"], error["message"]
        assert any(side in error["message"] for side in other_sides), error["message"]


# -- (ii) cancellation ----------------------------------------------------------------------


@pytest.mark.parametrize(("world_size", "mode"), [(2, "tcp"), (3, "tcp"), (3, "unix-dir")])
def test_cancelled_collective_aborts_the_peers(worlds: Worlds, world_size: int, mode: str) -> None:
    canceller, gated = 1, (0 if world_size == 2 else 2)
    world = worlds.start(
        "scenario_worker.py",
        "cancel",
        world_size=world_size,
        mode=mode,
        args=[str(canceller), str(gated)],
    )
    reports = world.finish()
    for report in reports:
        assert_ok(report, "open", "agreed")

    cancelled = steps(reports[canceller])["cancelled"]
    # The collective could not complete (a rank was missing), so the cancel scope fired and
    # caught the cancellation, which escaped the allreduce as such; the abort notice to peers
    # is bounded (0.25 s), so giving up is prompt too.
    assert cancelled["cancelled_caught"]
    assert cancelled["escaped_is_cancellation"], cancelled
    assert cancelled["broken"]
    assert cancelled["elapsed"] < CANCEL_AFTER_S + 1.0
    for step in ("allreduce-after", "barrier-after"):
        error = error_of(reports[canceller], step)
        assert error["type"] == "CommunicatorBrokenError", error
        assert error["cause_is_cancellation"], error
        assert f"rank {canceller}: " in error["message"], error
        assert "broken since allreduce #2 was cancelled after " in error["message"], error

    for rank, report in enumerate(reports):
        if rank == canceller:
            continue
        error = error_of(report, "allreduce")
        assert error["type"] in ("PeerAbortedError", "PeerFailedError"), (rank, error)
        assert error["rank"] == rank
        if error["type"] == "PeerAbortedError":
            assert error["reason"] == "cancelled", error
            assert error["peer"] == canceller, error
            assert f"rank {canceller} cancelled" in error["message"], error
        else:
            assert error["peer"] not in (None, rank), error
        # The gated rank joins after the canceller gave up; the others were waiting already.
        bound = PROMPT_S if rank == gated else CANCEL_AFTER_S + PROMPT_S
        assert steps(report)["allreduce"]["elapsed"] < bound
        assert_broken_after(report, "barrier-after")


# -- (iii) invalid environments -------------------------------------------------------------


@pytest.fixture
def idle_listener() -> Iterator[socket.socket]:
    """A loopback TCP socket that listens but never accepts: a process that connects to it
    (which no process should here) leaves a connection in its backlog."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock


def _assert_never_connected(listener: socket.socket) -> None:
    listener.setblocking(False)
    try:
        connection, peer = listener.accept()
    except BlockingIOError:
        return
    connection.close()
    pytest.fail(f"the process connected to MASTER_ADDR:MASTER_PORT (from {peer}) before failing")


_GOOD = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}
_UNIX = {"TRIORING_TRANSPORT": "unix"}

#: name: (changes to a valid rank-1 environment, None = unset; the variable the message names)
BAD_ENVIRONMENTS: dict[str, tuple[dict[str, str | None], str]] = {
    "RANK-missing": ({"RANK": None}, "RANK"),
    "RANK-not-an-int": ({"RANK": "abc"}, "RANK"),
    "RANK-negative": ({"RANK": "-1"}, "RANK"),
    "RANK-not-below-WORLD_SIZE": ({"RANK": "2"}, "RANK"),
    "WORLD_SIZE-missing": ({"WORLD_SIZE": None}, "WORLD_SIZE"),
    "WORLD_SIZE-zero": ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    "MASTER_ADDR-missing": ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    "MASTER_ADDR-missing-unix": ({"MASTER_ADDR": None, **_UNIX}, "MASTER_ADDR"),
    "MASTER_PORT-missing": ({"MASTER_PORT": None}, "MASTER_PORT"),
    "MASTER_PORT-zero": ({"MASTER_PORT": "0"}, "MASTER_PORT"),
    "MASTER_PORT-too-large": ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    "MASTER_PORT-not-an-int": ({"MASTER_PORT": "http"}, "MASTER_PORT"),
    "TRIORING_TRANSPORT-unknown": ({"TRIORING_TRANSPORT": "pigeon"}, "TRIORING_TRANSPORT"),
    "TRIORING_SOCKET_DIR-missing": (
        {"TRIORING_SOCKET_DIR": "/nonexistent/trioring-sockets", **_UNIX},
        "TRIORING_SOCKET_DIR",
    ),
}


@pytest.mark.parametrize("name", list(BAD_ENVIRONMENTS))
def test_invalid_environment_fails_before_any_io(
    worlds: Worlds, idle_listener: socket.socket, name: str
) -> None:
    changes, variable = BAD_ENVIRONMENTS[name]
    port = idle_listener.getsockname()[1]
    env = worlds.base_env()
    for key, value in {**_GOOD, **changes}.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value.format(port=port)
    out_dir = worlds.out_dir()
    worker = worlds.spawn("scenario_worker.py", ["open", str(out_dir), "0"], env)
    assert worker.wait(timeout=PROMPT_S + 5) == 0, worker.log_text()

    report = worker.report()
    error = error_of(report, "open")
    assert error["type"] == "ConfigurationError", error
    assert re.search(rf"\b{variable}\b", error["message"]), error["message"]
    assert steps(report)["open"]["elapsed"] < PROMPT_S
    _assert_never_connected(idle_listener)


def test_valid_environment_does_connect(worlds: Worlds, idle_listener: socket.socket) -> None:
    """Control for the test above: with a valid environment, rank 1 does connect to
    MASTER_ADDR:MASTER_PORT (and waits there for rank 0 until the worker gives up)."""
    env = worlds.base_env()
    env.update(
        {key: value.format(port=idle_listener.getsockname()[1]) for key, value in _GOOD.items()}
    )
    env["WORKER_OPEN_TIMEOUT_S"] = "1"
    out_dir = worlds.out_dir()
    worker = worlds.spawn("scenario_worker.py", ["open", str(out_dir), "0"], env)
    assert worker.wait(timeout=PROMPT_S + 5) == 0, worker.log_text()
    assert error_of(worker.report(), "open")["type"] == "TooSlowError"
    with pytest.raises(pytest.fail.Exception, match="connected to MASTER_ADDR:MASTER_PORT"):
        _assert_never_connected(idle_listener)


# -- (iv) inconsistent worlds ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)], ids=["rank1-says-3", "rank0-says-3"])
def test_disagreeing_world_sizes_fail_rendezvous(
    worlds: Worlds, mode: str, sizes: tuple[int, int]
) -> None:
    world = worlds.start(
        "scenario_worker.py",
        "open",
        world_size=sizes[0],
        ranks=[0, 1],
        mode=mode,
        env_overrides={1: {"WORLD_SIZE": str(sizes[1])}},
    )
    for report in world.finish():
        error = error_of(report, "open")
        assert error["type"] == "RendezvousError", error
        assert f"WORLD_SIZE={sizes[0]}" in error["message"], error
        assert f"WORLD_SIZE={sizes[1]}" in error["message"], error
        assert steps(report)["open"]["elapsed"] < PROMPT_S


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
@pytest.mark.parametrize(
    ("forced", "expected"),
    [
        (
            ("allreduce=ring", ""),
            (
                "rank 1 forces no algorithm (TRIORING_ALGORITHM is unset or empty) but rank 0 "
                "forces TRIORING_ALGORITHM='allreduce=ring'"
            ),
        ),
        (
            ("broadcast=tree, allreduce=ring", "allreduce=ring,broadcast=shm"),
            (
                "rank 1 forces TRIORING_ALGORITHM='allreduce=ring,broadcast=shm' but rank 0 "
                "forces TRIORING_ALGORITHM='allreduce=ring,broadcast=tree'"
            ),
        ),
    ],
    ids=["rank0-only", "different"],
)
def test_disagreeing_forced_algorithms_fail_rendezvous(
    worlds: Worlds, mode: str, forced: tuple[str, str], expected: str
) -> None:
    """Ranks that force different algorithms would not run the same collectives (over Unix
    sockets a rank forcing a tree broadcast met a peer's shared-memory one with "sent a
    frame during a shared-memory collective", naming no cause): rank 0 refuses the world
    at the rendezvous instead, and every rank's open raises RendezvousError saying which
    rank forces what. (Two ranks: a third that arrives after rank 0 refused finds nobody, see
    test_setup_failures.py.)"""
    world = worlds.start(
        "scenario_worker.py",
        "open",
        world_size=2,
        mode=mode,
        env_overrides={
            0: {"TRIORING_ALGORITHM": forced[0]},
            1: {"TRIORING_ALGORITHM": forced[1]},
        },
    )
    for report in world.finish():
        error = error_of(report, "open")
        assert error["type"] == "RendezvousError", error
        assert expected in error["message"], error
        assert "every rank must force the same algorithms" in error["message"], error
        assert steps(report)["open"]["elapsed"] < PROMPT_S


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
def test_the_same_forced_algorithms_in_another_order_agree(worlds: Worlds, mode: str) -> None:
    """Control for the test above: the order of the pairs and the spaces around them do not
    matter, only what is forced: the world opens, and its barrier (forced to the
    dissemination on every rank) completes."""
    world = worlds.start(
        "scenario_worker.py",
        "open",
        world_size=3,
        mode=mode,
        env_overrides={
            0: {"TRIORING_ALGORITHM": "allreduce=ring,barrier=dissemination"},
            1: {"TRIORING_ALGORITHM": " barrier = dissemination , allreduce=ring"},
            2: {"TRIORING_ALGORITHM": "barrier=dissemination,allreduce=ring"},
        },
    )
    for report in world.finish():
        assert_ok(report, "open", "barrier")


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
def test_duplicate_rank_fails_rendezvous(worlds: Worlds, mode: str) -> None:
    world = worlds.start("scenario_worker.py", "open", world_size=3, ranks=[0, 1, 1], mode=mode)
    for report in world.finish():
        error = error_of(report, "open")
        assert error["type"] == "RendezvousError", error
        assert "two processes claim rank 1" in error["message"], error
        assert steps(report)["open"]["elapsed"] < PROMPT_S


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
def test_duplicate_rank_0_fails_to_listen(worlds: Worlds, mode: str) -> None:
    """Two processes say RANK=0 in a world of 3 that has no rank 2. Whichever listens for
    the rendezvous first waits (with rank 1) for the missing rank, as documented, until its
    fail_after ends it, and then rank 1 learns at once that the rendezvous failed; the other
    rank 0 cannot listen and fails at once."""
    give_up_s = 3.0
    world = worlds.start(
        "scenario_worker.py",
        "open",
        world_size=3,
        ranks=[0, 0, 1],
        mode=mode,
        env_overrides={
            0: {"WORKER_OPEN_TIMEOUT_S": str(give_up_s)},
            1: {"WORKER_OPEN_TIMEOUT_S": str(give_up_s)},
            2: {"WORKER_OPEN_TIMEOUT_S": str(give_up_s + 10)},
        },
        retry_port_clash=False,
    )
    reports = world.finish()
    errors = [error_of(report, "open") for report in reports]
    elapsed = [steps(report)["open"]["elapsed"] for report in reports]
    listening = [i for i in (0, 1) if errors[i]["type"] == "TooSlowError"]
    assert len(listening) == 1, errors
    refused = 1 - listening[0]
    assert errors[refused]["type"] == "RendezvousError", errors[refused]
    assert errors[refused]["address_in_use"], errors[refused]
    assert "rank 0: cannot listen for the rendezvous" in errors[refused]["message"]
    assert elapsed[refused] < PROMPT_S
    assert give_up_s <= elapsed[listening[0]] < give_up_s + PROMPT_S
    assert errors[2]["type"] == "RendezvousError", errors[2]
    assert "rank 1: rendezvous with rank 0 failed" in errors[2]["message"], errors[2]
    # (Before its own deadline, measured from its own, slightly later, start.)
    assert elapsed[2] < give_up_s + PROMPT_S


# -- (v) a killed peer ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "mode", "victim", "collective"),
    [
        (2, "tcp", 1, "allreduce"),
        (3, "unix-dir", 1, "broadcast"),
        (3, "tcp", 0, "allreduce"),
        (3, "unix-dir", 2, "allreduce"),
    ],
)
def test_killed_peer_fails_the_next_collective(
    worlds: Worlds, world_size: int, mode: str, victim: int, collective: str
) -> None:
    """SIGKILL one rank between collectives; the survivors' next collective raises
    PeerFailedError promptly.

    Which peer it names: with two ranks, or in a broadcast rooted at the victim (every
    survivor's only link in use is to the victim), always the victim. In a ring allreduce of
    three, the first survivor to notice names the victim, but the other one may find that
    survivor's connection closed (it broke in reaction) before it reads the relayed news, and
    then names it instead."""
    world = worlds.start(
        "scenario_worker.py",
        "kill",
        world_size=world_size,
        mode=mode,
        args=[str(victim), collective],
    )
    world.wait_for("ready")
    killed = world.workers[victim]
    killed.popen.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    (world.out_dir / "go").touch()

    survivors = [rank for rank in range(world_size) if rank != victim]
    named = []
    for rank, report in zip(survivors, world.finish(survivors), strict=True):
        assert_ok(report, "open", "agreed")
        error = error_of(report, "next")
        assert error["type"] == "PeerFailedError", (rank, error)
        assert error["rank"] == rank, error
        assert error["peer"] in [*survivors, victim], error
        assert error["peer"] != rank, error
        assert f"rank {error['peer']}" in error["message"], error
        assert steps(report)["next"]["elapsed"] < PROMPT_S
        assert_broken_after(report, "barrier-after")
        named.append(error["peer"])
    if world_size == 2 or collective == "broadcast":
        assert set(named) == {victim}, named
    else:
        assert victim in named, named
