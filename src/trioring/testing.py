"""Helpers for testing code that uses trioring, in one process."""

from ._testing import open_local_world as open_local_world

for _name, _obj in list(globals().items()):
    if getattr(_obj, "__module__", "").startswith("trioring._"):
        _obj.__module__ = __name__
del _name, _obj
