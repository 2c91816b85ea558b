"""Transports: how bytes move between ranks.

:class:`Transport` is the interface; :class:`TcpTransport`, :class:`UnixTransport` and
:class:`MemoryTransport` are the built-in implementations. Third-party transports register
through the ``trioring.transports`` entry-point group (see :class:`Transport`).
"""

from ._abc import (
    BytesLike as BytesLike,
    Connection as Connection,
    Listener as Listener,
    Transport as Transport,
    TransportContext as TransportContext,
)
from ._memory import MemoryTransport as MemoryTransport, StreamConnection as StreamConnection
from ._socket import SocketConnection as SocketConnection
from ._tcp import TcpTransport as TcpTransport
from ._unix import UnixTransport as UnixTransport

for _name, _obj in list(globals().items()):
    if getattr(_obj, "__module__", "").startswith("trioring.transports._"):
        _obj.__module__ = __name__
del _name, _obj
