"""Mutual HMAC-SHA256 challenge-response, run first on every connection (rendezvous and data).

::

    client -> server  HELLO      "TRAH" | version u8 | role u8 | 2 pad | from u32 | to u32
                                  | world_size u32 | job digest (16) | client nonce (32)     68 bytes
    server -> client  CHALLENGE  "TRAC" | version u8 | 3 pad | server nonce (32)
                                  | server MAC (32)                                           72 bytes
    client -> server  PROOF      client MAC (32)                                             32 bytes

Each MAC is HMAC-SHA256, keyed with the job's secret, over a transcript of everything both
sides said (protocol version, role, job digest, world size, both ranks, both nonces) plus a
label saying who computes it ("server" or "client"). So a MAC cannot be replayed on another
connection (fresh nonces), reflected back at its sender (different label), or moved to
another job, world or pair of ranks. MACs are compared with :func:`hmac.compare_digest`.
A server reads at most 100 bytes from a peer before it is authenticated, and closes the
connection if the handshake does not finish within :data:`HANDSHAKE_SECONDS`.

Without a secret (loopback-only jobs, see :mod:`trioring._config`) the same exchange runs
with an empty key: it then proves nothing about the peer's identity, but still keeps jobs and
strangers that do not speak the protocol apart.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from typing import TYPE_CHECKING, final

import attrs
import trio

from ._util import recv_exactly

if TYPE_CHECKING:
    from .transports import Connection

__all__ = ["HANDSHAKE_SECONDS", "Credentials", "HandshakeError", "Role", "accept", "initiate"]

#: How long a peer may take to complete the handshake. This, and the same bound on the
#: rendezvous hello, are trioring's only internal deadlines: they protect a listening rank from
#: clients that connect and then say nothing. They never bound how long ranks wait for each
#: other; the caller's cancel scope does that.
HANDSHAKE_SECONDS = 5.0

VERSION = 1
_HELLO = struct.Struct("<4sBB2xIII16s32s")
_CHALLENGE = struct.Struct("<4sB3x32s32s")
_PROOF_SIZE = 32
MAX_PREAUTH_BYTES = _HELLO.size + _PROOF_SIZE
assert _HELLO.size == 68
assert _CHALLENGE.size == 72


class Role(enum.IntEnum):
    RENDEZVOUS = 1
    MESH = 2


class HandshakeError(Exception):
    """The peer is not a rank of this job (wrong secret, job, world, rank or protocol).

    Attributes:
        failed_proof: the peer spoke this job's handshake but failed to authenticate (or
            rejected our proof): most likely a rank with a different ``TRIORING_SECRET``,
            which a listener logs where users look, unlike the strangers an open port gets.
    """

    def __init__(self, message: str, *, failed_proof: bool = False) -> None:
        super().__init__(message)
        self.failed_proof = failed_proof


@final
@attrs.frozen(repr=False)
class Credentials:
    """What proves membership of a job. ``secret`` may be empty (loopback-only jobs)."""

    secret: bytes
    job_id: str

    @property
    def job_digest(self) -> bytes:
        return hashlib.sha256(b"trioring-job\0" + self.job_id.encode()).digest()[:16]

    def __repr__(self) -> str:
        # Never show the secret, not even in a traceback's locals.
        return f"Credentials(job_id={self.job_id!r}, secret={'set' if self.secret else 'none'})"


def _mac(
    credentials: Credentials,
    label: bytes,
    role: int,
    client: int,
    server: int,
    world_size: int,
    client_nonce: bytes,
    server_nonce: bytes,
) -> bytes:
    transcript = b"".join(
        (
            b"trioring-handshake\0",
            struct.pack("<BBIII", VERSION, role, client, server, world_size),
            credentials.job_digest,
            client_nonce,
            server_nonce,
            label,
        )
    )
    return hmac.new(credentials.secret, transcript, hashlib.sha256).digest()


async def _read_exactly(connection: Connection, size: int, *, claim: str = "") -> bytearray:
    """``size`` bytes; ``claim`` (server side, reading the proof) says who the client claims
    to be: a genuine client closes at that point when our MAC did not match its secret."""
    try:
        return await recv_exactly(connection, size)
    except trio.BrokenResourceError as exc:
        raise HandshakeError(f"connection broke during the handshake: {exc}") from exc
    except EOFError:
        if claim:
            raise HandshakeError(
                f"the peer closed the connection during the handshake, after our challenge: "
                f"it rejected our proof ({claim}; different TRIORING_SECRET?)",
                failed_proof=True,
            ) from None
        raise HandshakeError(
            "the peer closed the connection during the handshake (it rejected us: "
            "different TRIORING_SECRET, TRIORING_JOB_ID or world?)"
        ) from None


async def _send(connection: Connection, data: bytes) -> None:
    try:
        await connection.send_all(data)
    except trio.BrokenResourceError as exc:
        raise HandshakeError(f"connection broke during the handshake: {exc}") from exc


async def initiate(
    connection: Connection,
    credentials: Credentials,
    *,
    role: Role,
    rank: int,
    peer: int,
    world_size: int,
) -> None:
    """Client side: prove to ``peer`` that we are ``rank`` of this job, and check that it is
    ``peer`` of this job. Raises :class:`HandshakeError`."""
    client_nonce = secrets.token_bytes(32)
    await _send(
        connection,
        _HELLO.pack(
            b"TRAH", VERSION, role, rank, peer, world_size, credentials.job_digest, client_nonce
        ),
    )
    magic, version, server_nonce, server_mac = _CHALLENGE.unpack(
        await _read_exactly(connection, _CHALLENGE.size)
    )
    if magic != b"TRAC" or version != VERSION:
        raise HandshakeError("the peer does not speak trioring's handshake (or another version)")
    expected = _mac(
        credentials, b"server", role, rank, peer, world_size, client_nonce, server_nonce
    )
    if not hmac.compare_digest(server_mac, expected):
        raise HandshakeError(
            "the peer failed to prove it knows the job's secret (different TRIORING_SECRET, "
            "or not a rank of this job)"
        )
    await _send(
        connection,
        _mac(credentials, b"client", role, rank, peer, world_size, client_nonce, server_nonce),
    )


@final
@attrs.frozen
class Peer:
    """Who the client of an accepted connection proved to be."""

    rank: int
    world_size: int


async def accept(
    connection: Connection,
    credentials: Credentials,
    *,
    role: Role,
    rank: int,
) -> Peer:
    """Server side: check that the client is a rank of this job that wants to talk to
    ``rank`` in ``role``, and prove the same back. Raises :class:`HandshakeError`; reads at
    most :data:`MAX_PREAUTH_BYTES` before the client is authenticated. The caller bounds the
    time (:data:`HANDSHAKE_SECONDS`)."""
    magic, version, their_role, client, server, world_size, job_digest, client_nonce = (
        _HELLO.unpack(await _read_exactly(connection, _HELLO.size))
    )
    if magic != b"TRAH" or version != VERSION:
        raise HandshakeError("not a trioring handshake (or another protocol version)")
    if their_role != role or server != rank:
        raise HandshakeError(f"the client wanted role {their_role}, rank {server}")
    if not hmac.compare_digest(job_digest, credentials.job_digest):
        raise HandshakeError("the client belongs to another job (TRIORING_JOB_ID)")
    server_nonce = secrets.token_bytes(32)
    server_mac = _mac(
        credentials, b"server", role, client, server, world_size, client_nonce, server_nonce
    )
    await _send(connection, _CHALLENGE.pack(b"TRAC", VERSION, server_nonce, server_mac))
    claim = f"it claims to be rank {client} of a world of {world_size}"
    proof = await _read_exactly(connection, _PROOF_SIZE, claim=claim)
    expected = _mac(
        credentials, b"client", role, client, server, world_size, client_nonce, server_nonce
    )
    if not hmac.compare_digest(proof, expected):
        raise HandshakeError(
            f"the client failed to prove it knows the job's secret ({claim}; different "
            "TRIORING_SECRET?)",
            failed_proof=True,
        )
    return Peer(client, world_size)
