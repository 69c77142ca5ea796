"""Checkpoint blocking time: synchronous vs asynchronous saves of a TorchRec model, in one run.

Two ranks (torchrun, gloo, CPU) each hold about 200 MB of state: an ``EmbeddingBagCollection`` of
``--tables`` tables (``--rows`` x ``--dim`` fp32, table-wise sharded, so half the tables per rank,
fused SGD in backward) under ``DistributedModelParallel`` with ``ShardingEnv(output_dtensor=True)``
(DTensor state, which the non-blocking DefaultStager can copy), plus a small dense MLP under DDP.
For each mode, with ``warmstart.checkpoint.Checkpointer``:

* ``sync``: blocking = the whole save, commit included;
* ``async-thread``: ``save`` returns once the state is copied to CPU memory; the write runs in a thread;
* ``async-thread+overlap``: ``save`` returns at once; the copy overlaps the next forward and training
  waits for it (``wait_staged``) only before the next backward (the fused optimizer writes the tables
  there): blocking = ``save`` + that wait;
* ``async-process``: as ``async-thread``, staged in shared memory and written by a separate process.

Each mode does one warm-up save (allocates staging buffers; starts the writer process), then
``--saves`` measured saves. Around each: ``--steps-between`` training steps with nothing in flight
(baseline step time), the save, then the same number of steps while the write is in flight (step
time while writing). Blocking is the slowest rank's. Usage::

    python benchmarks/checkpoint_async.py [--tables 8 --rows 200000 --dim 64] [--json FILE]

(re-launches itself under ``torchrun --standalone --nproc-per-node 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MODES = ("sync", "async-thread", "async-thread+overlap", "async-process")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--saves", type=int, default=3, help="measured saves per mode (after one warm-up save)")
    p.add_argument("--steps-between", type=int, default=12, help="steps before and after each save")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dir", type=Path, default=None, help="checkpoint folder (default: a temporary one on local disk)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def _build(args: argparse.Namespace, rank: int, world: int):
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"]
                    )
                    for i in range(args.tables)
                ],
                device=torch.device("meta"),
            )
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(args.tables * args.dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
            )

        def forward(self, kjt):
            pooled = self.ebc(kjt)
            return self.mlp(torch.cat([pooled[f"f{i}"] for i in range(args.tables)], dim=1)).square().mean()

    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.01})
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {f"t{i}": table_wise(rank=i % world) for i in range(args.tables)},
                local_size=world,
                world_size=world,
                device_type="cpu",
                sharder=sharder,
            )
        }
    )
    env = ShardingEnv(world, rank, dist.group.WORLD, output_dtensor=True)
    dmp = DistributedModelParallel(model, env=env, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _batches(args: argparse.Namespace, rank: int):
    import torch
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(rank)
    while True:
        lengths = torch.randint(1, 6, (args.tables * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        yield KeyedJaggedTensor(keys=[f"f{i}" for i in range(args.tables)], values=values, lengths=lengths)


def _state_bytes(state: dict) -> int:
    total = 0
    for value in state.values():
        sd = value.state_dict() if hasattr(value, "state_dict") else value
        stack = [sd]
        while stack:
            obj = stack.pop()
            if isinstance(obj, dict):
                stack.extend(obj.values())
            elif hasattr(obj, "to_local"):
                local = obj.to_local()
                total += local.numel() * local.element_size()
            elif hasattr(obj, "element_size"):
                total += obj.numel() * obj.element_size()
    return total


def _worker(args: argparse.Namespace) -> None:
    """One rank: every mode, in order."""
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    from warmstart.checkpoint import Checkpointer
    from warmstart.metrics import NullRecorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp, optimizer = _build(args, rank, world)
    batches = _batches(args, rank)
    state = {"model": dmp, "optim": optimizer}
    results: dict[str, dict] = {"state_bytes_per_rank": _state_bytes(state), "modes": {}}

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def step(ckpt: Checkpointer | None = None) -> tuple[float, float]:
        """One training step; returns (step time, time spent waiting for staging)."""
        started = time.perf_counter()
        loss = dmp(next(batches))
        waited = 0.0
        if ckpt is not None:
            t = time.perf_counter()
            ckpt.wait_staged()  # the fused optimizer updates the tables in backward: the copy must be done
            waited = time.perf_counter() - t
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started, waited

    for _ in range(3):  # warm up the model (first-batch work is not step time)
        step()
    step_no = 0
    for mode in args.modes.split(","):
        directory = args.dir / mode
        overlap = mode.endswith("+overlap")
        ckpt = Checkpointer(
            directory,
            mode=mode.removesuffix("+overlap"),
            keep=1,
            recorder=NullRecorder(),
            overlap_staging=overlap,
            save_rng=False,
        )
        blocking, first, upload, idle_steps, busy_steps = [], None, [], [], []
        for save_no in range(args.saves + 1):
            for _ in range(args.steps_between):
                idle_steps.append(step()[0])
                step_no += 1
            dist.barrier()
            started = time.perf_counter()
            ckpt.save(step_no, state)
            blocked = time.perf_counter() - started
            for _ in range(args.steps_between):
                in_flight = ckpt.in_flight
                took, waited = step(ckpt)
                blocked += waited  # only with overlap_staging: training stalls until the copy is done
                if save_no > 0:
                    (busy_steps if in_flight else idle_steps).append(took - waited)
                step_no += 1
            ckpt.wait()
            b = slowest(blocked)
            if save_no == 0:
                first = b
            else:
                blocking.append(b)
                upload.append(slowest(ckpt.last_save_to_commit_s or float("nan")))
        ckpt.close()
        results["modes"][mode] = {
            "blocking_s": statistics.median(blocking),
            "blocking_all_s": blocking,
            "first_save_blocking_s": first,
            "save_to_commit_s": statistics.median(upload),
            "step_s_idle": statistics.mean(idle_steps) if idle_steps else None,
            "step_s_while_writing": statistics.mean(busy_steps) if busy_steps else None,
            "steps_while_writing": len(busy_steps),
        }
        shutil.rmtree(directory, ignore_errors=True) if rank == 0 else None
    if rank == 0:
        (args.dir / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _report(args: argparse.Namespace, results: dict, seconds: float) -> dict:
    from rich.console import Console
    from rich.table import Table

    modes = results["modes"]
    sync = modes.get("sync", {}).get("blocking_s")
    table = Table(
        title=f"checkpoint save, 2 ranks x {results['state_bytes_per_rank'] / 1e6:.0f} MB "
        f"({args.tables} tables x {args.rows} x {args.dim} fp32, table-wise)"
    )
    for col in (
        "mode",
        "blocking (s)",
        "vs sync",
        "first save (s)",
        "save→commit (s)",
        "step idle (ms)",
        "step while writing (ms)",
        "slowdown",
    ):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in modes.items():
        ratio = r["blocking_s"] / sync if sync else None
        r["blocking_vs_sync"] = ratio
        idle, busy = r["step_s_idle"], r["step_s_while_writing"]
        r["step_slowdown"] = busy / idle if idle and busy else None
        table.add_row(
            mode,
            f"{r['blocking_s']:.3f}",
            f"{ratio:.1%}" if ratio is not None else "-",
            f"{r['first_save_blocking_s']:.3f}",
            f"{r['save_to_commit_s']:.3f}",
            f"{idle * 1e3:.0f}" if idle else "-",
            f"{busy * 1e3:.0f}" if busy else "-",
            f"{r['step_slowdown']:.2f}x" if r["step_slowdown"] else "-",
        )
    Console(width=160).print(table)
    results.update(
        machine=f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        wall_s=seconds,
        command="python benchmarks/checkpoint_async.py " + " ".join(sys.argv[1:]),
    )
    return results


def main() -> None:
    args = _args()
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [a for a in sys.argv[1:]]
    if "--dir" in argv:
        i = argv.index("--dir")
        del argv[i : i + 2]
    started = time.perf_counter()
    try:
        subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", __file__, *argv, "--dir", str(root)],
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        results = _report(args, json.loads((root / "results.json").read_text()), time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
