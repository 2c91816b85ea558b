"""Dedicated fuzz run of trioring's four parsers of untrusted bytes.

Targets, each fed generated or mutated inputs over in-memory Trio streams:

- ``frame``: the data-frame decoder, :meth:`trioring._framing.Link.recv`, which may raise
  only :class:`trioring.CollectiveError` subclasses (``ProtocolError``, ``PeerFailedError``
  for a truncated frame, ``CollectiveMismatchError``, ``PeerAbortedError``), and may return
  only for a byte-exact valid frame, whose payload must then be in the buffer;
- ``handshake``: the server side of the HMAC handshake, :func:`trioring._auth.accept`, which
  may raise only :class:`trioring._auth.HandshakeError` (nobody without the secret passes);
- ``rendezvous``: the rendezvous message reader, ``trioring._setup.read_message``,
  which may raise only ``BadMessage``, and may return only a well-formed message;
- ``objects``: the object decoder of the object collectives, :func:`trioring._objects.decode`
  (called directly on the bytes: it reads no stream), which may raise only
  :class:`trioring.ProtocolError`, and may return only for a canonical encoding (one that
  re-encodes to exactly the same bytes), allocating at most a small multiple of its input.

Inputs are random bytes, or valid messages mutated (bit flips, interesting bytes and length
fields, truncation, insertion, deletion, duplication, splicing, JSON depth bombs and odd
tokens), delivered in random short reads followed by end of file. Every example is bounded
(``--hang-s``): an example still running then is a hang. Afterwards a sample of examples runs
under ``tracemalloc`` to bound the largest allocation one example makes, and the run reports
the growth of peak RSS. Any unexpected exception, hang, bad success or oversized allocation
is printed with a reproducer (hex) and makes the exit status 1, as does a peak RSS that grew
by more than ``--max-rss-growth-kib`` on top of the most one example may allocate (a leak
grows with the examples; one large example within its bound raises the peak once).

Run: ``.venv/bin/python bench/fuzz.py`` (default 100,000 examples per target, a few minutes on
two cores); ``--examples``, ``--seed``, ``--targets``, ``--json PATH``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import resource
import struct
import sys
import time
import tracemalloc
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

import trioring
from trioring import _auth, _framing, _objects, _setup, _wire
from trioring.transports import StreamConnection

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

SECRET = b"fuzz-secret-0123456789abcdef0123"
CREDENTIALS = _auth.Credentials(SECRET, "fuzz-job")
#: Largest allocation one example may make beyond what its reader's documented bound allows:
#: a data frame never allocates (the payload lands in the caller's buffer), an abort reason is
#: at most 4 KiB, a handshake message 72 bytes; a rendezvous body may be ``max_body`` (4 KiB,
#: or 16 MiB for the address table that rank 0, already authenticated, sends), plus its parse.
ALLOCATION_SLACK = 1024 * 1024

# -- seeds: valid messages of each protocol ---------------------------------------------------


def frame_specs() -> list[tuple[_wire.OpSpec, int]]:
    """(spec the receiver expects, element offset) pairs; payload sizes follow the dtype."""
    kinds = _wire.Kind
    return [
        (_wire.OpSpec(kinds.ALLREDUCE, 1, 10, 4, 1), 0),  # float32[4], sum
        (_wire.OpSpec(kinds.ALLREDUCE, 7, 11, 3, 5), 2),  # float64 chunk at offset 2
        (_wire.OpSpec(kinds.BROADCAST, 2, 1, 16, 0, 1), 0),  # int8[16] from root 1
        (_wire.OpSpec(kinds.BARRIER, 3), 0),  # no payload
        (_wire.OpSpec(kinds.ALLREDUCE, 2**40, 13, 1, 2), 0),  # complex128, large seq
    ]


def payload_size(spec: _wire.OpSpec, count_in_frame: int) -> int:
    if not spec.dtype_code:
        return 0
    return _wire.DTYPES[spec.dtype_code - 1].itemsize * count_in_frame


def data_frame(spec: _wire.OpSpec, offset: int, payload: bytes) -> bytes:
    header = bytearray(_wire.HEADER.size)
    _wire.pack_data_header(header, spec, offset, len(payload))
    return bytes(header) + payload


def abort_frame(kind: int, subject: int, seq: int, reason: bytes) -> bytes:
    return (
        _wire.HEADER.pack(
            _wire.MAGIC,
            _wire.VERSION,
            _wire.FrameType.ABORT,
            kind,
            0,
            0,
            subject,
            seq,
            0,
            0,
            len(reason),
        )
        + reason
    )


def frame_seeds(rng: random.Random) -> list[bytes]:
    seeds = []
    for spec, offset in frame_specs():
        count = 1 if spec.count else 0
        seeds.append(data_frame(spec, offset, rng.randbytes(payload_size(spec, count))))
    for kind in range(1, 7):
        seeds.append(abort_frame(kind, rng.randrange(4), rng.randrange(9), b"cancelled"))
    seeds.append(abort_frame(1, 2, 5, "rank 2 \u00e9chou\u00e9 \U0001f4a5".encode()))
    seeds.append(abort_frame(5, 1, 1, b"x" * _wire.MAX_REASON_BYTES))
    return seeds


def handshake_seeds(rng: random.Random) -> list[bytes]:
    seeds = []
    for role in (_auth.Role.RENDEZVOUS, _auth.Role.MESH):
        for credentials in (CREDENTIALS, _auth.Credentials(b"w" * 32, "other-job")):
            hello = _auth._HELLO.pack(
                b"TRAH",
                _auth.VERSION,
                role,
                rng.randrange(1, 4),
                0,
                4,
                credentials.job_digest,
                rng.randbytes(32),
            )
            seeds.append(hello + rng.randbytes(32))  # with a (wrong) proof
            seeds.append(hello)
    return seeds


def rendezvous_seeds(rng: random.Random) -> list[bytes]:
    bodies: list[tuple[int, dict[str, Any]]] = [
        (1, {"rank": 1, "world_size": 4, "transport": "tcp", "address": "127.0.0.1:4242"}),
        (2, {"session": "ab" * 16, "addresses": ["127.0.0.1:1", "127.0.0.1:2"]}),
        (3, {"message": "two processes claim rank 1"}),
        (4, {"session": "cd" * 16, "from": 2, "to": 0}),
        (5, {"session": "cd" * 16, "from": 0}),
    ]
    seeds = []
    for kind, body in bodies:
        payload = json.dumps(body, separators=(",", ":")).encode()
        seeds.append(_setup.HEADER.pack(_setup.MAGIC, _setup.VERSION, kind, len(payload)) + payload)
    del rng
    return seeds


def objects_seeds(rng: random.Random) -> list[bytes]:
    import numpy as np

    deep: Any = None
    for _ in range(_objects.MAX_DEPTH):
        deep = [deep]
    values: list[Any] = [
        None,
        True,
        -(2**70),
        float("nan"),
        complex(1, -0.0),
        "r\u00e9sum\u00e9",
        rng.randbytes(9),
        {"lr": 0.1, "layers": [64, 64], "name": "run-7", 3: (True, None)},
        [[], (), {}, [[[]]]],
        {"rank": 1, "loss": 0.5, "hist": np.zeros(4)},
        np.arange(12, dtype=np.int16).reshape(3, 4),
        np.array(2.5, np.float16),
        np.zeros((2, 0, 3), np.complex64),
        np.array([True, False, True]),
        [np.arange(3, dtype=np.uint8), "x", np.ones(2, np.complex128)],
        deep,
    ]
    return [_objects.encode(value) for value in values]


# -- mutation -----------------------------------------------------------------------------------

INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x02, 0x05)
INTERESTING_INTS = (
    0,
    1,
    2,
    15,
    16,
    47,
    48,
    4095,
    4096,
    4097,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
JSON_TOKENS = (
    b"[",
    b"]",
    b"{",
    b"}",
    b'"a":',
    b",",
    b"1e999",
    b"-0",
    b"NaN",
    b"Infinity",
    b'"\\ud800"',
    b"null",
    b"true",
    b"9" * 400,
    b"\xff\xfe",
    b"\x00",
)


def mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 8))):
        choice = rng.randrange(11)
        if choice == 0 and buf:  # bit flip
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif choice == 1 and buf:  # interesting byte
            buf[rng.randrange(len(buf))] = rng.choice(INTERESTING_BYTES)
        elif choice == 2 and len(buf) >= 4:  # interesting little-endian integer field
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
            at = rng.randrange(max(1, len(buf) - width + 1))
            buf[at : at + width] = value.to_bytes(width, "little")[: len(buf) - at]
        elif choice == 3 and buf:  # truncate
            del buf[rng.randrange(len(buf)) :]
        elif choice == 4:  # insert random bytes
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.choice((1, 2, 4, 8, 32, 200)))
        elif choice == 5 and buf:  # delete a range
            at = rng.randrange(len(buf))
            del buf[at : at + rng.randrange(1, 16)]
        elif choice == 6 and buf:  # duplicate a range
            at = rng.randrange(len(buf))
            piece = buf[at : at + rng.randrange(1, 64)]
            buf[at:at] = piece
        elif choice == 7:  # splice with another seed (a second message, or a mixed header)
            other = rng.choice(seeds)
            cut = rng.randrange(len(buf) + 1)
            buf = buf[:cut] + other[rng.randrange(len(other) + 1) :]
        elif choice == 8:  # append a whole second message
            buf += rng.choice(seeds)
        elif choice == 9:  # JSON tokens or a depth bomb where a body may be
            at = rng.randrange(len(buf) + 1)
            if rng.random() < 0.3:
                depth = rng.choice((50, 500, 999, 1001, 2000, 4000))
                buf[at:at] = rng.choice((b"[", b'{"a":')) * depth
            else:
                buf[at:at] = b"".join(rng.choice(JSON_TOKENS) for _ in range(rng.randrange(1, 6)))
        elif choice == 10:  # make a rendezvous length prefix agree with the rest
            buf = bytearray(fix_rendezvous_length(bytes(buf)))
    return bytes(buf)


def fix_rendezvous_length(data: bytes) -> bytes:
    """Make the length field of a rendezvous header match the bytes after it, so that a
    mutated body gets parsed instead of stopping at a short read."""
    size = _setup.HEADER.size
    if len(data) < size:
        return data
    return data[: size - 4] + struct.pack("<I", len(data) - size) + data[size:]


def generate(rng: random.Random, seeds: list[bytes]) -> bytes:
    roll = rng.random()
    if roll < 0.03:
        return rng.choice(seeds)
    if roll < 0.20:
        size = rng.choice((0, 1, 7, 8, 47, 48, 49, 67, 68, 100, 300, 5000))
        if rng.random() < 0.5:
            size = rng.randrange(0, 600)
        return rng.randbytes(size)
    return mutate(rng, rng.choice(seeds), seeds)


# -- delivery -------------------------------------------------------------------------------------


def connection_for(rng: random.Random, data: bytes) -> StreamConnection:
    """A Connection whose receive side yields ``data`` in random short reads, then EOF. Sent
    bytes are buffered and dropped."""
    receive = trio.testing.MemoryReceiveStream()
    pieces: collections.deque[bytes] = collections.deque()
    at = 0
    while at < len(data):
        step = rng.choice((1, 3, 8, 48, 68, 4096, len(data)))
        pieces.append(data[at : at + step])
        at += step

    async def feed() -> None:
        if pieces:
            receive.put_data(pieces.popleft())
        else:
            receive.put_eof()

    receive.receive_some_hook = feed
    return StreamConnection(trio.StapledStream(trio.testing.MemorySendStream(), receive))


# -- targets --------------------------------------------------------------------------------------


class Bad(Exception):
    """The target did something it must not: returned for invalid input, and so on."""


# Each target draws its parameters from ``rng``, and records them and the exact bytes it
# parses in ``params`` (what a reproducer needs), before it parses anything.


async def run_frame(rng: random.Random, data: bytes, params: dict[str, Any]) -> tuple[str, int]:
    spec, offset = rng.choice(frame_specs())
    params.update(input=data, call=f"Link.recv({spec}, offset={offset})")
    count = 1 if spec.count else 0
    size = payload_size(spec, count)
    into = bytearray(size)
    link = _framing.Link(0, 1, connection_for(rng, data), job_id="fuzz")
    try:
        await link.recv(spec, offset, memoryview(into))
    except trioring.CollectiveError as exc:
        return type(exc).__name__, ALLOCATION_SLACK
    # (The pad bytes are not checked by the decoder, so compare the fields, not the bytes.)
    expected = _wire.HEADER.unpack(data_frame(spec, offset, b"\0" * size)[:48])
    if _wire.HEADER.unpack(data[:48]) != expected or bytes(into) != data[48 : 48 + size]:
        raise Bad(f"recv returned for a frame that is not the expected one: {data[:96].hex()}")
    return "ok", ALLOCATION_SLACK


async def run_handshake(rng: random.Random, data: bytes, params: dict[str, Any]) -> tuple[str, int]:
    role = rng.choice((_auth.Role.RENDEZVOUS, _auth.Role.MESH))
    params.update(input=data, call=f"_auth.accept(role={role!r}, rank=0)")
    try:
        peer = await _auth.accept(connection_for(rng, data), CREDENTIALS, role=role, rank=0)
    except _auth.HandshakeError:
        return "HandshakeError", ALLOCATION_SLACK
    raise Bad(f"accepted a peer without the secret: {peer}")


async def run_rendezvous(
    rng: random.Random, data: bytes, params: dict[str, Any]
) -> tuple[str, int]:
    expected = rng.choice(({1}, {2, 3}, {4}, {5}))
    max_body = rng.choice((_setup.MAX_SMALL_BODY, _setup.MAX_TABLE_BODY))
    if rng.random() < 0.5:
        data = fix_rendezvous_length(data)
    params.update(input=data, call=f"read_message(expected={expected}, max_body={max_body})")
    try:
        kind, body = await _setup.read_message(connection_for(rng, data), expected, max_body)
    except _setup.BadMessage:
        return "BadMessage", max_body + ALLOCATION_SLACK
    if kind not in expected or not isinstance(body, dict):
        raise Bad(f"returned type {kind} / {type(body).__name__} for {data[:96].hex()}")
    return "ok", max_body + ALLOCATION_SLACK


async def run_objects(rng: random.Random, data: bytes, params: dict[str, Any]) -> tuple[str, int]:
    copy = rng.random() < 0.5
    params.update(input=data, call=f"_objects.decode(copy={copy})")
    # Up to max_elements values of Python overhead each, and the arrays' copies.
    limit = ALLOCATION_SLACK + 200 * len(data)
    # The decoder never yields; without a checkpoint, the move_on_after deadlines of the
    # examples pile up in Trio's deadline heap (unpruned), which reads as an RSS leak.
    await trio.lowlevel.checkpoint()
    try:
        obj = _objects.decode(data, copy=copy)
    except trioring.ProtocolError:
        return "ProtocolError", limit
    if _objects.encode(obj) != data:
        raise Bad(f"decoded a non-canonical encoding: {data[:96].hex()}")
    return "ok", limit


TARGETS: dict[str, tuple[Callable[[random.Random], list[bytes]], Any]] = {
    "frame": (frame_seeds, run_frame),
    "handshake": (handshake_seeds, run_handshake),
    "rendezvous": (rendezvous_seeds, run_rendezvous),
    "objects": (objects_seeds, run_objects),
}


# -- the run --------------------------------------------------------------------------------------


def max_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


class Findings:
    """Failures grouped by kind, each with the shortest reproducer seen."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, Any]] = {}

    def add(self, key: str, params: dict[str, Any], example_seed: int, detail: str) -> None:
        data: bytes = params.get("input", b"")
        group = self.groups.setdefault(key, {"count": 0, "detail": detail, "data": None})
        group["count"] += 1
        if group["data"] is None or len(data) < len(bytes.fromhex(group["data"])):
            group.update(
                data=data.hex(),
                call=params.get("call"),
                example_seed=example_seed,
                detail=detail,
            )

    @property
    def total(self) -> int:
        return sum(group["count"] for group in self.groups.values())


async def one(
    run: Callable[[random.Random, bytes, dict[str, Any]], Awaitable[tuple[str, int]]],
    rng: random.Random,
    data: bytes,
    example_seed: int,
    hang_s: float,
    findings: Findings,
) -> tuple[str, int, dict[str, Any]]:
    """Run one example; return its outcome, the most it may allocate, and its parameters."""
    params: dict[str, Any] = {}
    try:
        with trio.move_on_after(hang_s) as scope:
            outcome, limit = await run(rng, data, params)
    except Bad as exc:
        findings.add("bad success", params, example_seed, str(exc))
        return "BAD", ALLOCATION_SLACK, params
    except Exception as exc:
        name = type(exc).__name__
        findings.add(f"unexpected {name}", params, example_seed, f"{name}: {exc}"[:300])
        return f"unexpected {name}", _setup.MAX_TABLE_BODY + ALLOCATION_SLACK, params
    if scope.cancelled_caught:
        findings.add("hang", params, example_seed, f"still running after {hang_s} s")
        return "HANG", ALLOCATION_SLACK, params
    return outcome, limit, params


async def fuzz_target(name: str, args: argparse.Namespace) -> dict[str, Any]:
    make_seeds, run = TARGETS[name]
    rng = random.Random(f"{args.seed}/{name}")
    seeds = make_seeds(rng)
    outcomes: collections.Counter[str] = collections.Counter()
    findings = Findings()
    warmup = min(2000, args.examples)
    rss_after_warmup = max_rss_kib()
    # The most one example may allocate, as its reader's bound allows (see ALLOCATION_SLACK).
    allowed = 0
    slowest = 0.0
    started = time.perf_counter()
    for index in range(args.examples):
        if index == warmup:
            rss_after_warmup = max_rss_kib()
        example_seed = rng.getrandbits(64)
        example_rng = random.Random(example_seed)
        data = generate(example_rng, seeds)
        t0 = time.perf_counter()
        outcome, limit, _ = await one(run, example_rng, data, example_seed, args.hang_s, findings)
        outcomes[outcome] += 1
        allowed = max(allowed, limit)
        slowest = max(slowest, time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    rss_end = max_rss_kib()

    # Allocation pass: the largest amount of memory one example has allocated at once.
    largest = 0
    tracemalloc.start()
    try:
        for _ in range(args.alloc_examples):
            example_seed = rng.getrandbits(64)
            example_rng = random.Random(example_seed)
            data = generate(example_rng, seeds)
            tracemalloc.reset_peak()
            baseline = tracemalloc.get_traced_memory()[0]
            _, limit, params = await one(
                run, example_rng, data, example_seed, args.hang_s, findings
            )
            peak = tracemalloc.get_traced_memory()[1] - baseline
            if peak > limit:
                detail = f"allocated {peak} bytes, limit {limit}"
                findings.add("allocation", params, example_seed, detail)
            largest = max(largest, peak)
    finally:
        tracemalloc.stop()
    return {
        "target": name,
        "examples": args.examples,
        "seconds": round(elapsed, 1),
        "examples_per_s": round(args.examples / elapsed),
        "slowest_example_ms": round(slowest * 1000, 2),
        "outcomes": dict(outcomes.most_common()),
        "alloc_examples": args.alloc_examples,
        "largest_allocation_bytes": largest,
        "max_rss_kib_after_warmup": rss_after_warmup,
        "max_rss_kib_end": rss_end,
        "rss_growth_kib": rss_end - rss_after_warmup,
        # A leak grows with the examples; one example within its bound raises the peak
        # once, by up to what it may allocate (a rendezvous header that announces a 16 MiB
        # table makes the reader allocate it before the connection ends), and the
        # allocator keeps such pages: so that much comes on top of --max-rss-growth-kib.
        "rss_allowance_kib": args.max_rss_growth_kib + allowed // 1024,
        "failures": findings.total,
        "findings": findings.groups,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000, help="per target")
    parser.add_argument("--alloc-examples", type=int, default=5_000, help="per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--hang-s", type=float, default=2.0, help="bound on one example")
    parser.add_argument("--max-rss-growth-kib", type=int, default=16 * 1024)
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for name in args.targets.split(","):
        result = await fuzz_target(name, args)
        results.append(result)
        print(
            f"{name:>10}: {result['examples']:,} examples in {result['seconds']} s "
            f"({result['examples_per_s']:,}/s), slowest {result['slowest_example_ms']} ms, "
            f"peak RSS {result['max_rss_kib_end'] / 1024:.1f} MiB "
            f"(+{result['rss_growth_kib'] / 1024:.2f} MiB after warm-up, at most "
            f"{result['rss_allowance_kib'] / 1024:.0f}), largest allocation "
            f"{result['largest_allocation_bytes']:,} B over {result['alloc_examples']:,} "
            f"traced examples, failures {result['failures']}",
            flush=True,
        )
        print(f"{'':>12}outcomes: {result['outcomes']}", flush=True)
        for key, group in result["findings"].items():
            print(
                f"{'':>12}FAIL {key} x{group['count']}: {group['detail']}\n"
                f"{'':>14}reproducer (example seed {group['example_seed']}): {group['call']} "
                f"on {len(group['data']) // 2} bytes: {group['data'][:400]}",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"trioring {trioring.__version__}, trio {trio.__version__}, Python "
        f"{sys.version.split()[0]}; seed {args.seed}",
        flush=True,
    )
    results = trio.run(main_async, args)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    too_much_rss = [r for r in results if r["rss_growth_kib"] > r["rss_allowance_kib"]]
    for result in too_much_rss:
        print(
            f"FAIL {result['target']}: peak RSS grew by more than {result['rss_allowance_kib']} "
            f"KiB ({args.max_rss_growth_kib} KiB and the largest allocation one example may make)"
        )
    return 1 if too_much_rss or any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
