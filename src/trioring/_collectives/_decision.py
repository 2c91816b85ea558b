"""The decision table: which algorithm runs a collective, by array size and by the one-host
paths that every rank agreed on at opening. Every choice trioring makes is here.

==========  ======================================================  ======================
collective  condition, first match wins                             algorithm
==========  ======================================================  ======================
allreduce   "shm" and nbytes <= the segment's share (<= 4 KiB)      ``shm``
allreduce   "cma" and nbytes > CMA_MIN_BYTES                        ``cma``
allreduce   nbytes <= min(SMALL_ALLREDUCE_BYTES, chunk_bytes)        ``recursive_doubling``
allreduce   otherwise                                               ``ring``
broadcast   "shm" and nbytes <= SHM_MAX_BYTES                       ``shm``
broadcast   "cma" and nbytes > CMA_MIN_BYTES                        ``cma``
broadcast   otherwise                                               ``tree``
barrier     "shm"                                                   ``shm``
barrier     otherwise                                               ``dissemination``
allgather   total nbytes <= SMALL_ALLGATHER_BYTES                   ``bruck``
allgather   otherwise                                               ``ring``
allgatherv  total nbytes <= SMALL_ALLGATHER_BYTES                   ``bruck``
allgatherv  otherwise                                               ``ring``
==========  ======================================================  ======================

===============  ===================================  =========
collective       condition (see REDUCE_FAMILY below)  algorithm
===============  ===================================  =========
reduce_scatter   nbytes <= min(SMALL_REDUCE_SCATTER_BYTES,  ``recursive_halving``
                 chunk_bytes)
reduce_scatter   otherwise                            ``ring``
reduce_scatterv  as reduce_scatter (total nbytes)     as reduce_scatter
reduce           any size                             ``tree``
===============  ===================================  =========

The world size enters only through the limits: the shared-memory allreduce needs 2 p arrays'
worth of scratch (p the largest power of two <= world size). A world of one runs whichever
is chosen without any I/O.

Forcing (for tests and experts): ``Communicator._force_algorithm(collective, name)``, or
``TRIORING_ALGORITHM=allreduce=ring,broadcast=tree`` read by ``open_communicator()``,
replaces the row's choice for every call of that collective. The algorithm decides the
frames on the wire, so it must be forced identically on every rank: ranks that disagree
never take wrong data for right (frames carry the call's identity), but raise
``ProtocolError`` or, where two ranks never exchange a frame, wait until a deadline. A
forced algorithm that cannot run a call here (no shared segment, an array too large for it)
raises ``InvalidArgumentError`` before any I/O, never falls back to another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import ConfigurationError
from .._onehost._shm import SHM_MAX_BYTES

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "ALGORITHMS",
    "CMA_MIN_BYTES",
    "SMALL_ALLGATHER_BYTES",
    "SMALL_ALLREDUCE_BYTES",
    "SMALL_REDUCE_SCATTER_BYTES",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "parse_forced",
    "reduce",
    "reduce_scatter",
]

#: Arrays up to this size (and the scratch buffer, DEFAULT_CHUNK_BYTES) are allreduced by
#: recursive doubling: log2 n exchanges of the whole array, in few messages and no tasks,
#: which measured faster than the ring below it on 2 to 4 ranks. Larger ones go by the ring
#: (bandwidth-optimal), unless cross-memory attach takes them (CMA_MIN_BYTES).
SMALL_ALLREDUCE_BYTES = 1024 * 1024
#: Arrays above this size are allreduced and broadcast by cross-memory attach, when all ranks
#: agreed to use it at opening (one host, Unix transport, the kernel allows it): below, the
#: rounds of notices cost more than the copies they save. Measured on 2 and 4 ranks with the
#: Unix transport's 1 MiB send buffers, in alternating blocks of one run: at 256 and 512 KiB
#: the sockets were faster for both collectives (allreduce 369-615 us against 621-960 at
#: world 4), at 1 MiB the two were even, and from 2 MiB cross-memory attach was 2-3x faster.
CMA_MIN_BYTES = 512 * 1024
#: Allgathers (and allgathervs) of up to this many bytes in all go by Bruck's algorithm
#: (ceil(log2 n) rounds at any world size), larger ones by the ring (bandwidth-optimal, n-1
#: steps). MPICH's defaults (Thakur, Rabenseifner and Gropp 2005): recursive doubling for
#: power-of-two worlds below 512 KiB in all, Bruck below 80 KiB otherwise, ring above;
#: trioring has no recursive doubling allgather (Bruck takes as many rounds). Measured here
#: (median of 50-200 float32 allgathers, Unix and TCP, 2 shared cores, 1 MiB chunks): the
#: ring's tasks cost it ~100 us at world 2 and ~700 us at world 4 on small arrays, so Bruck
#: won up to 256 KiB in all (79-117 against 179-231 us at world 2, 510-590 against 970-1040
#: at world 4); at 384 KiB the ring won at world 2 (191-276 against 324-477 us, Bruck's
#: halves no longer fitting the socket buffers), at 512 KiB the two were even at world 4,
#: and at 1 MiB the ring won at both. No one-host path yet.
SMALL_ALLGATHER_BYTES = 256 * 1024

#: Every algorithm of every collective, by the name that forcing uses.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("shm", "cma", "recursive_doubling", "ring"),
    "broadcast": ("shm", "cma", "tree"),
    "barrier": ("shm", "dissemination"),
    "allgather": ("bruck", "ring"),
    "allgatherv": ("bruck", "ring"),
    "reduce_scatter": ("recursive_halving", "ring"),
    "reduce_scatterv": ("recursive_halving", "ring"),
    "reduce": ("tree",),
    "gather": ("tree",),
    "gatherv": ("tree",),
    "scatter": ("tree",),
    "scatterv": ("tree",),
    "alltoall": ("bruck", "pairwise"),
    "alltoallv": ("pairwise",),
    "scan": ("recursive_doubling",),
    "exscan": ("recursive_doubling",),
}

# REDUCE_FAMILY: reduce_scatter and reduce_scatterv go by recursive halving up to
# SMALL_REDUCE_SCATTER_BYTES (and one chunk: it sends each half in one frame, through the
# scratch buffer), by the ring above; reduce by the binomial tree. Thakur, Rabenseifner and Gropp (2005) cost the ring reduce-scatter at
# (n-1) alpha + ((n-1)/n) m (beta + gamma): bandwidth-optimal, and MPICH's choice for long
# messages is its pairwise exchange, the same cost; for short ones (< 512 KiB in all,
# commutative ops, which all of trioring's are) MPICH uses recursive halving,
# log2 n alpha + ((n-1)/n) m (beta + gamma), and SMALL_REDUCE_SCATTER_BYTES is that limit,
# not yet measured here. For reduce, MPICH takes the binomial tree,
# ceil(log2 n) (alpha + m beta + m gamma), up to 2 KiB and Rabenseifner's reduce-scatter +
# gather, 2 log2 n alpha + 2 ((n-1)/n) m beta + ((n-1)/n) m gamma, above: not written yet,
# so reduce has one row. No one-host path for the family yet.
SMALL_REDUCE_SCATTER_BYTES = 512 * 1024


def allreduce(nbytes: int, shm_bytes: int, cma: bool, small_bytes: int) -> str:
    """The allreduce row for an array of ``nbytes``: ``shm_bytes`` is the largest array the
    shared segment takes (-1 without one), ``cma`` whether cross-memory attach was agreed,
    ``small_bytes`` the largest array recursive doubling takes. (Positional, and the limits
    worked out by the caller once, so that a 4-byte allreduce pays little for asking.)"""
    if nbytes <= shm_bytes:
        return "shm"
    if cma and nbytes > CMA_MIN_BYTES:
        return "cma"
    if nbytes <= small_bytes:
        return "recursive_doubling"
    return "ring"


def broadcast(nbytes: int, shm: bool, cma: bool) -> str:
    """The broadcast row for an array of ``nbytes``."""
    if shm and nbytes <= SHM_MAX_BYTES:
        return "shm"
    if cma and nbytes > CMA_MIN_BYTES:
        return "cma"
    return "tree"


def barrier(*, shm: bool) -> str:
    """The barrier row."""
    return "shm" if shm else "dissemination"


def allgather(total_nbytes: int) -> str:
    """The allgather and allgatherv row, by the bytes gathered on every rank (for
    allgatherv known only after the counts are exchanged, identically on every rank)."""
    return "bruck" if total_nbytes <= SMALL_ALLGATHER_BYTES else "ring"


def reduce_scatter(nbytes: int, small_bytes: int) -> str:
    """The reduce_scatter and reduce_scatterv row for an input of ``nbytes``, the same on
    every rank; ``small_bytes`` is the largest input recursive halving takes here (see
    REDUCE_FAMILY above)."""
    return "recursive_halving" if nbytes <= small_bytes else "ring"


def reduce() -> str:
    """The reduce row (see REDUCE_FAMILY above)."""
    return "tree"


def check_forced(collective: str, name: str, *, source: str = "forced algorithm") -> None:
    """Raise ConfigurationError unless ``name`` is an algorithm of ``collective``."""
    if collective not in ALGORITHMS:
        known = ", ".join(ALGORITHMS)
        raise ConfigurationError(
            f"{source}: unknown collective {collective!r}; expected one of {known}"
        )
    if name not in ALGORITHMS[collective]:
        known = ", ".join(ALGORITHMS[collective])
        raise ConfigurationError(
            f"{source}: {collective} has no algorithm {name!r}; expected one of {known}"
        )


def parse_forced(env: Mapping[str, str]) -> dict[str, str]:
    """TRIORING_ALGORITHM (``allreduce=ring,broadcast=tree``) as {collective: algorithm}."""
    raw = env.get("TRIORING_ALGORITHM", "").strip()
    forced: dict[str, str] = {}
    if not raw:
        return forced
    source = f"TRIORING_ALGORITHM={raw!r}"
    for item in raw.split(","):
        collective, equals, name = (part.strip() for part in item.partition("="))
        if not equals or not collective or not name:
            raise ConfigurationError(
                f"{source}: expected comma-separated COLLECTIVE=ALGORITHM pairs, such as "
                "allreduce=ring,broadcast=tree"
            )
        check_forced(collective, name, source=source)
        if forced.get(collective, name) != name:
            raise ConfigurationError(f"{source}: {collective} is forced twice")
        forced[collective] = name
    return forced
