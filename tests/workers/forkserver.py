"""A fork server: one process that has imported numpy, trio and trioring once, and forks a
fresh worker process on request, so that a worker starts in milliseconds instead of spending
~0.5 s importing (which, times four ranks on a two-core machine, dominates a fault test).

Run as a script it is the server; imported, :class:`ForkServer` is the client that starts it
and talks to it. Protocol: JSON lines. The client writes requests on the server's stdin::

    {"op": "spawn", "id": N, "script": PATH, "args": [...], "env": {...}, "log": PATH}
    {"op": "signal", "id": N, "pid": PID, "sig": SIGNUM}

and the server answers on its stdout with ``{"id": N, ...}`` (``pid`` for a spawn; ``sent``
and ``t``, the ``time.monotonic()`` just before ``kill(2)``, for a signal), and reports each
child's end as ``{"exit": PID, "code": CODE}`` (``-SIGNUM`` if a signal ended it). The server
alone reaps its children and signals only children it has not reaped, so a signal can never
reach a recycled pid. When its stdin closes (the client closed it, or the client died) it
kills and reaps every child left and exits.

A child runs ``PATH`` as ``__main__`` (``runpy.run_path``, so the script's module-level code
runs in the child, after its environment is set) with ``sys.argv = [PATH, *args]`` and PATH's directory first on ``sys.path``, exactly
``env`` as its environment, stdin from ``/dev/null`` and stdout and stderr appended to ``log``;
it dies with the server (``PR_SET_PDEATHSIG``), as the server dies with the client. Only
third-party modules and trioring are imported in the server (they read no environment at
import time).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- the server -------------------------------------------------------------------------------


def _write(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _run_child(request: dict[str, Any], server_pid: int, keep_out: list[int]) -> None:
    """In the forked child: set up the process and run the script; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep_out:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        _die_with_parent()
        if os.getppid() != server_pid:
            os._exit(1)
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy
        import traceback

        script = request["script"]
        sys.argv = [script, *request["args"]]
        # As `python PATH` would: the script's directory first, for its own helpers.
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    _die_with_parent()
    # Import what workers need once, here, so that every child has it already.
    import numpy  # noqa: F401
    import trio  # noqa: F401

    import trioring  # noqa: F401

    # Workers import their helpers (_worker_util) from this directory. Those are not imported
    # here: they may read the environment at import time, which differs per child.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    server_pid = os.getpid()
    children: set[int] = set()
    buffer = b""
    out = 1

    def reap(block: bool) -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            _write(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    _write(out, {"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            reap(block=False)
        if 0 not in readable:
            continue
        data = os.read(0, 65536)
        if not data:
            break
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    _run_child(request, server_pid, [wake_r, wake_w])
                children.add(pid)
                _write(out, {"id": request["id"], "pid": pid})
            elif request["op"] == "signal":
                # Reap first: a child that has exited must not be signalled (its pid may be
                # reused once reaped, and we reap only here, in this loop).
                reap(block=False)
                sent, when = False, None
                if request["pid"] in children:
                    when = time.monotonic()
                    os.kill(request["pid"], request["sig"])
                    sent = True
                _write(out, {"id": request["id"], "sent": sent, "t": when})
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap(block=True)


# -- the client -------------------------------------------------------------------------------


class ForkServerError(Exception):
    pass


class ForkServer:
    """Starts the server process and talks to it. Single-threaded: replies and exit reports
    are read whenever the client waits for something (:meth:`pump`)."""

    def __init__(self, python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        # One thread per process is plenty here, and a process with fewer threads forks cleanly.
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [python, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        self._in = self._proc.stdin
        self._out = self._proc.stdout.fileno()
        self._buffer = b""
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        #: Exit codes of children that ended, by pid.
        self.exit_codes: dict[int, int] = {}
        self._ready: int | None = None
        deadline = time.monotonic() + 60
        while self._ready is None:
            if not self.pump(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                raise ForkServerError("the fork server did not start within 60 s")

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def pump(self, timeout: float = 0.0) -> bool:
        """Read whatever the server said, waiting up to ``timeout`` for the first bytes.
        Returns whether anything was read."""
        readable, _, _ = select.select([self._out], [], [], timeout)
        if not readable:
            return False
        data = os.read(self._out, 65536)
        if not data:
            raise ForkServerError(f"the fork server exited ({self._proc.wait()})")
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "ready" in message:
                self._ready = message["ready"]
            elif "exit" in message:
                self.exit_codes[message["exit"]] = message["code"]
            else:
                self._replies[message["id"]] = message
        return True

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        ident = message["id"] = self._next_id
        self._in.write((json.dumps(message) + "\n").encode())
        self._in.flush()
        deadline = time.monotonic() + 30
        while ident not in self._replies:
            if time.monotonic() > deadline:
                raise ForkServerError(f"no answer from the fork server to {message['op']}")
            self.pump(0.5)
        return self._replies.pop(ident)

    def spawn(self, script: str, args: list[str], env: dict[str, str], log: str) -> int:
        """Start ``script`` with ``args`` in a fresh child; returns its pid."""
        reply = self._request(
            {"op": "spawn", "script": script, "args": list(args), "env": dict(env), "log": log}
        )
        pid: int = reply["pid"]
        return pid

    def signal(self, pid: int, signum: int) -> float | None:
        """Send ``signum`` to child ``pid`` unless it has ended; returns the
        ``time.monotonic()`` at which it was sent, or None if the child had ended."""
        reply = self._request({"op": "signal", "pid": pid, "sig": int(signum)})
        sent: float | None = reply["t"] if reply["sent"] else None
        return sent

    def poll(self, pid: int) -> int | None:
        """The child's exit code, or None while it runs."""
        self.pump(0.0)
        return self.exit_codes.get(pid)

    def wait(self, pid: int, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the child to end; its exit code, or None."""
        deadline = time.monotonic() + timeout
        while pid not in self.exit_codes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.pump(min(remaining, 0.05))
        return self.exit_codes[pid]

    def close(self) -> None:
        """Stop the server; it kills and reaps every child still running."""
        with contextlib.suppress(BrokenPipeError, OSError):
            self._in.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        assert self._proc.stdout is not None
        self._proc.stdout.close()


if __name__ == "__main__":
    serve()
