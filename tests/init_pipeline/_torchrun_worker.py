"""One rank of the init-pipeline torchrun tests: ``_torchrun_worker.py MODE OUT_DIR [CACHE_URL SECRET]``.

Modes:
    plan   cached_plan over the process group (counted planner calls), compared with
           collective_plan, then three training steps of DistributedModelParallel with that plan.
    graph  the ready-made TorchRec start-up graph, then two training steps on the prefetched batches.
    fail   the start-up graph where rank 1's data loader stage fails (once rank 1 has loaded its
           checkpoint, so no collective holds its main thread) while rank 0 waits in a collective.
    fail-peer-waiting
           the same, but rank 0 still waits for its own first batch, outside any collective, so it
           hears of the failure (and raises it) at once.
Each rank writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import _plan_models as m
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from warmstart.init_pipeline import (
    CompileWarmup,
    StageFailed,
    TorchRecStartup,
    cached_plan,
    release_process_groups,
    torchrec_startup_graph,
)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH = 8


class CountingPlanner(EmbeddingShardingPlanner):
    """The real planner; counts how often this process ran it."""

    calls = 0

    def plan(self, module, sharders):
        CountingPlanner.calls += 1
        return super().plan(module, sharders)


class Trainable(m.TwoTowers):
    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.sparse["ebc"](kjt).values()
        return (pooled.sum(dim=1) + self.dense(dense).sum(dim=1) - 1.0).pow(2).mean()


def build_model(device: torch.device) -> Trainable:
    return Trainable(m.tables(), device)


def counting_planner(world_size: int = WORLD) -> CountingPlanner:
    return m.planner(world_size, cls=CountingPlanner)


def batch(step: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * RANK + step)
    keys = [f"f{i}" for i in range(4)]
    lengths = torch.randint(1, 3, (len(keys) * BATCH,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, 100 * (i + 1), (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=g)
            for i in range(len(keys))
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths), torch.randn(BATCH, 8, generator=g)


def train(model: nn.Module, batches, steps: int) -> dict:
    dense_params = [p for n, p in model.named_parameters() if "ebc" not in n]
    table_before = {
        k: v.local_shards()[0].tensor.clone() if hasattr(v, "local_shards") else v.to_local().clone()
        for k, v in model.state_dict().items()
        if "embedding_bags" in k and _has_local(v)
    }
    opt = torch.optim.SGD(dense_params, lr=0.05)
    losses = []
    for _ in range(steps):
        kjt, dense = next(batches)
        loss = model(kjt, dense)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    changed = 0
    for k, before in table_before.items():
        v = model.state_dict()[k]
        after = v.local_shards()[0].tensor if hasattr(v, "local_shards") else v.to_local()
        changed += int(not torch.equal(before, after))
    return {"losses": losses, "tables_changed": changed, "tables_local": len(table_before)}


def _has_local(v) -> bool:
    if hasattr(v, "local_shards"):
        return bool(v.local_shards())
    return hasattr(v, "to_local") and v.to_local().numel() > 0


def mode_plan(out: dict, cache_url: str, secret: str) -> None:
    dist.init_process_group("gloo")
    store = m.local_store(Path(os.environ["WARMSTART_CACHE_DIR"]), cache_url, secret.encode())
    planner = counting_planner()
    plan = cached_plan(planner, m.model(), m.sharders(), pg=dist.group.WORLD, store=store)
    store.flush()
    out["planner_calls"] = CountingPlanner.calls
    expected = m.planner(WORLD).collective_plan(m.model(), m.sharders(), dist.group.WORLD)
    out["equal_to_collective_plan"] = plan == expected
    out["store_lookups"] = sum(
        c.hits + c.misses
        for (tier, kind), c in store.stats.items()
        if kind == "sharding_plan" and tier in ("local", "remote")
    )
    out["hits"] = {tier: c.hits for (tier, kind), c in store.stats.items() if kind == "sharding_plan"}
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    model = DistributedModelParallel(
        build_model(torch.device("meta")),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=m.sharders(),
    )
    out.update(train(model, (batch(i) for i in range(100)), 3))


class Batches(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (batch(i) for i in range(100))


FIRST_DRAWS: list[float] = []


class DrawingBatches(torch.utils.data.IterableDataset):
    """Batches made in this process with a random transform (one draw from torch's global generator)."""

    def __iter__(self):
        for i in range(100):
            FIRST_DRAWS.append(torch.rand(1).item())
            yield batch(i)


class FailingBatches(torch.utils.data.IterableDataset):
    """Fails its first batch once ``signal`` exists (written when the rank's checkpoint is loaded):
    a failure while the rank's main thread waits in a collective that its peer never joins would
    abort the rank instead of raising (tests/init_pipeline/test_graph.py covers that)."""

    def __init__(self, signal: Path) -> None:
        self.signal = signal

    def __iter__(self):
        return self

    def __next__(self):  # the first batch, in the data_loader_init stage
        deadline = time.monotonic() + 60
        while not self.signal.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # rank 0 is in the final collective (or waiting for its batch) by then
        raise OSError("data loader worker died")


class SlowBatches(Batches):
    def __iter__(self):
        time.sleep(8.0)  # past rank 1's failure and the time its peers wait before raising it
        return super().__iter__()


def mode_graph(out: dict, fail: str | None = None) -> None:
    loaded = Path(sys.argv[2], f"rank{RANK}.checkpoint-loaded")

    def build_loader(rank: int, world_size: int):
        if fail and rank == 1:  # its worker's error reaches the stage, which fetches the first batch
            return torch.utils.data.DataLoader(FailingBatches(loaded), batch_size=None, num_workers=1)
        if fail == "fail-peer-waiting":
            return torch.utils.data.DataLoader(SlowBatches(), batch_size=None, num_workers=1)
        if rank == 1:  # batches made in this process, drawing from the generator the checkpoint restores
            return torch.utils.data.DataLoader(DrawingBatches(), batch_size=None, num_workers=0)
        return torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1)

    def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        assert isinstance(optimizer, torch.optim.SGD)
        torch.manual_seed(7)  # as a checkpoint's load restores the generators' states
        total = torch.tensor([sum(p.numel() for p in model.parameters())])
        dist.all_reduce(total)
        loaded.touch()
        return int(total)

    warmup = CompileWarmup(
        build=lambda device: nn.Linear(8, 4, device=device),
        example_inputs=lambda device: (torch.randn(BATCH, 8, device=device),),
        compile_kwargs={"backend": "eager"},
    )
    spec = TorchRecStartup(
        build_model=build_model,
        batch_size=BATCH,
        sharders=m.sharders(),
        build_planner=lambda world, local, device: counting_planner(world),
        build_loader=build_loader,
        load_checkpoint=load_checkpoint,
        compile_warmup=warmup,
        build_optimizer=lambda model: torch.optim.SGD(
            [p for n, p in model.named_parameters() if "ebc" not in n], lr=0.05
        ),
        pg_timeout_s=60,
        plan_store=m.local_store(Path(os.environ["WARMSTART_CACHE_DIR"])),
    )
    # The failing rank lingers 1.5 s (so its peers can name the stage) before it raises; the rank
    # stuck in the collective aborts after 3 s, unless torchrun has torn it down by then.
    graph = torchrec_startup_graph(spec, abort_grace_s=3.0)
    graph.add(
        "first_batch_ready",
        lambda data_loader_init, checkpoint_load: dist.barrier(),
        deps=["data_loader_init", "checkpoint_load"],
        collective=True,
    )
    start = time.monotonic()
    try:
        result = graph.run()
    except StageFailed as exc:
        out.update(error=str(exc), stage=exc.stage, failed_rank=exc.rank, seconds=time.monotonic() - start)
        _write(out)
        raise
    out["stages"] = sorted(result.timings)
    out["planner_calls"] = CountingPlanner.calls
    out["plan_source"] = result["sharding_plan"].source if result["sharding_plan"] else None
    out["plan"] = str(result["sharding_plan_broadcast"])
    out["checkpoint_load"] = result["checkpoint_load"]
    out["prefetched"] = result["data_loader_init"].prefetched
    out["compile_s"] = result["compile_warmup"]
    out.update(train(result["model_transform"], result["data_loader_init"], 2))
    # the in-process loader's first batch was made after the checkpoint's load, as in plain code
    after_the_load = torch.rand(1, generator=torch.Generator().manual_seed(7)).item()
    out["first_draw_after_the_load"] = FIRST_DRAWS[:1] == [after_the_load]


def _write(out: dict) -> None:
    Path(sys.argv[2], f"rank{RANK}.json").write_text(json.dumps(out))


def main() -> None:
    mode = sys.argv[1]
    out: dict = {"rank": RANK}
    try:
        if mode == "plan":
            mode_plan(out, sys.argv[3], sys.argv[4])
        else:
            mode_graph(out, fail=mode if mode.startswith("fail") else None)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the groups are released
        sys.excepthook(*sys.exc_info())
        failed = True
    else:
        failed = False
    # The model, plan and loader of the mode are gone with its frame (and, on failure, with the
    # traceback): the process group can be freed now, its gloo threads joined before the interpreter
    # finalizes. A gloo thread still freeing a collective's tensors then would take the GIL during
    # finalization and abort the rank (SIGABRT, 'terminate called without an active exception').
    out["gloo_threads_at_exit"] = release_process_groups()
    if failed:
        sys.exit(1)
    _write(out)


if __name__ == "__main__":
    main()
