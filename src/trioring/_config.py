"""Resolve open_communicator's arguments against the environment, before any I/O."""

from __future__ import annotations

import ipaddress
import os
import stat
import struct
from typing import TYPE_CHECKING, final

import attrs

from ._auth import Credentials
from ._collectives import _decision
from ._errors import ConfigurationError
from ._launchers import detect
from .transports._abc import DEFAULT_PEER_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Mapping

DEFAULT_TRANSPORT = "tcp"
#: How long a receive polls (yielding the CPU between tries) before parking, by default.
DEFAULT_SPIN_US = 50
_MAX_SPIN_US = 10_000
# TRIORING_PEER_TIMEOUT is whole seconds, as the kernel's keepalive times are; below 2 s the
# probes cannot be spread (transports/_liveness.py), above a day it is as good as off.
_MIN_PEER_TIMEOUT = 2
_MAX_PEER_TIMEOUT = 86_400


@final
@attrs.frozen(kw_only=True)
class Config:
    rank: int
    world_size: int
    transport: str
    master_addr: str | None
    master_port: int | None
    socket_dir: str | None
    #: A listening TCP socket inherited from the launcher for rank 0's rendezvous
    #: (TRIORING_LISTEN_FD): no find-a-free-port-then-bind race between jobs.
    listen_fd: int | None = None
    #: The IPv4 address of the interface TRIORING_IFNAME names, where data listeners bind.
    interface_address: str | None = None
    #: The socket directory was derived (not given): remove it once it is empty.
    socket_dir_derived: bool = False
    #: Where the transport name came from, for error messages ("TRIORING_TRANSPORT='x'").
    transport_source: str = "default"
    credentials: Credentials = attrs.field(factory=lambda: Credentials(b"", ""))
    #: Bounded poll before a receive parks (TRIORING_SPIN_US); 0 turns it off.
    spin_seconds: float = 0.0
    #: Whether TRIORING_SPIN_US set it. If not, a communicator polls only where that can
    #: help, which it tells once it knows where its peers run (see _onehost._cpus).
    spin_given: bool = False
    #: Whether this rank offers cross-memory attach for large collectives (TRIORING_CMA).
    cma: bool = True
    #: Whether this rank offers a shared segment for small collectives (TRIORING_SHM).
    shm: bool = True
    #: Whether this rank offers to read large arrays from its peers in two threads where
    #: the host's CPUs allow (TRIORING_THREADS; see _onehost._cma_collectives.read_threads).
    threads: bool = True
    #: Whether this rank offers, where every rank of the host has a CPU, to have a
    #: broadcast's root write a share of its array into the readers' arrays (TRIORING_PUSH;
    #: see _onehost._push).
    push: bool = True
    #: Seconds without an answer from a peer's host before its TCP connection fails
    #: (TRIORING_PEER_TIMEOUT); None when turned off.
    peer_timeout: float | None = DEFAULT_PEER_TIMEOUT
    #: Algorithms forced per collective (TRIORING_ALGORITHM; see _collectives._decision).
    algorithms: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def rendezvous_over_socket_dir(self) -> bool:
        return self.transport == "unix" and self.socket_dir is not None


def _first(
    value: object | None,
    argument: str,
    variables: tuple[str, ...],
    env: Mapping[str, str],
    hint: tuple[str, str] | None,
) -> tuple[object | None, str]:
    """The first setting found: the argument, then each variable, then the launcher hint.
    Returns the raw value and a description of where it came from."""
    if value is not None:
        return value, f"{argument}="
    for variable in variables:
        raw = env.get(variable, "").strip()
        if raw:
            return raw, f"{variable}="
    if hint is not None:
        label = hint[1]
        return hint[0], f"{label}=" if label.isidentifier() else f"{label} = "
    return None, ""


def _int(
    value: int | None,
    argument: str,
    variables: tuple[str, ...],
    env: Mapping[str, str],
    *,
    hint: tuple[str, str] | None = None,
    minimum: int,
    maximum: int | None = None,
    required: bool = True,
) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        # bool is an int subclass; rank=True is a bug, not rank 1.
        raise ConfigurationError(f"{argument}= must be an int, got {value!r}")
    raw, origin = _first(value, argument, variables, env, hint)
    if raw is None:
        if not required:
            return None
        main = variables[-1]
        raise ConfigurationError(
            f"{main} is not set: pass {argument}= to open_communicator() or set the {main} "
            f"environment variable (or {variables[0]}, or start the ranks with a launcher "
            "that sets them: trioring run, torchrun, mpirun, srun)"
        )
    if isinstance(raw, int):
        number, source = raw, f"{origin}{raw}"
    else:
        source = f"{origin}{raw}" if origin.endswith("=") else f"{origin}{raw!r}"
        try:
            number = int(str(raw))
        except ValueError:
            raise ConfigurationError(f"{origin}{raw!r} is not an integer") from None
    if number < minimum or (maximum is not None and number > maximum):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ConfigurationError(f"{source} is out of range: it must be {bounds}")
    return number


def resolve(
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    transport: str | None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Apply the documented precedence and validate everything before any I/O, raising
    :class:`ConfigurationError` naming the culprit.

    Precedence, first found wins: the explicit argument; ``TRIORING_RANK``,
    ``TRIORING_WORLD_SIZE``, ``TRIORING_MASTER_ADDR``, ``TRIORING_MASTER_PORT``; ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; the launcher's own variables (see
    :mod:`trioring._launchers`). Under torchrun, whose agent holds ``MASTER_PORT``, the
    port is ``MASTER_PORT + 1`` unless ``TRIORING_MASTER_PORT`` is set.
    """
    if env is None:
        env = os.environ
    hints = detect(env)
    size = _int(
        world_size,
        "world_size",
        ("TRIORING_WORLD_SIZE", "WORLD_SIZE"),
        env,
        hint=hints.world_size,
        minimum=1,
    )
    me = _int(rank, "rank", ("TRIORING_RANK", "RANK"), env, hint=hints.rank, minimum=0)
    assert size is not None
    assert me is not None
    if me >= size:
        raise ConfigurationError(
            f"rank {me} is out of range for world size {size}: ranks are 0..{size - 1} "
            "(check RANK and WORLD_SIZE)"
        )

    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr.strip()):
        raise ConfigurationError(f"master_addr= must be a non-empty string, got {master_addr!r}")
    raw_addr, _ = _first(
        master_addr, "master_addr", ("TRIORING_MASTER_ADDR", "MASTER_ADDR"), env, hints.master_addr
    )
    master_addr = None if raw_addr is None else str(raw_addr).strip()

    socket_dir = env.get("TRIORING_SOCKET_DIR", "").strip() or None
    socket_dir_derived = False
    if transport is None:
        raw_transport = env.get("TRIORING_TRANSPORT", "").strip()
        transport = raw_transport or DEFAULT_TRANSPORT
        transport_source = f"TRIORING_TRANSPORT={raw_transport!r}" if raw_transport else "default"
        if not raw_transport and size > 1 and hints.all_local is not None:
            # The launcher started every rank on this host: Unix sockets, and with them the
            # one-host paths (shared segment, cross-memory attach). Under torchrun at world 2
            # (2 vCPUs) a 4-byte allreduce took 55-56 us so against 85-87 over TCP loopback,
            # a 4 MiB one 1.1-1.3 ms against 2.9-3.2. With no address, the ranks meet in a
            # directory each names by itself; with one (torchrun always gives one), there.
            local = f"{hints.launcher} (every rank on this host: {hints.all_local})"
            if master_addr is not None or socket_dir is not None:
                transport, transport_source = "unix", local
            elif hints.local_socket_dir is not None:
                transport, transport_source = "unix", local
                socket_dir = _ensure_private_dir(hints.local_socket_dir)
                socket_dir_derived = True
    elif not isinstance(transport, str) or not transport:
        raise ConfigurationError(f"transport= must be a transport name, got {transport!r}")
    else:
        transport_source = f"transport={transport!r}"

    if socket_dir is not None and transport == "unix" and not os.path.isdir(socket_dir):
        raise ConfigurationError(
            f"TRIORING_SOCKET_DIR={socket_dir!r} is not an existing directory; create it "
            "(shared by all ranks, mode 0700) or unset it"
        )

    needs_address = size > 1 and not (transport == "unix" and socket_dir is not None)
    if master_addr is None and needs_address:
        raise ConfigurationError(
            "MASTER_ADDR is not set: pass master_addr= to open_communicator() or set the "
            "MASTER_ADDR environment variable (or, for ranks on one host, set "
            "TRIORING_TRANSPORT=unix and TRIORING_SOCKET_DIR to a shared directory)"
        )
    port_variables: tuple[str, ...] = ("TRIORING_MASTER_PORT", "MASTER_PORT")
    port_hint = hints.master_port
    if hints.launcher == "torchrun" and port_hint is not None:
        # MASTER_PORT belongs to torchrun's agent: binding it would fail with EADDRINUSE.
        port_variables = ("TRIORING_MASTER_PORT",)
    port = _int(
        master_port,
        "master_port",
        port_variables,
        env,
        hint=port_hint,
        minimum=1,
        maximum=65535,
        required=needs_address,
    )
    if port is None and needs_address:  # pragma: no cover - _int raised already
        raise ConfigurationError("MASTER_PORT is not set")
    secret = _secret(env)
    if (
        not secret
        and master_addr is not None
        and needs_address
        and transport != "memory"
        and not _is_loopback(master_addr)
        and env.get("TRIORING_ALLOW_INSECURE", "").strip() != "1"
    ):
        raise ConfigurationError(
            f"MASTER_ADDR={master_addr} is not a loopback address and no secret is set: any "
            "host that can reach it could join the job. Set TRIORING_SECRET (the same random "
            "string on every rank, e.g. from `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`) or TRIORING_SECRET_FILE (a file of mode 0600); "
            "or set TRIORING_ALLOW_INSECURE=1 on a network you trust"
        )
    listen_fd = _listen_fd(env) if me == 0 and needs_address and transport != "memory" else None
    ifname = env.get("TRIORING_IFNAME", "").strip()
    interface_address = _interface_address(ifname) if ifname else None
    return Config(
        rank=me,
        world_size=size,
        transport=transport,
        master_addr=master_addr,
        master_port=port,
        socket_dir=socket_dir if transport == "unix" else None,
        socket_dir_derived=socket_dir_derived,
        interface_address=interface_address,
        listen_fd=listen_fd,
        transport_source=transport_source,
        credentials=Credentials(secret, job_id(env)),
        spin_seconds=spin_seconds(env),
        spin_given=bool(env.get("TRIORING_SPIN_US", "").strip()),
        cma=_flag(env, "TRIORING_CMA", default=True),
        shm=_flag(env, "TRIORING_SHM", default=True),
        threads=_flag(env, "TRIORING_THREADS", default=True),
        push=_flag(env, "TRIORING_PUSH", default=True),
        peer_timeout=peer_timeout(env),
        algorithms=_decision.parse_forced(env),
    )


def spin_seconds(env: Mapping[str, str]) -> float:
    """TRIORING_SPIN_US as seconds, by default DEFAULT_SPIN_US. Unless it was given, a
    communicator turns polling off where a peer can run only on this rank's one CPU (see
    ``_onehost._cpus.spin_for``)."""
    raw = env.get("TRIORING_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US / 1e6
    if not raw.isdigit() or int(raw) > _MAX_SPIN_US:
        raise ConfigurationError(
            f"TRIORING_SPIN_US={raw!r}: expected microseconds, an integer from 0 (no polling) "
            f"to {_MAX_SPIN_US}"
        )
    return int(raw) / 1e6


def peer_timeout(env: Mapping[str, str]) -> float | None:
    """TRIORING_PEER_TIMEOUT as seconds (DEFAULT_PEER_TIMEOUT when unset); None for 0, off."""
    raw = env.get("TRIORING_PEER_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_PEER_TIMEOUT
    if (
        raw.isascii()
        and raw.isdigit()
        and (int(raw) == 0 or _MIN_PEER_TIMEOUT <= int(raw) <= _MAX_PEER_TIMEOUT)
    ):
        return float(raw) if int(raw) else None
    raise ConfigurationError(
        f"TRIORING_PEER_TIMEOUT={raw!r}: expected whole seconds from {_MIN_PEER_TIMEOUT} to "
        f"{_MAX_PEER_TIMEOUT} (after how long a peer whose host no longer answers counts as "
        "failed), or 0 to leave it to the operating system"
    )


def _flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if raw in ("0", "1"):
        return raw == "1"
    raise ConfigurationError(f"{name}={raw!r}: expected 1 (on) or 0 (off)")


def _listen_fd(env: Mapping[str, str]) -> int | None:
    raw = env.get("TRIORING_LISTEN_FD", "").strip()
    if not raw:
        return None
    try:
        fd = int(raw)
        is_socket = stat.S_ISSOCK(os.fstat(fd).st_mode)
    except (ValueError, OSError):
        is_socket = False
    if not is_socket:
        raise ConfigurationError(
            f"TRIORING_LISTEN_FD={raw!r} is not an open socket inherited from the launcher"
        )
    return fd


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux), for TRIORING_IFNAME."""
    import fcntl
    import socket

    siocgifaddr = 0x8915
    known = [interface for _, interface in socket.if_nameindex()]
    if name not in known:
        raise ConfigurationError(
            f"TRIORING_IFNAME={name!r} is not a network interface here; known: {', '.join(known)}"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15])
            )
        except OSError:
            raise ConfigurationError(f"TRIORING_IFNAME={name!r} has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


def _ensure_private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if needed; refuse one that another user owns or others can
    write to, since its sockets would then not be ours."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigurationError(f"cannot create the socket directory {path!r}: {exc}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigurationError(
            f"{path!r} is not a private directory of this user (mode 0700); remove it or set "
            "TRIORING_SOCKET_DIR"
        )
    return path


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


#: Launcher variables a job id is derived from when TRIORING_JOB_ID is not set, in order.
JOB_ID_VARIABLES = (
    "TRIORING_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "PMIX_NAMESPACE",
    "OMPI_MCA_ess_base_jobid",
)


def job_id(env: Mapping[str, str]) -> str:
    """The job id: ``TRIORING_JOB_ID``, else the launcher's job or run id, else empty."""
    for name in JOB_ID_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            if name == "SLURM_JOB_ID" and env.get("SLURM_STEP_ID", "").strip():
                return f"slurm-{value}.{env['SLURM_STEP_ID'].strip()}"
            return value if name == "TRIORING_JOB_ID" else f"{name}={value}"
    return ""


_MIN_SECRET_BYTES = 16


def _secret(env: Mapping[str, str]) -> bytes:
    """The shared secret from TRIORING_SECRET, or from the file TRIORING_SECRET_FILE names.
    Errors never include the secret itself."""
    value = env.get("TRIORING_SECRET", "")
    path = env.get("TRIORING_SECRET_FILE", "").strip()
    if value and path:
        raise ConfigurationError("set TRIORING_SECRET or TRIORING_SECRET_FILE, not both")
    if path:
        try:
            info = os.stat(path)
            with open(path, "rb") as file:
                data = file.read(65537).strip()
        except OSError as exc:
            raise ConfigurationError(
                f"TRIORING_SECRET_FILE={path!r} cannot be read: {exc.strerror}"
            ) from None
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ConfigurationError(
                f"TRIORING_SECRET_FILE={path!r} has mode {stat.S_IMODE(info.st_mode):04o}; other "
                f"users could read it. Run `chmod 600 {path}`"
            )
        if info.st_uid != os.getuid():
            raise ConfigurationError(
                f"TRIORING_SECRET_FILE={path!r} belongs to another user (uid {info.st_uid})"
            )
        secret = data
        source = "TRIORING_SECRET_FILE"
    else:
        secret = value.strip().encode()
        source = "TRIORING_SECRET"
    if secret and len(secret) < _MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"{source} is too short ({len(secret)} bytes); use at least {_MIN_SECRET_BYTES} "
            "random bytes, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return secret
