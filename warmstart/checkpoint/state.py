"""What goes into a checkpoint besides the user's modules: RNG state, rank-local entries, and the
adapters that let optimizers load in place.

DCP treats every entry with the same key on every rank as one replicated value and keeps a single
copy, which is right for replicated weights and wrong for anything that differs per rank (RNG
streams, a data loader's position in its shard). Entries wrapped in :class:`RankLocal` are stored
under a per-rank key instead. This module owns those wrappers and the in-place-load preparation of
optimizers; it does no I/O and no cross-rank communication.
"""

from __future__ import annotations

import pickle
import random
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

RNG_KEY = "_warmstart_rng"
_RANK_SEP = "@rank"


class RankLocal:
    """Marks a checkpoint entry as different on every rank (data loader position, sampler state).

    Example:
        >>> ckpt.save(step, {"model": model, "loader": RankLocal(loader)})

    Args:
        obj: any object with ``state_dict()`` / ``load_state_dict()``, or a dict of tensors.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class RNGState:
    """The process's random number generators as one ``Stateful``: Python ``random``, NumPy's
    global generator (when NumPy is installed), torch's CPU generator and every CUDA device's."""

    def state_dict(self) -> dict[str, Any]:
        """The current generator states (tensors and pickled bytes)."""
        state: dict[str, Any] = {
            "python": pickle.dumps(random.getstate()),
            "torch": torch.get_rng_state(),
        }
        numpy = _numpy()
        if numpy is not None:
            state["numpy"] = pickle.dumps(numpy.random.get_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = pickle.dumps([s.cpu() for s in torch.cuda.get_rng_state_all()])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the generators saved by :meth:`state_dict` (those present in both)."""
        random.setstate(pickle.loads(state["python"]))
        torch.set_rng_state(state["torch"])
        numpy = _numpy()
        if numpy is not None and "numpy" in state:
            numpy.random.set_state(pickle.loads(state["numpy"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(pickle.loads(state["cuda"]))


class OptimizerState:
    """A plain ``torch.optim.Optimizer`` as a ``Stateful`` keyed by parameter name, so it saves
    and loads in place (its lazily created state is materialized before a load).

    TorchRec's ``KeyedOptimizer`` / ``CombinedOptimizer`` (and ``DistributedModelParallel``'s fused
    optimizer) are already keyed: pass those directly.

    Args:
        model: the module the optimizer's parameters belong to (DDP wrapped or not).
        optimizer: the optimizer.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter names."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads ``state`` (as returned by :meth:`state_dict`) into the optimizer."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


def rank_key(key: str, rank: int) -> str:
    """The key a rank-local entry is stored under."""
    return f"{key}{_RANK_SEP}{rank}"


def check_entry(key: str, value: Any) -> None:
    """Rejects entries that cannot round-trip: reserved keys and un-keyed torch optimizers.

    Raises:
        TypeError: a plain ``torch.optim.Optimizer`` (its state is keyed by position, and empty
            until the first step, so it cannot be loaded in place); wrap it in :class:`OptimizerState`.
        ValueError: the key is reserved.
    """
    if key.startswith("_warmstart") or _RANK_SEP in key:
        raise ValueError(
            f"checkpoint entry {key!r}: keys starting with '_warmstart' or containing {_RANK_SEP!r} are reserved"
        )
    inner = value.obj if isinstance(value, RankLocal) else value
    if isinstance(inner, torch.optim.Optimizer) and not _is_keyed_optimizer(inner):
        raise TypeError(
            f"checkpoint entry {key!r} is a plain {type(inner).__name__}: wrap it as "
            f"OptimizerState(model, optimizer) so that it saves and loads by parameter name"
        )


def prepare_for_load(value: Any) -> None:
    """Materializes the lazily created state of TorchRec dense optimizers, which refuse to load
    into an empty state (``KeyedOptimizer.load_state_dict``: 'Different parameter count')."""
    if "torchrec" not in sys.modules:  # nothing can be a TorchRec optimizer; importing it costs seconds
        return
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    if isinstance(value, CombinedOptimizer):
        for _, sub in value.optimizers:
            prepare_for_load(sub)
    elif isinstance(value, KeyedOptimizerWrapper) and len(value.state) == 0:
        value.init_state()


def is_stateful(value: Any) -> bool:
    """Whether DCP will call ``state_dict`` / ``load_state_dict`` on ``value``."""
    return isinstance(value, Stateful)


def _is_keyed_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    if "torchrec" not in sys.modules:
        return False
    from torchrec.optim.keyed import KeyedOptimizer

    return isinstance(optimizer, KeyedOptimizer)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
