"""The sharding-plan cache: TorchRec plans served from warmstart's store instead of re-planned.

:func:`cached_plan` is ``planner.collective_plan`` / ``planner.plan`` with a cache in front (CONTRACT
§5). The key (:func:`plan_key`) is a SHA-256 over canonical JSON of everything the planner reads,
computed without enumerating sharding options: library versions; the planner's class and settings
(topology with every capacity and bandwidth, batch size, constraints, enumerator, storage
reservation, proposers, partitioner, performance model, timeout); per sharded module its path and
type and each table's shape, dtype and config (features, pooling, data type); the module's total
parameter size (storage reservation reads it); and each sharder's type and options (fused params,
comm codecs). The value is the pickled ``ShardingPlan`` plus its key, stored as kind
``sharding_plan``, so the shared remote tier hands it to every machine. Every hit is checked before
use (:func:`verify_plan`: module paths, table names, shards tiling each table, ranks below the world
size, sharding types and kernels the sharders allow on the compute device); a failed check or an
entry that does not unpickle is counted as ``rejected`` (tier ``verify``) and the plan is computed
again. With a process group only rank 0 looks up or plans, and one ``broadcast_object_list`` hands
the result to the other ranks, as ``collective_plan`` does. This module must never return a plan
for inputs other than the ones it was computed for: when in doubt, the key includes more.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import logging
import pickle
import time
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from warmstart.errors import WarmstartError
from warmstart.init_pipeline.graph import call_in_subprocess

if TYPE_CHECKING:  # torch and TorchRec are imported where used: importing warmstart stays cheap
    import torch.distributed as dist
    from torch import nn
    from torchrec.distributed.types import ModuleSharder, ShardingPlan

log = logging.getLogger("warmstart.init_pipeline")

PLAN_KIND = "sharding_plan"
"""The store kind sharding plans are kept under."""
VERIFY_TIER = "verify"
"""The stats row where hits that failed :func:`verify_plan` (or did not unpickle) are counted."""

_FORMAT = 1  # bump when the key inputs or the stored value change meaning
_MAX_DEPTH = 64  # a guard against pathological nesting only: deeper settings must not be cut off

# Attributes planners and their parts set while planning (search state, results, caches): not settings.
_STATE_ATTRS = frozenset({
    "_stats", "_debug", "_num_proposals", "_num_plans", "_best_plan", "_search_space",
    "_sharder_map", "_sharder_data_map", "_last_stored_search_space", "_last_stored_module",
    "_last_stored_sharders", "_last_reserved_topology", "_dense_storage", "_kjt_storage",
    "_proposal_index", "_proposals", "_sharding_options_by_fqn", "_current_proposal",
    "_best_perf_rating", "_num_inferior_perf", "_grouped_sharding_options", "_proposal_cache",
    "_created_by_factory",
})


class PlanMismatch(WarmstartError, ValueError):
    """A cached plan does not fit the module, sharders or topology it was looked up for."""


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

    plan: "ShardingPlan | None"
    source: str
    key: str | None = None
    seconds: float = 0.0
    plan_s: float = 0.0
    rejected: int = 0
    error: str | None = None


def cached_plan(planner: Any, module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]] | None" = None, *,
                pg: "dist.ProcessGroup | None" = None, store: Any = None, plan_in_subprocess: bool = False,
                salt: str = "") -> "ShardingPlan":
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
        return _plan_or_raise(resolve_plan(planner, module, sharders, store=store,
                                           plan_in_subprocess=plan_in_subprocess, salt=salt))
    outcome = None
    if pg.rank() == 0:
        outcome = resolve_plan(planner, module, sharders, store=store, plan_in_subprocess=plan_in_subprocess,
                               salt=salt, catch=True)
    return broadcast_plan(outcome, pg)


def resolve_plan(planner: Any, module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]]", *,
                 store: Any, plan_in_subprocess: bool = False, salt: str = "", catch: bool = False) -> PlanOutcome:
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
            hit = load_plan(store, key, planner, module, sharders)
            if isinstance(hit, PlanOutcome):
                hit.seconds = time.perf_counter() - start
                return hit
            rejected = hit
        plan_start = time.perf_counter()
        if plan_in_subprocess:
            plan = call_in_subprocess(planner.plan, {"module": module, "sharders": sharders}, name="sharding planner")
        else:
            plan = planner.plan(module, sharders)
    except Exception as exc:  # the planner's (or the key's) error: every rank must hear of it
        if not catch:
            raise
        log.exception("warmstart: sharding plan failed")
        return PlanOutcome(None, "planner", key, time.perf_counter() - start, rejected=rejected,
                           error=f"{type(exc).__name__}: {exc}")
    plan_s = time.perf_counter() - plan_start
    if store is not None:
        store_plan(store, key, plan, plan_s)
    return PlanOutcome(plan, "planner", key, time.perf_counter() - start, plan_s, rejected)


def broadcast_plan(outcome: PlanOutcome | None, pg: "dist.ProcessGroup") -> "ShardingPlan":
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


def _plan_or_raise(outcome: PlanOutcome) -> "ShardingPlan":
    if outcome.plan is None:
        raise PlanningFailed(f"sharding planner failed on rank 0: {outcome.error}")
    return outcome.plan


# -- the store -----------------------------------------------------------------------------------


def load_plan(store: Any, key: str, planner: Any, module: "nn.Module",
              sharders: "list[ModuleSharder[nn.Module]]") -> PlanOutcome | int:
    """Look ``key`` up and verify the entry.

    Returns:
        A ``cache`` :class:`PlanOutcome` on a verified hit, else the number of entries rejected
        (0 on a plain miss, 1 when an entry was found but unusable).
    """
    blob = store.get(PLAN_KIND, key)
    if blob is None:
        return 0
    try:
        entry = pickle.loads(blob)
        if not isinstance(entry, dict) or entry.get("format") != _FORMAT or entry.get("key") != key:
            raise PlanMismatch("the entry is not a sharding plan stored under this key")
        plan = entry["plan"]
        verify_plan(plan, planner, module, sharders)
    except Exception as exc:  # noqa: BLE001 - any unusable entry is a miss, counted and logged
        log.warning("warmstart: cached sharding plan %s… rejected (%s: %s); planning again",
                    key[:12], type(exc).__name__, exc)
        _count_rejected(store)
        return 1
    return PlanOutcome(plan, "cache", key, plan_s=float(entry.get("plan_s", 0.0)))


def store_plan(store: Any, key: str, plan: "ShardingPlan", plan_s: float) -> None:
    """Write ``plan`` under ``key`` (the remote write goes in the background). Never raises."""
    try:
        blob = pickle.dumps({"format": _FORMAT, "key": key, "plan": plan, "plan_s": plan_s,
                             "created": time.time()}, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a plan that does not pickle is simply not cached
        log.warning("warmstart: sharding plan does not pickle; not cached", exc_info=True)
        return
    store.put(PLAN_KIND, key, blob, cost_s=plan_s)


def _count_rejected(store: Any) -> None:
    stats = getattr(store, "stats", None)
    if stats is not None:
        stats.add(VERIFY_TIER, PLAN_KIND, rejected=1)


# -- the key -------------------------------------------------------------------------------------


def plan_key(planner: Any, module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]]", *,
             salt: str = "") -> str:
    """SHA-256 (hex) of :func:`plan_key_inputs`. Costs milliseconds; enumerates nothing."""
    text = json.dumps(plan_key_inputs(planner, module, sharders, salt=salt), sort_keys=True,
                      separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_key_inputs(planner: Any, module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]]", *,
                    salt: str = "") -> dict[str, Any]:
    """Everything the plan depends on, as JSON-ready data (what :func:`plan_key` hashes)."""
    return {
        "format": _FORMAT,
        "versions": _versions(),
        "planner": _canonical(planner),
        "model": _model_inputs(module, sharders),
        "sharders": [_sharder_inputs(s) for s in sharders],
        "salt": salt,
    }


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str | None]:
    import torch

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    return {"torch": torch.__version__, "torchrec": version("torchrec", "torchrec-nightly"),
            "fbgemm": version("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu")}


def claimed_modules(module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]]") -> dict[str, tuple[Any, Any]]:
    """Module path to ``(module, sharder)`` for every module a sharder claims, found as the planner does.

    Mirrors ``EmbeddingEnumerator.enumerate``: walk the children, stop at a module whose type a
    sharder handles.
    """
    from torchrec.distributed.planner.utils import sharder_name

    by_type = {sharder_name(s.module_type): s for s in sharders}
    found: dict[str, tuple[Any, Any]] = {}
    queue: list[tuple[str, Any]] = [("", module)]
    while queue:
        path, child = queue.pop(0)
        sharder = by_type.get(sharder_name(type(child)))
        if sharder is not None:
            found[path] = (child, sharder)
            continue
        queue.extend((f"{path}.{name}" if path else name, grandchild) for name, grandchild in child.named_children())
    return found


def _model_inputs(module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]]") -> dict[str, Any]:
    modules = []
    for path, (child, sharder) in sorted(claimed_modules(module, sharders).items()):
        configs = _table_configs(child)
        tables = []
        for name, param in sorted(sharder.shardable_parameters(child).items()):
            tables.append({"name": name, "shape": [int(d) for d in param.shape], "dtype": str(param.dtype),
                           "config": _canonical(configs.get(name))})
        is_weighted = getattr(child, "is_weighted", None)
        modules.append({"path": path, "type": _qualname(type(child)), "sharder": _qualname(type(sharder)),
                        "is_weighted": bool(is_weighted()) if callable(is_weighted) else None, "tables": tables})
    # Storage reservation subtracts the dense part (parameters and buffers) from every device.
    total_bytes = sum(t.numel() * t.element_size() for t in module.parameters())
    total_bytes += sum(t.numel() * t.element_size() for t in module.buffers())
    return {"type": _qualname(type(module)), "modules": modules, "total_bytes": total_bytes}


def _table_configs(module: Any) -> dict[str, Any]:
    for accessor in ("embedding_bag_configs", "embedding_configs", "tables"):
        fn = getattr(module, accessor, None)
        if callable(fn):
            try:
                return {getattr(c, "name", None): c for c in fn()}
            except Exception:  # noqa: BLE001 - some modules expose the accessor but not for this case
                continue
    return {}


def _sharder_inputs(sharder: Any) -> dict[str, Any]:
    return {"type": _qualname(type(sharder)), "module_type": _qualname(sharder.module_type),
            "settings": _canonical(sharder)}


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _canonical(obj: Any, depth: int = 0, memo: dict[int, Any] | None = None) -> Any:
    """JSON-ready, process-independent form of a settings object (no ids, no reprs with addresses)."""
    kind = type(obj)
    if kind in _PLAIN:  # the common case first: this runs tens of thousands of times per key
        return obj
    if kind is float:
        return obj if obj == obj and obj not in (_INF, -_INF) else repr(obj)
    if kind is list or kind is tuple:
        return [_canonical(v, depth + 1, memo) for v in obj]
    if kind is dict:
        return {str(k): _canonical(obj[k], depth + 1, memo) for k in sorted(obj, key=str)}
    if isinstance(obj, enum.Enum):
        return f"{kind.__qualname__}.{obj.name}"
    if isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return _canonical(float(obj))
    if isinstance(obj, functools.partial):
        return {"partial": _canonical(obj.func, depth + 1, memo), "args": _canonical(obj.args, depth + 1, memo),
                "keywords": _canonical(obj.keywords, depth + 1, memo)}
    if isinstance(obj, (type, *_FUNCTION_TYPES)) or callable(obj) and not hasattr(obj, "__dict__"):
        return _qualname(obj)
    if depth > _MAX_DEPTH:
        return _qualname(kind)
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v, depth + 1, memo) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, depth + 1, memo) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_canonical(v, depth + 1, memo) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    module = kind.__module__
    if module.startswith("torch") and hasattr(obj, "shape") and hasattr(obj, "dtype"):  # a tensor
        return {"tensor": [int(d) for d in obj.shape], "dtype": str(obj.dtype)}
    if module == "torch" or kind.__name__ in ("dtype", "device"):
        return str(obj)
    # One topology is shared by the planner, its enumerator, estimators and perf model: walk it once.
    if memo is None:
        memo = {}
    seen = memo.get(id(obj))
    if seen is not None:
        return {"__cycle__": _qualname(kind)} if seen is _IN_PROGRESS else seen
    memo[id(obj)] = _IN_PROGRESS
    names = _field_names(kind)
    if names is not None:
        fields = {name: getattr(obj, name) for name in names}
    elif hasattr(obj, "__dict__"):
        fields = vars(obj)
    elif hasattr(obj, "__slots__"):
        fields = {k: getattr(obj, k) for k in obj.__slots__ if hasattr(obj, k)}
    else:
        memo[id(obj)] = _qualname(kind)
        return memo[id(obj)]
    out = {k: _canonical(fields[k], depth + 1, memo) for k in sorted(fields) if k not in _STATE_ATTRS}
    out["__type__"] = _qualname(kind)
    memo[id(obj)] = out
    return out


_PLAIN = frozenset({type(None), bool, int, str})
_IN_PROGRESS = object()
_INF = float("inf")
_FUNCTION_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)


@functools.lru_cache(maxsize=None)
def _field_names(kind: type) -> tuple[str, ...] | None:
    return tuple(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else None


# -- verification --------------------------------------------------------------------------------


def verify_plan(plan: Any, planner: Any, module: "nn.Module", sharders: "list[ModuleSharder[nn.Module]]", *,
                world_size: int | None = None, compute_device: str | None = None) -> None:
    """Check that ``plan`` fits ``module``, ``sharders`` and the planner's topology.

    Checks: the plan's module paths are exactly the sharded modules that have tables; each module's
    table names are exactly its shardable parameters; every sharding type and compute kernel is one
    the sharder offers on the compute device; every rank is below the world size; the shards of
    each table tile it exactly (in bounds, no overlap, nothing missing) and are placed on the
    compute device.

    Args:
        world_size, compute_device: override what is read from ``planner``'s topology.

    Raises:
        PlanMismatch: the first check that failed, in words.
    """
    from torchrec.distributed.types import ShardingPlan, ShardingType

    if not isinstance(plan, ShardingPlan):
        raise PlanMismatch(f"expected a ShardingPlan, found {type(plan).__name__}")
    topology = getattr(planner, "_topology", None)
    world_size = world_size if world_size is not None else getattr(topology, "world_size", None)
    compute_device = compute_device or getattr(topology, "compute_device", None)
    if world_size is None or compute_device is None:
        raise PlanMismatch("cannot tell the world size and compute device of the planner")
    claimed = claimed_modules(module, sharders)
    expected = {path: (child, sharder, dict(sharder.shardable_parameters(child)))
                for path, (child, sharder) in claimed.items()}
    expected = {path: v for path, v in expected.items() if v[2]}
    if set(plan.plan) != set(expected):
        raise PlanMismatch(f"module paths differ: plan has {sorted(plan.plan)}, model has {sorted(expected)}")
    for path, (child, sharder, params) in expected.items():
        module_plan = plan.plan[path]
        if set(module_plan) != set(params):
            missing, extra = sorted(set(params) - set(module_plan)), sorted(set(module_plan) - set(params))
            raise PlanMismatch(f"{path}: tables differ (missing {missing}, unexpected {extra})")
        allowed = sharder.sharding_types(compute_device)
        for name, sharding in module_plan.items():
            where = f"{path}.{name}" if path else name
            if sharding.sharding_type not in allowed:
                raise PlanMismatch(f"{where}: sharding type {sharding.sharding_type} is not offered on "
                                   f"{compute_device} (offered: {allowed})")
            kernels = sharder.compute_kernels(sharding.sharding_type, compute_device)
            if sharding.compute_kernel not in kernels:
                raise PlanMismatch(f"{where}: compute kernel {sharding.compute_kernel} is not offered for "
                                   f"{sharding.sharding_type} on {compute_device}")
            ranks = list(sharding.ranks or [])
            if not ranks or any(not 0 <= int(r) < world_size for r in ranks):
                raise PlanMismatch(f"{where}: ranks {ranks} are not all below the world size {world_size}")
            shape = [int(d) for d in params[name].shape]
            spec = sharding.sharding_spec
            if spec is None:
                if sharding.sharding_type != ShardingType.DATA_PARALLEL.value:
                    raise PlanMismatch(f"{where}: {sharding.sharding_type} without a sharding spec")
                continue
            _verify_tiling(where, shape, spec.shards, world_size, compute_device)


def _verify_tiling(where: str, shape: list[int], shards: list[Any], world_size: int, compute_device: str) -> None:
    boxes = []
    for shard in shards:
        offsets, sizes = list(shard.shard_offsets), list(shard.shard_sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise PlanMismatch(f"{where}: a shard has {len(sizes)} dimensions, the table {len(shape)}")
        if any(o < 0 or s <= 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise PlanMismatch(f"{where}: shard at {offsets} of size {sizes} is outside the table {shape}")
        placement = shard.placement
        rank, device = placement.rank(), placement.device()
        if rank is None or not 0 <= rank < world_size:
            raise PlanMismatch(f"{where}: shard placed on rank {rank}, world size is {world_size}")
        if device.type != compute_device:
            raise PlanMismatch(f"{where}: shard placed on {device.type}, compute device is {compute_device}")
        boxes.append((offsets, sizes))
    volume = 1
    for d in shape:
        volume *= d
    covered = 0
    for offsets, sizes in boxes:
        n = 1
        for s in sizes:
            n *= s
        covered += n
    if covered != volume:
        raise PlanMismatch(f"{where}: shards cover {covered} of {volume} elements")
    for i, (oa, sa) in enumerate(boxes):  # same volume and no overlap: an exact tiling
        for ob, sb in boxes[i + 1:]:
            if all(a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb)):
                raise PlanMismatch(f"{where}: shards at {oa} and {ob} overlap")
