"""Failures while the world forms (issue 14): a rank that dies, raises, cannot reach a peer or
gives up anywhere in the set-up (rendezvous, mesh, capability agreement) makes every rank
raise RendezvousError naming it, within a few seconds; a rank that finds nobody at the
rendezvous says why; a failed authentication is a WARNING on the listening rank.

Processes are real (tests/workers/setup_worker.py, with the marker files and JSON reports of
_worker_util.py), and so are their sockets: loopback, Unix, or network namespaces joined by a
bridge (tests/netns.py; needs root and iptables). The in-process tests at the end use real
loopback sockets too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import trio.testing

import trioring
from conftest import WAIT_S, WORKERS_DIR, Worker, free_tcp_port, poll_until
from netns import Hosts, open_hosts
from trioring import _config, _control, _rendezvous, _setup
from trioring._config import Config
from trioring._errors import RendezvousError
from trioring.transports._memory import StreamConnection

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from conftest import Worlds

WORKER = "setup_worker.py"
#: How soon after a failure every other rank must have raised (they take milliseconds).
PROMPT_S = 5.0


def open_step(report: dict[str, Any]) -> dict[str, Any]:
    step: dict[str, Any] = report["steps"]["open"]
    return step


def open_error(report: dict[str, Any]) -> dict[str, Any]:
    error: dict[str, Any] | None = open_step(report)["error"]
    assert error is not None, f"worker {report['index']}: open_communicator raised nothing"
    return error


def died_at(out_dir: Path, index: int) -> float:
    return float((out_dir / f"w{index}.died").read_text())


# -- a rank that dies or raises in the middle of the set-up ----------------------------------


@pytest.mark.parametrize(
    ("world_size", "mode", "victim", "fault"),
    [
        (4, "tcp", 2, "mesh-kill"),
        (4, "unix-dir", 2, "mesh-raise"),
        (4, "tcp", 0, "mesh-kill"),
        (3, "unix-dir", 1, "agree-kill"),
    ],
)
def test_a_rank_failing_during_set_up_fails_every_rank(
    worlds: Worlds, world_size: int, mode: str, victim: int, fault: str
) -> None:
    """The victim is SIGKILLed (or raises) once its first data connection is up, or once its
    capability agreement is done but before it said READY. Before the control channel, the
    ranks that were waiting to accept its connections waited forever, and after the
    agreement the others even opened. Now every survivor raises RendezvousError naming the
    victim (and why, when it could say) within PROMPT_S of its death: rather than the
    echo of its failure that another rank saw first (a connection to it broke)."""
    world = worlds.start(
        WORKER,
        "open",
        world_size=world_size,
        mode=mode,
        env_overrides={victim: {"SETUP_FAULT": fault}},
    )
    survivors = [r for r in range(world_size) if r != victim]
    reports = dict(zip(survivors, world.finish(survivors), strict=True))
    killed = fault.endswith("kill")
    code = world.workers[victim].wait()
    assert code == (-9 if killed else 0), world.workers[victim].log_text()
    death = died_at(world.out_dir, victim)
    for rank, report in reports.items():
        error = open_error(report)
        assert error["type"] == "RendezvousError", (rank, error)
        assert error["peer"] == victim, (rank, error)
        assert f"rank {victim}" in error["message"], (rank, error)
        if not killed:  # it said why, and every rank heard it
            assert "RuntimeError: injected failure" in error["message"], (rank, error)
        assert open_step(report)["ended"] - death < PROMPT_S, (rank, error)
    if victim == 0:
        # Every channel closed: the ranks that had nothing else to notice say so.
        messages = [open_error(report)["message"] for report in reports.values()]
        assert any("rank 0 left during set-up" in m for m in messages), messages


@pytest.mark.parametrize(
    ("own", "blamed"),
    [
        # Rank 2 gave up when rank 0 died and closed its connections mid-handshake: an echo.
        (RendezvousError("rank 3: handshake with rank 2 failed: reset", rank=3, peer=2), 0),
        # About rank 0 itself: ours says more than "rank 0 left".
        (RendezvousError("rank 3: cannot connect to rank 0: refused", rank=3, peer=0), None),
        # Not about another rank: this rank's own failure stands.
        (RuntimeError("this rank's own failure"), None),
    ],
)
async def test_a_failure_with_a_peer_while_rank_0_dies_names_rank_0(
    autojump_clock: trio.testing.MockClock, own: Exception, blamed: int | None
) -> None:
    """A rank whose share of the set-up failed with a peer other than rank 0 while rank 0
    died (no verdict: its channel closed) raises that rank 0 left, from its own failure: in
    real processes rank 3 said "handshake with rank 2 failed: connection reset" where rank
    0 had been killed (1 run of test_a_rank_failing_during_set_up_fails_every_rank[4-tcp-
    0-mesh-kill] in about 50 on two loaded cores). An own failure about rank 0, or about
    this rank alone, is raised as it is."""
    ours, rank0 = trio.testing.memory_stream_pair()
    follower = _control.Follower(attrs.evolve(config_of(4), rank=3), StreamConnection(ours))
    follower.joined = True  # rank 0 watches the channel: the failure is reported on it
    failed = trio.Event()

    async def share() -> None:
        failed.set()
        raise own

    async def rank_0_dies() -> None:
        await failed.wait()
        await trio.testing.wait_all_tasks_blocked()  # the report is sent, the verdict awaited
        await rank0.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rank_0_dies)
        with pytest.raises(Exception) as raised:  # noqa: PT011 (either, checked below)
            await follower.run(share)
    if blamed is None:
        assert raised.value is own
        return
    error = raised.value
    assert isinstance(error, RendezvousError), error
    assert (error.peer, error.__cause__) == (0, own)
    assert str(error).startswith("rank 3: rank 0 left during set-up ("), error


# -- across hosts: one rank cannot reach another ---------------------------------------------


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with open_hosts(3) as made:
        yield made


def run_on_hosts(
    hosts: Hosts, out_dir: Path, port: int, open_s: dict[int, float]
) -> dict[int, dict[str, Any]]:
    """One rank per host, TCP with a secret; each rank's reports once all have exited."""
    secret, job = secrets.token_hex(32), f"setup-{os.getpid()}"
    processes: list[subprocess.Popen[str]] = []
    try:
        for rank in range(3):
            env = {
                key: value
                for key, value in os.environ.items()
                if not key.startswith(("TRIORING_", "MASTER_"))
                and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
            }
            env.update(
                RANK=str(rank),
                WORLD_SIZE="3",
                MASTER_ADDR=hosts.address(0),
                MASTER_PORT=str(port),
                TRIORING_SECRET=secret,
                TRIORING_JOB_ID=job,
                SETUP_OPEN_S=str(open_s[rank]),
                PYTHONUNBUFFERED="1",
            )
            log = (out_dir / f"w{rank}.log").open("w")
            argv = [sys.executable, str(WORKERS_DIR / WORKER), "open", str(out_dir), str(rank)]
            processes.append(hosts.popen(rank, argv, env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.monotonic() + max(open_s.values()) + WAIT_S
        for rank, process in enumerate(processes):
            code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            assert code == 0, (rank, (out_dir / f"w{rank}.log").read_text())
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return {r: json.loads((out_dir / f"w{r}.json").read_text()) for r in range(3)}


def test_a_refused_connection_between_two_ranks_fails_every_rank(
    hosts: Hosts, tmp_path: Path
) -> None:
    """Host 2 resets its own SYNs to host 1: rank 2 cannot connect to rank 1 and raises at
    once. Ranks 0 and 1 used to wait in open_communicator for their whole deadline (60 s in
    the report); now they raise RendezvousError naming rank 2 and why, within PROMPT_S."""
    hosts.iptables(
        2, "-A", "OUTPUT", "-d", hosts.address(1), "-p", "tcp", "--syn",
        "-j", "REJECT", "--reject-with", "tcp-reset",
    )  # fmt: skip
    reports = run_on_hosts(hosts, tmp_path, 29781, {0: 40, 1: 40, 2: 40})
    failed = open_error(reports[2])
    assert failed["type"] == "RendezvousError", failed
    assert "cannot connect to rank 1" in failed["message"], failed
    assert "refused" in failed["message"].lower(), failed
    for rank in (0, 1):
        error = open_error(reports[rank])
        assert error["type"] == "RendezvousError", (rank, error)
        assert error["peer"] == 2, (rank, error)
        assert "rank 2 failed: cannot connect to rank 1" in error["message"], (rank, error)
        assert open_step(reports[rank])["ended"] - open_step(reports[2])["ended"] < PROMPT_S


def test_dropped_syns_end_every_rank_when_one_gives_up(hosts: Hosts, tmp_path: Path) -> None:
    """Host 2 drops its SYNs to host 1: rank 2's connection attempt hangs until its own
    deadline (3 s; the others' are 40 s). Rank 0 used to open regardless (and fail at its
    first collective) while rank 1 waited for rank 2 until its deadline; now rank 2's giving
    up ends everyone's set-up, naming rank 2."""
    hosts.iptables(2, "-A", "OUTPUT", "-d", hosts.address(1), "-p", "tcp", "--syn", "-j", "DROP")
    reports = run_on_hosts(hosts, tmp_path, 29782, {0: 40, 1: 40, 2: 3})
    assert open_error(reports[2])["type"] == "TooSlowError", reports[2]
    for rank in (0, 1):
        error = open_error(reports[rank])
        assert error["type"] == "RendezvousError", (rank, error)
        assert error["peer"] == 2, (rank, error)
        assert "rank 2 gave up" in error["message"], (rank, error)
        assert open_step(reports[rank])["ended"] - open_step(reports[2])["ended"] < PROMPT_S


# -- a rank arriving after rank 0 refused the world ------------------------------------------


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
def test_a_late_rank_says_rank_0_may_have_refused_the_world(worlds: Worlds, mode: str) -> None:
    """Rank 1 says WORLD_SIZE=4 in a world of 3: rank 0 refuses it and both exit. Rank 2
    arrives afterwards and finds nobody. It cannot know whether rank 0 has not started yet
    or is already gone, so when its deadline fires it says that nothing listens there and
    that rank 0 may have exited after refusing the world, instead of only "rank 0 never
    answered"."""
    out_dir = worlds.out_dir()
    port = free_tcp_port() if mode == "tcp" else None
    socket_dir = worlds.socket_dir() if mode == "unix-dir" else None

    def spawn(rank: int, **extra: str) -> Worker:
        env = worlds.world_env(mode, 3, rank, port=port, socket_dir=socket_dir)
        env.update(extra)
        return worlds.spawn(WORKER, ["open", str(out_dir), str(rank)], env)

    early = [spawn(0), spawn(1, WORLD_SIZE="4")]
    for worker in early:
        assert worker.wait() == 0, worker.log_text()
        error = open_error(worker.report())
        assert error["type"] == "RendezvousError", error
        assert "WORLD_SIZE=4" in error["message"], error
    late = spawn(2, SETUP_OPEN_S="1")
    assert late.wait() == 0, late.log_text()
    assert open_error(late.report())["type"] == "TooSlowError"
    log = late.log_text()
    line = next((x for x in log.splitlines() if "rank 0 never answered" in x), None)
    assert line is not None, log
    assert line.startswith("WARNING"), line
    assert "nothing listens there" in line or "no rendezvous socket there" in line, line
    assert "after it refused the world" in line, line


# -- a rank with the wrong secret -------------------------------------------------------------


def test_a_wrong_secret_is_a_warning_on_rank_0(worlds: Worlds) -> None:
    """Rank 1 has another TRIORING_SECRET: it raises at once (rank 0 failed to prove the
    secret to it). Rank 0, waiting for it, used to log the rejected handshake at INFO only,
    so nobody saw why the world never formed: now it is a WARNING naming the claimed rank
    and TRIORING_SECRET, and when rank 0 gives up it says how many connections it
    rejected."""
    out_dir = worlds.out_dir()
    port = free_tcp_port()
    workers = []
    for rank in (0, 1):
        env = worlds.world_env("tcp", 2, rank, port=port, socket_dir=None)
        env.update(TRIORING_SECRET=secrets.token_hex(32), TRIORING_JOB_ID="wrong-secret")
        workers.append(worlds.spawn(WORKER, ["open", str(out_dir), str(rank)], env))
    rank0, rank1 = workers
    assert rank1.wait() == 0, rank1.log_text()
    error = open_error(rank1.report())
    assert error["type"] == "RendezvousError", error
    assert "secret" in error["message"], error
    pattern = re.compile(
        r"^WARNING trioring rank 0: rejected a connection during the rendezvous: .*"
        r"rank 1 of a world of 2; different TRIORING_SECRET\?",
        re.MULTILINE,
    )

    def warned() -> bool:
        if rank0.popen.poll() is not None:
            pytest.fail(f"rank 0 exited:\n{rank0.log_text()}")
        return pattern.search(rank0.log_text()) is not None

    poll_until(warned, "rank 0's warning")
    (out_dir / "w0.giveup").touch()
    assert rank0.wait() == 0, rank0.log_text()
    assert open_error(rank0.report())["type"] == "TooSlowError"
    assert "ranks 1 never joined; it rejected 1 connection(s)" in rank0.log_text()


# -- in one process: what a rank logs when rank 0 never answers ------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("TRIORING_") or key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("MASTER_PORT", raising=False)


async def open_as_rank_1(port: int, seconds: float) -> None:
    with pytest.raises(trio.TooSlowError), trio.fail_after(seconds):
        async with trioring.open_communicator(
            rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, transport="tcp"
        ):
            pass


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.usefixtures("clean_env")
async def test_nobody_listening_is_explained(caplog: pytest.LogCaptureFixture) -> None:
    port = free_tcp_port()
    await open_as_rank_1(port, 0.3)
    [message] = warnings_of(caplog)
    assert f"rank 0 never answered at 127.0.0.1:{port}: connection refused" in message


@pytest.mark.usefixtures("clean_env")
async def test_deadline_inside_a_connection_attempt_still_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A listener whose accept queue is full drops our SYN, so the deadline fires inside
    trio.open_tcp_stream, which raises a group of Cancelled: the warning used to be lost."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # Linux queues one connection, then drops further SYNs
        filler.connect(listener.getsockname())
        port = listener.getsockname()[1]
        await open_as_rank_1(port, 0.5)
    [message] = warnings_of(caplog)
    assert "rank 0 never answered" in message, message
    assert "got no answer at all" in message, message


@pytest.mark.usefixtures("clean_env")
async def test_a_listener_that_never_answers_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """The connection is accepted (by the kernel) but nothing ever answers the handshake:
    not "rank 0 was still waiting for other ranks", which it never said."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        await open_as_rank_1(listener.getsockname()[1], 0.3)
    [message] = warnings_of(caplog)
    assert "accepted the connection but never answered the handshake" in message, message


@pytest.mark.usefixtures("clean_env")
async def test_a_long_wait_for_rank_0_is_reported_while_it_lasts(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_rendezvous, "_STILL_WAITING_FIRST_S", 0.05)
    await open_as_rank_1(free_tcp_port(), 0.5)
    messages = warnings_of(caplog)
    assert any("still waiting for rank 0" in m and "connection refused" in m for m in messages)


@pytest.mark.usefixtures("clean_env")
async def test_rank_0_says_who_it_still_waits_for(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of a world of 3 whose other ranks never start: it says which ranks it waits
    for while it waits, as the others say they wait for it, and once more when its deadline
    ends the wait."""
    monkeypatch.setattr(_rendezvous, "_STILL_WAITING_FIRST_S", 0.05)
    monkeypatch.setattr(_rendezvous, "_STILL_WAITING_EVERY_S", 0.1)
    port = free_tcp_port()
    with pytest.raises(trio.TooSlowError), trio.fail_after(0.5):
        async with trioring.open_communicator(
            rank=0, world_size=3, master_addr="127.0.0.1", master_port=port, transport="tcp"
        ):
            pass
    messages = warnings_of(caplog)
    waiting = [m for m in messages if m.startswith("rank 0: still waiting at ")]
    assert len(waiting) >= 2, messages
    assert waiting[0].startswith(f"rank 0: still waiting at 127.0.0.1:{port} after 0 s"), waiting
    assert waiting[0].endswith("for ranks 1, 2 to join (1 of 3 here)"), waiting
    assert "ranks 1, 2 never joined" in messages[-1], messages


# -- in one process: the admission of connections --------------------------------------------


def config_of(world_size: int) -> Config:
    return Config(
        rank=0,
        world_size=world_size,
        transport="tcp",
        master_addr="127.0.0.1",
        master_port=1,
        socket_dir=None,
    )


async def test_failed_authentications_are_rate_limited_warnings(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """The first failed authentication is a WARNING; the next ones within
    AUTH_WARNING_INTERVAL_S are INFO, and the next WARNING counts them. Strangers stay
    INFO."""
    caplog.set_level(logging.INFO, logger="trioring")
    admission = _setup.Admission(config_of(2), "rendezvous")
    for delay in (0, 1, 1, _setup.AUTH_WARNING_INTERVAL_S):
        await trio.sleep(delay)
        admission.reject("the client failed to prove it knows the job's secret", failed_proof=True)
    admission.reject("not a trioring handshake")
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in levels] == [
        logging.WARNING,
        logging.INFO,
        logging.INFO,
        logging.WARNING,
        logging.INFO,
    ], levels
    assert "(and 2 more like it since the last warning)" in levels[3][1]
    assert admission.rejected == 5


class _Idle(trio.abc.AsyncResource):
    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize(("world_size", "evicted"), [(2, 300 - 128), (200, 0)])
async def test_pending_handshakes_scale_with_the_world(world_size: int, evicted: int) -> None:
    """300 handshakes at once: with a world of 2 the oldest beyond 128 are evicted, but a
    world of 200 ranks may have all of its own in progress (twice its size), so none is."""
    admission = _setup.Admission(config_of(world_size), "rendezvous")
    release = trio.Event()

    async def handshake() -> None:
        await release.wait()

    async with trio.open_nursery() as nursery:
        for _ in range(300):
            nursery.start_soon(admission.run, _Idle(), handshake)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.rejected == evicted
        release.set()


# -- what rank 0 compares in a hello -----------------------------------------------------------


def _rank0_config(forced: str = "") -> Config:
    return _config.resolve(
        rank=0,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29500,
        transport="unix",
        env={"TRIORING_ALGORITHM": forced},
    )


def _hello(**changes: object) -> dict[str, Any]:
    hello: dict[str, Any] = {
        "rank": 1,
        "world_size": 2,
        "transport": "unix",
        "address": "/tmp/x",
        "version": trioring.__version__,
        "algorithms": {},
    }
    hello.update(changes)
    return {name: value for name, value in hello.items() if value is not None}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        (
            {"version": "0.0.9"},
            f"rank 1 runs trioring 0.0.9 but rank 0 runs trioring {trioring.__version__}: "
            "every rank must run the same version",
        ),
        # A trioring from before the hello named its version.
        (
            {"version": None, "algorithms": None},
            f"rank 1 runs an older trioring but rank 0 runs trioring {trioring.__version__}",
        ),
        (
            {"algorithms": {"allreduce": "ring"}},
            "rank 1 forces TRIORING_ALGORITHM='allreduce=ring'",
        ),
        ({"algorithms": ["allreduce"]}, "rank 1 sent a malformed list of forced algorithms"),
        ({"algorithms": []}, "rank 1 sent a malformed list of forced algorithms"),
        ({"world_size": 3}, "rank 1 says WORLD_SIZE=3 but rank 0 says WORLD_SIZE=2"),
        ({"transport": "tcp"}, "rank 1 uses transport 'tcp' but rank 0 uses 'unix'"),
    ],
)
def test_what_rank_0_refuses_in_a_hello(changes: dict[str, Any], expected: str | None) -> None:
    """Rank 0 refuses a world whose ranks disagree on anything that decides the frames on
    the wire: the world, the transport, trioring's version and the forced algorithms (the
    last two sent by every rank's hello; one without them comes from an older trioring).
    The multi-process refusals, and what every rank raises, are in
    test_multiprocess_errors.py."""
    problem = _rendezvous._disagreement(_rank0_config(), 1, _hello(**changes))
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert expected in problem, problem


def test_rank_0_names_both_sides_of_a_forced_algorithm() -> None:
    problem = _rendezvous._disagreement(_rank0_config("broadcast=tree,allreduce=ring"), 1, _hello())
    assert problem == (
        "rank 1 forces no algorithm (TRIORING_ALGORITHM is unset or empty) but rank 0 forces "
        "TRIORING_ALGORITHM='allreduce=ring,broadcast=tree': every rank must force the same "
        "algorithms, which decide the frames on the wire"
    )
    same = {"allreduce": "ring", "broadcast": "tree"}
    assert (
        _rendezvous._disagreement(
            _rank0_config("broadcast=tree,allreduce=ring"), 1, _hello(algorithms=same)
        )
        is None
    )
