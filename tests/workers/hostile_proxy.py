"""A frame-aware TCP proxy that puts real faults on the wire between two ranks.

Run as ``hostile_proxy.py proxy OUT_DIR INDEX FAULT_JSON``. It listens on a loopback port,
which it writes to ``OUT_DIR/w{INDEX}.port``. The ranks use the ``proxied`` transport of
``hostile_worker.py``, whose ``connect(address)`` connects here instead and first sends a
preamble naming ``address`` (see :func:`preamble`); the proxy connects there and relays
bytes both ways. It follows trioring's data-connection protocol: the HMAC handshake
(HELLO 68 bytes and PROOF 32 from the client, CHALLENGE 72 from the server), then one
rendezvous-style message each way (MESH_HELLO, MESH_ACK), then 48-byte frame headers, each
followed by its payload. From the HELLO it learns which ranks a connection joins.

``FAULT_JSON`` says what to do to one data frame: ``{"kind": K, "src": A, "dst": B,
"seq": S}`` acts, once, on the first DATA frame that rank A sends to rank B for the
collective with sequence number S (whatever the algorithm, a frame names its collective):

- ``rst``: forward nothing of it and reset both connections (``SO_LINGER`` 0, close: RST);
- ``header``: forward its header only, then close both connections cleanly (FIN);
- ``half``: forward its header and half its payload, then close both cleanly (FIN);
- ``rst-half``: forward its header and half its payload, then reset both (RST);
- ``garbage``: forward it with the magic of its header overwritten, and keep relaying;
- ``handshake-rst``: reset the connection from A to B as soon as its HELLO arrives (no frame
  is involved: ``seq`` is ignored);
- ``none``: relay faithfully.

When the fault fires, the proxy writes ``OUT_DIR/w{INDEX}.fault.json``: what it did, to which
frame (its header fields, among them the collective's sequence number) and when
(``time.monotonic()``, which is system-wide on Linux, so workers' times compare with it). The
proxy runs until it is killed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import trio

PREAMBLE = struct.Struct("<4sH")
PREAMBLE_MAGIC = b"PRXY"
HELLO_SIZE, PROOF_SIZE, CHALLENGE_SIZE = 68, 32, 72
HELLO = struct.Struct("<4sBB2xIII16s32s")
MESSAGE_HEADER = struct.Struct("<4sBBxxI")
FRAME_HEADER = struct.Struct("<4sBBBBB3xiQQQQ")
DATA = 1
CHUNK = 64 * 1024


def preamble(address: str) -> bytes:
    """What the ``proxied`` transport sends first: where the proxy should connect."""
    encoded = address.encode()
    return PREAMBLE.pack(PREAMBLE_MAGIC, len(encoded)) + encoded


class Closed(Exception):
    """The source ended (EOF or error) before a whole unit arrived; ``partial`` holds what
    did arrive."""

    def __init__(self, partial: bytes) -> None:
        super().__init__(f"closed after {len(partial)} bytes")
        self.partial = partial


class Reader:
    """Exact reads from a stream (the proxy must not read past a frame it may cut)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            try:
                data = await self.stream.receive_some(CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                raise Closed(bytes(self.buffer))
            self.buffer += data
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out


def reset(stream: trio.SocketStream) -> None:
    """Close with SO_LINGER 0, so the kernel sends RST instead of FIN."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


class Pair:
    """One relayed connection: ``client`` (the connecting rank) and ``server``."""

    def __init__(self, proxy: Proxy, client: trio.SocketStream, server: trio.SocketStream):
        self.proxy = proxy
        self.client = client
        self.server = server
        self.ranks: tuple[int, int] | None = None  # (client rank, server rank)
        self.hello_seen = trio.Event()
        #: After a clean cut: both directions drop whatever still arrives, until EOF.
        self.draining = False
        self.was_reset = False
        self.cancel_scope = trio.CancelScope()

    def close_both_with_rst(self) -> None:
        self.was_reset = True
        reset(self.client)
        reset(self.server)

    async def cut_cleanly(self) -> None:
        """After a cut frame: FIN both ways; from now on drop what either rank still sends
        (so that neither is reset by unread data) until each has closed its side."""
        self.draining = True
        for stream in (self.client, self.server):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await stream.send_eof()

    async def forward(self, sink: trio.SocketStream, data: bytes) -> None:
        if not self.draining:
            await sink.send_all(data)

    async def forward_payload(self, reader: Reader, sink: trio.SocketStream, nbytes: int) -> None:
        while nbytes:
            piece = await reader.exactly(min(nbytes, CHUNK))
            await self.forward(sink, piece)
            nbytes -= len(piece)

    async def relay(self, reader: Reader, sink: trio.SocketStream, c2s: bool) -> None:
        try:
            await self._relay(reader, sink, c2s)
        except Closed as closed:
            # The source ended: forward what arrived, then end this direction likewise.
            if self.draining or self.was_reset:
                return
            try:
                await self.forward(sink, closed.partial)
                await sink.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            if self.was_reset:
                return
            # A rank reset its side, or the other direction failed: end both.
            self.cancel_scope.cancel()

    async def _relay(self, reader: Reader, sink: trio.SocketStream, c2s: bool) -> None:
        if c2s:
            hello = await reader.exactly(HELLO_SIZE)
            _, _, _, client, server, _, _, _ = HELLO.unpack(hello)
            self.ranks = (client, server)
            self.hello_seen.set()
            if self.proxy.fault_kind == "handshake-rst" and self.matches(client, server):
                self.proxy.fired(self, {"hello_from": client, "hello_to": server})
                self.close_both_with_rst()
                return
            await self.forward(sink, hello)
            await self.forward(sink, await reader.exactly(PROOF_SIZE))
        else:
            await self.forward(sink, await reader.exactly(CHALLENGE_SIZE))
        header = await reader.exactly(MESSAGE_HEADER.size)
        await self.forward(sink, header)
        await self.forward_payload(reader, sink, MESSAGE_HEADER.unpack(header)[3])
        await self.hello_seen.wait()
        assert self.ranks is not None
        sender, receiver = self.ranks if c2s else self.ranks[::-1]
        faulted = self.proxy.fault_kind not in ("none", "handshake-rst") and self.matches(
            sender, receiver
        )
        while True:
            header = await reader.exactly(FRAME_HEADER.size)
            fields = FRAME_HEADER.unpack(header)
            if (
                faulted
                and (fields[2], fields[7]) == (DATA, self.proxy.fault["seq"])
                and not self.proxy.has_fired
            ):
                await self.inject(reader, sink, header, fields)
                if self.was_reset:
                    return
                continue
            await self.forward(sink, header)
            await self.forward_payload(reader, sink, fields[-1])

    def matches(self, sender: int, receiver: int) -> bool:
        return (sender, receiver) == (self.proxy.fault["src"], self.proxy.fault["dst"])

    async def inject(
        self, reader: Reader, sink: trio.SocketStream, header: bytes, fields: tuple[Any, ...]
    ) -> None:
        """Do the fault to this frame. Returns with the frame consumed from ``reader``
        (unless the connections were reset)."""
        kind = self.proxy.fault_kind
        nbytes = fields[-1]
        record = {
            "frame_type": fields[2],
            "collective_kind": fields[3],
            "seq": fields[7],
            "count": fields[8],
            "offset": fields[9],
            "nbytes": nbytes,
        }
        if kind == "rst":
            self.proxy.fired(self, {**record, "forwarded": 0})
            self.close_both_with_rst()
        elif kind in ("header", "half", "rst-half"):
            half = nbytes // 2 if kind != "header" else 0
            await sink.send_all(header + (await reader.exactly(half) if half else b""))
            self.proxy.fired(self, {**record, "forwarded": len(header) + half})
            if kind == "rst-half":
                self.close_both_with_rst()
            else:
                await self.cut_cleanly()
                await self.forward_payload(reader, sink, nbytes - half)  # dropped
        elif kind == "garbage":
            self.proxy.fired(self, {**record, "forwarded": len(header) + nbytes})
            await sink.send_all(b"\xde\xad\xbe\xef" + header[4:])
            await self.forward_payload(reader, sink, nbytes)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")


class Proxy:
    def __init__(self, out_dir: Path, index: int, fault: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.index = index
        self.fault = fault
        self.fault_kind: str = fault["kind"]
        self.has_fired = False
        self.connections = 0

    def fired(self, pair: Pair, details: dict[str, Any]) -> None:
        self.has_fired = True
        # However the ranks behave from here on, this connection ends within 10 s.
        pair.cancel_scope.deadline = trio.current_time() + 10
        record = {
            "t": time.monotonic(),
            "kind": self.fault_kind,
            "connection": pair.ranks,
            **details,
        }
        path = self.out_dir / f"w{self.index}.fault.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)

    async def handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        client_reader = Reader(client)
        try:
            magic, size = PREAMBLE.unpack(await client_reader.exactly(PREAMBLE.size))
            if magic != PREAMBLE_MAGIC:
                raise ValueError("no preamble")
            host, _, port = (await client_reader.exactly(size)).decode().rpartition(":")
            server = await trio.open_tcp_stream(host, int(port))
        except (Closed, OSError, ValueError):
            await trio.aclose_forcefully(client)
            return
        pair = Pair(self, client, server)
        try:
            with pair.cancel_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pair.relay, client_reader, server, True)
                    nursery.start_soon(pair.relay, Reader(server), client, False)
        finally:
            await trio.aclose_forcefully(client)
            await trio.aclose_forcefully(server)

    async def serve(self) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        path = self.out_dir / f"w{self.index}.port"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(path)
        await trio.serve_listeners(self.handle, listeners)


def main() -> None:
    _, out_dir, index, fault = sys.argv[1:]
    trio.run(Proxy(Path(out_dir), int(index), json.loads(fault)).serve)


if __name__ == "__main__":
    main()
