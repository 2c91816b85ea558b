"""Resolve open_communicator's arguments against the environment, before any I/O."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, final

import attrs

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
        transport = env.get("TRIORING_TRANSPORT", "").strip() or DEFAULT_TRANSPORT
    elif not isinstance(transport, str) or not transport:
        raise ConfigurationError(f"transport= must be a transport name, got {transport!r}")

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
    return Config(
        rank=me,
        world_size=size,
        transport=transport,
        master_addr=master_addr,
        master_port=port,
        socket_dir=socket_dir if transport == "unix" else None,
    )
