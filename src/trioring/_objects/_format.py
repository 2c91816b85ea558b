"""What both directions of the object codec share: the version, the tags, the bounds and how
an error names a value's place (the format: see :mod:`trioring._objects`)."""

from __future__ import annotations

import struct
import sys
from typing import Any

VERSION = 1
#: Default bounds (see :mod:`trioring._objects`).
MAX_DEPTH = 100
MAX_ELEMENTS = 1_000_000
MAX_INT_BYTES = 1 << 20
#: The largest ``max_depth`` either side accepts: the codec recurses once per level.
DEPTH_LIMIT = 200
#: The smallest encoding: the version byte and one tag (``None``, ``False``, ``True``).
MIN_ENCODED_BYTES = 2
#: numpy's limit on dimensions (64 since numpy 2).
MAX_NDIM = 64
#: Arrays up to this size are copied into the header buffer; larger ones travel as their
#: own buffer in :func:`~trioring._objects.encode_buffers` (no copy until the buffers are
#: joined).
INLINE_ARRAY_BYTES = 4096

NONE, FALSE, TRUE, INT, FLOAT, COMPLEX, STR, BYTES, LIST, TUPLE, DICT, NDARRAY = range(12)
FLOAT64 = struct.Struct("<d")
COMPLEX128 = struct.Struct("<dd")
U64 = struct.Struct("<Q")
TAG_NAMES = (
    *("None", "False", "True", "int", "float", "complex"),
    *("str", "bytes", "list", "tuple", "dict", "ndarray"),
)
if sys.byteorder != "little":  # pragma: no cover - trioring's wire format is little-endian
    raise ImportError("trioring's object codec needs a little-endian machine")


def type_name(value: object) -> str:
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _key_path(key: str | int) -> str:
    if type(key) is str:
        escaped = key.replace("\\", "\\\\").replace('"', '\\"')
        return f'["{escaped}"]'
    return f"[{key}]"


#: Where a value is inside the encoded object: the name of the whole (a str), or (where its
#: container is, the index of a list or tuple item) or (where its dict is, the key, None).
#: Rendered as text (``obj["cfg"][2]``) only when a value is refused: building that text
#: for every value took 9 % of the encoding of a 3-key dict (15.5 against 14.1 us) and 20 %
#: of a list of 1,000 ints' (1326 against 1054 us; 2 vCPUs, AMD EPYC).
ValuePath = str | tuple[Any, ...]


def path_text(path: ValuePath) -> str:
    """``path`` as the text an error shows: ``obj["cfg"][2]``."""
    steps: list[str] = []
    while type(path) is tuple:
        if len(path) == 2:
            path, index = path
            steps.append(f"[{index}]")
        else:
            path, key, _ = path
            steps.append(_key_path(key))
    assert type(path) is str
    return path + "".join(reversed(steps))


def check_bounds(max_depth: int, max_elements: int, max_int_bytes: int) -> None:
    if not 0 <= max_depth <= DEPTH_LIMIT:
        raise ValueError(f"max_depth must be in 0..{DEPTH_LIMIT}, not {max_depth}")
    if max_elements < 1 or max_int_bytes < 1:
        raise ValueError("max_elements and max_int_bytes must be at least 1")


# -- encoding ---------------------------------------------------------------------------------
