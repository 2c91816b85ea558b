"""In-process worlds for tests and examples."""

from __future__ import annotations

import functools
import itertools
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ._communicator import DEFAULT_CHUNK_BYTES, Communicator
from ._concurrency import run_concurrently
from ._config import Config
from ._errors import ConfigurationError
from ._opening import create_communicator, require_trio
from ._util import async_context_only
from .transports import MemoryTransport, TransportContext

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

__all__ = ["open_local_world"]

_WORLDS = itertools.count()


@async_context_only("trioring.testing.open_local_world(...)")
@asynccontextmanager
async def open_local_world(
    world_size: int,
    *,
    buffered: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> AsyncIterator[list[Communicator]]:
    """Yield ``world_size`` communicators connected to each other over in-memory streams,
    inside the current ``trio.run``; close them all on exit.

    ``comms[i].rank == i``. Run each rank's code as its own task, since collectives only
    complete when every rank takes part::

        async with trioring.testing.open_local_world(4) as comms:
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(my_rank_code, comm)

    Args:
        world_size: number of ranks (>= 1).
        buffered: with ``False``, connections have no buffer at all (every send waits for
            the matching receive, like :func:`trio.testing.lockstep_stream_pair`), so code
            that sends before it receives deadlocks at once instead of only on large arrays.
        chunk_bytes: bytes per frame of bulk data (default 1 MiB, ``DEFAULT_CHUNK_BYTES``);
            make it small to exercise chunking with small arrays.

    Unlike :func:`trioring.open_communicator`, any number of local worlds may be opened at
    once: they share no addresses.
    """
    require_trio("trioring.testing.open_local_world()")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 16:
        raise ConfigurationError(f"chunk_bytes must be an int >= 16, got {chunk_bytes!r}")
    stream_pair = None if buffered else trio.testing.lockstep_stream_pair
    make_transport: Callable[[TransportContext], MemoryTransport] = functools.partial(
        MemoryTransport, stream_pair=stream_pair
    )
    world_id = next(_WORLDS)
    comms: list[Communicator | None] = [None] * world_size

    def opener(rank: int) -> Callable[[], Awaitable[None]]:
        async def open_rank() -> None:
            config = Config(
                rank=rank,
                world_size=world_size,
                transport="memory",
                master_addr=f"local-world-{world_id}",
                master_port=1,
                socket_dir=None,
            )
            comms[rank] = await create_communicator(config, make_transport, chunk_bytes=chunk_bytes)

        return open_rank

    try:
        await run_concurrently(*(opener(rank) for rank in range(world_size)))
        ready = [comm for comm in comms if comm is not None]
        assert len(ready) == world_size
        yield ready
    finally:
        with trio.CancelScope(shield=True):
            for comm in comms:
                if comm is not None:
                    await comm.aclose()
