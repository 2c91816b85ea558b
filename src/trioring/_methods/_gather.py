"""The gather family's public methods: gather, gatherv, scatter and scatterv (their checks, decisions and
algorithms: :mod:`trioring._collectives._gather`)."""

from __future__ import annotations

from .._core import CommunicatorCore

__all__ = ["GatherMethods"]


class GatherMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""
