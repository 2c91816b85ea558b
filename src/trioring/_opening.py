"""Opening a communicator: the checks at the entry points (inside Trio? another open of the
same rank in progress?), the set-up (rendezvous, mesh, the one-host paths' agreement, see
:func:`trioring._rendezvous.connect_world`), and :func:`open_communicator`."""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from . import _config, _registry
from ._communicator import DEFAULT_CHUNK_BYTES, Communicator
from ._errors import CollectiveError, ConcurrentOpenError, ConfigurationError, RendezvousError
from ._family import Family
from ._onehost import _agree as onehost_agree
from ._p2p import Endpoint
from ._rendezvous import connect_world
from ._util import async_context_only
from .transports import TcpTransport, Transport, TransportContext, UnixTransport

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ._framing import Link
    from ._onehost._shm import SharedSlots

__all__ = ["create_communicator", "open_communicator", "require_trio"]


async def create_communicator(
    config: _config.Config,
    make_transport: Callable[[TransportContext], Transport],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Communicator:
    """Assemble the world and return its communicator, whose background tasks (the
    point-to-point readers, the listener's acceptor) run until it closes."""
    if config.transport == "memory":
        make_rendezvous: Callable[[TransportContext], Transport] = make_transport
    elif config.rendezvous_over_socket_dir:
        make_rendezvous = UnixTransport
    else:
        make_rendezvous = TcpTransport
    peer_pids: dict[int, int] | None = None
    shm: SharedSlots | None = None
    spin = config.spin_seconds
    crowded = False

    async def agree(links: dict[int, Link]) -> None:
        # Runs inside connect_world's set-up, so that a rank failing here (or dying) aborts
        # every rank's open_communicator, not only its neighbours'.
        nonlocal peer_pids, shm, spin, crowded
        try:
            spin, peer_pids, shm, crowded = await onehost_agree.agree_on_paths(config, links)
        except CollectiveError as exc:
            raise RendezvousError(
                f"rank {config.rank}: rendezvous failed while agreeing on capabilities: "
                f"{exc._bare_message}",
                rank=config.rank,
                peer=exc.peer,
                collective="rendezvous",
                job_id=config.credentials.job_id or None,
            ) from exc

    try:
        assembled = await connect_world(config, make_transport, make_rendezvous, agree)
    except BaseException:
        # connect_world closed the links and the transport; the segment is ours.
        if shm is not None:
            shm.close()
        raise
    links = assembled.links
    family = Family(
        config=config,
        transport=assembled.transport,
        listener=assembled.listener,
        addresses=assembled.addresses,
        session=assembled.session,
        endpoint=Endpoint(
            rank=config.rank,
            connections=assembled.p2p,
            job_id=config.credentials.job_id or None,
            spin_seconds=spin,
            peer_pids=peer_pids,
            crowded=crowded,
        ),
    )
    try:
        await family.start()
    except BaseException:
        with trio.CancelScope(shield=True):
            if shm is not None:
                shm.close()
            for link in links.values():
                await trio.aclose_forcefully(link.connection)
            await family.aclose()
        raise
    comm = Communicator._create(
        rank=config.rank,
        world_size=config.world_size,
        family=family,
        links=links,
        chunk_bytes=chunk_bytes,
        job_id=config.credentials.job_id,
    )
    comm._world.peer_pids = peer_pids
    for collective, name in config.algorithms.items():
        comm._force_algorithm(collective, name)
    comm._world.shm = shm
    # Only now: a long wait watches the other links by reading their frames ahead, and the
    # set-up above reads the segment's frame straight off the socket (its descriptor travels
    # beside the bytes), which must not have been read ahead. With 64 ranks on 2 cores the
    # set-up's waits outlast _WATCH_AFTER_SECONDS, and a watch took rank 0's segment frame:
    # every 64-rank world failed to open.
    for link in links.values():
        link.watch = list(links.values())
    return comm


def require_trio(what: str) -> None:
    """Raise ConfigurationError unless running inside ``trio.run``: called from asyncio (or no
    event loop at all), Trio's own calls would fail later with internal RuntimeErrors.

    Only the entry points check (open_communicator, open_local_world): a Communicator can only
    be made inside Trio, so its methods need not pay for the check on every collective."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        pass
    else:
        return
    # Without importing asyncio ourselves (and sniffio is not a dependency): a running
    # asyncio loop can only exist if the program imported asyncio.
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None and asyncio._get_running_loop() is not None:
        where = (
            "from asyncio. Run the program with trio.run(main) instead (from asyncio code, "
            "trio.run can run in a thread: await asyncio.to_thread(trio.run, main))"
        )
    else:
        where = "outside trio.run. Run the program with trio.run(main)"
    raise ConfigurationError(f"trioring needs Trio (trio.run); {what} was called {where}")


def _concurrent_open(config: _config.Config) -> ConcurrentOpenError:
    if config.world_size == 1:
        world = "a world of one rank"
    elif config.rendezvous_over_socket_dir:
        world = f"{config.transport}, socket directory {config.socket_dir}"
    else:
        world = f"{config.transport}, rendezvous at {config.master_addr}:{config.master_port}"
    job_id = config.credentials.job_id or None
    return ConcurrentOpenError(
        f"rank {config.rank}: another open_communicator() call of this process is still "
        f"opening rank {config.rank} of the same world ({world}); opening communicators "
        "concurrently is not supported. Run the collectives one after another on one "
        "communicator, or open the second communicator after the first one is open",
        rank=config.rank,
        collective="rendezvous",
        job_id=job_id,
    )


_OpeningKey = tuple[int, str, str | None, int | None, str | None, str]
#: Who is connecting, and to which world (rank, transport, master address and port, socket
#: directory, job id), for every open_communicator() call of this process that has not
#: finished opening. Two at once for the same rank of one world would both try to be that
#: rank at one rendezvous (rank 0 fails to bind, the others wait forever), so the second one
#: fails at once, on every rank alike (see ConcurrentOpenError).
_OPENING: set[_OpeningKey] = set()


def _opening_key(config: _config.Config) -> _OpeningKey:
    return (
        config.rank,
        config.transport,
        config.master_addr,
        config.master_port,
        config.socket_dir,
        config.credentials.job_id,
    )


@async_context_only("trioring.open_communicator()")
@asynccontextmanager
async def open_communicator(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    transport: str | None = None,
) -> AsyncIterator[Communicator]:
    """Join a world of ``world_size`` processes and yield a connected :class:`Communicator`;
    close it on exit. When an exception (a cancellation too) leaves the block, the peers are
    told what it was before the communicator closes: one that waits for this rank in a
    collective, or calls one later, raises :class:`~trioring.PeerAbortedError` saying so.

    Every argument left as ``None`` is read from the environment, as ``torch.distributed``
    does: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
    ``TRIORING_TRANSPORT`` (``"tcp"`` by default, ``"unix"``, or any registered transport).
    With ``TRIORING_TRANSPORT=unix`` and ``TRIORING_SOCKET_DIR`` set to a directory shared by
    all ranks, no TCP port is used at all; without it, rendezvous goes through
    ``MASTER_ADDR:MASTER_PORT`` and data through Unix sockets. A world of size 1 needs no
    address. Missing or invalid settings raise :class:`~trioring.ConfigurationError` naming
    the variable, and an unknown or unavailable transport raises
    :class:`~trioring.ConfigurationError` or :class:`~trioring.TransportUnavailable`, all
    before any I/O.

    Rank 0 listens at ``MASTER_ADDR:MASTER_PORT``; the other ranks retry connecting until it
    does. There is no internal timeout: wrap the call in ``trio.fail_after`` to bound how long
    to wait for missing ranks. Cancellation while connecting closes everything opened so far.

    One process opens one communicator per world at a time: a call made while another call
    of this process is still opening the same rank of the same world raises
    :class:`~trioring.ConcurrentOpenError` at once (on every rank, since every rank makes the
    same calls). Opening another communicator with the same settings after this one is open
    works; so do collectives on several open communicators at once.

    Raises:
        ConfigurationError, TransportUnavailable: before any I/O; ``ConfigurationError`` also
            when called outside ``trio.run`` (from asyncio, say).
        ConcurrentOpenError: before any I/O, see above.
        RendezvousError: the world is inconsistent (different ``WORLD_SIZE``, duplicate
            ``RANK``, different transports) or a peer cannot be reached.
    """
    require_trio("open_communicator()")
    config = _config.resolve(
        rank=rank,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        transport=transport,
    )
    transport_cls = _registry.get_transport(config.transport, source=config.transport_source)
    key = _opening_key(config)
    if key in _OPENING:
        raise _concurrent_open(config)
    _OPENING.add(key)
    try:
        comm = await create_communicator(config, transport_cls)
    finally:
        _OPENING.discard(key)
    try:
        yield comm
    except BaseException as exc:
        await comm._leave_because(exc)
        raise
    finally:
        await comm.aclose()
