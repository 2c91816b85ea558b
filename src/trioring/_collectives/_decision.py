"""The decision table: which algorithm runs a collective, by array size and by the one-host
paths that every rank agreed on at opening. Every choice trioring makes is here.

==========  ======================================================  ======================
collective  condition, first match wins                             algorithm
==========  ======================================================  ======================
allreduce   "shm" and nbytes <= the segment's share (<= 256 KiB)    ``shm``
allreduce   "shm", and nbytes <= PIPE_MAX_REDUCE_BYTES or no "cma"  ``pipe``
            (larger arrays, through the segment's pipe)
allreduce   "cma", and "shm" or nbytes > CMA_MIN_BYTES              ``cma``
allreduce   nbytes <= min(SMALL_ALLREDUCE_BYTES, chunk_bytes)       ``recursive_doubling``
allreduce   otherwise                                               ``ring``
broadcast   "shm" and nbytes <= SHM_MAX_BYTES                       ``shm``
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
alltoall    "shm", and n >= 3 or no "cma"                           ``pipe``
alltoall    "cma", and "shm" or nbytes > CMA_MIN_COPY_BYTES         ``cma``
alltoall    block nbytes <= SMALL_ALLTOALL_BLOCK_BYTES and n >= 4   ``bruck``
alltoall    otherwise                                               ``pairwise``
alltoallv   "shm" and every rank's blocks came with its counts      ``shm`` (not forceable)
alltoallv   otherwise                                               ``pairwise``
gather      "shm" and each rank's block <= SHM_MAX_BYTES            ``shm``
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
reduce_scatter   "shm" and nbytes <= allreduce's share of the segment  ``shm``
reduce_scatter   "shm", and nbytes <= PIPE_MAX_REDUCE_BYTES or no      ``pipe``
                 "cma" (larger inputs, through the segment's pipe)
reduce_scatter   "cma", and "shm" or nbytes >                         ``cma``
                 CMA_MIN_REDUCE_SCATTER_BYTES
reduce_scatter   nbytes <= min(SMALL_REDUCE_SCATTER_BYTES, chunk)     ``recursive_halving``
reduce_scatter   otherwise                                            ``ring``
reduce_scatterv  as reduce_scatter (total nbytes)                     as reduce_scatter
reduce           "shm" and nbytes <= allreduce's share of the segment  ``shm``
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
scan        any size, chunk by chunk            ``recursive_doubling``
exscan      any size, chunk by chunk            ``recursive_doubling``
==========  ==================================  ======================

The world size enters through the limits (the shared-memory allreduce needs log2 p arrays'
worth of scratch, p the largest power of two <= world size) and where a row names it. A
world of one runs whichever is chosen without any I/O.

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

    from .._algorithms import World

__all__ = [
    "ALGORITHMS",
    "CMA_MIN_BYTES",
    "CMA_MIN_REDUCE_SCATTER_BYTES",
    "PIPE_MAX_ALLGATHER_BYTES",
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
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
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
#: The collectives that only copy (allgather, gather, scatter, alltoall) go by cross-memory
#: attach above this many bytes (the larger of one rank's buffers), when every rank agreed to
#: use it, and by the shared segment when what a rank writes there fits its slot
#: (SHM_MAX_BYTES). Measured with bench/thresholds.py (float32, Unix transport, 2 shared
#: cores, other work running; median of 9-11 alternating rounds of 10 calls, slowest rank):
#: allgather by cma against recursive doubling at world 2: 215 against 145 us at 64 KiB,
#: 267/299 at 256 KiB, 589/633 at 1 MiB, 1319/2245 at 4 MiB; at world 4: even at 256 KiB,
#: 1322/1049 at 1 MiB, 2842/4709 at 4 MiB. Alltoall by cma against pairwise at world 2:
#: 71/50 us at 64 KiB, 85/77 at 256 KiB, 235/279 at 1 MiB, 700/1222 at 4 MiB; at world 4
#: even at 256-512 KiB, 2240/1940 at 1 MiB, 4439/5939 at 4 MiB. So the copies win from a
#: few MiB at both worlds, lose below 1 MiB at world 4. Through the segment, at every size it
#: takes: allgather 90-96 against 105-115 us at world 2, 270-285 against 341-392 at world 4;
#: alltoall 82-85 against 108-120 (pairwise) at world 2, 336-373 against 667-769 at world 4.
#: The slots against cma again, once cma read each peer's x in place (thresholds.py --each,
#: forced, allgather, gather and alltoall at 64-256 KiB, world 2, ten launches): cma took
#: 0.6-0.9 of the slots' time at 256 KiB in one stretch of the machine (bench/modes.py) and
#: 1.2-2.4 times it at every size from 96 KiB in another, minutes later; at world 4 the
#: slots won at 256 KiB-1 MiB in one launch and lost at 768 KiB in another. So the slots
#: keep every call they fit.
CMA_MIN_COPY_BYTES = 2 * 1024 * 1024
#: Allgathers (and allgathervs) of up to this many bytes in all go by Bruck's algorithm
#: (ceil(log2 n) rounds at any world size), larger ones by the ring (bandwidth-optimal, n-1
#: steps), unless the world size is a power of two (SMALL_POW2_ALLGATHER_BYTES). MPICH's
#: defaults (Thakur, Rabenseifner and Gropp 2005): recursive doubling for power-of-two
#: worlds below 512 KiB in all, Bruck below 80 KiB otherwise, ring above. Measured here
#: (median of 50-200 float32 allgathers, Unix and TCP, 2 shared cores, 1 MiB chunks): the
#: ring's tasks cost it ~100 us at world 2 and ~700 us at world 4 on small arrays, so Bruck
#: won up to 256 KiB in all (79-117 against 179-231 us at world 2, 510-590 against 970-1040
#: at world 4); at 384 KiB the ring won at world 2 (191-276 against 324-477 us, Bruck's
#: halves no longer fitting the socket buffers), at 512 KiB the two were even at world 4,
#: and at 1 MiB the ring won at both. No one-host path yet.
SMALL_ALLGATHER_BYTES = 256 * 1024
#: At a power-of-two world size, allgathers (and allgathervs) of up to this many bytes in
#: all go by recursive doubling (log2 n exchanges, every block landing in place: Bruck's
#: rounds without its rotation, and the ring's bandwidth without its n-1 steps); MPICH
#: stops at 512 KiB, Open MPI takes it at every size below 32 ranks. Measured here (median
#: of 100 float32 allgathers per algorithm, in 5 alternating blocks of one run, the slowest
#: rank's time, Unix transport, 2 shared cores, 1 MiB chunks; bruck / recursive doubling /
#: ring, us): at world 2, 1 KiB 52 / 49 / 160, 64 KiB 61 / 55 / 243, 512 KiB 494 / 130 /
#: 314, 2 MiB 1993 / 448 / 748, 16 MiB 11016 / 3953 / 4071, 64 MiB 51432 / 32429 / 33134;
#: at world 4, 1 KiB 324 / 343 / 1210 (even with Bruck), 64 KiB 356 / 267 / 1172, 512 KiB
#: 1305 / 497 / 1461, 2 MiB 4353 / 1102 / 2494, 16 MiB 31893 / 12768 / 15554, 64 MiB
#: 150109 / 71351 / 76275; at world 8, 64 KiB 976 / 863 / 3681, 1 MiB 5769 / 1897 / 5138,
#: 16 MiB 69273 / 33371 / 35453. So it won (or tied) at every size measured, up to 64 MiB,
#: the limit here; above, unmeasured, Bruck and the ring as at other world sizes (the ring
#: talks to neighbours only, MPICH's reason for it on long messages).
SMALL_POW2_ALLGATHER_BYTES = 64 * 1024 * 1024

# PIPE_FAMILY: with a shared segment, what its slots cannot take goes through its pipe
# (_onehost._pipe: a ring of 4 x 1 MiB that every rank maps, a writer copying chunk k in
# while its readers copy chunk k - 1 out or reduce it), rather than by cross-memory attach,
# whose kernel copy runs at half the speed of a copy in user space here (a 4 MiB read: 346-
# 377 us by process_vm_readv, 147-157 through the ring, forked processes). Forced against
# cma in alternating rounds (bench/thresholds.py, float32, 5-7 rounds of 10 calls, the
# slowest rank; pipe / cma, us), every result checked:
#   broadcast  w2: 300 KiB 57 / 60, 1 MiB 110 / 117, 4 MiB 172 / 280, 16 MiB 1091 / 2241,
#              64 MiB 4650 / 6854; w4: 144 / 192, 246 / 344, 759 / 951, 2980 / 4690,
#              10764 / 15827.
#   allreduce  w2: 300 KiB 130 / 156, 1 MiB 172 / 247, 4 MiB 296 / 491, 8 MiB 801 / 803,
#              16 MiB 2198 / 2472, 64 MiB 9510 / 10163; w3: 1 MiB 547 / 658, 4 MiB 1240 /
#              1726, 16 MiB 5621 / 7253; w4: 300 KiB 592 / 622, 1 MiB 787 / 1042, 4 MiB 2110
#              / 4441, 16 MiB 9084 / 11438, 64 MiB 30584 / 31986.
#   reduce_scatter  w2: 300 KiB 96 / 100, 1 MiB 147 / 196, 4 MiB 366 / 518, 16 MiB 2750 /
#              3017; w4: 299 / 333, 438 / 535, 1388 / 2001, 5132 / 5634.
#   reduce     w2: 300 KiB 93 / 127 (tree 102), 1 MiB 138 / 226 (248), 4 MiB 460 / 624
#              (940), 16 MiB 2696 / 3691 (3992); w4: 515 / 488 (642), 859 / 917 (846),
#              1562 / 3685 (3579), 9066 / 9798 (11549).
#   allgather  w2: 1 MiB 127 / 184, 4 MiB 301 / 339, 8 MiB 876 / 891, 16 MiB 2470 / 2162
#              (an earlier run 6942 / 2690); w4: 300 KiB 318 / 433, 1 MiB 593 / 1111, 4 MiB
#              1377 / 1561, 16 MiB 4987 / 4793: up to PIPE_MAX_ALLGATHER_BYTES, where the
#              two copies of each byte begin to cost more than the kernel's one. Those cma
#              times read each peer's block from its result, where it had just copied it;
#              it reads the peer's x now (see _copies.cma_allgather), and at world 2 that
#              wins: timed each alone (--each), 7 rounds, six launches, pipe / cma, 1 MiB
#              and 4 MiB: in four launches 149-163 / 162-186 and 493-779 / 534-814, in the
#              two that met a slow stretch of the machine (bench/modes.py) 410-436 /
#              143-168 and 1100-1141 / 569-775. With x rewritten just before each call
#              (four launches, 1 MiB): 123-143 / 143-161, and in slow stretches 231-420 /
#              166-187. A slow stretch makes each line dear that crosses between the cores,
#              and the pipe crosses twice (the writer takes each ring line back from the
#              reader's cache, then the reader takes it again) where a read of x crosses
#              once, or not at all if x is unchanged and in the reader's cache. So at world
#              2 cma takes every allgather the slots cannot. At world 4 (three launches):
#              512 KiB and 1 MiB even (1 MiB 702-923 / 755-887), 4 MiB 2635-3065 /
#              3040-3478 and 8 MiB 5928-6212 / 6418-6778 to the pipe: it stays there.
#   alltoall   w2: 300 KiB 89 / 98, 1 MiB 143 / 142, 4 MiB 478 / 423, 16 MiB 3028 / 2931;
#              w3: 286 / 459, 292 / 830, 1143 / 1413 (300 KiB to 4 MiB); w4: 337 / 350,
#              468 / 624, 1619 / 2197, 6525 / 6819: the pipe from world 3. At world 2,
#              what the slots cannot take went by the pairwise exchange up to
#              CMA_MIN_COPY_BYTES, whatever the docs said: against cma (--each, three
#              launches, 7 rounds; cma / pairwise) 600 KiB 137 / 185, 768 KiB 144-160 /
#              178-205, 1 MiB 166-174 / 205-256, 2 MiB 274-303 / 390-491. cma takes them.
#   gather     w2: 300 KiB 67 / 55, 1 MiB 77 / 106, 4 MiB 180 / 290, 16 MiB 1388 / 2382;
#              w3: 130 / 115, 159 / 183, 301 / 372 (to 4 MiB); w4: 316 / 268, 633 / 330,
#              1298 / 710, 3773 / 2781: the pipe up to world 3. At world 4 on 2 cores its
#              three writers and the root share two cores; by cma the root reads alone.
#              Measured again (--each, 5-7 rounds, µs, pipe / cma): at world 4, 4 MiB in
#              five launches 519-1210 / 701-1250 (the pipe faster in four), 8 MiB 1347-1381
#              / 2108-2109 (two), 16 MiB 3097 / 3336; at world 5 1.25 MiB 559 / 645, 4 MiB
#              842 / 1129, 16 MiB 4140 / 3917; at world 8 4 MiB 1939 / 2006, 16 MiB 7430 /
#              6451. But timed as bench/paired.py times them, beside Open MPI in the same
#              ranks, the pipe's 4 MiB was no better (ratio to Open MPI 1.15-1.61 against
#              1.50-1.81, three runs each) and its 8 MiB worse (1.26-1.64 / 1.12-1.23): from
#              world 4, cma keeps what it had. Between the slots and CMA_MIN_COPY_BYTES,
#              though, the tree took them, and there the pipe won (world 4, 2-3 launches,
#              tree / cma / pipe: 1.125 MiB 504-619 / 270-414 / 263-357, 1.5 MiB 517 / 346 /
#              342, 2 MiB 626-867 / 398-535 / 296-434): the pipe up to CMA_MIN_COPY_BYTES.
#   scatter    w2: 300 KiB 143 / 106, 1 MiB 189 / 144, 4 MiB 280 / 264, 16 MiB 2275 / 1227;
#              w4: 387 / 432, 420 / 436, 777 / 621, 3509 / 3282: cma, where the root's
#              readers copy in parallel, each once; the pipe only without it.
# Timed each call alone instead (thresholds.py --each: a reset and a check between calls,
# as the benchmarks that judge the targets time them; 5-9 rounds), the pipe still won at 1-4
# MiB for broadcast, allreduce, reduce_scatter and reduce (w2 4 MiB: 343 / 473 reduce_
# scatter, 551 / 773 allreduce), and from 16 MiB the two were mostly within each other's
# spread (64 MiB allreduce w2 15610 / 12926, w4 36969 / 39452; broadcast w2 6799 / 8196,
# w4 24863 / 24686), the pipe with the longer tails (p90 up to 5x its median against
# cma's 1.1x). At those sizes every copy runs at memory speed, and where the two vCPUs do
# not share a cache the ring's traffic goes to memory too; cma copies each byte once. One
# sweep in a slow stretch of the machine put cma ahead at 16 and 64 MiB for nearly every
# collective; a rerun of the same cells did not. Not enough to move a threshold on: left
# as it is, measured again where the cores are not shared.
# Without cross-memory attach the pipe takes every size the slots cannot (against the
# sockets at world 4, TRIORING_CMA=0: gather 300 KiB 230 / 332 us by the tree, 1 MiB 192 /
# 431; scatter 327 / 365, 361 / 448).
PIPE_MAX_ALLGATHER_BYTES = 8 * 1024 * 1024
#: With a shared segment and cross-memory attach both agreed, allreduces, reduce_scatters
#: (and reduce_scattervs) and reduces of more than this many bytes go by cross-memory
#: attach, not through the pipe. The pipe copies each byte of a finished segment twice
#: (into the ring, out of it) where cma reads it once, and the reduction reads the ring,
#: where cma reads the peer's array into a scratch chunk: above a few MiB the copies decide.
#: The PIPE_FAMILY numbers above came from an AMD EPYC machine, where the pipe won or tied
#: up to 64 MiB (4 MiB allreduce at world 2, timed alone: 551 against 773 us). On the Intel
#: Xeon machine of 2026-12-05 (2 vCPUs, 2 MiB of L2 each; thresholds.py --each, 5 rounds,
#: cma / pipe, us) cma won from 4 MiB: allreduce w2 4 MiB 730-788 / 812-871, 8 MiB 1251 /
#: 1713, 16 MiB 2195-2251 / 3235-3327, 32 MiB 4996 / 6215, 64 MiB 12960-13252 /
#: 14725-16617; w3 4 MiB 2512 / 2702, 8 MiB 3780 / 4822, 16 MiB 7990 / 9965, 64 MiB 39309
#: / 50552; w4 4 MiB 3011 / 3079, 8 MiB 4950 / 5838, 16 MiB 11443 / 12613, 64 MiB 46371 /
#: 56703; reduce_scatter w2 4 MiB 620-640 / 595-659, 8 MiB 1116 / 1210, 32 MiB 4834 /
#: 5790, 64 MiB 10790-11450 / 13731-13752, w4 4 MiB 1758 / 1923, 16 MiB 6770 / 8115, 64
#: MiB 30287 / 39396; reduce w4 4 MiB 2482 / 2673, 16 MiB 10203 / 11142, 64 MiB 42890 /
#: 52838. Reduce at w2 tied (4 MiB 822 / 856, 16 MiB 2708 / 3006, 64 MiB 20956 / 21630 in
#: one launch; 6 MiB 1456-1457 / 1327-1353, 8 MiB 1803-1892 / 1782-1831, 16 MiB 3534-3554
#: / 3469-3496 in two more: its root receives half the array either way), so one rule
#: serves the three rather than a row by world size. Beside Open MPI in the same ranks
#: (bench/paired.py, 5 windows, two rounds of each source tree, ratio to Open MPI's time,
#: pipe -> cma): allreduce 64 MiB w2 0.68-0.70 -> 0.52-0.57, w4 0.80-0.86 -> 0.61-0.62;
#: 8 MiB w2 1.54-1.55 -> 0.97-1.13; reduce_scatter 64 MiB w4 0.37-0.40 -> 0.28-0.30;
#: reduce 64 MiB w4 0.44-0.45 -> 0.37. Broadcast stays with the pipe there (w2 64 MiB 10282
#: / 7843, w4 27415 / 24392). This limit keeps the EPYC machine's clear wins for the pipe
#: (1-4 MiB) and takes the Xeon's above. It is a trade: on the EPYC machine the two tied at
#: 8 MiB (801 / 803 us back to back), the pipe led by 8-27 % at 16 MiB back to back, and at
#: 64 MiB the two split (timed alone, w2 15610 / 12926 cma's way, w4 36969 / 39452 the
#: pipe's). Remeasure on such a machine before moving it.
PIPE_MAX_REDUCE_BYTES = 4 * 1024 * 1024

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
    "scan": ("recursive_doubling",),
    "exscan": ("recursive_doubling",),
}

# REDUCE_FAMILY: reduce_scatter and reduce_scatterv go by recursive halving up to
# SMALL_REDUCE_SCATTER_BYTES (and one chunk: it sends each half in one frame, through the
# scratch buffer), by the ring above; reduce by the binomial tree up to SMALL_REDUCE_BYTES
# (and at world 2), by reduce-scatter + gather above. Thakur, Rabenseifner and Gropp (2005)
# cost the ring reduce-scatter at (n-1) alpha + ((n-1)/n) m (beta + gamma):
# bandwidth-optimal, and MPICH's choice for long messages is its pairwise exchange, the
# same cost; for short ones (< 512 KiB in all, commutative ops, which all of trioring's
# are) MPICH uses recursive halving, log2 n alpha + ((n-1)/n) m (beta + gamma).
#
# Measured here (median of 100 float32 calls per algorithm, in 5 alternating blocks of one
# run, the slowest rank's time, Unix transport, 2 shared cores, 1 MiB chunks; recursive
# halving / ring, us): at world 2, 4 KiB 73 / 173, 256 KiB 127 / 267, 512 KiB 235 / 361,
# 1 MiB 416 / 572; at world 4, 4 KiB 448 / 1060, 256 KiB 602 / 1366, 512 KiB 808 / 1561,
# 1 MiB 1254 / 2134. Recursive halving won at every size it takes (up to the scratch
# buffer, one chunk), so SMALL_REDUCE_SCATTER_BYTES is that chunk, not MPICH's 512 KiB.
SMALL_REDUCE_SCATTER_BYTES = 1024 * 1024
#
# On one host with a shared segment, reduce_scatter, reduce_scatterv and reduce go through
# its pipe whenever its slots cannot take the call (see PIPE_FAMILY). Without a segment but
# with cross-memory attach, reduce_scatter(v) reads each peer's block of their input
# directly (_cma_collectives.cma_reduce_scatter) above CMA_MIN_REDUCE_SCATTER_BYTES, the
# control going by frames. Measured with bench/thresholds.py (float32, 7 alternating rounds
# of 10 calls, slowest rank; cma against recursive halving up to 1 MiB, the ring above, us):
# without a segment at world 2, 64 KiB 91 / 78, 256 KiB 109 / 132, 1 MiB 220 / 295; at
# world 4, 256 KiB 691 / 606, 1 MiB 952 / 999.
CMA_MIN_REDUCE_SCATTER_BYTES = 1024 * 1024
# Reduce without a segment reads the same way (_cma_collectives.cma_reduce: each rank
# reduces a segment, the root copies the finished ones), at world sizes of 3 and more,
# above CMA_MIN_COPY_BYTES. At world 2 the tree stays: it was as fast or faster (1 MiB 216 /
# 261 us), since the root copies and reduces as much either way and the tree's sender runs
# ahead through the socket buffer. At world 3 (cma / tree, us) 1 MiB 925 / 571, 4 MiB 2314
# / 2597; at world 4, 1 MiB 932 / 988, 4 MiB 2616 / 3991.
# For reduce, MPICH takes the binomial tree, ceil(log2 n) (alpha + m beta + m gamma), up to
# 2 KiB (REDUCE_SHORT) and Rabenseifner's reduce-scatter + gather,
# 2 log2 n alpha + 2 ((n-1)/n) m beta + ((n-1)/n) m gamma, above: the root receives about
# 2 m instead of ceil(log2 n) whole arrays, and the work is spread over the ranks. At world 2
# both move m into the root, and reduce-scatter + gather takes more steps: the tree always.
# Measured here as above (tree / reduce-scatter + gather, us, root 0): at world 2, 256 B
# 57 / 137, 2 KiB 60 / 136, 128 KiB 94 / 183, 2 MiB 712 / 1277, 8 MiB 2107 / 3982; at world
# 4, 256 B 313 / 447, 2 KiB 239 / 393, 128 KiB 379 / 563, 2 MiB 2133 / 3844, 8 MiB 7129 /
# 14991; at world 8, 128 KiB 2407 / 3465, 8 MiB 21411 / 28882, 32 MiB 72871 / 101683. The
# tree won at every size measured: on one host with fewer cores than ranks, the total work
# decides, and reduce-scatter + gather moves more bytes in all (about n m against the
# tree's (n-1) m) in more steps. So the threshold is the largest size measured, 32 MiB,
# far above MPICH's 2 KiB, which is for ranks on separate hosts; remeasure there.
SMALL_REDUCE_BYTES = 32 * 1024 * 1024


def allreduce(nbytes: int, shm_bytes: int, cma: bool, small_bytes: int) -> str:
    """The allreduce row for an array of ``nbytes``: ``shm_bytes`` is the largest array the
    shared segment takes (-1 without one), ``cma`` whether cross-memory attach was agreed,
    ``small_bytes`` the largest array recursive doubling takes. (Positional, and the limits
    worked out by the caller once, so that a 4-byte allreduce pays little for asking.)"""
    if nbytes <= shm_bytes:
        return "shm"
    if shm_bytes >= 0:
        return "cma" if cma and nbytes > PIPE_MAX_REDUCE_BYTES else "pipe"
    if cma and nbytes > CMA_MIN_BYTES:
        return "cma"
    if nbytes <= small_bytes:
        return "recursive_doubling"
    return "ring"


def broadcast(nbytes: int, shm: bool, cma: bool) -> str:
    """The broadcast row for an array of ``nbytes``."""
    if shm:
        return "shm" if nbytes <= SHM_MAX_BYTES else "pipe"
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


def reduce(nbytes: int, world_size: int, shm_bytes: int = -1, cma: bool = False) -> str:
    """The reduce row for an array of ``nbytes``; ``shm_bytes`` and ``cma`` as for
    :func:`reduce_scatter` (see REDUCE_FAMILY above)."""
    if nbytes <= shm_bytes:
        return "shm"
    if shm_bytes >= 0:
        return "cma" if cma and nbytes > PIPE_MAX_REDUCE_BYTES else "pipe"
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
    if segment and (not cma or world_size >= 3):
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
# plus n - 1 hops of latency: not written, so there is nothing to choose yet.


def scan() -> str:
    """The scan and exscan row (see SCAN_FAMILY above)."""
    return "recursive_doubling"


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


def copy_unrunnable(collective: str, name: str, world: World, nbytes: int) -> str | None:
    """Why the forced one-host algorithm ``name`` of a copying collective (allgather,
    gather, scatter, alltoall) cannot move ``nbytes`` (what one rank writes to the shared
    segment) here; None if it can, or if ``name`` is not a one-host algorithm."""
    if name == "shm":
        if world.shm is None:
            return f"the forced {collective} algorithm 'shm' needs the \"shm\" feature"
        if nbytes > SHM_MAX_BYTES:
            return (
                f"the forced {collective} algorithm 'shm' takes at most {SHM_MAX_BYTES} bytes "
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
