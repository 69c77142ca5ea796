"""A brand-new "machine" for a compile job in a test: empty HOME, TMPDIR, Inductor and warmstart
directories under one folder, no inherited warmstart or Inductor settings, warmstart on."""

from __future__ import annotations

import os
from pathlib import Path


def machine_env(machine: Path, **extra: str) -> dict[str, str]:
    """The environment of a job on a new machine under ``machine`` (its directories are made), with
    ``extra`` on top. Inductor's vector-ISA build probes (seconds each on a new machine) are taken
    as passed, and one thread each for OpenMP and Inductor's compile: what the tests check is
    warmstart's part, on 2 cores shared with other tests."""
    for sub in ("home", "tmp", "inductor", "warmstart", "runs"):
        (machine / sub).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    env.update(
        HOME=str(machine / "home"),
        TMPDIR=str(machine / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(machine / "inductor"),
        WARMSTART_CACHE_DIR=str(machine / "warmstart"),
        WARMSTART_RUN_DIR=str(machine / "runs"),
        TORCHINDUCTOR_COMPILE_THREADS="1",
        TORCHINDUCTOR_VEC_ISA_OK="1",
        OMP_NUM_THREADS="1",
        WARMSTART="1",
    )
    env.update(extra)
    return env
