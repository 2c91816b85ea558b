"""Unix-domain socket transport (all ranks on one host)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket as _stdlib_socket
import stat
import struct
import tempfile
from typing import final

import trio

from .._util import UNIX_PATH_MAX_BYTES, socket_temp_root
from ._abc import Transport, TransportContext
from ._socket import SocketConnection, SocketListener

__all__ = ["UnixTransport"]

_LISTEN_BACKLOG = 512
#: Send buffer asked for on every connection. The default (208 KiB) holds less than one
#: 256 KiB frame, so every larger frame waits for the receiver mid-send; 1 MiB (which Linux
#: doubles, within ``net.core.wmem_max``) takes a whole 1 MiB chunk at once. Measured
#: without cross-memory attach, median of 3 runs each: allreduce of 256 KiB at world 4
#: 1196 -> 348 us, of 1 MiB at world 2 669 -> 253 us, of 4 MiB at world 2 2332 -> 1459 us.
#: A limit, not an allocation: the kernel uses it only for bytes in flight.
_SEND_BUFFER_BYTES = 1024 * 1024


def _check_path(path: str) -> None:
    if path.startswith("\0"):
        # Abstract sockets have no file permissions and are shared by a whole network
        # namespace (CVE-2020-15257): never used implicitly.
        raise OSError(errno.EINVAL, "abstract-namespace Unix sockets are not supported; use a path")
    if len(os.fsencode(path)) > UNIX_PATH_MAX_BYTES:
        raise OSError(
            errno.ENAMETOOLONG,
            f"Unix socket path {path!r} is {len(os.fsencode(path))} bytes; the limit is "
            f"{UNIX_PATH_MAX_BYTES}. Use a shorter TRIORING_SOCKET_DIR",
        )


async def _remove_if_stale(path: str) -> None:
    """Unlink ``path`` if it is a socket nobody listens on (left by a killed job). A live
    socket or anything that is not a socket is left alone, and binding then fails."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        return
    probe = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await probe.connect(path)
    except ConnectionRefusedError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    except OSError:
        pass
    finally:
        probe.close()


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _tune(sock: trio.socket.SocketType) -> None:
    # Stream Unix sockets are limited by the sender's buffer alone (there is no receive
    # window), so only SO_SNDBUF matters. Where wmem_max is lower the kernel caps the value.
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, _SEND_BUFFER_BYTES)


def _same_user(sock: trio.socket.SocketType) -> bool:
    """Admit only processes of our own user: the socket file is 0600 already, but a process
    that opened it before the chmod, or root, could still connect."""
    so_peercred = getattr(_stdlib_socket, "SO_PEERCRED", None)
    if so_peercred is None:  # pragma: no cover - not Linux: rely on the file's mode
        return True
    _, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(trio.socket.SOL_SOCKET, so_peercred, _PEERCRED.size)
    )
    return bool(uid == os.getuid())


@final
class UnixTransport(Transport):
    """Unix-domain stream sockets: ranks on one host only, no TCP port needed.

    Listeners live in :attr:`TransportContext.socket_dir` when given (it must be shared by
    all ranks), otherwise in a private directory (mode 0700) this transport creates and
    removes in :meth:`close`.
    """

    name = "unix"
    description = "Unix-domain sockets (one host)"

    def __init__(self, context: TransportContext) -> None:
        super().__init__(context)
        self._private_dir: str | None = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not hasattr(_stdlib_socket, "AF_UNIX"):
            return "AF_UNIX sockets are not supported on this platform"
        return None

    def _directory(self) -> str:
        if self.context.socket_dir is not None:
            return self.context.socket_dir
        if self._private_dir is None:
            # mkdtemp's name: the prefix and 8 random characters.
            root = socket_temp_root(len("trioring-") + 8)
            self._private_dir = tempfile.mkdtemp(prefix="trioring-", dir=root)
        return self._private_dir

    def close(self) -> None:
        """Remove the private socket directory, if this transport made one."""
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    async def listen(self, address: str | None = None) -> SocketListener:
        if address is None:
            address = os.path.join(
                self._directory(), f"r{self.context.rank}-{secrets.token_hex(4)}.sock"
            )
        _check_path(address)
        await _remove_if_stale(address)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        try:
            await sock.bind(address)
            # Between bind and chmod the file has the umask's mode; SO_PEERCRED (see
            # _same_user) still keeps other users out in that window.
            os.chmod(address, 0o600)
            sock.listen(_LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        path = address

        def unlink() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

        return SocketListener(sock, address, admit=_same_user, configure=_tune, on_close=unlink)

    async def connect(self, address: str) -> SocketConnection:
        _check_path(address)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        try:
            await sock.connect(address)
            _tune(sock)
        except BaseException:
            sock.close()
            raise
        return SocketConnection(sock)
