"""Sharding-plan cache benchmark: planning time vs a hit on a new machine, in one run.

For each (tables, world size), three "machines" (processes with empty cache directories, all with
``WARMSTART=1`` and the same real ``redis-server`` as the shared tier) call
``warmstart.init_pipeline.cached_plan`` on the same model and planner:

* ``plan``: machine A, empty caches: TorchRec's planner runs (its time is the baseline);
* ``hit, new machine``: machine B, empty local directory: the plan comes from the shared Redis;
* ``hit, same machine``: machine B again: the plan comes from its local tier.

The model is an ``EmbeddingBagCollection`` on the meta device with a mix of table sizes; the planner
is TorchRec's default ``EmbeddingShardingPlanner`` for a simulated ``Topology(world_size,
compute_device="cuda")`` (planning itself needs no GPU). Usage::

    python benchmarks/plan_cache.py [--cases 100x8,100x16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SECRET = "plan-cache-benchmark"
BATCH_SIZE = 512


def build(num_tables: int, world_size: int):
    """The model, planner and sharders every machine of one case uses."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    rows = (20_000, 500_000, 4_000_000)
    dims = (32, 64, 128)
    tables = [
        EmbeddingBagConfig(
            name=f"table_{i}",
            embedding_dim=dims[i % 3],
            num_embeddings=rows[(i // 3) % 3] * (1 + i % 7),
            feature_names=[f"feature_{i}"],
        )
        for i in range(num_tables)
    ]
    module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cuda"), batch_size=BATCH_SIZE
    )
    return planner, module, [EmbeddingBagCollectionSharder()]


def machine(num_tables: int, world_size: int) -> dict:
    """One machine's call of ``cached_plan`` (run in its own process)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from warmstart.compile_cache import get_store
    from warmstart.init_pipeline import cached_plan, plan_key

    planner, module, sharders = build(num_tables, world_size)
    store = get_store()
    assert store is not None and store.remote is not None, "WARMSTART=1 with a shared cache is expected"
    start = time.perf_counter()
    plan = cached_plan(planner, module, sharders)
    seconds = time.perf_counter() - start
    store.flush()
    key_start = time.perf_counter()
    plan_key(planner, module, sharders)
    key_s = time.perf_counter() - key_start
    counts = {tier: counts.to_dict() for (tier, kind), counts in store.stats.items() if kind == "sharding_plan"}
    return {
        "seconds": seconds,
        "key_s": key_s,
        "stats": counts,
        "plan": str(plan),
        "source": "remote"
        if counts.get("remote", {}).get("hits")
        else "local"
        if counts.get("local", {}).get("hits")
        else "planner",
    }


def run_machine(directory: Path, url: str, num_tables: int, world_size: int) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    env.update(
        WARMSTART="1",
        WARMSTART_CACHE_URL=url,
        WARMSTART_SECRET=SECRET,
        WARMSTART_CACHE_DIR=str(directory / "warmstart"),
        HOME=str(directory),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--machine", f"{num_tables}x{world_size}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"machine {directory.name} failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def bench_case(num_tables: int, world_size: int, work: Path, url: str) -> dict:
    a = run_machine(work / f"{num_tables}x{world_size}-a", url, num_tables, world_size)
    b = run_machine(work / f"{num_tables}x{world_size}-b", url, num_tables, world_size)
    b_again = run_machine(work / f"{num_tables}x{world_size}-b", url, num_tables, world_size)
    assert (a["source"], b["source"], b_again["source"]) == ("planner", "remote", "local"), (
        a["source"],
        b["source"],
        b_again["source"],
    )
    assert a["plan"] == b["plan"] == b_again["plan"], "a hit returned a different plan"
    return {
        "tables": num_tables,
        "world_size": world_size,
        "plan_s": a["seconds"],
        "hit_new_machine_s": b["seconds"],
        "hit_same_machine_s": b_again["seconds"],
        "key_s": b["key_s"],
        "hit_new_machine_pct": 100 * b["seconds"] / a["seconds"],
        "hit_same_machine_pct": 100 * b_again["seconds"] / a["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="100x8,100x16", help="comma-separated TABLESxWORLD (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--machine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.machine:
        tables, world = (int(x) for x in args.machine.split("x"))
        print("RESULT " + json.dumps(machine(tables, world)), flush=True)
        return

    from _redis import RedisNode
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="plan-cache-bench-") as tmp:
        work = Path(tmp)
        redis = RedisNode(work / "redis").start()
        try:
            with Progress(transient=True) as progress:
                task = progress.add_task("planning and serving plans", total=len(cases))
                for tables, world in cases:
                    progress.update(task, description=f"{tables} tables x {world} ranks")
                    results.append(bench_case(tables, world, work, redis.url))
                    progress.advance(task)
        finally:
            redis.stop()
    table = Table(title="Sharding plan: planner vs cache hit (one run)")
    for column in (
        "tables x ranks",
        "plan (s)",
        "hit, new machine (ms)",
        "% of plan",
        "hit, same machine (ms)",
        "% of plan",
        "key (ms)",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            f"{r['tables']} x {r['world_size']}",
            f"{r['plan_s']:.2f}",
            f"{1000 * r['hit_new_machine_s']:.1f}",
            f"{r['hit_new_machine_pct']:.3f}%",
            f"{1000 * r['hit_same_machine_s']:.1f}",
            f"{r['hit_same_machine_pct']:.3f}%",
            f"{1000 * r['key_s']:.1f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": platform.platform(), "python": platform.python_version(), "cases": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
