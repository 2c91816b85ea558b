"""LinkErrors, the errors a :class:`~trioring._framing.Link` raises, each naming this rank,
the peer, the collective and its sequence number. A base class of its own so that the link's
module holds the framing and this one the wording users read."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, TypeVar

from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CommunicatorClosedError,
    PeerFailedError,
    ProtocolError,
    TrioringError,
)
from ._wire import HEADER, MAGIC, VERSION, FrameType, OpSpec, describe_remote
from .transports._socket import UNREACHABLE_ERRNOS

if TYPE_CHECKING:
    import trio

    from .transports._socket import SocketConnection

_E = TypeVar("_E", bound=TrioringError)

#: What a receive that has no byte of its frame yet says it receives (see Link._recv_some).
FIRST_HEADER = "a frame header"
# What a connection that ends or is reset under a live rank usually means.
_LOST_PEER = "the peer exited, crashed or closed its communicator"


class LinkErrors:
    """The error constructors of a link from ``rank`` to ``peer``."""

    rank: int
    peer: int
    job_id: str | None
    _fast: SocketConnection | None

    def _error(self, cls: type[_E], spec: OpSpec, message: str, *, with_peer: bool = True) -> _E:
        """``cls(message)`` naming this rank, the peer (unless ``with_peer`` is false), the
        job and ``spec``'s collective and sequence number."""
        return cls(
            message,
            rank=self.rank,
            job_id=self.job_id,
            peer=self.peer if with_peer else None,
            collective=spec.kind.label,
            seq=spec.seq,
        )

    def _context(self, spec: OpSpec) -> str:
        return f"rank {self.rank}: {spec.named()}"

    def memory_failed(
        self, spec: OpSpec, error: OSError, *, wrote: bool = False
    ) -> PeerFailedError:
        """The error for a failed cross-memory read from this link's peer (or write into
        it: ``wrote``)."""
        verb = "write into" if wrote else "read"
        return self.peer_failed(
            spec,
            f"could not {verb} the memory of peer rank {self.peer} ({error.strerror}; the "
            "peer exited or left the collective)",
        )

    def protocol_error(self, spec: OpSpec, detail: str) -> ProtocolError:
        """A :class:`ProtocolError` about what this link's peer sent."""
        return self._error(
            ProtocolError, spec, f"{self._context(spec)}: from peer rank {self.peer}: {detail}"
        )

    def _mismatch(
        self, spec: OpSpec, kind: int, seq: int, dtype: int, count: int, op: int, root: int
    ) -> CollectiveMismatchError | None:
        """The error for a peer's call whose identity is not ``spec``'s; None if it is."""
        if (kind, seq, dtype, count, op, root) == (
            spec.kind,
            spec.seq,
            spec.dtype_code,
            spec.count,
            spec.op_code,
            spec.root,
        ):
            return None
        remote = describe_remote(kind, seq, dtype, count, op, root)
        mine = spec.describe()
        error = self._error(
            CollectiveMismatchError, spec, f"rank {self.rank}: {mine}, rank {self.peer}: {remote}"
        )
        error.calls = {self.rank: mine, self.peer: remote}
        return error

    def header_mismatch(self, spec: OpSpec, header: memoryview) -> CollectiveError:
        """The error for this link's peer having published, in shared memory, a frame header
        other than the one of ``spec`` (see _onehost._shm_reductions.shm_allreduce)."""
        (magic, version, ftype, kind, op, dtype, root, seq, count, offset, nbytes) = (
            HEADER.unpack_from(header)
        )
        if magic != MAGIC or version != VERSION or ftype != FrameType.DATA:
            return self.protocol_error(spec, "published a corrupt frame header in shared memory")
        mismatch = self._mismatch(spec, kind, seq, dtype, count, op, root)
        if mismatch is not None:
            return mismatch
        return self.protocol_error(
            spec, f"published {nbytes} bytes at element {offset} for the same collective"
        )

    def _failed(self, spec: OpSpec, detail: str) -> PeerFailedError:
        return self.peer_failed(spec, f"connection to peer rank {self.peer} {detail}")

    def peer_failed(self, spec: OpSpec, what: str) -> PeerFailedError:
        return self._error(PeerFailedError, spec, f"{self._context(spec)}: {what}")

    def closed_error(self, spec: OpSpec) -> CommunicatorClosedError:
        """The error for a communicator closed by another task during ``spec``."""
        return self._error(
            CommunicatorClosedError,
            spec,
            f"{self._context(spec)}: the communicator was closed by another task while this "
            "collective was running",
            with_peer=False,
        )

    def _broken(self, spec: OpSpec, doing: str, exc: trio.BrokenResourceError) -> PeerFailedError:
        """The error for the connection broken while ``doing``. A timeout (the kernel's, or
        the transport's TRIORING_PEER_TIMEOUT) means the peer's host went silent, not that
        the peer closed: say so, or a reader looks for a crash that never happened."""
        cause = exc.__cause__
        if not isinstance(cause, OSError) or cause.errno not in UNREACHABLE_ERRNOS:
            detail = f"broke while {doing}: {exc}"
            if isinstance(cause, OSError) and cause.errno in (errno.ECONNRESET, errno.EPIPE):
                # The peer's socket closed with data unread: say what that usually means.
                detail += f" ({_LOST_PEER})"
            return self._failed(spec, detail)
        timeout = self._fast.peer_timeout if self._fast is not None else None
        silence = f" ({cause.strerror})"
        if timeout is not None:
            silence = f" for {timeout:g} s (TRIORING_PEER_TIMEOUT; {cause.strerror})"
        return self.peer_failed(
            spec,
            f"peer rank {self.peer} became unreachable while {doing}: no answer from rank "
            f"{self.peer}'s host{silence}; it crashed or lost its network, or the network "
            "drops its packets",
        )

    def _closed_by_peer(self, spec: OpSpec, done: int, total: int, what: str) -> PeerFailedError:
        """The error for a connection that ended after ``done`` of ``total`` bytes of
        ``what``; before the first byte of a frame, a clean close."""
        error = self._failed(
            spec,
            f"was closed by the peer after {done} of {total} bytes of {what} ({_LOST_PEER})",
        )
        error._trioring_clean_close = what == FIRST_HEADER and not done
        error._trioring_cut_short = not error._trioring_clean_close
        return error
