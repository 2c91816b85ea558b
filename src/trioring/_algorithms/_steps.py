"""The pieces every algorithm is made of: one send while one receive (:func:`exchange`), and
an array cut into chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._concurrency import run_concurrently

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._framing import Link
    from .._wire import OpSpec

__all__ = ["bytes_of", "chunks", "exchange"]


def chunks(lo: int, hi: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(offset, count) pieces of [lo, hi). An empty range still yields one empty piece, so
    every link carries at least one frame per step and a mismatch never goes unnoticed."""
    if hi <= lo:
        yield lo, 0
        return
    for start in range(lo, hi, chunk):
        yield start, min(chunk, hi - start)


async def exchange(
    spec: OpSpec,
    to: Link,
    send_offset: int,
    payload: memoryview,
    frm: Link,
    recv_offset: int,
    into: memoryview,
) -> None:
    """Send one frame to ``to`` while receiving one from ``frm``. When the connection takes
    the whole frame at once (small frames nearly always), this starts no tasks at all, which
    is most of the cost of a small collective; otherwise the rest of the send and the
    receive run concurrently, so neither side can wait for the other's send to finish."""
    rest = to.start_send(spec, send_offset, payload)
    if rest is None:
        await frm.recv(spec, recv_offset, into)
        return
    unsent = rest

    async def send() -> None:
        await to.finish_send(spec, unsent)

    async def receive() -> None:
        await frm.recv(spec, recv_offset, into)

    await run_concurrently(send, receive)


def bytes_of(flat: np.ndarray, offset: int, count: int) -> memoryview:
    return flat[offset : offset + count].view(np.uint8).data
