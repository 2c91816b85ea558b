"""Dissemination barrier (Hensgen, Finkel and Manber 1988).

Cost: ceil(log2 n) alpha, with empty frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._steps import exchange

if TYPE_CHECKING:
    from .._wire import OpSpec
    from ._world import World

__all__ = ["barrier"]


async def barrier(world: World, spec: OpSpec) -> None:
    """Dissemination barrier: in round k every rank sends a token to rank + 2^k and waits for
    the token from rank - 2^k, for ceil(log2 n) rounds. No rank leaves before every rank has
    entered. Tokens are frames carrying the barrier's sequence number and the round (as the
    offset), and each is verified, so a token from an earlier barrier can never release a
    later one."""
    n, r = world.size, world.rank
    empty = memoryview(b"")
    distance, round_ = 1, 0
    while distance < n:
        to, frm = world.links[(r + distance) % n], world.links[(r - distance) % n]
        await exchange(spec, to, round_, empty, frm, round_, empty)
        distance, round_ = distance * 2, round_ + 1
