"""Sub-communicators: split and dup. Each is a collective over the parent (one small
allgather of every rank's color and key, O(log n) rounds), after which the members of each
new communicator connect to each other through the world's listeners (see
:mod:`trioring._family`) and, on one host, agree on the one-host paths among themselves."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from .._collectives import _allgather
from .._concurrency import run_concurrently
from .._core import CommunicatorCore
from .._errors import CollectiveError, RendezvousError
from .._onehost import _agree
from .._util import AsyncContextOnly
from .._wire import DTYPE_CODES, NO_ROOT, Kind

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from contextlib import AbstractAsyncContextManager

    from .._communicator import Communicator
    from .._framing import Link
    from .._onehost._shm import SharedSlots
    from .._wire import OpSpec

__all__ = ["GroupMethods"]

#: Colors are ints in [0, COLOR_BOUND); keys any int64.
COLOR_BOUND = 2**31
_INT64 = np.dtype(np.int64)


class GroupMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""

    def split(
        self, *, color: int | None, key: int | None = None
    ) -> AbstractAsyncContextManager[Communicator | None]:
        """Split this communicator into disjoint sub-communicators, one per ``color``; use
        as ``async with comm.split(color=c, key=k) as sub:``. Collective: every rank calls
        it, in the same order as its other collectives.

        The ranks that pass the same ``color`` (an int, ``0 <= color < 2**31``) form one new
        communicator, ranked by ``key`` (default: this rank), ties broken by rank here
        (MPI's ``MPI_Comm_split``). ``color=None`` joins none: ``sub`` is then ``None``, but
        the rank must still call. No new rendezvous and no new port: the members connect to
        each other through the listeners the world already has, and those on one host agree
        on the one-host paths (shared segment, cross-memory attach) among themselves.

        The new communicator is independent: its own sequence numbers, identity checks and
        busy rule; collectives on it run **at the same time** as those on this communicator
        and on any other (from different tasks), and never wait behind them. A cancel,
        mismatch or error in it breaks it alone (its members are told); closing it leaves
        this one open; closing this one closes it (its pending calls raise
        :class:`~trioring.CommunicatorClosedError`). Leaving the ``async with`` closes it.
        Costs: one allgather of two int64 per rank on this communicator, then ``m - 1``
        connections per rank of a communicator of ``m`` ranks (file descriptors kept until
        it closes).

        Raises:
            InvalidArgumentError: bad ``color`` or ``key`` (before any I/O).
            CollectiveError: the split failed (a member died, a connection could not be
                made); this communicator is broken, as after any failed collective.
        """
        return AsyncContextOnly(self._child(Kind.SPLIT, color, key), "comm.split(color=...)")

    def dup(self) -> AbstractAsyncContextManager[Communicator]:
        """A new communicator of the same ranks (``async with comm.dup() as side:``), for
        running collectives concurrently with this one from another task. Collective, as
        :meth:`split` (it is ``split(color=0)`` with the same costs and rules)."""
        return AsyncContextOnly(self._child(Kind.DUP, 0, None), "comm.dup()")

    @asynccontextmanager
    async def _child(self, kind: Kind, color: int | None, key: int | None) -> AsyncIterator[Any]:
        child = await self._make_child(kind, color, key)
        try:
            yield child
        except BaseException as exc:
            if child is not None:
                await child._leave_because(exc)
            raise
        finally:
            if child is not None:
                await child.aclose()

    async def _make_child(self, kind: Kind, color: int | None, key: int | None) -> Any:
        if color is not None and (
            isinstance(color, bool)
            or not isinstance(color, (int, np.integer))
            or not 0 <= int(color) < COLOR_BOUND
        ):
            raise self._invalid(kind, f"color must be None or an int in [0, 2**31), got {color!r}")
        if key is None:
            key = self._rank
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise self._invalid(kind, f"key must be an int, got {key!r}")
        if not -(2**63) <= int(key) < 2**63:
            raise self._invalid(kind, f"key must fit in an int64, got {key}")
        n = self._world_size
        mine = np.array([-1 if color is None else int(color), int(key)], dtype=np.int64)
        table = np.empty(2 * n, dtype=np.int64)
        agree = _allgather.body(None, self._world, mine, table)
        made: list[Any] = []

        async def body(spec: OpSpec) -> None:
            await agree(spec)
            if color is None:
                return
            rows = table.reshape(n, 2)
            order = sorted((int(k), r) for r, (c, k) in enumerate(rows) if c == color)
            ranks = [r for _, r in order]
            made.append(await self._connect_child(spec, kind, int(color), ranks))

        await self._run(kind, body, (DTYPE_CODES[_INT64], 2, 0, NO_ROOT, None))
        return made[0] if made else None

    async def _connect_child(self, spec: OpSpec, kind: Kind, color: int, ranks: list[int]) -> Any:
        """This rank's part of making the communicator of parent ``ranks`` (in new-rank
        order): connections, then the one-host agreement, then the object."""
        family = self._family
        rank = ranks.index(self._rank)
        members = tuple(self._members[r] for r in ranks)
        name = f"{self._key}/{kind.label}#{spec.seq}/{color}"
        of = self._label or "world"
        label = f"{kind.label} #{spec.seq} of {of}" + (
            f" (color {color})" if kind is Kind.SPLIT else ""
        )
        peers = [r for r in ranks if r != self._rank]
        try:
            links = await family.connect_group(
                name, members, rank=rank, watch=self._abort_watch(spec, peers)
            )
        except RendezvousError as exc:
            # A connection that could not be made is this split's failure, reported as a
            # collective's so that the parent breaks and tells its peers.
            raise CollectiveError(
                str(exc._bare_message),
                rank=self._rank,
                peer=None if exc.peer is None else ranks[exc.peer],
                collective=kind.label,
                seq=spec.seq,
                job_id=self._job_id,
            ) from exc
        config = family.config
        pids: dict[int, int] | None = None
        shm: SharedSlots | None = None
        try:
            local = attrs.evolve(config, rank=rank, world_size=len(ranks))
            _, pids, shm, _ = await _agree.agree_on_paths(local, links)
            child = type(self)._create(  # type: ignore[attr-defined]
                rank=rank,
                world_size=len(ranks),
                family=family,
                links=links,
                chunk_bytes=self._world.chunk_bytes,
                job_id=self._job_id or "",
                key=name,
                members=members,
                parent=self,
                label=label,
            )
        except BaseException:
            if shm is not None:
                shm.close()
            for link in links.values():
                await trio.aclose_forcefully(link.connection)
            raise
        child._world.peer_pids = pids
        child._world.shm = shm
        child._forced = dict(self._forced)
        for link in links.values():
            link.watch = list(links.values())
        self._children.append(child)
        return child

    def _abort_watch(self, spec: OpSpec, peers: list[int]) -> Callable[[], Awaitable[None]]:
        """While the members connect, watch this communicator's (idle) links to them for an
        abort frame: a member that failed here, alive, says so there, and we must not wait
        for its connection. A member that died is seen by the point-to-point plane."""

        def watcher(link: Link) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                error = await link.watch_idle(spec)
                if error is not None:
                    raise error

            return one

        async def watch() -> None:
            links = [self._links[p] for p in peers if p in self._links]
            await run_concurrently(*(watcher(link) for link in links))

        return watch
