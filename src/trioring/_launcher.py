"""Start and supervise the ranks of one job on this machine (``trioring run``).

Contract of :func:`launch`:

* Every rank is ``spec.command`` run with the launcher's environment plus ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, the rendezvous variables of
  ``spec.transport`` (see :func:`rendezvous_environment`) and ``TRIORING_RUN_DIR``, and with
  ``OMP_NUM_THREADS=1`` when there are several ranks and it is unset (see
  :func:`limit_threads`; one line on stderr says so). Ranks inherit stdin. Their stdout
  and stderr are inherited unchanged, unless output is tagged (``spec.tag_output``; by
  default when there are several ranks and stdout is a terminal): then every line is
  forwarded whole, prefixed with ``[rank] ``, to the launcher's stdout or stderr.
* If every rank exits with status 0, :func:`launch` returns 0.
* The first rank to exit non-zero or by a signal is *the first failure*, with one exception:
  a rank whose uncaught error only echoes other ranks' failure (a ``PeerFailedError`` naming
  rank 2, say; the rank leaves a note in ``TRIORING_RUN_DIR``, see ``_launched``) is not the
  first failure while a rank it blames is running. It becomes the first failure if the
  ranks it blames all exit without failing on their own, or are still running ``spec.grace``
  seconds after it exited. Once there is a first failure, every rank still running gets
  ``SIGTERM``; whichever are still running ``spec.grace`` seconds later get ``SIGKILL``.
  :func:`launch` returns the first failure's exit status (``128 + signal number`` for a
  signal, as a shell reports it), and one line on stderr names it, the ranks whose errors
  echoed a failure, those that were exiting on an error of their own meanwhile, and the
  ranks that had to be terminated; where the first failure was an uncaught error in a
  process that imported trioring, a line before it gives that error's type and message
  (the rank tells the launcher, see ``_launched``). Ranks that exit after being told to
  stop are not failures.
* ``SIGINT``, ``SIGTERM`` or ``SIGHUP`` delivered to the launcher stops the ranks the same
  way and :func:`launch` returns ``128 + signal number``. A second signal during the grace
  period skips the rest of it and sends ``SIGKILL`` at once. A signal the launcher inherited
  as ignored (``nohup``, background jobs of a non-interactive shell) stays ignored.
* :func:`launch` never returns or raises while a rank it started may still be running: any
  error or cancellation inside it kills and reaps every rank before propagating. The one case
  no process can cover is the launcher itself being killed with ``SIGKILL``; ranks share the
  launcher's process group, so a terminal's Ctrl-C or hangup still reaches them then.
  Processes that ranks start themselves are theirs to clean up.
* The Unix socket directory and ``TRIORING_RUN_DIR`` are created before the first rank
  starts and removed before :func:`launch` returns or raises, whatever happened.
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

from ._launched import (
    RUN_DIR_VARIABLE,
    left_early,
    note_calls,
    odd_calls,
    read_calls,
    read_echo,
    read_error,
)
from ._util import socket_temp_root

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
    RUN_DIR_VARIABLE,
)

#: What the launcher prints when it sets OMP_NUM_THREADS (once, on stderr), as torchrun does.
THREADS_NOTE = (
    "trioring run: setting OMP_NUM_THREADS=1 for every rank (it was not set), so that the "
    "ranks' OpenMP and BLAS threads do not fight over the cores; set OMP_NUM_THREADS to "
    "choose another value"
)


def limit_threads(env: dict[str, str], nprocs: int) -> bool:
    """Set ``OMP_NUM_THREADS=1`` in ``env`` when there are several ranks and it is unset (or
    empty); return whether it was set. As torchrun does: N ranks that each start one BLAS or
    OpenMP thread per core oversubscribe the machine N times (a 2-rank numpy training loop
    ran 10x slower). OpenBLAS, MKL, BLIS and OpenMP itself all fall back to this variable;
    their own variables (``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ...) take precedence
    for their library and are left alone, as is a value the user set."""
    if nprocs < 2 or env.get("OMP_NUM_THREADS", "").strip():
        return False
    env["OMP_NUM_THREADS"] = "1"
    return True


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


def _ended_as(returncode: int, ranks: int) -> str:
    """``exited with code 2``, or ``was killed by SIGINT`` (``were``, said of several ranks)."""
    if returncode < 0:
        return f"{'was' if ranks == 1 else 'were'} killed by {_signal_name(-returncode)}"
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
    # A short prefix in the default temp dir (or /tmp where that is too long): socket paths
    # must fit in sun_path (108 bytes). "-run-" tells our directories from the ones
    # UnixTransport makes for itself.
    root = socket_temp_root(len("trioring-run-") + 8)
    socket_dir = tempfile.mkdtemp(prefix="trioring-run-", dir=root)
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


def _rank_list(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


@final
@attrs.define(eq=False)
class _Supervisor:
    """Watches a started set of ranks and decides when and why they are stopped.

    A rank that fails with an error that only echoes other ranks' failure (it says so in
    ``run_dir``, see ``_launched``) is not taken for the first failure while a rank it blames
    is still running: peers of a crashed rank often exit before it does, and the crashed rank
    must be named, and not be stopped half-way through printing its traceback. If the blamed
    ranks have all exited without failing on their own, or are still running ``grace``
    seconds later, the first echoing rank is the first failure after all.
    """

    processes: list[trio.Process]
    grace: float
    stderr: TextIO
    run_dir: str | None = None
    # Why the job is stopping, set once: (rank, returncode) of the first failure, or the
    # signal the launcher received. None while every rank is still allowed to run.
    first_failure: tuple[int, int] | None = None
    received_signal: int | None = None
    terminated: list[int] = attrs.Factory(list)
    killed: list[int] = attrs.Factory(list)
    # The signal that cut the grace period short, if one did (see _watch_signals).
    second_signal: int | None = None
    # rank -> the ranks its failure echoes, for every rank that exited with an echo.
    echoes: dict[int, frozenset[int]] = attrs.Factory(dict)
    # The first echoing exit (rank, returncode), while we wait for the ranks it blames.
    pending_echo: tuple[int, int] | None = None
    # rank -> its uncaught error in one line, for every rank that exited non-zero on one.
    errors: dict[int, str] = attrs.Factory(dict)
    # rank -> its call, from every side of the mismatches that ranks exited on, and the
    # ranks that named their own (see note_calls).
    calls: dict[int, str] = attrs.Factory(dict)
    self_named: set[int] = attrs.Factory(set)

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

    def _echo_of(self, rank: int) -> frozenset[int] | None:
        if rank not in self.echoes and self.run_dir is not None:
            echoed = read_echo(self.run_dir, self.processes[rank].pid)
            if echoed is not None:
                self.echoes[rank] = echoed
        return self.echoes.get(rank)

    async def _watch_rank(self, rank: int, process: trio.Process, nursery: trio.Nursery) -> None:
        returncode = await process.wait()
        # Read even once stopping: the report says which ranks failed because of another,
        # and which failed on an error of their own meanwhile.
        echoed = self._echo_of(rank) if returncode != 0 else None
        if returncode != 0 and echoed is None and self.run_dir is not None:
            error = read_error(self.run_dir, process.pid)
            if error is not None:
                self.errors[rank] = error
        if returncode != 0 and self.run_dir is not None:
            note_calls(self.calls, self.self_named, rank, read_calls(self.run_dir, process.pid))
        if returncode == 0 or self.stopping:
            self._settle_pending(nursery)
            return
        if echoed is None:
            self._fail(rank, returncode, nursery)
            return
        if self.pending_echo is None:
            self.pending_echo = (rank, returncode)
            nursery.start_soon(self._settle_after_grace, nursery)
        self._settle_pending(nursery)

    def _settle_pending(self, nursery: trio.Nursery) -> None:
        """Decide the pending echo once every rank it (or a later echo) blames has exited: a
        blamed rank that failed on its own is the first failure, else the echo is."""
        if self.pending_echo is None or self.stopping:
            return
        blamed = sorted(set().union(*self.echoes.values()) - set(self.echoes))
        outcomes = []
        for rank in blamed:
            if not 0 <= rank < len(self.processes):
                continue
            returncode = self.processes[rank].returncode
            if returncode is None:
                return  # still running: its own failure may be on its way
            outcomes.append((rank, returncode))
        for rank, returncode in outcomes:
            # Its watcher may not have run yet: look at its report here.
            if returncode != 0 and self._echo_of(rank) is None:
                self._fail(rank, returncode, nursery)
                return
        self._fail(*self.pending_echo, nursery)

    async def _settle_after_grace(self, nursery: trio.Nursery) -> None:
        await trio.sleep(self.grace)
        if self.pending_echo is not None and not self.stopping:
            self._fail(*self.pending_echo, nursery)

    def _fail(self, rank: int, returncode: int, nursery: trio.Nursery) -> None:
        self.first_failure = (rank, returncode)
        self._stop(nursery)

    async def _watch_signals(self, signals: AsyncIterator[int], nursery: trio.Nursery) -> None:
        async for signum in signals:
            if not self.stopping:
                self.received_signal = signum
                self._stop(nursery)
            else:
                # The user asked twice: don't make them wait out the grace period.
                self.second_signal = self.second_signal or signum
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
            first, returncode = self.first_failure
            reason = f"rank {first} {_describe_exit(returncode)} (first failure)"
            status = exit_status(returncode)
        elif self.received_signal is not None:
            first = None
            reason = f"received {_signal_name(self.received_signal)}"
            status = 128 + self.received_signal
        else:
            return 0
        parts = [reason]
        echoed = {rank: ranks for rank, ranks in self.echoes.items() if rank != first}
        if echoed:
            if first is not None and all(first in ranks for ranks in echoed.values()):
                parts.append(f"{_rank_list(echoed)} failed because of it")
            else:
                parts.append(f"{_rank_list(echoed)} failed because another rank did")
        # A rank that reported an echo after SIGTERM exited on its own: it is listed above;
        # so is one that was exiting, or had exited, on an error of its own (another rank of
        # a mismatched call, say, which saw the mismatch itself).
        also = sorted(rank for rank in self.errors if rank != first and rank not in echoed)
        if also:
            parts.append(
                f"{_rank_list(also)} failed on {'its' if len(also) == 1 else 'their'} own too"
            )
        # Ranks that had ended before the others were stopped, with no word of why (every
        # rank failing alike at once, or killed by the same signal): how each ended.
        ended: dict[int, list[int]] = {}
        for rank, process in enumerate(self.processes):
            code = process.returncode
            if code and rank not in self.terminated and rank not in (first, *echoed, *also):
                ended.setdefault(code, []).append(rank)
        for code, ranks in ended.items():
            parts.append(f"{_rank_list(ranks)} {_ended_as(code, len(ranks))} too")
        terminated = [rank for rank in self.terminated if rank not in echoed and rank not in also]
        if terminated:
            parts.append("terminated ranks " + ", ".join(map(str, terminated)))
        elif not echoed and not also and not ended:
            parts.append("no other rank was running")
        if self.killed:
            when = (
                f"after {self.grace:g} s grace"
                if self.second_signal is None
                else f"at a second signal, {_signal_name(self.second_signal)}"
            )
            parts[-1] += f" (SIGKILL {when}: ranks {', '.join(map(str, self.killed))})"
        parts += left_early(self.echoes, [process.returncode for process in self.processes])
        if first is not None and first in self.errors:
            # Its traceback may be far above, among the other ranks' output.
            print(f"trioring run: rank {first} raised {self.errors[first]}", file=self.stderr)
        if (odd := odd_calls(self.calls)) is not None:
            # The first failure is whichever rank saw the mismatch first, not the one whose
            # call was wrong.
            print(f"trioring run: {odd}", file=self.stderr)
        print(f"trioring run: {'; '.join(parts)}", file=self.stderr, flush=True)
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


@contextlib.contextmanager
def _run_directory() -> Iterator[str]:
    """A private directory (mode 0700) for the ranks' notes to the launcher (``_launched``),
    removed with everything in it when the context exits."""
    path = tempfile.mkdtemp(prefix="trioring-run-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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
    base = dict(os.environ)
    if limit_threads(base, spec.nprocs):
        print(THREADS_NOTE, file=sys.stderr, flush=True)
    # The signal receiver is installed before the first rank starts, so no signal can land in
    # a window where it would raise KeyboardInterrupt past live ranks.
    with (
        _stop_signal_receiver() as signals,
        rendezvous_environment(spec.transport) as rendezvous,
        _run_directory() as run_dir,
    ):
        processes: list[trio.Process] = []
        tag = spec.tagging()
        pipe = subprocess.PIPE if tag else None
        job = {**rendezvous, RUN_DIR_VARIABLE: run_dir}
        try:
            async with trio.open_nursery() as forwarding:
                for rank in range(spec.nprocs):
                    env = rank_environment(base, job, rank=rank, world_size=spec.nprocs)
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
                supervisor = _Supervisor(processes, spec.grace, sys.stderr, run_dir)
                status = await supervisor.run(signals)
                forwarding.cancel_scope.deadline = trio.current_time() + _OUTPUT_DRAIN_S
        finally:
            await _kill_and_reap(processes)
    return status


def run(spec: LaunchSpec) -> int:
    """Synchronous entry point: :func:`launch` under :func:`trio.run`."""
    return trio.run(launch, spec)
