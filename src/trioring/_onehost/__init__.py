"""The one-host data paths: a shared segment for small collectives (:mod:`._shm`, its
collectives in :mod:`._shm_collectives` and :mod:`._shm_reductions`), cross-memory attach
for large ones (:mod:`._cma`, its collectives in :mod:`._cma_collectives` and
:mod:`._cma_reductions`), and the agreement on them when a communicator opens
(:mod:`._agree`). The collectives here know buffers and peers, like those of
:mod:`trioring._algorithms`, whose :class:`~trioring._algorithms.World` they share."""
