"""Cross-memory attach: copy bytes straight out of a peer process's memory
(``process_vm_readv``, Linux), so large collectives between ranks on one host copy each byte
once instead of twice (into a socket buffer, then out of it).

Only ranks connected by Unix sockets use it: the kernel then tells us each peer's pid
(``SO_PEERCRED``), so we never trust a pid from the wire. The kernel allows the read only
where we could ptrace the peer anyway (same user, not made undumpable; Yama and seccomp may
forbid it), which :func:`probe` checks for each pair of ranks when a communicator opens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import struct
import sys
from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    import numpy as np
    import trio

__all__ = [
    "CmaError",
    "data_address",
    "peer_pid",
    "read_into",
    "unavailable_reason",
    "write_into",
    "write_unavailable_reason",
]


#: Whether this CPU makes a process's stores visible to others in program order (x86-64's
#: TSO): a point-to-point PULL's guard word relies on it (see trioring._p2p._sending);
#: elsewhere messages go through the socket. (Python cannot issue fences.)
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64")


@final
class CmaError(OSError):
    """A cross-memory read failed (the peer exited, or its buffer is gone)."""


class _IOVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("length", ctypes.c_size_t))


def _load(name: str = "process_vm_readv") -> tuple[object | None, str | None]:
    if not sys.platform.startswith("linux"):
        return None, f"{name} is Linux-only (this is {sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = getattr(libc, name)
    except (OSError, AttributeError) as exc:
        return None, f"libc has no {name}: {exc}"
    function.restype = ctypes.c_ssize_t
    function.argtypes = (
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    return function, None


_readv, _load_error = _load()
_writev, _write_load_error = _load("process_vm_writev")


def _self_test(*, write: bool = False) -> str | None:
    """Why a copy within this process by ``process_vm_readv`` (``process_vm_writev``) fails;
    None if it works."""
    name, function, error = (
        ("process_vm_writev", _writev, _write_load_error)
        if write
        else ("process_vm_readv", _readv, _load_error)
    )
    if function is None:
        return error
    source = ctypes.create_string_buffer(b"trioring", 8)
    target = ctypes.create_string_buffer(8)
    remote, local = (target, source) if write else (source, target)
    try:
        (write_into if write else read_into)(
            os.getpid(), ctypes.addressof(remote), ctypes.addressof(local), 8
        )
    except CmaError as exc:
        return f"{name} is not permitted here ({exc.strerror}; seccomp or a sandbox?)"
    if target.raw != source.raw:  # pragma: no cover - the kernel would be broken
        return f"{name} copied wrong data"
    return None


def unavailable_reason() -> str | None:
    """Why cross-memory attach cannot work in this process; None if it can (between ranks
    of the same user; :func:`probe`-style checks per peer still apply)."""
    if os.environ.get("TRIORING_CMA", "").strip() == "0":
        return "turned off by TRIORING_CMA=0"
    return _self_test()


def write_unavailable_reason() -> str | None:
    """Why this process cannot write into a peer's memory (``process_vm_writev``, which the
    kernel allows where it allows reads, but a seccomp filter may not); None if it can."""
    return _self_test(write=True)


def read_into(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` in process ``pid`` to address ``local`` here.
    Raises :class:`CmaError` (with the errno) if the kernel refuses or copies short."""
    assert _readv is not None
    _copy(_readv, pid, remote, local, nbytes)


def write_into(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``local`` here to address ``remote`` in process ``pid``:
    the reverse of :func:`read_into`, with the same errors. Only into an array that ``pid``
    announced for this very purpose, and only while it waits for the write (see
    _cma_collectives.push_into)."""
    assert _writev is not None
    _copy(_writev, pid, remote, local, nbytes)


def _copy(function: object, pid: int, remote: int, local: int, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        local_iov = _IOVec(local + done, nbytes - done)
        remote_iov = _IOVec(remote + done, nbytes - done)
        got = function(pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)  # type: ignore[operator]
        if got < 0:
            code = ctypes.get_errno()
            raise CmaError(code, os.strerror(code))
        if got == 0:
            raise CmaError(errno.EFAULT, "the peer's buffer ended early")
        done += got


_char_at = ctypes.c_char.from_buffer
_address_of = ctypes.addressof


def data_address(array: np.ndarray) -> int:
    """The address of the first byte of ``array`` (C-contiguous), as ``array.ctypes.data``
    but cheaper where it can be: through the buffer protocol, which takes a writable
    buffer of at least a byte, and falls back to ``ctypes.data`` for the others (read-only
    or empty arrays). ``ctypes.data`` makes a Python object each time: 1.0 us, and 19 us
    from the caches that a large call's copies leave (timed after a pass over 16 MiB),
    against 0.28 and 6.9 through the buffer; a call by cross-memory attach asks for one
    address per array it exposes and one per read."""
    try:
        return int(_address_of(_char_at(array)))  # type: ignore[arg-type]  # numpy arrays are buffers
    except (TypeError, ValueError):  # read-only (TypeError), empty (ValueError)
        return int(array.ctypes.data)


def peer_pid(sock: trio.socket.SocketType) -> int:
    """The pid of the process at the other end of a connected Unix socket, from the kernel."""
    import socket

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid
