"""What every algorithm knows of its world (:class:`World`), and what a cancelled one was
waiting for (:func:`interrupted_wait`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import attrs
import numpy as np

from .._onehost._shm import LINE

if TYPE_CHECKING:
    from .._framing import Link
    from .._onehost._shm import SharedSlots
    from .._onehost._shm_reductions import ReducePlan
    from .._wire import OpSpec

__all__ = ["World", "awaited_ranks", "interrupted_wait"]


@final
@attrs.define(eq=False)
class World:
    """What an algorithm needs to know about this rank's place in the world."""

    rank: int
    size: int
    links: dict[int, Link]
    chunk_bytes: int
    scratch: np.ndarray[tuple[int], np.dtype[np.uint8]]
    #: Peer pids (from the kernel) when every pair of ranks agreed to use cross-memory
    #: attach at opening; None otherwise.
    peer_pids: dict[int, int] | None = None
    #: The shared segment for small collectives, when every rank agreed at opening to use
    #: one (see _shm); None otherwise.
    shm: SharedSlots | None = None
    #: The plans of recent shared-memory reductions, per (parity, dtype, first and end
    #: column, the row read from the caller's input or -1).
    shm_plans: dict[tuple[int, np.dtype, int, int, int], ReducePlan] = attrs.field(factory=dict)
    #: The collective whose wait on the segment is in a checkpoint, and the sequence words
    #: of the peers that had not published it then; left as they are when a cancellation
    #: ends the wait there, to name those peers (see :func:`awaited_ranks`).
    shm_waiting: OpSpec | None = None
    shm_late: list[int] = attrs.field(factory=list)
    #: The largest array the segment's reductions take here, once worked out (see
    #: ``_collectives._allreduce.shm_bytes``, which a communicator calls when it is made);
    #: -1 until then. Worked out on every call, it cost a 4-byte reduce_scatter at world 2
    #: about 1 us.
    slot_reduce_bytes: int = attrs.field(default=-1, init=False)
    #: The same for a reduce, and a reduce_scatter where no rank is crowded: up to the whole
    #: slot, where allreduce's stops at SHM_MAX_BYTES (see _onehost._shm.SLOT_PAYLOAD_BYTES).
    slot_wide_reduce_bytes: int = attrs.field(default=-1, init=False)
    _scratch_view: tuple[np.dtype, int, np.ndarray, memoryview] | None = None
    #: One element of any dtype, for one-element reductions (see recursive doubling).
    _spare: np.ndarray[tuple[int], np.dtype[np.uint8]] = attrs.field(
        factory=lambda: np.zeros(16, dtype=np.uint8)
    )
    _spare_view: tuple[np.dtype, np.ndarray, memoryview] | None = None

    def scratch_as(self, dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, memoryview]:
        """The first ``nbytes`` of the scratch buffer as an array of ``dtype`` and as bytes.
        The last answer is kept: a program calls small collectives of one size over and over,
        and making the two views costs more than the rest of a 4-byte allreduce's arithmetic."""
        cached = self._scratch_view
        if cached is None or cached[0] != dtype or cached[1] != nbytes:
            array = self.scratch[:nbytes].view(dtype)
            cached = self._scratch_view = (dtype, nbytes, array, array.view(np.uint8).data)
        return cached[2], cached[3]

    def spare_as(self, dtype: np.dtype) -> tuple[np.ndarray, memoryview]:
        """A one-element array of ``dtype``, apart from the scratch buffer, and its bytes;
        kept like :meth:`scratch_as`."""
        cached = self._spare_view
        if cached is None or cached[0] != dtype:
            array = self._spare[: dtype.itemsize].view(dtype)
            cached = self._spare_view = (dtype, array, array.view(np.uint8).data)
        return cached[1], cached[2]


def awaited_ranks(world: World, spec: OpSpec) -> list[int]:
    """The peers that ``spec`` was waiting for when a cancellation ended its wait, in
    ascending order: those whose frame it was receiving, those whose connection would not
    take the rest of its send, and, on the shared segment, those that had not published the
    call yet. Read from what the waits left behind (see ``Link.receive_waiting``), so it
    costs nothing until a collective is cancelled."""
    ranks = {
        link.peer
        for link in world.links.values()
        if link.receive_waiting is spec or link.send_waiting is spec
    }
    slots = world.shm
    if slots is not None and world.shm_waiting is spec:
        # A late word is one of the words on the peer's line (sequence, done, ready).
        lines = {word // (LINE // 8) for word in world.shm_late}
        ranks.update(
            peer
            for peer, word in zip(slots.peers, slots.peer_words, strict=True)
            if word // (LINE // 8) in lines
        )
    return sorted(ranks)


def interrupted_wait(world: World, spec: OpSpec) -> str:
    """What the cancelled ``spec`` had been doing, as the end of a sentence: `` after 5.0 s
    while waiting for rank 2``. The time counts from the call's first wait; either part is
    left out where nothing was waited for."""
    if not world.links:
        return ""
    elapsed = next(iter(world.links.values())).waits.elapsed(spec.seq)
    text = "" if elapsed is None else f" after {_duration(elapsed)}"
    ranks = awaited_ranks(world, spec)
    if len(ranks) == 1:
        text += f" while waiting for rank {ranks[0]}"
    elif 1 < len(ranks) <= 3:
        text += f" while waiting for ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
    elif ranks:
        # A long list would drown the message; the lowest rank is where to look first.
        text += f" while waiting for rank {ranks[0]} and {len(ranks) - 1} others"
    return text


def _duration(seconds: float) -> str:
    # Tenths of seconds, as the rendezvous reports its waits; milliseconds for short scopes,
    # where "0.0 s" would say nothing.
    return f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"
