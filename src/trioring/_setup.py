"""What every stage of the set-up (rendezvous, mesh, control; see :mod:`trioring._rendezvous`)
shares: the message format, and the admission of accepted connections.

Messages are ``"TRRV" | version u8 | type u8 | 2 pad | body length u32`` plus a JSON object
of bounded size; nothing is unpickled or evaluated.
"""

from __future__ import annotations

import errno
import json
import logging
import struct
from typing import TYPE_CHECKING, Any, TypeVar, final

import trio

from . import _auth
from ._concurrency import is_cancellation
from ._util import recv_exactly

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._config import Config
    from .transports import Connection

MAGIC = b"TRRV"
#: 2: the rendezvous connection stays open as the control channel (READY, GO, FAILED, ABORT).
VERSION = 2
HEADER = struct.Struct("<4sBBxxI")
HELLO, TABLE, REFUSE, MESH_HELLO, MESH_ACK = 1, 2, 3, 4, 5
READY, GO, FAILED, ABORT = 6, 7, 8, 9
#: A sub-communicator's connection, through the data listener (see _family).
GROUP_HELLO, GROUP_ACK = 10, 11
MAX_SMALL_BODY = 4096
MAX_TABLE_BODY = 16 * 1024 * 1024
#: Room for a reason in FAILED or ABORT, as JSON (well inside MAX_SMALL_BODY).
MAX_REASON_JSON = 2048

#: How long an accepted connection may take to authenticate and say who it is (see
#: :data:`trioring._auth.HANDSHAKE_SECONDS`).
HANDSHAKE_SECONDS = _auth.HANDSHAKE_SECONDS
#: ... at least, and this many seconds per rank of the world if that is more. A large world
#: on few cores (128 ranks on 2) starves the processes of CPU while they all connect: a
#: 128-rank set-up once saw a genuine rank's handshake pass 5 s, its connection dropped as a
#: stranger's, and the world fail. The limit only keeps idle strangers from holding a
#: listener's slots, and a flood is bounded by eviction anyway (MAX_PENDING_HANDSHAKES).
HANDSHAKE_SECONDS_PER_RANK = 0.25


def handshake_seconds(world_size: int) -> float:
    """How long an accepted connection of a world of ``world_size`` ranks may take to
    authenticate and say who it is."""
    return max(HANDSHAKE_SECONDS, HANDSHAKE_SECONDS_PER_RANK * world_size)


#: At most this many connections (or twice the world size, if more) may be in their handshake
#: at once on one listener; beyond that the oldest is dropped, so that a flood of idle
#: connections cannot exhaust file descriptors, and never a genuine rank.
MAX_PENDING_HANDSHAKES = 128
#: A failed authentication (a likely wrong ``TRIORING_SECRET``) is logged at WARNING at most
#: once per this many seconds per listener, with a count of those in between (at INFO).
AUTH_WARNING_INTERVAL_S = 10.0

logger = logging.getLogger("trioring")

_T = TypeVar("_T")


class BadMessage(Exception):
    """A peer sent something that is not the expected set-up message."""


class ConnectionLost(BadMessage):
    """The connection closed or broke before the message was complete."""


async def _recv_exactly(connection: Connection, size: int) -> bytearray:
    try:
        return await recv_exactly(connection, size)
    except trio.BrokenResourceError as exc:
        raise ConnectionLost(f"connection broke: {exc}") from exc
    except EOFError:
        raise ConnectionLost("connection closed before the message was complete") from None


async def send_message(connection: Connection, kind: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    try:
        await connection.send_all(HEADER.pack(MAGIC, VERSION, kind, len(payload)), payload)
    except trio.BrokenResourceError as exc:
        raise ConnectionLost(f"connection broke: {exc}") from exc


async def read_message(
    connection: Connection, expected: set[int], max_body: int = MAX_SMALL_BODY
) -> tuple[int, dict[str, Any]]:
    magic, version, kind, length = HEADER.unpack(await _recv_exactly(connection, HEADER.size))
    if magic != MAGIC:
        raise BadMessage(f"not a trioring rendezvous message (starts with {bytes(magic)!r})")
    if version != VERSION:
        raise BadMessage(f"protocol version {version}, this trioring speaks {VERSION}")
    if kind not in expected:
        raise BadMessage(f"unexpected message type {kind}")
    if length > max_body:
        raise BadMessage(f"message body of {length} bytes exceeds the limit of {max_body}")
    try:
        body = json.loads(await _recv_exactly(connection, length))
    except (ValueError, RecursionError) as exc:
        # RecursionError: JSON nested thousands of levels deep.
        raise BadMessage(f"malformed message body: {exc!r}"[:200]) from None
    if not isinstance(body, dict):
        raise BadMessage("malformed message body: not an object")
    return kind, body


def field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadMessage(f"field {name!r} is missing or not a {kind.__name__}")
    return value


def clip(text: str, limit: int = MAX_REASON_JSON) -> str:
    """``text``, shortened until it fits in ``limit`` bytes of JSON (escapes included)."""
    if len(json.dumps(text)) <= limit:
        return text
    while text and len(json.dumps(text + "...")) > limit:
        text = text[: len(text) - max(1, len(text) // 8)]
    return text + "..."


def without_rank_prefix(message: str, rank: int) -> str:
    """``message`` without a leading ``"rank N: "`` naming ``rank`` (errors start so)."""
    prefix = f"rank {rank}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def job_suffix(config: Config) -> str:
    return f" [job {config.credentials.job_id}]" if config.credentials.job_id else ""


def job_id(config: Config) -> str | None:
    return config.credentials.job_id or None


def connect_errno(exc: OSError) -> int | None:
    """The errno behind a failed connect. ``trio.open_tcp_stream`` raises an OSError without
    one, whose cause is the group of every attempt's error."""
    if exc.errno is not None:
        return exc.errno
    if isinstance(exc, ConnectionRefusedError):  # the memory transport's, without an errno
        return errno.ECONNREFUSED
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        for inner in cause.exceptions:
            if isinstance(inner, OSError) and inner.errno is not None:
                return inner.errno
    return None


def describe_connect_error(exc: OSError) -> str:
    """Why a connect failed, in the kernel's words (``"[Errno 111] Connection refused"``),
    also when ``trio.open_tcp_stream`` hid them in its cause."""
    cause = exc.__cause__
    if exc.errno is None and isinstance(cause, BaseExceptionGroup):
        inner = [str(e) for e in cause.exceptions if isinstance(e, OSError)]
        if inner:
            return "; ".join(inner)
    return str(exc)


@final
class Admission:
    """Runs the handshakes of accepted connections, at most
    ``max(MAX_PENDING_HANDSHAKES, 2 * world_size)`` at a time, and logs every connection it
    turns away.

    When the limit is reached, the *oldest* handshake in progress is dropped to make room: a
    genuine rank completes its handshake within milliseconds, so a flood of idle connections
    only ever evicts itself instead of locking the ranks out. The limit grows with the world
    so that the world's own ranks, all connecting at once, never evict each other.

    Rejections are logged at INFO (strangers are expected on an open port), except a peer
    that spoke this job's handshake but failed to authenticate: that is most likely a rank
    with a different ``TRIORING_SECRET``, which otherwise leaves every rank waiting in
    silence. It is logged at WARNING, rate-limited (see :data:`AUTH_WARNING_INTERVAL_S`).
    """

    def __init__(self, config: Config, where: str) -> None:
        self.rejected = 0
        self.last_reason: str | None = None
        self._config = config
        self._where = where
        self._limit = max(MAX_PENDING_HANDSHAKES, 2 * config.world_size)
        self._deadline = handshake_seconds(config.world_size)
        self._pending: dict[int, trio.CancelScope] = {}
        self._next = 0
        self._warned_at: float | None = None
        self._unwarned = 0

    def reject(self, reason: str, *, failed_proof: bool = False) -> None:
        self.rejected += 1
        self.last_reason = reason
        level, extra = logging.INFO, ""
        if failed_proof:
            now = trio.current_time()
            if self._warned_at is None or now - self._warned_at >= AUTH_WARNING_INTERVAL_S:
                level = logging.WARNING
                if self._unwarned:
                    extra = f" (and {self._unwarned} more like it since the last warning)"
                self._warned_at, self._unwarned = now, 0
            else:
                self._unwarned += 1
        logger.log(
            level,
            "rank %d: rejected a connection during the %s: %s%s%s",
            self._config.rank,
            self._where,
            reason,
            extra,
            job_suffix(self._config),
        )

    def summary(self) -> str:
        """What was rejected so far, for a log line ("" if nothing)."""
        if not self.rejected:
            return ""
        return f"; it rejected {self.rejected} connection(s), the last one: {self.last_reason}"

    async def run(
        self, connection: Connection, handshake: Callable[[], Awaitable[_T]]
    ) -> _T | None:
        """Run ``handshake`` within the deadline; return its result, or None (the connection
        then is closed and the reason logged). If the surrounding scope is cancelled (the
        stage completed), the connection is closed and logged too."""
        if len(self._pending) >= self._limit:
            # Out of the table at once: the evicted task may run only after more arrivals,
            # which must each evict another one, not cancel the same one again.
            oldest = self._pending.pop(next(iter(self._pending)))
            oldest.cancel(reason="evicted: too many handshakes in progress")
        key, self._next = self._next, self._next + 1
        scope = trio.CancelScope()
        self._pending[key] = scope
        try:
            with scope:
                with trio.fail_after(self._deadline):
                    return await handshake()
            self.reject("evicted to make room: too many handshakes in progress")
        except _auth.HandshakeError as exc:
            self.reject(str(exc), failed_proof=exc.failed_proof)
        except (BadMessage, trio.TooSlowError) as exc:
            # A stranger, or a client that gave up: not a rank of ours.
            self.reject(str(exc) or "handshake took too long")
        except BaseException as exc:
            # A group, too: cancelled while a nursery inside the handshake ran.
            if is_cancellation(exc):
                self.reject(f"the {self._where} ended before this handshake did")
            await trio.aclose_forcefully(connection)
            raise
        finally:
            self._pending.pop(key, None)
        await trio.aclose_forcefully(connection)
        return None


async def introduce(
    connection: Connection,
    config: Config,
    *,
    peer: int,
    hello: tuple[int, dict[str, Any]],
    ack: tuple[int, dict[str, Any]],
) -> None:
    """The connecting side of a data connection's set-up (the mesh's and a
    sub-communicator's): prove to world rank ``peer`` that we are this rank of the job, send
    ``hello`` (type, body), and read the answer of type ``ack[0]``, whose fields must equal
    ``ack[1]``. Raises BadMessage or :class:`trioring._auth.HandshakeError`; the caller
    closes the connection."""
    await _auth.initiate(
        connection,
        config.credentials,
        role=_auth.Role.MESH,
        rank=config.rank,
        peer=peer,
        world_size=config.world_size,
    )
    await send_message(connection, *hello)
    _, body = await read_message(connection, {ack[0]})
    if any(body.get(name) != value for name, value in ack[1].items()):
        raise BadMessage("the answer came from another world or rank")
