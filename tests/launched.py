"""Run a worker script on ``n`` ranks and read the JSON report each rank wrote
(``rank{r}.json`` in ``out_dir``), for tests whose ranks all report the same way.

Over Unix sockets the ranks are forked by the session's fork server (workers/forkserver.py),
with the environment ``trioring run --transport unix`` gives its ranks: a rank starts in
milliseconds instead of spending ~0.6 s of CPU importing numpy, trio and trioring, which for
the ~250 tests here, at 2-5 ranks each on 2 cores, was about 4 minutes of the suite.
``trioring run`` itself is tested in test_launcher.py, test_launch_env.py and by the
documentation's examples. Over TCP the ranks still go through ``trioring run``: it hands rank
0 a socket already listening on the rendezvous port, where a port picked here could be taken
by someone else before rank 0 binds it."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

#: Bound on one launched world, start to exit.
TIMEOUT_S = 120
WORKERS_DIR = Path(__file__).parent / "workers"
#: Variables a CI runner (or torchrun) may have set that would leak into the workers.
SCRUBBED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def threads_expected(world_size: int, *, push: bool = True) -> bool:
    """Whether ranks forked or launched from this process on one host, with cross-memory
    attach and the shared segment, have ``"threads"`` among their features: they inherit
    this process's CPUs, which must number two for every reader of a broadcast, and the
    root must not be writing into their arrays instead (see :func:`broadcast_pushes`;
    ``push`` False: the ranks turned pushing off)."""
    import trioring
    from trioring._onehost._cma_collectives import READ_THREADS

    return (
        trioring.is_available("threads")
        and len(os.sched_getaffinity(0)) >= READ_THREADS * (world_size - 1)
        and world_size > 1
        and not (push and broadcast_pushes(world_size))
    )


def push_expected(world_size: int) -> bool:
    """Whether ranks forked or launched from this process on one host, with cross-memory
    attach and the shared segment, have ``"push"`` among their features."""
    import trioring

    return trioring.is_available("push") and world_size > 1


def broadcast_pushes(world_size: int) -> bool:
    """Whether, with ``"push"``, such ranks' large broadcasts are pushed: they inherit this
    process's CPUs, which must number one for every rank."""
    return push_expected(world_size) and len(os.sched_getaffinity(0)) >= world_size


def base_env() -> dict[str, str]:
    """This process's environment without rendezvous or trioring settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in SCRUBBED and not key.startswith("TRIORING_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_ports(count: int = 1) -> int:
    """A port p such that p .. p + count - 1 were all free on loopback a moment ago, below
    the kernel's range of ephemeral ports: a port from that range (as ``bind(0)`` gives)
    can be taken meanwhile by any connection's local end, and once was (torchrun's own to
    its store: EADDRINUSE for trioring's rank 0 at the port after torchrun's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, max(10_000 + count, ephemeral - count))
        with contextlib.ExitStack() as stack:
            try:
                for offset in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            return port
    raise AssertionError(f"no {count} adjacent free ports")


def load_module(name: str, path: Path) -> Any:
    """Import the file ``path`` as a module called ``name`` (a worker, a docs hook: files
    that are not on ``sys.path`` as a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


forkserver = load_module("trioring_tests_forkserver", WORKERS_DIR / "forkserver.py")
_server: Any = None


def fork_server() -> Any:
    """This process's fork server, started on first use; stopped (and every child it still
    has killed and reaped) when the process exits, or by :func:`close_fork_server`."""
    global _server
    if _server is None:
        _server = forkserver.ForkServer(env=base_env())
        atexit.register(close_fork_server)
    if not _server.alive:
        raise AssertionError("the fork server died")
    return _server


def close_fork_server() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def forked_world(
    worker: Path,
    worker_args: Sequence[str],
    out_dir: Path,
    n: int,
    env: Mapping[str, str],
    *,
    timeout: float = TIMEOUT_S,
) -> tuple[dict[int, int | None], str]:
    """Fork ``n`` ranks of ``worker`` over Unix sockets in a fresh directory and wait for all
    of them, at most ``timeout`` seconds in all; kill whichever still runs then. Each rank's
    exit code (None: killed at the deadline) and their logs."""
    server = fork_server()
    socket_dir = tempfile.mkdtemp(prefix="trt-")
    job = {
        # What trioring run gives each job: its own id and secret.
        "TRIORING_JOB_ID": f"test-{secrets.token_hex(6)}",
        "TRIORING_SECRET": secrets.token_hex(32),
        "TRIORING_TRANSPORT": "unix",
        "TRIORING_SOCKET_DIR": socket_dir,
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
    }
    logs = [out_dir / f"rank{rank}.log" for rank in range(n)]
    pids: list[int] = []
    codes: dict[int, int | None] = {}
    try:
        for rank in range(n):
            rank_env = {**base_env(), **job, "RANK": str(rank), "LOCAL_RANK": str(rank), **env}
            pids.append(server.spawn(str(worker), list(worker_args), rank_env, str(logs[rank])))
        deadline = time.monotonic() + timeout
        for rank, pid in enumerate(pids):
            codes[rank] = server.wait(pid, max(0.0, deadline - time.monotonic()))
    finally:
        for pid in pids:
            if server.poll(pid) is None:
                server.signal(pid, signal.SIGKILL)
                server.wait(pid, 30)
        shutil.rmtree(socket_dir, ignore_errors=True)
    output = "".join(
        f"--- rank {rank} (exit {codes.get(rank)}) ---\n"
        + (log.read_text(errors="replace") if log.exists() else "")
        for rank, log in enumerate(logs)
    )
    return codes, output


def _launched(
    worker: Path, worker_args: Sequence[str], n: int, transport: str, env: Mapping[str, str]
) -> tuple[int, str]:
    """Run ``worker`` under ``trioring run``, in its own process group (killed whole if it
    overruns); its exit status and output."""
    args = [sys.executable, "-m", "trioring", "run", "-n", str(n), "--transport", transport]
    args += ["--no-tag-output", str(worker), *worker_args]
    process = subprocess.Popen(
        args,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output, _ = communicate_or_kill(process, TIMEOUT_S)
    return process.returncode, output


def communicate_or_kill(process: subprocess.Popen[str], timeout: float) -> tuple[str, str | None]:
    """``process.communicate`` within ``timeout``; past it, or on any error, its whole
    session (the launcher and its ranks) is killed and reaped first."""
    try:
        return process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def run_reports(
    worker: Path,
    worker_args: Sequence[str],
    out_dir: Path,
    n: int,
    *,
    transport: str = "unix",
    env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``n`` ranks; every rank must exit 0."""
    if transport == "unix":
        codes, output = forked_world(worker, worker_args, out_dir, n, env or {})
        assert all(code == 0 for code in codes.values()), output
    else:
        code, output = _launched(worker, worker_args, n, transport, env or {})
        assert code == 0, output
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def run_killed(
    worker: Path,
    worker_args: Sequence[str],
    out_dir: Path,
    victim: int,
    *,
    n: int = 4,
    env: Mapping[str, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """Run ``worker`` on ``n`` ranks over Unix sockets, one of which (``victim``) SIGKILLs
    itself; every other rank must exit by itself, having written its report, and the victim
    must have written nothing. The survivors' reports (``rank{r}.json``), by rank."""
    codes, output = forked_world(worker, worker_args, out_dir, n, env or {})
    assert codes[victim] == -signal.SIGKILL, output
    assert None not in codes.values(), f"a survivor was still running after {TIMEOUT_S} s\n{output}"
    assert not (out_dir / f"rank{victim}.json").exists()
    return {
        rank: json.loads((out_dir / f"rank{rank}.json").read_text())
        for rank in range(n)
        if rank != victim
    }


#: Bound on one `trioring run` of run_launcher (its ranks import numpy and trio, on a busy
#: machine).
LAUNCHER_DEADLINE_S = 45.0


def run_launcher(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m trioring run ARGS`` to completion, killed with every rank if it takes
    longer than LAUNCHER_DEADLINE_S."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trioring", "run", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stdout, stderr = communicate_or_kill(process, LAUNCHER_DEADLINE_S)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def write_script(tmp_path: Path, source: str) -> Path:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(source))
    return script
