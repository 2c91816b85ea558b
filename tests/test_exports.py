"""The public surface: every public name is exported once, from its public module."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import trioring
import trioring.testing
import trioring.transports

PUBLIC_MODULES = [trioring, trioring.testing, trioring.transports]


def public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    }


def test_expected_surface() -> None:
    assert public_names(trioring) == {
        "Capability",
        "CollectiveError",
        "CollectiveMismatchError",
        "Communicator",
        "CommunicatorBrokenError",
        "CommunicatorBusyError",
        "CommunicatorClosedError",
        "ConcurrentOpenError",
        "ConfigurationError",
        "InvalidArgumentError",
        "PeerAbortedError",
        "PeerFailedError",
        "ProtocolError",
        "ReduceOp",
        "TAG_BOUND",
        "RendezvousError",
        "TransportUnavailable",
        "TrioringError",
        "capabilities",
        "is_available",
        "open_communicator",
        "register_transport",
    }
    assert public_names(trioring.testing) == {"open_local_world"}
    assert public_names(trioring.transports) == {
        "BytesLike",
        "Connection",
        "Listener",
        "MemoryTransport",
        "SocketConnection",
        "StreamConnection",
        "TcpTransport",
        "Transport",
        "TransportContext",
        "UnixTransport",
    }


def test_public_submodules_are_attributes_of_the_package() -> None:
    # `import trioring` is enough for `trioring.testing.open_local_world` (issue 14); that a
    # fresh interpreter gets them is tested in test_rough_edges.py.
    public_submodules = {
        name for name in dir(trioring) if isinstance(getattr(trioring, name), types.ModuleType)
    } - {name for name in dir(trioring) if name.startswith("_")}
    assert public_submodules == {"testing", "transports"}
    assert trioring.testing is importlib.import_module("trioring.testing")
    assert trioring.transports is importlib.import_module("trioring.transports")


def test_each_object_exported_once() -> None:
    seen: dict[int, str] = {}
    for module in PUBLIC_MODULES:
        for name in public_names(module):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            where = f"{module.__name__}.{name}"
            assert id(obj) not in seen, f"{where} is also exported as {seen[id(obj)]}"
            seen[id(obj)] = where


def test_objects_claim_their_public_module() -> None:
    for module in PUBLIC_MODULES:
        for name in public_names(module):
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__module__ == module.__name__, f"{name}: {obj.__module__}"


def test_private_modules_are_private() -> None:
    public = {m.__name__ for m in PUBLIC_MODULES}
    for info in pkgutil.walk_packages(trioring.__path__, "trioring."):
        leaf = info.name.rsplit(".", 1)[1]
        if info.name in public or leaf in ("__main__",):
            continue
        assert leaf.startswith("_"), f"{info.name} should be private (_{leaf})"
        importlib.import_module(info.name)


def test_exception_hierarchy() -> None:
    for name in public_names(trioring):
        obj = getattr(trioring, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert issubclass(obj, trioring.TrioringError), name
    assert issubclass(trioring.PeerFailedError, trioring.CollectiveError)
    assert issubclass(trioring.ConfigurationError, ValueError)
