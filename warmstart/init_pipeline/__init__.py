"""Start-up as an overlapped dependency graph, and a sharding-plan cache (docs/reference.md#sharding-plans).

``graph.py`` schedules start-up stages (no torch) and ``child_process.py`` runs one of them in a
forked child; ``plan_cache.py`` serves TorchRec sharding plans from warmstart's store, keyed by
``cache_key.py`` and checked by ``plan_verify.py``; ``stages.py`` has the ready-made TorchRec stages,
and ``generators.py`` keeps the compile warm-up's random draws out of theirs.
The names below are imported lazily so that ``import warmstart.init_pipeline`` does not import torch.

Example:
    >>> from warmstart.init_pipeline import cached_plan
    >>> plan = cached_plan(planner, model_on_meta, sharders, pg=dist.group.WORLD)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from warmstart.init_pipeline.child_process import call_in_subprocess
from warmstart.init_pipeline.graph import (
    RUNS_ON,
    FailureChannel,
    Stage,
    StageFailed,
    StageTiming,
    StartupGraph,
    StartupResult,
)

_LAZY = {
    "cached_plan": "plan_cache",
    "resolve_plan": "plan_cache",
    "broadcast_plan": "plan_cache",
    "PlanningFailed": "plan_cache",
    "PlanOutcome": "plan_cache",
    "PLAN_KIND": "plan_cache",
    "plan_key": "cache_key",
    "plan_key_inputs": "cache_key",
    "verify_plan": "plan_verify",
    "PlanMismatch": "plan_verify",
    "TorchRecStartup": "stages",
    "CompileWarmup": "stages",
    "zero_initialized": "stages",
    "GeneratorGuard": "generators",
    "PrefetchedLoader": "stages",
    "StoreFailureChannel": "stages",
    "torchrec_startup_graph": "stages",
    "release_process_groups": "stages",
    "gloo_worker_threads": "stages",
}

__all__ = [
    "RUNS_ON",
    "FailureChannel",
    "Stage",
    "StageFailed",
    "StageTiming",
    "StartupGraph",
    "StartupResult",
    "call_in_subprocess",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'warmstart.init_pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"warmstart.init_pipeline.{module}"), name)
    globals()[name] = value
    return value
