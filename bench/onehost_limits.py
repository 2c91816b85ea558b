"""Two limits of this machine that bound trioring's one-host paths, measured without
trioring (the performance page cites them):

1. **A busy sibling**: how much slower a Python loop runs while another process keeps the
   other core busy, yielding (`sched_yield`, as a rank waiting on the shared segment does) or
   spinning, against a plain `memcpy` under the same conditions. A rank that waits for its
   peer does exactly this to the peer it waits for.
2. **Copy-in/copy-out through shared memory**: a broadcast of SIZE bytes from one process
   to another through two slots of CHUNK bytes in an anonymous shared mapping, pipelined
   (the writer fills slot k % 2 while the reader empties the other), polling counters with
   `sched_yield`: the shared-memory alternative to cross-memory attach for large arrays.
3. **Sends into a Unix socket**: how long one ``sendmsg`` of 256 KiB (``--send``) takes,
   and how often it takes over 500 us. In some runs here about one send in seven did
   (p99 824 us against a median of 47), with no trioring in the process: the socket
   paths of trioring's mid-size collectives inherit those stalls.

Usage: ``.venv/bin/python bench/onehost_limits.py [--size 4M] [--chunk 256K] [--send 256K]``.
Medians of bounded loops; each child process is reaped before the script exits.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import socket
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

_UNITS = {"K": 1 << 10, "M": 1 << 20}


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)


def _busy(mode: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if mode == "yield":
            os.sched_yield()


def _median_us(function: Callable[[], None], repeats: int, inner: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            function()
        times.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(times)


def sibling() -> None:
    """Part 1: a small Python call and a 2 MiB copy, alone and beside a busy process."""
    x = np.ones(1, np.float32)
    y = np.ones(1, np.float32)
    big, into = np.ones(1 << 19, np.float32), np.empty(1 << 19, np.float32)

    def small() -> None:  # about what a 4-byte allreduce does besides waiting
        np.add(x, y, out=x)
        x[0] = 1.0
        os.sched_yield()

    def copy() -> None:
        into[...] = big

    context = multiprocessing.get_context("fork")
    for mode in ("alone", "yield", "spin"):
        helper = None
        if mode != "alone":
            helper = context.Process(target=_busy, args=(mode, 30.0), daemon=True)
            helper.start()
            time.sleep(0.2)  # let it reach its loop; not synchronisation of results
        try:
            call = _median_us(small, 7, 20_000)
            moved = _median_us(copy, 7, 100)
        finally:
            if helper is not None:
                helper.terminate()
                helper.join(5)
        print(f"sibling {mode:>5}: small call {call:6.2f} us, 2 MiB copy {moved:6.1f} us")


def pipeline(size: int, chunk: int, repeats: int = 100) -> None:
    """Part 2: a pipelined copy-in/copy-out broadcast through two shared slots."""
    slots_count = 2
    shared = mmap.mmap(-1, 4096 + slots_count * chunk)
    words = np.frombuffer(shared, np.int64, 16, 0)
    slots = np.frombuffer(shared, np.uint8, slots_count * chunk, 4096).reshape(slots_count, chunk)
    source, target = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    chunks = -(-size // chunk)
    written, read = 0, 8  # the words: chunks written by the writer, chunks emptied by the reader

    def wait(word: int, value: int) -> None:
        deadline = time.monotonic() + 10
        while words[word] < value:
            os.sched_yield()
            if time.monotonic() > deadline:
                raise SystemExit("pipeline: the other process stopped")

    pid = os.fork()
    if pid == 0:  # the reader
        try:
            count = 0
            for _ in range(repeats):
                for k in range(chunks):
                    count += 1
                    wait(written, count)
                    lo, hi = k * chunk, min(size, (k + 1) * chunk)
                    target[lo:hi] = slots[count % slots_count, : hi - lo]
                    words[read] = count
        finally:
            os._exit(0)
    times = []
    try:
        count = 0
        for _ in range(repeats):
            start = time.perf_counter()
            for k in range(chunks):
                count += 1
                wait(read, count - slots_count)  # the slot is free again
                lo, hi = k * chunk, min(size, (k + 1) * chunk)
                slots[count % slots_count, : hi - lo] = source[lo:hi]
                words[written] = count
            wait(read, count)
            times.append(time.perf_counter() - start)
    finally:
        os.waitpid(pid, 0)
    print(
        f"pipelined copy through shared memory: {size >> 10} KiB in {chunk >> 10} KiB "
        f"chunks, median {statistics.median(times) * 1e6:.0f} us over {repeats}"
    )


def socket_sends(size: int, calls: int = 3000) -> None:
    """Part 3: how long one ``sendmsg`` of ``size`` bytes into a Unix stream socket takes
    (the kernel copies it into its buffers; the peer, another process, reads it all and
    answers with one byte before the next send), and how often it takes over 500 us."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # as trioring asks
        sock.settimeout(10)
    pid = os.fork()
    if pid == 0:  # the reader
        try:
            ours.close()
            view = memoryview(bytearray(size))
            for _ in range(calls):
                got = 0
                while got < size:
                    got += theirs.recv_into(view[got:])
                theirs.send(b"k")
        finally:
            os._exit(0)
    theirs.close()
    data = memoryview(np.ones(size, np.uint8))
    times = []
    try:
        for _ in range(calls):
            start = time.perf_counter()
            ours.sendall(data)
            times.append(time.perf_counter() - start)
            ours.recv(1)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    slow = sum(t > 500e-6 for t in times)
    print(
        f"one {size >> 10} KiB send into a Unix socket: median "
        f"{statistics.median(times) * 1e6:.0f} us, p99 "
        f"{statistics.quantiles(times, n=100)[98] * 1e6:.0f} us, {slow} of {calls} over 500 us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=_size, default=4 << 20)
    parser.add_argument("--chunk", type=_size, default=256 << 10)
    parser.add_argument("--send", type=_size, default=256 << 10, help="part 3's send size")
    args = parser.parse_args()
    sibling()
    pipeline(args.size, args.chunk)
    socket_sends(args.send)


if __name__ == "__main__":
    main()
