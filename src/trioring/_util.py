"""Small helpers with no better home."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import numpy as np

if TYPE_CHECKING:
    from .transports import Connection

T = TypeVar("T")


async def recv_exactly(connection: Connection, size: int) -> bytearray:
    """Receive exactly ``size`` bytes. Raises :class:`EOFError` if the peer closes first;
    :class:`trio.BrokenResourceError` passes through."""
    data = bytearray(size)
    view = memoryview(data)
    while view.nbytes:
        got = await connection.recv_into(view)
        if not got:
            raise EOFError(f"connection closed after {size - view.nbytes} of {size} bytes")
        view = view[got:]
    return data


class NoPublicConstructor(type):
    """Metaclass for classes users get from a factory and must not instantiate (as in Trio):
    calling the class raises ``TypeError``; the library uses ``cls._create(...)``."""

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; "
            "use trioring.open_communicator()"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]


try:  # numpy >= 2: the floating-point error state is one context variable
    from numpy._core._ufunc_config import (  # type: ignore[attr-defined]
        _extobj_contextvar,
        _make_extobj,
    )

    _IGNORE_ALL = _make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):  # numpy 1.x, or internals that moved
    _extobj_contextvar = None


class ignore_fp_errors:
    """``np.errstate(all="ignore")`` for the reductions, at a fraction of its cost.

    ``np.errstate`` builds its error-state object on every entry: 1.7 us here, as much as
    the arithmetic of a 4-byte allreduce through the shared segment. This sets a state built
    once (numpy 2's context variable, so per Trio task and safe across awaits, as errstate
    is) and falls back to ``np.errstate`` where numpy's internals differ. Only the error
    mode is frozen at import: the buffer size and error callback are those numpy had then,
    and neither changes a result."""

    __slots__ = ("_token",)
    _token: Any

    def __enter__(self) -> None:
        if _extobj_contextvar is not None:
            self._token = _extobj_contextvar.set(_IGNORE_ALL)
        else:
            self._token = np.errstate(all="ignore")
            self._token.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        if _extobj_contextvar is not None:
            _extobj_contextvar.reset(self._token)
        else:
            self._token.__exit__(*exc_info)


def is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (or a subclass, such as a Parameter). Found by
    name: trioring neither imports nor depends on torch."""
    return any(c.__module__ == "torch" and c.__qualname__ == "Tensor" for c in type(value).__mro__)


def expected_array(value: object, expected: str) -> str:
    """The refusal of ``value`` where ``expected`` (an array) belongs; for a torch tensor,
    with what to pass instead."""
    kind = type(value)
    if not is_torch_tensor(value):
        return f"expected {expected}, got {kind.__name__}"
    return (
        f"expected {expected}, got {kind.__module__}.{kind.__qualname__}: pass "
        "t.detach().numpy(), which for a CPU tensor is a view of the same memory (an "
        "in-place collective updates the tensor); copy a tensor on another device to the CPU "
        "first (t.cpu().numpy()) and the result back"
    )


#: The longest Unix socket path Linux takes (``sun_path`` is 108 bytes with its NUL).
UNIX_PATH_MAX_BYTES = 107
#: The longest socket file name trioring makes in a socket directory: the rendezvous's
#: ``trioring-<12 hex>.sock`` (a rank's data socket, ``r<rank>-<8 hex>.sock``, is shorter).
SOCKET_NAME_BYTES = 26


def socket_temp_root(dir_name_bytes: int) -> str:
    """Where to make a socket directory whose name takes ``dir_name_bytes``: the system's
    temp dir (``TMPDIR``), unless the socket paths in it would be too long, then ``/tmp``.
    Some clusters give every job a long ``TMPDIR``; a socket under one could not be bound
    at all. The same on every rank with the same ``TMPDIR`` (derived directories rely on
    it)."""
    root = tempfile.gettempdir()
    needed = len(os.fsencode(root)) + 1 + dir_name_bytes + 1 + SOCKET_NAME_BYTES
    if needed > UNIX_PATH_MAX_BYTES and os.access("/tmp", os.W_OK | os.X_OK):
        return "/tmp"
    return root
