"""The alltoall family's public methods: alltoall and alltoallv (their checks, decisions and
algorithms: :mod:`trioring._collectives._alltoall`)."""

from __future__ import annotations

from .._core import CommunicatorCore

__all__ = ["AlltoallMethods"]


class AlltoallMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""
