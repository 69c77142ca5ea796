"""The sharding-plan cache in one process: equal to the planner, keyed on everything, verified on hit."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import _plan_models as m
import pytest
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner, SortBy
from torchrec.distributed.planner.proposers import GreedyProposer
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import DataType, PoolingType

from warmstart.init_pipeline import PLAN_KIND, PlanMismatch, cached_plan, plan_key, resolve_plan, verify_plan
from warmstart.init_pipeline.plan_cache import VERIFY_TIER

HERE = Path(__file__).parent


def _renamed_feature() -> list:
    configs = m.tables()
    configs[0] = dataclasses.replace(configs[0], feature_names=["g0"])
    return configs


def _with(index: int, **changes) -> list:
    configs = m.tables()
    configs[index] = dataclasses.replace(configs[index], **changes)
    return configs


# Each entry: what changed -> (planner, module, sharders) built with that one change.
CHANGES = {
    "table size": lambda: (m.planner(), m.model(m.tables(rows=101)), m.sharders()),
    "embedding dim": lambda: (m.planner(), m.model(m.tables(dim=32)), m.sharders()),
    "feature": lambda: (m.planner(), m.model(_renamed_feature()), m.sharders()),
    "table added": lambda: (m.planner(), m.model(m.tables(5)), m.sharders()),
    "table name": lambda: (m.planner(), m.model(_with(1, name="t1b")), m.sharders()),
    "pooling": lambda: (m.planner(), m.model(_with(2, pooling=PoolingType.MEAN)), m.sharders()),
    "data type": lambda: (m.planner(), m.model(_with(2, data_type=DataType.FP16)), m.sharders()),
    "dense part": lambda: (m.planner(), m.model(dense=64), m.sharders()),
    "world size": lambda: (m.planner(4), m.model(), m.sharders()),
    "local world size": lambda: (m.planner(2, local_world_size=1), m.model(), m.sharders()),
    "batch size": lambda: (m.planner(batch_size=16), m.model(), m.sharders()),
    "compute device": lambda: (m.planner(device="cuda"), m.model(), m.sharders()),
    "ddr cap": lambda: (m.planner(ddr_cap=2**30), m.model(), m.sharders()),
    "constraint": lambda: (
        m.planner(constraints={"t0": ParameterConstraints(sharding_types=[ShardingType.COLUMN_WISE.value])}),
        m.model(),
        m.sharders(),
    ),
    "constraint pooling factor": lambda: (
        m.planner(constraints={"t0": ParameterConstraints(pooling_factors=[4.0])}),
        m.model(),
        m.sharders(),
    ),
    "sharder option": lambda: (m.planner(), m.model(), m.sharders(learning_rate=0.1)),
    "storage reservation": lambda: (
        m.planner(storage_reservation=HeuristicalStorageReservation(percentage=0.3)),
        m.model(),
        m.sharders(),
    ),
    "proposer": lambda: (m.planner(proposer=GreedyProposer()), m.model(), m.sharders()),
    "partitioner": lambda: (m.planner(partitioner=GreedyPerfPartitioner(sort_by=SortBy.PERF)), m.model(), m.sharders()),
}


def _base():
    return m.planner(), m.model(), m.sharders()


@pytest.fixture
def store(tmp_path):
    return m.local_store(tmp_path / "cache")


def test_cached_plan_equals_the_planners_and_the_second_call_is_a_hit(store):
    planner, module, sharders = _base()
    expected = planner.plan(module, sharders)
    first = cached_plan(*_base(), store=store)
    second = resolve_plan(*_base(), store=store)
    assert first == expected and second.plan == expected
    assert second.source == "cache" and second.plan_s > 0
    local = store.stats.get("local", PLAN_KIND)
    assert (local.hits, local.writes) == (1, 1)


def test_without_a_store_it_is_the_planner(monkeypatch):
    monkeypatch.delenv("WARMSTART", raising=False)
    from warmstart.compile_cache import get_store

    assert get_store() is None
    planner, module, sharders = _base()
    assert cached_plan(*_base()) == planner.plan(module, sharders)


def test_planning_in_a_subprocess_gives_the_same_plan(store):
    planner, module, sharders = _base()
    outcome = resolve_plan(*_base(), store=store, plan_in_subprocess=True)
    assert outcome.source == "planner" and outcome.plan == planner.plan(module, sharders)


def test_key_is_stable_for_equal_inputs_across_processes_and_after_planning():
    planner, module, sharders = _base()
    key = plan_key(planner, module, sharders)
    assert plan_key(*_base()) == key
    planner.plan(module, sharders)  # planning leaves search state on the planner: not part of the key
    assert plan_key(planner, module, sharders) == key
    code = (
        "import _plan_models as m; from warmstart.init_pipeline import plan_key; "
        "print(plan_key(m.planner(), m.model(), m.sharders()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == key, out.stderr[-2000:]


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_anything_that_affects_the_plan_changes_the_key(change):
    assert plan_key(*CHANGES[change]()) != plan_key(*_base())


def test_package_names_are_the_functions_not_the_modules_that_hold_them():
    import warmstart.init_pipeline as pkg
    from warmstart.init_pipeline import cache_key, plan_cache, plan_verify

    assert callable(pkg.plan_key) and pkg.plan_key is cache_key.plan_key
    assert pkg.verify_plan is plan_verify.verify_plan and pkg.cached_plan is plan_cache.cached_plan


def test_salt_changes_the_key():
    assert plan_key(*_base(), salt="v2") != plan_key(*_base())


@pytest.mark.parametrize(
    "change", ["table size", "feature", "world size", "batch size", "constraint", "sharder option"]
)
def test_a_change_recomputes_and_never_serves_the_stale_plan(store, change):
    cached_plan(*_base(), store=store)
    planner, module, sharders = CHANGES[change]()
    outcome = resolve_plan(planner, module, sharders, store=store)
    fresh_planner, fresh_module, fresh_sharders = CHANGES[change]()
    assert outcome.source == "planner"
    assert outcome.plan == fresh_planner.plan(fresh_module, fresh_sharders)
    verify_plan(outcome.plan, planner, module, sharders)


@pytest.mark.parametrize("entry", ["garbage", "truncated", "other key", "other model"])
def test_a_corrupt_or_foreign_entry_recomputes_and_is_counted(store, entry):
    planner, module, sharders = _base()
    key = plan_key(planner, module, sharders)
    good = planner.plan(module, sharders)
    blob = pickle.dumps({"format": 1, "key": key, "plan": good, "plan_s": 1.0})
    if entry == "garbage":
        blob = b"\x80\x05not a pickle"
    elif entry == "truncated":
        blob = blob[: len(blob) // 2]
    elif entry == "other key":
        blob = pickle.dumps({"format": 1, "key": "0" * 64, "plan": good, "plan_s": 1.0})
    else:  # a valid plan, but for a model with another table set under this key
        other_planner, other_module, other_sharders = CHANGES["table name"]()
        blob = pickle.dumps({"format": 1, "key": key, "plan": other_planner.plan(other_module, other_sharders)})
    store.put(PLAN_KIND, key, blob)
    outcome = resolve_plan(*_base(), store=store)
    assert outcome.source == "planner" and outcome.rejected == 1
    assert outcome.plan == good
    assert store.stats.get(VERIFY_TIER, PLAN_KIND).rejected == 1
    assert resolve_plan(*_base(), store=store).source == "cache"  # the recomputed plan replaced the entry


def test_a_hit_on_a_new_machine_comes_from_the_shared_redis(tmp_path, redis_node):
    secret = b"plan-cache-test"
    first = m.local_store(tmp_path / "machine-a", redis_node.url, secret)
    planned = resolve_plan(*_base(), store=first)
    first.flush()
    second = m.local_store(tmp_path / "machine-b", redis_node.url, secret)
    served = resolve_plan(*_base(), store=second)
    assert planned.source == "planner" and served.source == "cache"
    assert served.plan == planned.plan
    assert second.stats.get("remote", PLAN_KIND).hits == 1
    assert second.stats.get("local", PLAN_KIND).misses == 1


# -- verify_plan ---------------------------------------------------------------------------------


def _planned(world_size: int = 2, device: str = "cpu"):
    planner, module, sharders = m.planner(world_size, device=device), m.model(), m.sharders()
    return planner.plan(module, sharders), planner, module, sharders


def _first_sharding(plan):
    return plan.plan["sparse.ebc"]["t0"]


def _tw_on_rank(plan, rank: int):
    sharding = _first_sharding(plan)
    sharding.ranks = [rank]
    sharding.sharding_spec.shards[0].placement = type(sharding.sharding_spec.shards[0].placement)(f"rank:{rank}/cpu")


def _shrink_shard(plan):
    shard = _first_sharding(plan).sharding_spec.shards[0]
    shard.shard_sizes = [shard.shard_sizes[0] - 1, shard.shard_sizes[1]]


def _duplicate_shard(plan):
    shards = _first_sharding(plan).sharding_spec.shards
    shards.append(dataclasses.replace(shards[0]))


BREAKS = {
    "table missing": (lambda plan: plan.plan["sparse.ebc"].pop("t3"), "tables differ"),
    "module path": (lambda plan: plan.plan.__setitem__("ebc", plan.plan.pop("sparse.ebc")), "module paths differ"),
    "rank out of range": (lambda plan: _tw_on_rank(plan, 2), "below the world size"),
    "sharding type not on cpu": (
        lambda plan: setattr(_first_sharding(plan), "sharding_type", ShardingType.ROW_WISE.value),
        "not offered on cpu",
    ),
    "kernel not on cpu": (lambda plan: setattr(_first_sharding(plan), "compute_kernel", "fused_uvm"), "kernel"),
    "shard does not cover": (_shrink_shard, "cover"),
    "shards overlap": (_duplicate_shard, "outside the table|cover|overlap"),
}


def test_a_real_plan_verifies():
    for device, world in (("cpu", 2), ("cuda", 8)):
        verify_plan(*_planned(world, device))


@pytest.mark.parametrize("breakage", sorted(BREAKS))
def test_verify_rejects_a_plan_that_does_not_fit(breakage):
    plan, planner, module, sharders = _planned()
    if _first_sharding(plan).sharding_type != ShardingType.TABLE_WISE.value:
        pytest.skip("the planner did not choose table-wise for t0")
    damage, message = BREAKS[breakage]
    damage(plan)
    with pytest.raises(PlanMismatch, match=message):
        verify_plan(plan, planner, module, sharders)


def test_verify_rejects_a_plan_for_another_world_size():
    plan, _, module, sharders = _planned(world_size=4)
    with pytest.raises(PlanMismatch):
        verify_plan(plan, m.planner(2), module, sharders)
