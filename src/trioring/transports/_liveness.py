"""How a TCP connection notices that its peer's host is gone (``TRIORING_PEER_TIMEOUT``).

A process that dies leaves its kernel behind, and the kernel closes the process's sockets:
the peer reads end-of-file or ``ECONNRESET`` at once. A host that crashes or loses its
network, and a partition that silently drops packets, send nothing at all, and TCP on its own
waits a very long time, or forever, to say so. Here the kernel's keepalive covers a
connection with nothing to send, and :func:`unanswered_seconds` (read from ``TCP_INFO`` by a
wait that lasts, see :class:`~trioring.transports.SocketConnection`) one with data the peer
does not acknowledge. Either way the connection fails with ``ETIMEDOUT`` once the peer's host
has answered nothing for the timeout, and never while it answers: a peer that is alive but
slow, busy or stopped (``SIGSTOP``, a debugger) is waited for, however long.
"""

from __future__ import annotations

import socket as _stdlib_socket
import struct
import sys

import trio

__all__ = ["check_interval", "configure", "keepalive_settings", "unanswered_seconds"]

# How the bound comes about, per state of a Linux TCP connection (U = the peer timeout):
#
# 1. Nothing to send (idle, or only receiving). Keepalive: once nothing has been received for
#    KEEPIDLE seconds the kernel probes every KEEPINTVL seconds and, after KEEPCNT unanswered
#    probes, fails the connection with ETIMEDOUT: KEEPIDLE + KEEPCNT * KEEPINTVL after the
#    peer's host last sent anything. keepalive_settings() makes that sum U (at most U, and
#    within one KEEPINTVL of it). A live host's kernel answers the probes even while the
#    process is stopped. KEEPIDLE is a third of U, so a live idle connection costs one probe
#    and its answer per U / 3 (10 s by default); the rest is split into at least
#    _KEEPALIVE_PROBES probes, so that a lossy network must lose all of them in a row.
# 2. Data sent and not acknowledged. Keepalive does not run then (tcp_keepalive_timer: "it is
#    alive without keepalive"); the kernel retransmits with exponential back-off and gives up
#    only after net.ipv4.tcp_retries2 (15) tries: about 15 minutes.
# 3. Data queued because the peer's receive window is closed (its process does not read:
#    stopped, or busy outside a collective while we push a large buffer at it). The kernel
#    sends window probes, backing off to one per 120 s, for as long as the peer answers
#    them, and gives up after tcp_retries2 unanswered ones.
#
# TCP_USER_TIMEOUT bounds 2 and 3 in the kernel, but since Linux 5.11 ("tcp: fix
# TCP_USER_TIMEOUT with zero window") it also fails 3 when the peer answers every probe: the
# window merely stayed closed for U. Measured on Linux 6.18: a reader that stops reading,
# TCP_USER_TIMEOUT=3000 on the sender, ETIMEDOUT after 3.4 s. A rank that computes for longer
# than U while a peer already sends it a large allreduce would be declared dead. So it stays
# unset, and for 2 and 3 a wait that lasts looks at TCP_INFO every check_interval(U): the
# peer is unreachable when at least _UNANSWERED_TRIES retransmissions or probes in a row
# went unanswered (tcpi_retransmits, tcpi_probes: any acknowledgement resets both) and it
# has acknowledged nothing for U (tcpi_last_ack_recv). A live peer acknowledges within a
# round trip, so that takes U of silence from it (on a live idle connection the last answer
# to keepalive is at most KEEPIDLE old when sending starts) or, in state 3 once the probes
# are further apart than U, two lost probes in a row. With the kernel's retransmission
# back-off (0.2 s, doubling) U = 30 s of silence is seven or more lost exchanges in a row.
# Measured in network namespaces: 30 % of one host's incoming packets dropped, no error in
# 90 s of allreduces; 30 % dropped at every host (half the exchanges fail, the job all but
# stalls), a 42 s silence within 90 s. A network that loses that much needs a larger U.
#
# Detection therefore takes at most U (state 1) or U + check_interval(U) (states 2, 3) after
# the peer's host last answered, that is at most U + 1 s after it went silent.

#: Keepalive probes to split U - KEEPIDLE into, at least (fewer when U is only a few seconds).
_KEEPALIVE_PROBES = 10
#: Retransmissions or window probes in a row without an answer, at least, before a peer
#: that has been silent for U counts as unreachable.
_UNANSWERED_TRIES = 2
#: A wait that lasts checks the connection this often: U / 10, at most this many seconds.
_MAX_CHECK_SECONDS = 1.0

# struct tcp_info (linux/tcp.h): eight u8 (state, ca_state, retransmits, probes, ...), then
# u32 fields, of which tcpi_last_ack_recv (milliseconds) is the thirteenth.
_TCP_INFO = struct.Struct("=8B13I")
_RETRANSMITS, _PROBES, _LAST_ACK_RECV = 2, 3, 20
_TCP_ESTABLISHED = 1


def keepalive_settings(timeout: float) -> tuple[int, int, int]:
    """(KEEPIDLE, KEEPINTVL, KEEPCNT) in whole seconds (the kernel's unit), whose
    KEEPIDLE + KEEPCNT * KEEPINTVL is as close to ``timeout`` (>= 2) as it can be without
    exceeding it."""
    whole = max(2, int(timeout))
    idle = max(1, whole // 3)
    interval = max(1, (whole - idle) // _KEEPALIVE_PROBES)
    return idle, interval, max(1, (whole - idle) // interval)


def check_interval(timeout: float) -> float:
    """How often a wait that lasts looks at its connection (see :func:`unanswered_seconds`)."""
    return min(timeout / 10, _MAX_CHECK_SECONDS)


def configure(sock: trio.socket.SocketType, timeout: float | None) -> None:
    """Turn on keepalive with the probes of :func:`keepalive_settings` (``None``: leave the
    system's defaults, keepalive off). TCP_USER_TIMEOUT is left unset (see above)."""
    if timeout is None:
        return
    idle, interval, count = keepalive_settings(timeout)
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_KEEPALIVE, 1)
    # TCP_KEEPIDLE is TCP_KEEPALIVE on macOS; elsewhere a missing option keeps its default.
    idle_option = getattr(
        _stdlib_socket, "TCP_KEEPIDLE", getattr(_stdlib_socket, "TCP_KEEPALIVE", None)
    )
    for option, value in (
        (idle_option, idle),
        (getattr(_stdlib_socket, "TCP_KEEPINTVL", None), interval),
        (getattr(_stdlib_socket, "TCP_KEEPCNT", None), count),
    ):
        if option is not None:
            sock.setsockopt(trio.socket.IPPROTO_TCP, option, value)


def unanswered_seconds(sock: trio.socket.SocketType) -> float | None:
    """How long the peer's host has left our retransmissions or window probes unanswered
    (states 2 and 3 above): the seconds since it last acknowledged anything, once at least
    ``_UNANSWERED_TRIES`` tries in a row went unanswered; ``None`` while it answers, when
    nothing is outstanding, and where ``TCP_INFO`` is not Linux's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        info = sock.getsockopt(trio.socket.IPPROTO_TCP, _stdlib_socket.TCP_INFO, _TCP_INFO.size)
    except OSError:
        return None  # closed meanwhile: whoever closed it reports that
    fields = _TCP_INFO.unpack_from(info)
    if fields[0] != _TCP_ESTABLISHED:
        return None
    if max(fields[_RETRANSMITS], fields[_PROBES]) < _UNANSWERED_TRIES:
        return None
    seconds: float = fields[_LAST_ACK_RECV] / 1000
    return seconds
