"""Allreduce and broadcast by cross-memory attach between the ranks of one host."""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._algorithms import World, chunks
from .._concurrency import run_concurrently
from .._util import ignore_fp_errors
from . import _cma

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._framing import Link
    from .._wire import OpSpec

__all__ = ["ANNOUNCE", "cma_allreduce", "cma_broadcast", "parse_announce", "read_peer"]


# -- cross-memory attach ---------------------------------------------------------------------
#
# Ranks on one host read each other's arrays directly (see _cma), so each byte is copied once.
# Frames still carry every step's identity (mismatches raise as with sockets), and they order
# the memory accesses: a rank reads a region of a peer's array only after the peer said the
# region holds what the step needs, and it returns only after every peer said it has finished
# reading its array, so a caller may overwrite the array as soon as the call returns.

#: How long a copy may hold the thread before it lets other tasks run.
_SCHEDULE_EVERY_SECONDS = 0.001

ANNOUNCE = struct.Struct("<QQ")  # address of the array's data, its size in bytes


def parse_announce(link: Link, spec: OpSpec, data: bytearray, nbytes: int) -> int:
    address, announced = ANNOUNCE.unpack(data)
    if announced != nbytes:
        raise link.protocol_error(
            spec, f"announced an array of {announced} bytes, expected {nbytes}"
        )
    return int(address)


async def read_peer(world: World, spec: OpSpec, peer: int, address: int, into: np.ndarray) -> None:
    """Copy ``into.nbytes`` bytes from ``address`` in ``peer``'s memory into ``into``, chunk by
    chunk. Cancellation is noticed after every chunk; other tasks get to run at least every
    millisecond (a schedule point after each chunk would cost more than the copy itself at a
    few MiB)."""
    assert world.peer_pids is not None
    pid = world.peer_pids[peer]
    local = into.ctypes.data
    done, total = 0, into.nbytes
    since = time.perf_counter()
    while done < total:
        step = min(world.chunk_bytes, total - done)
        try:
            _cma.read_into(pid, address + done, local + done, step)
        except _cma.CmaError as exc:
            raise world.links[peer].memory_failed(spec, exc) from exc
        done += step
        if time.perf_counter() - since >= _SCHEDULE_EVERY_SECONDS:
            await trio.lowlevel.checkpoint()
            since = time.perf_counter()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()


async def cma_allreduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Allreduce by direct reads: rank r reduces segment r of the array, reading that segment
    of every peer's array chunk by chunk (own values first, then peers in rank order); then
    it copies every other finished segment from the rank that owns it.

    Each segment is computed on one rank only and copied from there, so the result is
    bitwise identical on every rank. Frames: step 0 announces the array's address, step 1
    says "my segment is final" (after which peers read it, and we may overwrite theirs in
    ours), step 2 says "done reading yours". Each rank sends a step to every peer before it
    waits for that step from any, so one task does it all, without deadlock: starting tasks
    and passing frames between them cost more than the copies at a few MiB. An abort frame
    from a peer other than the one being waited for is still seen, by the watch that a long
    wait keeps on the idle links (``Link._park``). Scratch: one chunk.
    """
    n, r = world.size, world.rank
    peers = [q for q in range(n) if q != r]
    itemsize = flat.dtype.itemsize
    total = flat.shape[0]
    bounds = [i * total // n for i in range(n + 1)]
    addresses: dict[int, int] = {}
    empty = memoryview(b"")
    announce = bytearray(ANNOUNCE.size)
    mine = memoryview(ANNOUNCE.pack(flat.ctypes.data, flat.nbytes))
    # The waits for the peers' frames poll briefly like any receive (see Link._recv_some).
    # Parking at once looked right, since the peer waited for is copying megabytes, but the
    # poll's first try yields the CPU, often to that very peer, and a wake-up through the
    # event loop costs more: parking made 1 MiB at world 4 on 2 cores 1.8x slower (4 MiB
    # 1.3x, world 2 4 MiB 1.2x; 64 MiB unchanged).
    for peer in peers:
        await world.links[peer].send(spec, 0, mine)
    chunk = max(1, world.chunk_bytes // itemsize)
    scratch = world.scratch[: chunk * itemsize].view(flat.dtype)
    lo, hi = bounds[r], bounds[r + 1]
    # Overflow to inf is a valid result, as in ring_allreduce.
    with ignore_fp_errors():
        for peer in peers:
            link = world.links[peer]
            await link.recv(spec, 0, memoryview(announce))
            addresses[peer] = address = parse_announce(link, spec, announce, flat.nbytes)
            for offset, count in chunks(lo, hi, chunk):
                if not count:
                    continue
                incoming = scratch[:count]
                await read_peer(world, spec, peer, address + offset * itemsize, incoming)
                target = flat[offset : offset + count]
                reduce(target, incoming, out=target)
        if divide:
            np.divide(flat[lo:hi], n, out=flat[lo:hi])
    for peer in peers:
        await world.links[peer].send(spec, 1, empty)
    for peer in peers:
        await world.links[peer].recv(spec, 1, empty)
        start, stop = bounds[peer], bounds[peer + 1]
        if stop > start:
            await read_peer(world, spec, peer, addresses[peer] + start * itemsize, flat[start:stop])
    for peer in peers:
        await world.links[peer].send(spec, 2, empty)
    # The peers have finished reading our array: only now may we return.
    for peer in peers:
        await world.links[peer].recv(spec, 2, empty)


async def cma_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Broadcast by direct reads: the root announces its array's address (step 0), every
    other rank copies it and says so (step 1); the root returns when all have, listening to
    every peer at once. The caller's barrier round has already checked that every rank
    agrees on ``root``."""
    n, r = world.size, world.rank
    empty = memoryview(b"")
    if r == root:
        peers = [q for q in range(n) if q != r]
        mine = memoryview(ANNOUNCE.pack(flat.ctypes.data, flat.nbytes))
        for peer in peers:
            await world.links[peer].send(spec, 0, mine)

        def listener(peer: int) -> Callable[[], Awaitable[None]]:
            async def listen() -> None:
                await world.links[peer].recv(spec, 1, empty)

            return listen

        await run_concurrently(*(listener(peer) for peer in peers))
        return
    link = world.links[root]
    data = bytearray(ANNOUNCE.size)
    await link.recv(spec, 0, memoryview(data))
    address = parse_announce(link, spec, data, flat.nbytes)
    await read_peer(world, spec, root, address, flat.view(np.uint8))
    await link.send(spec, 1, empty)
