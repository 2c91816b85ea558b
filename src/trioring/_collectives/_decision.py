"""The decision table: which algorithm runs a collective, by array size and by the one-host
paths that every rank agreed on at opening. Every choice trioring makes is here.

==========  ======================================================  ======================
collective  condition, first match wins                             algorithm
==========  ======================================================  ======================
allreduce   "shm" and nbytes <= the segment's share (<= 256 KiB)    ``shm``
allreduce   "shm", "cma" and "push", nbytes >                       ``cma``
            PIPE_MAX_PUSHED_REDUCE_BYTES (0 on Intel CPUs; each
            rank writes its finished segment into the others')
allreduce   "shm", and nbytes <= PIPE_MAX_REDUCE_BYTES or no "cma"  ``pipe``
            (larger arrays, through the segment's pipe)
allreduce   "cma", and "shm" or nbytes > CMA_MIN_BYTES              ``cma``
allreduce   nbytes <= min(SMALL_ALLREDUCE_BYTES, chunk_bytes)       ``recursive_doubling``
allreduce   otherwise                                               ``ring``
broadcast   "shm" and nbytes <= SHM_MAX_BYTES, or <=                ``shm``
            SLOT_PAYLOAD_BYTES where the slots take it in pieces
            (no rank crowded, an Intel CPU)
broadcast   "shm" and "cma", the readers in threads (nbytes >=      ``cma``
            READ_THREADS_MIN_BYTES and two CPUs for each reader),
            or the root writing a share into theirs ("push": a
            CPU for each rank, nbytes > PUSH_MIN_BYTES and >
            PIPE_MAX_PUSHED_BROADCAST_BYTES: 0 on Intel CPUs)
broadcast   "shm" (larger arrays, through the segment's pipe)       ``pipe``
broadcast   "cma" and nbytes > CMA_MIN_BYTES                        ``cma``
broadcast   otherwise                                               ``tree``
barrier     "shm"                                                   ``shm``
barrier     otherwise                                               ``dissemination``
allgather   "shm" and each rank's block <= SHM_MAX_BYTES            ``shm``
allgather   "shm", and either n >= 3 and total <=                   ``pipe``
            PIPE_MAX_ALLGATHER_BYTES, or no "cma"
allgather   "cma", and "shm" or total nbytes > CMA_MIN_COPY_BYTES   ``cma``
allgather   n a power of 2, total <= SMALL_POW2_ALLGATHER_BYTES     ``recursive_doubling``
allgather   total nbytes <= SMALL_ALLGATHER_BYTES                   ``bruck``
allgather   otherwise                                               ``ring``
allgatherv  "shm" and every rank's block came with its counts (see  ``shm`` (not forceable)
            UNEVEN below)
allgatherv  otherwise as allgather (total nbytes, once the counts      as allgather
            are known)
alltoall    "shm" and (n-1)/n nbytes <= SHM_MAX_BYTES (own block    ``shm``
            stays out of the slot)
alltoall    "shm", and either n >= 3 and nbytes <=                  ``pipe``
            PIPE_MAX_ALLTOALL_BYTES, or no "cma"
alltoall    "cma", and "shm" or nbytes > CMA_MIN_COPY_BYTES         ``cma``
alltoall    block nbytes <= SMALL_ALLTOALL_BLOCK_BYTES and n >= 4   ``bruck``
alltoall    otherwise                                               ``pairwise``
alltoallv   "shm" and every rank's blocks came with its counts      ``shm`` (not forceable)
alltoallv   otherwise                                               ``pairwise``
gather      "shm" and each rank's block <= SHM_MAX_BYTES, or <=     ``shm``
            SLOT_PAYLOAD_BYTES where no rank is crowded
gather      "shm", and n <= 3 or total <= CMA_MIN_COPY_BYTES or no  ``pipe``
            "cma"
gather      "cma" and total nbytes > CMA_MIN_COPY_BYTES             ``cma``
gather      otherwise (an agreement round, then the binomial tree)  ``tree``
gatherv     "shm" and every non-root's block came with its counts   ``shm`` (not forceable)
gatherv     otherwise                                               ``tree``
scatter     "shm", an array on the root whose other ranks' blocks   ``shm`` (not forceable:
            fit its slot beside the header (the header round goes      only the root knows the
            through the segment whenever there is one)                 size before the round)
scatter     "shm", no "cma", an array on the root                   ``pipe``
scatter     "cma", an array on the root, total > CMA_MIN_SCATTER_   ``cma``
            BYTES with a shared segment, CMA_MIN_COPY_BYTES without
scatter     otherwise (a header round, then the binomial tree)      ``tree``
scatterv    "shm" and the others' blocks and shapes fit the root's  ``shm`` (not forceable)
            slot beside the header
scatterv    otherwise                                               ``tree``
==========  ======================================================  ======================

===============  ===================================================  =========================
collective       condition (see REDUCE_FAMILY below)                  algorithm
===============  ===================================================  =========================
reduce_scatter   "shm" and nbytes <= the segment's share for           ``shm``
                 reductions (allreduce's where some rank is crowded)
reduce_scatter   "shm", and nbytes <= PIPE_MAX_REDUCE_BYTES or no      ``pipe``
                 "cma" (larger inputs, through the segment's pipe)
reduce_scatter   "cma", and "shm" or nbytes >                         ``cma``
                 CMA_MIN_REDUCE_SCATTER_BYTES
reduce_scatter   nbytes <= min(SMALL_REDUCE_SCATTER_BYTES, chunk)     ``recursive_halving``
reduce_scatter   otherwise                                            ``ring``
reduce_scatterv  as reduce_scatter (total nbytes)                     as reduce_scatter
reduce           "shm" and nbytes <= the segment's share for           ``shm``
                 reductions (up to SLOT_PAYLOAD_BYTES)
reduce           "shm", "cma" and "push", nbytes >                     ``cma``
                 PIPE_MAX_PUSHED_REDUCE_BYTES (0 on Intel CPUs; the
                 others write their finished segments into the root's)
reduce           "shm", and nbytes <= PIPE_MAX_REDUCE_BYTES or no      ``pipe``
                 "cma" (larger arrays, through the segment's pipe)
reduce           "cma", and "shm" or (n >= 3 and nbytes >              ``cma``
                 CMA_MIN_COPY_BYTES)
reduce           nbytes <= SMALL_REDUCE_BYTES, or n <= 2              ``tree``
reduce           otherwise                                            ``reduce_scatter_gather``
===============  ===================================================  =========================

==========  ==================================  ======================
collective  condition (see SCAN_FAMILY below)   algorithm
==========  ==================================  ======================
scan        "shm", up to ``SHM_MAX_BYTES``      ``shm``
scan        otherwise, chunk by chunk           ``recursive_doubling``
exscan      "shm", up to ``SHM_MAX_BYTES``      ``shm``
exscan      otherwise, chunk by chunk           ``recursive_doubling``
==========  ==================================  ======================

The world size enters through the limits (the shared-memory allreduce needs log2 p arrays'
worth of scratch, p the largest power of two <= world size) and where a row names it. A
world of one runs whichever is chosen without any I/O.

Forcing (for tests and experts): ``Communicator._force_algorithm(collective, name)``, or
``TRIORING_ALGORITHM=allreduce=ring,broadcast=tree`` read by ``open_communicator()``,
replaces the row's choice for every call of that collective. The algorithm decides the
frames on the wire, so it must be forced identically on every rank: rank 0 refuses a world
whose ranks' TRIORING_ALGORITHM differ (see _rendezvous); ranks whose ``_force_algorithm``
disagree never take wrong data for right (frames carry the call's identity), but raise
``ProtocolError`` or, where two ranks never exchange a frame, wait until a deadline. A
forced algorithm that cannot run a call here (no shared segment, an array too large for it)
raises ``InvalidArgumentError`` before any I/O, never falls back to another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import ConfigurationError
from .._onehost._shm import SHM_MAX_BYTES, SLOT_PAYLOAD_BYTES
from ._limits import (
    CMA_MIN_BYTES,
    CMA_MIN_COPY_BYTES,
    CMA_MIN_REDUCE_SCATTER_BYTES,
    PIPE_LIMITS_BY_VENDOR,
    PIPE_MAX_ALLGATHER_BYTES,
    PIPE_MAX_ALLTOALL_BYTES,
    PIPE_MAX_PUSHED_BROADCAST_BYTES,
    PIPE_MAX_PUSHED_REDUCE_BYTES,
    PIPE_MAX_REDUCE_BYTES,
    SMALL_ALLGATHER_BYTES,
    SMALL_ALLREDUCE_BYTES,
    SMALL_POW2_ALLGATHER_BYTES,
    SMALL_REDUCE_BYTES,
    SMALL_REDUCE_SCATTER_BYTES,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._algorithms import World

__all__ = [
    "ALGORITHMS",
    "CMA_MIN_BYTES",
    "CMA_MIN_REDUCE_SCATTER_BYTES",
    "PIPE_LIMITS_BY_VENDOR",
    "PIPE_MAX_ALLGATHER_BYTES",
    "PIPE_MAX_ALLTOALL_BYTES",
    "PIPE_MAX_PUSHED_BROADCAST_BYTES",
    "PIPE_MAX_PUSHED_REDUCE_BYTES",
    "PIPE_MAX_REDUCE_BYTES",
    "SMALL_ALLGATHER_BYTES",
    "SMALL_ALLREDUCE_BYTES",
    "SMALL_ALLTOALL_BLOCK_BYTES",
    "SMALL_POW2_ALLGATHER_BYTES",
    "SMALL_REDUCE_BYTES",
    "SMALL_REDUCE_SCATTER_BYTES",
    "allgather",
    "allreduce",
    "alltoall",
    "alltoallv",
    "barrier",
    "broadcast",
    "gather",
    "parse_forced",
    "pipe_reduce_limit",
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
]

#: Every algorithm of every collective, by the name that forcing uses.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("shm", "pipe", "cma", "recursive_doubling", "ring"),
    "broadcast": ("shm", "pipe", "cma", "tree"),
    "barrier": ("shm", "dissemination"),
    "allgather": ("shm", "pipe", "cma", "bruck", "recursive_doubling", "ring"),
    "allgatherv": ("pipe", "cma", "bruck", "recursive_doubling", "ring"),
    "reduce_scatter": ("shm", "pipe", "cma", "recursive_halving", "ring"),
    "reduce_scatterv": ("shm", "pipe", "cma", "recursive_halving", "ring"),
    "reduce": ("shm", "pipe", "cma", "tree", "reduce_scatter_gather"),
    "gather": ("shm", "pipe", "cma", "tree"),
    "gatherv": ("tree",),
    "scatter": ("pipe", "cma", "tree"),
    "scatterv": ("tree",),
    "alltoall": ("shm", "pipe", "cma", "bruck", "pairwise"),
    "alltoallv": ("pairwise",),
    "scan": ("recursive_doubling", "shm"),
    "exscan": ("recursive_doubling", "shm"),
}


def pipe_reduce_limit(push: bool) -> int:
    """The largest allreduce or reduce that goes through the segment's pipe where
    cross-memory attach was agreed too: ``PIPE_MAX_PUSHED_REDUCE_BYTES`` where the ranks
    also push (0 on Intel CPUs: every one the slots cannot take goes by cma), else
    ``PIPE_MAX_REDUCE_BYTES`` (see PipeLimits in _limits)."""
    return PIPE_MAX_PUSHED_REDUCE_BYTES if push else PIPE_MAX_REDUCE_BYTES


def allreduce(nbytes: int, shm_bytes: int, cma: bool, small_bytes: int, push: bool = False) -> str:
    """The allreduce row for an array of ``nbytes``: ``shm_bytes`` is the largest array the
    shared segment takes (-1 without one), ``cma`` whether cross-memory attach was agreed,
    ``small_bytes`` the largest array recursive doubling takes, ``push`` whether the ranks
    agreed to write their finished segments into each other's arrays
    (_onehost._push.can_push). (Positional, and the limits worked out by the caller once,
    so that a 4-byte allreduce pays little for asking.)"""
    if nbytes <= shm_bytes:
        return "shm"
    if shm_bytes >= 0:
        return "cma" if cma and nbytes > pipe_reduce_limit(push) else "pipe"
    if cma and nbytes > CMA_MIN_BYTES:
        return "cma"
    if nbytes <= small_bytes:
        return "recursive_doubling"
    return "ring"


def broadcast(nbytes: int, shm_bytes: int, cma: bool, *, threads: bool = False) -> str:
    """The broadcast row for an array of ``nbytes``; ``shm_bytes``: the largest the shared
    segment's slots take here (-1: no segment; see _broadcast.shm_limit); ``threads``: its
    readers would read it in threads (see _onehost._cma_collectives.read_threads), or its
    root would write a share of it into theirs as they read (_onehost._push.push_bytes)."""
    if shm_bytes >= 0:
        if nbytes <= shm_bytes:
            return "shm"
        return "cma" if cma and threads else "pipe"
    if cma and nbytes > CMA_MIN_BYTES:
        return "cma"
    return "tree"


def barrier(*, shm: bool) -> str:
    """The barrier row."""
    return "shm" if shm else "dissemination"


def allgather(
    total_nbytes: int,
    world_size: int,
    onehost: tuple[bool, bool] = (False, False),
    *,
    segment: bool = False,
) -> str:
    """The allgather and allgatherv row, by the bytes gathered on every rank (for
    allgatherv known only after the counts are exchanged, identically on every rank), the
    world size, (whether the shared segment's slots take this call's blocks, whether
    cross-memory attach was agreed) and whether there is a shared segment (its pipe)."""
    shm, cma = onehost
    if shm:
        return "shm"
    if segment and (not cma or (world_size >= 3 and total_nbytes <= PIPE_MAX_ALLGATHER_BYTES)):
        return "pipe"
    if cma and (segment or total_nbytes > CMA_MIN_COPY_BYTES):
        return "cma"
    if total_nbytes <= SMALL_POW2_ALLGATHER_BYTES and world_size & (world_size - 1) == 0:
        return "recursive_doubling"
    return "bruck" if total_nbytes <= SMALL_ALLGATHER_BYTES else "ring"


def reduce_scatter(nbytes: int, small_bytes: int, shm_bytes: int = -1, cma: bool = False) -> str:
    """The reduce_scatter and reduce_scatterv row for an input of ``nbytes``, the same on
    every rank; ``small_bytes`` is the largest input recursive halving takes here,
    ``shm_bytes`` the largest the shared segment takes (-1: none), ``cma`` whether
    cross-memory attach was agreed (see REDUCE_FAMILY above)."""
    if nbytes <= shm_bytes:
        return "shm"
    if shm_bytes >= 0:
        return "cma" if cma and nbytes > PIPE_MAX_REDUCE_BYTES else "pipe"
    if cma and nbytes > CMA_MIN_REDUCE_SCATTER_BYTES:
        return "cma"
    return "recursive_halving" if nbytes <= small_bytes else "ring"


def reduce(
    nbytes: int, world_size: int, shm_bytes: int = -1, cma: bool = False, *, push: bool = False
) -> str:
    """The reduce row for an array of ``nbytes``; ``shm_bytes`` and ``cma`` as for
    :func:`reduce_scatter` (see REDUCE_FAMILY above), ``push`` as for :func:`allreduce`."""
    if nbytes <= shm_bytes:
        return "shm"
    if shm_bytes >= 0:
        return "cma" if cma and nbytes > pipe_reduce_limit(push) else "pipe"
    if cma and world_size >= 3 and nbytes > CMA_MIN_COPY_BYTES:
        return "cma"
    if nbytes <= SMALL_REDUCE_BYTES or world_size <= 2:
        return "tree"
    return "reduce_scatter_gather"


#: Alltoalls whose blocks (the bytes one rank sends to one other) are at most this large
#: go by Bruck's algorithm at world sizes of 4 and more: ceil(log2 n) rounds, each sending
#: about half of the array; larger blocks, and worlds of 2 and 3 (where Bruck takes as many
#: rounds as the pairwise exchange takes steps, plus its packing), by the pairwise exchange
#: (n-1 steps, each byte sent once). MPICH: Bruck for blocks <= 256 B (p >= 8), isend/irecv
#: up to 32 KiB, pairwise above; Open MPI: Bruck at p >= 32 for blocks under 512 B-2 KiB.
#: Measured here (uint8 blocks, Unix transport via ``trioring run``, 2 shared cores, both
#: algorithms forced in alternating blocks of 10 calls in one run, the slowest rank's
#: median of 21-31 blocks): at world 2 pairwise won at every size (107 against 150 us up
#: to 4 KiB: one step either way); at world 3 by 35-50 us (161-168 against 199-220 us up
#: to 4 KiB); at world 4 the two were even up to 256 B (196-206 against 202-215 us), Bruck
#: 3 % behind at 1 KiB (218-222 against 210-216 us), 10 % at 4 KiB and 30 % at 16 KiB; at
#: worlds 6 and 8 (oversubscribed, so CPU-bound) Bruck won at every size to 4 KiB (world
#: 8: 704-898 against 1003-1129 us). 1 KiB: even at world 4, ahead where Bruck saves
#: more than one round.
SMALL_ALLTOALL_BLOCK_BYTES = 1024


def alltoall(
    block_nbytes: int,
    world_size: int,
    onehost: tuple[bool, bool] = (False, False),
    *,
    segment: bool = False,
) -> str:
    """The alltoall row for blocks of ``block_nbytes`` (the same on every rank whose call
    agrees: the frames carry dtype and element count) at ``world_size``, (whether the
    shared segment's slots take this call's input, whether cross-memory attach was agreed)
    and whether there is a shared segment (its pipe)."""
    shm, cma = onehost
    if shm:
        return "shm"
    if segment and (
        not cma or (world_size >= 3 and block_nbytes * world_size <= PIPE_MAX_ALLTOALL_BYTES)
    ):
        return "pipe"
    if cma and (segment or block_nbytes * world_size > CMA_MIN_COPY_BYTES):
        return "cma"
    if world_size >= 4 and block_nbytes <= SMALL_ALLTOALL_BLOCK_BYTES:
        return "bruck"
    return "pairwise"


def alltoallv(*, slotted: bool = False) -> str:
    """The alltoallv row, once the counts are known (they differ per pair): ``slotted``,
    every rank's blocks for the other ranks came with its counts in its slot of the shared
    segment; otherwise the pairwise exchange."""
    return "shm" if slotted else "pairwise"


# SCAN_FAMILY: scan and exscan go by recursive doubling (MPICH's default for both; Thakur,
# Rabenseifner and Gropp 2005), ceil(log2 n) (alpha + m beta + m gamma), run once per chunk
# of chunk_bytes so that its scratch stays two chunks. At the sizes a scan is mostly used
# for (a count per rank, an offset into a shared output) latency is all that counts. Large
# arrays pay ceil(log2 n) m beta, where a chain pipelined in chunks would pay about m beta
# plus n - 1 hops of latency: not written. On one host an array that fits a slot of the
# shared segment goes through it: one publication, after which rank r folds the ranks below
# it in recursive doubling's order (r - 1 reductions on rank r, against ceil(log2 n)
# exchanges through the sockets).


def scan(nbytes: int, shm: bool) -> str:
    """The scan and exscan row for an array of ``nbytes`` (see SCAN_FAMILY above); ``shm``:
    whether there is a shared segment."""
    return "shm" if shm and nbytes <= SHM_MAX_BYTES else "recursive_doubling"


# GATHER_FAMILY: without the one-host paths, gather, gatherv, scatter and scatterv go by the
# binomial tree at every size, MPICH's choice for both (Thakur, Rabenseifner and Gropp 2005):
# ceil(log2 n) alpha + ((n-1)/n) m beta, for m bytes gathered at (scattered from) the root,
# latency-optimal and, since the root receives (sends) every byte but its own once, as good
# as any algorithm on the root's link. Each call first takes a dissemination round
# (ceil(log2 n) alpha) so that a disagreement raises on every rank (see _collectives._gather
# and _scatter).
#
# UNEVEN: allgatherv, gatherv and alltoallv start with their counts, scatterv with the
# root's shapes. With a shared segment every rank publishes its counts in its slot (the
# scatter header round already went there), the data after them where it fits, instead of
# a Bruck exchange through the sockets (about 100 us at world 2); when every block fits,
# that is the whole call. Not forceable: no rank knows beforehand whether all fit.
# trioring bench, float32, world 2, slowest rank's median, us, before / after, 8 B / 64
# KiB / 1 MiB: allgatherv 125 / 50, 138 / 64, 229 / 145; gatherv 88 / 31, 100 / 47, 193 /
# 185; alltoallv 96 / 31, 117 / 37, 274 / 155 (even ones, same launches: 17-30, 24-60,
# 82-167); scatterv 92 / 63, 109 / 74 against scatter's 42-46 / 61-76 before, 63 / 75 after.


def gather(
    total_nbytes: int = 0,
    onehost: tuple[bool, bool] = (False, False),
    *,
    segment: bool = False,
    world_size: int = 1,
) -> str:
    """The gather row for ``total_nbytes`` gathered at the root, (whether the shared
    segment's slots take this call's blocks, whether cross-memory attach was agreed),
    whether there is a shared segment (its pipe) and the world size; gatherv's blocks are
    known only after a first exchange: it passes nothing, for the tree."""
    shm, cma = onehost
    if shm:
        return "shm"
    if segment and (not cma or world_size <= 3 or total_nbytes <= CMA_MIN_COPY_BYTES):
        return "pipe"
    if cma and total_nbytes > CMA_MIN_COPY_BYTES:
        return "cma"
    return "tree"


def gatherv(*, slotted: bool = False) -> str:
    """The gatherv row, once the counts are known: ``slotted``, every non-root rank's block
    came with its counts in its slot of the shared segment; otherwise the tree."""
    return "shm" if slotted else "tree"


#: A scatter too large for the shared segment goes by cross-memory attach from this size
#: (where there is a segment; CMA_MIN_COPY_BYTES where there is none). Forced in alternating
#: rounds of one run (bench/thresholds.py, 9-15 rounds of 10 calls, tree against cma, us):
#: at world 2, 512 KiB 188/170 and 130/125, 768 KiB 150/152, 1 MiB 274/222 and 181/170,
#: 2 MiB 420/320; world 3, 384 KiB 375/259, 512 KiB 431/249, 1 MiB 529/275; world 4,
#: 384 KiB 472/400, 512 KiB 394/341 and 333/296, 1 MiB 568/371, 2 MiB 763/512. With a
#: barrier before each call, as the benchmarks time them (7 rounds of 20 calls): world 2,
#: 512 KiB 372/148, 1 MiB 222/204, 2 MiB 360/301; world 4, 566/568, 699/569, 988/728. The sizes
#: between the segment and this one start above the segment's reach at worlds 2-4 (its
#: root carries up to about n/(n-1) slots), so every scatter it cannot carry reads by
#: cross-memory attach there, and no socket send is in the way (see bench/onehost_limits.py).
#: Without a segment the tree stayed even with or ahead of cma up to 2 MiB, so the
#: threshold there is CMA_MIN_COPY_BYTES.
CMA_MIN_SCATTER_BYTES = 256 * 1024


def others_share(nbytes: int, world_size: int) -> int:
    """What a slot of the shared segment holds for a call that leaves a rank's own block
    out of it (a scatter's root, every rank of an alltoall): ``nbytes`` (its whole array,
    ``world_size`` equal blocks) less that block."""
    return nbytes - nbytes // world_size


def scatter(
    total_nbytes: int = 0, cma: bool = False, slot_bytes: int = -1, world_size: int = 1
) -> str:
    """The scatter row for ``total_nbytes`` scattered from the root's array (known on every
    rank after the first round; a list on the root, or scatterv, passes nothing, for the
    tree), with cross-memory attach or without, and ``slot_bytes`` what the root's slot
    carries beside the header (-1: no shared segment): the other ranks' blocks, all but
    the root's own, must fit it."""
    if slot_bytes >= 0 and others_share(total_nbytes, world_size) <= slot_bytes:
        return "shm"
    if slot_bytes >= 0 and not cma:
        return "pipe"
    threshold = CMA_MIN_SCATTER_BYTES if slot_bytes >= 0 else CMA_MIN_COPY_BYTES
    return "cma" if cma and total_nbytes > threshold else "tree"


def shm_copy_bytes(collective: str) -> int:
    """What one rank of ``collective`` (allgather, gather, scatter, alltoall, scan) may write
    into its slot of the shared segment when its algorithm is forced: the whole slot for a
    gather (the table's limit may be lower: _gather.shm_limit), SHM_MAX_BYTES for the
    others, which measured no faster through the slots above it (see
    _onehost._shm.SLOT_PAYLOAD_BYTES)."""
    return SLOT_PAYLOAD_BYTES if collective == "gather" else SHM_MAX_BYTES


def copy_unrunnable(collective: str, name: str, world: World, nbytes: int) -> str | None:
    """Why the forced one-host algorithm ``name`` of a collective that copies through the
    shared segment (allgather, gather, scatter, alltoall, scan) cannot move ``nbytes``
    (what one rank writes to it) here; None if it can, or if ``name`` is not a one-host
    algorithm."""
    if name == "shm":
        if world.shm is None:
            return f"the forced {collective} algorithm 'shm' needs the \"shm\" feature"
        if nbytes > (most := shm_copy_bytes(collective)):
            return (
                f"the forced {collective} algorithm 'shm' takes at most {most} bytes "
                f"per rank, not {nbytes}"
            )
    elif name == "pipe" and world.shm is None:
        return f"the forced {collective} algorithm 'pipe' needs the \"shm\" feature"
    elif name == "cma" and world.peer_pids is None:
        return f"the forced {collective} algorithm 'cma' needs the \"cma\" feature"
    return None


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
