"""Which CPUs a rank and its one-host peers may run on, and what that means for how a rank
waits for them: whether it may poll (the spin feature), and whether it must yield its CPU
before anything else (SharedSlots.oversubscribed).

A rank's own affinity alone does not say whether its peers share its CPUs. Launchers pin
ranks one per core (Open MPI's ``mpirun`` binds each of 2 ranks to a core by default;
``srun --cpu-bind``, ``taskset``, ``numactl``): each rank may then run on one CPU, and its
peers run on others. Judged by its own affinity, such a rank took itself for one of several
ranks on one CPU: it turned polling off, and with it the shared segment, and yielded first
at every wait. Pinned one per core on 2 cores, a 4-byte scatter at world 2 took 155-282 us
per call instead of 24-60 unpinned, an allreduce 43-71 instead of 23-26, a gather 103-131
instead of 13-22 (8 loops of 500 calls). With the peers' own affinities read (by the pid
the kernel gives for a Unix socket's other end), the same pinned ranks took 35-44, 18-22
and 14-36.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, final

import attrs

from ._cma import peer_pid

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .._config import Config
    from .._framing import Link

__all__ = ["Cpus", "cpu_vendor", "cpus_of", "spin_for"]


@final
@attrs.frozen
class Cpus:
    #: The CPUs this process may run on.
    mine: frozenset[int]
    #: Those of each one-host peer, or None where they are not known: peers over TCP (they
    #: may be on other hosts), or one whose affinity could not be read.
    peers: tuple[frozenset[int], ...] | None

    @property
    def polling_helps(self) -> bool:
        """Whether a wait for a peer may poll before it parks: not when a peer may run only
        on this rank's one CPU, since it could not answer while we poll. Unknown peers count
        as such a peer (the rule before peers were looked at)."""
        if len(self.mine) > 1:
            return True
        if self.peers is None:
            return False
        return not any(cpus <= self.mine for cpus in self.peers)

    def together(self) -> int:
        """How many CPUs this rank and its one-host peers may run on, all of them together;
        0 where a peer's are not known."""
        if self.peers is None:
            return 0
        return len(self.mine.union(*self.peers))

    def oversubscribed(self, world_size: int) -> bool:
        """Whether this rank shares its CPUs with more ranks than there are CPUs among them
        (this rank, and every peer that may run on one of its CPUs): then a wait yields the
        CPU before anything else, since the peer it waits for may need this very one."""
        if self.peers is None:
            return world_size > len(self.mine)
        sharing = [cpus for cpus in self.peers if cpus & self.mine]
        return 1 + len(sharing) > len(self.mine.union(*sharing))


def cpus_of(links: Iterable[Link] | None) -> Cpus:
    """This process's CPUs, and those of the peers at the other end of ``links`` (Unix
    connections; None: not on one host)."""
    mine = frozenset(os.sched_getaffinity(0))
    if links is None:
        return Cpus(mine, None)
    peers = []
    for link in links:
        try:
            pid = peer_pid(link.connection.socket)  # type: ignore[attr-defined]
            # 0 when the peer is in a pid namespace we cannot see (where affinity(0) would
            # be our own).
            if pid <= 0:
                return Cpus(mine, None)
            peers.append(frozenset(os.sched_getaffinity(pid)))
        except OSError:
            return Cpus(mine, None)
    return Cpus(mine, tuple(peers))


def spin_for(config: Config, cpus: Cpus) -> float:
    """How long a communicator's waits poll before they park: TRIORING_SPIN_US where it was
    given; else the default where polling can help (:attr:`Cpus.polling_helps`), or 0."""
    if config.spin_given or cpus.polling_helps:
        return config.spin_seconds
    return 0.0


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as the kernel names it (``vendor_id`` in /proc/cpuinfo:
    ``GenuineIntel``, ``AuthenticAMD``), or "" where it names none. The same for every
    process on a host, so every rank of a one-host communicator reads the same; read once
    per process (the pipe's limits and the slots' pieces both go by it)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
                if not line.strip():
                    break  # the first CPU's block ended without one
    except OSError:
        pass
    return ""
