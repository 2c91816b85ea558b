"""Assemble the world: every rank learns every other rank's data address, the ranks connect
pairwise (:mod:`trioring._mesh`), agree on their one-host capabilities, and only then does
anyone's ``open_communicator`` return.

Every connection, rendezvous and data alike, first runs the mutual HMAC handshake of
:mod:`trioring._auth`; only an authenticated peer gets to send anything else.

Rendezvous protocol (over TCP at ``MASTER_ADDR:MASTER_PORT``, or over a Unix socket in
``TRIORING_SOCKET_DIR``): rank 0 listens; every other rank connects (retrying until rank 0 is
up), opens its data listener and sends HELLO {rank, world_size, transport, address,
version, algorithms}; rank 0 checks the hellos against its own view (same world size,
transport, trioring version and forced algorithms, no duplicate rank) and answers every rank
with TABLE {session, addresses}, or REFUSE {message} to all if the world is inconsistent.
The ranks then build the mesh. Each rank's rendezvous connection stays open as its control
channel until the world has formed (READY, GO, FAILED, ABORT: see :mod:`trioring._control`),
so that a rank failing anywhere in the set-up makes every rank raise
:class:`RendezvousError` naming it, at once.

The message format is in :mod:`trioring._setup` (versioned, JSON bodies of bounded size).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket as _stdlib_socket
from typing import TYPE_CHECKING, Any, final

import attrs
import trio

from . import _auth
from ._concurrency import is_cancellation
from ._control import Coordinator, Follower
from ._errors import RendezvousError
from ._mesh import connect_mesh
from ._setup import (
    HELLO,
    Admission,
    BadMessage,
    clip,
    connect_errno,
    describe_connect_error,
    field,
    job_id,
    job_suffix,
    read_message,
    send_message,
)
from ._version import __version__
from .transports import Connection, Listener, Transport, TransportContext
from .transports._tcp import format_host_port, parse_host_port, tcp_listener

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._config import Config
    from ._framing import Link

logger = logging.getLogger("trioring")

_RETRY_FIRST_DELAY = 0.005
_RETRY_MAX_DELAY = 0.5
#: A rank still waiting for rank 0, and rank 0 still waiting for the others to join, says
#: so at WARNING after this many seconds, then every _STILL_WAITING_EVERY_S (there is no
#: internal timeout: without a deadline it waits forever).
_STILL_WAITING_FIRST_S = 30.0
_STILL_WAITING_EVERY_S = 300.0
#: The longest sleep of rank 0 until it says so (see _serve).
_STILL_WAITING_SLICE_S = 1.0


def rendezvous_socket_name(config: Config) -> str:
    """One name per job, so that jobs sharing a socket directory never meet."""
    return f"trioring-{config.credentials.job_digest[:6].hex()}.sock"


def rendezvous_address(config: Config) -> str:
    if config.rendezvous_over_socket_dir:
        assert config.socket_dir is not None
        return os.path.join(config.socket_dir, rendezvous_socket_name(config))
    assert config.master_addr is not None
    assert config.master_port is not None
    return format_host_port(config.master_addr, config.master_port)


def _why_unanswered(last_error: OSError | None) -> str:
    """What a rank that never reached rank 0 can tell from its last connection attempt. A
    refusal cannot tell "not started yet" from "already gone" (after refusing the world, say)
    apart, so it names both; rank 0's log says which."""
    if last_error is None:
        return (
            "its connection attempt got no answer at all (is the host down or unreachable, or "
            "does a firewall drop the packets?)"
        )
    code = connect_errno(last_error)
    gone = (
        "rank 0 has not started yet, or it has already exited (for instance after it "
        "refused the world: see its log)"
    )
    if code == errno.ECONNREFUSED:
        return f"connection refused: the host is up but nothing listens there, so {gone}"
    if code == errno.ENOENT:
        return f"there is no rendezvous socket there, so {gone}"
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT):
        return f"rank 0's host is unreachable ({describe_connect_error(last_error)})"
    return f"the last attempt failed: {describe_connect_error(last_error)}"


async def _reach_rank0(config: Config, transport: Transport, address: str) -> Connection:
    """Connect to the rendezvous, waiting for rank 0 to start listening. Retries for as long
    as the caller's cancel scope allows (saying so now and then); an address that cannot even
    be resolved fails at once. Logs why rank 0 never answered if the scope fires."""
    rank = config.rank
    started = trio.current_time()
    warn_at = started + _STILL_WAITING_FIRST_S
    last_error: OSError | None = None
    delay = _RETRY_FIRST_DELAY
    try:
        while True:
            try:
                return await transport.connect(address)
            except _stdlib_socket.gaierror as exc:
                raise RendezvousError(
                    f"rank {rank}: cannot resolve the rendezvous address {address} "
                    f"(MASTER_ADDR): {exc}",
                    rank=rank,
                    collective="rendezvous",
                    job_id=job_id(config),
                ) from exc
            except OSError as exc:
                last_error = exc
            if trio.current_time() >= warn_at:
                logger.warning(
                    "rank %d: still waiting for rank 0 at %s after %.0f s: %s%s",
                    rank,
                    address,
                    trio.current_time() - started,
                    _why_unanswered(last_error),
                    job_suffix(config),
                )
                warn_at = trio.current_time() + _STILL_WAITING_EVERY_S
            await trio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_DELAY)
    except BaseException as exc:
        # A group, too: trio.open_tcp_stream runs its attempts in a nursery.
        if is_cancellation(exc):
            logger.warning(
                "rank %d: rendezvous interrupted after %.1f s; rank 0 never answered at %s: %s%s",
                rank,
                trio.current_time() - started,
                address,
                _why_unanswered(last_error),
                job_suffix(config),
            )
        raise


def _inherited_listener(fd: int, address: str, peer_timeout: float | None) -> Listener:
    """The launcher's listening socket (it bound the port, so no other job can take it between
    choosing and binding). We use a duplicate, so that the inherited descriptor stays open for
    the process's next communicator, as socket activation does. Its connections are tuned
    like those of a TCP transport's own listener (keepalive included)."""
    sock = trio.socket.from_stdlib_socket(_stdlib_socket.socket(fileno=os.dup(fd)))
    try:
        port = sock.getsockname()[1]
        _, expected_port = parse_host_port(address)
        if port != expected_port:
            raise OSError(
                f"the inherited socket (TRIORING_LISTEN_FD) listens on port {port}, not "
                f"{expected_port}"
            )
    except BaseException:
        sock.close()
        raise
    return tcp_listener(sock, peer_timeout=peer_timeout)


async def _serve(
    config: Config, listener: Listener, own_address: str, coordinator: Coordinator
) -> tuple[str, list[str]]:
    """Rank 0: collect every other rank's hello (handing its connection to ``coordinator``),
    then send everyone the table; or refuse the world."""
    size = config.world_size
    hellos: dict[int, str] = {}
    problems: list[str] = []
    admission = Admission(config, "rendezvous")

    async def handle(connection: Connection) -> None:
        async def greet() -> tuple[int, str, str | None]:
            peer = await _auth.accept(
                connection, config.credentials, role=_auth.Role.RENDEZVOUS, rank=0
            )
            _, body = await read_message(connection, {HELLO})
            rank = field(body, "rank", int)
            world_size = field(body, "world_size", int)
            if (rank, world_size) != (peer.rank, peer.world_size):
                raise BadMessage("hello disagrees with the handshake")
            return rank, field(body, "address", str), _disagreement(config, rank, body)

        greeting = await admission.run(connection, greet)
        if greeting is None:
            return
        rank, address, problem = greeting
        if problem is None and rank in hellos:
            problem = f"two processes claim rank {rank} (check RANK)"
        if problems:  # another hello is being refused already
            await trio.aclose_forcefully(connection)
            return
        if problem is not None:
            problems.append(problem)
            await coordinator.refuse(problem, connection)
            nursery.cancel_scope.cancel()
            return
        hellos[rank] = address
        coordinator.join(rank, connection)
        if len(hellos) == size - 1:
            nursery.cancel_scope.cancel()

    started = trio.current_time()

    async def say_who_is_missing() -> None:
        # Without it, rank 0 of a world that was started with too few ranks (a launch by
        # hand, a WORLD_SIZE too large) waits in silence where the others say so. In short
        # sleeps: Trio keeps a cancelled sleep's deadline in its heap until that deadline
        # passes, and one sleep of 30 s per rendezvous kept one for every communicator
        # opened in the last 30 s (tests/test_faults.py's open/close cycles counted 1100
        # more objects at the end than halfway).
        warn_at = started + _STILL_WAITING_FIRST_S
        while True:
            now = trio.current_time()
            if now < warn_at:
                await trio.sleep(min(_STILL_WAITING_SLICE_S, warn_at - now))
                continue
            missing = sorted(set(range(1, size)) - hellos.keys())
            logger.warning(
                "rank 0: still waiting at %s after %.0f s for ranks %s to join (%d of %d here)%s%s",
                rendezvous_address(config),
                trio.current_time() - started,
                ", ".join(map(str, missing)),
                len(hellos) + 1,
                size,
                admission.summary(),
                job_suffix(config),
            )
            warn_at = now + _STILL_WAITING_EVERY_S

    try:
        async with trio.open_nursery() as nursery:

            async def accept_all() -> None:
                while True:
                    nursery.start_soon(handle, await listener.accept())

            nursery.start_soon(accept_all)
            nursery.start_soon(say_who_is_missing)
    except BaseException as exc:
        missing = sorted(set(range(1, size)) - hellos.keys())
        if missing and is_cancellation(exc) and not coordinator.failing:
            logger.warning(
                "rank 0: rendezvous at %s interrupted after %.1f s; ranks %s never joined%s%s",
                rendezvous_address(config),
                trio.current_time() - started,
                ", ".join(map(str, missing)),
                admission.summary(),
                job_suffix(config),
            )
        raise
    if problems:
        raise RendezvousError(
            f"rank 0: rendezvous failed: {problems[0]}", rank=0, job_id=job_id(config)
        )
    session = secrets.token_hex(16)
    addresses = [own_address] + [hellos[r] for r in range(1, size)]
    await coordinator.send_table(session, addresses)
    return session, addresses


def _disagreement(config: Config, rank: int, hello: dict[str, Any]) -> str | None:
    """Why rank 0 refuses the world because of ``rank``'s hello, or None. Besides the world
    itself, every rank must run the same trioring and force the same algorithms: both
    decide which frames go on the wire, and ranks that disagree would otherwise raise a
    ProtocolError at their first collective that says nothing of the cause (or, where two
    algorithms never exchange a frame, wait for each other)."""
    world_size = field(hello, "world_size", int)
    transport = field(hello, "transport", str)
    if world_size != config.world_size:
        return (
            f"rank {rank} says WORLD_SIZE={world_size} but rank 0 says "
            f"WORLD_SIZE={config.world_size}"
        )
    if transport != config.transport:
        return (
            f"rank {rank} uses transport {transport!r} but rank 0 uses "
            f"{config.transport!r} (check TRIORING_TRANSPORT)"
        )
    if not 0 < rank < config.world_size:
        return f"a process claims rank {rank}, outside 1..{config.world_size - 1}"
    version = hello.get("version")
    if version != __version__:
        theirs = f"trioring {version}" if isinstance(version, str) else "an older trioring"
        return (
            f"rank {rank} runs {theirs[:64]} but rank 0 runs trioring {__version__}: every "
            "rank must run the same version (its wire protocol and its choices of algorithm)"
        )
    forced, own = hello.get("algorithms"), dict(config.algorithms)
    if forced != own:
        return (
            f"rank {rank} {_forcing(forced)} but rank 0 {_forcing(own)}: every rank must "
            "force the same algorithms, which decide the frames on the wire"
        )
    return None


def _forcing(forced: object) -> str:
    """What a hello's ``algorithms`` force, as TRIORING_ALGORITHM would say it."""
    if not isinstance(forced, dict):
        return "sent a malformed list of forced algorithms"
    if not forced:
        return "forces no algorithm (TRIORING_ALGORITHM is unset or empty)"
    pairs = ",".join(f"{c}={a}" for c, a in sorted(forced.items(), key=str))
    return f"forces TRIORING_ALGORITHM={clip(pairs, 400)!r}"


async def _join(config: Config, follower: Follower, own_address: str) -> tuple[str, list[str]]:
    """Ranks other than 0: authenticate, say hello and wait for the table."""
    rank = config.rank
    hello = {
        "rank": rank,
        "world_size": config.world_size,
        "transport": config.transport,
        "address": own_address,
        "version": __version__,
        "algorithms": dict(config.algorithms),
    }
    try:
        await _auth.initiate(
            follower.connection,
            config.credentials,
            role=_auth.Role.RENDEZVOUS,
            rank=rank,
            peer=0,
            world_size=config.world_size,
        )
        await send_message(follower.connection, HELLO, hello)
    except (BadMessage, _auth.HandshakeError) as exc:
        raise RendezvousError(
            f"rank {rank}: rendezvous with rank 0 failed: {exc}",
            rank=rank,
            peer=0,
            collective="rendezvous",
            job_id=job_id(config),
        ) from exc
    follower.joined = True
    return await follower.receive_table()


async def connect_world(
    config: Config,
    make_transport: Callable[[TransportContext], Transport],
    make_rendezvous_transport: Callable[[TransportContext], Transport],
    finish: Callable[[dict[int, Link]], Awaitable[None]],
) -> Assembled:
    """Rendezvous, connect the mesh, and run ``finish(links)`` (the capability agreement)
    while every rank watches its control channel; return once every rank has done all of it.
    The data listener stays open (sub-communicators connect through it): the caller closes
    it, and then calls :func:`remove_socket_dir`.

    A failure on any rank, here or in ``finish``, makes every rank raise
    :class:`RendezvousError` naming it (this rank's own error as it is). On any failure or
    cancellation, everything opened here is closed again before the exception propagates."""
    rank, size = config.rank, config.world_size
    base = TransportContext(
        rank=rank,
        world_size=size,
        host=config.master_addr or "127.0.0.1",
        socket_dir=config.socket_dir,
        peer_timeout=config.peer_timeout,
    )
    if size == 1:
        await trio.lowlevel.checkpoint()
        alone = make_transport(base)
        try:
            await finish({})
        except BaseException:
            alone.close()
            raise
        return Assembled(transport=alone, links={}, p2p={}, listener=None, addresses=[""])

    address = rendezvous_address(config)
    rendezvous = make_rendezvous_transport(base)
    transport: Transport | None = None
    links: dict[int, Link] = {}
    p2p: dict[int, Connection] = {}
    data_listener: Listener | None = None
    session, addresses = "", [""]

    async def share() -> None:
        """This rank's part once it has the table: its connections, then ``finish``."""
        assert transport is not None
        assert data_listener is not None
        await connect_mesh(config, transport, data_listener, session, addresses, p2p, links)
        await finish(links)

    try:
        if rank == 0:
            try:
                if config.listen_fd is not None and not config.rendezvous_over_socket_dir:
                    rendezvous_listener = _inherited_listener(
                        config.listen_fd, address, config.peer_timeout
                    )
                else:
                    rendezvous_listener = await rendezvous.listen(address)
            except OSError as exc:
                raise RendezvousError(
                    f"rank 0: cannot listen for the rendezvous at {address}: {exc}",
                    rank=0,
                    collective="rendezvous",
                    job_id=job_id(config),
                ) from exc
            coordinator = Coordinator(config)

            async def serve_and_share() -> None:
                nonlocal transport, data_listener, session, addresses
                try:
                    transport = make_transport(base)
                    data_listener = await transport.listen()
                    session, addresses = await _serve(
                        config, rendezvous_listener, data_listener.address, coordinator
                    )
                finally:
                    await rendezvous_listener.aclose()
                await share()

            await coordinator.run(serve_and_share)
        else:
            started = trio.current_time()
            connection = await _reach_rank0(config, rendezvous, address)
            follower = Follower(config, connection)
            try:
                # Listen where the others can reach us: the interface TRIORING_IFNAME names,
                # else the one this connection to rank 0 went out of.
                host = config.interface_address or connection.local_host or base.host
                transport = make_transport(
                    TransportContext(
                        rank=rank,
                        world_size=size,
                        host=host,
                        socket_dir=config.socket_dir,
                        peer_timeout=config.peer_timeout,
                    )
                )
                data_listener = await transport.listen()
                try:
                    session, addresses = await _join(config, follower, data_listener.address)
                except BaseException as exc:
                    if is_cancellation(exc):
                        _log_unfinished_join(config, follower, address, started)
                    raise
                await follower.run(share)
            except BaseException as exc:
                # Before our connections close, so that rank 0 hears why from us first.
                await follower.report(exc)
                raise
            finally:
                await trio.aclose_forcefully(connection)
        assert transport is not None
        assert data_listener is not None
        return Assembled(
            transport=transport,
            links=links,
            p2p=p2p,
            listener=data_listener,
            addresses=addresses,
            session=session,
        )
    except BaseException:
        for link in links.values():
            await trio.aclose_forcefully(link.connection)
        for connection in p2p.values():
            await trio.aclose_forcefully(connection)
        if data_listener is not None:
            await trio.aclose_forcefully(data_listener)
        if transport is not None:
            transport.close()
        remove_socket_dir(config)
        raise
    finally:
        rendezvous.close()


def remove_socket_dir(config: Config) -> None:
    """Remove the socket directory trioring made for this job, if it is empty: every rank
    calls this once its listener is closed, and whichever rank gets here last removes it."""
    if config.socket_dir_derived and config.socket_dir is not None:
        with contextlib.suppress(OSError):
            os.rmdir(config.socket_dir)


@final
@attrs.frozen(kw_only=True)
class Assembled:
    """What :func:`connect_world` hands over: the transport, the world communicator's links
    (plane 0), the point-to-point connections (plane 1), the data listener (None in a world
    of one) and every rank's data address."""

    transport: Transport
    links: dict[int, Link]
    p2p: dict[int, Connection]
    listener: Listener | None
    addresses: list[str]
    session: str = ""


def _log_unfinished_join(config: Config, follower: Follower, address: str, started: float) -> None:
    if follower.joined:
        what = f"rank 0 at {address} was still waiting for other ranks to join"
    else:
        what = (
            f"rank 0 at {address} accepted the connection but never answered the handshake "
            "(is a trioring rank 0 of this job listening there?)"
        )
    logger.warning(
        "rank %d: rendezvous interrupted after %.1f s; %s%s",
        config.rank,
        trio.current_time() - started,
        what,
        job_suffix(config),
    )
