"""The scan family's public methods: scan and exscan (their checks, decisions and
algorithms: :mod:`trioring._collectives._scan`)."""

from __future__ import annotations

from .._core import CommunicatorCore

__all__ = ["ScanMethods"]


class ScanMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""
