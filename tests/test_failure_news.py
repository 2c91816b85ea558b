"""How a rank that loses a connection tells the others, in in-process worlds on virtual time.

A rank whose connection to a peer ends looks briefly (``_PENDING_ABORT_SECONDS``) on its other
links for an abort frame that names an earlier cause: the lost connection may only echo a
failure elsewhere. When the connection ended between two frames, the peer itself died or left
(a live peer that gives up says why first), so the rank tells the others before it looks:
otherwise every survivor waits out its look for the others' news, which they hold back for
their own looks. The autojump clock makes "nobody waited out a look" exact: no virtual time
passes unless every task is blocked on a timer.

A rank that leaves a communicator's ``async with`` block on an exception tells its peers what
it was before it closes, so that they raise PeerAbortedError with the reason; its LEFT frame
says the same to their point-to-point calls, and where it left only because a third rank
failed, names that rank. A collective that Trio cancelled because code beside it failed
says so. Errors of a sub-communicator say which world ranks its ranks are, for ``trioring
run``'s report.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

import numpy as np
import pytest
import trio
import trio.testing

import trioring
from local_runs import on_every_rank
from trioring._errors import echoed_ranks
from trioring._framing import _PENDING_ABORT_SECONDS
from trioring._wire import AbortKind, Kind, OpSpec, pack_abort_frame
from trioring.testing import open_local_world


async def _vanish(comm: trioring.Communicator) -> None:
    """Close every connection of ``comm`` without a word, as a killed process's kernel does."""
    for link in comm._links.values():
        await trio.aclose_forcefully(link.connection)


async def _rank_1_tells_rank_0_it_was_cancelled(comm: trioring.Communicator) -> None:
    """The abort frame rank 1 of a world would send rank 0 on giving up in allreduce #1."""
    reason = "cancelled allreduce #1 (by the test)"
    await comm._links[0].send_abort(AbortKind.CANCELLED, 1, 1, reason, 1)


@pytest.mark.parametrize("world_size", [3, 4, 5])
async def test_a_peer_gone_between_frames_is_reported_without_waiting_out_the_look(
    autojump_clock: trio.testing.MockClock, world_size: int
) -> None:
    """The last rank vanishes; every survivor's allreduce raises PeerFailedError naming it.
    Those that found its connection closed between frames, and those that heard it from
    them, did not wait out a look; the former say so in their own words, not as news relayed
    by a neighbour. (A survivor whose send to it failed while the same link was being read
    cannot tell where the close fell, and may still wait out its look.)"""
    gone = world_size - 1
    errors: dict[int, trioring.PeerFailedError] = {}
    took: dict[int, float] = {}
    async with open_local_world(world_size) as comms:
        await _vanish(comms[gone])
        start = trio.current_time()

        async def survivor(comm: trioring.Communicator) -> None:
            with pytest.raises(trioring.PeerFailedError) as info:
                await comm.allreduce(np.ones(4, np.float32))
            errors[comm.rank] = info.value
            took[comm.rank] = trio.current_time() - start

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for comm in comms[:gone]:
                    nursery.start_soon(survivor, comm)
    assert sorted(errors) == list(range(gone))
    closed = f"connection to peer rank {gone} was closed by the peer after 0 of"
    for rank, error in errors.items():
        assert error.peer == gone, error
        if "broke while sending" not in str(error):
            assert took[rank] < _PENDING_ABORT_SECONDS, (rank, took[rank], error)
            assert closed in str(error) or f"rank {gone} failed (relayed by" in str(error)
    first_hand = [
        e for r, e in errors.items() if str(e).startswith(f"rank {r}: allreduce #1: {closed}")
    ]
    for error in first_hand:
        assert not getattr(error, "__notes__", []), error.__notes__
    if world_size != 4:
        # At world 4 the two ranks that exchange with rank 3 both send to it first, so its
        # close is only ever met by a send: the exception above.
        assert first_hand, errors


async def test_the_look_still_finds_the_cause_behind_a_silent_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rank 1 gives up (an abort frame saying it was cancelled) and rank 2 then closes without
    a word: rank 0, which waits on rank 2 first, must report rank 1's cancellation, the cause,
    and keep what it noticed first as a note."""
    async with open_local_world(3) as comms:
        await _rank_1_tells_rank_0_it_was_cancelled(comms[1])
        await _vanish(comms[2])
        with trio.fail_after(10), pytest.raises(trioring.PeerAbortedError) as info:
            await comms[0].allreduce(np.ones(4, np.float32))
    error = info.value
    assert error.peer == 1, error
    assert str(error).startswith("rank 0: allreduce #1: rank 1 "), error
    assert "cancelled allreduce #1 (by the test)" in str(error)
    assert any(
        "first noticed on this rank as: PeerFailedError" in note and "rank 2" in note
        for note in error.__notes__
    ), error.__notes__


async def test_a_failed_memory_read_tells_a_dead_peer_from_one_that_gave_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A cross-memory read of a peer's array fails when the peer is gone (ESRCH) or freed it
    (EFAULT). The read's link then tells why: rank 2 closed without a word, so the error is
    marked as a clean close (its rank may tell the others at once, see the first test), at
    once; rank 1 said it was cancelled before it closed, so that is what the read raises."""
    spec = OpSpec(Kind.ALLREDUCE, 1)
    gone = OSError(errno.ESRCH, os.strerror(errno.ESRCH))
    async with open_local_world(3) as comms:
        await _rank_1_tells_rank_0_it_was_cancelled(comms[1])
        await _vanish(comms[1])
        await _vanish(comms[2])
        links = comms[0]._links
        start = trio.current_time()
        with trio.fail_after(10):
            error = await links[2].explained(spec, links[2].memory_failed(spec, gone))
        assert trio.current_time() - start < _PENDING_ABORT_SECONDS
        assert isinstance(error, trioring.PeerFailedError), error
        assert error.peer == 2, error
        assert error._trioring_clean_close, error
        assert "could not read the memory of peer rank 2 (No such process" in str(error)
        with trio.fail_after(10), pytest.raises(trioring.PeerAbortedError) as info:
            await links[1].explained(spec, links[1].memory_failed(spec, gone))
    assert info.value.peer == 1, info.value
    assert "cancelled allreduce #1 (by the test)" in str(info.value)


async def test_a_look_that_a_sibling_failure_cancels_still_finds_the_abort(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rank 0's cross-memory read from rank 1 failed (a failed send looks the same way),
    and its look on that link has read the header of rank 1's abort frame (the reason is
    still on its way) when the task beside it fails (another peer's connection ended) and
    their nursery cancels this one. The look finishes the frame first (shielded, within its
    grace), so the abort is what the task raises, and what the collective reports, instead
    of the echo. Before, the cancelled look had consumed the header, and the communicator's
    look for the cause found nothing left there (the chaos trials, seed 1177: a send)."""
    spec = OpSpec(Kind.ALLREDUCE, 1)
    gone = OSError(errno.ESRCH, os.strerror(errno.ESRCH))
    header, reason = pack_abort_frame(
        AbortKind.CANCELLED, 1, 1, "cancelled allreduce #1 (by the test)", 1
    )
    async with open_local_world(3) as comms:
        link = comms[0]._links[1]
        told = comms[1]._links[0].connection
        raised: list[BaseException] = []

        async def send_task(sibling_failed: trio.CancelScope) -> None:
            with sibling_failed:
                try:
                    raise await link.explained(spec, link.memory_failed(spec, gone))
                except trioring.TrioringError as exc:
                    raised.append(exc)

        with trio.fail_after(10):
            await told.send_all(header)
            sibling_failed = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_task, sibling_failed)
                await trio.testing.wait_all_tasks_blocked()  # the look waits for the reason
                sibling_failed.cancel()
                await told.send_all(reason)
    assert len(raised) == 1, raised
    assert isinstance(raised[0], trioring.PeerAbortedError), raised[0]
    assert raised[0].peer == 1, raised[0]
    assert "cancelled allreduce #1 (by the test)" in str(raised[0])


async def test_a_neighbour_gone_mid_frame_points_at_the_peer_that_died(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rank 2 died (its connections ended between two frames, without a word); rank 1 gave
    up because of it in the middle of a frame to rank 0, so it could say nothing there.
    Rank 0's receive from rank 1 fails mid-payload, and nothing on any link explains it:
    the look for the cause names rank 2, which died, rather than the echo (rank 1; the
    call keeps it as a note). Before, it named rank 1 (the chaos trials, seed 2537: a rank
    killed in a reduce_scatter at world 4)."""
    spec = OpSpec(Kind.ALLREDUCE, 1, dtype_code=1, count=64, op_code=1)
    async with open_local_world(3) as comms:
        await _vanish(comms[2])
        sender = comms[1]._links[0]
        views = sender.start_send(spec, 0, memoryview(bytes(256)))
        assert views is not None  # an in-memory stream takes nothing at once
        await sender.connection.send_all(bytes(views[0]) + bytes(views[1][:100]))
        await trio.aclose_forcefully(sender.connection)
        with trio.fail_after(10), pytest.raises(trioring.PeerFailedError) as info:
            await comms[0]._links[1].recv(spec, 0, memoryview(bytearray(256)))
        echo = info.value
        assert echo.peer == 1, echo
        assert "after 100 of 256 bytes of a payload" in str(echo), echo
        with trio.fail_after(10):
            cause = await comms[0]._relayed_cause(echo, spec)
    assert isinstance(cause, trioring.PeerFailedError), cause
    assert cause.peer == 2, cause
    assert "connection to peer rank 2 was closed by the peer after 0 of" in str(cause)


async def _fail_in_tasks(count: int) -> None:
    """Raise a RuntimeError from each of ``count`` tasks of a nursery, beside a task that
    their failure cancels: the nursery raises them in an exception group. (Each raises as
    soon as it runs, so no failure cancels another; their order varies, their text not.)"""

    async def fail() -> None:
        raise RuntimeError("bad batch on rank 1")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        for _ in range(count):
            nursery.start_soon(fail)


@pytest.mark.parametrize("waiting_in", ["allreduce", "recv"])
@pytest.mark.parametrize("how", ["raise", "interrupt", "cancel", "group", "group of 2"])
async def test_a_rank_that_leaves_on_an_exception_says_why(how: str, waiting_in: str) -> None:
    """An exception (or a cancellation) leaves rank 1's ``async with comm.dup()`` block
    while ranks 0 and 2 wait for it on the duplicate, in an allreduce or in a receive from
    it: they raise PeerAbortedError (in the allreduce) or PeerFailedError (in the receive,
    from the point-to-point plane's LEFT frame) naming rank 1 and what made it leave, not a
    bare closed connection; for a nursery's exception group, the failure in it. The
    communicator the duplicate was made from is untouched."""
    errors: dict[int, BaseException] = {}
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            try:
                with trio.CancelScope() as scope:
                    async with comm.dup() as side:
                        if comm.rank == 1:
                            if how == "raise":
                                raise RuntimeError("bad batch on rank 1")
                            if how == "interrupt":
                                raise KeyboardInterrupt
                            if how.startswith("group"):
                                await _fail_in_tasks(2 if how == "group of 2" else 1)
                            scope.cancel()
                            await trio.sleep_forever()
                        if waiting_in == "recv":
                            await side.recv(source=1, tag=3)
                        else:
                            await side.allreduce(np.ones(4, np.float32))
            except (Exception, KeyboardInterrupt) as exc:
                errors[comm.rank] = exc

        sums: dict[int, np.ndarray] = {}

        async def world_allreduce(comm: trioring.Communicator) -> None:
            sums[comm.rank] = x = np.ones(4, np.float32)
            await comm.allreduce(x)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(rank_main, comm)
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(world_allreduce, comm)
    assert sorted(sums) == [0, 1, 2]
    for total in sums.values():
        np.testing.assert_array_equal(total, np.full(4, 3, np.float32))
    if how == "raise":
        assert isinstance(errors.pop(1), RuntimeError)
        why = "on RuntimeError: bad batch on rank 1"
    elif how == "group":
        assert isinstance(errors.pop(1), ExceptionGroup)
        why = "on RuntimeError: bad batch on rank 1 (in an exception group)"
    elif how == "group of 2":
        assert isinstance(errors.pop(1), ExceptionGroup)
        why = "on RuntimeError: bad batch on rank 1 (the first of 2 in an exception group)"
    elif how == "interrupt":
        assert isinstance(errors.pop(1), KeyboardInterrupt)
        why = "on KeyboardInterrupt"  # an exception without text: its name alone
    else:
        assert 1 not in errors
        why = "cancelled (by its caller's deadline or cancel scope)"
    assert sorted(errors) == [0, 2], errors
    for rank, error in errors.items():
        assert isinstance(error, trioring.CollectiveError), error
        assert (error.rank, error.peer) == (rank, 1), error
        # (An in-process world has no job id to end the message.)
        if waiting_in == "allreduce":
            assert isinstance(error, trioring.PeerAbortedError), error
            text = str(error)
            # (Or "... collective #1 (relayed by rank 0): ...", where rank 0 told it first.)
            assert text.startswith(f"rank {rank}: allreduce #1: rank 1 aborted collective #1")
            assert text.endswith(f"it left its communicator {why}"), error
            continue
        assert isinstance(error, trioring.PeerFailedError), error
        if how == "cancel":
            why = "on a cancellation (by its caller's deadline or cancel scope)"
        assert str(error) == (
            f"rank {rank}: recv(source=1, tag=3) on dup #1 of world: rank 1 left this "
            f"communicator {why}; nothing more comes from it, and it receives nothing more"
        ), error
        assert echoed_ranks(error) == frozenset({1})


async def test_point_to_point_errors_in_a_split_map_to_world_ranks() -> None:
    """In a split of ranks 0 and 2, rank 0 waits for a message from the split's rank 1 (world
    rank 2), which closes the split instead: the error names the split's rank 1, and says
    which world rank that is, in its text and for ``trioring run`` (echoed_ranks)."""
    caught: list[trioring.PeerFailedError] = []
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            async with comm.split(color=comm.rank % 2) as half:
                assert half is not None
                if comm.rank == 0:
                    with pytest.raises(trioring.PeerFailedError) as info:
                        await half.recv(source=1)
                    caught.append(info.value)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(rank_main, comm)
    (error,) = caught
    assert error.rank == 0
    assert error.peer == 1
    assert "rank 1 closed this communicator" in str(error), error
    assert echoed_ranks(error) == frozenset({2})


async def test_a_receive_that_waits_in_vain_names_what_came_instead() -> None:
    """Rank 0 sends small messages with tags 1 and 5, then closes the communicator; rank 1
    waits for tag 2 (the usual bug: a wrong tag). Its error names the messages from rank 0
    that no receive took, by tag."""
    caught: list[trioring.PeerFailedError] = []
    async with open_local_world(2) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            async with comm.dup() as twin:
                if comm.rank == 0:
                    for tag in (5, 1, 5):
                        await twin.send(np.ones(2), dest=1, tag=tag)
                    return
                with pytest.raises(trioring.PeerFailedError) as info:
                    await twin.recv(source=0, tag=2)
                caught.append(info.value)

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    (error,) = caught
    assert error.peer == 0
    assert str(error).startswith(
        "rank 1: recv(source=0, tag=2) on dup #1 of world: rank 0 closed this communicator: "
        "nothing more comes from it, and it receives nothing more; of what it sent, this rank "
        "has not received 3 messages, with tags 1 (1), 5 (2)"
    ), error


async def test_a_rank_that_left_because_another_failed_passes_the_blame_on() -> None:
    """World ranks 1 and 2 share a split; rank 2 vanishes from it, so rank 1's barrier there
    raises PeerFailedError naming it, which leaves rank 1's blocks. Rank 0, waiting on the
    world's duplicate for a message from rank 1, hears that rank 1 left because of rank 2:
    the error's ``peer`` is rank 2, as ``trioring run`` and a relayed collective error say.
    Rank 2, alive and waiting there too, hears that rank 1 left because of it: the blame
    stays with rank 1, the rank that left."""
    caught: dict[int, trioring.PeerFailedError] = {}
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            raises = pytest.raises(trioring.PeerFailedError)
            with raises if comm.rank == 1 else contextlib.nullcontext():
                async with comm.dup() as side, comm.split(color=min(comm.rank, 1)) as pair:
                    if comm.rank == 1:
                        await pair.barrier()
                        return
                    if comm.rank == 2:
                        await _vanish(pair)
                    with pytest.raises(trioring.PeerFailedError) as info:
                        await side.recv(source=1)
                    caught[comm.rank] = info.value

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    for rank, blamed in [(0, 2), (2, 1)]:
        error = caught[rank]
        assert (error.rank, error.peer) == (rank, blamed), error
        assert echoed_ranks(error) == frozenset({blamed})
        text = str(error)
        because = "because of rank 2" if rank == 0 else "because of this rank"
        assert text.startswith(
            f"rank {rank}: recv(source=1, tag=0) on dup #1 of world: rank 1 left this "
            f"communicator {because}, on PeerFailedError: rank 0: barrier #1: "
        ), text
        # The barrier's ranks were the split's: its rank 0 is world rank 1, its rank 1 world 2.
        assert "as world ranks: 0->1, 1->2]" in text, text
        from_ = "rank 1" if rank == 0 else "it"
        assert text.endswith(f"; nothing more comes from {from_}, and it receives nothing more")


@pytest.mark.parametrize("failing", [1, 2, 3])
async def test_a_receive_from_any_rank_names_the_one_that_left_on_an_error(failing: int) -> None:
    """Rank 0 waits for a message from any rank of a duplicate; the others leave it, one on
    an error, the others closing it, in no set order. Once every other rank has left, the
    receive raises naming the one that left on an error (a server whose workers stop wants
    the failure, not the last close), with the reason and that rank as ``peer``."""
    caught: list[trioring.PeerFailedError] = []
    async with open_local_world(4) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            with contextlib.suppress(RuntimeError):
                async with comm.dup() as side:
                    if comm.rank == failing:
                        raise RuntimeError(f"NaN on rank {failing}")
                    if comm.rank == 0:
                        with pytest.raises(trioring.PeerFailedError) as info:
                            await side.recv_any(tag=1)
                        caught.append(info.value)

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    (error,) = caught
    assert (error.rank, error.peer) == (0, failing), error
    assert str(error) == (
        "rank 0: recv_any(tag=1) on dup #1 of world: every other rank has left this "
        f"communicator; rank {failing} left this communicator on RuntimeError: NaN on rank "
        f"{failing}; nothing more comes from it, and it receives nothing more"
    ), error


async def test_a_receive_from_a_rank_whose_collective_broke_the_communicator_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rank 0's allreduce on a duplicate hits its deadline (rank 1 never calls it: it waits
    for a message from rank 0 there instead), which breaks the duplicate on rank 0; when rank
    0 leaves the block, rank 1's receive raises, saying which collective broke and how."""
    caught: list[trioring.PeerFailedError] = []
    async with open_local_world(2) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            async with comm.dup() as side:
                if comm.rank == 0:
                    with trio.move_on_after(2.5):
                        await side.allreduce(np.ones(4))
                    assert side.broken
                else:
                    with pytest.raises(trioring.PeerFailedError) as info:
                        await side.recv(source=0, tag=1)
                    caught.append(info.value)

        with trio.fail_after(10):
            await on_every_rank(comms, rank_main)
    (error,) = caught
    assert (error.rank, error.peer) == (1, 0), error
    assert str(error) == (
        "rank 1: recv(source=0, tag=1) on dup #1 of world: rank 0 left this communicator when "
        "allreduce #1 was cancelled there after 2.5 s while waiting for rank 1; nothing more "
        "comes from it, and it receives nothing more"
    ), error


async def test_a_collective_cancelled_by_a_failure_beside_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 0's allreduce runs in a nursery beside a task that raises once every task is
    blocked (rank 0 waiting for ranks 1 and 2, which have not called yet): Trio cancels the
    allreduce. Its warning, and the error of every peer's allreduce, say that it was that
    failure, not a deadline, that cancelled it."""
    errors: dict[int, BaseException] = {}
    failed = trio.Event()
    async with open_local_world(3) as comms:

        async def rank_main(comm: trioring.Communicator) -> None:
            x = np.ones(4)
            try:
                async with comm.dup() as side:
                    if comm.rank == 0:
                        try:
                            async with trio.open_nursery() as nursery:
                                nursery.start_soon(side.allreduce, x)
                                await trio.testing.wait_all_tasks_blocked()
                                raise ValueError("bad batch")
                        finally:
                            failed.set()
                    await failed.wait()
                    await side.allreduce(x)
            except Exception as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10), caplog.at_level(logging.WARNING, logger="trioring"):
            await on_every_rank(comms, rank_main)
    cause = ", when code beside it raised ValueError('bad batch')"
    (warning,) = [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
    assert warning.startswith("rank 0: allreduce #1 cancelled after "), warning
    assert f"{cause}; ranks above are those of dup #1 of world" in warning, warning
    assert isinstance(errors.pop(0), ExceptionGroup)
    for rank, error in errors.items():
        assert isinstance(error, trioring.PeerAbortedError), error
        assert error.peer == 0, error
        assert str(error).startswith(f"rank {rank}: allreduce #1: rank 0 cancelled allreduce #1 ")
        assert str(error).endswith(cause), error
