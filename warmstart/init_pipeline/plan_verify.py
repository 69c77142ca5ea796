"""Checking a sharding plan against the model, sharders and topology it is about to be used for.

:func:`verify_plan` is what stands between a cache hit and ``DistributedModelParallel``: a plan that
fails it is never used (:class:`PlanMismatch` says which check failed, in words).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from warmstart.errors import WarmstartError
from warmstart.init_pipeline.cache_key import claimed_modules

if TYPE_CHECKING:  # torch and TorchRec are imported where used: importing warmstart stays cheap
    from torch import nn
    from torchrec.distributed.types import ModuleSharder


class PlanMismatch(WarmstartError, ValueError):
    """A cached plan does not fit the module, sharders or topology it was looked up for."""


def verify_plan(
    plan: Any,
    planner: Any,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    world_size: int | None = None,
    compute_device: str | None = None,
) -> None:
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
    from torchrec.distributed.types import ShardingPlan

    if not isinstance(plan, ShardingPlan):
        raise PlanMismatch(f"expected a ShardingPlan, found {type(plan).__name__}")
    world_size, compute_device = _topology(planner, world_size, compute_device)
    expected = _expected_modules(module, sharders)
    if set(plan.plan) != set(expected):
        raise PlanMismatch(f"module paths differ: plan has {sorted(plan.plan)}, model has {sorted(expected)}")
    for path, (sharder, params) in expected.items():
        module_plan = plan.plan[path]
        if set(module_plan) != set(params):
            missing, extra = sorted(set(params) - set(module_plan)), sorted(set(module_plan) - set(params))
            raise PlanMismatch(f"{path}: tables differ (missing {missing}, unexpected {extra})")
        allowed = sharder.sharding_types(compute_device)
        for name, sharding in module_plan.items():
            where = f"{path}.{name}" if path else name
            shape = [int(d) for d in params[name].shape]
            _verify_sharding(where, sharding, sharder, allowed, shape, world_size, compute_device)


def _topology(planner: Any, world_size: int | None, compute_device: str | None) -> tuple[int, str]:
    """The world size and compute device the plan must fit: those given, else the planner's."""
    topology = getattr(planner, "_topology", None)
    world_size = world_size if world_size is not None else getattr(topology, "world_size", None)
    compute_device = compute_device or getattr(topology, "compute_device", None)
    if world_size is None or compute_device is None:
        raise PlanMismatch("cannot tell the world size and compute device of the planner")
    return world_size, compute_device


def _expected_modules(
    module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The sharder and shardable parameters of each module path a plan must cover: the sharded
    modules that have tables."""
    expected = {
        path: (sharder, dict(sharder.shardable_parameters(child)))
        for path, (child, sharder) in claimed_modules(module, sharders).items()
    }
    return {path: v for path, v in expected.items() if v[1]}


def _verify_sharding(
    where: str, sharding: Any, sharder: Any, allowed: list[str], shape: list[int], world_size: int, compute_device: str
) -> None:
    """One table's parameter sharding: a sharding type and kernel the sharder offers on the device,
    ranks within the world, and shards that tile the table (a data-parallel table has none)."""
    from torchrec.distributed.types import ShardingType

    if sharding.sharding_type not in allowed:
        raise PlanMismatch(
            f"{where}: sharding type {sharding.sharding_type} is not offered on {compute_device} (offered: {allowed})"
        )
    kernels = sharder.compute_kernels(sharding.sharding_type, compute_device)
    if sharding.compute_kernel not in kernels:
        raise PlanMismatch(
            f"{where}: compute kernel {sharding.compute_kernel} is not offered for "
            f"{sharding.sharding_type} on {compute_device}"
        )
    ranks = list(sharding.ranks or [])
    if not ranks or any(not 0 <= int(r) < world_size for r in ranks):
        raise PlanMismatch(f"{where}: ranks {ranks} are not all below the world size {world_size}")
    spec = sharding.sharding_spec
    if spec is None:
        if sharding.sharding_type != ShardingType.DATA_PARALLEL.value:
            raise PlanMismatch(f"{where}: {sharding.sharding_type} without a sharding spec")
        return
    _verify_tiling(where, shape, spec.shards, world_size, compute_device)


def _verify_tiling(where: str, shape: list[int], shards: list[Any], world_size: int, compute_device: str) -> None:
    boxes = []
    for shard in shards:
        offsets, sizes = list(shard.shard_offsets), list(shard.shard_sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise PlanMismatch(f"{where}: a shard has {len(sizes)} dimensions, the table {len(shape)}")
        if any(o < 0 or s <= 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
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
    for _offsets, sizes in boxes:
        n = 1
        for s in sizes:
            n *= s
        covered += n
    if covered != volume:
        raise PlanMismatch(f"{where}: shards cover {covered} of {volume} elements")
    for i, (oa, sa) in enumerate(boxes):  # same volume and no overlap: an exact tiling
        for ob, sb in boxes[i + 1 :]:
            if all(a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb, strict=True)):
                raise PlanMismatch(f"{where}: shards at {oa} and {ob} overlap")
