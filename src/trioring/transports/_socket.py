"""Connection and Listener over trio sockets, shared by the TCP and Unix transports.

We use raw ``trio.socket`` calls instead of ``trio.SocketStream``: ``recv_into`` lets bulk data
land straight in numpy arrays, and ``sendmsg`` sends a frame header and its payload in one
system call. The price is that we translate ``OSError`` ourselves, as ``SocketStream`` would.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import os
import socket
import termios
from functools import partial
from typing import TYPE_CHECKING, TypeVar, final

import trio

from . import _liveness
from ._abc import BytesLike, Connection, Listener

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

_T = TypeVar("_T")

# Linux caps sendmsg at IOV_MAX (1024) buffers; we never pass more than a handful.
_ACCEPT_RETRY_ERRNOS = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR}
# Out of file descriptors or memory: wait for some to be released instead of failing the
# whole rendezvous (a flood of connections must not take the job down), as trio.serve_* do.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_ACCEPT_CAPACITY_SLEEP = 0.1


def advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``views`` after their first ``sent`` bytes went out."""
    rest = []
    for view in views:
        if sent >= view.nbytes:
            sent -= view.nbytes
            continue
        rest.append(view[sent:])
        sent = 0
    return rest


# Errors that mean "the peer's host stopped answering" rather than "the peer closed": the
# kernel's timeout (keepalive, or ours, see _liveness), reported as the last ICMP error it
# got meanwhile where it got one.
UNREACHABLE_ERRNOS = frozenset(
    {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}
)


def _load_recv() -> Callable[..., int] | None:
    # recv(2) with MSG_PEEK, which os has no call for: looking at what a socket holds without
    # taking it (see SocketConnection.peek_nowait).
    try:
        function = ctypes.CDLL(None, use_errno=True).recv
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    recv: Callable[..., int] = function
    return recv


_RECV = _load_recv()
_PEEK_FLAGS = socket.MSG_PEEK | socket.MSG_DONTWAIT


@final
class PeekBuffer:
    """Memory that :meth:`SocketConnection.peek_nowait` copies into."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self.address = ctypes.addressof((ctypes.c_char * size).from_buffer(self.buffer))


@final
class SocketConnection(Connection):
    """A connected stream socket (TCP or AF_UNIX).

    With a ``peer_timeout`` (TCP only, see :mod:`trioring.transports._liveness`), every wait of
    :meth:`send_all`, :meth:`recv_into` and :meth:`send_rest`, and of
    ``wait_readable(check_peer=True)``, raises :class:`trio.BrokenResourceError` (from a
    ``TimeoutError``) once the peer's host has left the connection's data unacknowledged for
    that many seconds."""

    def __init__(self, sock: trio.socket.SocketType, *, peer_timeout: float | None = None) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._peer_timeout = peer_timeout
        self._waiting = array.array("i", [0])  # FIONREAD's answer (waiting_nowait)

    @property
    def socket(self) -> trio.socket.SocketType:
        """The underlying trio socket (for setting options; do not read or write it)."""
        return self._sock

    @property
    def peer_timeout(self) -> float | None:
        """Seconds of silence from the peer's host after which the connection fails
        (``TRIORING_PEER_TIMEOUT``); ``None`` when nothing but the operating system's own
        timeouts apply."""
        return self._peer_timeout

    def _broken(self, doing: str, exc: OSError) -> trio.BrokenResourceError:
        if exc.errno in UNREACHABLE_ERRNOS and self._peer_timeout is not None:
            return trio.BrokenResourceError(
                f"{doing} failed: no answer from the peer's host for {self._peer_timeout:g} s "
                f"(TRIORING_PEER_TIMEOUT): {exc.strerror}"
            )
        return trio.BrokenResourceError(f"{doing} failed: {exc}")

    async def _checking_peer(self, wait: Callable[[], Awaitable[_T]]) -> _T:
        """``await wait()`` (a wait that a cancellation interrupts without losing data), and
        meanwhile look at the connection every few seconds: raise OSError(ETIMEDOUT) if the
        peer's host no longer answers. The deadline costs microseconds per call: only for waits
        that are rare or expected to last."""
        timeout = self._peer_timeout
        if timeout is None:
            return await wait()
        while True:
            with trio.move_on_after(_liveness.check_interval(timeout)):
                return await wait()
            silent = _liveness.unanswered_seconds(self._sock)
            if silent is not None and silent >= timeout:
                raise TimeoutError(errno.ETIMEDOUT, f"data unacknowledged for {silent:.1f} s")

    @property
    def local_host(self) -> str | None:
        if self._sock.family in (trio.socket.AF_INET, trio.socket.AF_INET6):
            host: str = self._sock.getsockname()[0]
            return host
        return None

    async def send_all(self, *buffers: BytesLike) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if v.nbytes]
        if not views:
            await trio.lowlevel.checkpoint()
            return
        sock = self._sock
        try:
            while views:
                # trio's sendmsg sends nothing when a cancellation interrupts it.
                views = advance(views, await self._checking_peer(partial(sock.sendmsg, views)))
        except OSError as exc:
            if sock.fileno() == -1:
                raise trio.ClosedResourceError("connection was closed") from None
            raise self._broken("send", exc) from exc

    async def recv_into(self, buffer: memoryview) -> int:
        try:
            received: int = await self._checking_peer(partial(self._sock.recv_into, buffer))
        except OSError as exc:
            if self._sock.fileno() == -1:
                raise trio.ClosedResourceError("connection was closed") from None
            raise self._broken("receive", exc) from exc
        return received

    # Synchronous fast paths for trioring's own framing layer (not part of the Connection
    # contract). They skip Trio's two scheduler round trips per call when the kernel can
    # complete the operation at once, which is most of the cost of a small collective. The
    # fd-level calls are safe next to the trio socket: it is non-blocking, and it owns the fd.

    def send_nowait(self, buffers: list[memoryview]) -> int:
        """Send what the socket accepts right now; the number of bytes sent, 0 if it would
        block. Raises like :meth:`send_all`."""
        try:
            return os.writev(self._fd, buffers)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if self._sock.fileno() == -1:
                raise trio.ClosedResourceError("connection was closed") from None
            raise self._broken("send", exc) from exc

    def recv_nowait(self, buffer: memoryview) -> int | None:
        """Receive what is already there (0 at end of stream); ``None`` if it would block.
        Raises like :meth:`recv_into`."""
        try:
            return os.readv(self._fd, [buffer])
        except BlockingIOError:
            return None
        except OSError as exc:
            if self._sock.fileno() == -1:
                raise trio.ClosedResourceError("connection was closed") from None
            raise self._broken("receive", exc) from exc

    #: Whether :meth:`peek_nowait` works here (it needs the C library's recv).
    can_peek = _RECV is not None

    def peek_nowait(self, into: PeekBuffer, nbytes: int) -> int | None:
        """Copy what the socket holds (up to ``nbytes``, at most ``into``'s size) without
        taking it; the number of bytes, 0 at end of stream, ``None`` if there is nothing.
        Raises like :meth:`recv_into`; needs :attr:`can_peek`."""
        assert _RECV is not None
        if self._fd < 0:
            raise trio.ClosedResourceError("connection was closed")
        got = _RECV(self._fd, into.address, min(nbytes, len(into.buffer)), _PEEK_FLAGS)
        if got >= 0:
            return got
        code = ctypes.get_errno()
        if code in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            return None
        if self._sock.fileno() == -1:
            raise trio.ClosedResourceError("connection was closed")
        exc = OSError(code, os.strerror(code))
        raise self._broken("receive", exc) from exc

    def waiting_nowait(self) -> int:
        """How many bytes the socket holds, ready to be read (``FIONREAD``). Raises like
        :meth:`recv_into`."""
        if self._fd < 0:
            raise trio.ClosedResourceError("connection was closed")
        count = self._waiting
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, count)
        except OSError as exc:
            if self._sock.fileno() == -1:
                raise trio.ClosedResourceError("connection was closed") from None
            raise self._broken("receive", exc) from exc
        return count[0]

    async def wait_readable(self, *, check_peer: bool = False) -> None:
        """Park until the socket is readable (a checkpoint). Raises
        :class:`trio.ClosedResourceError` if it is or gets closed. With ``check_peer``, also
        raises :class:`trio.BrokenResourceError` when the peer's host stops answering (see
        :attr:`peer_timeout`); that costs a deadline, so ask for it once a wait has lasted."""
        if self._fd < 0:
            raise trio.ClosedResourceError("connection was closed")
        if not check_peer or self._peer_timeout is None:
            await trio.lowlevel.wait_readable(self._fd)
            return
        try:
            await self._checking_peer(partial(trio.lowlevel.wait_readable, self._fd))
        except TimeoutError as exc:
            raise self._broken("receive", exc) from exc

    async def wait_writable(self) -> None:
        """Park until the socket is writable (a checkpoint); closed as :meth:`wait_readable`."""
        if self._fd < 0:
            raise trio.ClosedResourceError("connection was closed")
        await trio.lowlevel.wait_writable(self._fd)

    async def send_rest(self, buffers: list[memoryview]) -> None:
        """Send all of ``buffers``, parking until the socket is writable before each try:
        for the rest of a frame that :meth:`send_nowait` did not take. Raises like
        :meth:`send_all`, also when the peer's host stops answering (see
        :attr:`peer_timeout`). If cancelled, some of the data may have been sent."""
        views = buffers
        if not views:
            await trio.lowlevel.checkpoint()
            return

        async def drain() -> None:
            nonlocal views
            while views:
                await self.wait_writable()
                views = advance(views, self.send_nowait(views))

        try:
            await self._checking_peer(drain)
        except TimeoutError as exc:
            raise self._broken("send", exc) from exc

    async def aclose(self) -> None:
        # Forget the number first: once closed, the kernel may give it to another file.
        self._fd = -1
        self._sock.close()
        await trio.lowlevel.checkpoint()


@final
class SocketListener(Listener):
    """A listening stream socket. ``admit`` may refuse an accepted connection (it is closed
    and never returned); ``configure`` sets options on admitted ones; ``on_close`` releases
    what the address holds (a socket file) after the socket is closed; ``peer_timeout`` is
    given to every accepted :class:`SocketConnection`."""

    def __init__(
        self,
        sock: trio.socket.SocketType,
        address: str,
        *,
        configure: Callable[[trio.socket.SocketType], None] | None = None,
        admit: Callable[[trio.socket.SocketType], bool] | None = None,
        on_close: Callable[[], None] | None = None,
        peer_timeout: float | None = None,
    ) -> None:
        self._sock = sock
        self._address = address
        self._configure = configure
        self._admit = admit
        self._on_close = on_close
        self._peer_timeout = peer_timeout

    @property
    def address(self) -> str:
        return self._address

    async def accept(self) -> SocketConnection:
        while True:
            try:
                conn, _ = await self._sock.accept()
            except OSError as exc:
                if self._sock.fileno() == -1:
                    raise trio.ClosedResourceError("listener was closed") from None
                if exc.errno in _ACCEPT_RETRY_ERRNOS:
                    continue
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                    await trio.sleep(_ACCEPT_CAPACITY_SLEEP)
                    continue
                raise
            if self._admit is not None and not self._admit(conn):
                conn.close()
                continue
            if self._configure is not None:
                self._configure(conn)
            return SocketConnection(conn, peer_timeout=self._peer_timeout)

    async def aclose(self) -> None:
        if self._sock.fileno() != -1:
            self._sock.close()
            if self._on_close is not None:
                self._on_close()
        await trio.lowlevel.checkpoint()
