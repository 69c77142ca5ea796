"""Asynchronous checkpointing and fast recovery on torch.distributed.checkpoint.

Example:
    >>> from warmstart.checkpoint import AsyncMode, Checkpointer, RankLocal
    >>> ckpt = Checkpointer("/ckpt/run-1", mode=AsyncMode.ASYNC, keep=3)
    >>> state = {"model": model, "optim": optimizer, "loader": RankLocal(loader)}
    >>> start = ckpt.load_latest(state)      # step of the latest committed checkpoint, or None
    >>> ckpt.save(step, state)               # blocks only while the state is copied to CPU memory
"""

from warmstart.checkpoint.checkpointer import AsyncMode, Checkpointer, CheckpointError
from warmstart.checkpoint.interval import AdaptiveInterval, optimal_interval_s
from warmstart.checkpoint.layout import CommittedCheckpoint, committed_checkpoints, latest_committed
from warmstart.checkpoint.state import OptimizerState, RankLocal, RNGState

__all__ = [
    "AsyncMode",
    "Checkpointer",
    "CheckpointError",
    "AdaptiveInterval",
    "optimal_interval_s",
    "CommittedCheckpoint",
    "committed_checkpoints",
    "latest_committed",
    "OptimizerState",
    "RankLocal",
    "RNGState",
]
