"""One rank of tests/test_p2p_processes.py (point-to-point and sub-communicators in real
processes).

``trioring run -n N --transport T groups_worker.py MODE OUT_DIR [ARGS]``. Modes:

- ``snippet``: issue 16's code as a user writes it (point-to-point, split, dup with two
  concurrent collectives, the object calls), with the sends its receives need; the report
  (``rank{RANK}.json``) has every result, checked by the test against numpy.
- ``kill-p2p VICTIM``: rank 0 sends 64 MiB to VICTIM, which posts the matching receive and
  SIGKILLs itself once the first bytes landed; rank 1 (if not the victim) waits in a receive
  from VICTIM. Survivors report what they raised.
- ``kill-groups VICTIM``: the world splits by parity and dups; VICTIM SIGKILLs itself once
  all are made; every survivor runs a barrier on the world, the dup and its half, and
  reports each outcome.

- ``pull``: every rank sends messages above the eager limit (odd sizes, one above the
  cross-memory read's step) to the next rank and receives from the previous one, at once,
  overwriting each array as soon as its send returns; the report has the features, how many
  messages this rank's receives copied out of their sender's memory and the sizes of the
  messages that came wrong (none).

- ``eager``: as ``pull``, with messages up to the eager limit (EAGER_MESSAGES), each
  received into one ``out`` buffer that is overwritten after every check; the report also
  has how many frames waiting receives took off the sockets themselves.

- ``pull-cancel SEED``: as ``pull`` (one tag, so that order tells a lost or doubled message),
  but every send and receive runs under a random deadline of up to 3 ms (none every fourth
  try) and is tried again while it is cancelled: a cancelled send must have delivered
  nothing, a returned one everything, a cancelled receive must have consumed nothing. The
  report has the messages that came wrong (none) and how many calls were cancelled.

- ``eager-cancel SEED``: as ``pull-cancel``, with the messages of ``eager``.

Survivors of the kill modes ignore SIGTERM, so that the launcher's teardown after the
victim's death does not race their report.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


def outcome(exc: BaseException | None, started: float) -> dict[str, Any]:
    if exc is None:
        return {"error": None, "elapsed": time.monotonic() - started}
    return {
        "error": type(exc).__name__,
        "peer": getattr(exc, "peer", None),
        "message": str(exc),
        "elapsed": time.monotonic() - started,
    }


async def snippet(comm: trioring.Communicator, report: dict[str, Any]) -> None:
    n, r = comm.world_size, comm.rank
    x = np.full(5, float(r))
    big = np.full(300_000, float(r))
    small = np.array([r, 10 * r])
    buf = np.empty(10)
    # point-to-point: non-overtaking per (source, tag); dtype and shape travel in the header
    if r == 0:
        await comm.send(np.arange(10.0), dest=1, tag=7)
        await comm.send(np.arange(10.0) * 2, dest=1, tag=8)
    elif r == 1:
        a = await comm.recv(source=0, tag=7)  # new array, float64[10]
        await comm.recv(source=0, tag=8, out=buf)  # or into a buffer (dtype/count checked)
        report["a"] = a.tolist()
        report["a_dtype"] = str(a.dtype)
        report["buf"] = buf.tolist()
    right, left = (r + 1) % n, (r - 1) % n
    halo = await comm.sendrecv(x, dest=right, source=left)  # both directions at once
    report["halo"] = halo.tolist()
    await comm.send(np.array([r * 100]), dest=right, tag=3)
    src, msg = await comm.recv_any(tag=3)  # from whichever rank sends first
    report["any"] = [src, msg.tolist()]

    # sub-communicators: collective over comm, no new rendezvous, no new port
    async with comm.split(color=r % 2, key=r) as half:
        assert half is not None
        await half.allreduce(x)
        report["half"] = [half.rank, half.world_size, x.tolist()]
        report["half_features"] = sorted(half.features)
    async with comm.dup() as side:
        async with trio.open_nursery() as nursery:  # two collectives at once, from two tasks
            nursery.start_soon(comm.allreduce, big)
            gathered: list[Any] = []

            # Then a large broadcast on the other communicator while the large allreduce
            # may still run: on one host each goes through its own segment's pipe.
            wide = np.full(600_000, float(r))

            async def gather_small() -> None:
                gathered.append(await side.allgather(small))
                await side.broadcast(wide, root=n - 1)

            nursery.start_soon(gather_small)
        report["big"] = [float(big.min()), float(big.max())]
        report["small"] = gathered[0].tolist()
        report["wide"] = [float(wide.min()), float(wide.max())]

    # objects: a safe codec, never pickle
    cfg = await comm.broadcast_object(
        {"lr": 0.1, "layers": [64, 64], "name": "run-7"} if r == 0 else None, root=0
    )
    stats = await comm.allgather_object({"rank": r, "loss": 0.5, "hist": np.zeros(4)})
    rows = await comm.gather_object(("ok", r), root=0)
    await comm.send_object({"step": 3, "from": r}, dest=right)
    obj = await comm.recv_object(source=left)
    report["cfg"] = cfg
    report["stats"] = [[s["rank"], s["loss"], s["hist"].tolist()] for s in stats]
    report["rows"] = None if rows is None else [list(row) for row in rows]
    report["obj"] = obj
    report["features"] = sorted(comm.features)


async def kill_p2p(comm: trioring.Communicator, victim: int, report: dict[str, Any]) -> None:
    r = comm.rank
    await comm.barrier()
    started = time.monotonic()
    if r == victim:
        target = np.zeros(8 * 1024 * 1024)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: comm.recv(source=0, tag=1, out=target))
            # Until the first bytes landed: the sender is then in the middle of its send.
            while target[0] != 1.0:  # noqa: ASYNC110 - polling our own buffer
                await trio.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        if r == 0:
            await comm.send(np.ones(8 * 1024 * 1024), dest=victim, tag=1)
        elif r == 1:
            await comm.recv(source=victim, tag=2)
        else:
            return
    except trioring.TrioringError as exc:
        report.update(outcome(exc, started))
    else:
        report.update(outcome(None, started))


async def kill_groups(comm: trioring.Communicator, victim: int, report: dict[str, Any]) -> None:
    r = comm.rank
    async with comm.split(color=r % 2) as half, comm.dup() as side:
        assert half is not None
        assert side is not None
        await comm.barrier()
        if r == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        for name, sub in (("world", comm), ("dup", side), ("half", half)):
            started = time.monotonic()
            try:
                await sub.barrier()
            except trioring.TrioringError as exc:
                report[name] = outcome(exc, started)
            else:
                report[name] = outcome(None, started)


#: dtype and element count of each message of ``pull`` mode: 1 MiB + 4 bytes, 3 MiB + 10
#: and 9 MiB + 8 (above the 4 MiB step of a PULL), each sent three times.
PULL_MESSAGES = [("float32", 262_145), ("int16", 1_572_869), ("float64", 1_179_649)] * 3
#: Eager messages of odd sizes: taken whole off the socket by a polling receive (up to 64
#: KiB and a few bytes), read straight into ``out`` once whole (beyond), up to the eager
#: limit of 1 MiB (by cross-memory attach above 512 KiB where ranks outnumber cores).
EAGER_MESSAGES = [
    ("float64", 1), ("int16", 1_501), ("float32", 16_385), ("uint8", 70_001),
    ("float64", 40_001), ("int32", 262_143), ("complex128", 65_536),
] * 3  # fmt: skip


def expected(source: int, i: int, dtype: str, count: int) -> np.ndarray:
    """Message ``i`` of rank ``source`` in the pull modes."""
    return ((np.arange(count) * (source + 3) + i) % 101).astype(dtype)


async def _pull_ring(
    comm: trioring.Communicator,
    send: Callable[[np.ndarray, int, int], Awaitable[object]],
    recv: Callable[[int, int], Awaitable[np.ndarray]],
    messages: list[tuple[str, int]] = PULL_MESSAGES,
) -> list[int]:
    """Each rank sends ``messages`` to the next rank, ``send(array, dest, i)``, and zeroes
    each array as soon as its send returns (the receiver must have had all of it), while it
    receives the previous rank's, ``recv(source, i)``, and overwrites each once checked
    (it may be a view of the ``out`` the next message lands in); then a barrier. Returns the
    indices of the messages that arrived wrong."""
    r, n = comm.rank, comm.world_size
    wrong: list[int] = []

    async def sending() -> None:
        for i, (dtype, count) in enumerate(messages):
            array = expected(r, i, dtype, count)
            await send(array, (r + 1) % n, i)
            array[:] = 0

    async def receiving() -> None:
        for i, (dtype, count) in enumerate(messages):
            got = await recv((r - 1) % n, i)
            if not np.array_equal(got, expected((r - 1) % n, i, dtype, count)):
                wrong.append(i)
            got.reshape(-1).view(np.uint8)[:] = 0xA5

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sending)
        nursery.start_soon(receiving)
    await comm.barrier()
    return wrong


async def pull(comm: trioring.Communicator, report: dict[str, Any]) -> None:
    pulls = count_pulls()
    wrong = await _pull_ring(
        comm,
        lambda array, dest, i: comm.send(array, dest=dest, tag=i),
        lambda source, i: comm.recv(source=source, tag=i),
    )
    report.update(
        features=sorted(comm.features), pulls=pulls[0], wrong=wrong, messages=len(PULL_MESSAGES)
    )


def _receive_buffer(messages: list[tuple[str, int]]) -> Callable[[int], np.ndarray]:
    """One buffer for every message of ``messages``: message ``i``'s ``out`` is its start,
    viewed as that message's dtype."""
    out = np.empty(max(count * np.dtype(dtype).itemsize for dtype, count in messages), np.uint8)

    def into(i: int) -> np.ndarray:
        dtype, count = messages[i]
        return out[: count * np.dtype(dtype).itemsize].view(dtype)

    return into


async def eager(comm: trioring.Communicator, report: dict[str, Any]) -> None:
    into = _receive_buffer(EAGER_MESSAGES)
    wrong = await _pull_ring(
        comm,
        lambda array, dest, i: comm.send(array, dest=dest, tag=i),
        lambda source, i: comm.recv(source=source, tag=i, out=into(i)),
        EAGER_MESSAGES,
    )
    report.update(
        features=sorted(comm.features),
        wrong=wrong,
        messages=len(EAGER_MESSAGES),
        taken=comm._endpoint.taken_by_waits,
    )


async def pull_cancel(
    comm: trioring.Communicator,
    seed: int,
    report: dict[str, Any],
    messages: list[tuple[str, int]] = PULL_MESSAGES,
) -> None:
    rng = np.random.default_rng(seed * 100 + comm.rank)
    cancelled = {"send": 0, "recv": 0}
    into = _receive_buffer(messages)

    async def tried(name: str, call: Callable[[], Awaitable[Any]]) -> Any:
        for attempt in range(1, 201):
            deadline = math.inf if attempt % 4 == 0 else float(rng.uniform(0, 0.003))
            with trio.move_on_after(deadline):
                return await call()
            cancelled[name] += 1
        raise AssertionError(f"{name} cancelled 200 times")

    wrong = await _pull_ring(
        comm,
        lambda array, dest, _: tried("send", lambda: comm.send(array, dest=dest)),
        lambda source, i: tried("recv", lambda: comm.recv(source=source, out=into(i))),
        messages,
    )
    report.update(features=sorted(comm.features), wrong=wrong, cancelled=cancelled)


def count_pulls() -> list[int]:
    """Count the messages this rank's receives copy out of their sender's memory
    (Reading._copy_out, wrapped)."""
    from trioring._p2p._reading import Reading

    calls = [0]
    original = Reading._copy_out

    async def counted(self: Any, *args: Any) -> None:
        calls[0] += 1
        await original(self, *args)

    Reading._copy_out = counted  # type: ignore[method-assign]
    return calls


async def main(mode: str, out_dir: Path, args: list[str]) -> int:
    report: dict[str, Any] = {}
    if mode.startswith("kill"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.fail_after(60):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            if mode == "snippet":
                await snippet(comm, report)
            elif mode == "kill-p2p":
                await kill_p2p(comm, int(args[0]), report)
            elif mode == "pull":
                await pull(comm, report)
            elif mode == "pull-cancel":
                await pull_cancel(comm, int(args[0]), report)
            elif mode == "eager":
                await eager(comm, report)
            elif mode == "eager-cancel":
                await pull_cancel(comm, int(args[0]), report, EAGER_MESSAGES)
            elif mode == "kill-groups":
                await kill_groups(comm, int(args[0]), report)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
