"""Settings derived from launchers' environments (recorded from real runs; see
shared notes) and the documented precedence."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import trioring
from trioring._config import Config, resolve
from trioring._launchers import detect, expand_hostlist

if TYPE_CHECKING:
    from collections.abc import Iterator

# Recorded from torchrun 2.13 (--nproc-per-node 3, default master port), trimmed.
TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "3",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "3",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "0",
}
# Open MPI 4.1 mpirun -np 3 on one host.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    "OMPI_COMM_WORLD_NODE_RANK": "0",
    "PMIX_RANK": "2",
    "PMIX_NAMESPACE": "prterun-host-12345@1",
}
# MPICH 4.0 Hydra mpiexec -n 3 on one host.
MPICH = {"PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}
# srun -N 4 -n 8 (from the srun manual's variables).
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-09,12]",
    "SLURM_STEP_NODELIST": "gpu[07-09,12]",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_STEP_NUM_NODES": "4",
}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp root short enough for socket paths: pytest's own ``tmp_path`` may not be (its
    test-named directories pass 60 bytes), and then the derived directories would go to
    the real /tmp."""
    path = Path(tempfile.mkdtemp(prefix="tl-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(env: dict[str, str], **kwargs: object) -> Config:
    args: dict[str, object] = dict.fromkeys(
        ("rank", "world_size", "master_addr", "master_port", "transport")
    )
    args.update(kwargs)
    return resolve(env=env, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("x[8-10]", ["x8", "x9", "x10"]),
        ("r[1-2]n[01,3]", ["r1n01", "r1n3", "r2n01", "r2n3"]),
        ("gpu[007-008]", ["gpu007", "gpu008"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "n[a-b]", "n[1-x]"])
def test_expand_hostlist_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def test_torchrun_uses_the_next_port() -> None:
    c = config(TORCHRUN)
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (1, 3, "127.0.0.1", 29501)
    assert detect(TORCHRUN).launcher == "torchrun"
    # TRIORING_MASTER_PORT overrides the convention; an argument beats everything.
    assert config({**TORCHRUN, "TRIORING_MASTER_PORT": "40000"}).master_port == 40000
    assert config(TORCHRUN, master_port=41000).master_port == 41000


def test_slurm_rank_size_address_port() -> None:
    c = config({**SLURM, "TRIORING_SECRET": "s" * 32})
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (5, 8, "gpu07", 15000 + 4242)
    assert c.credentials.job_id == "slurm-4242.0"
    # MASTER_ADDR / MASTER_PORT set in the job script win over the derived ones.
    c = config({**SLURM, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"})
    assert (c.master_addr, c.master_port) == ("127.0.0.1", 23456)


def test_slurm_step_on_one_node_needs_no_address_nor_secret(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """srun -N 1 -n 4: the tasks meet in a directory named after the job and step, so no
    node name (which would need a secret) and no port; then Unix sockets."""
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))
    one_node = {
        **SLURM,
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "gpu07",
        "SLURM_STEP_NODELIST": "gpu07",
        "SLURM_TASKS_PER_NODE": "4",
    }
    c = config(one_node)
    assert (c.rank, c.world_size, c.transport, c.master_addr) == (3, 4, "unix", None)
    assert c.rendezvous_over_socket_dir
    assert c.socket_dir == str(short_tmp / f"trioring-{os.getuid()}-slurm-4242.0")
    assert c.transport_source == "slurm (every rank on this host: SLURM_STEP_NUM_NODES == 1)"
    # Every task derives the same directory; the next step another one.
    assert config({**one_node, "SLURM_PROCID": "0"}).socket_dir == c.socket_dir
    assert config({**one_node, "SLURM_STEP_ID": "1"}).socket_dir != c.socket_dir
    # An address set in the job script is where they meet; TRIORING_TRANSPORT still wins.
    given = config({**one_node, "MASTER_ADDR": "127.0.0.1"})
    assert (given.transport, given.master_addr, given.master_port) == ("unix", "127.0.0.1", 19242)
    with pytest.raises(trioring.ConfigurationError, match="MASTER_ADDR is not set"):
        config({**one_node, "TRIORING_TRANSPORT": "tcp"})


def test_slurm_without_secret_is_refused_for_remote_hosts() -> None:
    with pytest.raises(trioring.ConfigurationError, match="MASTER_ADDR=gpu07 is not a loopback"):
        config(SLURM)


def test_torchrun_with_every_rank_here_takes_unix_sockets() -> None:
    """torchrun always gives an address: the ranks meet there, then talk over Unix sockets
    (and the one-host paths) when its one agent started them all."""
    c = config(TORCHRUN)
    assert (c.transport, c.socket_dir, c.rendezvous_over_socket_dir) == ("unix", None, False)
    assert (
        c.transport_source == "torchrun (every rank on this host: LOCAL_WORLD_SIZE == WORLD_SIZE)"
    )
    # Two nodes of three ranks each: TCP, as before.
    two_nodes = {**TORCHRUN, "WORLD_SIZE": "6", "GROUP_WORLD_SIZE": "2"}
    assert config(two_nodes).transport == "tcp"
    # An older torchrun without LOCAL_WORLD_SIZE cannot say: TCP.
    unsaid = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    assert config(unsaid).transport == "tcp"
    # The user's choice wins, and a world of one needs no transport of its own.
    assert config({**TORCHRUN, "TRIORING_TRANSPORT": "tcp"}).transport == "tcp"
    assert config(TORCHRUN, transport="tcp").transport == "tcp"
    alone = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    assert config(alone).transport == "tcp"


def test_open_mpi_with_an_address() -> None:
    c = config({**OPENMPI, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23000"})
    # Every rank on this host: they meet at the address, then talk over Unix sockets.
    assert (c.rank, c.world_size, c.transport) == (2, 3, "unix")
    assert (c.master_addr, c.master_port, c.rendezvous_over_socket_dir) == (
        "127.0.0.1",
        23000,
        False,
    )
    assert c.credentials.job_id == "PMIX_NAMESPACE=prterun-host-12345@1"
    tcp = {
        **OPENMPI,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "23000",
        "TRIORING_TRANSPORT": "tcp",
    }
    assert config(tcp).transport == "tcp"
    across = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert config({**across, "MASTER_PORT": "23000"}).transport == "tcp"


def test_mpi_on_one_host_with_a_socket_dir(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)
    c = config({**MPICH, "TRIORING_SOCKET_DIR": str(tmp_path)})
    assert (c.transport, c.socket_dir, c.master_addr) == ("unix", str(tmp_path), None)
    assert c.rendezvous_over_socket_dir


@pytest.mark.parametrize("env", [OPENMPI, MPICH], ids=["openmpi", "mpich"])
def test_mpi_on_one_host_needs_no_address(env: dict[str, str]) -> None:
    c = config(env)
    assert c.transport == "unix"
    assert c.master_addr is None
    assert c.socket_dir is not None
    assert c.rendezvous_over_socket_dir
    info = os.stat(c.socket_dir)
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    # Every rank of the job derives the same directory by itself.
    rank_variable = "OMPI_COMM_WORLD_RANK" if "OMPI_COMM_WORLD_RANK" in env else "PMI_RANK"
    other_rank = {**env, rank_variable: "1"}
    assert config(other_rank).socket_dir == c.socket_dir
    os.rmdir(c.socket_dir)


def test_mpi_across_hosts_needs_an_address() -> None:
    env = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(trioring.ConfigurationError, match="MASTER_ADDR is not set"):
        config(env)


def test_precedence_argument_then_trioring_then_pytorch_then_launcher() -> None:
    env = {
        **SLURM,
        "RANK": "3",
        "WORLD_SIZE": "8",
        "TRIORING_RANK": "4",
        "MASTER_ADDR": "127.0.0.2",
        "TRIORING_MASTER_ADDR": "127.0.0.3",
        "MASTER_PORT": "20000",
        "TRIORING_MASTER_PORT": "20001",
    }
    c = config(env)
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (4, 8, "127.0.0.3", 20001)
    c = config(env, rank=6, master_addr="localhost", master_port=30000)
    assert (c.rank, c.master_addr, c.master_port) == (6, "localhost", 30000)
    without_trioring = {k: v for k, v in env.items() if not k.startswith("TRIORING_")}
    c = config(without_trioring)
    assert (c.rank, c.master_addr, c.master_port) == (3, "127.0.0.2", 20000)


def test_errors_name_the_derived_source() -> None:
    with pytest.raises(trioring.ConfigurationError, match=r"SLURM_PROCID='x' is not an integer"):
        config({**SLURM, "SLURM_PROCID": "x", "MASTER_ADDR": "127.0.0.1"})


def test_private_socket_dir_of_another_mode_is_refused(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))
    c = config(MPICH)
    assert c.socket_dir is not None
    os.chmod(c.socket_dir, 0o755)
    with pytest.raises(trioring.ConfigurationError, match="not a private directory"):
        config(MPICH)


def test_ifname_selects_the_listening_address() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2000"}
    assert config({**env, "TRIORING_IFNAME": "lo"}).interface_address == "127.0.0.1"
    with pytest.raises(trioring.ConfigurationError, match="TRIORING_IFNAME='nope0' is not"):
        config({**env, "TRIORING_IFNAME": "nope0"})


def test_derived_socket_dirs_leave_a_long_tmpdir_for_tmp(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket path must fit in 107 bytes: under a TMPDIR too long for that, the directory
    every rank derives goes under /tmp (the same for every rank); a short TMPDIR is kept."""
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))
    assert os.path.dirname(config(MPICH).socket_dir or "") == str(short_tmp)
    long_tmpdir = short_tmp / ("x" * 90)
    long_tmpdir.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(long_tmpdir))
    c = config(MPICH)
    assert c.socket_dir is not None
    assert os.path.dirname(c.socket_dir) == "/tmp"
    assert len(os.path.join(c.socket_dir, "trioring-0123456789ab.sock")) <= 107
    assert config({**MPICH, "PMI_RANK": "2"}).socket_dir == c.socket_dir
    os.rmdir(c.socket_dir)
