"""Small helpers with no better home."""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


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
