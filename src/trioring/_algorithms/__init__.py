"""The algorithms that the collectives share, one module each: ring (``_ring``), recursive
doubling (``_recursive_doubling``), binomial tree (``_tree``), dissemination
(``_dissemination``); their common steps (``_steps``) and :class:`World` (``_world``), which
the one-host paths in ``trioring._onehost`` share too.

They know peers (:class:`~trioring._framing.Link`) and buffers, never sockets. Each one
sends and receives concurrently (one task per direction), so that no rank ever waits for its
own send to finish before it receives: that would deadlock on unbuffered streams and stall on
full socket buffers. Arrays are processed in chunks of ``chunk_bytes`` so large arrays stream
through the ring or tree instead of being sent whole at every step.
"""

from ._bruck import bruck_allgather as bruck_allgather
from ._bruck_alltoall import bruck_alltoall as bruck_alltoall
from ._dissemination import barrier as barrier
from ._pairwise import pairwise_alltoall as pairwise_alltoall
from ._recursive_doubling import recursive_doubling_allreduce as recursive_doubling_allreduce
from ._recursive_doubling_allgather import (
    is_power_of_two as is_power_of_two,
    recursive_doubling_allgather as recursive_doubling_allgather,
)
from ._recursive_halving import (
    recursive_halving_reduce_scatter as recursive_halving_reduce_scatter,
)
from ._reduce_scatter_gather import reduce_scatter_gather as reduce_scatter_gather
from ._ring import ring_allreduce as ring_allreduce
from ._ring_allgather import ring_allgather as ring_allgather
from ._ring_reduce_scatter import ring_reduce_scatter as ring_reduce_scatter
from ._scan import recursive_doubling_scan as recursive_doubling_scan
from ._steps import bytes_of as bytes_of, chunks as chunks, exchange as exchange
from ._tree import (
    broadcast as broadcast,
    small_broadcast as small_broadcast,
    tree_neighbours as tree_neighbours,
)
from ._tree_gather import (
    disseminate as disseminate,
    tree_gather as tree_gather,
    tree_scatter as tree_scatter,
    tree_scatterv as tree_scatterv,
)
from ._tree_reduce import tree_reduce as tree_reduce
from ._world import (
    World as World,
    awaited_ranks as awaited_ranks,
    interrupted_wait as interrupted_wait,
)
