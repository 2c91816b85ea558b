"""The gather family's public methods: gather, gatherv, scatter and scatterv (their checks,
decisions and algorithms: :mod:`trioring._collectives._gather` and
:mod:`~trioring._collectives._scatter`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._collectives import _gather, _scatter
from .._collectives._checks import Refused
from .._core import CommunicatorCore
from .._wire import Kind

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

__all__ = ["GatherMethods"]


class GatherMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""

    async def gather(
        self,
        x: np.ndarray[Any, Any],
        *,
        root: int = 0,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any] | None:
        """Gather every rank's ``x`` on ``root``.

        On ``root``, returns a **new array** of shape ``(world_size, *x.shape)`` (the
        root's ``x.shape``) whose row ``i`` is rank ``i``'s ``x``, or ``out`` when given,
        filled in rank order; it is made of copies only, so bitwise the ranks' inputs. On
        every other rank, returns None. ``x`` itself is only read, on every rank. A world of
        one, and a size of 0, work (and still checkpoint). By the tree, a non-root rank
        returns once its parent has taken its subtree's blocks: a failure elsewhere after
        that is raised by its next call, not by this one. Through the shared segment's
        slots a rank returns once every rank has published the call (the root once it has
        copied every block); through the pipe, or by cross-memory attach with a segment,
        only once every rank has done its part, so a rank that fails or gives up before
        then makes every rank raise in the call; by cross-memory attach without a segment,
        once the root has read every block. The root raises unless it has every block.

        Args:
            x: C-contiguous ``numpy.ndarray`` (or ``numpy.memmap``) of a supported dtype,
                ``bool`` included, of any shape; read-only arrays are fine. Same dtype and
                element count on every rank (the shape may differ: only the element count is
                checked, and the root's shape shapes the result).
            root: the rank that receives; the same on every rank.
            out: on ``root``, an optional C-contiguous, writable array of ``x``'s dtype with
                ``world_size * x.size`` elements, of any shape; rank ``i``'s elements land at
                ``out.reshape(-1)[i * x.size:(i + 1) * x.size]``, and ``out`` is returned.
                The root's ``x`` may be its own block of ``out`` (in place), but must not
                overlap it otherwise. On other ranks ``out`` is ignored (neither checked nor
                written), as MPI's receive buffer is significant only at the root, so the
                same line of code can run on every rank. After a failure or cancellation,
                the root's ``out`` holds unspecified contents.

        Algorithm: a dissemination round of tokens carrying the call's identity (so that
        ranks that disagree about dtype, count or ``root`` raise instead of waiting for each
        other), then a binomial tree rooted at ``root``: ``ceil(log2 n)`` hops, each rank
        sending its parent its whole subtree's blocks in one message, streamed in chunks;
        the root receives ``(n-1)/n`` of the result once. Scratch: a rank with children in
        the tree (other than the root) holds its subtree's blocks. On one host (the
        ``"shm"`` and ``"cma"`` entries of :attr:`features`): blocks of up to
        ``SHM_MAX_BYTES`` (``SLOT_PAYLOAD_BYTES`` where no rank shares its CPUs with more
        ranks than it has) go through the shared segment (every other rank publishes its
        block and the call, the root the call only, and copies the blocks); larger blocks
        stream through the segment's pipe (each rank copies its block in, chunk by chunk,
        the root copies them out) up to world 3, or at any world size without cross-memory
        attach or up to ``CMA_MIN_COPY_BYTES`` gathered in all; otherwise, above
        ``CMA_MIN_COPY_BYTES``, the agreement round
        (through the segment where there is one), then the root reads
        every peer's ``x`` by cross-memory attach, and releases the peers once it has read
        them all, each byte copied once straight from where it is to where it goes; the
        caller may overwrite its arrays as soon as the call returns.

        Raises:
            InvalidArgumentError: bad ``x``, ``root`` or (on the root) ``out`` (before any
                I/O; the communicator stays usable).
            CollectiveError: see :meth:`allreduce`; :class:`~trioring.CollectiveMismatchError`
                on every rank when ranks pass different dtypes, element counts or roots, or
                one of them runs another collective.
        """
        kind = Kind.GATHER
        try:
            result, body, identity = _gather.plan_gather(
                self._world, self._forced.get(kind.label), x, root, out
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return result

    async def gatherv(
        self,
        x: np.ndarray[Any, Any],
        *,
        root: int = 0,
        out: np.ndarray[Any, Any] | None = None,
    ) -> list[np.ndarray[Any, Any]] | None:
        """Gather every rank's ``x``, whose first dimension may differ between ranks, on
        ``root``.

        On ``root``, returns a list of ``world_size`` arrays: ``parts[i]`` has rank ``i``'s
        shape and values. They are views, in rank order, into one contiguous buffer: a new
        one, or ``out`` when given (``parts[i]`` is then ``out.reshape(-1)[start_i:start_i +
        size_i]`` reshaped to rank ``i``'s shape, and the list, not ``out``, is returned,
        as :meth:`allgatherv` does). On every other rank, returns None. The sizes are found
        by trioring: every rank first sends every rank its row count and trailing shape (so
        every rank checks them), then the data goes up the tree. Any rank may pass zero
        rows; a world of one works. ``x`` is only read.

        Args:
            x: C-contiguous ``numpy.ndarray`` (or ``numpy.memmap``) of at least one
                dimension and a supported dtype; read-only arrays are fine. Same dtype,
                number of dimensions and trailing shape (``x.shape[1:]``) on every rank;
                ``x.shape[0]`` may differ.
            root: the rank that receives; the same on every rank.
            out: on ``root``, an optional C-contiguous, writable array of ``x``'s dtype
                holding exactly the total number of elements of all ranks' ``x``, of any
                shape, not overlapping ``x``. Its dtype and layout are checked before any
                I/O, its size once the counts are known (the root's capacity travels with
                its counts, so every rank checks it). On other ranks ignored, as in
                :meth:`gather`.

        Algorithm: an allgather of one small vector per rank (rows, the root's ``out=``
        capacity, trailing shape) by Bruck's algorithm, ``ceil(log2 n)`` rounds, then the
        binomial tree of :meth:`gather`, whose frames carry the total element count. On
        one host (the ``"shm"`` entry of :attr:`features`) every rank publishes its vector
        in its slot of the shared segment instead, every rank but the root with ``x``
        beside it where it fits the slot: when every one does, that publication is the
        whole call (the root copies the blocks out of the slots); otherwise the tree
        follows.

        Raises:
            InvalidArgumentError: bad ``x``, ``root`` or (on the root) ``out`` (before any
                I/O; the communicator stays usable).
            CollectiveError: see :meth:`allreduce`. :class:`~trioring.CollectiveMismatchError`
                on every rank when ranks pass different dtypes, numbers of dimensions,
                trailing shapes or roots, or when the root's ``out`` does not hold the total
                (the communicator is then broken, as for any mismatch).
        """
        kind = Kind.GATHERV
        try:
            result, body, identity = _gather.plan_gatherv(
                self._world, self._forced.get(kind.label), x, root, out
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return result

    async def scatter(
        self,
        blocks: np.ndarray[Any, Any] | Sequence[np.ndarray[Any, Any]] | None,
        *,
        root: int = 0,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Send block ``i`` of ``root``'s ``blocks`` to rank ``i``, and return this rank's.

        On ``root``, ``blocks`` is either one array whose first dimension is
        ``world_size`` (rank ``i`` gets ``blocks[i]``, of shape ``blocks.shape[1:]``), or a
        list (or tuple) of ``world_size`` arrays, which may differ in shape (rank ``i`` gets
        an array of ``blocks[i]``'s shape): the uneven form, the same as :meth:`scatterv`.
        On every other rank ``blocks`` is ignored (pass None), as mpi4py ignores a
        non-root's send buffer: the dtype and shape come from the root, with the data.

        Returns a **new array** of this rank's block (the root's too is a copy), or ``out``
        when given. The blocks are made of copies only, so bitwise the root's. A world of
        one, and blocks of size 0, work (and still checkpoint). The root's blocks are only
        read. By the tree, a rank returns once it has its block and has passed its children
        theirs (the root: once it has sent them all): a failure elsewhere after that is
        raised by its next call, not by this one. Through the slots a rank returns once
        every rank has published the call and it has its block. For a list, when any rank
        passed ``out=``, every rank returns only after a closing barrier (below). The
        other one-host paths' rules are below too.

        Args:
            blocks: on ``root``, a C-contiguous ``numpy.ndarray`` (or ``numpy.memmap``) of
                a supported dtype, ``bool`` included, with ``world_size`` rows (read-only
                arrays are fine), or a list of ``world_size`` such arrays of one dtype and
                one number of dimensions. Ignored elsewhere.
            root: the rank that sends; the same on every rank.
            out: optional C-contiguous, writable array of any shape to receive this rank's
                block, returned instead of a new array. On the root it is checked before
                any I/O (the root's dtype, its block's element count, apart from the other
                blocks; it may be the root's own block of ``blocks``). On other ranks its
                layout is checked before any I/O, and its dtype and element count against
                the root's block once the root's header has arrived: a disagreement raises
                :class:`~trioring.CollectiveMismatchError` on every rank, never a hang, and
                nothing is written into that rank's ``out``. For a list, whose element
                counts are checked only as each rank's block shape arrives, the other ranks
                (the root included) may have filled their ``out`` before the closing
                barrier raises. After any other failure or cancellation, ``out`` holds
                unspecified contents.

        Algorithm: a dissemination round in which the root's header (dtype, form, block
        shape) reaches every rank, with every rank's ``out=`` dtype and size (so that a
        disagreement, or ranks that disagree about ``root``, raise on every rank, and
        nobody waits), ``ceil(log2 n)`` rounds; then a binomial tree rooted at ``root``:
        ``ceil(log2 n)`` hops, each rank receiving its whole subtree's blocks from its
        parent in one message, streamed in chunks, and forwarding its children's parts as
        they arrive; the root sends ``(n-1)/n`` of the blocks once. For a list, every edge
        first carries the shapes of its subtree's blocks, and when any rank passed ``out=``,
        a dissemination barrier ends the call (an ``out=`` that does not fit its block is
        found by its rank only once its shape is there). Scratch: a rank with children in
        the tree (other than the root) holds its subtree's blocks; the root one chunk.
        On one host, when the root passes one array too large for the shared segment (of
        more than ``CMA_MIN_SCATTER_BYTES`` with one, ``CMA_MIN_COPY_BYTES`` without)
        and every rank agreed to use cross-memory attach (``"cma"`` in :attr:`features`),
        every other rank reads its block straight from the root's array after the header
        round, and the root returns once all have; with a shared segment every rank returns
        once all have (so a rank that fails in the read makes every rank raise in the call),
        without one a rank that has read its block returns at once. A list on the root
        never goes by cross-memory attach or the pipe, even when ``"cma"`` is forced: it
        travels in the root's slot where it fits (below), otherwise by the tree.
        With a shared segment but without cross-memory attach, such an array streams through
        the segment's pipe after the header round instead (the root copies each block in,
        chunk by chunk, its rank copies it out), and every rank returns once all have.
        With a shared segment (``"shm"`` in :attr:`features`) the header round goes through
        it instead of the sockets (every rank publishes its header, every rank merges them
        all), and an array whose blocks for the other ranks fit the root's slot beside the
        header (about ``SHM_MAX_BYTES`` for all but the root's own block, which the root
        copies directly) travels in the same publication: each rank copies its block out of
        the root's slot, and nothing else is exchanged. So does a list whose block shapes
        and blocks for the other ranks fit there, followed by the closing barrier when any
        rank passed ``out=``. That path is chosen by size and cannot be forced: only the
        root knows the size before the header round.

        Raises:
            InvalidArgumentError: on the root, bad ``blocks`` (not ``world_size`` rows or
                arrays, mixed dtypes or numbers of dimensions) or ``out``; on any rank, a bad
                ``root`` or an ``out`` that cannot receive (before any I/O; the
                communicator stays usable).
            CollectiveError: see :meth:`allreduce`; :class:`~trioring.CollectiveMismatchError`
                on every rank when ranks disagree about ``root``, an ``out`` does not fit, or
                a rank runs another collective.
        """
        kind = Kind.SCATTER
        try:
            box, body, identity = _scatter.plan_scatter(
                self._world, self._forced.get(kind.label), blocks, root, out, uneven=False
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return box[0]

    async def scatterv(
        self,
        blocks: Sequence[np.ndarray[Any, Any]] | None,
        *,
        root: int = 0,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """:meth:`scatter` of uneven blocks: ``root`` passes a list (or tuple) of
        ``world_size`` arrays of one dtype and one number of dimensions, which may differ in
        shape (in the first dimension, or in any), and rank ``i`` gets a new array of
        ``blocks[i]``'s shape and values (or ``out``, when given, of that many elements).
        ``blocks`` is ignored on other ranks. Everything else (``out``, errors, the
        algorithm) is as for a list passed to :meth:`scatter`; only the call's kind
        differs, so a rank calling :meth:`scatter` while another calls :meth:`scatterv`
        raises :class:`~trioring.CollectiveMismatchError` on every rank.

        Raises:
            InvalidArgumentError: on the root, ``blocks`` not a list of ``world_size``
                arrays (an array of rows goes to :meth:`scatter`), or as :meth:`scatter`.
            CollectiveError: see :meth:`scatter`.
        """
        kind = Kind.SCATTERV
        try:
            box, body, identity = _scatter.plan_scatter(
                self._world, self._forced.get(kind.label), blocks, root, out, uneven=True
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return box[0]
