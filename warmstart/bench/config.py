"""The reference job's configuration: one frozen dataclass, parsed from the command line.

Every field has a docstring and a default sized for a 2-core CPU machine. ``JobConfig.from_args``
is the only parser; checks live in ``__post_init__`` and name the option and what is accepted. This
module imports no torch, so the job can start its clock before the heavy imports.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from warmstart.checkpoint.mode import AsyncMode
from warmstart.errors import ConfigError

MODES = ("baseline", "warmstart")
CHECKPOINT_MODES = tuple(mode.value for mode in AsyncMode)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """Everything the reference job needs to know."""

    mode: str = "warmstart"
    """``baseline`` (plain torch.compile, planner, loader, synchronous checkpoints) or ``warmstart``
    (start-up graph, cached plan, async checkpoints; the compile cache comes from ``WARMSTART=1``)."""
    steps: int = 120
    """Training steps of the whole job (across restarts)."""
    tables: int = 64
    """Embedding tables, one sparse feature each."""
    rows_min: int = 1_000
    """Fewest rows a table may have (sizes are log-uniform between min and max)."""
    rows_max: int = 8_000
    """Most rows a table may have."""
    dim: int = 16
    """Embedding dimension."""
    batch_size: int = 512
    """Samples per step and rank."""
    dense_layers: tuple[int, ...] = (512, 256, 64)
    """Hidden sizes of the dense arch (bottom MLP)."""
    over_layers: tuple[int, ...] = (512, 512, 256)
    """Hidden sizes of the over arch (top MLP); with the dense arch, TorchRec's DLRM example defaults."""
    lr_dense: float = 1e-3
    """Adam learning rate of the dense part."""
    lr_sparse: float = 0.05
    """Row-wise Adagrad learning rate of the embedding tables (fused into the backward pass)."""
    checkpoint_dir: Path = Path("checkpoints")
    """Where checkpoints go; shared by every attempt (it is the durable storage that survives a restart)."""
    checkpoint_every: int = 30
    """Save a checkpoint after every this many steps."""
    keep_checkpoints: int = 2
    """Committed checkpoints to keep."""
    checkpoint_mode: str = "async-thread"
    """warmstart mode: ``async-thread``, ``async-process`` or ``sync`` (baseline: always plain sync DCP)."""
    snapshots: bool = False
    """warmstart mode: per-step snapshots to the node's keeper and the buddy's, so that a restart
    resumes from the step it failed in (docs/checkpoint.md#per-step-snapshots); off: from the last
    checkpoint, as the baseline does. ``warmstart bench cold-vs-warm`` turns them on for cold and warm
    (``--no-snapshots``: off; docs/benchmarks.md#per-step-snapshots)."""
    snapshot_buddy: str = ""
    """The buddy node's keeper (``host:port``) that this node's keeper copies the snapshots to, and
    that a restart on a new node restores from; empty: none."""
    collective_timeout_s: float = 600.0
    """Timeout of the process group's collectives: a rank whose peer died does not hang for 30 min."""
    fail_at_step: int = -1
    """Attempt 0 dies at the start of this step (the injected failure); -1 never fails."""
    loader_workers: int = 1
    """DataLoader worker processes per rank."""
    seed: int = 0
    """Seeds the table sizes, the dense weights and the data."""
    log_every: int = 20
    """Rank 0 prints the loss every this many steps."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("--mode", self.mode, "baseline or warmstart")
        for name in ("steps", "tables", "dim", "batch_size", "checkpoint_every", "keep_checkpoints", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}", getattr(self, name), "a positive integer")
        if not 0 < self.rows_min <= self.rows_max:
            raise ConfigError("--rows-min", self.rows_min, f"a positive integer <= --rows-max ({self.rows_max})")
        if self.fail_at_step >= self.steps:
            raise ConfigError("--fail-at-step", self.fail_at_step, f"-1 or a step below --steps ({self.steps})")
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            raise ConfigError("--checkpoint-mode", self.checkpoint_mode, ", ".join(CHECKPOINT_MODES))
        if self.loader_workers < 0:
            raise ConfigError("--loader-workers", self.loader_workers, "0 or more")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> JobConfig:
        """Parse ``argv`` (default ``sys.argv[1:]``): one ``--flag`` per field.

        Raises:
            ConfigError: a value is out of range.
        """
        parser = argparse.ArgumentParser(
            prog="python -m warmstart.bench.reference_job",
            description="The warmstart reference TorchRec training job (run under torchrun).",
        )
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            default = field.default
            if isinstance(default, tuple):
                parser.add_argument(
                    flag,
                    type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=default,
                    help="comma-separated sizes",
                )
            elif isinstance(default, bool):
                parser.add_argument(flag, type=_on_off, default=default, help="on or off")
            else:
                parser.add_argument(flag, type=type(default), default=default)
        return cls(**vars(parser.parse_args(argv)))

    def to_args(self) -> list[str]:
        """The command-line flags that reproduce this config (for launchers)."""
        args: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            if isinstance(value, bool):
                text = "on" if value else "off"
            else:
                text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            args += ["--" + field.name.replace("_", "-"), text]
        return args


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected on or off")
