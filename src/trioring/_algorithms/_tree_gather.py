"""Binomial tree gather and scatter, equal or uneven blocks, streamed chunk by chunk; and the
dissemination round with a payload (:func:`disseminate`) that a scatter starts with.

Cost (Thakur, Rabenseifner and Gropp 2005): ceil(log2 n) alpha + ((n-1)/n) m beta for
either, for n ranks and m bytes gathered at (scattered from) the root: latency-optimal, and
the root receives (sends) every byte but its own once. MPICH's choice for gather and scatter
at every message size. :func:`disseminate` costs ceil(log2 n) alpha with a fixed payload.

The tree is broadcast's (:func:`~trioring._algorithms.tree_neighbours`): in virtual ranks
v = (rank - root) mod n, the subtree of v is the contiguous range [v, v + lowbit(v)) (cut at
n; the root's is everything), so a node forwards its whole subtree's blocks as one message,
in virtual rank order, in chunks of ``chunk_bytes``. A frame's offset is the element offset
of its chunk within the message (the receiving child's subtree). A message that carries
nothing still carries one empty frame, so every edge of the tree checks every call.

Scratch: a non-root node with children holds its subtree's blocks (gather: its own and its
descendants'; scatter: the same, on their way down), a new buffer per call; leaves and the
root need none beyond one chunk, for the one chunk per call that wraps around the end of
the root's buffer (virtual rank n - root is real rank 0).
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

import attrs
import numpy as np
import trio

from .._concurrency import run_concurrently
from .._wire import DTYPE_CODES
from ._steps import bytes_of, chunks, exchange
from ._tree import tree_neighbours

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._framing import Link
    from .._wire import OpSpec
    from ._world import World

__all__ = ["disseminate", "tree_gather", "tree_scatter", "tree_scatterv"]

_INT64 = np.dtype(np.int64)


def span(v: int, n: int) -> int:
    """How many virtual ranks the subtree of virtual rank ``v`` holds (``v`` included)."""
    return n if v == 0 else min(v & -v, n - v)


@attrs.frozen
class _Node:
    """This rank's place in the tree rooted at ``root``."""

    v: int
    span: int
    parent: int | None
    #: (real rank, first virtual rank relative to v, span), largest subtree first.
    children: list[tuple[int, int, int]]


def _node(rank: int, n: int, root: int) -> _Node:
    v = (rank - root) % n
    parent, children = tree_neighbours(rank, n, root)
    described = []
    for child in children:
        cv = (child - root) % n
        described.append((child, cv - v, span(cv, n)))
    return _Node(v, span(v, n), parent, described)


def _prefix(sizes: Sequence[int]) -> list[int]:
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return starts


@attrs.define(eq=False)
class _Ring:
    """The root's blocks in real rank order, as flat arrays (one, or one per rank), seen as
    a ring of ``total`` elements: a message for virtual ranks [a, b) starts at real rank
    (a + root) mod n and may run past the end into real rank 0. Pieces that lie inside one
    array are read and written in place; the rest (a piece that wraps around, or spans
    arrays of a list) go through ``spare``, one chunk."""

    parts: list[np.ndarray]
    starts: list[int]
    chunk: int
    _spare: np.ndarray | None = None

    @property
    def total(self) -> int:
        return self.starts[-1]

    def _locate(self, position: int) -> int:
        # The last part starting at or before ``position`` (so empty parts are skipped).
        return min(bisect.bisect_right(self.starts, position), len(self.parts)) - 1

    def _spans(self, lo: int, count: int) -> list[tuple[int, int, int]]:
        """(part, offset in it, length) pieces of [lo, lo + count) around the ring."""
        pieces = []
        position, left = lo, count
        while left:
            if position >= self.total:
                position -= self.total
            index = self._locate(position)
            take = min(left, self.starts[index + 1] - position)
            pieces.append((index, position - self.starts[index], take))
            position, left = position + take, left - take
        return pieces

    def copy_to(self, lo: int, into: np.ndarray) -> None:
        """Copy [lo, lo + into.size) into the flat ``into``, unless it is there already."""
        at = 0
        for index, offset, take in self._spans(lo, into.shape[0]):
            source = self.parts[index][offset : offset + take]
            target = into[at : at + take]
            if source.ctypes.data != target.ctypes.data:
                target[:] = source
            at += take

    def spare(self, count: int) -> np.ndarray:
        if self._spare is None:
            self._spare = np.empty(self.chunk, dtype=self.parts[0].dtype)
        return self._spare[:count]

    def read(self, lo: int, count: int) -> memoryview:
        """The bytes of [lo, lo + count)."""
        pieces = self._spans(lo, count)
        if len(pieces) <= 1:
            index, offset, _ = pieces[0] if pieces else (0, 0, 0)
            return bytes_of(self.parts[index], offset, count)
        spare = self.spare(count)
        at = 0
        for index, offset, take in pieces:
            spare[at : at + take] = self.parts[index][offset : offset + take]
            at += take
        return bytes_of(spare, 0, count)

    async def receive(
        self, link: Link, spec: OpSpec, frame_offset: int, lo: int, count: int
    ) -> None:
        """Receive the frame at ``frame_offset`` into [lo, lo + count)."""
        pieces = self._spans(lo, count)
        if len(pieces) <= 1:
            index, offset, _ = pieces[0] if pieces else (0, 0, 0)
            await link.recv(spec, frame_offset, bytes_of(self.parts[index], offset, count))
            return
        spare = self.spare(count)
        await link.recv(spec, frame_offset, bytes_of(spare, 0, count))
        at = 0
        for index, offset, take in pieces:
            self.parts[index][offset : offset + take] = spare[at : at + take]
            at += take


async def disseminate(
    world: World,
    spec: OpSpec,
    state: np.ndarray,
    merge: Callable[[np.ndarray, np.ndarray], None],
) -> None:
    """The dissemination barrier (:func:`~trioring._algorithms.barrier`) with a payload:
    in round k every rank sends its ``state`` (a small 1-D int64 array) to rank + 2^k while
    it receives rank - 2^k's, and folds that in with ``merge(state, received)``. After
    ceil(log2 n) rounds every rank's initial state has reached every rank, so with a merge
    that is idempotent (min, max, or, "take the root's header if I have none yet") every
    rank ends with the same state. Frames carry ``spec`` with dtype int64 and the state's
    length as the count, and the round as the offset."""
    n, r = world.size, world.rank
    if n == 1:
        return
    token = spec._replace(dtype_code=DTYPE_CODES[_INT64], count=state.shape[0])
    outgoing = np.empty_like(state)
    incoming = np.empty_like(state)
    distance, round_ = 1, 0
    while distance < n:
        outgoing[:] = state
        to, frm = world.links[(r + distance) % n], world.links[(r - distance) % n]
        await exchange(
            token,
            to,
            round_,
            outgoing.view(np.uint8).data,
            frm,
            round_,
            incoming.view(np.uint8).data,
        )
        merge(state, incoming)
        distance, round_ = distance * 2, round_ + 1


async def tree_gather(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    sizes: Sequence[int],
    root: int,
    result: np.ndarray | None,
) -> None:
    """Gather every rank's ``flat`` into root's ``result``, in rank order: rank i's block
    of ``sizes[i]`` elements lands at ``result[sum(sizes[:i]):][:sizes[i]]``. ``sizes`` is
    the same on every rank; ``result`` is None except on the root (where ``flat`` may be its
    own block of it, in place). ``flat`` is only read.

    A node receives its children's messages one after the other, smallest subtree first
    (the order of its buffer), into its buffer after its own block, and sends the buffer to
    its parent; a buffer of more than one chunk goes up while the rest still arrives (two
    tasks). The root receives straight into ``result``, largest subtree first: its data
    comes from furthest away, and the smaller subtrees wait with theirs in hand (so a rank
    whose part was taken may return before the root has the rest, but the root's smallest
    child never returns before the larger subtrees are in). Every send waits only for
    receives from further down the tree, so this cannot deadlock on unbuffered links.
    """
    n, r = world.size, world.rank
    dtype = flat.dtype
    chunk = max(1, world.chunk_bytes // dtype.itemsize)
    node = _node(r, n, root)
    local = [sizes[(r + j) % n] for j in range(node.span)]  # virtual order, from this rank
    starts = _prefix(local)
    ascending = node.children[::-1]
    if node.parent is None:
        assert result is not None
        bounds = _prefix(sizes)
        own = result[bounds[r] : bounds[r + 1]]
        if own.shape[0] and own.ctypes.data != flat.ctypes.data:
            own[:] = flat
        ring = _Ring([result], [0, bounds[n]], chunk)
        for child, first, width in node.children:
            lo = bounds[(r + first) % n]
            link = world.links[child]
            for offset, count in chunks(0, starts[first + width] - starts[first], chunk):
                await ring.receive(link, spec, offset, lo + offset, count)
        return
    parent = world.links[node.parent]
    if not node.children:
        for offset, count in chunks(0, flat.shape[0], chunk):
            await parent.send(spec, offset, bytes_of(flat, offset, count))
        return
    length = starts[node.span]
    buffer = np.empty(length, dtype)
    buffer[: starts[1]] = flat
    pieces = list(chunks(0, length, chunk))

    async def receive(progress: trio.MemorySendChannel[int] | None) -> None:
        for child, first, width in ascending:
            link, lo = world.links[child], starts[first]
            for offset, count in chunks(0, starts[first + width] - lo, chunk):
                await link.recv(spec, offset, bytes_of(buffer, lo + offset, count))
                if progress is not None:
                    progress.send_nowait(lo + offset + count)

    if len(pieces) == 1:
        await receive(None)
        await parent.send(spec, 0, bytes_of(buffer, 0, length))
        return
    send_progress, receive_progress = trio.open_memory_channel[int](math.inf)

    async def send() -> None:
        ready = starts[1]
        for offset, count in pieces:
            while ready < offset + count:
                ready = await receive_progress.receive()
            await parent.send(spec, offset, bytes_of(buffer, offset, count))

    async def receive_all() -> None:
        await receive(send_progress)

    with send_progress, receive_progress:
        await run_concurrently(receive_all, send)


async def tree_scatter(
    world: World,
    spec: OpSpec,
    parts: list[np.ndarray] | None,
    sizes: Sequence[int],
    root: int,
    result: np.ndarray,
) -> None:
    """Scatter root's blocks: rank i's ``result`` receives the ``sizes[i]`` elements that
    start at ``sum(sizes[:i])`` of root's ``parts`` joined end to end (one flat array in rank
    order, or one per rank; only read). ``sizes`` is the same on every rank; ``parts`` is
    None except on the root.

    The root sends each child its subtree's blocks, largest subtree first; a node receives
    its subtree's message from its parent into its buffer, keeps its own block and forwards
    each child's part of it; with more than one chunk, each chunk is forwarded as soon as it
    has arrived (one task per child, and one receiving). Receives never wait for sends, so
    this cannot deadlock on unbuffered links.
    """
    n, r = world.size, world.rank
    node = _node(r, n, root)
    local = [sizes[(r + j) % n] for j in range(node.span)]
    await _scatter(world, node, local, lambda _total: spec, spec, parts, result, root)


async def tree_scatterv(
    world: World,
    spec: OpSpec,
    root: int,
    ndim: int,
    shapes: np.ndarray | None,
    parts: list[np.ndarray] | None,
    prepare: Callable[[tuple[int, ...]], np.ndarray],
) -> None:
    """:func:`tree_scatter` for blocks whose shapes only the root knows: ``shapes`` (root
    only) is an int64 array of one row of ``ndim`` dimensions per rank, in rank order.

    Each edge first carries the receiving subtree's rows of shapes (one frame: ``spec`` with
    dtype int64 and count ``subtree ranks * ndim``), then the blocks (``spec`` with the
    subtree's element count as the count). A rank calls ``prepare(its shape)`` once it has
    its shape, before any of its data arrives or any shape goes on to its children, and
    receives its block into the flat array that returns; ``prepare`` may raise (a rank whose
    ``out=`` does not fit), which then reaches its children as an abort.
    """
    n, r = world.size, world.rank
    node = _node(r, n, root)
    shape_code = DTYPE_CODES[_INT64]

    def shapes_spec(ranks: int) -> OpSpec:
        return spec._replace(dtype_code=shape_code, count=ranks * ndim)

    if node.parent is None:
        assert shapes is not None
        local_shapes = shapes[[(r + j) % n for j in range(n)]]
    else:
        local_shapes = np.empty((node.span, ndim), _INT64)
        link = world.links[node.parent]
        await link.recv(shapes_spec(node.span), 0, local_shapes.reshape(-1).view(np.uint8).data)
        if local_shapes.size and local_shapes.min() < 0:
            raise link.protocol_error(
                spec, f"impossible block shapes {local_shapes.tolist()} from the root"
            )
    result = prepare(tuple(int(d) for d in local_shapes[0]))
    for child, first, width in node.children:
        rows = np.ascontiguousarray(local_shapes[first : first + width]).reshape(-1)
        await world.links[child].send(shapes_spec(width), 0, rows.view(np.uint8).data)
    local = [math.prod(int(d) for d in row) for row in local_shapes]

    def edge(total: int) -> OpSpec:
        return spec._replace(count=total)

    await _scatter(world, node, local, edge, edge(sum(local)), parts, result, root)


async def _scatter(
    world: World,
    node: _Node,
    local: Sequence[int],
    edge: Callable[[int], OpSpec],
    mine: OpSpec,
    parts: list[np.ndarray] | None,
    result: np.ndarray,
    root: int,
) -> None:
    """The data of :func:`tree_scatter` and :func:`tree_scatterv`: ``local`` are the sizes
    of this rank's subtree in virtual order, ``edge(total)`` the identity of the frames
    to a child whose subtree holds ``total`` elements, ``mine`` that of this rank's."""
    n, r = world.size, world.rank
    dtype = result.dtype
    chunk = max(1, world.chunk_bytes // dtype.itemsize)
    starts = _prefix(local)
    if node.parent is None:
        assert parts is not None
        ring = _Ring(parts, _prefix([p.shape[0] for p in parts]), chunk)
        sizes = [0] * n
        for j, size in enumerate(local):
            sizes[(r + j) % n] = size
        bounds = _prefix(sizes)
        ring.copy_to(bounds[r], result)
        for child, first, width in node.children:
            total = starts[first + width] - starts[first]
            link, lo, spec = world.links[child], bounds[(r + first) % n], edge(total)
            for offset, count in chunks(0, total, chunk):
                await link.send(spec, offset, ring.read(lo + offset, count))
        return
    parent = world.links[node.parent]
    length = starts[node.span]
    if not node.children:
        for offset, count in chunks(0, length, chunk):
            await parent.recv(mine, offset, bytes_of(result, offset, count))
        return
    buffer = np.empty(length, dtype)
    pieces = list(chunks(0, length, chunk))
    outgoing = [
        (world.links[child], starts[first], starts[first + width] - starts[first])
        for child, first, width in node.children
    ]
    if len(pieces) == 1:
        await parent.recv(mine, 0, bytes_of(buffer, 0, length))
        for link, lo, total in outgoing:
            await link.send(edge(total), 0, bytes_of(buffer, lo, total))
    else:
        channels = [trio.open_memory_channel[int](math.inf) for _ in outgoing]

        async def receive() -> None:
            for offset, count in pieces:
                await parent.recv(mine, offset, bytes_of(buffer, offset, count))
                for send_channel, _ in channels:
                    send_channel.send_nowait(offset + count)

        def sender(index: int) -> Callable[[], Awaitable[None]]:
            link, lo, total = outgoing[index]
            progress = channels[index][1]
            spec = edge(total)

            async def send() -> None:
                ready = 0
                for offset, count in chunks(0, total, chunk):
                    while ready < lo + offset + count:
                        ready = await progress.receive()
                    await link.send(spec, offset, bytes_of(buffer, lo + offset, count))

            return send

        try:
            await run_concurrently(receive, *(sender(i) for i in range(len(outgoing))))
        finally:
            for send_channel, receive_channel in channels:
                send_channel.close()
                receive_channel.close()
    result[:] = buffer[: starts[1]]
