"""Assemble the world: every rank learns every other rank's data address, then the ranks
connect pairwise (a full mesh: rank i connects to every j < i and accepts every j > i).

Every connection, rendezvous and data alike, first runs the mutual HMAC handshake of
:mod:`trioring._auth`; only an authenticated peer gets to send anything else.

Rendezvous protocol (over TCP at ``MASTER_ADDR:MASTER_PORT``, or over a Unix socket in
``TRIORING_SOCKET_DIR``): rank 0 listens; every other rank connects (retrying until rank 0 is
up), opens its data listener and sends HELLO {rank, world_size, transport, address}; rank 0
checks the hellos against its own view (same world size and transport, no duplicate rank)
and answers every rank with TABLE {session, addresses}, or REFUSE {message} to all if the
world is inconsistent. Data connections then open with MESH_HELLO {session, from, to},
answered by MESH_ACK, so a connection from another job, or a stray client, is never taken for
a peer.

Messages are ``"TRRV" | version u8 | type u8 | 2 pad | body length u32`` plus a JSON body of
bounded size; nothing is unpickled or evaluated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket as _stdlib_socket
import struct
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from . import _auth
from ._concurrency import is_cancellation, run_concurrently
from ._errors import RendezvousError
from ._framing import Link
from ._util import recv_exactly
from .transports import Connection, Listener, Transport, TransportContext
from .transports._socket import SocketListener
from .transports._tcp import format_host_port, parse_host_port

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._config import Config

MAGIC = b"TRRV"
VERSION = 1
HEADER = struct.Struct("<4sBBxxI")
HELLO, TABLE, REFUSE, MESH_HELLO, MESH_ACK = 1, 2, 3, 4, 5
_MAX_SMALL_BODY = 4096
_MAX_TABLE_BODY = 16 * 1024 * 1024

#: How long an accepted connection may take to authenticate and say who it is (see
#: :data:`trioring._auth.HANDSHAKE_SECONDS`).
HANDSHAKE_SECONDS = _auth.HANDSHAKE_SECONDS
#: At most this many connections may be in their handshake at once on one listener; more are
#: closed at once, so that a flood of idle connections cannot exhaust file descriptors.
MAX_PENDING_HANDSHAKES = 128

logger = logging.getLogger("trioring")

_RETRY_FIRST_DELAY = 0.005
_RETRY_MAX_DELAY = 0.5


def rendezvous_socket_name(config: Config) -> str:
    """One name per job, so that jobs sharing a socket directory never meet."""
    return f"trioring-{config.credentials.job_digest[:6].hex()}.sock"


_T = TypeVar("_T")


class _BadMessage(Exception):
    """A peer sent something that is not the expected rendezvous message."""


async def _recv_exactly(connection: Connection, size: int) -> bytearray:
    try:
        return await recv_exactly(connection, size)
    except trio.BrokenResourceError as exc:
        raise _BadMessage(f"connection broke: {exc}") from exc
    except EOFError:
        raise _BadMessage("connection closed before the message was complete") from None


async def _send_message(connection: Connection, kind: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    try:
        await connection.send_all(HEADER.pack(MAGIC, VERSION, kind, len(payload)), payload)
    except trio.BrokenResourceError as exc:
        raise _BadMessage(f"connection broke: {exc}") from exc


async def _read_message(
    connection: Connection, expected: set[int], max_body: int = _MAX_SMALL_BODY
) -> tuple[int, dict[str, Any]]:
    magic, version, kind, length = HEADER.unpack(await _recv_exactly(connection, HEADER.size))
    if magic != MAGIC:
        raise _BadMessage(f"not a trioring rendezvous message (starts with {bytes(magic)!r})")
    if version != VERSION:
        raise _BadMessage(f"protocol version {version}, this trioring speaks {VERSION}")
    if kind not in expected:
        raise _BadMessage(f"unexpected message type {kind}")
    if length > max_body:
        raise _BadMessage(f"message body of {length} bytes exceeds the limit of {max_body}")
    try:
        body = json.loads(await _recv_exactly(connection, length))
    except (ValueError, RecursionError) as exc:
        # RecursionError: JSON nested thousands of levels deep.
        raise _BadMessage(f"malformed message body: {exc!r}"[:200]) from None
    if not isinstance(body, dict):
        raise _BadMessage("malformed message body: not an object")
    return kind, body


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _BadMessage(f"field {name!r} is missing or not a {kind.__name__}")
    return value


async def _connect_retrying(
    transport: Transport, address: str, rank: int, job_id: str | None
) -> Connection:
    """Connect to the rendezvous, waiting for rank 0 to start listening. Retries for as long as
    the caller's cancel scope allows; an address that cannot even be resolved fails at once."""
    delay = _RETRY_FIRST_DELAY
    while True:
        try:
            return await transport.connect(address)
        except _stdlib_socket.gaierror as exc:
            raise RendezvousError(
                f"rank {rank}: cannot resolve the rendezvous address {address} (MASTER_ADDR): {exc}",
                rank=rank,
                collective="rendezvous",
                job_id=job_id,
            ) from exc
        except OSError:
            await trio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_DELAY)


def _inherited_listener(fd: int, address: str) -> Listener:
    """The launcher's listening socket (it bound the port, so no other job can take it between
    choosing and binding). We use a duplicate, so that the inherited descriptor stays open for
    the process's next communicator, as socket activation does."""
    sock = trio.socket.from_stdlib_socket(_stdlib_socket.socket(fileno=os.dup(fd)))
    try:
        host, port = sock.getsockname()[:2]
        _, expected_port = parse_host_port(address)
        if port != expected_port:
            raise OSError(
                f"the inherited socket (TRIORING_LISTEN_FD) listens on port {port}, not "
                f"{expected_port}"
            )
    except BaseException:
        sock.close()
        raise
    return SocketListener(sock, format_host_port(host, port))


def rendezvous_address(config: Config) -> str:
    if config.rendezvous_over_socket_dir:
        assert config.socket_dir is not None
        return os.path.join(config.socket_dir, rendezvous_socket_name(config))
    assert config.master_addr is not None
    assert config.master_port is not None
    return format_host_port(config.master_addr, config.master_port)


async def _serve(config: Config, listener: Listener, own_address: str) -> tuple[str, list[str]]:
    """Rank 0: collect every other rank's hello, then answer all of them."""
    size = config.world_size
    hellos: dict[int, tuple[Connection, str]] = {}
    failure: list[RendezvousError] = []

    async def refuse_all(message: str, culprit: Connection) -> None:
        for connection in [culprit, *(c for c, _ in hellos.values())]:
            try:
                with trio.move_on_after(1):
                    await _send_message(connection, REFUSE, {"message": message})
            except _BadMessage:
                pass

    started = trio.current_time()
    try:
        async with trio.open_nursery() as nursery:
            await _serve_hellos(config, listener, nursery, hellos, failure, refuse_all)
    except BaseException as exc:
        missing = sorted(set(range(1, size)) - hellos.keys())
        if missing and is_cancellation(exc):
            logger.warning(
                "rank 0: rendezvous at %s interrupted after %.1f s; ranks %s never joined%s",
                rendezvous_address(config),
                trio.current_time() - started,
                ", ".join(map(str, missing)),
                _job_suffix(config),
            )
        for connection, _ in hellos.values():
            await trio.aclose_forcefully(connection)
        raise
    return await _answer(config, hellos, failure, own_address)


def _job_suffix(config: Config) -> str:
    return f" [job {config.credentials.job_id}]" if config.credentials.job_id else ""


class _Admission:
    """Runs the handshakes of accepted connections, at most :data:`MAX_PENDING_HANDSHAKES` at
    a time, and logs every connection it turns away.

    When the limit is reached, the *oldest* handshake in progress is dropped to make room: a
    genuine rank completes its handshake within milliseconds, so a flood of idle connections
    only ever evicts itself instead of locking the ranks out.
    """

    def __init__(self, config: Config, where: str) -> None:
        self.rejected = 0
        self._config = config
        self._where = where
        self._pending: dict[int, trio.CancelScope] = {}
        self._next = 0

    def reject(self, reason: str) -> None:
        self.rejected += 1
        logger.info(
            "rank %d: rejected a connection during the %s: %s%s",
            self._config.rank,
            self._where,
            reason,
            _job_suffix(self._config),
        )

    async def run(
        self, connection: Connection, handshake: Callable[[], Awaitable[_T]]
    ) -> _T | None:
        """Run ``handshake`` within the deadline; return its result, or None (the connection
        then is closed and the reason logged). If the surrounding scope is cancelled (the
        rendezvous completed), the connection is closed and logged too."""
        if len(self._pending) >= MAX_PENDING_HANDSHAKES:
            oldest = next(iter(self._pending.values()))
            oldest.cancel(reason="evicted: too many handshakes in progress")
        key, self._next = self._next, self._next + 1
        scope = trio.CancelScope()
        self._pending[key] = scope
        try:
            with scope:
                with trio.fail_after(HANDSHAKE_SECONDS):
                    return await handshake()
            self.reject("evicted to make room: too many handshakes in progress")
        except (_BadMessage, _auth.HandshakeError, trio.TooSlowError) as exc:
            # A stranger, or a client that gave up: not a rank of ours.
            self.reject(str(exc) or "handshake took too long")
        except trio.Cancelled:
            self.reject("the rendezvous ended before this handshake did")
            await trio.aclose_forcefully(connection)
            raise
        finally:
            del self._pending[key]
        await trio.aclose_forcefully(connection)
        return None


async def _serve_hellos(
    config: Config,
    listener: Listener,
    nursery: trio.Nursery,
    hellos: dict[int, tuple[Connection, str]],
    failure: list[RendezvousError],
    refuse_all: Callable[[str, Connection], Any],
) -> None:
    size = config.world_size
    admission = _Admission(config, "rendezvous")

    async def handle(connection: Connection) -> None:
        async def greet() -> tuple[int, int, str, str]:
            peer = await _auth.accept(
                connection, config.credentials, role=_auth.Role.RENDEZVOUS, rank=0
            )
            _, body = await _read_message(connection, {HELLO})
            rank = _field(body, "rank", int)
            world_size = _field(body, "world_size", int)
            if (rank, world_size) != (peer.rank, peer.world_size):
                raise _BadMessage("hello disagrees with the handshake")
            return rank, world_size, _field(body, "transport", str), _field(body, "address", str)

        greeting = await admission.run(connection, greet)
        if greeting is None:
            return
        rank, world_size, transport, address = greeting
        problem = None
        if world_size != size:
            problem = f"rank {rank} says WORLD_SIZE={world_size} but rank 0 says WORLD_SIZE={size}"
        elif transport != config.transport:
            problem = (
                f"rank {rank} uses transport {transport!r} but rank 0 uses "
                f"{config.transport!r} (check TRIORING_TRANSPORT)"
            )
        elif not 0 < rank < size:
            problem = f"a process claims rank {rank}, outside 1..{size - 1}"
        elif rank in hellos:
            problem = f"two processes claim rank {rank} (check RANK)"
        if problem is not None:
            await refuse_all(problem, connection)
            failure.append(
                RendezvousError(
                    f"rank 0: rendezvous failed: {problem}",
                    rank=0,
                    job_id=config.credentials.job_id or None,
                )
            )
            nursery.cancel_scope.cancel()
            return
        hellos[rank] = (connection, address)
        if len(hellos) == size - 1:
            nursery.cancel_scope.cancel()

    async def accept_all() -> None:
        while True:
            nursery.start_soon(handle, await listener.accept())

    nursery.start_soon(accept_all)


async def _answer(
    config: Config,
    hellos: dict[int, tuple[Connection, str]],
    failure: list[RendezvousError],
    own_address: str,
) -> tuple[str, list[str]]:
    """Rank 0, once every rank said hello (or the world was refused): send the table."""
    size = config.world_size
    try:
        if failure:
            raise failure[0]
        session = secrets.token_hex(16)
        addresses = [own_address] + [hellos[r][1] for r in range(1, size)]
        for rank in range(1, size):
            try:
                await _send_message(
                    hellos[rank][0], TABLE, {"session": session, "addresses": addresses}
                )
            except _BadMessage as exc:
                raise RendezvousError(
                    f"rank 0: rank {rank} left during rendezvous: {exc}",
                    rank=0,
                    peer=rank,
                    job_id=config.credentials.job_id or None,
                ) from exc
        return session, addresses
    finally:
        for connection, _ in hellos.values():
            await trio.aclose_forcefully(connection)


async def _join(config: Config, connection: Connection, own_address: str) -> tuple[str, list[str]]:
    """Ranks other than 0: say hello and wait for the table."""
    rank = config.rank
    hello = {
        "rank": rank,
        "world_size": config.world_size,
        "transport": config.transport,
        "address": own_address,
    }
    try:
        await _auth.initiate(
            connection,
            config.credentials,
            role=_auth.Role.RENDEZVOUS,
            rank=rank,
            peer=0,
            world_size=config.world_size,
        )
        await _send_message(connection, HELLO, hello)
        kind, body = await _read_message(connection, {TABLE, REFUSE}, _MAX_TABLE_BODY)
        if kind == REFUSE:
            raise RendezvousError(
                f"rank {rank}: rank 0 refused the world: {_field(body, 'message', str)}",
                rank=rank,
                peer=0,
                collective="rendezvous",
                job_id=config.credentials.job_id or None,
            )
        session = _field(body, "session", str)
        addresses = _field(body, "addresses", list)
    except (_BadMessage, _auth.HandshakeError) as exc:
        raise RendezvousError(
            f"rank {rank}: rendezvous with rank 0 failed: {exc}",
            rank=rank,
            peer=0,
            collective="rendezvous",
            job_id=config.credentials.job_id or None,
        ) from exc
    if len(addresses) != config.world_size or not all(isinstance(a, str) for a in addresses):
        raise RendezvousError(
            f"rank {rank}: rank 0 sent an address table of the wrong shape",
            rank=rank,
            peer=0,
            collective="rendezvous",
            job_id=config.credentials.job_id or None,
        )
    return session, addresses


async def _mesh(
    config: Config,
    transport: Transport,
    listener: Listener,
    session: str,
    addresses: list[str],
    links: dict[int, Link],
) -> None:
    """Connect to every lower rank and accept every higher one, filling ``links``."""
    rank, size = config.rank, config.world_size

    def error(message: str, peer: int) -> RendezvousError:
        return RendezvousError(
            f"rank {rank}: {message}",
            rank=rank,
            peer=peer,
            collective="rendezvous",
            job_id=config.credentials.job_id or None,
        )

    async def connect_to(peer: int) -> None:
        address = addresses[peer]
        try:
            connection = await transport.connect(address)
        except OSError as exc:
            raise error(f"cannot connect to rank {peer} at {address}: {exc}", peer) from exc
        try:
            await _auth.initiate(
                connection,
                config.credentials,
                role=_auth.Role.MESH,
                rank=rank,
                peer=peer,
                world_size=size,
            )
            await _send_message(
                connection, MESH_HELLO, {"session": session, "from": rank, "to": peer}
            )
            _, body = await _read_message(connection, {MESH_ACK})
            if body.get("session") != session or body.get("from") != peer:
                raise _BadMessage("the answer came from another world or rank")
        except (_BadMessage, _auth.HandshakeError) as exc:
            await trio.aclose_forcefully(connection)
            raise error(f"handshake with rank {peer} at {address} failed: {exc}", peer) from exc
        except BaseException:
            await trio.aclose_forcefully(connection)
            raise
        links[peer] = Link(rank, peer, connection, job_id=config.credentials.job_id)

    admission = _Admission(config, "connection set-up")

    async def accept_higher() -> None:
        pending = set(range(rank + 1, size))
        if not pending:
            return
        async with trio.open_nursery() as nursery:

            async def handle(connection: Connection) -> None:
                async def greet() -> int:
                    client = await _auth.accept(
                        connection, config.credentials, role=_auth.Role.MESH, rank=rank
                    )
                    peer = client.rank
                    if client.world_size != size or peer not in pending:
                        raise _BadMessage(f"unexpected rank {peer} of world {client.world_size}")
                    _, body = await _read_message(connection, {MESH_HELLO})
                    if (body.get("session"), body.get("from"), body.get("to")) != (
                        session,
                        peer,
                        rank,
                    ):
                        raise _BadMessage("not from this world")
                    pending.discard(peer)
                    await _send_message(connection, MESH_ACK, {"session": session, "from": rank})
                    return peer

                peer = await admission.run(connection, greet)
                if peer is None:
                    return
                links[peer] = Link(rank, peer, connection, job_id=config.credentials.job_id)
                # Stop accepting only once every higher rank's handshake has completed, not
                # merely started: cancelling earlier would cut a handshake in half.
                if all(p in links for p in range(rank + 1, size)):
                    nursery.cancel_scope.cancel()

            while True:
                nursery.start_soon(handle, await listener.accept())

    started = trio.current_time()
    try:
        await run_concurrently(accept_higher, *(_bind(connect_to, peer) for peer in range(rank)))
    except BaseException as exc:
        missing = sorted(set(range(size)) - links.keys() - {rank})
        if missing and is_cancellation(exc):
            logger.warning(
                "rank %d: connection set-up interrupted after %.1f s; no connection yet with "
                "ranks %s%s",
                rank,
                trio.current_time() - started,
                ", ".join(map(str, missing)),
                _job_suffix(config),
            )
        raise


def _bind(function: Callable[[int], Any], argument: int) -> Callable[[], Any]:
    async def bound() -> None:
        await function(argument)

    return bound


async def connect_world(
    config: Config,
    make_transport: Callable[[TransportContext], Transport],
    make_rendezvous_transport: Callable[[TransportContext], Transport],
) -> tuple[Transport, dict[int, Link]]:
    """Rendezvous and connect the mesh. On any failure or cancellation, everything opened here
    is closed again before the exception propagates."""
    rank, size = config.rank, config.world_size
    base = TransportContext(
        rank=rank,
        world_size=size,
        host=config.master_addr or "127.0.0.1",
        socket_dir=config.socket_dir,
    )
    if size == 1:
        await trio.lowlevel.checkpoint()
        return make_transport(base), {}

    address = rendezvous_address(config)
    rendezvous = make_rendezvous_transport(base)
    transport: Transport | None = None
    links: dict[int, Link] = {}
    data_listener: Listener | None = None
    try:
        if rank == 0:
            try:
                if config.listen_fd is not None and not config.rendezvous_over_socket_dir:
                    rendezvous_listener = _inherited_listener(config.listen_fd, address)
                else:
                    rendezvous_listener = await rendezvous.listen(address)
            except OSError as exc:
                raise RendezvousError(
                    f"rank 0: cannot listen for the rendezvous at {address}: {exc}",
                    rank=0,
                    collective="rendezvous",
                    job_id=config.credentials.job_id or None,
                ) from exc
            try:
                transport = make_transport(base)
                data_listener = await transport.listen()
                session, addresses = await _serve(
                    config, rendezvous_listener, data_listener.address
                )
            finally:
                await rendezvous_listener.aclose()
        else:
            started = trio.current_time()
            try:
                connection = await _connect_retrying(
                    rendezvous, address, rank, config.credentials.job_id or None
                )
            except trio.Cancelled:
                logger.warning(
                    "rank %d: rendezvous interrupted after %.1f s; rank 0 never answered at %s%s",
                    rank,
                    trio.current_time() - started,
                    address,
                    _job_suffix(config),
                )
                raise
            try:
                # Listen where the others can reach us: the interface TRIORING_IFNAME names,
                # else the one this connection to rank 0 went out of.
                host = config.interface_address or connection.local_host or base.host
                transport = make_transport(
                    TransportContext(
                        rank=rank, world_size=size, host=host, socket_dir=config.socket_dir
                    )
                )
                data_listener = await transport.listen()
                try:
                    session, addresses = await _join(config, connection, data_listener.address)
                except trio.Cancelled:
                    logger.warning(
                        "rank %d: rendezvous interrupted after %.1f s; rank 0 at %s was still "
                        "waiting for other ranks to join%s",
                        rank,
                        trio.current_time() - started,
                        address,
                        _job_suffix(config),
                    )
                    raise
            finally:
                await trio.aclose_forcefully(connection)
        await _mesh(config, transport, data_listener, session, addresses, links)
        return transport, links
    except BaseException:
        for link in links.values():
            await trio.aclose_forcefully(link.connection)
        if transport is not None:
            transport.close()
        raise
    finally:
        if data_listener is not None:
            await trio.aclose_forcefully(data_listener)
        rendezvous.close()
        if config.socket_dir_derived and config.socket_dir is not None:
            # Every listener of the job is closed once the mesh is up, so the directory we
            # made is empty then; whichever rank gets here last removes it.
            with contextlib.suppress(OSError):
                os.rmdir(config.socket_dir)
