"""A hostile client that keeps hitting a rank 0's rendezvous port.

Run as ``hostile_client.py flood OUT_DIR INDEX CONFIG_JSON``. It never knows the job's
secret; it knows what an attacker on the network could: the address, the job id (it is not
secret) and, for the replay, the bytes a sniffer captured from a genuine client's handshake
(``replay``, computed by the test).

``CONFIG_JSON``:

- ``address``: ``host:port`` to attack; ``job_id``, ``world_size``: of the attacked job;
- ``kinds``: the quick attacks to cycle through, ``attempts`` of them in all,
  ``concurrency`` at a time (see :meth:`Attacker.quick`: ``random``, ``random-short``,
  ``http``, ``tls``, ``nmap-lines``, ``oversized``, ``wrong-job``, ``wrong-role``,
  ``wrong-rank``, ``half-hello-close``, ``rst``, ``wrong-secret``, ``wrong-world``,
  ``spoof-rank``, ``replay``, ``reflect``);
- ``slow``: never-finishing handshakes (``silent``, ``half-hello``, ``hello-no-proof``), one
  connection each, held until the server closes them (or ``hold_s`` seconds pass); once all
  are open, ``w{INDEX}.held`` is created;
- ``gate_after``: create ``w{INDEX}.flooding`` once this many quick attempts are over;
- ``until_refused``: stop once a connection is refused (the rendezvous is over);
- ``max_s``: stop quick attempts after this long in any case (also on ``OUT_DIR/stop``);
  ``attempt_s``: bound on one quick attempt (one that runs out is a violation).

Each attempt connects, sends its bytes, and reads whatever comes back until the server closes
the connection (bounded by ``attempt_s``). The only bytes the server may ever send an attacker
is one handshake CHALLENGE (72 bytes starting ``TRAC``), and only to a client whose hello
names the right job, role and rank: anything else is recorded as a ``violation``. The report
``w{INDEX}.json`` has per-kind counts, the violations and the slow connections' fates.
"""

from __future__ import annotations

import collections
import functools
import json
import random
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import trio

from trioring import _auth

CHALLENGE_SIZE = 72
#: Attacks whose hello is right enough (job, role, rank) to get a CHALLENGE back.
GETS_CHALLENGE = {
    "wrong-secret",
    "wrong-world",
    "spoof-rank",
    "replay",
    "reflect",
    "hello-no-proof",
}


def tls_client_hello() -> bytes:
    """A fixed TLS 1.3-style ClientHello, as a TLS client or scanner would open with."""
    random_bytes = bytes(range(32))
    session = bytes(range(32, 64))
    ciphers = bytes.fromhex("130113021303c02bc02fc02cc030cca9cca8c013c014009c009d002f0035")
    sni_name = b"rank0.example"
    sni = struct.pack(">HBH", len(sni_name) + 3, 0, len(sni_name)) + sni_name
    extensions = b"".join(
        struct.pack(">HH", kind, len(data)) + data
        for kind, data in (
            (0x0000, sni),
            (0x000A, bytes.fromhex("0006001d00170018")),  # supported groups
            (0x000D, bytes.fromhex("000804030804040105010601")),  # signature algorithms
            (0x002B, bytes.fromhex("0403040303")),  # supported versions
            (0x0033, bytes.fromhex("0024001d0020") + bytes(range(64, 96))),  # key share
        )
    )
    body = (
        b"\x03\x03"
        + random_bytes
        + bytes([len(session)])
        + session
        + struct.pack(">H", len(ciphers))
        + ciphers
        + b"\x01\x00"
        + struct.pack(">H", len(extensions))
        + extensions
    )
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack(">H", len(handshake)) + handshake


TLS_CLIENT_HELLO = tls_client_hello()


class Attacker:
    def __init__(self, out_dir: Path, index: int, config: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.index = index
        self.config = config
        host, _, port = config["address"].rpartition(":")
        self.host, self.port = host, int(port)
        self.world_size: int = config["world_size"]
        self.job = _auth.Credentials(b"", config["job_id"])
        self.rng = random.Random(config.get("seed", 0))
        self.attempts: list[dict[str, Any]] = []
        self.slow: list[dict[str, Any]] = []
        self.violations: list[dict[str, Any]] = []
        self.refused = False
        self.held = 0  # slow connections established and sent
        self.flood_seconds = 0.0
        replay = config.get("replay") or {}
        self.replay_hello = bytes.fromhex(replay.get("hello", ""))
        self.replay_proof = bytes.fromhex(replay.get("proof", ""))

    # -- the bytes of each attack ---------------------------------------------------------

    def hello(
        self,
        *,
        job: _auth.Credentials | None = None,
        role: int = _auth.Role.RENDEZVOUS,
        sender: int = 1,
        to: int = 0,
        world_size: int | None = None,
    ) -> bytes:
        """A handshake HELLO as a rank would send it (by default: rank 1 to rank 0, for the
        rendezvous of the attacked job), with a fresh nonce."""
        return _auth._HELLO.pack(
            b"TRAH",
            _auth.VERSION,
            role,
            sender,
            to,
            self.world_size if world_size is None else world_size,
            (job or self.job).job_digest,
            self.rng.randbytes(32),
        )

    async def quick(self, kind: str, stream: trio.SocketStream, received: bytearray) -> None:
        """Send attack ``kind`` (the caller then reads until the server closes)."""
        rng = self.rng
        if kind == "random":
            await stream.send_all(rng.randbytes(rng.randrange(68, 2048)))
        elif kind == "random-short":
            await stream.send_all(rng.randbytes(rng.randrange(1, 68)))
            await stream.send_eof()
        elif kind == "http":
            await stream.send_all(
                f"GET / HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nUser-Agent: "
                "Mozilla/5.0 (hostile)\r\nAccept: */*\r\nConnection: keep-alive\r\n\r\n".encode()
            )
        elif kind == "tls":
            await stream.send_all(TLS_CLIENT_HELLO)
        elif kind == "nmap-lines":
            await stream.send_all(b"\r\n\r\n")
            await stream.send_eof()
        elif kind == "oversized":
            await stream.send_all(rng.randbytes(256 * 1024))
        elif kind == "wrong-job":
            await stream.send_all(self.hello(job=_auth.Credentials(b"", "another-job")))
        elif kind == "wrong-role":
            await stream.send_all(self.hello(role=_auth.Role.MESH))
        elif kind == "wrong-rank":
            await stream.send_all(self.hello(to=1))
        elif kind == "half-hello-close":
            await stream.send_all(self.hello()[:30])
            await stream.send_eof()
        elif kind in ("wrong-secret", "wrong-world", "spoof-rank", "reflect", "replay"):
            if kind == "replay":
                hello = self.replay_hello
            elif kind == "wrong-world":
                hello = self.hello(world_size=self.world_size + 1)
            elif kind == "spoof-rank":
                hello = self.hello(sender=self.world_size - 1)
            else:
                hello = self.hello()
            await stream.send_all(hello)
            if not await read_up_to(stream, received, CHALLENGE_SIZE):
                return
            if kind == "replay":
                proof = self.replay_proof
            elif kind == "reflect":
                proof = bytes(received[40:72])  # the server's own MAC
            elif kind == "wrong-secret":
                # A well-formed proof, MACed with a key that is not the job's secret.
                _, _, role, sender, to, world, _, client_nonce = _auth._HELLO.unpack(hello)
                _, _, server_nonce, _ = _auth._CHALLENGE.unpack(bytes(received[:72]))
                wrong = _auth.Credentials(b"not-the-secret-0123456789", self.job.job_id)
                proof = _auth._mac(
                    wrong, b"client", role, sender, to, world, client_nonce, server_nonce
                )
            else:
                proof = rng.randbytes(32)
            await stream.send_all(proof)
        else:
            raise ValueError(f"unknown attack {kind!r}")

    def check(self, record: dict[str, Any], received: bytes) -> None:
        kind = record["kind"]
        allowed = received == b"" or (
            kind in GETS_CHALLENGE and len(received) == CHALLENGE_SIZE and received[:4] == b"TRAC"
        )
        if not allowed or record["outcome"] == "timeout":
            if len(self.violations) < 50:
                self.violations.append({**record, "received": received[:200].hex()})
            else:
                self.violations.append({"kind": kind})

    async def connect(self) -> trio.SocketStream | None:
        try:
            return await trio.open_tcp_stream(self.host, self.port)
        except OSError:
            self.refused = True
            return None

    async def one(self, kind: str, *, slow: bool) -> None:
        started = time.monotonic()
        stream = await self.connect()
        record: dict[str, Any] = {"kind": kind, "connected": stream is not None}
        if stream is None:
            record["outcome"] = "refused"
            self.attempts.append(record)
            return
        received = bytearray()
        outcome = "eof"
        if kind == "rst":  # connect, then reset at once (SO_LINGER 0)
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stream.socket.close()
            record.update(outcome="self-reset", received=0, seconds=0.0)
            self.attempts.append(record)
            return
        try:
            with trio.move_on_after(self.config["hold_s" if slow else "attempt_s"]) as scope:
                if slow:
                    await self.slow_attack(kind, stream, received)
                else:
                    await self.quick(kind, stream, received)
                while await read_up_to(stream, received, len(received) + 4096):
                    pass
            if scope.cancelled_caught:
                outcome = "timeout"
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            outcome = "reset"
        finally:
            await trio.aclose_forcefully(stream)
        record.update(
            outcome=outcome,
            received=len(received),
            challenge=received[:4] == b"TRAC",
            seconds=round(time.monotonic() - started, 3),
        )
        self.check(record, bytes(received))
        (self.slow if slow else self.attempts).append(record)

    async def slow_attack(self, kind: str, stream: trio.SocketStream, received: bytearray) -> None:
        """Start a handshake and never finish it; the caller then waits for the server."""
        if kind == "half-hello":
            await stream.send_all(self.hello()[:30])
        elif kind == "hello-no-proof":
            await stream.send_all(self.hello())
        elif kind != "silent":
            raise ValueError(f"unknown slow attack {kind!r}")
        self.held += 1
        if self.held == len(self.config.get("slow", [])):
            write(self.out_dir / f"w{self.index}.held", b"")

    # -- running ---------------------------------------------------------------------------

    async def flood(self) -> None:
        kinds: list[str] = self.config["kinds"]
        total: int = self.config["attempts"]
        gate: int = self.config.get("gate_after", 0)
        deadline = time.monotonic() + self.config["max_s"]
        stop = self.out_dir / "stop"
        started = iter(range(total))
        gate_marked = False

        async def worker() -> None:
            nonlocal gate_marked
            for number in started:
                if time.monotonic() > deadline or stop.exists():
                    return
                if self.refused and self.config.get("until_refused"):
                    return
                await self.one(kinds[number % len(kinds)], slow=False)
                if not gate_marked and len(self.attempts) >= gate:
                    gate_marked = True
                    write(self.out_dir / f"w{self.index}.flooding", b"")

        begun = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(self.config["concurrency"]):
                nursery.start_soon(worker)
        self.flood_seconds = time.monotonic() - begun

    async def run(self) -> None:
        begun = time.monotonic()
        async with trio.open_nursery() as nursery:
            for kind in self.config.get("slow", []):
                nursery.start_soon(functools.partial(self.one, kind, slow=True))
            await self.flood()
        self.report(time.monotonic() - begun)

    def report(self, seconds: float) -> None:
        kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for record in self.attempts:
            kinds[record["kind"]][record["outcome"]] += 1
            kinds[record["kind"]]["challenges"] += int(record.get("challenge", False))
        report = {
            "seconds": round(seconds, 3),
            "flood_seconds": round(self.flood_seconds, 3),
            "attempts": len(self.attempts),
            "connected": sum(record["connected"] for record in self.attempts),
            "max_received": max((r.get("received", 0) for r in self.attempts), default=0),
            "kinds": {kind: dict(counts) for kind, counts in kinds.items()},
            "slow": self.slow,
            "violations": self.violations,
        }
        write(self.out_dir / f"w{self.index}.json", json.dumps(report, indent=1).encode())


async def read_up_to(stream: trio.SocketStream, received: bytearray, size: int) -> bool:
    """Read until ``received`` holds ``size`` bytes; False at EOF (the server closed)."""
    while len(received) < size:
        data = await stream.receive_some(size - len(received))
        if not data:
            return False
        received += data
    return True


def write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def main() -> None:
    _, out_dir, index, config = sys.argv[1:]
    trio.run(Attacker(Path(out_dir), int(index), json.loads(config)).run)


if __name__ == "__main__":
    main()
