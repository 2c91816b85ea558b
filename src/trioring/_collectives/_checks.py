"""Checks that every collective makes of its arguments, before any I/O; and the agreement
round of the rooted collectives, before their first byte moves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import _algorithms
from .._util import expected_array
from .._wire import DTYPE_CODES

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from typing import TypeAlias

    from .._algorithms import World
    from .._wire import OpSpec

    _R = TypeVar("_R")
    #: What a collective runs once its call has a sequence number, given that identity.
    Body: TypeAlias = Callable[[OpSpec], Awaitable[None]]

    #: The fields of a call's identity after its kind and sequence number, in OpSpec's
    #: order: ``(dtype_code, count, op_code, root, trailing)``. Every frame carries the
    #: first four; ``trailing``, the uneven calls' shape after the rows, names the call in
    #: errors (see OpSpec). What ``CommunicatorCore._run`` takes. A tuple rather than a
    #: dict of ``_run``'s keywords: see ``_run``.
    Identity: TypeAlias = tuple[int, int, int, int, tuple[int, ...] | None]

    #: What a family's planner gives the Communicator's method: the result to return, the
    #: body, and the call's identity (for ``CommunicatorCore._run``).
    Plan: TypeAlias = tuple[_R, Body, Identity]

__all__ = ["Refused", "agree", "check_array", "check_out", "check_root"]


class Refused(Exception):
    """An argument a collective refuses; the Communicator turns it into an
    InvalidArgumentError that says which rank and call."""


def check_array(array: object, *, writable: bool = True) -> np.ndarray[Any, Any]:
    """``array`` as a flat view, or Refused saying why it cannot take part. An input that
    a collective only reads may be read-only (``writable=False``)."""
    # The algorithms work on the raw buffer through a flat view, so only types whose data
    # *is* that buffer are accepted: an exact ndarray, or a memmap (an ndarray whose
    # buffer is a mapped file). Any other subclass may mean more than its buffer (a
    # masked array's mask) or reshape differently (np.matrix stays 2-D, so its element
    # count would read as 1 and the algorithm would fail half-way, breaking the
    # communicator): refused before any I/O, with what to pass instead.
    if type(array) is not np.ndarray and type(array) is not np.memmap:
        raise Refused(_unsupported_array_type(array))
    dtype = array.dtype
    if dtype not in DTYPE_CODES:
        if dtype.names is not None:
            detail = (
                f"structured dtype {dtype} is not supported; reduce or broadcast each "
                "field as an array of its own"
            )
        elif dtype.byteorder not in "=|" and dtype.newbyteorder("=") in DTYPE_CODES:
            detail = f"dtype {dtype.str} is not in native byte order; convert with .astype({dtype.name!r})"
        else:
            supported = ", ".join(dt.name for dt in DTYPE_CODES)
            detail = f"dtype {dtype} is not supported; supported dtypes: {supported}"
        raise Refused(detail)
    flags = array.flags
    if not flags.c_contiguous:
        raise Refused("array is not C-contiguous; pass np.ascontiguousarray(a) and copy back")
    if writable and not flags.writeable:
        raise Refused("array is read-only; collectives work in place")
    return array if array.ndim == 1 else array.reshape(-1)


def check_out(
    out: object, dtype: np.dtype[Any], count: int | None, *avoid: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """``out=`` as a flat view, or Refused: an exact ndarray (or memmap) of ``dtype`` and
    (unless ``count`` is None, when only the exchanged counts can tell) ``count`` elements,
    any shape, C-contiguous, writable, and apart from the arrays in ``avoid`` (inputs that
    the algorithm reads while it writes the result)."""
    try:
        flat = check_array(out)
    except Refused as exc:
        raise Refused(f"out=: {exc}") from None
    if flat.dtype != dtype:
        raise Refused(f"out= has dtype {flat.dtype}, the input has {dtype}; they must agree")
    if count is not None and flat.shape[0] != count:
        raise Refused(f"out= has {flat.shape[0]} elements, expected {count}")
    for source in avoid:
        if np.may_share_memory(flat, source):
            raise Refused("out= overlaps the input array; pass a separate buffer")
    return flat


def check_root(root: object, world_size: int) -> int:
    """``root`` as an int rank of the world, or Refused."""
    if isinstance(root, bool) or not isinstance(root, int | np.integer):
        raise Refused(f"root must be an int rank, got {root!r}")
    if not 0 <= root < world_size:
        raise Refused(f"root {root} is not a rank of this communicator (0..{world_size - 1})")
    return int(root)


def _unsupported_array_type(array: object) -> str:
    """Why ``array``, which is not an exact ndarray or memmap, is refused, and what to pass."""
    name = f"{type(array).__module__}.{type(array).__qualname__}"
    if isinstance(array, np.ma.MaskedArray):
        return (
            f"{name} is not supported: its mask would be ignored. Reduce the data and the mask "
            "as two plain arrays, e.g. data = a.filled(0) (a new array; fill with a value that "
            "is neutral for the op) and mask = np.ma.getmaskarray(a).astype(np.uint8) with "
            "op='max'"
        )
    if isinstance(array, np.matrix):
        return (
            f"{name} is not supported: it stays 2-D when flattened. Pass np.asarray(m), a view "
            "of the same memory, so the result still lands in m"
        )
    if isinstance(array, np.ndarray):
        return (
            f"{name} is not supported: collectives work on the raw buffer, which only "
            "numpy.ndarray and numpy.memmap are exactly. If the data is all that matters, "
            "pass np.asarray(a), a view of the same memory"
        )
    return expected_array(array, "a numpy.ndarray")


async def agree(world: World, spec: OpSpec, name: str) -> None:
    """The agreement round of a rooted collective (broadcast, gather, reduce) that goes by
    the algorithm ``name``: a dissemination round of tokens carrying the call's identity
    (root included) reaches every rank from every rank, so ranks that disagree about the
    root find out before any data moves. A tree alone cannot: if the root itself thinks
    another rank is the root, nobody would ever send. Cross-memory attach through the
    shared segment skips it: its publication of the call agrees instead (see
    ``_cma_collectives.expose``)."""
    if name != "cma" or world.shm is None:
        await _algorithms.barrier(world, spec)
