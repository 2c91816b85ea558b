"""What every communicator of one world shares on this rank (:class:`Family`): the transport,
the data listener, which stays open so that sub-communicators get connections of their own
without a new rendezvous, every rank's data address, the point-to-point plane
(:mod:`trioring._p2p`), and the background tasks all of these need (the listener's acceptor
and the point-to-point readers), which start when the world communicator opens and end
when it closes (see :meth:`Family.start` for why they are not in a nursery of the caller's).

Why sub-communicators get connections of their own instead of sharing the world's,
multiplexed under a communicator id: each connection keeps the collectives' receive path as it
is (the frame is read straight into the caller's array, with one header comparison), and the
kernel's flow control keeps one communicator's data from ever waiting behind another's. A
shared connection would need, for a frame of another communicator read while this one waits,
either a copy into a buffer (unbounded unless every communicator had credit-based flow control
of its own, which is a round trip per window on every large collective) or a reader task per
connection and a hand-off per frame. The price is file descriptors: ``2 (n - 1)`` for a world
of ``n`` ranks (collectives and point-to-point) plus ``m - 1`` per open sub-communicator of
``m`` ranks, and a connection set-up per pair when a sub-communicator is made (measured in
``bench/split.py``; see docs/explanation/communicators.md).

Set-up of a group's connections (GROUP_HELLO {session, key, from, to}, answered by
GROUP_ACK): like the mesh, every member connects to each member of lower rank and waits for
those of higher rank, whose connections the acceptor files under (key, from). A member that
dies meanwhile is seen by the point-to-point plane (its reader meets the end of the
connection) and ends every wait that involves it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, final

import trio

from . import _auth
from ._concurrency import run_concurrently
from ._errors import CommunicatorClosedError, PeerFailedError, RendezvousError, TrioringError
from ._framing import Link
from ._rendezvous import remove_socket_dir
from ._setup import (
    GROUP_ACK,
    GROUP_HELLO,
    Admission,
    BadMessage,
    describe_connect_error,
    introduce,
    read_message,
    send_message,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._config import Config
    from ._p2p import Endpoint
    from .transports import Connection, Listener, Transport

__all__ = ["Family"]

_logger = logging.getLogger("trioring")


@final
class Family:
    """The world-wide resources of one rank (see the module docstring). Made by
    :func:`trioring._opening.create_communicator`; :meth:`start` starts its background
    tasks, :meth:`aclose` ends them."""

    def __init__(
        self,
        *,
        config: Config,
        transport: Transport,
        listener: Listener | None,
        addresses: list[str],
        session: str,
        endpoint: Endpoint,
    ) -> None:
        self.config = config
        self.transport = transport
        self.endpoint = endpoint
        self._listener = listener
        self._addresses = addresses
        self._session = session
        #: Connections the acceptor took for a group, by (group key, world rank of the peer).
        self._arrivals: dict[tuple[str, int], Connection] = {}
        #: Set (and replaced) whenever a connection arrives, a peer is lost, or we close.
        self._changed = trio.Event()
        self._lost: dict[int, TrioringError] = {}
        self._closed = False
        self._scope = trio.CancelScope()
        self._spawned = False
        self._ready = trio.Event()
        self._finished = trio.Event()
        endpoint.on_peer_lost = self._peer_lost

    @property
    def closed(self) -> bool:
        return self._closed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _peer_lost(self, world_rank: int, error: TrioringError) -> None:
        self._lost.setdefault(world_rank, error)
        self._notify()

    async def start(self) -> None:
        """Start the background tasks: the point-to-point readers and the listener's
        acceptor. They run as a Trio system task that this family owns: :meth:`aclose` stops
        it and waits until it has. Not in a nursery of the caller's: a nursery inside
        :func:`trioring.open_communicator` would make it a misnesting error to bound the
        opening alone by a cancel scope (``with trio.fail_after(10): comm = await
        stack.enter_async_context(open_communicator())``), as the docs suggest. The task
        never raises into the program: the readers record what goes wrong with a peer and
        raise it to the calls it concerns."""
        self._spawned = True
        trio.lowlevel.spawn_system_task(self._background, name=f"trioring rank {self.config.rank}")
        await self._ready.wait()

    async def _background(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.endpoint.run)
                    if self._listener is not None:
                        nursery.start_soon(self._accept, self._listener)
                    self._ready.set()
        except Exception:
            # A bug of ours: say so, and end the world's messages (their calls then raise
            # CommunicatorClosedError) rather than crash the whole trio.run.
            _logger.exception("rank %d: trioring's background task failed", self.config.rank)
        finally:
            self._ready.set()
            self._finished.set()

    async def _accept(self, listener: Listener) -> None:
        config = self.config
        admission = Admission(config, "set-up of a sub-communicator")

        async def handle(connection: Connection) -> None:
            async def greet() -> tuple[str, int]:
                client = await _auth.accept(
                    connection, config.credentials, role=_auth.Role.MESH, rank=config.rank
                )
                if client.world_size != config.world_size:
                    raise BadMessage(f"unexpected rank of world {client.world_size}")
                _, body = await read_message(connection, {GROUP_HELLO})
                key = body.get("key")
                if (
                    body.get("session") != self._session
                    or body.get("from") != client.rank
                    or body.get("to") != config.rank
                    or not isinstance(key, str)
                    or (key, client.rank) in self._arrivals
                ):
                    raise BadMessage("not from this world")
                await send_message(connection, GROUP_ACK, {"session": self._session})
                return key, client.rank

            greeted = await admission.run(connection, greet)
            if greeted is None:
                return
            if self._closed:
                await trio.aclose_forcefully(connection)
                return
            self._arrivals[greeted] = connection
            self._notify()

        async with trio.open_nursery() as nursery:
            while True:
                try:
                    connection = await listener.accept()
                except trio.ClosedResourceError:
                    return
                nursery.start_soon(handle, connection)

    async def connect_group(
        self,
        key: str,
        members: Sequence[int],
        *,
        rank: int,
        watch: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[int, Link]:
        """Connect this rank (``rank`` of the group; ``members`` are the world ranks of the
        group's ranks) to every other member, for the group ``key`` (identical on every
        member, unique in the world). Returns the links by group rank. ``watch`` runs
        meanwhile and may raise to end the set-up (the caller watches its own links for a
        member's abort frame). Raises :class:`PeerFailedError` when a member is lost,
        :class:`RendezvousError` when a connection cannot be made, and
        :class:`CommunicatorClosedError` when the world closes meanwhile; on any failure the
        connections made so far are closed."""
        config = self.config
        me = config.rank
        links: dict[int, Link] = {}
        job_id = config.credentials.job_id

        def lost_error(peer: int) -> TrioringError:
            cause = self._lost[members[peer]]
            error = PeerFailedError(
                f"rank {rank}: {key}: set-up of the sub-communicator's connections failed: "
                f"rank {peer} (world rank {members[peer]}) was lost ({cause._bare_message})",
                rank=rank,
                peer=peer,
                collective="split",
                job_id=job_id or None,
            )
            error.__cause__ = cause
            return error

        def check() -> None:
            if self._closed:
                raise CommunicatorClosedError(
                    f"rank {rank}: {key}: the world communicator was closed during the set-up "
                    "of a sub-communicator",
                    rank=rank,
                    collective="split",
                    job_id=job_id or None,
                )
            # Only the members whose connection is still to come: one that finished its
            # part and left at once (its process is done) has given us all we need.
            for peer, world_rank in enumerate(members):
                pending = peer not in links and (
                    peer < rank or (key, world_rank) not in self._arrivals
                )
                if world_rank in self._lost and peer != rank and pending:
                    raise lost_error(peer)

        async def connect_to(peer: int) -> None:
            world_rank = members[peer]
            address = self._addresses[world_rank]

            def error(message: str) -> RendezvousError:
                return RendezvousError(
                    f"rank {rank}: {key}: {message}",
                    rank=rank,
                    peer=peer,
                    collective="split",
                    job_id=job_id or None,
                )

            try:
                connection = await self.transport.connect(address)
            except OSError as exc:
                check()
                raise error(
                    f"cannot connect to rank {peer} (world rank {world_rank}) at {address}: "
                    f"{describe_connect_error(exc)}"
                ) from exc
            try:
                await introduce(
                    connection,
                    config,
                    peer=world_rank,
                    hello=(
                        GROUP_HELLO,
                        {"session": self._session, "key": key, "from": me, "to": world_rank},
                    ),
                    ack=(GROUP_ACK, {"session": self._session}),
                )
            except (BadMessage, _auth.HandshakeError) as exc:
                await trio.aclose_forcefully(connection)
                check()
                raise error(f"handshake with rank {peer} at {address} failed: {exc}") from exc
            except BaseException:
                await trio.aclose_forcefully(connection)
                raise
            links[peer] = Link(rank, peer, connection, job_id=job_id)

        async def wait_higher() -> None:
            while True:
                check()
                for peer in range(rank + 1, len(members)):
                    connection = self._arrivals.pop((key, members[peer]), None)
                    if connection is not None:
                        links[peer] = Link(rank, peer, connection, job_id=job_id)
                if all(peer in links for peer in range(rank + 1, len(members))):
                    return
                await self._changed.wait()

        async def connect_all() -> None:
            await run_concurrently(wait_higher, *(_bound(connect_to, peer) for peer in range(rank)))

        try:
            if watch is None:
                await connect_all()
            else:
                watching_scope = trio.CancelScope()

                async def watching() -> None:
                    with watching_scope:
                        await watch()
                        await trio.sleep_forever()

                async def connecting() -> None:
                    try:
                        await connect_all()
                    finally:
                        watching_scope.cancel()

                await run_concurrently(watching, connecting)
        except BaseException:
            for link in links.values():
                await trio.aclose_forcefully(link.connection)
            for peer in range(rank + 1, len(members)):
                stray = self._arrivals.pop((key, members[peer]), None)
                if stray is not None:
                    await trio.aclose_forcefully(stray)
            raise
        return links

    async def aclose(self) -> None:
        """Stop the background tasks and close the listener, the point-to-point plane and the
        transport. Idempotent. Communicators close their own links."""
        if self._closed:
            return
        self._closed = True
        self._notify()
        with trio.CancelScope(shield=True):
            if self._listener is not None:
                await trio.aclose_forcefully(self._listener)
            for connection in self._arrivals.values():
                await trio.aclose_forcefully(connection)
            self._arrivals.clear()
            await self.endpoint.aclose()
            self._scope.cancel()
            if self._spawned:
                await self._finished.wait()
        self.transport.close()
        remove_socket_dir(self.config)


def _bound(
    function: Callable[[int], Awaitable[None]], argument: int
) -> Callable[[], Awaitable[None]]:
    async def bound() -> None:
        await function(argument)

    return bound
