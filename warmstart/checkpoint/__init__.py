"""Asynchronous checkpointing and fast recovery on torch.distributed.checkpoint.

Example:
    >>> from warmstart.checkpoint import AsyncMode, Checkpointer, RankLocal
    >>> ckpt = Checkpointer("/ckpt/run-1", mode=AsyncMode.ASYNC, keep=3)
    >>> state = {"model": model, "optim": optimizer, "loader": RankLocal(loader)}
    >>> start = ckpt.load_latest(state)      # step of the latest committed checkpoint, or None
    >>> ckpt.save(step, state)               # blocks only while the state is copied to CPU memory

``AsyncMode`` is imported eagerly (it needs no torch: command lines list the modes); the rest when
first used, so importing the package costs nothing until then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from warmstart.checkpoint.mode import AsyncMode

if TYPE_CHECKING:
    from warmstart.checkpoint.checkpointer import Checkpointer, CheckpointError
    from warmstart.checkpoint.interval import AdaptiveInterval, optimal_interval_s
    from warmstart.checkpoint.layout import CommittedCheckpoint, committed_checkpoints, latest_committed
    from warmstart.checkpoint.state import OptimizerState, RankLocal, RNGState

_LAZY = {
    "Checkpointer": "checkpointer",
    "CheckpointError": "checkpointer",
    "AdaptiveInterval": "interval",
    "optimal_interval_s": "interval",
    "CommittedCheckpoint": "layout",
    "committed_checkpoints": "layout",
    "latest_committed": "layout",
    "OptimizerState": "state",
    "RankLocal": "state",
    "RNGState": "state",
}

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"warmstart.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'warmstart.checkpoint' has no attribute {name!r}")
