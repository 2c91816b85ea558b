"""trioring: Trio-native collective communication (allreduce, broadcast, allgather,
reduce_scatter, gather, scatter, alltoall, scan, ...) for numpy arrays across processes,
over TCP or Unix sockets."""

# The public submodules too, so that `import trioring` is enough for
# `trioring.testing.open_local_world` (as the reference shows it). Cheap: they only re-export
# what the core imports anyway. (_launched: see the end of this file.)
from . import _launched, testing as testing, transports as transports
from ._collectives._allreduce import ReduceOp as ReduceOp
from ._communicator import Communicator as Communicator
from ._errors import (
    CollectiveError as CollectiveError,
    CollectiveMismatchError as CollectiveMismatchError,
    CommunicatorBrokenError as CommunicatorBrokenError,
    CommunicatorBusyError as CommunicatorBusyError,
    CommunicatorClosedError as CommunicatorClosedError,
    ConcurrentOpenError as ConcurrentOpenError,
    ConfigurationError as ConfigurationError,
    InvalidArgumentError as InvalidArgumentError,
    PeerAbortedError as PeerAbortedError,
    PeerFailedError as PeerFailedError,
    ProtocolError as ProtocolError,
    RendezvousError as RendezvousError,
    TransportUnavailable as TransportUnavailable,
    TrioringError as TrioringError,
)
from ._opening import open_communicator as open_communicator
from ._p2p import TAG_BOUND as TAG_BOUND
from ._registry import (
    Capability as Capability,
    capabilities as capabilities,
    is_available as is_available,
    register_transport as register_transport,
)
from ._version import __version__ as __version__

# Objects say they live where users import them from (for repr, docs and pickling of errors).
for _name, _obj in list(globals().items()):
    if getattr(_obj, "__module__", "").startswith("trioring._"):
        _obj.__module__ = __name__
del _name, _obj

# Under `trioring run` only: errors that merely echo another rank's failure print one line.
_launched.install()
