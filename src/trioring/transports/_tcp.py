"""TCP transport."""

from __future__ import annotations

import errno
import functools
import socket as _stdlib_socket
from typing import final

import trio

from . import _liveness
from ._abc import Transport
from ._socket import SocketConnection, SocketListener

__all__ = ["TcpTransport", "format_host_port", "parse_host_port", "tcp_listener"]

_LISTEN_BACKLOG = 512


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6addr]:port"``. Raises ``ValueError`` naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected 'host:port', got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_host_port(host: str, port: int) -> str:
    """Inverse of :func:`parse_host_port`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tune(sock: trio.socket.SocketType, peer_timeout: float | None) -> None:
    # Collective frames are latency-bound at small sizes: never let Nagle hold a header back.
    sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
    # A host that crashed or a partition sends nothing: without keepalive an idle connection
    # to it never fails (see _liveness for how the timeout is made of the probes).
    _liveness.configure(sock, peer_timeout)


def tcp_listener(sock: trio.socket.SocketType, *, peer_timeout: float | None) -> SocketListener:
    """A listener on ``sock``, a bound and listening TCP socket (ours, or one inherited from
    the launcher), whose accepted connections are tuned as connected ones are: no Nagle,
    and keepalive with ``peer_timeout`` (see :mod:`._liveness`)."""
    host, port = sock.getsockname()[:2]
    return SocketListener(
        sock,
        format_host_port(host, port),
        configure=functools.partial(_tune, peer_timeout=peer_timeout),
        peer_timeout=peer_timeout,
    )


@final
class TcpTransport(Transport):
    """TCP sockets; works across hosts. Listeners bind :attr:`TransportContext.host`
    (the interface this rank reached the rendezvous from) on a free port.

    With :attr:`TransportContext.peer_timeout` set, a connection whose peer's host stops
    answering (it crashed, lost its network, or a partition drops its packets) fails with
    :class:`trio.BrokenResourceError` after that many seconds (one more at most), and a
    connect to an address that does not answer raises ``TimeoutError`` after as many."""

    name = "tcp"
    description = "TCP sockets (across hosts)"

    async def listen(self, address: str | None = None) -> SocketListener:
        if address is None:
            host, port = self.context.host, 0
        else:
            host, port = parse_host_port(address)
        infos = await trio.socket.getaddrinfo(
            host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE
        )
        if not infos:  # pragma: no cover - getaddrinfo raises instead
            raise OSError(f"cannot resolve {host!r}")
        family, type_, proto, _, sockaddr = infos[0]
        sock = trio.socket.socket(family, type_, proto)
        try:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            await sock.bind(sockaddr)
            sock.listen(_LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        return tcp_listener(sock, peer_timeout=self.context.peer_timeout)

    async def connect(self, address: str) -> SocketConnection:
        host, port = parse_host_port(address)
        timeout = self.context.peer_timeout
        # A SYN to a host that is down goes unanswered, and the kernel retries it for about
        # two minutes (net.ipv4.tcp_syn_retries): bound it like any other silence.
        with trio.move_on_after(timeout if timeout is not None else float("inf")) as scope:
            stream = await trio.open_tcp_stream(host, port)
        if scope.cancelled_caught:
            raise TimeoutError(
                errno.ETIMEDOUT,
                f"no answer from {address} for {timeout:g} s (TRIORING_PEER_TIMEOUT)",
            )
        sock = stream.socket
        # trio.SocketStream sets TCP_NOTSENT_LOWAT=16 KiB, which costs 30-40% on bulk sends
        # (shared/notes/ecosystem.md); we own the socket from here on, so undo it.
        notsent_lowat = getattr(_stdlib_socket, "TCP_NOTSENT_LOWAT", None)
        if notsent_lowat is not None:
            sock.setsockopt(trio.socket.IPPROTO_TCP, notsent_lowat, -1)  # -1 = unlimited
        _tune(sock, timeout)
        return SocketConnection(sock, peer_timeout=timeout)
