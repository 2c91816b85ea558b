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


def first_leaf(exc: BaseException) -> tuple[BaseException, int]:
    """The exception that says what ``exc`` is: ``exc`` itself, or for a group the first of
    its leaves (the exceptions in it, and in the groups in it, that are not groups) that is
    not a :class:`trio.Cancelled`, or the first leaf if all are; and how many leaves there
    are of that kind. A nursery whose task fails raises the failure in a group, beside any
    sibling's Cancelled that escaped: the failure is what a reader needs named."""
    leaves = _leaves(exc)
    telling = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)] or leaves
    return telling[0], len(telling)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation: a :class:`trio.Cancelled`, or a group of nothing
    else (as a nursery raises when a cancel scope around it fires)."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


#: How Trio words the reason of a nursery's cancellation when a child task or the nursery's
#: own block raised (trio 0.31+): "child task raised exception ValueError('x')", "Code block
#: inside nursery contextmanager raised exception ValueError('x')".
_RAISED = " raised exception "
#: The most of Trio's reason that a message repeats: it holds the exception's repr, which a
#: program's own exception can make as long as it likes.
_MAX_CAUSE_CHARS = 500


def cancel_cause(exc: BaseException) -> str:
    """Why Trio cancelled ``exc`` (a cancellation), as the end of a sentence, where that is
    news to a peer: ``", when code beside it raised ValueError('bad batch')"`` when a
    failure in a sibling task, or in the nursery's own block, made the nursery cancel the
    rest (a peer told only "rank 2 cancelled allreduce #5" would look for a deadline),
    ``", by KeyboardInterrupt"``, or a cancel scope's reason where the program gave one.
    Empty for a deadline, whose time the message already says, and for a scope cancelled
    without a reason."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    if not isinstance(exc, trio.Cancelled):
        return ""
    source, reason = exc.source, exc.reason
    if reason is not None and len(reason) > _MAX_CAUSE_CHARS:
        reason = reason[:_MAX_CAUSE_CHARS] + "..."
    if source == "nursery" and reason:
        _, raised, error = reason.partition(_RAISED)
        if raised:
            return f", when code beside it raised {error}"
        return f", when its nursery was cancelled ({reason})"
    if source == "KeyboardInterrupt":
        return ", by KeyboardInterrupt"
    if source == "explicit" and reason:
        return f", by its cancel scope ({reason})"
    return ""


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


# How many sleeps a grace period is counted in (see run_with_grace). Five: a stall then has
# to come five times within one grace to cut it short, while each sleep stays long enough
# (10 ms of the 50 ms abort grace) that the ticks cost nothing measurable.
_GRACE_TICKS = 5


async def run_with_grace(seconds: float, *functions: Callable[[], Awaitable[None]]) -> bool:
    """Run ``functions`` as sibling tasks and cancel those still running once ``seconds`` of
    waiting has passed. True when every one of them finished.

    The wait is counted in ``_GRACE_TICKS`` sleeps of ``seconds / _GRACE_TICKS``, not by one
    deadline, because the whole process can stall (a loaded machine, a virtual machine's
    stolen time): with four busy processes on 2 cores, stalls of 0.4-0.6 s came about once
    in 50 worlds. A deadline that passed during such a stall fired at the first checkpoint
    after it, so tasks that had been runnable since before the stall (sending an abort frame
    into a buffer with room, say) were cancelled before they took one step, and the peers
    saw a closed connection instead of the reason. A stall uses up one tick here; the tasks
    run in the scheduler pass that wakes the tick.

    Exceptions propagate as from any nursery; a cancellation from outside cancels all.
    """
    if not functions:
        return True
    finished = 0
    async with trio.open_nursery() as nursery:

        async def run(function: Callable[[], Awaitable[None]]) -> None:
            nonlocal finished
            await function()
            finished += 1
            if finished == len(functions):
                nursery.cancel_scope.cancel(reason="every task finished")

        async def tick() -> None:
            for _ in range(_GRACE_TICKS):
                await trio.sleep(seconds / _GRACE_TICKS)
            nursery.cancel_scope.cancel(reason="the grace period ran out")

        nursery.start_soon(tick)
        for function in functions:
            nursery.start_soon(run, function)
    return finished == len(functions)
