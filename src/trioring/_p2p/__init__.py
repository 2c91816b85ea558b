"""The point-to-point plane: one :class:`Endpoint` per rank, shared by all communicators of
its world (see :mod:`._endpoint` for the protocol and its guarantees)."""

from ._endpoint import Endpoint as Endpoint
from ._engine import (
    CHUNK_BYTES as CHUNK_BYTES,
    CMA_EAGER_BYTES as CMA_EAGER_BYTES,
    EAGER_BYTES as EAGER_BYTES,
    MAX_PENDING_RTS as MAX_PENDING_RTS,
    MESSAGE_OVERHEAD as MESSAGE_OVERHEAD,
    WINDOW_BYTES as WINDOW_BYTES,
)
from ._frames import TAG_BOUND as TAG_BOUND, Leaving as Leaving, MessageKind as MessageKind
from ._matching import Scope as Scope
