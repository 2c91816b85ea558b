"""Shared fixtures. Keep each group of fixtures in its own marked section."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import launched

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

# =============================================================================================
# Multi-process worlds (used by test_multiprocess.py and test_multiprocess_errors.py)
#
# Each rank is a real process running a script from tests/workers/ (see _worker_util.py
# there for the worker protocol: marker files and a JSON report per worker). The `worlds`
# fixture starts them, tracks every Popen, and kills and reaps whatever is still running at
# teardown. Synchronisation is only through marker files polled with a deadline.
# =============================================================================================

WORKERS_DIR = Path(__file__).parent / "workers"
#: Bound on any single wait for worker processes or their marker files.
WAIT_S = 30.0
_POLL_S = 0.01


def free_tcp_port() -> int:
    """A loopback port that was free a moment ago (whoever binds it next may lose a race;
    :meth:`Worlds.start` retries a world whose rank 0 finds it taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def poll_until(condition: Any, what: str, timeout: float = WAIT_S) -> None:
    """Wait until ``condition()`` is true, failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(_POLL_S)


class Worker:
    """One worker process and its files in ``out_dir``."""

    def __init__(self, index: int, popen: subprocess.Popen[bytes], out_dir: Path, log: Path):
        self.index = index
        self.popen = popen
        self.out_dir = out_dir
        self.log = log

    def file(self, name: str) -> Path:
        return self.out_dir / f"w{self.index}.{name}"

    def has(self, marker: str) -> bool:
        return self.file(marker).exists()

    def report(self) -> dict[str, Any]:
        path = self.file("json")
        if not path.exists():
            pytest.fail(f"worker {self.index} wrote no report; its log:\n{self.log_text()}")
        report: dict[str, Any] = json.loads(path.read_text())
        return report

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return "(no log)"

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {self.index} still running after {timeout} s:\n{self.log_text()}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(WAIT_S)


class World:
    def __init__(self, workers: list[Worker], out_dir: Path) -> None:
        self.workers = workers
        self.out_dir = out_dir

    def wait_for(self, marker: str, indices: Sequence[int] | None = None) -> None:
        """Wait until the given workers (default: all) have created ``marker``; fail at once
        if one of them exits first."""
        chosen = [self.workers[i] for i in indices] if indices is not None else self.workers

        def ready() -> bool:
            for worker in chosen:
                if not worker.has(marker) and worker.popen.poll() is not None:
                    pytest.fail(
                        f"worker {worker.index} exited ({worker.popen.returncode}) before "
                        f"{marker!r}:\n{worker.log_text()}"
                    )
            return all(worker.has(marker) for worker in chosen)

        poll_until(ready, f"marker {marker!r}")

    def finish(
        self, indices: Sequence[int] | None = None, timeout: float = WAIT_S
    ) -> list[dict[str, Any]]:
        """Wait for the given workers (default: all) to exit, within ``timeout`` in all; check
        that each exited with status 0, and return their reports in the same order."""
        chosen = [self.workers[i] for i in indices] if indices is not None else self.workers
        deadline = time.monotonic() + timeout
        for worker in chosen:
            code = worker.wait(max(0.1, deadline - time.monotonic()))
            assert code == 0, f"worker {worker.index} exited with {code}:\n{worker.log_text()}"
        return [worker.report() for worker in chosen]


class Worlds:
    """Starts worker processes and cleans up after them (the ``worlds`` fixture)."""

    def __init__(self, tmp_path: Path) -> None:
        #: Where rendezvous ports come from (a test of the retry replaces it).
        self.free_port = free_tcp_port
        self._tmp_path = tmp_path
        self._workers: list[Worker] = []
        self._dirs: list[str] = []
        self._count = 0

    def socket_dir(self) -> str:
        """A fresh, short directory for Unix sockets (``sun_path`` holds 107 bytes, and
        pytest's ``tmp_path`` can be longer than that once a socket name is added)."""
        path = tempfile.mkdtemp(prefix="trt-")
        self._dirs.append(path)
        return path

    def out_dir(self) -> Path:
        self._count += 1
        path = self._tmp_path / f"world{self._count}"
        path.mkdir()
        return path

    @staticmethod
    def base_env() -> dict[str, str]:
        return launched.base_env()

    def spawn(self, script: str, args: Sequence[str], env: Mapping[str, str]) -> Worker:
        """Start ``tests/workers/<script> *args`` with exactly ``env``; ``args[1]`` and
        ``args[2]`` are the output directory and the worker index."""
        out_dir, index = Path(args[1]), int(args[2])
        log = out_dir / f"w{index}.log"
        with log.open("wb") as log_file:
            popen = subprocess.Popen(
                [sys.executable, str(WORKERS_DIR / script), *args],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        worker = Worker(index, popen, out_dir, log)
        self._workers.append(worker)
        return worker

    def world_env(
        self, mode: str, world_size: int, rank: int, *, port: int | None, socket_dir: str | None
    ) -> dict[str, str]:
        """The environment of one rank. How ranks find each other (``mode``): ``"tcp"``;
        ``"unix-tcp"``, Unix data sockets after a TCP rendezvous at MASTER_ADDR:MASTER_PORT;
        ``"unix-dir"``, Unix sockets only, in a shared TRIORING_SOCKET_DIR."""
        env = self.base_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        env["TRIORING_TRANSPORT"] = "tcp" if mode == "tcp" else "unix"
        if mode == "unix-dir":
            assert socket_dir is not None
            env["TRIORING_SOCKET_DIR"] = socket_dir
        elif port is not None:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return env

    def start(
        self,
        script: str,
        scenario: str,
        *,
        world_size: int,
        mode: str,
        args: Sequence[str] = (),
        ranks: Sequence[int] | None = None,
        env_overrides: Mapping[int, Mapping[str, str]] | None = None,
        retry_port_clash: bool = True,
    ) -> World:
        """Start one worker per entry of ``ranks`` (default ``range(world_size)``; worker i
        gets ``RANK=ranks[i]``), and wait until each has connected or exited.

        If rank 0 could not listen on the rendezvous port because something else took it
        since :func:`free_tcp_port` found it free, the whole world is killed and started
        again on another port (twice at most)."""
        ranks = list(range(world_size)) if ranks is None else list(ranks)
        uses_port = mode != "unix-dir" and world_size > 1
        out_dir = self.out_dir()
        for attempt in range(3):
            port = self.free_port() if uses_port else None
            socket_dir = self.socket_dir() if mode == "unix-dir" else None
            workers = []
            for index, rank in enumerate(ranks):
                env = self.world_env(mode, world_size, rank, port=port, socket_dir=socket_dir)
                env.update((env_overrides or {}).get(index, {}))
                workers.append(self.spawn(script, [scenario, str(out_dir), str(index), *args], env))
            world = World(workers, out_dir)
            retry = uses_port and retry_port_clash and attempt < 2

            def settled(workers: list[Worker] = workers, retry: bool = retry) -> bool:
                if retry and _port_clash(workers):
                    return True
                return all(w.has("connected") or w.popen.poll() is not None for w in workers)

            poll_until(settled, "every worker to connect or exit")
            if not (retry and _port_clash(workers)):
                return world
            for worker in workers:
                worker.kill()
            for path in out_dir.iterdir():
                path.unlink()
        raise AssertionError("unreachable")

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)


def _port_clash(workers: list[Worker]) -> bool:
    for worker in workers:
        if worker.popen.poll() is None or not worker.has("json"):
            continue
        error = worker.report()["steps"].get("open", {}).get("error")
        if error and error["type"] == "RendezvousError" and error["address_in_use"]:
            return True
    return False


@pytest.fixture
def worlds(tmp_path: Path) -> Iterator[Worlds]:
    """Start multi-process worlds; every process still running at teardown is killed."""
    harness = Worlds(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


# =============================================================================================
# Forked worlds (used by test_faults.py)
#
# The same workers, marker files and reports as the `worlds` fixture above, but each process
# is forked by a fork server (workers/forkserver.py) that imported numpy, trio and trioring
# once per session: a worker starts in a few milliseconds instead of ~0.5 s, which is what
# lets the fault matrix run a hundred worlds in minutes on two cores. Signals go through the
# server, which alone reaps its children, so a signal never reaches a recycled pid. At
# teardown every worker still running is continued (it may be SIGSTOPped), killed and reaped.
# Tests record latencies with `fault_latencies`; the terminal summary lists them per row.
# =============================================================================================


class ForkedProcess:
    """What :class:`Worker` and :class:`World` use of ``subprocess.Popen``, for a process
    of the fork server."""

    def __init__(self, server: Any, pid: int, args: Sequence[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = list(args)

    @property
    def returncode(self) -> int | None:
        code: int | None = self._server.exit_codes.get(self.pid)
        return code

    def poll(self) -> int | None:
        code: int | None = self._server.poll(self.pid)
        return code

    def wait(self, timeout: float | None = None) -> int:
        code: int | None = self._server.wait(self.pid, WAIT_S * 10 if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, signum: int) -> float | None:
        """Send ``signum`` unless the process ended; the ``time.monotonic()`` it was sent."""
        sent: float | None = self._server.signal(self.pid, signum)
        return sent


class ForkedWorlds(Worlds):
    """:class:`Worlds` whose workers come from the fork server (the ``forked_worlds``
    fixture). ``worker.popen`` is a :class:`ForkedProcess`."""

    def __init__(self, tmp_path: Path, server: Any) -> None:
        super().__init__(tmp_path)
        self.server = server

    def spawn(self, script: str, args: Sequence[str], env: Mapping[str, str]) -> Worker:
        out_dir, index = Path(args[1]), int(args[2])
        log = out_dir / f"w{index}.log"
        path = str(WORKERS_DIR / script)
        pid = self.server.spawn(path, list(args), dict(env), str(log))
        process = ForkedProcess(self.server, pid, [path, *args])
        worker = Worker(index, process, out_dir, log)  # type: ignore[arg-type]
        self._workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self._workers:
            if worker.popen.poll() is None:
                worker.popen.send_signal(signal.SIGCONT)
        super().close()


@pytest.fixture(scope="session")
def fork_server() -> Iterator[Any]:
    """The session's fork server, shared with launched.run_reports."""
    try:
        yield launched.fork_server()
    finally:
        launched.close_fork_server()


@pytest.fixture
def forked_worlds(tmp_path: Path, fork_server: Any) -> Iterator[ForkedWorlds]:
    """Like ``worlds``, with forked workers; every one still running at teardown is killed
    and reaped."""
    if not fork_server.alive:
        pytest.fail("the fork server died")
    harness = ForkedWorlds(tmp_path, fork_server)
    try:
        yield harness
    finally:
        harness.close()


_LATENCIES = pytest.StashKey[dict[str, list[tuple[float, bool | None]]]]()


@pytest.fixture
def fault_latencies(request: pytest.FixtureRequest) -> dict[str, list[tuple[float, bool | None]]]:
    """Per row name: (latency in seconds, whether that rank named the culprit, or None), for
    the terminal summary."""
    return request.config.stash.setdefault(_LATENCIES, {})


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    import statistics

    rows = config.stash.get(_LATENCIES, {})
    if not rows:
        return
    terminalreporter.section("fault detection latency (ms) per rank, all runs of a row")
    terminalreporter.line(
        f"{'row':<34} {'n':>4} {'median':>8} {'p90':>8} {'max':>8}  named the culprit"
    )
    for name in sorted(rows):
        values = sorted(latency for latency, _ in rows[name])
        if not values:
            continue
        named = [flag for _, flag in rows[name] if flag is not None]
        median = statistics.median(values) * 1000
        p90 = values[min(len(values) - 1, int(len(values) * 0.9))] * 1000
        naming = f"{sum(named)}/{len(named)}" if named else "-"
        terminalreporter.line(
            f"{name:<34} {len(values):>4} {median:>8.1f} {p90:>8.1f} "
            f"{values[-1] * 1000:>8.1f}  {naming}"
        )
