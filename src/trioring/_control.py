"""The control channel: every rank's rendezvous connection to rank 0 stays open until the
whole world has formed, so that a failure anywhere in the set-up reaches every rank at once.

::

    rank r -> rank 0   HELLO {...}           (the rendezvous, see _rendezvous)
    rank 0 -> rank r   TABLE {...} | REFUSE {message} | ABORT {rank, message}
    rank r -> rank 0   READY {}              its mesh and capability agreement are done
                       FAILED {message, peer} it gave up (its own error, or cancelled);
                                             ``peer``: the rank its error involves, or null
    rank 0 -> rank r   GO {}                 every rank (rank 0 too) is READY
                       ABORT {rank, message} rank ``rank`` failed or left; ``message`` says how

Rank 0 reads every rank's channel from its HELLO on; a channel that closes before GO (the
rank exited or was killed) counts as FAILED. The first failure wins: rank 0 sends ABORT
naming it to every rank, before it tears down anything of its own, and raises it itself.
(A FAILED that involves another rank waits up to SUSPECT_GRACE_SECONDS for that rank's own
report, which then comes first.) Every other rank watches its channel while it builds its
share of the mesh, so an ABORT interrupts it at once; a rank that failed itself sends FAILED
and waits for the verdict, and raises the ABORT's failure if another rank's came first
(its own is the cause then), else its own. When rank 0 itself fails it sends ABORT naming
itself; when it dies, every channel closes and the ranks raise "rank 0 left during set-up". A rank that gives up after GO was sent (or dies right after
its READY) is noticed by its peers' first collective instead, as any later failure is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, final

import trio

from ._concurrency import is_cancellation, run_with_grace
from ._errors import RendezvousError, TrioringError
from ._setup import (
    ABORT,
    FAILED,
    GO,
    MAX_TABLE_BODY,
    READY,
    REFUSE,
    TABLE,
    BadMessage,
    ConnectionLost,
    clip,
    field,
    job_id,
    read_message,
    send_message,
    without_rank_prefix,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._config import Config
    from .transports import Connection

__all__ = ["NOTICE_SECONDS", "Coordinator", "Follower"]

#: How long a rank that gives up spends telling rank 0 why, and rank 0 telling the others,
#: before closing anyway (an internal deadline, like the handshake's: a peer that does not
#: read cannot hold a failing rank).
NOTICE_SECONDS = 0.5
#: When a rank reports a failure involving another rank (its connection to it broke, say),
#: rank 0 waits this long for that rank's own report before blaming the reporter: the
#: reporter's failure is often only the echo of the other's, which then arrives a moment
#: later (a rank that fails tears its connections down before it has told rank 0).
SUSPECT_GRACE_SECONDS = 0.5
#: How long a failed rank waits for rank 0's verdict (ABORT naming the first failure).
VERDICT_SECONDS = NOTICE_SECONDS + SUSPECT_GRACE_SECONDS + 1.0


def _error(config: Config, message: str, peer: int | None) -> RendezvousError:
    return RendezvousError(
        f"rank {config.rank}: {message}",
        rank=config.rank,
        peer=peer,
        collective="rendezvous",
        job_id=job_id(config),
    )


async def _tell(connection: Connection, kind: int, body: dict[str, Any]) -> None:
    """Send, if the peer is still there (best effort: it may have gone already)."""
    with contextlib.suppress(BadMessage, trio.ClosedResourceError):
        await send_message(connection, kind, body)


def _describe(exc: BaseException, rank: int) -> str:
    """What went wrong, for another rank's eyes: the errors inside a group (not its
    generic "Exceptions from Trio nursery"), without the cancellations it caused."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return "; ".join(_describe(inner, rank) for inner in (rest.exceptions if rest else ()))
    if isinstance(exc, TrioringError):
        return without_rank_prefix(exc._bare_message, rank)
    return f"{type(exc).__name__}: {exc}"


def _about_another_peer(exc: Exception) -> bool:
    """Whether ``exc`` is this rank's set-up error about its connection with a rank other
    than rank 0."""
    return isinstance(exc, RendezvousError) and exc.peer not in (None, 0)


class _Failure(Exception):
    """Inside the coordinator: rank ``subject`` failed, and ``reason`` says how."""

    def __init__(self, subject: int, reason: str) -> None:
        super().__init__(reason)
        self.subject = subject
        self.reason = reason


@final
class Coordinator:
    """Rank 0's side: watches every rank's channel while :meth:`run` builds rank 0's share,
    then sends GO, or ABORT on the first failure anywhere."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._controls: dict[int, Connection] = {}
        self._ready: set[int] = set()
        self._all_ready = trio.Event()
        self._nursery: trio.Nursery | None = None
        # (error rank 0 raises, the rank that failed, how) in the order they happened.
        self._failures: list[tuple[TrioringError, int, str]] = []
        self._refused = False  # REFUSE went out: the ranks know, and their EOFs are expected
        self._aborted = False  # ABORT went out
        self._settled = False  # every rank is READY: GO goes out whatever happens now
        self._table_sent = False
        self._started = trio.current_time()
        self._reported: dict[int, trio.Event] = {}  # set once that rank failed or left

    def _report_of(self, rank: int) -> trio.Event:
        return self._reported.setdefault(rank, trio.Event())

    @property
    def failing(self) -> bool:
        """Whether a failure somewhere (not the caller's scope) is ending the set-up."""
        return bool(self._failures)

    def join(self, rank: int, connection: Connection) -> None:
        """Rank ``rank`` said hello on ``connection``: watch it from now on."""
        assert self._nursery is not None, "join() outside run()"
        self._controls[rank] = connection
        if self._aborted:
            return  # it is closed with the others, and learns that the rendezvous failed
        self._nursery.start_soon(self._guard, self._watch, rank, connection)

    async def send_table(self, session: str, addresses: list[str]) -> None:
        body = {"session": session, "addresses": addresses}
        for rank, connection in self._controls.items():
            try:
                await send_message(connection, TABLE, body)
            except ConnectionLost as exc:
                raise _Failure(rank, f"rank {rank} left during the rendezvous ({exc})") from exc
        self._table_sent = True

    async def refuse(self, message: str, culprit: Connection) -> None:
        """The world is inconsistent: tell every rank that said hello, and ``culprit``."""
        self._refused = True
        body = {"message": clip(message)}
        with trio.CancelScope(shield=True):
            await run_with_grace(
                NOTICE_SECONDS,
                *(
                    functools.partial(_tell, connection, REFUSE, body)
                    for connection in [culprit, *self._controls.values()]
                ),
            )
        await trio.aclose_forcefully(culprit)

    async def run(self, share: Callable[[], Awaitable[None]]) -> None:
        """Run ``share`` (rank 0's rendezvous, mesh and agreement), then wait until every
        rank is READY and send GO. On the first failure anywhere, or cancellation, every
        rank still connected is sent ABORT naming who failed, and the failure is raised
        here: rank 0's own error as it is, another rank's as a RendezvousError naming it.
        Every control connection is closed on return."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._guard, self._share, share)
            if self._failures:
                first, *others = self._failures
                for other, _, _ in others[:4]:
                    first[0].add_note(f"also during set-up: {other}")
                raise first[0]
        except BaseException as exc:
            await self._abort(exc)
            raise
        else:
            async with trio.open_nursery() as nursery:
                for connection in self._controls.values():
                    nursery.start_soon(_tell, connection, GO, {})
        finally:
            self._nursery = None
            for connection in self._controls.values():
                await trio.aclose_forcefully(connection)

    async def _share(self, share: Callable[[], Awaitable[None]]) -> None:
        await share()
        await self._all_ready.wait()
        self._settled = True
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel(reason="every rank is ready")  # stops the watchers

    async def _guard(self, function: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Record the first failures and stop everything else; a cancellation or any other
        exception propagates (in the nursery's group)."""
        try:
            await function(*args)
        except _Failure as failure:
            error = _error(self._config, f"set-up aborted: {failure.reason}", failure.subject)
            await self._record(error, failure.subject, failure.reason)
        except TrioringError as exc:
            about = getattr(exc, "peer", None)
            if type(about) is int and about != 0 and about in self._controls:
                # Rank 0's own failure may only echo that rank's (its connection broke
                # because that rank gave up): wait for its report as for any rank's. If it
                # comes, it is the first failure, and this wait is cancelled.
                with trio.move_on_after(SUSPECT_GRACE_SECONDS):
                    await self._report_of(about).wait()
            reason = f"rank 0 failed: {without_rank_prefix(exc._bare_message, 0)}"
            await self._record(exc, 0, reason)

    async def _record(self, error: TrioringError, subject: int, reason: str) -> None:
        self._failures.append((error, subject, reason))
        if len(self._failures) == 1:
            # Before anything of ours is torn down, so that the ranks hear the cause before
            # they see its consequences (our connections closing).
            await self._send_abort(subject, reason)
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel(reason="the set-up failed")

    async def _send_abort(self, subject: int, reason: str) -> None:
        """ABORT to every rank, ``subject`` too (it waits for the verdict after FAILED)."""
        if self._refused or self._aborted:
            return
        self._aborted = True
        body = {"rank": subject, "message": clip(reason)}
        with trio.CancelScope(shield=True):
            await run_with_grace(
                NOTICE_SECONDS,
                *(
                    functools.partial(_tell, connection, ABORT, body)
                    for connection in self._controls.values()
                ),
            )

    async def _watch(self, rank: int, connection: Connection) -> None:
        """Read rank ``rank``'s channel until GO: READY, or FAILED / a close (a failure)."""
        while True:
            try:
                kind, body = await read_message(connection, {READY, FAILED})
                message = field(body, "message", str) if kind == FAILED else ""
            except BadMessage as exc:
                if self._refused or self._settled:
                    return
                self._report_of(rank).set()
                if isinstance(exc, ConnectionLost):
                    raise _Failure(
                        rank,
                        f"rank {rank} left during set-up (its connection to rank 0: {exc}; "
                        "the process exited or was killed?)",
                    ) from exc
                raise _Failure(rank, f"rank {rank} broke the set-up protocol: {exc}") from exc
            if kind == FAILED:
                if self._refused or self._settled:
                    return
                self._report_of(rank).set()
                if not message.startswith(f"rank {rank} "):
                    message = f"rank {rank} failed: {message}"
                about = body.get("peer")
                if type(about) is int and about in self._controls and about != rank:
                    # If that rank's own report comes meanwhile, it is the first failure,
                    # and this watch is cancelled.
                    with trio.move_on_after(SUSPECT_GRACE_SECONDS):
                        await self._report_of(about).wait()
                raise _Failure(rank, clip(message))
            self._ready.add(rank)
            if len(self._ready) == self._config.world_size - 1:
                self._all_ready.set()

    async def _abort(self, exc: BaseException) -> None:
        if self._failures:
            _, subject, reason = self._failures[0]
        elif is_cancellation(exc):
            subject = 0
            reason = (
                f"rank 0 gave up after {trio.current_time() - self._started:.1f} s: cancelled "
                "(by its caller's deadline or cancel scope)"
            )
            missing = sorted(set(range(1, self._config.world_size)) - self._controls.keys())
            if missing and not self._table_sent:
                reason += f"; ranks {', '.join(map(str, missing))} never joined"
        else:
            subject, reason = 0, f"rank 0 failed: {_describe(exc, 0)}"
        await self._send_abort(subject, reason)


@final
class Follower:
    """The side of every rank but 0: reads rank 0's answer to its HELLO, watches the channel
    for ABORT while :meth:`run` builds this rank's share, and reports its own failure."""

    def __init__(self, config: Config, connection: Connection) -> None:
        self.connection = connection
        #: Our HELLO went out: rank 0 watches this connection from then on.
        self.joined = False
        self._config = config
        self._told = False  # rank 0 knows already (it told us), or the channel is gone
        self._reported = False  # we sent FAILED
        self._started = trio.current_time()

    async def receive_table(self) -> tuple[str, list[str]]:
        """Rank 0's answer to our HELLO: the session and every rank's address."""
        try:
            kind, body = await read_message(self.connection, {TABLE, REFUSE, ABORT}, MAX_TABLE_BODY)
            if kind == TABLE:
                session: str = field(body, "session", str)
                addresses: list[Any] = field(body, "addresses", list)
            else:
                message: str = field(body, "message", str)
                subject = body.get("rank", 0) if kind == ABORT else 0
        except BadMessage as exc:
            self._told = True
            raise _error(self._config, f"rendezvous with rank 0 failed: {exc}", 0) from exc
        if kind == REFUSE:
            self._told = True
            raise _error(self._config, f"rank 0 refused the world: {message}", 0)
        if kind == ABORT:
            self._told = True
            peer = subject if isinstance(subject, int) and not isinstance(subject, bool) else 0
            raise _error(self._config, f"rendezvous with rank 0 failed: {message}", peer)
        if len(addresses) != self._config.world_size or not all(
            isinstance(a, str) for a in addresses
        ):
            raise _error(self._config, "rank 0 sent an address table of the wrong shape", 0)
        return session, addresses

    async def run(self, share: Callable[[], Awaitable[None]]) -> None:
        """Run ``share`` (this rank's mesh and agreement) and say READY, while watching for
        ABORT; return once rank 0 said GO.

        An ABORT interrupts ``share`` and is raised. If ``share`` fails first, rank 0 is told
        (FAILED) and its verdict awaited (up to :data:`VERDICT_SECONDS`): if another rank
        failed first, as our own failure is often only its echo (a connection it closed),
        that is raised, from ours; if rank 0 left without a verdict (it died), that it left
        is raised, from ours, unless ours is about rank 0 or this rank alone; otherwise ours
        is."""
        rank = self._config.rank
        own: list[Exception] = []
        # What rank 0 said: nothing yet; GO (None); ABORT (its error, True); or it left
        # (that error, False).
        verdict: list[tuple[RendezvousError, bool] | None] = []
        heard = trio.Event()

        async with trio.open_nursery() as nursery:

            async def work() -> None:
                try:
                    await share()
                except Exception as exc:
                    own.append(exc)
                    await self.report(exc)
                    with trio.move_on_after(VERDICT_SECONDS):
                        await heard.wait()
                    nursery.cancel_scope.cancel(reason="this rank failed")
                    return
                # If rank 0 is gone, the watch says so.
                with contextlib.suppress(BadMessage):
                    await send_message(self.connection, READY, {})

            async def watch() -> None:
                try:
                    kind, body = await read_message(self.connection, {GO, ABORT})
                    if kind == ABORT:
                        message: str = field(body, "message", str)
                        subject: int = field(body, "rank", int)
                except BadMessage as exc:
                    verdict.append((self._rank0_left(exc), False))
                else:
                    if kind == ABORT:
                        self._told = True
                        error = _error(self._config, f"set-up aborted: {message}", subject)
                        verdict.append((error, True))
                    else:
                        verdict.append(None)
                heard.set()
                if verdict[0] is not None:
                    nursery.cancel_scope.cancel(reason="the set-up was aborted")

            nursery.start_soon(work)
            nursery.start_soon(watch)

        final = verdict[0] if verdict else None
        if own:
            # Unless another rank's failure came first, ours says most; and when rank 0 is
            # gone without a verdict, ours says most only if it is about rank 0 or this rank
            # alone. A failure with another peer is then most likely that peer's echo of rank
            # 0's death (it gave up and closed its connections while we shook hands with it:
            # "connection reset by rank 2" where rank 0 was killed), and a rank 0 that died
            # is a failure of its own in any case.
            if (
                final is not None
                and final[0].peer != rank
                and (final[1] or _about_another_peer(own[0]))
            ):
                raise final[0] from own[0]
            raise own[0]
        if final is not None:
            raise final[0]

    def _rank0_left(self, exc: BadMessage) -> RendezvousError:
        self._told = True
        if isinstance(exc, ConnectionLost):
            return _error(self._config, f"rank 0 left during set-up ({exc})", 0)
        return _error(self._config, f"rank 0 broke the set-up protocol: {exc}", 0)

    async def report(self, exc: BaseException) -> None:
        """Tell rank 0 why this rank gives up (it tells everyone), unless it cannot hear us
        yet or knows already. Best effort, within :data:`NOTICE_SECONDS`."""
        if not self.joined or self._told or self._reported:
            return
        self._reported = True
        rank = self._config.rank
        peer = exc.peer if isinstance(exc, TrioringError) else None
        if is_cancellation(exc):
            message = (
                f"rank {rank} gave up after {trio.current_time() - self._started:.1f} s: "
                "cancelled (by its caller's deadline or cancel scope)"
            )
        else:
            message = f"rank {rank} failed: {_describe(exc, rank)}"
        body = {"message": clip(message), "peer": peer}
        with trio.CancelScope(shield=True):
            await run_with_grace(
                NOTICE_SECONDS, functools.partial(_tell, self.connection, FAILED, body)
            )
