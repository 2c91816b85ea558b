"""The public methods of :class:`trioring.Communicator`, one module per collective family
beyond the first three (which stay in :mod:`trioring._communicator`). Each is a thin layer:
validate (through its family module in :mod:`trioring._collectives`), pick, run (through
:meth:`trioring._core.CommunicatorCore._run`)."""

from ._allgather import AllgatherMethods as AllgatherMethods
from ._alltoall import AlltoallMethods as AlltoallMethods
from ._gather import GatherMethods as GatherMethods
from ._groups import GroupMethods as GroupMethods
from ._objects import ObjectMethods as ObjectMethods
from ._p2p import PointToPointMethods as PointToPointMethods
from ._reduce import ReduceMethods as ReduceMethods
from ._scan import ScanMethods as ScanMethods
