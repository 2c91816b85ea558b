"""The environment for a rank started by a test: the test runner's own, less every variable
that would make the rank join another world (a CI runner, torchrun or a SLURM allocation may
have set them)."""

from __future__ import annotations

import os


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRIORING_", "MASTER_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env.update(extra)
    return env
