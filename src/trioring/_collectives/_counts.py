"""What the uneven collectives (allgatherv, gatherv, alltoallv) say when the counts that the
ranks exchanged before their data do not fit: one wording for all of them, the checks of
allgatherv's and gatherv's vectors, and the layout of their results."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .._errors import CollectiveMismatchError, ProtocolError

if TYPE_CHECKING:
    import numpy as np

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "bounds_of",
    "checked_rows",
    "describe",
    "impossible_counts",
    "job_id",
    "mismatch",
    "parts_of",
]


def job_id(world: World) -> str | None:
    return next(iter(world.links.values())).job_id if world.links else None


def describe(spec: OpSpec, trailing: tuple[int, ...], rows: int | None = None) -> str:
    """A rank's call whose arrays have the ``trailing`` shape: ``allgatherv float32[rows,
    2] #4``, the same words in which that rank names its own call (see OpSpec.describe);
    ``float32[3, 2]`` given ``rows``."""
    return spec._replace(trailing=trailing).describe(rows)


def mismatch(
    world: World, spec: OpSpec, peer: int, detail: str, calls: dict[int, str] | None = None
) -> CollectiveMismatchError:
    """The counts of ``peer`` disagree with this rank's, as ``detail`` says (and ``calls``,
    each side's call, where the calls differ)."""
    return CollectiveMismatchError(
        f"rank {world.rank}: {detail}",
        calls=calls,
        rank=world.rank,
        peer=peer,
        job_id=job_id(world),
        collective=spec.kind.label,
        seq=spec.seq,
    )


def impossible_counts(world: World, spec: OpSpec, peer: int, vector: list[int]) -> ProtocolError:
    """``peer`` sent counts no rank could have sent (negative sizes)."""
    return ProtocolError(
        f"rank {world.rank}: {spec.named()}: from peer rank {peer}: impossible counts {vector}",
        rank=world.rank,
        peer=peer,
        job_id=job_id(world),
        collective=spec.kind.label,
        seq=spec.seq,
    )


def checked_rows(
    world: World, spec: OpSpec, table: list[list[int]], width: int, root: int | None = None
) -> list[int]:
    """Every rank's rows from the vectors ``[rows, out= capacity or -1, *trailing]`` that
    are the first ``width`` words of each rank's row of ``table``, of an allgatherv
    (``root`` None: every rank's ``out=`` must hold the total) or a gatherv (only
    ``root``'s), once every rank's agreed with this one's. The same checks in the same
    order on every rank, which all see the same vectors, so a disagreement raises
    everywhere. The messages are made only for an error: a dtype's name alone takes 3 us,
    in a small allgatherv of 30."""
    mine = table[world.rank][1:width]
    if mine[0] == -1:
        # Where every rank's capacity and trailing shape are this rank's, with no out=,
        # nothing below can fail but a negative row count: checked here in one pass, it
        # took 2.4 us instead of 6.4 at world 2 (timeit, 2 vCPUs, AMD EPYC), in a small
        # allgatherv of about 80.
        all_rows = [row[0] for row in table if row[1:width] == mine]
        if len(all_rows) == world.size and min(all_rows) >= 0:
            return all_rows
    trailing = mine[1:]
    for peer, row in enumerate(table):
        peer_rows, capacity, *peer_trailing = row[:width]
        if peer_rows < 0 or capacity < -1 or min(peer_trailing, default=0) < 0:
            raise impossible_counts(world, spec, peer, row[:width])
        if peer_trailing != trailing:
            # Without the rows, which may differ: the words each rank names its call in,
            # so that trioring run sees whose call is the odd one.
            theirs = describe(spec, tuple(peer_trailing))
            mine_text = describe(spec, tuple(trailing))
            calls = {world.rank: mine_text, peer: theirs}
            raise mismatch(world, spec, peer, f"{mine_text}, rank {peer}: {theirs}", calls)
    all_rows = [row[0] for row in table]
    total = sum(all_rows) * math.prod(trailing)
    for peer in range(world.size) if root is None else (root,):
        capacity = table[peer][1]
        if capacity not in (-1, total):
            who = f"rank {peer}" if root is None else f"root {root}"
            raise mismatch(
                world,
                spec,
                peer,
                f"{_me(world, spec, table, width)} (the ranks' arrays hold {total} elements in "
                f"all), {who}: out= holds {capacity} elements",
            )
    return all_rows


def _me(world: World, spec: OpSpec, table: list[list[int]], width: int) -> str:
    """This rank's call with its rows, as the message about an ``out=`` names it."""
    mine = table[world.rank]
    return describe(spec, tuple(mine[2:width]), mine[0])


def bounds_of(all_rows: list[int], row_size: int) -> list[int]:
    """Where each rank's block starts in the result, in elements, and where the last ends:
    rank q's rows of ``row_size`` elements at ``[bounds[q], bounds[q + 1])``."""
    bounds = [0]
    for rows in all_rows:
        bounds.append(bounds[-1] + rows * row_size)
    return bounds


def parts_of(
    buffer: np.ndarray, bounds: list[int], all_rows: list[int], trailing: tuple[int, ...]
) -> list[np.ndarray]:
    """Each rank's block of the flat ``buffer``, shaped ``(rows, *trailing)``: views. 1-D
    blocks (most calls, the object collectives' bytes included) need no reshape."""
    blocks = [buffer[bounds[q] : bounds[q + 1]] for q in range(len(all_rows))]
    if not trailing:
        return blocks
    return [block.reshape(rows, *trailing) for block, rows in zip(blocks, all_rows, strict=True)]
