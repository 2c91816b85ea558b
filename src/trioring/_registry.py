"""The capability registry: which transports (and gated features) exist, and which can run
here, with the reason when one cannot (like ``torch.distributed.is_gloo_available``)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Literal, final

import attrs

from ._collectives import _limits
from ._config import DEFAULT_SPIN_US, spin_seconds
from ._errors import ConfigurationError, TransportUnavailable
from ._onehost import _cma, _cma_collectives, _push, _shm
from ._p2p import CMA_EAGER_BYTES, EAGER_BYTES
from .transports import MemoryTransport, TcpTransport, Transport, UnixTransport

__all__ = ["Capability", "capabilities", "is_available", "register_transport"]

ENTRY_POINT_GROUP = "trioring.transports"

_BUILTIN: dict[str, type[Transport]] = {
    "tcp": TcpTransport,
    "unix": UnixTransport,
    "memory": MemoryTransport,
}
_registered: dict[str, type[Transport]] = {}


@final
@attrs.frozen(kw_only=True)
class Capability:
    """One row of :func:`capabilities`.

    Attributes:
        name: what to ask for (``"unix"``; a transport's name is what
            ``TRIORING_TRANSPORT`` takes).
        kind: ``"transport"`` or ``"feature"``.
        available: whether it can be used on this machine.
        reason: why not, when ``available`` is false; ``None`` otherwise.
        description: one line saying what it is.
        origin: ``"builtin"``, ``"registered"`` (by :func:`register_transport`) or the
            distribution that declared the entry point.
    """

    name: str
    kind: Literal["transport", "feature"]
    available: bool
    reason: str | None
    description: str
    origin: str


def register_transport(cls: type[Transport], *, replace: bool = False) -> None:
    """Register a transport class under ``cls.name`` for this process.

    Packages should prefer the ``trioring.transports`` entry-point group, which needs no
    import-time side effects; this function is for applications and tests. Raises
    :class:`ConfigurationError` if the name is taken, unless ``replace`` is true.
    """
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ConfigurationError(f"{cls!r} is not a trioring.transports.Transport subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{cls.__qualname__} has no 'name' class attribute")
    if not replace and (name in _BUILTIN or name in _registered):
        raise ConfigurationError(f"a transport named {name!r} is already registered")
    _registered[name] = cls


@attrs.frozen
class _Entry:
    name: str
    origin: str
    cls: type[Transport] | None
    load_error: str | None


def _entries() -> dict[str, _Entry]:
    entries = {name: _Entry(name, "builtin", cls, None) for name, cls in _BUILTIN.items()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in entries:
            continue
        origin = ep.dist.name if ep.dist is not None else ep.value
        try:
            loaded = ep.load()
        except Exception as exc:
            entries[ep.name] = _Entry(ep.name, origin, None, f"failed to load {ep.value}: {exc!r}")
            continue
        if not (isinstance(loaded, type) and issubclass(loaded, Transport)):
            entries[ep.name] = _Entry(
                ep.name, origin, None, f"{ep.value} is not a trioring.transports.Transport"
            )
            continue
        entries[ep.name] = _Entry(ep.name, origin, loaded, None)
    for name, cls in _registered.items():
        entries[name] = _Entry(name, "registered", cls, None)
    return entries


def _row(entry: _Entry) -> Capability:
    if entry.cls is None:
        return Capability(
            name=entry.name,
            kind="transport",
            available=False,
            reason=entry.load_error,
            description="",
            origin=entry.origin,
        )
    try:
        reason = entry.cls.unavailable_reason()
    except Exception as exc:
        reason = f"availability check failed: {exc!r}"
    return Capability(
        name=entry.name,
        kind="transport",
        available=reason is None,
        reason=reason,
        description=entry.cls.description,
        origin=entry.origin,
    )


def _spin_unavailable() -> str | None:
    try:
        seconds = spin_seconds(os.environ)
    except ConfigurationError as exc:
        return str(exc)
    if seconds:
        return None
    return "turned off by TRIORING_SPIN_US=0"


def _shm_unavailable() -> str | None:
    reason = _shm.unavailable_reason()
    if reason is not None:
        return reason
    spin = _spin_unavailable()
    if spin is not None:
        # Parked, a wait on the segment wakes only on the event loop's millisecond timer.
        return f"needs polling (the spin feature), which is off: {spin}"
    return None


def _threads_unavailable() -> str | None:
    if os.environ.get("TRIORING_THREADS", "").strip() == "0":
        return "turned off by TRIORING_THREADS=0"
    cma, shm = _cma.unavailable_reason(), _shm_unavailable()
    if cma is not None or shm is not None:
        return f"needs cma and shm: {cma or shm}"
    if len(os.sched_getaffinity(0)) < _cma_collectives.READ_THREADS:
        return "this process may run on one CPU only"
    return None


def _push_unavailable() -> str | None:
    if os.environ.get("TRIORING_PUSH", "").strip() == "0":
        return "turned off by TRIORING_PUSH=0"
    cma, shm = _cma.unavailable_reason(), _shm_unavailable()
    if cma is not None or shm is not None:
        return f"needs cma and shm: {cma or shm}"
    if not _cma.STORES_IN_ORDER:
        return f"needs x86-64's store order (this is {platform.machine()})"
    return _cma.write_unavailable_reason()


def _features() -> list[Capability]:
    return [
        Capability(
            name=name,
            kind="feature",
            available=reason is None,
            reason=reason,
            description=description,
            origin="builtin",
        )
        for name, reason, description in (
            (
                "cma",
                _cma.unavailable_reason(),
                f"large collectives, and messages above {EAGER_BYTES // 1024} KiB "
                f"({CMA_EAGER_BYTES // 1024} KiB where ranks outnumber cores) on x86-64, "
                "between ranks on one host (unix) copy straight from peers' memory "
                "(process_vm_readv); "
                "off with TRIORING_CMA=0",
            ),
            (
                "shm",
                _shm_unavailable(),
                "barriers and collectives between ranks on one host (unix) go through a "
                f"shared segment instead of sockets: up to {_shm.SHM_MAX_BYTES} bytes "
                f"per rank through its slots ({_shm.SLOT_PAYLOAD_BYTES} for reduce, and "
                "without oversubscription for gather, reduce_scatter and, on Intel CPUs, "
                "broadcast), larger ones streamed through its pipe; off with TRIORING_SHM=0",
            ),
            (
                "spin",
                _spin_unavailable(),
                f"receives poll up to TRIORING_SPIN_US us (default {DEFAULT_SPIN_US}; point-to-"
                "point waits at least 1 ms, taking frames off the sockets themselves) before "
                "they park; 0 turns it off. By default not where a peer on this host can run "
                "only on the one CPU this rank may use (it could not answer while we poll), "
                "nor, on one CPU, over TCP (the peers' CPUs are not known)",
            ),
            (
                "threads",
                _threads_unavailable(),
                "a rank on one host that reads a large array from a peer while the others "
                "only wait (a broadcast of "
                f"{_cma_collectives.READ_THREADS_MIN_BYTES // 2**20} MiB or more) reads it in "
                f"{_cma_collectives.READ_THREADS} threads, where the ranks on the host have "
                "that many CPUs for every such reader; off with TRIORING_THREADS=0",
            ),
            (
                "push",
                _push_unavailable(),
                "ranks on one host write into each other's arrays (process_vm_writev) in "
                f"calls of more than {_pushed_from() // 1024} KiB: each rank of an "
                "allreduce (a reduce) writes each piece of its segment into every other "
                "rank's (the root's) as soon as it has reduced it, and, where every rank "
                "has a CPU of its own, a broadcast's root writes a share of the array into "
                "every other rank's while they read the rest; off with TRIORING_PUSH=0",
            ),
        )
    ]


def _pushed_from() -> int:
    """The bytes above which calls push here: PUSH_MIN_BYTES, or the pipe's limits for
    pushed calls where this CPU's vendor has them higher (see _collectives._limits)."""
    return max(
        _push.PUSH_MIN_BYTES,
        _limits.PIPE_MAX_PUSHED_REDUCE_BYTES,
        _limits.PIPE_MAX_PUSHED_BROADCAST_BYTES,
    )


def capabilities() -> tuple[Capability, ...]:
    """Everything trioring knows about, available here or not, in a stable order (built-in
    transports, then registered and plugin ones, then features). Never raises: a plugin
    that fails to load is listed as unavailable with the error as its reason."""
    return (*(_row(entry) for entry in _entries().values()), *_features())


def is_available(name: str) -> bool:
    """Whether the transport or feature ``name`` can be used here. Unknown names are not
    available. :func:`capabilities` says why not."""
    entry = _entries().get(name)
    if entry is not None:
        return _row(entry).available
    return any(row.name == name and row.available for row in _features())


def get_transport(name: str, *, source: str | None = None) -> type[Transport]:
    """The transport class for ``name``; raises :class:`ConfigurationError` for unknown names
    (naming ``source``, e.g. ``"TRIORING_TRANSPORT='x'"``) and :class:`TransportUnavailable`
    (with the reason) when it cannot run here."""
    entries = _entries()
    entry = entries.get(name)
    if entry is None:
        known = ", ".join(sorted(entries))
        where = f"{source}: " if source else ""
        raise ConfigurationError(f"{where}unknown transport {name!r}; known transports: {known}")
    row = _row(entry)
    if not row.available or entry.cls is None:
        raise TransportUnavailable(name, row.reason or "unknown reason")
    return entry.cls
