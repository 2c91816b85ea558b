"""Waiting point-to-point calls that poll: before a receive or a rendezvous send parks, it
looks at its peers' sockets itself and takes the whole frames waiting there, as the reader
would (:meth:`Polling._poll`); see _endpoint.py for the protocol."""

from __future__ import annotations

import functools
import math
import os
import time
from typing import TYPE_CHECKING

import trio

from .._errors import ProtocolError
from .._framing import SPIN_SLICE_SECONDS
from ._frames import DIM, HEADER, Frame, FrameType, decode_header, decode_shape
from ._peer import READ_WHOLE_BYTES, Peer
from ._reading import Reading, body_bytes

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..transports._socket import SocketConnection

__all__ = ["POLL_SECONDS", "Polling"]

#: Where polling is on (the spin feature), a receive or a rendezvous send polls at least
#: this long before it parks, as a wait on the shared segment does
#: (_shm_collectives.SHM_SPIN_SECONDS): a peer that runs Python between two messages
#: answers later than the 50 us of a collective's poll (DEFAULT_SPIN_US), and a wait that
#: parks is woken through the event loop and the reader. Ping-pong at world 2 on 2 vCPUs,
#: one way, polling this long against 50 us (bench/p2p.py, three launches each): 8 bytes
#: 122-131 us against 181-199, 64 KiB 179-185 against 218-235. The cost where ranks
#: outnumber cores: a ring of 1 MiB eager messages at world 3 took 2479-2634 us per step
#: against 2304-2377 (8 bytes: 395-413 against 428-623); 1 MiB now goes by cross-memory
#: attach there (CMA_EAGER_BYTES), 1.7-1.8 ms.
POLL_SECONDS = 0.001
#: A poll asks Trio whether other tasks wait to run every this many looks, not at each: the
#: question (5.4 us here) costs more than a look (a peek at a socket, 2.9 us, and a yield of
#: the CPU, 0.5 us). After a look that took frames (which may have woken tasks) it asks at
#: once, but passes through the scheduler only if tasks wait: where a CREDIT frame comes
#: just before a large message, a pass after it let the reader, woken by the message's first
#: bytes, read half of the 256 KiB messages of a ping-pong (and chase their writer), 160-170
#: us one way at world 2 on 2 vCPUs against 106-112 with the poll taking them all
#: (bench/p2p.py).
_LOOKS_PER_QUEUE_CHECK = 4
#: What a look at a socket copies first (MSG_PEEK copies): enough for a burst of small
#: frames, where copying the whole buffer each time would cost a waiting receive 10-20 us
#: per look when a large message fills the socket.
_PEEK_FIRST_BYTES = 4096


def _read_exactly(connection: SocketConnection, target: memoryview) -> None:
    """Read ``target``'s size from ``connection``, where that many bytes wait already."""
    position = 0
    while position < target.nbytes:
        got = connection.recv_nowait(target[position:])
        if not got:  # cannot happen: the bytes were there, and only we read them
            raise trio.BrokenResourceError(f"read {position} of {target.nbytes} bytes seen waiting")
        position += got


class Polling(Reading):
    """The polling of the engine's waits (the sends, in _sending.py, and the receives, in
    _endpoint.py, build on it)."""

    async def _poll(self, worlds: Sequence[int], moved: Callable[[], bool]) -> bool:
        """Before a receive or a send parks: look for frames from the peers ``worlds``
        (world ranks) until ``moved()``: as a collective's receive does, for a peer on
        another core often answers within microseconds, where parking would add the
        operating system's wake-up of an idle process and passes through the scheduler for
        the reader and then the waiting task. Each look takes the frames waiting on the
        sockets itself (:meth:`_take_waiting`) and yields the CPU; the first pass through the
        scheduler (the schedule point the call owes) comes right after the first look, while
        the peer is still busy, and the reader and the other tasks of this program run at the
        next ones, as soon as one has work and at least every ``SPIN_SLICE_SECONDS``. Polls
        for ``spin_seconds`` (at least ``POLL_SECONDS``); looks once where polling is off;
        stops at once where a peer's reader must go on (inside a frame, at a DATA frame,
        at a large EAGER frame that stopped coming before it was whole), or where no peer
        can answer (a send to ourselves). The passes are shielded; a cancellation ends the
        poll at the next one, and the caller's wait takes it. Returns whether it passed
        through the scheduler."""
        peers = [peer for world in worlds if (peer := self._peers.get(world)) is not None]
        passed = False
        start = time.perf_counter()
        deadline = start + (self._spin_seconds and max(self._spin_seconds, POLL_SECONDS))
        slice_end = start + SPIN_SLICE_SECONDS
        statistics = trio.lowlevel.current_statistics
        looks = 0
        while True:
            # None: someone else must run (a reader; with no peer, a task of ours sending
            # to us); True: frames were taken.
            took: bool | None = False if peers else None
            for peer in peers:
                taken = self._take_waiting(peer)
                if taken is None:
                    took = None
                elif taken and took is False:
                    took = True
            if moved() or took is None:
                return passed
            now = time.perf_counter()
            if now >= deadline:
                return passed
            looks += 1
            if (
                not passed
                or now >= slice_end
                or ((took or not looks % _LOOKS_PER_QUEUE_CHECK) and statistics().tasks_runnable)
            ):
                await trio.lowlevel.cancel_shielded_checkpoint()
                passed = True
                if moved() or trio.current_effective_deadline() == -math.inf:
                    return True
                slice_end = time.perf_counter() + SPIN_SLICE_SECONDS
            else:
                os.sched_yield()

    def _take_waiting(self, peer: Peer) -> bool | None:
        """Take the whole frames that wait on ``peer``'s socket and handle them here, in the
        calling task, as the reader would have. For a call that polls: its message (or
        answer) is then handled without waking the reader and then the call, two passes
        through the scheduler of 10-20 us each here (with the poll of POLL_SECONDS, an
        8-byte message one way at world 2 on 2 vCPUs went from 174-198 us to 116-126,
        bench/p2p.py). Only while the reader is
        :attr:`~._peer.FrameReader.idle`, by a look at the socket that takes nothing
        (MSG_PEEK), then a read of exactly the whole frames seen, so that what the reader
        reads next is still the start of a frame; a large EAGER frame first in line goes to
        :meth:`_take_large`. Returns whether it took any; None when only the reader can go
        on (it is inside a frame, the next frame is DATA, the connection ended or failed),
        so the caller should let it run."""
        fast = peer.fast
        if fast is None or not fast.can_peek or not peer.reader.idle or peer.error is not None:
            return None
        window = self._peek_buffer.view
        limit = _PEEK_FIRST_BYTES
        try:
            while True:
                got = fast.peek_nowait(self._peek_buffer, limit)
                if not got:
                    return None if got == 0 else False  # 0: the end; the reader says so
                taken = 0
                frames: list[tuple[Frame, int, int]] = []
                short = False  # whether the last frame seen is cut off
                while got - taken >= HEADER.size:
                    frame = decode_header(window[taken : taken + HEADER.size])
                    size = body_bytes(frame)
                    if frame.type is FrameType.DATA or size > READ_WHOLE_BYTES:
                        if frames:
                            break  # taken at the next look
                        if frame.type is FrameType.EAGER:
                            return self._take_large(peer, frame, size)
                        return None
                    if got - taken - HEADER.size < size:
                        short = True  # the rest is on its way, or beyond this look
                        break
                    frames.append((frame, taken + HEADER.size, size))
                    taken += HEADER.size + size
                else:
                    short = got > taken
                if not short or got < limit or limit == len(window):
                    break
                limit = len(window)  # the rest may be there already: look at all of it
            if not frames:
                return False
            _read_exactly(fast, window[:taken])
            self.taken_by_waits += len(frames)
            for frame, at, size in frames:
                self._handle(peer, frame, window[at : at + size])
        except trio.ClosedResourceError:
            return None
        except (trio.BrokenResourceError, ProtocolError) as exc:
            self._reading_failed(peer, exc)  # which stops the reader (Engine._record_failure)
            return None
        return True

    def _take_large(self, peer: Peer, frame: Frame, size: int) -> bool | None:
        """For :meth:`_take_waiting`: take the large EAGER ``frame`` (``size`` bytes after
        its header) at the start of ``peer``'s socket once all of it waits there, its
        payload read straight into the ``out`` of the receive it arrives for where there is
        one (:meth:`_landing`): one copy, no wake-up of the reader and then the receive.
        Ping-pong at world 2 on 2 vCPUs, one way (bench/p2p.py): 128 KiB 89-99 us against
        138-142 read by the reader, 256 KiB 97-112 against 160-170 (Gloo: 146-168). False while
        the frame still streams in (the caller looks again); None when only the reader can
        go on: the socket stopped filling before the frame was whole (a TCP receive window
        smaller than the frame, a writer that waits for us)."""
        fast = peer.fast
        assert fast is not None
        waiting = fast.waiting_nowait()
        if waiting < HEADER.size + size:
            if waiting > peer.seen_waiting:
                peer.seen_waiting = waiting
                return False
            peer.seen_waiting = 0
            return None
        peer.seen_waiting = 0
        head = HEADER.size + DIM.size * frame.ndim
        window = self._peek_buffer.view
        _read_exactly(fast, window[:head])
        shape = decode_shape(window[HEADER.size : head], frame)
        self._eager(peer, frame, shape, functools.partial(_read_exactly, fast))
        self.taken_by_waits += 1
        return True
