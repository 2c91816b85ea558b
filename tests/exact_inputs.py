"""Seeded inputs whose reductions are exact in any order of operations, so that every
algorithm's result can be compared with numpy's exactly (integer values; for products only
+-1 and 2, powers of two), and the ops each dtype supports."""

from __future__ import annotations

from typing import Any

import numpy as np


def make(seed: int, rank: int, count: int, dtype: np.dtype[Any], op: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng([seed, rank])
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


def ops_for(dtype: np.dtype[Any]) -> tuple[str, ...]:
    if dtype.kind == "c":
        return ("sum", "mean", "prod")
    if dtype.kind in "iu":
        return ("sum", "min", "max", "prod")
    return ("sum", "mean", "min", "max", "prod")
