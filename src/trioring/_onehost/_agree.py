"""The one-host paths' set-up: when a communicator opens over Unix sockets, every rank
agrees, identically, on which of them its collectives may use (``setup #0``: cross-memory
attach at offsets 0 and 1, the shared segment at 2 and 3)."""

from __future__ import annotations

import array
import os
import socket
import struct
from typing import TYPE_CHECKING

import attrs
import numpy as np
import trio

from .._wire import HEADER, Kind, OpSpec, pack_data_header
from . import _cma, _shm
from ._cpus import cpus_of, spin_for

if TYPE_CHECKING:
    from .._config import Config
    from .._framing import Link
    from ._cpus import Cpus

__all__ = ["agree_on_cma", "agree_on_paths", "agree_on_shm"]


async def agree_on_paths(
    config: Config, links: dict[int, Link]
) -> tuple[float, dict[int, int] | None, _shm.SharedSlots | None, bool]:
    """Set up how a communicator of ``config.world_size`` ranks (this one ``config.rank``)
    waits and what its one-host paths are: the poll its waits use, set on every link (see
    :func:`~._cpus.spin_for`); over Unix sockets, both agreements, the peers' pids if
    cross-memory attach is on (else None) and the mapped segment if the shared segment is
    (else None); and whether this rank shares its CPUs with more ranks than they number
    (:meth:`~._cpus.Cpus.oversubscribed`; this rank's view, not agreed). Nothing may read
    ahead on the links meanwhile: the segment's frame is read straight off the socket. On
    failure nothing is left open."""
    one_host = config.transport == "unix" and config.world_size > 1
    cpus = cpus_of(links.values() if one_host else None)
    spin = spin_for(config, cpus)
    for link in links.values():
        link.spin_seconds = spin
    crowded = cpus.oversubscribed(config.world_size)
    if not one_host:
        return spin, None, None, crowded
    config = attrs.evolve(config, spin_seconds=spin)
    pids = await agree_on_cma(config, links)
    return spin, pids, await agree_on_shm(config, links, cpus), crowded


_OFFER = struct.Struct("<QQQ")  # offered (0/1), address of our cookie, the cookie's value


async def agree_on_cma(config: Config, links: dict[int, Link]) -> dict[int, int] | None:
    """Decide, identically on every rank, whether collectives may use cross-memory attach:
    only if every rank offers it and every rank could read a cookie from every peer's memory
    (the kernel's ptrace rules, seccomp and containers decide that, per pair). Two rounds of
    small frames on every link (``setup #0``). Returns the peers' pids, or None."""
    spec = OpSpec(Kind.SETUP, 0)
    offer = config.cma and _cma.unavailable_reason() is None
    cookie = np.frombuffer(os.urandom(8), dtype=np.uint64).copy()
    pids = (
        {peer: _cma.peer_pid(link.connection.socket) for peer, link in links.items()}  # type: ignore[attr-defined]
        if offer
        else {}
    )
    mine = memoryview(_OFFER.pack(offer, cookie.ctypes.data, int(cookie[0])))
    for link in links.values():
        await link.send(spec, 0, mine)
    readable = offer
    theirs = bytearray(_OFFER.size)
    probe = np.zeros(1, dtype=np.uint64)
    for peer, link in links.items():
        await link.recv(spec, 0, memoryview(theirs))
        offered, address, value = _OFFER.unpack(theirs)
        if not (offered and readable):
            readable = False
            continue
        try:
            _cma.read_into(pids[peer], address, probe.ctypes.data, 8)
        except _cma.CmaError:
            readable = False
        else:
            readable = int(probe[0]) == value
    verdict = memoryview(struct.pack("<Q", readable))
    for link in links.values():
        await link.send(spec, 1, verdict)
    agreed = readable
    answer = bytearray(8)
    for link in links.values():
        await link.recv(spec, 1, memoryview(answer))
        agreed = agreed and struct.unpack("<Q", answer)[0] == 1
    # Keep the cookie alive until every peer has read it (they answered after reading).
    del cookie
    return pids if agreed else None


async def agree_on_shm(
    config: Config, links: dict[int, Link], cpus: Cpus
) -> _shm.SharedSlots | None:
    """Decide, identically on every rank, whether small collectives go through a shared
    segment (see .shm): rank 0 creates it and hands it to every peer over its Unix
    connection; every rank maps it and says whether that worked; it is used only if it
    worked everywhere (``setup #0``, offsets 2 and 3). With the segment go an eventfd per
    rank (up to WAKER_MAX_RANKS), through which peers wake its parked waits. Off without polling
    (TRIORING_SPIN_US=0, or a peer that can run only on this rank's one CPU), where every
    wait would park. Each rank's answer at offset 3 also says whether it shares its CPUs
    with more ranks than there are of them (see :attr:`_shm.SharedSlots.crowded`), and how
    many CPUs it counts for all the ranks together (see :attr:`_shm.SharedSlots.cpus`)."""
    spec = OpSpec(Kind.SETUP, 0)
    offer = config.shm and config.spin_seconds > 0 and _shm.unavailable_reason() is None
    # The segment, then every rank's eventfd (see SharedSlots.wake_parked).
    wakers = config.world_size <= _shm.WAKER_MAX_RANKS
    fds: list[int] = []
    slots = None
    try:
        if config.rank == 0:
            if offer:
                try:
                    fds.append(_shm.create_segment(config.world_size))
                    if wakers:
                        fds.extend(_shm.create_wakers(config.world_size))
                except OSError:
                    offer = False
            for link in links.values():
                await _send_segment(link, spec, fds if offer else [])
        else:
            fds = await _receive_segment(links[0], spec, 1 + (config.world_size if wakers else 0))
        if offer and fds:
            try:
                slots = _shm.SharedSlots(
                    fds[0],
                    config.rank,
                    config.world_size,
                    {peer: link.connection.socket.fileno() for peer, link in links.items()},  # type: ignore[attr-defined]
                    wakers=fds[1:],
                    oversubscribed=cpus.oversubscribed(config.world_size),
                )
            except (OSError, ValueError):
                slots = None
            else:
                del fds[1:]  # the wakers are the slots' now
    finally:
        for fd in fds:
            os.close(fd)
    try:
        crowded = cpus.oversubscribed(config.world_size)
        # The CPUs all ranks may run on, by this rank's count (0: unknown), in bits 8-31:
        # the least count is every rank's. Bits 2 and 3: whether this rank offers a
        # broadcast's root writing into the readers' arrays, and reading in threads (an
        # older peer, which sends neither, turns both off).
        together = min(cpus.together(), _CPUS_MAX)
        push = config.push and _cma.STORES_IN_ORDER and _cma.write_unavailable_reason() is None
        threads = config.threads
        verdict = memoryview(
            struct.pack(
                "<Q",
                (slots is not None) | crowded << 1 | push << 2 | threads << 3 | together << 8,
            )
        )
        for link in links.values():
            await link.send(spec, 3, verdict)
        agreed = slots is not None
        answer = bytearray(8)
        for link in links.values():
            await link.recv(spec, 3, memoryview(answer))
            (word,) = struct.unpack("<Q", answer)
            agreed = agreed and word & 1 == 1
            crowded = crowded or word & 2 == 2
            push = push and word & 4 == 4
            threads = threads and word & 8 == 8
            together = min(together, word >> 8 & _CPUS_MAX)
    except BaseException:
        if slots is not None:
            slots.close()
        raise
    if not agreed and slots is not None:
        slots.close()
        slots = None
    if slots is not None:
        slots.crowded = crowded
        slots.cpus = together
        slots.push = push
        slots.threads = threads
    return slots


#: The most CPUs a rank's verdict counts (24 bits of it).
_CPUS_MAX = (1 << 24) - 1
#: How many descriptors the frame carries: the segment's and every rank's eventfd, or none.
_SEGMENT = struct.Struct("<Q")


async def _send_segment(link: Link, spec: OpSpec, fds: list[int]) -> None:
    frame = bytearray(HEADER.size + _SEGMENT.size)
    pack_data_header(frame, spec, 2, _SEGMENT.size)
    _SEGMENT.pack_into(frame, HEADER.size, len(fds))
    sock = link.connection.socket  # type: ignore[attr-defined]
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        sent = await sock.sendmsg([frame], ancillary)
        if sent < len(frame):
            await link.connection.send_all(memoryview(frame)[sent:])
    except (OSError, trio.BrokenResourceError) as exc:
        raise link.peer_failed(spec, f"connection to peer rank {link.peer} broke: {exc}") from exc


async def _receive_segment(link: Link, spec: OpSpec, count: int) -> list[int]:
    """The ``count`` descriptors rank 0 sent over ``link`` (none when it offered none)."""
    size = HEADER.size + _SEGMENT.size
    # The frame is read straight off the socket, so nothing of it may sit in the link's
    # buffers (nothing watches the links during set-up; see _create_communicator).
    assert not link.has_buffered_bytes, "setup frame read ahead"
    sock = link.connection.socket  # type: ignore[attr-defined]
    fds: list[int] = []
    try:
        try:
            data, ancillary, flags, _ = await sock.recvmsg(size, socket.CMSG_SPACE(4 * count))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    fds.extend(array.array("i", payload[:usable]))
            received = bytearray(data)
            while data and len(received) < size:
                data = await sock.recv(size - len(received))
                received += data
        except OSError as exc:
            raise link.peer_failed(
                spec, f"connection to peer rank {link.peer} broke: {exc}"
            ) from exc
        if len(received) < size:
            raise link.peer_failed(
                spec,
                f"connection to peer rank {link.peer} was closed during setup (the peer exited)",
            )
        expected = bytearray(HEADER.size)
        pack_data_header(expected, spec, 2, _SEGMENT.size)
        if received[: HEADER.size] != expected:
            raise link.protocol_error(spec, "expected the shared segment's frame during setup")
        (offered,) = _SEGMENT.unpack_from(received, HEADER.size)
        if offered == count == len(fds) and not flags & socket.MSG_CTRUNC:
            fds, mine = [], fds
            return mine
        return []
    finally:
        for fd in fds:  # all of them, unless returned
            os.close(fd)
