"""The size limits of the decision table (_decision), each with the measurement that chose
it. Kept apart from the table's rows so that each stays readable: the rows say which
algorithm a call takes, these say where, and why there."""

from __future__ import annotations

from typing import final

import attrs

from .._onehost._cpus import cpu_vendor

__all__ = [
    "ANY_SIZE",
    "CMA_MIN_BYTES",
    "CMA_MIN_COPY_BYTES",
    "CMA_MIN_REDUCE_SCATTER_BYTES",
    "PIPE_LIMITS",
    "PIPE_LIMITS_BY_VENDOR",
    "PIPE_LIMITS_ELSEWHERE",
    "PIPE_MAX_ALLGATHER_BYTES",
    "PIPE_MAX_ALLTOALL_BYTES",
    "PIPE_MAX_PUSHED_BROADCAST_BYTES",
    "PIPE_MAX_PUSHED_REDUCE_BYTES",
    "PIPE_MAX_REDUCE_BYTES",
    "SMALL_ALLGATHER_BYTES",
    "SMALL_ALLREDUCE_BYTES",
    "SMALL_POW2_ALLGATHER_BYTES",
    "SMALL_REDUCE_BYTES",
    "SMALL_REDUCE_SCATTER_BYTES",
    "PipeLimits",
    "pipe_limits",
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
#
# PIPE_LIMITS: where cross-memory attach was agreed too, the largest call each family sends
# through the pipe. The reductions' first:
# With a shared segment and cross-memory attach both agreed, allreduces, reduce_scatters
# (and reduce_scattervs) and reduces of more than PIPE_MAX_REDUCE_BYTES go by cross-memory
# attach, not through the pipe. The pipe copies each byte of a finished segment twice
# (into the ring, out of it) where cma reads it once, and the reduction reads the ring,
# where cma reads the peer's array into a scratch chunk: above a few MiB the copies decide.
# The PIPE_FAMILY numbers above came from an AMD EPYC machine, where the pipe won or tied
# up to 64 MiB (4 MiB allreduce at world 2, timed alone: 551 against 773 us). On the Intel
# Xeon machine of 2026-12-05 (2 vCPUs, 2 MiB of L2 each; thresholds.py --each, 5 rounds,
# cma / pipe, us) cma won from 4 MiB: allreduce w2 4 MiB 730-788 / 812-871, 8 MiB 1251 /
# 1713, 16 MiB 2195-2251 / 3235-3327, 32 MiB 4996 / 6215, 64 MiB 12960-13252 /
# 14725-16617; w3 4 MiB 2512 / 2702, 8 MiB 3780 / 4822, 16 MiB 7990 / 9965, 64 MiB 39309
# / 50552; w4 4 MiB 3011 / 3079, 8 MiB 4950 / 5838, 16 MiB 11443 / 12613, 64 MiB 46371 /
# 56703; reduce_scatter w2 4 MiB 620-640 / 595-659, 8 MiB 1116 / 1210, 32 MiB 4834 /
# 5790, 64 MiB 10790-11450 / 13731-13752, w4 4 MiB 1758 / 1923, 16 MiB 6770 / 8115, 64
# MiB 30287 / 39396; reduce w4 4 MiB 2482 / 2673, 16 MiB 10203 / 11142, 64 MiB 42890 /
# 52838. Reduce at w2 tied (4 MiB 822 / 856, 16 MiB 2708 / 3006, 64 MiB 20956 / 21630 in
# one launch; 6 MiB 1456-1457 / 1327-1353, 8 MiB 1803-1892 / 1782-1831, 16 MiB 3534-3554
# / 3469-3496 in two more: its root receives half the array either way), so one rule
# serves the three rather than a row by world size. Beside Open MPI in the same ranks
# (bench/paired.py, 5 windows, two rounds of each source tree, ratio to Open MPI's time,
# pipe -> cma): allreduce 64 MiB w2 0.68-0.70 -> 0.52-0.57, w4 0.80-0.86 -> 0.61-0.62;
# 8 MiB w2 1.54-1.55 -> 0.97-1.13; reduce_scatter 64 MiB w4 0.37-0.40 -> 0.28-0.30;
# reduce 64 MiB w4 0.44-0.45 -> 0.37. Broadcast stays with the pipe there (w2 64 MiB 10282
# / 7843, w4 27415 / 24392). This limit keeps the EPYC machine's clear wins for the pipe
# (1-4 MiB) and takes the Xeon's above. It is a trade: on the EPYC machine the two tied at
# 8 MiB (801 / 803 us back to back), the pipe led by 8-27 % at 16 MiB back to back, and at
# 64 MiB the two split (timed alone, w2 15610 / 12926 cma's way, w4 36969 / 39452 the
# pipe's). Remeasure on such a machine before moving it.
#
# Then (2026-12-05, a later session) cma's reductions read in pieces of 256 KiB instead of
# 1 MiB (_cma_reductions._REDUCE_STEP_BYTES), 7-20 % faster, and on the same Intel machine
# cma won from 2 MiB (thresholds.py --each, 5 rounds, pipe / cma, us): allreduce w2 1 MiB
# 253 / 278, 2 MiB 486 / 462, 4 MiB 891 / 709, 8 MiB 1823 / 1128; w4 1 MiB 1114 / 1105,
# 2 MiB 1893 / 1721, 4 MiB 3136 / 2773; reduce_scatter w2 1 MiB 198 / 187, 2 MiB 353 /
# 373, 4 MiB 642 / 652, 8 MiB 1275 / 1139; w4 1 MiB 735 / 602, 2 MiB 1181 / 909, 4 MiB
# 2074 / 1585; reduce w2 1 MiB 245 / 285, 2 MiB 537 / 512, 4 MiB 920 / 912; w4 1 MiB 1040 /
# 1084, 2 MiB 1814 / 1625, 4 MiB 2991 / 2569. Beside Open MPI in the same ranks
# (bench/paired.py, 7 windows, two rounds each, ratio to its time, the pipe -> cma as
# now): 4 MiB allreduce w2 1.49-1.62 -> 1.14-1.23, reduce w2 1.31-1.37 -> 1.17-1.29,
# reduce_scatter w2 0.64-0.65 -> 0.59-0.65; at w4 reduce_scatter 0.45 -> 0.32-0.33, reduce
# 0.58-0.61 -> 0.49-0.51. On the EPYC machine the pipe's lead at 4 MiB was 1.4x, more than
# those pieces gain. So the limit goes by the CPU's vendor: the Intel machine's (cma above
# 2 MiB) on Intel CPUs, the EPYC machine's (above 4 MiB) on every other. One machine of
# each was measured; force the algorithm (TRIORING_ALGORITHM) where another differs.
#
# A second AMD machine did (2026-12-06, a later session): 2 vCPUs of an AMD EPYC of
# family 23 model 1, slower throughout than the first EPYC machine (a 4 MiB allreduce at
# world 2 took 2.3-3.1 ms where that one took 0.55-0.77). There cma won every reduction at
# 4 MiB (thresholds.py --each, 5 rounds, pipe / cma, us): allreduce w2 1 MiB 675 / 663,
# 2 MiB 1386 / 1227, 4 MiB 3097 / 2299, 8 MiB 5598 / 4113; w4 1 MiB 3802 / 3482, 2 MiB
# 6557 / 5685, 4 MiB 11658 / 9484; reduce_scatter w2 1 MiB 557 / 596, 2 MiB 946 / 969,
# 4 MiB 1904 / 1651; reduce w2 1 MiB 484 / 685, 2 MiB 1337 / 1366, 4 MiB 2635 / 2334. Its
# cores handed 1 MiB through a shared mapping in 340-596 us against 319-453 by
# process_vm_readv (bench/modes.py --reads), as the first machine did only in its slow
# stretches. So the vendor stands in for how the host places and connects the two vCPUs,
# and two AMD machines differed. The limits stay (the first machine's measurements are the
# larger set); on a machine like the second, a program whose large reductions matter can
# force cma's way (TRIORING_ALGORITHM=allreduce=cma, and the same for reduce_scatter and
# reduce: at every size, so only where its small calls do not matter).
#
# Then "push" (2026-12-07, the Intel machine): where the ranks agreed to write their
# finished pieces into each other's arrays, every allreduce and reduce the slots could not
# take went by cross-memory attach, on every vendor, from measurements on that machine only
# (pushed cma beat the pipe there from 512 KiB: see the algorithms page). A third AMD
# machine (2026-12-08: 2 vCPUs of an AMD EPYC of family 26 model 2, under Firecracker,
# Linux 6.18) measured it the other way. There a process_vm_readv costs 5.5 us even for
# 4 KiB (about 2.6 on the Intel machine), and its cores hand 1 MiB through a shared
# mapping in 51-61 us against 89-100 by process_vm_readv, 4 MiB in 212-242 against 275-289
# (bench/modes.py --reads, 8 blocks each, no slow stretch). Forced (thresholds.py --each,
# pipe / pushed cma, us): allreduce w2 (7 rounds) 384 KiB 92 / 115, 1 MiB 141 / 194,
# 4 MiB 356 / 646, 16 MiB 2459 / 2545, 64 MiB 10514 / 8542; w4 (5 rounds) 384 KiB 508 /
# 462, 1 MiB 619 / 668, 4 MiB 2179 / 2619, 16 MiB 12209 / 9981; reduce w2 384 KiB 96 /
# 111, 1 MiB 129 / 184, 4 MiB 417 / 392, 16 MiB 3187 / 2215; w4 384 KiB 298 / 275, 1 MiB
# 377 / 416, 4 MiB 1250 / 1605, 16 MiB 7316 / 5831. Beside Open MPI in the same ranks
# (bench/paired.py, 9 windows, launches alternating, ratio to its time, the table before
# -> after: pushed cma -> the pipe), three launches each at w2: allreduce 768 KiB
# 1.63-1.74 -> 1.05-1.25, 1 MiB 1.48-1.58 -> 0.93-1.09, 2 MiB 1.34-1.38 -> 0.78-0.85,
# 4 MiB 1.13-1.76 -> 0.84-0.94; reduce 768 KiB 1.34-1.89 -> 0.97-1.06, 1 MiB 1.19-1.69
# -> 0.84-0.95, 2 MiB 0.75-1.46 -> 0.66-0.77, 4 MiB 0.91-1.26 -> 0.55-0.68; two each at
# w4 (4 ranks on the 2 vCPUs): allreduce 768 KiB 1.60-1.80 -> 1.78-1.84, 1 MiB 1.39-1.67
# -> 1.29-1.45, 2 MiB 1.29-1.44 -> 0.87-0.91, 4 MiB 1.03-1.24 -> 0.93-1.17; reduce 768
# KiB 1.42-1.85 -> 1.73-2.35, 1 MiB 1.26-1.66 -> 1.09-1.25, 2 MiB 0.95-1.00 -> 0.75-0.89,
# 4 MiB 0.88-0.92 -> 0.91-1.00 (the smallest sizes at w4 lost a little: one rule for
# every world size, as for the other limits). So pushing moves the pipe's limit for
# reductions only where it was measured to (PipeLimits.pushed_reduce: 0 on Intel CPUs,
# every reduction above the slots pushed; elsewhere the pipe's own 4 MiB, as before push,
# which two AMD machines of three measured ahead).
# Broadcasts too: the root's writes (PUSH_MIN_BYTES in _onehost._push) were measured
# against the pipe on the Intel machine only; on the family-26 EPYC, beside Open MPI in
# the same ranks (bench/paired.py -n 2, 9 windows, launches alternating, six of each from
# 768 KiB to 4 MiB, three at the other sizes; ratio to its time, pushed -> through the
# pipe): 512 KiB 1.09-1.49 -> 0.95-1.01, 768 KiB 0.94-1.22 -> 0.80-1.18, 1 MiB 0.86-1.10
# -> 0.64-0.93, 2 MiB 0.69-0.81 -> 0.50-0.68, 4 MiB 0.65-1.04 -> 0.75-0.85, 8 MiB
# 0.58-0.80 -> 0.81-1.35, 16 MiB 1.17-1.34 -> 1.00-1.35, 64 MiB 0.97-1.12 -> 1.10-1.30.
# So pushed_broadcast: 0 on Intel CPUs, 4 MiB elsewhere (at 4 MiB the pipe is the steadier
# of two even sides; the root pushes above it). At world 4 on 2 vCPUs no root pushes
# (push_bytes: a CPU for each rank).
#
# Then (2026-12-05, a third session on the Intel machine) the copies: alltoall went through
# the pipe from world 3 at every size, and allgather from world 3 up to 8 MiB, from the
# EPYC machine's numbers above. On the Intel machine cross-memory attach won every
# alltoall cell at worlds 3 and 4, with more ranks than cores (thresholds.py --each, 5
# rounds, pipe / cma, us): world 4 320 KiB 358 / 303, 384 KiB 401 / 328, 512 KiB 481 /
# 409, 1 MiB 729 / 609, 4 MiB 2235 / 1498, 16 MiB 11457 / 8318; world 3 1 MiB 537 / 434,
# 4 MiB 1739 / 1285, 16 MiB 9301 / 6674. Allgather split at 2-4 MiB: world 4 (7 rounds)
# 512 KiB 429 / 434, 1 MiB 565-619 / 563-645, 2 MiB 916 / 865, 3 MiB 1271 / 1189, 4 MiB
# 1746 / 1549, 8 MiB 3407 / 3069; world 3 1 MiB 465 / 482, 2 MiB 723 / 778, 3 MiB 1032 /
# 1043, 4 MiB 1890 / 1309, 8 MiB 3552 / 2478. Beside Open MPI in the same ranks
# (bench/paired.py, world 4, 7 windows, two rounds, both forced, ratio to Open MPI's
# time): the 4 MiB alltoall 2.11 by the pipe, 1.47-1.54 by cma, 64 MiB 1.57 and 1.12;
# the 4 MiB allgather took 1400-1698 us by the pipe, 1356-1466 by cma. With a core per
# rank the gap widens: on a 16-core Xeon (bench/paired.py, Open MPI 5.0.11, one run) the
# pipe's 4 MiB alltoall took 625 / 1515 / 3468 us at worlds 4 / 8 / 16 where the
# single-copy floor of the same ranks (bench/_copy_floor.py) took 375 / 390 / 475, and
# its 4 MiB allgather at world 4 437 against 330, where trioring's own cma calls took 7 %
# more than that floor at world 2 (alltoall 383 against 357, allgather 368 against 343).
# So on Intel CPUs cross-memory attach takes every alltoall the slots cannot, and every
# allgather above 2 MiB, as the reductions. The two tables, unforced, beside Open MPI
# (bench/paired.py, 5 windows, two rounds each, ratio to its time, before -> after):
# alltoall at world 4 1 MiB 2.63-2.69 -> 2.24-2.25, 4 MiB 2.08-2.09 -> 1.49-1.55, 16 MiB
# 1.87-1.94 -> 1.24-1.25; at world 3 1 MiB 2.59-2.71 -> 1.67-1.79, 4 MiB 1.67-1.74 ->
# 1.28-1.33, 16 MiB 1.62-1.70 -> 1.02-1.26; the 4 MiB allgather at world 3 0.87-0.89 ->
# 0.63-0.74, at world 4 no gain on the 2 vCPUs (1.09-1.30 -> 1.30-1.32; 1441-1584 us ->
# 1631-1632), where the pipe's readers and writers share the two cores.


@final
@attrs.frozen
class PipeLimits:
    """The largest calls, in bytes, that go through the shared segment's pipe where
    cross-memory attach was agreed too (cma takes the larger ones; without it the pipe takes
    every call the slots cannot): ``reduce`` for allreduce, reduce_scatter(v) and reduce
    (their input), ``allgather`` for allgather(v) (the bytes gathered in all) and
    ``alltoall`` for alltoall (a rank's input), those two from world 3 (at world 2 cma takes
    them all); ``pushed_reduce`` for allreduce and reduce where the ranks also agreed to
    write their finished pieces into each other's arrays (``"push"``), and
    ``pushed_broadcast`` for a broadcast whose root would write a share of its array into
    the readers' (above it, cma takes the broadcast, and the root pushes)."""

    reduce: int
    allgather: int
    alltoall: int
    pushed_reduce: int
    pushed_broadcast: int


#: More bytes than any call has: no limit.
ANY_SIZE = 1 << 62
#: The limits where the CPU's vendor has none of its own: the EPYC machine's (PIPE_FAMILY).
PIPE_LIMITS_ELSEWHERE = PipeLimits(
    reduce=4 * 1024 * 1024,
    allgather=8 * 1024 * 1024,
    alltoall=ANY_SIZE,
    pushed_reduce=4 * 1024 * 1024,
    pushed_broadcast=4 * 1024 * 1024,
)
#: The Intel Xeon machine's (see PIPE_LIMITS above), by ``vendor_id`` in /proc/cpuinfo.
PIPE_LIMITS_BY_VENDOR = {
    "GenuineIntel": PipeLimits(
        reduce=2 * 1024 * 1024,
        allgather=2 * 1024 * 1024,
        alltoall=0,
        pushed_reduce=0,
        pushed_broadcast=0,
    ),
}


def pipe_limits(vendor: str) -> PipeLimits:
    """The pipe's limits on a CPU of ``vendor`` (``vendor_id`` in /proc/cpuinfo)."""
    return PIPE_LIMITS_BY_VENDOR.get(vendor, PIPE_LIMITS_ELSEWHERE)


#: The limits on this machine. Every rank of a communicator that has a shared segment runs
#: on one host, so all read the same vendor and decide alike.
PIPE_LIMITS = pipe_limits(cpu_vendor())
PIPE_MAX_REDUCE_BYTES = PIPE_LIMITS.reduce
PIPE_MAX_PUSHED_REDUCE_BYTES = PIPE_LIMITS.pushed_reduce
PIPE_MAX_PUSHED_BROADCAST_BYTES = PIPE_LIMITS.pushed_broadcast
PIPE_MAX_ALLGATHER_BYTES = PIPE_LIMITS.allgather
PIPE_MAX_ALLTOALL_BYTES = PIPE_LIMITS.alltoall

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
# directly (_cma_reductions.cma_reduce_scatter) above CMA_MIN_REDUCE_SCATTER_BYTES, the
# control going by frames. Measured with bench/thresholds.py (float32, 7 alternating rounds
# of 10 calls, slowest rank; cma against recursive halving up to 1 MiB, the ring above, us):
# without a segment at world 2, 64 KiB 91 / 78, 256 KiB 109 / 132, 1 MiB 220 / 295; at
# world 4, 256 KiB 691 / 606, 1 MiB 952 / 999.
CMA_MIN_REDUCE_SCATTER_BYTES = 1024 * 1024
# Reduce without a segment reads the same way (_cma_reductions.cma_reduce: each rank
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
