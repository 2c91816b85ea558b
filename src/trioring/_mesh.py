"""The pairwise mesh: rank i connects to every j < i and accepts every j > i, twice (plane 0
carries the world communicator's collectives, plane 1 the point-to-point messages of every
communicator of the world, see :mod:`trioring._p2p`). Each data connection is authenticated
(:mod:`trioring._auth`) and then introduced with MESH_HELLO {session, from, to, plane},
answered by MESH_ACK {session, from}, so that a connection from another job, an earlier world
or a stray client is never taken for a peer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from . import _auth
from ._concurrency import is_cancellation, run_concurrently
from ._errors import RendezvousError
from ._framing import Link
from ._setup import (
    MESH_ACK,
    MESH_HELLO,
    Admission,
    BadMessage,
    describe_connect_error,
    introduce,
    job_id,
    job_suffix,
    read_message,
    send_message,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._config import Config
    from .transports import Connection, Listener, Transport

__all__ = ["connect_mesh"]

logger = logging.getLogger("trioring")


async def connect_mesh(
    config: Config,
    transport: Transport,
    listener: Listener,
    session: str,
    addresses: list[str],
    p2p: dict[int, Connection],
    links: dict[int, Link],
) -> None:
    """Connect to every lower rank and accept every higher one, filling ``links`` (plane 0)
    and ``p2p`` (plane 1). Raises
    :class:`RendezvousError` naming the peer when a connection or its handshake fails; waits
    for peers that do not come for as long as the caller's scope allows."""
    rank, size = config.rank, config.world_size

    def error(message: str, peer: int) -> RendezvousError:
        return RendezvousError(
            f"rank {rank}: {message}",
            rank=rank,
            peer=peer,
            collective="rendezvous",
            job_id=job_id(config),
        )

    async def connect_to(peer: int, plane: int) -> None:
        address = addresses[peer]
        try:
            connection = await transport.connect(address)
        except OSError as exc:
            raise error(
                f"cannot connect to rank {peer} at {address}: {describe_connect_error(exc)}", peer
            ) from exc
        try:
            await introduce(
                connection,
                config,
                peer=peer,
                hello=(MESH_HELLO, {"session": session, "from": rank, "to": peer, "plane": plane}),
                ack=(MESH_ACK, {"session": session, "from": peer}),
            )
        except (BadMessage, _auth.HandshakeError) as exc:
            await trio.aclose_forcefully(connection)
            raise error(f"handshake with rank {peer} at {address} failed: {exc}", peer) from exc
        except BaseException:
            await trio.aclose_forcefully(connection)
            raise
        if plane:
            p2p[peer] = connection
        else:
            links[peer] = Link(rank, peer, connection, job_id=config.credentials.job_id)

    admission = Admission(config, "connection set-up")

    async def accept_higher() -> None:
        pending = {(peer, plane) for peer in range(rank + 1, size) for plane in (0, 1)}
        if not pending:
            return
        async with trio.open_nursery() as nursery:

            async def handle(connection: Connection) -> None:
                async def greet() -> tuple[int, int]:
                    client = await _auth.accept(
                        connection, config.credentials, role=_auth.Role.MESH, rank=rank
                    )
                    peer = client.rank
                    if client.world_size != size or not rank < peer < size:
                        raise BadMessage(f"unexpected rank {peer} of world {client.world_size}")
                    _, body = await read_message(connection, {MESH_HELLO})
                    plane = body.get("plane")
                    if (
                        not isinstance(plane, int)
                        or (body.get("session"), body.get("from"), body.get("to"))
                        != (
                            session,
                            peer,
                            rank,
                        )
                        or (peer, plane) not in pending
                    ):
                        raise BadMessage("not from this world")
                    pending.discard((peer, plane))
                    await send_message(connection, MESH_ACK, {"session": session, "from": rank})
                    return peer, plane

                greeted = await admission.run(connection, greet)
                if greeted is None:
                    return
                peer, plane = greeted
                if plane:
                    p2p[peer] = connection
                else:
                    links[peer] = Link(rank, peer, connection, job_id=config.credentials.job_id)
                # Stop accepting only once every higher rank's handshakes have completed, not
                # merely started: cancelling earlier would cut a handshake in half.
                if all(p in links and p in p2p for p in range(rank + 1, size)):
                    nursery.cancel_scope.cancel()

            while True:
                nursery.start_soon(handle, await listener.accept())

    started = trio.current_time()
    try:
        await run_concurrently(
            accept_higher,
            *(_bind(connect_to, peer, plane) for peer in range(rank) for plane in (0, 1)),
        )
    except BaseException as exc:
        missing = sorted(set(range(size)) - links.keys() - {rank})
        if missing and is_cancellation(exc):
            logger.warning(
                "rank %d: connection set-up interrupted after %.1f s; no connection yet with "
                "ranks %s%s",
                rank,
                trio.current_time() - started,
                ", ".join(map(str, missing)),
                job_suffix(config),
            )
        raise


def _bind(function: Callable[..., Any], *arguments: int) -> Callable[[], Any]:
    async def bound() -> None:
        await function(*arguments)

    return bound
