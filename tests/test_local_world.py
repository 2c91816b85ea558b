"""Collectives in one process over the in-memory transport (trioring.testing)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import trioring
from trioring._collectives._decision import SMALL_ALLREDUCE_BYTES
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

DTYPES = [
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
OPS = ["sum", "mean", "min", "max", "prod"]


def allowed(op: str, dtype: np.dtype[Any]) -> bool:
    if op in ("min", "max") and dtype.kind == "c":
        return False
    return not (op == "mean" and dtype.kind in "iu")


def make_input(seed: int, rank: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if dtype.kind in "iu":
        # Small magnitudes: sums and products of up to 6 ranks stay exact in every int type.
        return np.asarray(rng.integers(0 if dtype.kind == "u" else -3, 4, size=shape), dtype=dtype)
    values = rng.uniform(-2, 2, size=shape)
    if dtype.kind == "c":
        values = values + 1j * rng.uniform(-2, 2, size=shape)
    return np.asarray(values, dtype=dtype)


def reference(op: str, inputs: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(inputs)
    if op in ("sum", "mean"):
        total = stacked.sum(axis=0, dtype=stacked.dtype)
        return total / len(inputs) if op == "mean" else total
    if op == "prod":
        return stacked.prod(axis=0, dtype=stacked.dtype)
    return stacked.min(axis=0) if op == "min" else stacked.max(axis=0)


def check_close(result: np.ndarray, expected: np.ndarray, op: str) -> None:
    assert result.dtype == expected.dtype
    if result.dtype.kind in "iu" or op in ("min", "max"):
        np.testing.assert_array_equal(result, expected)
    else:
        tolerance = 2e-2 if result.dtype in (np.float16,) else 1e-5
        np.testing.assert_allclose(result, expected, rtol=tolerance, atol=tolerance)


async def run_ranks(
    comms: list[trioring.Communicator], fn: Callable[[trioring.Communicator], Awaitable[None]]
) -> None:
    async with trio.open_nursery() as nursery:
        for comm in comms:
            nursery.start_soon(fn, comm)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.integers(1, 6),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES).map(np.dtype),
    op=st.sampled_from(OPS),
    root_seed=st.integers(0, 1000),
    seed=st.integers(0, 2**16),
    chunk_bytes=st.sampled_from([16, 48, 1024]),
    buffered=st.booleans(),
)
def test_collectives_match_numpy(
    n: int,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    op: str,
    root_seed: int,
    seed: int,
    chunk_bytes: int,
    buffered: bool,
) -> None:
    if not allowed(op, dtype):
        op = "sum"
    root = root_seed % n
    inputs = [make_input(seed, r, shape, dtype) for r in range(n)]
    reduced: list[np.ndarray] = [x.copy() for x in inputs]
    broadcasted: list[np.ndarray] = [make_input(seed + 1, r, shape, dtype) for r in range(n)]
    root_data = broadcasted[root].copy()

    async def rank_main(comm: trioring.Communicator) -> None:
        await comm.allreduce(reduced[comm.rank], op=op)
        await comm.barrier()
        await comm.broadcast(broadcasted[comm.rank], root=root)

    async def main() -> None:
        with trio.fail_after(5):
            async with open_local_world(n, buffered=buffered, chunk_bytes=chunk_bytes) as comms:
                await run_ranks(comms, rank_main)
                assert all(c.seq == 3 for c in comms)

    trio.run(main)
    expected = reference(op, inputs)
    for result in reduced:
        assert result.shape == shape
        check_close(result, expected, op)
        # Bitwise identical on every rank, NaN payloads and signed zeros included.
        assert result.tobytes() == reduced[0].tobytes()
    for result in broadcasted:
        assert result.tobytes() == root_data.tobytes()


async def test_mean_divides_once_in_dtype() -> None:
    async with open_local_world(3, chunk_bytes=16) as comms:
        arrays = [np.full(10, float(r + 1), dtype=np.float32) for r in range(3)]

        async def rank_main(comm: trioring.Communicator) -> None:
            await comm.allreduce(arrays[comm.rank], op=trioring.ReduceOp.MEAN)

        await run_ranks(comms, rank_main)
    for a in arrays:
        np.testing.assert_array_equal(a, np.float32(6) / np.float32(3))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
async def test_one_element_allreduces_of_every_dtype_and_op_in_a_row(n: int) -> None:
    # One-element reductions never work in place (numpy is slow at that): each partial
    # result goes to the other of the array and a spare element. Every dtype and op, one
    # call after another on the same communicators, so that a result left in the spare
    # element, or a spare still viewed as the previous call's dtype, would show.
    cases = [(dtype, op) for dtype in DTYPES for op in OPS if allowed(op, np.dtype(dtype))]
    inputs = [
        [make_input(seed, r, (1,), np.dtype(dtype)) for r in range(n)]
        for seed, (dtype, _) in enumerate(cases)
    ]
    results = [[x.copy() for x in per_rank] for per_rank in inputs]

    async def rank_main(comm: trioring.Communicator) -> None:
        for index, (_, op) in enumerate(cases):
            await comm.allreduce(results[index][comm.rank], op=op)

    with trio.fail_after(20):
        async with open_local_world(n) as comms:
            await run_ranks(comms, rank_main)
    for (_, op), given_inputs, outputs in zip(cases, inputs, results, strict=True):
        expected = reference(op, given_inputs)
        for output in outputs:
            check_close(output, expected, op)
            assert output.tobytes() == outputs[0].tobytes()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_lockstep_streams_do_not_deadlock(n: int) -> None:
    """With unbuffered streams every send waits for its receive: any algorithm step that
    sends before it receives would hang here (and fail_after would fire)."""
    with trio.fail_after(20):
        async with open_local_world(n, buffered=False, chunk_bytes=64) as comms:

            async def rank_main(comm: trioring.Communicator) -> None:
                x = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
                for op in OPS:
                    await comm.allreduce(x.copy(), op=op)
                for root in range(n):
                    await comm.broadcast(x, root=root)
                await comm.barrier()
                await comm.allreduce(np.zeros(0, np.int32))

            await run_ranks(comms, rank_main)


async def test_cancelled_collective_breaks_every_rank() -> None:
    async with open_local_world(4) as comms:
        errors: dict[int, BaseException] = {}
        cancelled = trio.Event()

        async def rank_main(comm: trioring.Communicator) -> None:
            # Large enough for the ring algorithm, in which every rank needs every other's
            # data until the end (small arrays: see the next test).
            x = np.ones(2 * SMALL_ALLREDUCE_BYTES // 4, np.float32)
            if comm.rank == 2:
                with trio.move_on_after(0) as scope:
                    # The cancel scope is already expired: checkpoint_if_cancelled raises
                    # before any I/O, so the communicator stays usable...
                    await comm.allreduce(x)
                assert scope.cancelled_caught
                assert not comm.broken
                # ... while a cancellation during I/O breaks it (the others join this
                # collective only after rank 2 gave up, so it can only end by cancellation).
                with trio.move_on_after(0.05):
                    await comm.allreduce(x)
                assert comm.broken
                cancelled.set()
                with pytest.raises(trioring.CommunicatorBrokenError, match="rank 2: allreduce #2"):
                    await comm.allreduce(x)
                return
            await cancelled.wait()
            try:
                await comm.allreduce(x)
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await run_ranks(comms, rank_main)
    assert sorted(errors) == [0, 1, 3]
    for rank, exc in errors.items():
        assert isinstance(exc, trioring.PeerAbortedError | trioring.PeerFailedError), exc
        assert exc.rank == rank
        assert f"rank {rank}:" in str(exc)
    # Rank 2's ring neighbours name it; rank 0 hears either the relayed news or that rank 3,
    # interrupted mid-send, closed its connection.
    assert errors[1].peer == 2
    assert errors[3].peer == 2
    assert errors[0].peer in (2, 3)
    # Rank 3 receives from rank 2 in the ring: it reads rank 2's abort frame and knows why.
    assert isinstance(errors[3], trioring.PeerAbortedError)
    assert errors[3].reason == "cancelled"
    assert "rank 2 cancelled allreduce #1 after " in str(errors[3])


async def test_cancelled_small_allreduce_never_returns_a_wrong_result() -> None:
    """With recursive doubling, a rank whose exchanges were all done before a peer was
    cancelled may return; its result is then complete and correct, and its next collective
    raises. Every other rank raises in the call."""
    async with open_local_world(4) as comms:
        outcomes: dict[int, object] = {}
        cancelled = trio.Event()

        async def rank_main(comm: trioring.Communicator) -> None:
            x = np.full(10, comm.rank + 1.0)
            if comm.rank == 2:
                with trio.move_on_after(0.05):
                    await comm.allreduce(x)
                cancelled.set()
                return
            await cancelled.wait()
            try:
                await comm.allreduce(x)
            except trioring.TrioringError as exc:
                outcomes[comm.rank] = exc
                return
            outcomes[comm.rank] = x.copy()
            with pytest.raises(trioring.TrioringError):
                await comm.barrier()

        with trio.fail_after(10):
            await run_ranks(comms, rank_main)
    assert sorted(outcomes) == [0, 1, 3]
    for outcome in outcomes.values():
        if isinstance(outcome, np.ndarray):
            np.testing.assert_array_equal(outcome, np.full(10, 10.0))
        else:
            assert isinstance(outcome, trioring.PeerAbortedError | trioring.PeerFailedError)
            # Either the cancelled rank, or a rank that broke because of it and closed its
            # connection while it could not send an abort frame.
            assert outcome.peer == 2 or isinstance(outcomes.get(outcome.peer), Exception)
    assert any(not isinstance(o, np.ndarray) for o in outcomes.values())


@pytest.mark.parametrize(
    ("odd", "fragment"),
    [
        (lambda c: c.allreduce(np.zeros(10, np.float64)), ("float32[10]", "float64[10]")),
        (lambda c: c.allreduce(np.zeros(11, np.float32)), ("float32[10]", "float32[11]")),
        (
            lambda c: c.allreduce(np.zeros(10, np.float32), op="max"),
            ("allreduce(sum)", "allreduce(max)"),
        ),
        (lambda c: c.broadcast(np.zeros(10, np.float32)), ("allreduce(sum)", "broadcast(root=0)")),
        (lambda c: c.barrier(), ("allreduce(sum) float32[10] #1", "barrier #1")),
    ],
    ids=["dtype", "count", "op", "kind", "barrier"],
)
@pytest.mark.parametrize("n", [2, 3])
async def test_mismatch_raises_everywhere(
    n: int, odd: Callable[[trioring.Communicator], Awaitable[None]], fragment: tuple[str, str]
) -> None:
    errors: dict[int, BaseException] = {}
    async with open_local_world(n) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            try:
                if comm.rank == 1:
                    await odd(comm)
                else:
                    await comm.allreduce(np.zeros(10, np.float32))
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await run_ranks(comms, rank_main)
    assert sorted(errors) == list(range(n))
    mismatches = [e for e in errors.values() if isinstance(e, trioring.CollectiveMismatchError)]
    assert mismatches
    for exc in mismatches:
        assert all(f in str(exc) for f in fragment), str(exc)
    if n == 2:
        assert len(mismatches) == 2


async def test_root_mismatch() -> None:
    errors: dict[int, BaseException] = {}
    async with open_local_world(2) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            try:
                await comm.broadcast(np.zeros(4, np.int32), root=comm.rank)
            except trioring.CollectiveMismatchError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await run_ranks(comms, rank_main)
    assert "rank 0: broadcast(root=0) int32[4] #1, rank 1: broadcast(root=1) int32[4] #1" in str(
        errors[0]
    )


async def test_stale_barrier_token_never_releases_later_barrier() -> None:
    """A token left over from barrier #1 arrives while rank 1 runs barrier #2: it must be
    refused, not taken as rank 0's arrival at barrier #2."""
    from trioring._wire import Kind, OpSpec

    async with open_local_world(2) as comms:
        await run_ranks(comms, lambda c: c.barrier())
        # Rank 0 sends a second, stale token of barrier #1 (as a buggy or replayed peer might).
        await comms[0]._links[1].send(OpSpec(Kind.BARRIER, 1), 0, memoryview(b""))
        with trio.fail_after(10), pytest.raises(trioring.CollectiveMismatchError) as info:
            await comms[1].barrier()
        assert str(info.value).startswith("rank 1: barrier #2, rank 0: barrier #1")


async def test_skipped_collective_is_a_mismatch() -> None:
    errors: dict[int, BaseException] = {}
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            try:
                await comm.barrier()
                if comm.rank != 1:
                    await comm.barrier()
                await comm.allreduce(np.zeros(3))
            except trioring.TrioringError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await run_ranks(comms, rank_main)
    assert sorted(errors) == [0, 1, 2]
    mismatch = next(e for e in errors.values() if isinstance(e, trioring.CollectiveMismatchError))
    assert "barrier #2" in str(mismatch)
    assert "allreduce(sum) float64[3] #2" in str(mismatch)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.allreduce([1.0, 2.0]), "expected a numpy.ndarray, got list"),
        (lambda c: c.allreduce(np.zeros((4, 4), np.float32)[:, 1]), "not C-contiguous"),
        (lambda c: c.allreduce(np.zeros(3, object)), "dtype object is not supported"),
        (lambda c: c.allreduce(np.zeros(3, bool)), "not defined for dtype bool"),
        (lambda c: c.allreduce(np.zeros(3), op="bxor"), "needs an integer or bool dtype"),
        (lambda c: c.allreduce(np.zeros(3, ">f4")), "not in native byte order"),
        (
            lambda c: c.allreduce(np.zeros(3, np.complex64), op="min"),
            "'min' is not defined for complex",
        ),
        (lambda c: c.allreduce(np.zeros(3, np.int32), op="mean"), "'mean' needs a floating"),
        (lambda c: c.allreduce(np.zeros(3), op="avg"), "unknown op 'avg'"),
        (
            lambda c: c.broadcast(np.zeros(3), root=2),
            r"root 2 is not a rank of this communicator \(0\.\.1\)",
        ),
        (lambda c: c.broadcast(np.zeros(3), root=-1), "root -1 is not a rank"),
        (lambda c: c.broadcast(np.zeros(3), root=True), "root must be an int"),
    ],
)
async def test_invalid_arguments_fail_before_io(
    call: Callable[[trioring.Communicator], Awaitable[None]], message: str
) -> None:
    async with open_local_world(2) as comms:
        with pytest.raises(trioring.InvalidArgumentError, match=message) as info:
            await call(comms[0])
        assert str(info.value).startswith("rank 0: ")
        assert info.value.seq == 1
        assert not comms[0].broken
        assert comms[0].seq == 0
        # The communicator is still fine: a proper collective works on both ranks.
        await run_ranks(comms, lambda c: c.barrier())


async def test_read_only_array_refused() -> None:
    x = np.zeros(3)
    x.flags.writeable = False
    async with open_local_world(1) as (comm,):
        with pytest.raises(trioring.InvalidArgumentError, match="read-only"):
            await comm.broadcast(x)


async def test_world_of_one_and_checkpoints() -> None:
    async with open_local_world(1) as (comm,):
        x = np.arange(5, dtype=np.float64)
        for op in OPS:
            with trio.testing.assert_checkpoints():
                await comm.allreduce(x, op=op)
        with trio.testing.assert_checkpoints():
            await comm.broadcast(x, root=0)
        with trio.testing.assert_checkpoints():
            await comm.barrier()
        np.testing.assert_array_equal(x, np.arange(5, dtype=np.float64))
        assert comm.seq == 7


async def test_empty_arrays_checkpoint() -> None:
    async with open_local_world(2) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            with trio.testing.assert_checkpoints():
                await comm.allreduce(np.zeros(0, np.float32))

        await run_ranks(comms, rank_main)


async def test_concurrent_use_is_refused() -> None:
    async with open_local_world(2) as comms:
        busy_error: list[BaseException] = []

        async def second_caller() -> None:
            with pytest.raises(
                trioring.CommunicatorBusyError, match=r"allreduce\(sum\) float32\[4\] #1"
            ) as info:
                await comms[0].barrier()
            busy_error.append(info.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(comms[0].allreduce, np.zeros(4, np.float32))
            await trio.testing.wait_all_tasks_blocked()
            await second_caller()
            nursery.start_soon(comms[1].allreduce, np.zeros(4, np.float32))
        assert busy_error
        assert not comms[0].broken


async def test_closed_communicator() -> None:
    async with open_local_world(2) as comms:
        await comms[0].aclose()
        await comms[0].aclose()  # idempotent
        assert comms[0].closed
        with pytest.raises(trioring.CommunicatorClosedError, match="rank 0: barrier #1"):
            await comms[0].barrier()
        # The peer notices the closed connection instead of hanging.
        with (
            trio.fail_after(5),
            pytest.raises(trioring.PeerFailedError, match="peer rank 0") as info,
        ):
            await comms[1].barrier()
        assert info.value.peer == 0
        assert comms[1].broken


async def test_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="no public constructor"):
        trioring.Communicator()


async def test_open_local_world_validates() -> None:
    with pytest.raises(trioring.ConfigurationError):
        async with open_local_world(0):
            pass  # pragma: no cover


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())  # type: ignore[arg-type]


async def test_nothing_left_running_after_failure() -> None:
    """After a failed collective no helper task of trioring's is left behind (the world's
    own background tasks, the point-to-point readers and the listener's acceptor, run until
    the world closes, and not a moment longer)."""
    outside = count_tasks()
    async with open_local_world(3) as comms:
        before = count_tasks()

        async def rank_main(comm: trioring.Communicator) -> None:
            dtype = np.float64 if comm.rank == 0 else np.float32
            with pytest.raises(trioring.TrioringError):
                await comm.allreduce(np.zeros(8, dtype))

        with trio.fail_after(10):
            await run_ranks(comms, rank_main)
        assert count_tasks() == before
        assert all(c.broken for c in comms)
    assert count_tasks() == outside


def test_reference_helper_sanity() -> None:
    # The reference must actually differ between ops, or the property test proves little.
    a, b = np.array([1.0, 5.0]), np.array([3.0, 2.0])
    assert reference("sum", [a, b]).tolist() == [4.0, 7.0]
    assert reference("min", [a, b]).tolist() == [1.0, 2.0]
    assert reference("prod", [a, b]).tolist() == [3.0, 10.0]
    assert math.isclose(reference("mean", [a, b])[0], 2.0)
