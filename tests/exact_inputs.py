"""Seeded inputs whose reductions are exact in any order of operations, so that every
algorithm's result can be compared with numpy's exactly (integer values; for products only
+-1 and 2, powers of two; any bits at all for the bitwise ops, and for bool), and the ops
each dtype supports."""

from __future__ import annotations

from typing import Any

import numpy as np

#: The bitwise ops, which take integer and bool dtypes only.
BITWISE = ("band", "bor", "bxor")
#: Every op's numpy ufunc ("mean" is a sum, divided afterwards).
UFUNCS: dict[str, np.ufunc] = {
    "sum": np.add,
    "mean": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "prod": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def make(seed: int, rank: int, count: int, dtype: np.dtype[Any], op: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng([seed, rank])
    if dtype.kind == "b":
        # Biased so that an and (or a min) of a few ranks is not all False, nor an or (a
        # max) all True.
        p_true = {"band": 0.85, "min": 0.85, "bor": 0.15, "max": 0.15}.get(op, 0.5)
        return rng.random(count) < p_true
    if op in BITWISE:
        # Every bit, the sign bit included, biased as for bool: an and of two draws has a
        # quarter of its bits set, an or three quarters.
        def bits() -> np.ndarray[Any, Any]:
            return np.frombuffer(rng.bytes(count * dtype.itemsize), dtype).copy()

        if op == "band":
            return bits() | bits()
        if op == "bor":
            return bits() & bits()
        return bits()
    if op == "prod":
        # Products of +-1 and 2 are powers of two: exact in every dtype and every order.
        values = rng.choice(np.array([-1, 1, 2]), count)
    elif dtype.kind == "u":
        values = rng.integers(0, 9, count)
    else:
        values = rng.integers(-8, 9, count)
    array = values.astype(dtype)
    if dtype.kind == "c" and op != "prod":
        array += 1j * rng.integers(-8, 9, count)
    return array


def ops_for(dtype: np.dtype[Any], *, bitwise: bool = False) -> tuple[str, ...]:
    """The ops ``dtype`` takes: without ``bitwise``, those of the arithmetic group only (what
    every caller asked for before the bitwise ops existed); with it, integers gain
    band/bor/bxor. Bool always gets its own ops (min, max and the bitwise ones)."""
    if dtype.kind == "b":
        return ("min", "max", *BITWISE)
    if dtype.kind == "c":
        return ("sum", "mean", "prod")
    if dtype.kind in "iu":
        return ("sum", "min", "max", "prod", *(BITWISE if bitwise else ()))
    return ("sum", "mean", "min", "max", "prod")
