"""End-to-end tests of ``python -m trioring run``.

Ranks are small throwaway scripts that do not use the trioring core. Every rank writes a
report (its environment, pid, argv, what it saw of the socket directory) atomically once it is
ready, i.e. after its signal dispositions are set; tests and ranks that must wait for their
peers poll for these reports with a deadline instead of sleeping.

The launcher reaps every rank before it exits, so "no orphan" is checked right after the
launcher has exited: each reported pid must be gone.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from trioring._launcher import THREADS_NOTE, _Supervisor

if TYPE_CHECKING:
    from collections.abc import Iterator

# Bound on any single wait in these tests; pytest-timeout (60 s) bounds each test as a whole.
DEADLINE_S = 30.0

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    plan = json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    action = plan.get(str(rank), plan.get("default", "exit:0"))

    kind, _, arg = action.partition(":")
    if kind == "stubborn":
        # Survives SIGTERM, leaving a mark that it came: the launcher has acted on a signal.
        signal.signal(signal.SIGTERM, lambda *_: (out / f"term{rank}").touch())
    if kind == "exit-on-term":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(arg)))
    if kind in ("echo", "raise", "raise-on-term", "mismatch", "mismatch-on-term", "interrupt"):
        import trioring  # installs the launcher's excepthook (trioring._launched)

    def mismatched():
        # What rank `arg`'s float64 allreduce makes the float32 ranks raise, and it them.
        odd = int(arg)
        peer = 0 if rank == odd else odd
        calls = {
            r: f"allreduce(sum) {'float64' if r == odd else 'float32'}[4] #1"
            for r in (rank, peer)
        }
        text = ", ".join(f"rank {r}: {call}" for r, call in calls.items())
        return trioring.CollectiveMismatchError(text, calls=calls, rank=rank, peer=peer)

    if kind == "mismatch-on-term":
        # Sees the mismatch too, just after the first rank did: the launcher's SIGTERM.
        def fail_mismatched(*_):
            raise mismatched()

        signal.signal(signal.SIGTERM, fail_mismatched)
    if kind == "raise-on-term":
        # Fails on its own error as it is stopped: it was already exiting, as far as the
        # launcher can tell.
        def fail(*_):
            raise ValueError(arg)

        signal.signal(signal.SIGTERM, fail)

    socket_dir = os.environ.get("TRIORING_SOCKET_DIR")
    report = {
        "pid": os.getpid(),
        "argv": sys.argv[3:],
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TRIORING_TRANSPORT",
                "TRIORING_SOCKET_DIR", "MASTER_ADDR", "MASTER_PORT", "TRIORING_RANK",
                "TRIORING_WORLD_SIZE", "TRIORING_MASTER_ADDR", "TRIORING_MASTER_PORT",
                "OMP_NUM_THREADS", "TRIORING_RUN_DIR",
            )
        },
        "socket_dir_mode": (
            os.stat(socket_dir).st_mode if socket_dir and os.path.isdir(socket_dir) else None
        ),
    }
    tmp = out / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(out / f"rank{rank}.json")  # atomic: readers never see half a report

    def wait_for_peers():
        deadline = time.monotonic() + 20
        while len(list(out.glob("rank*.json"))) < world_size:
            if time.monotonic() > deadline:
                sys.exit(99)  # a test bug, reported as a distinct exit code
            time.sleep(0.01)

    def wait_for_exit_of(other):
        # Exited means reaped or a zombie: the launcher may not have reaped it yet.
        pid = json.loads((out / f"rank{other}.json").read_text())["pid"]
        deadline = time.monotonic() + 20
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                # Reaped before the open, or between the open and the read (ESRCH).
                return
            if state == "Z":
                return
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.01)

    if kind == "exit":
        if arg != "0":
            wait_for_peers()  # fail only once the others are up, so they must be stopped
            if "after_exit_of" in plan:
                wait_for_exit_of(plan["after_exit_of"])
        sys.exit(int(arg))
    if kind == "sigkill":
        wait_for_peers()
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "echo":
        # What a rank raises when rank `arg` failed under it: only an echo of that failure.
        wait_for_peers()
        raise trioring.PeerFailedError(
            f"rank {rank}: allreduce #1: rank {arg} failed", rank=rank, peer=int(arg)
        )
    if kind == "raise":
        wait_for_peers()
        raise ExceptionGroup("two errors", [ValueError(arg + "\\nsecond line"), KeyError(1)])
    if kind == "mismatch":
        wait_for_peers()
        raise mismatched()
    if kind in (
        "block", "stubborn", "exit-on-term", "raise-on-term", "mismatch-on-term", "interrupt"
    ):  # fmt: skip
        while True:
            signal.pause()  # "interrupt": Python's own SIGINT handler raises KeyboardInterrupt
    sys.exit(98)
    """
)


def _alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is still one of our ranks (a reused pid running something else is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during it
        return False
    return marker.encode() in cmdline


_DEFAULT_SIGNALS = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])"
)


class Job:
    """One launcher invocation over :data:`RANK_SCRIPT` in a private directory."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.script = tmp_path / "rank_script.py"
        self.script.write_text(RANK_SCRIPT)
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.launchers: list[subprocess.Popen[str]] = []

    def argv(
        self, nprocs: int, plan: dict[str, str], *options: str, extra: tuple[str, ...] = ()
    ) -> list[str]:
        return [
            sys.executable, "-m", "trioring", "run", "-n", str(nprocs), *options,
            str(self.script), str(self.out), json.dumps(plan), *extra,
        ]  # fmt: skip

    def start(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        omp_threads: str | None = "1",
        new_session: bool = False,
    ) -> subprocess.Popen[str]:
        """Start the launcher with ``env`` (default: ours) and OMP_NUM_THREADS set to
        ``omp_threads`` (None: unset), so that whether the launcher notes setting it does
        not depend on the environment the suite runs in."""
        env = dict(os.environ if env is None else env)
        env.pop("OMP_NUM_THREADS", None)
        if omp_threads is not None:
            env["OMP_NUM_THREADS"] = omp_threads
        # The launcher keeps signals it inherits as ignored (like nohup's SIGHUP), and a shell
        # running the suite in the background without job control ignores SIGINT: start it
        # with the default dispositions, whatever this process inherited.
        process = subprocess.Popen(
            [sys.executable, "-c", _DEFAULT_SIGNALS, *argv],
            cwd=self.dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=new_session,
        )
        self.launchers.append(process)
        return process

    def run(
        self, argv: list[str], env: dict[str, str] | None = None, *, omp_threads: str | None = "1"
    ) -> tuple[int, str, float]:
        """Run the launcher to completion; return (exit status, stderr, seconds taken)."""
        start = time.monotonic()
        process = self.start(argv, env, omp_threads=omp_threads)
        _, stderr = process.communicate(timeout=DEADLINE_S)
        return process.returncode, stderr, time.monotonic() - start

    def wait_reports(self, nprocs: int) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + DEADLINE_S
        while len(list(self.out.glob("rank*.json"))) < nprocs:
            assert time.monotonic() < deadline, "ranks did not report in time"
            time.sleep(0.01)
        return self.reports()

    def wait_files(self, names: list[str]) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not all((self.out / name).exists() for name in names):
            assert time.monotonic() < deadline, f"no {names} in time"
            time.sleep(0.01)

    def reports(self) -> dict[int, dict[str, Any]]:
        return {
            int(path.stem.removeprefix("rank")): json.loads(path.read_text())
            for path in self.out.glob("rank*.json")
        }

    def assert_no_rank_alive(self) -> None:
        pids = [report["pid"] for report in self.reports().values()]
        assert pids, "no rank reported"
        alive = [pid for pid in pids if _alive(pid, str(self.script))]
        assert not alive, f"ranks still running: {alive}"

    def cleanup(self) -> None:
        # Only reached with something left over when a test already failed: don't leak
        # processes into the rest of the session. Only pids we started, checked by cmdline.
        for launcher in self.launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
        for report in self.reports().values():
            if _alive(report["pid"], str(self.script)):
                os.kill(report["pid"], signal.SIGKILL)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    job = Job(tmp_path)
    try:
        yield job
    finally:
        job.cleanup()


def assert_unix_rendezvous(reports: dict[int, dict[str, Any]]) -> None:
    """All ranks shared one private socket directory, and it is gone now."""
    dirs = {report["env"]["TRIORING_SOCKET_DIR"] for report in reports.values()}
    assert len(dirs) == 1
    (socket_dir,) = dirs
    assert socket_dir
    for report in reports.values():
        assert report["env"]["TRIORING_TRANSPORT"] == "unix"
        mode = report["socket_dir_mode"]
        assert mode is not None, "socket directory did not exist while the rank ran"
        assert stat.S_ISDIR(mode)
        assert stat.S_IMODE(mode) == 0o700
        assert report["env"]["MASTER_ADDR"] is None
        assert report["env"]["MASTER_PORT"] is None
    assert not os.path.exists(socket_dir)


@pytest.mark.parametrize("nprocs", [1, 3])
def test_success_sets_rank_environment(job: Job, nprocs: int) -> None:
    status, stderr, _ = job.run(job.argv(nprocs, {}))
    assert (status, stderr) == (0, "")
    reports = job.reports()
    assert sorted(reports) == list(range(nprocs))
    for rank, report in reports.items():
        env = report["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(nprocs)
    assert_unix_rendezvous(reports)
    job.assert_no_rank_alive()


def test_arguments_pass_through_untouched(job: Job) -> None:
    extra = ("-n", "7", "--grace", "x", "--", "--transport", "tcp")
    status, stderr, _ = job.run(job.argv(2, {}, "--", extra=extra))
    assert (status, stderr) == (0, "")
    reports = job.reports()
    assert [reports[r]["argv"] for r in range(2)] == [list(extra)] * 2
    assert all(report["env"]["TRIORING_TRANSPORT"] == "unix" for report in reports.values())


def test_module_mode(job: Job) -> None:
    (job.dir / "rank_module.py").write_text(RANK_SCRIPT)
    argv = [
        sys.executable, "-m", "trioring", "run", "-n", "2", "-m", "rank_module",
        str(job.out), "{}", "--flag",
    ]  # fmt: skip
    status, stderr, _ = job.run(argv)
    assert (status, stderr) == (0, "")
    reports = job.reports()
    assert sorted(reports) == [0, 1]
    assert all(report["argv"] == ["--flag"] for report in reports.values())


def test_tcp_transport_sets_master_addr_and_port(job: Job) -> None:
    # Stale variables of the other transport must not leak into the ranks.
    env = {**os.environ, "TRIORING_SOCKET_DIR": "/nonexistent", "MASTER_PORT": "1"}
    status, stderr, _ = job.run(job.argv(3, {}, "--transport", "tcp"), env=env)
    assert (status, stderr) == (0, "")
    reports = job.reports()
    ports = {report["env"]["MASTER_PORT"] for report in reports.values()}
    assert len(ports) == 1
    (port,) = ports
    assert 1024 <= int(port) <= 65535
    for report in reports.values():
        assert report["env"]["TRIORING_TRANSPORT"] == "tcp"
        assert report["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert report["env"]["TRIORING_SOCKET_DIR"] is None


def test_unix_transport_drops_stale_tcp_variables(job: Job) -> None:
    env = {**os.environ, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"}
    status, _, _ = job.run(job.argv(2, {}, "--transport", "unix"), env=env)
    assert status == 0
    assert_unix_rendezvous(job.reports())


def test_stale_trioring_rank_variables_are_dropped(job: Job) -> None:
    """TRIORING_RANK and friends outrank RANK in open_communicator: left over from the
    calling shell, they would give every rank the same rank."""
    stale = {
        "TRIORING_RANK": "0",
        "TRIORING_WORLD_SIZE": "7",
        "TRIORING_MASTER_ADDR": "10.0.0.1",
        "TRIORING_MASTER_PORT": "1",
    }
    status, _, _ = job.run(job.argv(2, {}), env={**os.environ, **stale})
    assert status == 0
    for rank, report in job.reports().items():
        assert report["env"]["RANK"] == str(rank)
        assert all(report["env"][name] is None for name in stale), report["env"]


def test_failing_rank_stops_the_others(job: Job) -> None:
    grace = 20.0
    status, stderr, elapsed = job.run(
        job.argv(4, {"default": "block", "2": "exit:3"}, "--grace", str(grace))
    )
    assert status == 3
    assert stderr == (
        "trioring run: rank 2 exited with code 3 (first failure); terminated ranks 0, 1, 3\n"
    )
    # Blocked ranks die of SIGTERM at once: nobody waited for the grace period to end.
    assert elapsed < grace
    assert_unix_rendezvous(job.reports())
    job.assert_no_rank_alive()


def test_rank_killed_by_signal(job: Job) -> None:
    status, stderr, _ = job.run(job.argv(3, {"default": "block", "1": "sigkill"}))
    assert status == 128 + signal.SIGKILL
    assert stderr == (
        "trioring run: rank 1 was killed by SIGKILL, exit code 137 (first failure); "
        "terminated ranks 0, 2\n"
    )
    assert_unix_rendezvous(job.reports())
    job.assert_no_rank_alive()


def test_rank_ignoring_sigterm_is_killed_after_grace(job: Job) -> None:
    grace = 1.0
    status, stderr, elapsed = job.run(
        job.argv(3, {"default": "block", "0": "stubborn", "2": "exit:5"}, "--grace", str(grace))
    )
    assert status == 5
    assert stderr == (
        "trioring run: rank 2 exited with code 5 (first failure); terminated ranks 0, 1 "
        "(SIGKILL after 1 s grace: ranks 0)\n"
    )
    assert elapsed >= grace
    assert_unix_rendezvous(job.reports())
    job.assert_no_rank_alive()


def test_first_failure_wins_and_late_exits_are_not_failures(job: Job) -> None:
    # Rank 0 exits 0 early; rank 1 fails; rank 2 exits non-zero only because it was stopped.
    plan = {"0": "exit:0", "1": "exit:4", "after_exit_of": "0", "2": "exit-on-term:7"}
    status, stderr, _ = job.run(job.argv(3, plan))
    assert status == 4
    assert stderr == (
        "trioring run: rank 1 exited with code 4 (first failure); terminated ranks 2\n"
    )
    job.assert_no_rank_alive()


def test_the_first_failures_error_is_repeated_beside_the_summary(job: Job) -> None:
    """Rank 1's uncaught error is printed (traceback and all) by the rank, then once more in
    one line by the launcher, before its summary; rank 2, which fails on an error of its
    own as it is stopped, is named as such rather than as terminated."""
    plan = {"default": "block", "1": "raise:bad batch", "2": "raise-on-term:stopped"}
    status, stderr, _ = job.run(job.argv(4, plan, "--grace", "20"))
    assert status == 1, stderr
    assert stderr.count("Traceback (most recent call last)") >= 2, stderr
    # The group's first leaf, in one line, is named, with how many more there are.
    assert stderr.endswith(
        "trioring run: rank 1 raised ValueError: bad batch second line (and 1 more like it)\n"
        "trioring run: rank 1 exited with code 1 (first failure); rank 2 failed on its own "
        "too; terminated ranks 0, 3\n"
    ), stderr
    job.assert_no_rank_alive()


def test_a_mismatch_names_the_rank_whose_call_differs(job: Job) -> None:
    """Rank 2 made a float64 allreduce where the others made float32 ones. Rank 1 sees it
    first, so it is the first failure, but every rank's report of the mismatch reaches the
    launcher, which says whose call differs from the others'."""
    plan = {"default": "mismatch-on-term:2", "1": "mismatch:2"}
    status, stderr, _ = job.run(job.argv(4, plan, "--grace", "20"))
    assert status == 1, stderr
    assert stderr.endswith(
        "trioring run: rank 1 raised trioring.CollectiveMismatchError: rank 1: allreduce(sum) "
        "float32[4] #1, rank 2: allreduce(sum) float64[4] #1\n"
        "trioring run: rank 2's call differs from the other ranks' (rank 2: allreduce(sum) "
        "float64[4] #1; ranks 0, 1, 3: allreduce(sum) float32[4] #1)\n"
        "trioring run: rank 1 exited with code 1 (first failure); ranks 0, 2, 3 failed on "
        "their own too\n"
    ), stderr
    job.assert_no_rank_alive()


def echo_line(rank: int, blamed: int) -> str:
    """What a rank of kind ``echo:<blamed>`` prints instead of a traceback (trioring._launched)."""
    return (
        f"trioring.PeerFailedError: rank {rank}: allreduce #1: rank {blamed} failed "
        f"[traceback omitted by trioring run: this error only reports that rank {blamed} "
        "failed]\n"
    )


def test_echoing_rank_is_not_the_first_failure_while_its_culprit_runs(job: Job) -> None:
    """Rank 0 fails with an error that only reports rank 2's failure, and exits before rank 2
    does (as peers of a crashed rank often do). Rank 2 is still named the first failure, and
    was not stopped: it exited with its own status."""
    plan = {"default": "block", "0": "echo:2", "2": "exit:3", "after_exit_of": "0"}
    status, stderr, _ = job.run(job.argv(4, plan, "--grace", "20"))
    assert status == 3, stderr
    assert stderr == echo_line(0, 2) + (
        "trioring run: rank 2 exited with code 3 (first failure); rank 0 failed because of "
        "it; terminated ranks 1, 3\n"
    )
    job.assert_no_rank_alive()


def test_echoing_rank_is_the_first_failure_if_its_culprit_succeeds(job: Job) -> None:
    """Rank 1 exits with code 0 (it returned early, say, and closed its communicator) while
    rank 0 still needs it: rank 0's error only reports rank 1's failure. Rank 0 is the first
    failure, and the summary names rank 1 too, which nothing else would: its exit was
    clean."""
    status, stderr, _ = job.run(job.argv(2, {"0": "echo:1", "1": "exit:0"}))
    assert status == 1
    assert stderr == echo_line(0, 1) + (
        "trioring run: rank 0 exited with code 1 (first failure); no other rank was running; "
        "rank 1 exited with code 0 before rank 0, which failed waiting for it\n"
    )


def test_echoing_rank_is_the_first_failure_if_its_culprit_runs_on(job: Job) -> None:
    grace = 1.0
    plan = {"0": "echo:1", "1": "block", "2": "block"}
    status, stderr, elapsed = job.run(job.argv(3, plan, "--grace", str(grace)))
    assert status == 1
    assert stderr == echo_line(0, 1) + (
        "trioring run: rank 0 exited with code 1 (first failure); terminated ranks 1, 2\n"
    )
    assert elapsed >= grace  # rank 1 had the grace period to fail on its own
    job.assert_no_rank_alive()


def test_omp_num_threads_is_set_once_when_unset(job: Job) -> None:
    status, stderr, _ = job.run(job.argv(3, {}), omp_threads=None)
    assert status == 0
    assert stderr == THREADS_NOTE + "\n"
    reports = job.reports()
    assert [reports[r]["env"]["OMP_NUM_THREADS"] for r in range(3)] == ["1"] * 3


@pytest.mark.parametrize(("nprocs", "value"), [(3, "4"), (3, ""), (1, None)])
def test_omp_num_threads_is_left_alone(job: Job, nprocs: int, value: str | None) -> None:
    """A value the user set is kept; one rank cannot oversubscribe the machine, so it gets
    no value either (as with torchrun). An empty value counts as unset."""
    status, stderr, _ = job.run(job.argv(nprocs, {}), omp_threads=value)
    assert status == 0
    expected = "1" if value == "" else value
    assert stderr == ("" if expected == value else THREADS_NOTE + "\n")
    reports = job.reports()
    assert [reports[r]["env"]["OMP_NUM_THREADS"] for r in range(nprocs)] == [expected] * nprocs


def test_ranks_get_a_private_run_directory_that_is_removed(job: Job) -> None:
    status, _, _ = job.run(job.argv(2, {}))
    assert status == 0
    dirs = {report["env"]["TRIORING_RUN_DIR"] for report in job.reports().values()}
    assert len(dirs) == 1
    (run_dir,) = dirs
    assert run_dir
    assert not os.path.exists(run_dir)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_launcher_stops_everything(job: Job, signum: signal.Signals) -> None:
    launcher = job.start(job.argv(3, {"default": "block"}))
    job.wait_reports(3)
    launcher.send_signal(signum)
    _, stderr = launcher.communicate(timeout=DEADLINE_S)
    assert launcher.returncode == 128 + signum
    assert stderr == f"trioring run: received {signum.name}; terminated ranks 0, 1, 2\n"
    assert_unix_rendezvous(job.reports())
    job.assert_no_rank_alive()


def test_ctrl_c_reaching_every_rank_is_no_failure_of_theirs(job: Job) -> None:
    """Ctrl-C in a terminal sends SIGINT to the launcher and to every rank (one process
    group): each rank's KeyboardInterrupt is not reported as a failure of its own, and the
    ranks it ended before the launcher stopped them are said to have been killed by it."""
    launcher = job.start(job.argv(3, {"default": "interrupt"}), new_session=True)
    job.wait_reports(3)
    os.killpg(launcher.pid, signal.SIGINT)
    _, stderr = launcher.communicate(timeout=DEADLINE_S)
    assert launcher.returncode == 128 + signal.SIGINT, stderr
    summary = stderr.splitlines()[-1]
    assert re.fullmatch(
        r"trioring run: (received SIGINT|rank \d was killed by SIGINT, exit code 130 \(first "
        r"failure\))(; ranks? [\d, ]+ (was|were) killed by SIGINT too)?(; terminated ranks "
        r"[\d, ]+)?",
        summary,
    ), stderr
    for wrong in ("raised KeyboardInterrupt", "on its own", "on their own"):
        assert wrong not in stderr, stderr
    job.assert_no_rank_alive()


def test_inherited_ignored_signal_stays_ignored(job: Job) -> None:
    # As under nohup: the launcher starts with SIGHUP ignored.
    nohup = (
        "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    launcher = job.start([sys.executable, "-c", nohup, *job.argv(2, {"default": "block"})])
    job.wait_reports(2)
    launcher.send_signal(signal.SIGHUP)
    # Had SIGHUP been handled, it would have arrived first and stopped the job with 129.
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=DEADLINE_S)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert stderr == "trioring run: received SIGTERM; terminated ranks 0, 1\n"
    job.assert_no_rank_alive()


def test_second_signal_skips_the_grace_period(job: Job) -> None:
    grace = 60.0
    start = time.monotonic()
    launcher = job.start(job.argv(2, {"default": "stubborn"}, "--grace", str(grace)))
    job.wait_reports(2)
    launcher.send_signal(signal.SIGINT)
    # Only once the launcher has terminated the ranks: two signals sent back to back may
    # reach its handlers in either order (once, in a loaded CI run, it reported SIGTERM),
    # and it reports the first. A different signal, so it is not merged with the first.
    job.wait_files(["term0", "term1"])
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=DEADLINE_S)
    assert time.monotonic() - start < grace
    assert launcher.returncode == 128 + signal.SIGINT
    assert stderr == (
        "trioring run: received SIGINT; terminated ranks 0, 1 (SIGKILL at a second signal, "
        "SIGTERM: ranks 0, 1)\n"
    )
    assert_unix_rendezvous(job.reports())
    job.assert_no_rank_alive()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["-n", "0", "x.py"], "must be at least 1"),
        (["-n", "2"], "missing TARGET"),
        (["-n", "2", "--"], "missing TARGET"),
        (["-n", "2", "--grace", "-1", "x.py"], "must be a finite number"),
        (["-n", "2", "--transport", "carrier-pigeon", "x.py"], "invalid choice"),
        (["-n", "2", "no-such-script.py"], "no such script: no-such-script.py (for a module"),
    ],
)
def test_usage_errors(job: Job, options: list[str], message: str) -> None:
    status, stderr, _ = job.run([sys.executable, "-m", "trioring", "run", *options])
    assert status == 2
    assert message in stderr
    assert not job.reports()


class _Exited:
    """What the summary reads of a rank's process."""

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode
        self.pid = 0


def _summary(returncodes: list[int], **state: Any) -> tuple[int, str]:
    stderr = io.StringIO()
    exits: list[Any] = [_Exited(code) for code in returncodes]
    status = _Supervisor(processes=exits, grace=5.0, stderr=stderr, **state)._report()
    return status, stderr.getvalue()


def test_ranks_that_ended_before_the_others_were_stopped_are_named() -> None:
    """Every rank fails alike at once (a bad argument): rank 0's exit is seen first; ranks
    1 and 2 have ended too by the time the launcher stops the rest (rank 1 on an error it
    reported, rank 2 without a word); rank 3 is stopped. The summary says how each ended,
    where it named only rank 3."""
    sigterm = -signal.SIGTERM
    status, stderr = _summary(
        [2, 2, 2, sigterm], first_failure=(0, 2), terminated=[3], errors={1: "ValueError: x"}
    )
    assert status == 2
    assert stderr == (
        "trioring run: rank 0 exited with code 2 (first failure); rank 1 failed on its own "
        "too; rank 2 exited with code 2 too; terminated ranks 3\n"
    )
    _, stderr = _summary([1, 1, 1], first_failure=(2, 1))
    assert stderr.endswith(
        ": rank 2 exited with code 1 (first failure); ranks 0, 1 exited with code 1 too\n"
    )


def test_ranks_killed_by_the_signal_the_launcher_got_are_named_so() -> None:
    """Ctrl-C in a terminal reaches the ranks as well as the launcher: those it killed
    before the launcher stopped them are said to have been killed by it."""
    sigint = -signal.SIGINT
    status, stderr = _summary(
        [sigint, sigint, -signal.SIGTERM], received_signal=signal.SIGINT, terminated=[2]
    )
    assert status == 128 + signal.SIGINT
    assert stderr == (
        "trioring run: received SIGINT; ranks 0, 1 were killed by SIGINT too; terminated ranks 2\n"
    )
    _, stderr = _summary([sigint], received_signal=signal.SIGINT)
    assert stderr == "trioring run: received SIGINT; rank 0 was killed by SIGINT too\n"


def test_console_script_runs_the_launcher(job: Job) -> None:
    script = Path(sys.executable).with_name("trioring")
    assert script.exists(), "the package is installed (make test does), so its script is too"
    argv = job.argv(2, {})
    status, stderr, _ = job.run([str(script), *argv[argv.index("run") :]])
    assert (status, stderr) == (0, "")
    assert sorted(job.reports()) == [0, 1]


def test_info_json() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trioring", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=True,
    )
    data = json.loads(result.stdout)
    assert set(data["versions"]) == {"trioring", "trio", "numpy", "python"}
    assert data["versions"]["python"] == platform.python_version()
    names = {cap["name"]: cap for cap in data["capabilities"]}
    assert {"tcp", "unix"} <= set(names)
    for cap in names.values():
        assert set(cap) == {"name", "kind", "available", "reason", "description"}
        assert (cap["reason"] is None) == cap["available"]


def test_info_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trioring", "info"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["component", "version"]
    assert any(line.split()[:2] == ["python", platform.python_version()] for line in lines)
    assert any(line.split()[:3] == ["transport", "unix", "yes"] for line in lines)


TAGGED_SCRIPT = """
import os, sys
rank = os.environ["RANK"]
for i in range(200):
    # Long lines, written in pieces, so that unsynchronised forwarding would split them.
    sys.stdout.write(f"line {i} from {rank} ")
    sys.stdout.flush()
    sys.stdout.write("x" * 3000 + "\\n")
    sys.stdout.flush()
sys.stdout.write(f"unterminated {rank}")
sys.stderr.write(f"error line from {rank}\\n")
"""


def test_tag_output_prefixes_whole_lines(tmp_path: Path) -> None:
    script = tmp_path / "tagged.py"
    script.write_text(TAGGED_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "trioring", "run", "-n", "3", "--tag-output", str(script)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # no note from the launcher on stderr
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 * 201
    pattern = re.compile(r"\[(\d)\] (?:line \d+ from (\d) x{3000}|unterminated (\d))")
    for line in lines:
        match = pattern.fullmatch(line)
        assert match, line[:80]
        assert match.group(1) in (match.group(2), match.group(3))
    for rank in range(3):
        ranks_lines = [line for line in lines if line.startswith(f"[{rank}] line")]
        assert [int(line.split()[2]) for line in ranks_lines] == list(range(200))
    assert sorted(result.stderr.splitlines()) == [f"[{r}] error line from {r}" for r in range(3)]


def test_no_tag_output_passes_output_through(tmp_path: Path) -> None:
    script = tmp_path / "tagged.py"
    script.write_text(TAGGED_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "trioring", "run", "-n", "2", "--no-tag-output", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert not any(line.startswith("[") for line in result.stdout.splitlines())
    # Not a terminal, so the default is untagged too.
    default = subprocess.run(
        [sys.executable, "-m", "trioring", "run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert not any(line.startswith("[") for line in default.stdout.splitlines())
