"""Start and supervise the ranks of one job on this machine (``trioring run``).

Contract of :func:`launch`:

* Every rank is ``spec.command`` run with the launcher's environment plus ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the rendezvous variables of
  ``spec.transport`` (see :func:`rendezvous_environment`). Ranks inherit stdin. Their stdout
  and stderr are inherited unchanged, unless output is tagged (``spec.tag_output``; by
  default when there are several ranks and stdout is a terminal): then every line is
  forwarded whole, prefixed with ``[rank] ``, to the launcher's stdout or stderr.
* If every rank exits with status 0, :func:`launch` returns 0.
* The first rank to exit non-zero or by a signal is *the first failure*. Every rank still
  running then gets ``SIGTERM``; whichever are still running ``spec.grace`` seconds later get
  ``SIGKILL``. :func:`launch` returns the first failure's exit status (``128 + signal number``
  for a signal, as a shell reports it), and one line on stderr names it and the ranks that had
  to be terminated. Ranks that exit after being told to stop are not failures.
* ``SIGINT``, ``SIGTERM`` or ``SIGHUP`` delivered to the launcher stops the ranks the same
  way and :func:`launch` returns ``128 + signal number``. A second signal during the grace
  period skips the rest of it and sends ``SIGKILL`` at once. A signal the launcher inherited
  as ignored (``nohup``, background jobs of a non-interactive shell) stays ignored.
* :func:`launch` never returns or raises while a rank it started may still be running: any
  error or cancellation inside it kills and reaps every rank before propagating. The one case
  no process can cover is the launcher itself being killed with ``SIGKILL``; ranks share the
  launcher's process group, so a terminal's Ctrl-C or hangup still reaches them then.
  Processes that ranks start themselves are theirs to clean up.
* The Unix socket directory is created before the first rank starts and removed before
  :func:`launch` returns or raises, whatever happened.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Literal, TextIO, final

import attrs
import trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence

Transport = Literal["unix", "tcp"]
TRANSPORTS: tuple[Transport, ...] = ("unix", "tcp")

DEFAULT_GRACE = 5.0

# How long the last-resort cleanup waits for SIGKILLed ranks to be reaped. SIGKILL cannot be
# caught, so only a process stuck in the kernel (uninterruptible I/O) can take longer, and
# then nothing we could do would help; the bound just keeps the launcher from hanging on it.
_REAP_AFTER_KILL_S = 5.0

# Variables that belong to one job's rendezvous: a rank must never see a stale value for the
# transport it was not started with (e.g. MASTER_PORT left over from a torchrun shell), nor a
# TRIORING_RANK/TRIORING_WORLD_SIZE that would override the RANK/WORLD_SIZE we set.
_RENDEZVOUS_VARIABLES = (
    "TRIORING_RANK",
    "TRIORING_WORLD_SIZE",
    "TRIORING_MASTER_ADDR",
    "TRIORING_MASTER_PORT",
    "TRIORING_TRANSPORT",
    "TRIORING_SOCKET_DIR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TRIORING_SECRET",
    "TRIORING_SECRET_FILE",
    "TRIORING_JOB_ID",
    "TRIORING_LISTEN_FD",
)


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _grace_ok(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value}")


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _command_ok(
    _instance: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")


@attrs.frozen
class LaunchSpec:
    """What to run, how many times, and how to stop it.

    ``command`` is the full argv of every rank (``(sys.executable, "script.py", ...)``);
    ``grace`` is the time in seconds between ``SIGTERM`` and ``SIGKILL``.
    """

    command: tuple[str, ...] = attrs.field(converter=_str_tuple, validator=_command_ok)
    nprocs: int = attrs.field(validator=_positive)
    transport: Transport = attrs.field(default="unix", validator=attrs.validators.in_(TRANSPORTS))
    grace: float = attrs.field(default=DEFAULT_GRACE, converter=float, validator=_grace_ok)
    #: Prefix every line a rank prints with ``[rank] ``; None: only when there are several
    #: ranks and the launcher's stdout is a terminal.
    tag_output: bool | None = None

    def tagging(self) -> bool:
        if self.tag_output is not None:
            return self.tag_output
        return self.nprocs > 1 and sys.stdout.isatty()

    @classmethod
    def for_python(
        cls,
        target: str,
        args: Sequence[str] = (),
        *,
        module: bool = False,
        nprocs: int,
        transport: Transport = "unix",
        grace: float = DEFAULT_GRACE,
        tag_output: bool | None = None,
    ) -> LaunchSpec:
        """Run ``python target args`` (or ``python -m target args``) with this interpreter."""
        head = [sys.executable, "-m", target] if module else [sys.executable, target]
        return cls(
            command=[*head, *args],
            nprocs=nprocs,
            transport=transport,
            grace=grace,
            tag_output=tag_output,
        )


def exit_status(returncode: int) -> int:
    """Map a :attr:`trio.Process.returncode` to the status a shell would report.

    Negative return codes mean "killed by signal ``-returncode``"; shells report ``128 + n``.
    """
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}, exit code {exit_status(returncode)}"
    return f"exited with code {returncode}"


def _listening_socket(host: str) -> socket.socket:
    # The launcher binds and listens itself and hands the socket to rank 0
    # (TRIORING_LISTEN_FD), so there is no window between finding a free port and binding it
    # in which another job could take it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(512)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def rendezvous_environment(transport: Transport) -> Iterator[dict[str, str]]:
    """Yield the rendezvous variables that every rank of ``transport`` needs.

    Always a fresh ``TRIORING_JOB_ID`` and ``TRIORING_SECRET``. For ``unix``:
    ``TRIORING_SOCKET_DIR`` names a new private directory (mode 0700, made by
    :func:`tempfile.mkdtemp`), removed with everything in it when the context exits, whether
    normally, by exception or by cancellation. For ``tcp``: ``MASTER_ADDR=127.0.0.1``, the
    ``MASTER_PORT`` of a socket the launcher is already listening on, and that socket's
    descriptor as ``TRIORING_LISTEN_FD`` (passed to rank 0 only).
    """
    # Every job gets its own id and secret, so that two jobs on one host can never join each
    # other, and no other process can join this one without reading our environment.
    job = {
        "TRIORING_JOB_ID": f"run-{secrets.token_hex(6)}",
        "TRIORING_SECRET": secrets.token_hex(32),
    }
    if transport == "tcp":
        host = "127.0.0.1"
        with _listening_socket(host) as sock:
            yield {
                **job,
                "TRIORING_TRANSPORT": "tcp",
                "MASTER_ADDR": host,
                "MASTER_PORT": str(sock.getsockname()[1]),
                "TRIORING_LISTEN_FD": str(sock.fileno()),
            }
        return
    # A short prefix in the default temp dir: socket paths must fit in sun_path (108 bytes).
    # "-run-" tells our directories from the ones UnixTransport makes for itself.
    socket_dir = tempfile.mkdtemp(prefix="trioring-run-")
    try:
        yield {**job, "TRIORING_TRANSPORT": "unix", "TRIORING_SOCKET_DIR": socket_dir}
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


def rank_environment(
    base: Mapping[str, str], rendezvous: Mapping[str, str], *, rank: int, world_size: int
) -> dict[str, str]:
    """The full environment of one rank: ``base`` without stale rendezvous variables, plus
    ``rendezvous`` and the rank variables (single machine, so local equals global)."""
    env = {k: v for k, v in base.items() if k not in _RENDEZVOUS_VARIABLES}
    env.update(rendezvous)
    if rank != 0:
        # Only rank 0 listens for the rendezvous, so only it inherits the listening socket.
        env.pop("TRIORING_LISTEN_FD", None)
    env["RANK"] = env["LOCAL_RANK"] = str(rank)
    env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = str(world_size)
    return env


@final
@attrs.define(eq=False)
class _Supervisor:
    """Watches a started set of ranks and decides when and why they are stopped."""

    processes: list[trio.Process]
    grace: float
    stderr: TextIO
    # Why the job is stopping, set once: (rank, returncode) of the first failure, or the
    # signal the launcher received. None while every rank is still allowed to run.
    first_failure: tuple[int, int] | None = None
    received_signal: int | None = None
    terminated: list[int] = attrs.Factory(list)
    killed: list[int] = attrs.Factory(list)

    @property
    def stopping(self) -> bool:
        return self.first_failure is not None or self.received_signal is not None

    async def run(self, signals: AsyncIterator[int] | None) -> int:
        async with trio.open_nursery() as nursery:
            if signals is not None:
                nursery.start_soon(self._watch_signals, signals, nursery)
            async with trio.open_nursery() as ranks:
                for rank, process in enumerate(self.processes):
                    ranks.start_soon(self._watch_rank, rank, process, nursery)
            # Every rank has been reaped: the signal watcher and any grace timer are moot.
            nursery.cancel_scope.cancel()
        return self._report()

    async def _watch_rank(self, rank: int, process: trio.Process, nursery: trio.Nursery) -> None:
        returncode = await process.wait()
        if returncode != 0 and not self.stopping:
            self.first_failure = (rank, returncode)
            self._stop(nursery)

    async def _watch_signals(self, signals: AsyncIterator[int], nursery: trio.Nursery) -> None:
        async for signum in signals:
            if not self.stopping:
                self.received_signal = signum
                self._stop(nursery)
            else:
                # The user asked twice: don't make them wait out the grace period.
                self._kill_remaining()

    def _stop(self, nursery: trio.Nursery) -> None:
        for rank, process in enumerate(self.processes):
            if process.returncode is None:
                process.terminate()
                self.terminated.append(rank)
        nursery.start_soon(self._kill_after_grace)

    async def _kill_after_grace(self) -> None:
        await trio.sleep(self.grace)
        self._kill_remaining()

    def _kill_remaining(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.returncode is None:
                process.kill()
                if rank not in self.killed:
                    self.killed.append(rank)

    def _report(self) -> int:
        if self.first_failure is not None:
            rank, returncode = self.first_failure
            reason = f"rank {rank} {_describe_exit(returncode)} (first failure)"
            status = exit_status(returncode)
        elif self.received_signal is not None:
            reason = f"received {_signal_name(self.received_signal)}"
            status = 128 + self.received_signal
        else:
            return 0
        if self.terminated:
            stopped = "terminated ranks " + ", ".join(map(str, self.terminated))
        else:
            stopped = "no other rank was running"
        if self.killed:
            stopped += (
                f" (SIGKILL after {self.grace:g} s grace: ranks {', '.join(map(str, self.killed))})"
            )
        print(f"trioring run: {reason}; {stopped}", file=self.stderr, flush=True)
        return status


@contextlib.contextmanager
def _stop_signal_receiver() -> Iterator[AsyncIterator[int] | None]:
    """Receive the signals that stop the job; None if every one of them is ignored."""
    # Respect an inherited SIG_IGN: whoever started us (nohup, a shell without job control)
    # asked for the job to survive that signal. The ranks inherit the same disposition.
    candidates = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    wanted = [signum for signum in candidates if signal.getsignal(signum) is not signal.SIG_IGN]
    if not wanted:  # trio refuses an empty set
        yield None
        return
    with trio.open_signal_receiver(*wanted) as receiver:
        yield receiver


async def _kill_and_reap(processes: Sequence[trio.Process]) -> None:
    # Last resort on error or cancellation: nothing we started may outlive us. Shielded,
    # because we usually get here *because* we were cancelled.
    for process in processes:
        if process.returncode is None:
            process.kill()
    with trio.move_on_after(_REAP_AFTER_KILL_S, shield=True):
        for process in processes:
            await process.wait()


# After the last rank exits, how long its output may still take to drain (a grandchild that
# inherited the pipe could hold it open forever).
_OUTPUT_DRAIN_S = 2.0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def _forward_lines(stream: trio.abc.ReceiveStream, fd: int, prefix: bytes) -> None:
    """Copy ``stream`` to ``fd`` one whole line at a time, each with ``prefix``. Lines of
    different ranks never interleave mid-line: each goes out in one synchronous write loop,
    which no other task can interrupt. A last line without a newline gets one."""
    pending = b""
    async for chunk in stream:
        *lines, pending = (pending + chunk).split(b"\n")
        if lines:
            _write_all(fd, b"".join(prefix + line + b"\n" for line in lines))
    if pending:
        _write_all(fd, prefix + pending + b"\n")


async def launch(spec: LaunchSpec) -> int:
    """Run ``spec.nprocs`` ranks of ``spec.command`` until they finish; return the job's status.

    See the module docstring for the full contract. Must run in the main thread (it handles
    ``SIGINT``, ``SIGTERM`` and ``SIGHUP``); the one-line summary of a failure goes to
    :data:`sys.stderr`.
    """
    # The signal receiver is installed before the first rank starts, so no signal can land in
    # a window where it would raise KeyboardInterrupt past live ranks.
    with (
        _stop_signal_receiver() as signals,
        rendezvous_environment(spec.transport) as rendezvous,
    ):
        processes: list[trio.Process] = []
        tag = spec.tagging()
        pipe = subprocess.PIPE if tag else None
        try:
            async with trio.open_nursery() as forwarding:
                for rank in range(spec.nprocs):
                    env = rank_environment(
                        os.environ, rendezvous, rank=rank, world_size=spec.nprocs
                    )
                    inherited = env.get("TRIORING_LISTEN_FD")
                    process = await trio.lowlevel.open_process(
                        spec.command,
                        env=env,
                        stdout=pipe,
                        stderr=pipe,
                        pass_fds=(int(inherited),) if inherited else (),
                    )
                    processes.append(process)
                    if tag:
                        assert process.stdout is not None
                        assert process.stderr is not None
                        prefix = f"[{rank}] ".encode()
                        forwarding.start_soon(
                            _forward_lines, process.stdout, sys.stdout.fileno(), prefix
                        )
                        forwarding.start_soon(
                            _forward_lines, process.stderr, sys.stderr.fileno(), prefix
                        )
                status = await _Supervisor(processes, spec.grace, sys.stderr).run(signals)
                forwarding.cancel_scope.deadline = trio.current_time() + _OUTPUT_DRAIN_S
        finally:
            await _kill_and_reap(processes)
    return status


def run(spec: LaunchSpec) -> int:
    """Synchronous entry point: :func:`launch` under :func:`trio.run`."""
    return trio.run(launch, spec)
