"""Small helpers with no better home."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

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
