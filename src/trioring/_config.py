"""Resolve open_communicator's arguments against the environment, before any I/O."""

from __future__ import annotations

import ipaddress
import os
import stat
from typing import TYPE_CHECKING, final

import attrs

from ._auth import Credentials
from ._errors import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Mapping

DEFAULT_TRANSPORT = "tcp"


@final
@attrs.frozen(kw_only=True)
class Config:
    rank: int
    world_size: int
    transport: str
    master_addr: str | None
    master_port: int | None
    socket_dir: str | None
    #: Where the transport name came from, for error messages ("TRIORING_TRANSPORT='x'").
    transport_source: str = "default"
    credentials: Credentials = attrs.field(factory=lambda: Credentials(b"", ""))

    @property
    def rendezvous_over_socket_dir(self) -> bool:
        return self.transport == "unix" and self.socket_dir is not None


def _int(
    value: int | None,
    argument: str,
    variable: str,
    env: Mapping[str, str],
    *,
    minimum: int,
    maximum: int | None = None,
    required: bool = True,
) -> int | None:
    if value is not None:
        # bool is an int subclass; rank=True is a bug, not rank 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(f"{argument}= must be an int, got {value!r}")
        source = f"{argument}={value}"
        number = value
    else:
        raw = env.get(variable)
        if raw is None or raw.strip() == "":
            if not required:
                return None
            raise ConfigurationError(
                f"{variable} is not set: pass {argument}= to open_communicator() or set the "
                f"{variable} environment variable"
            )
        try:
            number = int(raw.strip())
        except ValueError:
            raise ConfigurationError(f"{variable}={raw!r} is not an integer") from None
        source = f"{variable}={raw}"
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
    """Apply the documented precedence (explicit argument, then environment, then default)
    and validate everything, raising :class:`ConfigurationError` naming the culprit."""
    if env is None:
        env = os.environ
    size = _int(world_size, "world_size", "WORLD_SIZE", env, minimum=1)
    me = _int(rank, "rank", "RANK", env, minimum=0)
    assert size is not None
    assert me is not None
    if me >= size:
        raise ConfigurationError(
            f"rank {me} is out of range for world size {size}: ranks are 0..{size - 1} "
            "(check RANK and WORLD_SIZE)"
        )

    if transport is None:
        raw_transport = env.get("TRIORING_TRANSPORT", "").strip()
        transport = raw_transport or DEFAULT_TRANSPORT
        transport_source = f"TRIORING_TRANSPORT={raw_transport!r}" if raw_transport else "default"
    elif not isinstance(transport, str) or not transport:
        raise ConfigurationError(f"transport= must be a transport name, got {transport!r}")
    else:
        transport_source = f"transport={transport!r}"

    socket_dir = env.get("TRIORING_SOCKET_DIR", "").strip() or None
    if socket_dir is not None and transport == "unix" and not os.path.isdir(socket_dir):
        raise ConfigurationError(
            f"TRIORING_SOCKET_DIR={socket_dir!r} is not an existing directory; create it "
            "(shared by all ranks, mode 0700) or unset it"
        )

    needs_address = size > 1 and not (transport == "unix" and socket_dir is not None)
    if master_addr is None:
        master_addr = env.get("MASTER_ADDR", "").strip() or None
    elif not isinstance(master_addr, str) or not master_addr.strip():
        raise ConfigurationError(f"master_addr= must be a non-empty string, got {master_addr!r}")
    if master_addr is None and needs_address:
        raise ConfigurationError(
            "MASTER_ADDR is not set: pass master_addr= to open_communicator() or set the "
            "MASTER_ADDR environment variable (or, for ranks on one host, set "
            "TRIORING_TRANSPORT=unix and TRIORING_SOCKET_DIR to a shared directory)"
        )
    port = _int(
        master_port,
        "master_port",
        "MASTER_PORT",
        env,
        minimum=1,
        maximum=65535,
        required=needs_address,
    )
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
    return Config(
        rank=me,
        world_size=size,
        transport=transport,
        master_addr=master_addr,
        master_port=port,
        socket_dir=socket_dir if transport == "unix" else None,
        transport_source=transport_source,
        credentials=Credentials(secret, job_id(env)),
    )


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
