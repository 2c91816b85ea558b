"""Small helpers with no better home."""

from __future__ import annotations

import functools
import os
import tempfile
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypeVar, final

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from .transports import Connection

T = TypeVar("T")
P = ParamSpec("P")


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


@final
class AsyncContextOnly(AbstractAsyncContextManager[T]):
    """An async context manager (``manager``) that, awaited or entered with a plain
    ``with``, says how it is used. Python's own TypeError names only contextlib's class:
    ``object _AsyncGeneratorContextManager can't be used in 'await' expression``, for
    ``await comm.split(color=0)``, a mistake made in a program written from the docs.
    Nothing has run when it raises: the manager's body starts only in ``__aenter__``."""

    __slots__ = ("_manager", "_usage")

    def __init__(self, manager: AbstractAsyncContextManager[T], usage: str) -> None:
        self._manager = manager
        self._usage = usage

    async def __aenter__(self) -> T:
        return await self._manager.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        return await self._manager.__aexit__(exc_type, exc_value, traceback)

    def __await__(self) -> NoReturn:
        raise TypeError(self._misuse("awaited"))

    def __enter__(self) -> NoReturn:
        raise TypeError(self._misuse("used with a plain 'with'"))

    def __exit__(self, *exc_info: object) -> None:
        """Never reached (``__enter__`` raises); Python looks for it before it calls
        ``__enter__``."""

    def _misuse(self, how: str) -> str:
        return (
            f"{self._usage} is an async context manager and cannot be {how}: write "
            f"'async with {self._usage} as ...:'"
        )


def async_context_only(
    usage: str,
) -> Callable[
    [Callable[P, AbstractAsyncContextManager[T]]], Callable[P, AbstractAsyncContextManager[T]]
]:
    """Make the async context managers that ``function`` returns say how they are used if
    awaited (see :class:`AsyncContextOnly`); ``usage`` is the call as users write it."""

    def decorate(
        function: Callable[P, AbstractAsyncContextManager[T]],
    ) -> Callable[P, AbstractAsyncContextManager[T]]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> AbstractAsyncContextManager[T]:
            return AsyncContextOnly(function(*args, **kwargs), usage)

        return wrapper

    return decorate


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
