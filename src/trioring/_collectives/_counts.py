"""What the uneven collectives (allgatherv, gatherv, alltoallv) say when the counts that the
ranks exchanged before their data do not fit: one wording for all of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import CollectiveMismatchError, ProtocolError

if TYPE_CHECKING:
    import numpy as np

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = ["describe", "impossible_counts", "job_id", "mismatch"]


def job_id(world: World) -> str | None:
    return next(iter(world.links.values())).job_id if world.links else None


def describe(
    spec: OpSpec, dtype: np.dtype[Any], rows: int | None, trailing: tuple[int, ...]
) -> str:
    """``allgatherv float32[3, 2] #4`` (``[rows, 2]`` where the rows vary per peer)."""
    dims = ("rows" if rows is None else str(rows), *(str(d) for d in trailing))
    return f"{spec.kind.label} {dtype.name}[{', '.join(dims)}] #{spec.seq}"


def mismatch(world: World, spec: OpSpec, peer: int, detail: str) -> CollectiveMismatchError:
    """The counts of ``peer`` disagree with this rank's, as ``detail`` says."""
    return CollectiveMismatchError(
        f"rank {world.rank}: {detail}",
        rank=world.rank,
        peer=peer,
        job_id=job_id(world),
        collective=spec.kind.label,
        seq=spec.seq,
    )


def impossible_counts(world: World, spec: OpSpec, peer: int, vector: np.ndarray) -> ProtocolError:
    """``peer`` sent counts no rank could have sent (negative sizes)."""
    return ProtocolError(
        f"rank {world.rank}: {spec.kind.label} #{spec.seq}: from peer rank {peer}: "
        f"impossible counts {vector.tolist()}",
        rank=world.rank,
        peer=peer,
        job_id=job_id(world),
        collective=spec.kind.label,
        seq=spec.seq,
    )
