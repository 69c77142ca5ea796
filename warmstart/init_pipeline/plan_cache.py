"""The sharding-plan cache: TorchRec plans served from warmstart's store instead of re-planned.

:func:`cached_plan` is ``planner.collective_plan`` / ``planner.plan`` with a cache in front
(docs/reference.md#sharding-plans). The key is :func:`~warmstart.init_pipeline.cache_key.plan_key`;
the value is the pickled ``ShardingPlan`` plus its key, stored as kind ``sharding_plan``, so the
shared remote tier hands it to every machine. Every hit is checked before use
(:func:`~warmstart.init_pipeline.plan_verify.verify_plan`); a failed check or an entry that does not
unpickle is counted as ``rejected`` (tier ``verify``) and the plan is computed again. With a process
group only rank 0 looks up or plans, and one ``broadcast_object_list`` hands the result to the other
ranks, as ``collective_plan`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

from warmstart import _defaults
from warmstart.errors import WarmstartError
from warmstart.init_pipeline.cache_key import FORMAT, plan_key
from warmstart.init_pipeline.child_process import call_in_subprocess
from warmstart.init_pipeline.plan_verify import PlanMismatch, verify_plan

if TYPE_CHECKING:  # torch and TorchRec are imported where used: importing warmstart stays cheap
    import torch.distributed as dist
    from torch import nn
    from torchrec.distributed.types import ModuleSharder, ShardingPlan

log = logging.getLogger("warmstart.init_pipeline")

PLAN_KIND = "sharding_plan"
"""The store kind sharding plans are kept under."""
VERIFY_TIER = "verify"
"""The stats row where hits that failed verification (or did not unpickle) are counted."""


class PlanningFailed(WarmstartError):
    """Planning failed on the rank that planned; raised on the ranks that waited for its plan."""


@dataclasses.dataclass
class PlanOutcome:
    """What resolving a plan on the planning rank produced.

    Attributes:
        plan: the plan, or ``None`` if planning failed.
        source: ``cache`` (a verified hit), ``planner`` (computed; stored when a store is configured).
        key: the cache key (``None`` without a store).
        seconds: time spent resolving (lookup, and planning on a miss).
        plan_s: planning time of the plan (on a hit, what it cost when it was computed).
        rejected: hits that failed verification before this outcome.
        error: ``ExceptionType: message`` when planning failed.
    """

    plan: ShardingPlan | None
    source: str
    key: str | None = None
    seconds: float = 0.0
    plan_s: float = 0.0
    rejected: int = 0
    error: str | None = None


def cached_plan(
    planner: Any,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    *,
    pg: dist.ProcessGroup | None = None,
    store: Any = None,
    plan_in_subprocess: bool = False,
    salt: str = "",
) -> ShardingPlan:
    """The plan ``planner`` would return for ``module``, served from the cache when nothing changed.

    Same result as ``planner.collective_plan(module, sharders, pg)`` (or ``planner.plan(module,
    sharders)`` when ``pg`` is None). With ``pg``, only rank 0 of ``pg`` looks up or plans; the plan
    reaches every rank through one broadcast, and a planning error is raised on every rank.

    Args:
        planner: a TorchRec ``ShardingPlanner`` (usually ``EmbeddingShardingPlanner``).
        module: the model, typically on the ``meta`` device.
        sharders: the sharders that will shard it; ``None``: TorchRec's default sharders.
        pg: the process group to plan for; ``None`` plans locally.
        store: the store to use; default :func:`warmstart.compile_cache.get_store` (``None`` while
            warmstart is off: then this is exactly the planner's own call).
        plan_in_subprocess: on a miss, plan in a forked child so other threads of this process keep
            the GIL.
        salt: extra text mixed into the key (e.g. a version of custom planner code).

    Returns:
        The ``ShardingPlan``.

    Raises:
        PlanningFailed: planning failed (with ``pg``: on rank 0, raised on every rank; rank 0 also
            logs the planner's traceback). Without ``pg`` the planner's own error is raised.
    """
    if sharders is None:  # as collective_plan does
        from torchrec.distributed.sharding_plan import get_default_sharders

        sharders = get_default_sharders()
    if store is None:
        from warmstart.compile_cache import get_store

        store = get_store()
    if store is None and not plan_in_subprocess:
        if pg is None:
            return planner.plan(module, sharders)
        return planner.collective_plan(module, sharders, pg)
    if pg is None:
        return _plan_or_raise(
            resolve_plan(planner, module, sharders, store=store, plan_in_subprocess=plan_in_subprocess, salt=salt)
        )
    outcome = None
    if pg.rank() == 0:
        outcome = resolve_plan(
            planner, module, sharders, store=store, plan_in_subprocess=plan_in_subprocess, salt=salt, catch=True
        )
    return broadcast_plan(outcome, pg)


def resolve_plan(
    planner: Any,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    store: Any,
    plan_in_subprocess: bool = False,
    salt: str = "",
    catch: bool = False,
) -> PlanOutcome:
    """On this rank alone: look the plan up, verify it, or plan (and store the plan) on a miss.

    Args:
        planner, module, sharders, plan_in_subprocess, salt: as for :func:`cached_plan`.
        store: the store (``None``: always plan).
        catch: return a failed :class:`PlanOutcome` instead of raising the planner's error (so that
            it can be broadcast).

    Returns:
        The outcome, with its source and timings.
    """
    start = time.perf_counter()
    key, rejected = None, 0
    try:
        if store is not None:
            key = plan_key(planner, module, sharders, salt=salt)
            hit = _load_plan(store, key, planner, module, sharders)
            if isinstance(hit, PlanOutcome):
                hit.seconds = time.perf_counter() - start
                return hit
            rejected = hit
        plan_start = time.perf_counter()
        if plan_in_subprocess:
            plan = call_in_subprocess(
                planner.plan,
                {"module": module, "sharders": sharders},
                stall_s=_defaults.PLANNER_CHILD_STALL_S,
                name="sharding planner",
            )
        else:
            plan = planner.plan(module, sharders)
    except Exception as exc:  # the planner's (or the key's) error: every rank must hear of it
        if not catch:
            raise
        log.exception("warmstart: sharding plan failed")
        return PlanOutcome(
            None, "planner", key, time.perf_counter() - start, rejected=rejected, error=f"{type(exc).__name__}: {exc}"
        )
    plan_s = time.perf_counter() - plan_start
    if key is not None:  # there is a key exactly when there is a store
        _store_plan(store, key, plan, plan_s)
    return PlanOutcome(plan, "planner", key, time.perf_counter() - start, plan_s, rejected)


def broadcast_plan(outcome: PlanOutcome | None, pg: dist.ProcessGroup) -> ShardingPlan:
    """Hand rank 0's outcome to every rank of ``pg`` with one ``broadcast_object_list``.

    A collective: every rank of ``pg`` must call it, rank 0 with its outcome, the others with ``None``.

    Raises:
        PlanningFailed: rank 0's outcome carries an error (raised on every rank).
    """
    import torch.distributed as dist

    if pg.rank() == 0 and outcome is None:
        raise ValueError("rank 0 must pass the outcome it resolved to broadcast_plan")
    if pg.size() > 1:
        payload = [outcome if pg.rank() == 0 else None]
        dist.broadcast_object_list(payload, group_src=0, group=pg)
        outcome = payload[0]
    assert outcome is not None
    return _plan_or_raise(outcome)


def _plan_or_raise(outcome: PlanOutcome) -> ShardingPlan:
    if outcome.plan is None:
        raise PlanningFailed(f"sharding planner failed on rank 0: {outcome.error}")
    return outcome.plan


# -- the store -----------------------------------------------------------------------------------


def _load_plan(
    store: Any, key: str, planner: Any, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
) -> PlanOutcome | int:
    """Look ``key`` up and verify the entry.

    Returns:
        A ``cache`` :class:`PlanOutcome` on a verified hit, else the number of entries rejected
        (0 on a plain miss, 1 when an entry was found but unusable).
    """
    found = store.get(PLAN_KIND, key)
    if not found:  # a Miss: its reason is the store's to count and report
        return 0
    try:
        entry = pickle.loads(found.value)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            raise PlanMismatch("the entry is not a sharding plan stored under this key")
        plan = entry["plan"]
        verify_plan(plan, planner, module, sharders)
    except Exception as exc:  # noqa: BLE001 - any unusable entry is a miss, counted and logged
        log.warning(
            "warmstart: cached sharding plan %s… rejected (%s: %s); planning again", key[:12], type(exc).__name__, exc
        )
        _count_rejected(store)
        return 1
    return PlanOutcome(plan, "cache", key, plan_s=float(entry.get("plan_s", 0.0)))


def _store_plan(store: Any, key: str, plan: ShardingPlan, plan_s: float) -> None:
    """Write ``plan`` under ``key`` (the remote write goes in the background). Never raises."""
    try:
        blob = pickle.dumps(
            {"format": FORMAT, "key": key, "plan": plan, "plan_s": plan_s, "created": time.time()},
            protocol=pickle.HIGHEST_PROTOCOL,
        )
    except Exception:  # noqa: BLE001 - a plan that does not pickle is simply not cached
        log.warning("warmstart: sharding plan does not pickle; not cached", exc_info=True)
        return
    store.put(PLAN_KIND, key, blob, cost_s=plan_s)


def _count_rejected(store: Any) -> None:
    stats = getattr(store, "stats", None)
    if stats is not None:
        stats.add(VERIFY_TIER, PLAN_KIND, rejected=1)
