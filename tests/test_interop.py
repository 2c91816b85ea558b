"""trioring under the launchers people already use, and across (namespaced) hosts.

* torchrun: torch's CPU wheel comes from the ``interop`` dependency group (installed by
  ``make test``). Its agent holds ``MASTER_PORT``; trioring uses ``MASTER_PORT + 1``, then
  Unix sockets, every rank being local. Tensors passed where arrays belong are refused with
  what to pass instead.
* Open MPI mpirun: Debian's ``openmpi-bin`` (installed by ``make test`` when running as root,
  as CI does); all ranks on one host, so Unix sockets, with no address at all or meeting at
  the one given.
* Three network namespaces joined by a bridge, one rank in each with its own non-loopback
  address, talking TCP with a shared secret. Needs root (CI has it); if the namespaces cannot
  be created the test fails with the reason.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio

import trioring
from clean_env import clean_env
from launched import free_ports
from netns import Hosts, open_hosts

if TYPE_CHECKING:
    from collections.abc import Iterator

WORKER = Path(__file__).parent / "workers" / "interop_worker.py"
TIMEOUT = 90


def free_port_pair() -> int:
    """A port p such that p and p + 1 were both free a moment ago (torchrun takes p, and
    trioring p + 1), below the ephemeral range (see launched.free_ports)."""
    return free_ports(2)


def reports(stdout: str) -> list[dict[str, Any]]:
    # Launchers do not keep the ranks' lines apart (torchrun may glue them together), but each
    # report is one flat JSON object.
    found = [json.loads(text) for text in re.findall(r'\{"rank"[^{}]*\}', stdout)]
    return sorted(found, key=lambda report: report["rank"])


def check_world(found: list[dict[str, Any]], size: int, transport: str) -> None:
    assert [report["rank"] for report in found] == list(range(size)), found
    for report in found:
        assert report["world_size"] == size
        assert report["transport"] == transport
        assert report["allreduce_ok"], report
        assert report["broadcast_ok"], report
        # Unix sockets bring the one-host paths with them; TCP never does.
        one_host = {"shm", "cma"} & set(report["features"])
        expected = (
            {name for name in ("shm", "cma") if trioring.is_available(name)}
            if transport == "unix"
            else set()
        )
        assert one_host == expected, report


def torchrun_command() -> list[str]:
    """torchrun starting 3 ranks on this host, its agent on a free port."""
    torchrun = Path(sys.executable).with_name("torchrun")
    assert torchrun.exists(), (
        "torchrun is missing: install the interop dependency group (make test does it)"
    )
    return [
        *(str(torchrun), "--nnodes=1", "--nproc-per-node=3", "--master-addr=127.0.0.1"),
        f"--master-port={free_port_pair()}",
    ]


def mpirun_command(*options: str) -> list[str]:
    """Open MPI's mpirun starting 3 Python ranks on this host, with ``options``."""
    mpirun = shutil.which("mpirun")
    assert mpirun is not None, (
        "mpirun is missing: install Debian's openmpi-bin (make test does as root)"
    )
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "3", *options, sys.executable]


def check_launched_world(command: list[str], cwd: Path, transport: str, **env: str) -> None:
    """Run the worker under ``command`` (a launcher of 3 ranks) with ``env`` added to a clean
    environment, and check the world its ranks report."""
    result = subprocess.run(
        [*command, str(WORKER)],
        env=clean_env(**env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    check_world(reports(result.stdout), 3, transport)


@pytest.mark.parametrize(
    ("chosen", "transport"),
    [(None, "unix"), ("tcp", "tcp")],
    ids=["every-rank-local-takes-unix", "tcp-when-asked"],
)
def test_under_torchrun(tmp_path: Path, chosen: str | None, transport: str) -> None:
    """torchrun always sets MASTER_ADDR; with every rank on this host (LOCAL_WORLD_SIZE ==
    WORLD_SIZE) the ranks meet there and then talk over Unix sockets and the one-host
    paths, unless TRIORING_TRANSPORT says otherwise."""
    extra = {} if chosen is None else {"TRIORING_TRANSPORT": chosen}
    check_launched_world(torchrun_command(), tmp_path, transport, OMP_NUM_THREADS="1", **extra)


def test_under_open_mpi(tmp_path: Path) -> None:
    # All ranks on one host and no address given: Unix sockets, no TCP port at all.
    check_launched_world(mpirun_command(), tmp_path, "unix")


async def test_torch_tensors_are_refused_with_what_to_pass() -> None:
    """A torch user's first call passes a tensor: every entry point says what to pass
    instead, and what it says works (a CPU tensor's numpy view is its memory)."""
    import torch  # here, not at the top: it takes seconds, and only this test needs it

    async with trioring.testing.open_local_world(2) as comms:
        a = comms[0]
        tensor = torch.ones(3)
        parameter = torch.nn.Parameter(torch.ones(3))
        calls = [
            (
                lambda: a.allreduce(tensor),
                "allreduce #1: expected a numpy.ndarray, got torch.Tensor",
            ),
            (lambda: a.allreduce(parameter), "got torch.nn.parameter.Parameter: pass t.detach()"),
            (lambda: a.allgather(np.ones(3), out=tensor), "out=: expected a numpy.ndarray, got"),
            (
                lambda: a.send(tensor, dest=1),
                "send(dest=1, tag=0): expected a numpy array, got torch",
            ),
            (lambda: a.broadcast_object({"w": tensor}, root=0), 'obj["w"]: torch.Tensor is not'),
        ]
        for call, message in calls:
            with pytest.raises(trioring.InvalidArgumentError, match=re.escape(message)) as info:
                await call()
            assert ".numpy()" in str(info.value)
    async with trioring.testing.open_local_world(2) as comms:
        tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]
        async with trio.open_nursery() as nursery:
            for comm, tensor in zip(comms, tensors, strict=True):
                nursery.start_soon(comm.allreduce, tensor.detach().numpy())
        for tensor in tensors:
            assert tensor.tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("chosen", "transport"),
    [(None, "unix"), ("tcp", "tcp")],
    ids=["every-rank-local-takes-unix", "tcp-when-asked"],
)
def test_under_open_mpi_with_an_address(tmp_path: Path, chosen: str | None, transport: str) -> None:
    """With MASTER_ADDR the ranks meet there; every rank being local, they then talk over
    Unix sockets, unless TRIORING_TRANSPORT says otherwise."""
    address = ("-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port_pair()}")
    chosen_args = () if chosen is None else ("-x", f"TRIORING_TRANSPORT={chosen}")
    check_launched_world(mpirun_command(*address, *chosen_args), tmp_path, transport)


# -- several hosts, for real: network namespaces --------------------------------------------


@pytest.fixture
def namespaces() -> Iterator[Hosts]:
    """Three hosts on one bridge, with addresses SUBNET.1 .. SUBNET.3."""
    with open_hosts(3) as hosts:
        yield hosts


def run_in_namespaces(
    hosts: Hosts, env: dict[str, str], *, ifname: bool = False
) -> list[subprocess.CompletedProcess[str]]:
    def rank_env(rank: int) -> dict[str, str]:
        extra = {"TRIORING_IFNAME": hosts.interface(rank)} if ifname else {}
        return clean_env(RANK=str(rank), WORLD_SIZE=str(len(hosts.names)), **env, **extra)

    processes = [
        hosts.python(
            rank, str(WORKER), rank_env(rank), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank in range(len(hosts.names))
    ]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=TIMEOUT)
            results.append(
                subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


@pytest.mark.parametrize("ifname", [False, True], ids=["route-to-master", "TRIORING_IFNAME"])
def test_three_hosts_over_tcp_with_a_secret(namespaces: Hosts, ifname: bool) -> None:
    env = {
        "MASTER_ADDR": namespaces.address(0),
        "MASTER_PORT": "29777",
        "TRIORING_SECRET": secrets.token_hex(32),
        "TRIORING_JOB_ID": "netns-test",
        "WORKER_DEADLINE_S": "40",
    }
    results = run_in_namespaces(namespaces, env, ifname=ifname)
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    check_world(reports("".join(r.stdout for r in results)), 3, "tcp")


def test_three_hosts_refuse_to_run_without_a_secret(namespaces: Hosts) -> None:
    env = {"MASTER_ADDR": namespaces.address(0), "MASTER_PORT": "29778", "WORKER_DEADLINE_S": "20"}
    results = run_in_namespaces(namespaces, env)
    for result in results:
        assert result.returncode != 0
        assert "ConfigurationError" in result.stderr
        assert "TRIORING_SECRET" in result.stderr


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_under_trioring_run(tmp_path: Path, transport: str) -> None:
    """Our own launcher end to end with real collectives. With tcp, rank 0 inherits the
    launcher's listening socket (TRIORING_LISTEN_FD): if it tried to bind MASTER_PORT itself,
    it would fail, since the launcher holds that port."""
    command = [sys.executable, "-m", "trioring", "run", "-n", "3", "--transport", transport]
    check_launched_world([*command, "--no-tag-output"], tmp_path, transport)


def test_srun_environment_on_one_node(tmp_path: Path) -> None:
    """What ``srun -N 1 -n 3`` gives each task (no SLURM in CI: the processes are started with
    its variables): they meet in a directory named after the job and step, with no address,
    port or secret, and then talk over Unix sockets."""
    job = str(900_000 + secrets.randbelow(99_999))  # a directory of its own for this run
    common = {
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "3",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node01",
        "SLURM_STEP_NODELIST": "node01",
        "SLURM_NODEID": "0",
    }
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=clean_env(**common, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        outputs = [process.communicate(timeout=TIMEOUT) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, out + err
    check_world(reports("".join(out for out, _ in outputs)), 3, "unix")


@pytest.mark.parametrize("launcher", ["trioring run", "torchrun", "mpirun"])
def test_a_long_tmpdir_still_gets_unix_sockets(tmp_path: Path, launcher: str) -> None:
    """Some clusters give each job a long TMPDIR. A socket's path must fit in 107 bytes, so
    the socket directories then go under /tmp instead: the job still runs on Unix
    sockets, whichever launcher makes them (each makes its own kind of directory)."""
    long_tmpdir = tmp_path / ("job-scratch-" + "x" * 60) / "tmp"
    long_tmpdir.mkdir(parents=True)
    assert len(str(long_tmpdir)) > 80
    commands = {
        "trioring run": lambda: [sys.executable, "-m", "trioring", "run", "-n", "3"],
        "torchrun": torchrun_command,
        "mpirun": mpirun_command,
    }
    check_launched_world(
        commands[launcher](), tmp_path, "unix", TMPDIR=str(long_tmpdir), OMP_NUM_THREADS="1"
    )
