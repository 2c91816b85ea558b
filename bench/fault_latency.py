"""How long survivors take to report a SIGKILLed peer (the fail-fast goal of the failure model).

Run by hand (not by pytest), from the repository root::

    .venv/bin/python bench/fault_latency.py [--worlds 2,4,8] [--reps 20] [--phase allreduce]

For each world size, ``--reps`` times: start a world (Unix sockets in a fresh socket directory,
or TCP with ``--transport tcp``) of ``tests/workers/fault_worker.py kill`` workers, forked by
the test suite's fork server; wait until every rank has announced it is entering the
collective; SIGKILL one rank (rank ``rep % world_size``, so every position takes its turn);
and read, from each survivor's report, when its collective raised. Latency = that moment
minus the moment the signal was sent, both ``time.monotonic()`` (CLOCK_MONOTONIC, shared by
every process on the host). Prints median, p90 and max per world, over every survivor and
over the slowest survivor of each run, with the project's targets: every survivor within 2 s,
median under 200 ms.

``--phase between`` kills a rank that is idle between collectives while the others wait for
it in a small allreduce; ``allreduce`` (the default) kills it in the middle of an allreduce of
``--elements`` float32s (64 MiB by default).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
WORKER = str(WORKERS / "fault_worker.py")
TARGET_MAX_S = 2.0
TARGET_MEDIAN_S = 0.2


def load_forkserver() -> Any:
    spec = importlib.util.spec_from_file_location("forkserver", WORKERS / "forkserver.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def base_env() -> dict[str, str]:
    scrub = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in scrub and not k.startswith("TRIORING_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_until(condition: Any, what: str, timeout: float = 60.0, poll: float = 0.001) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(poll)


def one_run(
    server: Any, world_size: int, victim: int, phase: str, elements: int, transport: str
) -> tuple[dict[int, float], dict[int, bool]]:
    """Returns (latency by survivor, whether that survivor named the victim)."""
    out_dir = Path(tempfile.mkdtemp(prefix="trfl-"))
    socket_dir = tempfile.mkdtemp(prefix="trt-")
    port = free_port()
    pids: dict[int, int] = {}
    try:
        for rank in range(world_size):
            env = base_env()
            env.update(RANK=str(rank), WORLD_SIZE=str(world_size))
            if transport == "unix":
                env.update(TRIORING_TRANSPORT="unix", TRIORING_SOCKET_DIR=socket_dir)
            else:
                env.update(TRIORING_TRANSPORT="tcp", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            args = ["kill", str(out_dir), str(rank), str(victim), phase, "-1", str(elements)]
            pids[rank] = server.spawn(WORKER, args, env, str(out_dir / f"w{rank}.log"))
        marker = {r: "idle" if (phase == "between" and r == victim) else "entering" for r in pids}
        files = [out_dir / f"w{r}.{marker[r]}" for r in pids]

        def ready() -> bool:
            for rank, pid in pids.items():
                if server.poll(pid) is not None:
                    log = (out_dir / f"w{rank}.log").read_text(errors="replace")[-2000:]
                    raise SystemExit(f"rank {rank} exited early:\n{log}")
            return all(path.exists() for path in files)

        wait_until(ready, "every rank to enter the collective")
        t_kill = server.signal(pids[victim], signal.SIGKILL)
        if t_kill is None:
            raise SystemExit(f"rank {victim} ended before the kill")
        latencies, named = {}, {}
        for rank, pid in pids.items():
            code = server.wait(pid, 60)
            if rank == victim:
                continue
            if code != 0:
                log = (out_dir / f"w{rank}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"rank {rank} exited with {code}:\n{log}")
            report = json.loads((out_dir / f"w{rank}.json").read_text())
            step = report["steps"]["collective"]
            if step["error"] is None:
                raise SystemExit(f"rank {rank}: the collective completed despite the kill")
            latencies[rank] = step["t1"] - t_kill
            named[rank] = step["error"]["peer"] == victim
        return latencies, named
    finally:
        for pid in pids.values():
            if server.poll(pid) is None:
                server.signal(pid, signal.SIGKILL)
                server.wait(pid, 30)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(socket_dir, ignore_errors=True)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes")
    parser.add_argument("--reps", type=int, default=20, help="runs per world size")
    parser.add_argument("--phase", choices=["allreduce", "between"], default="allreduce")
    parser.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--transport", choices=["unix", "tcp"], default="unix")
    options = parser.parse_args()
    server = load_forkserver().ForkServer(env=base_env())
    print(
        f"SIGKILL detection latency, phase={options.phase}, transport={options.transport}, "
        f"{options.reps} runs per world, {os.cpu_count()} CPUs"
    )
    header = (
        f"{'world':>5} {'samples':>7} {'median':>8} {'p90':>8} {'max':>8}   "
        f"{'slowest/run: median':>19} {'max':>8}   named victim"
    )
    print(header)
    print("-" * len(header))
    failed_targets = False
    try:
        for world_size in (int(w) for w in options.worlds.split(",")):
            every: list[float] = []
            slowest: list[float] = []
            named_total = named_count = 0
            for rep in range(options.reps):
                latencies, named = one_run(
                    server,
                    world_size,
                    rep % world_size,
                    options.phase,
                    options.elements,
                    options.transport,
                )
                every.extend(latencies.values())
                slowest.append(max(latencies.values()))
                named_total += len(named)
                named_count += sum(named.values())
            ms = 1000.0
            print(
                f"{world_size:>5} {len(every):>7} {statistics.median(every) * ms:>6.1f}ms "
                f"{percentile(every, 0.9) * ms:>6.1f}ms {max(every) * ms:>6.1f}ms   "
                f"{statistics.median(slowest) * ms:>17.1f}ms {max(slowest) * ms:>6.1f}ms   "
                f"{named_count}/{named_total}"
            )
            if max(every) > TARGET_MAX_S or statistics.median(every) > TARGET_MEDIAN_S:
                failed_targets = True
    finally:
        server.close()
    print(
        f"targets (G1): every survivor <= {TARGET_MAX_S * 1000:.0f} ms, median <= "
        f"{TARGET_MEDIAN_S * 1000:.0f} ms: {'MISSED' if failed_targets else 'met'}"
    )
    sys.exit(1 if failed_targets else 0)


if __name__ == "__main__":
    main()
