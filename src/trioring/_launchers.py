"""What the common launchers tell a process about its place in the job.

trioring reads its settings in this order (first found wins): an explicit argument of
``open_communicator``, then ``TRIORING_RANK`` / ``TRIORING_WORLD_SIZE`` /
``TRIORING_MASTER_ADDR`` / ``TRIORING_MASTER_PORT``, then the PyTorch-style ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, then what a launcher set:

* torchrun: ``RANK`` and ``WORLD_SIZE`` as usual; the port is ``MASTER_PORT + 1``.
* Open MPI ``mpirun``: ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``; when every rank
  is on this host (``OMPI_COMM_WORLD_LOCAL_SIZE`` equals the size) and no address is given,
  Unix sockets in a per-user, per-job directory need none.
* MPICH / Hydra ``mpiexec``: ``PMI_RANK`` / ``PMI_SIZE``; all-local runs (``MPI_LOCALNRANKS``
  equals the size) likewise.
* SLURM ``srun``: ``SLURM_PROCID`` / ``SLURM_NTASKS``; the address is the first host of
  ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``), the port
  ``15000 + SLURM_JOB_ID % 10000``; a step on one node (``SLURM_STEP_NUM_NODES`` is 1) needs
  neither, as all-local MPI runs.

Where the launcher says every rank is on this host (torchrun: ``LOCAL_WORLD_SIZE`` equals
``WORLD_SIZE``), the transport is Unix sockets, meeting at an address where one is given.

Under torchrun the agent's own store already listens on ``MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``), so trioring's rank 0 listens on the next port unless
``TRIORING_MASTER_PORT`` says otherwise.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, final

import attrs

from ._util import socket_temp_root

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["LauncherHints", "detect", "expand_hostlist"]


@final
@attrs.frozen(kw_only=True)
class LauncherHints:
    """Defaults derived from a launcher's variables; each value comes with the variable (or
    rule) it was derived from, for error messages."""

    launcher: str | None = None
    rank: tuple[str, str] | None = None
    world_size: tuple[str, str] | None = None
    master_addr: tuple[str, str] | None = None
    master_port: tuple[str, str] | None = None
    #: Every rank of the job runs on this host, as the launcher says (the variables that say
    #: so, for messages), or None: trioring then takes Unix sockets and its one-host paths.
    all_local: str | None = None
    #: Where those ranks can meet without an address (a directory each derives by itself),
    #: or None: the rendezvous then goes through the address the launcher gave.
    local_socket_dir: str | None = None


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed host lists: ``"node[01-03,07],gpu5"`` gives
    ``["node01", "node02", "node03", "node07", "gpu5"]``. Zero padding is kept, several
    bracket groups in one name multiply out (``"r[1-2]n[1,3]"``). Raises ``ValueError``."""
    items: list[str] = []
    depth, start = 0, 0
    for index, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {hostlist!r}")
        elif char == "," and depth == 0:
            items.append(hostlist[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    hosts: list[str] = []
    for item in (i.strip() for i in items):
        if item:
            hosts.extend(_expand_one(item, hostlist))
    return hosts


def _expand_one(pattern: str, whole: str) -> list[str]:
    match = _BRACKET.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    results: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in host list {whole!r}")
        if dash:
            width = len(low)
            numbers = range(int(low), int(high) + 1)
            values = [str(n).zfill(width) for n in numbers]
        else:
            values = [low]
        for value in values:
            results.extend(_expand_one(head + value + tail, whole))
    return results


def _local_socket_dir(job: str) -> str:
    # One directory per user and job under the system temp dir, known to every local rank
    # without any communication. The rendezvous socket inside it is job-specific too.
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[-40:]
    name = f"trioring-{os.getuid()}-{safe}"
    return os.path.join(socket_temp_root(len(name)), name)


def _same(env: Mapping[str, str], local: str, world: str) -> str | None:
    """``"local == world"`` where both variables are set and equal: every rank is local."""
    size = _get(env, world)
    return f"{local} == {world}" if size is not None and _get(env, local) == size else None


def detect(env: Mapping[str, str]) -> LauncherHints:
    """Read the launcher variables of ``env`` (never the process environment itself)."""
    if _get(env, "TORCHELASTIC_RUN_ID") or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        port = _get(env, "MASTER_PORT")
        derived = None
        if port is not None and port.isdigit():
            derived = (
                str(int(port) + 1),
                "MASTER_PORT+1 (torchrun's agent listens on MASTER_PORT)",
            )
        # One agent per node starts LOCAL_WORLD_SIZE ranks: equal to WORLD_SIZE, this node's
        # agent is the only one (torchrun always sets MASTER_ADDR: no directory needed).
        return LauncherHints(
            launcher="torchrun",
            master_port=derived,
            all_local=_same(env, "LOCAL_WORLD_SIZE", "WORLD_SIZE"),
        )

    if _get(env, "OMPI_COMM_WORLD_RANK") is not None:
        rank, size = _get(env, "OMPI_COMM_WORLD_RANK"), _get(env, "OMPI_COMM_WORLD_SIZE")
        all_local = _same(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE")
        job = _get(env, "PMIX_NAMESPACE") or _get(env, "OMPI_MCA_ess_base_jobid")
        return LauncherHints(
            launcher="openmpi",
            rank=(rank, "OMPI_COMM_WORLD_RANK") if rank else None,
            world_size=(size, "OMPI_COMM_WORLD_SIZE") if size else None,
            all_local=all_local,
            local_socket_dir=_local_socket_dir(f"ompi-{job or os.getppid()}")
            if all_local
            else None,
        )

    if _get(env, "PMI_RANK") is not None:
        rank, size = _get(env, "PMI_RANK"), _get(env, "PMI_SIZE")
        all_local = _same(env, "MPI_LOCALNRANKS", "PMI_SIZE")
        # Hydra sets no job id; the ranks on one host share their parent, the proxy.
        return LauncherHints(
            launcher="mpich",
            rank=(rank, "PMI_RANK") if rank else None,
            world_size=(size, "PMI_SIZE") if size else None,
            all_local=all_local,
            local_socket_dir=_local_socket_dir(f"hydra-{os.getppid()}") if all_local else None,
        )

    if _get(env, "SLURM_PROCID") is not None:
        rank, size = _get(env, "SLURM_PROCID"), _get(env, "SLURM_NTASKS")
        nodelist_var = next(
            (
                name
                for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if _get(env, name)
            ),
            None,
        )
        job = _get(env, "SLURM_JOB_ID")
        # A step on one node: every task is local, and they meet in a directory named after
        # the job and step, with no address (the node's name would need a secret) nor port.
        one_node = _get(env, "SLURM_STEP_NUM_NODES") == "1" and job is not None
        master_addr = None
        if nodelist_var is not None and not one_node:
            hosts = expand_hostlist(env[nodelist_var])
            if hosts:
                master_addr = (hosts[0], f"first host of {nodelist_var}")
        master_port = None
        if job is not None and job.isdigit():
            master_port = (str(15000 + int(job) % 10000), "15000 + SLURM_JOB_ID % 10000")
        step = _get(env, "SLURM_STEP_ID") or "batch"
        return LauncherHints(
            launcher="slurm",
            rank=(rank, "SLURM_PROCID") if rank else None,
            world_size=(size, "SLURM_NTASKS") if size else None,
            master_addr=master_addr,
            master_port=master_port,
            all_local="SLURM_STEP_NUM_NODES == 1" if one_node else None,
            local_socket_dir=_local_socket_dir(f"slurm-{job}.{step}") if one_node else None,
        )
    return LauncherHints()
