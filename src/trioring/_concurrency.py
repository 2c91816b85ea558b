"""Sibling tasks whose first trioring error stops the others and is raised on its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._errors import (
    CollectiveMismatchError,
    PeerAbortedError,
    ProtocolError,
    TrioringError,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

# More specific errors explain more: a mismatch or a peer's own reason beats "connection lost",
# which is often only the echo of the first error reaching us through another peer.
_PRIORITY: dict[type[TrioringError], int] = {
    CollectiveMismatchError: 3,
    PeerAbortedError: 2,
    ProtocolError: 2,
}


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation: a :class:`trio.Cancelled`, or a group of nothing
    else (as a nursery raises when a cancel scope around it fires)."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


async def run_concurrently(*functions: Callable[[], Awaitable[None]]) -> None:
    """Run ``functions`` as sibling tasks and wait for all of them.

    When one raises a :class:`TrioringError`, the others are cancelled and, once all have
    stopped, the most informative error collected is raised by itself (the others are attached
    to it as notes, never dropped). Any other exception propagates in Trio's exception group,
    and a cancellation from outside propagates as a cancellation.
    """
    errors: list[TrioringError] = []

    async with trio.open_nursery() as nursery:

        async def guarded(function: Callable[[], Awaitable[None]]) -> None:
            try:
                await function()
            except TrioringError as exc:
                errors.append(exc)
                nursery.cancel_scope.cancel(reason="a sibling task failed")

        for function in functions:
            nursery.start_soon(guarded, function)

    if errors:
        best = max(errors, key=lambda e: _PRIORITY.get(type(e), 1))
        for other in errors:
            if other is not best:
                best.add_note(f"also on this rank: {type(other).__name__}: {other}")
        raise best
