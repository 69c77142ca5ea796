"""Start-up graph benchmark: time to first batch of a TorchRec job, overlapped vs the same stages in sequence.

The job: a DLRM-style model (an ``EmbeddingBagCollection`` of ``--tables`` tables sharded by
``DistributedModelParallel``, and a dense part built from TorchRec's ``DenseArch``,
``InteractionArch`` and ``OverArch`` that is compiled with ``torch.compile``), 2 ranks over gloo
under ``torchrun``, a real ``DataLoader`` with 2 worker processes over TorchRec's
``RandomRecDataset``, and a DCP checkpoint loaded after sharding. Its start-up is the ready-made
graph of ``warmstart.init_pipeline.stages`` (process group, data loader with 3 batches prefetched,
model on meta, plan, DMP, checkpoint load, compile warm-up of the dense part on a synthetic batch).

A ``setup`` run saves the checkpoint and fills Inductor's local cache (so compile time is the
dynamo-plus-cached-Inductor time of a warm machine, the same in every configuration). Then each
configuration runs ``--repeats`` times, alternating:

* ``sequential``: ``graph.run(sequential=True)``: every stage on the main thread, one after another;
* ``graph``: ``graph.run()``: the overlapped schedule.

Time to first batch (TTFB) is measured on rank 0 from the start of ``graph.run()`` to the end of
the first training step (forward, backward, optimizer). The critical path is the longest dependency
chain of the stage times measured in that same graph run. Usage::

    python benchmarks/startup_graph.py [--tables 26] [--rows 50000] [--repeats 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
DIM = 64
NUM_DENSE = 13
BATCH = 512


# -- one rank (run by torchrun) ------------------------------------------------------------------


def _rank_main(role: str, out_dir: Path, ckpt: Path, num_tables: int, rows: int) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch._dynamo.utils as dynamo_utils
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.datasets.random import RandomRecDataset
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    from warmstart.init_pipeline import CompileWarmup, TorchRecStartup, torchrec_startup_graph, zero_initialized

    rank = int(os.environ["RANK"])
    keys = [f"f{i}" for i in range(num_tables)]

    class DenseOver(nn.Module):
        """Everything but the embeddings: the part that is compiled."""

        def __init__(self, device: torch.device) -> None:
            super().__init__()
            self.dense_arch = DenseArch(NUM_DENSE, [128, DIM], device=device)
            self.inter_arch = InteractionArch(num_tables)
            # InteractionArch returns the dense vector and the F + F(F-1)/2 pairwise dot products.
            self.over_arch = OverArch(DIM + num_tables * (num_tables + 1) // 2, [256, 128, 1], device=device)

        def forward(self, dense: torch.Tensor, sparse_values: torch.Tensor) -> torch.Tensor:
            sparse = sparse_values.view(-1, num_tables, DIM)
            return self.over_arch(self.inter_arch(self.dense_arch(dense), sparse)).squeeze(-1)

    class Model(nn.Module):
        def __init__(self, device: torch.device) -> None:
            super().__init__()
            self.sparse_arch = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[k])
                    for i, k in enumerate(keys)
                ],
                device=device,
            )
            self.dense_over = DenseOver(device)

        def forward(self, batch) -> torch.Tensor:
            sparse = self.sparse_arch(batch.sparse_features).values()
            logits = self.dense_over(batch.dense_features, sparse)
            return F.binary_cross_entropy_with_logits(logits, batch.labels.float())

    def build_loader(rank: int, world_size: int):
        data = RandomRecDataset(
            keys=keys,
            batch_size=BATCH,
            hash_size=rows,
            ids_per_feature=3,
            num_dense=NUM_DENSE,
            manual_seed=rank,
            num_generated_batches=4,
        )
        return torch.utils.data.DataLoader(data, batch_size=None, num_workers=2)

    def load_checkpoint(model: nn.Module, optimizer: None) -> int:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(ckpt))
        return len(state)

    # Same shapes, dtypes and requires_grad as the real inputs (the pooled embeddings carry grad),
    # or TorchDynamo's guards would send the first real step to compile again.
    warmup = CompileWarmup(
        # nothing drawn from torch's global random generator beside the model's build (see
        # CompileWarmup): zero-initialized module, zeros as inputs
        build=zero_initialized(DenseOver),
        example_inputs=lambda device: (
            torch.zeros(BATCH, NUM_DENSE, device=device),
            torch.zeros(BATCH, num_tables * DIM, device=device, requires_grad=True),
        ),
    )
    spec = TorchRecStartup(
        build_model=Model,
        batch_size=BATCH,
        sharders=[EmbeddingBagCollectionSharder()],
        build_loader=build_loader,
        load_checkpoint=None if role == "setup" else load_checkpoint,
        compile_warmup=warmup,
        pg_timeout_s=300,
    )
    graph = torchrec_startup_graph(spec)
    start = time.perf_counter()
    result = graph.run(sequential=role == "sequential")
    graph_s = time.perf_counter() - start

    model, batches = result["model_transform"], result["data_loader_init"]
    if role == "setup":  # before compiling: compiled submodules add "_orig_mod" to the state dict keys
        dcp.save(model.state_dict(), checkpoint_id=str(ckpt))
    inner = model.module
    inner.dense_over = torch.compile(inner.dense_over)
    dense_params = [p for n, p in model.named_parameters() if "sparse_arch" not in n]
    optimizer = torch.optim.SGD(dense_params, lr=0.01)
    graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
    step_start = time.perf_counter()
    loss = model(next(batches))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    first_step_s = time.perf_counter() - step_start
    ttfb_s = time.perf_counter() - start
    new_graphs = dynamo_utils.counters["stats"]["unique_graphs"] - graphs_before
    path, critical_s = result.critical_path()
    out = {
        "rank": rank,
        "role": role,
        "ttfb_s": ttfb_s,
        "graph_s": graph_s,
        "first_step_s": first_step_s,
        "critical_path": path,
        "critical_path_s": critical_s,
        "stages_sum_s": result.sequential_s,
        "first_step_new_graphs": new_graphs,
        "loss": float(loss),
        "plan_source": result["sharding_plan"].source if result["sharding_plan"] else None,
        "timings": {n: [t.start, t.end, t.runs_on] for n, t in result.timings.items()},
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------


def _torchrun(role: str, work: Path, run: str, args: argparse.Namespace) -> dict:
    out = work / run
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"),
        OMP_NUM_THREADS="1",
        LOCAL_WORLD_SIZE="2",
        PYTHONWARNINGS="ignore",
        TMPDIR=str(work / "tmp"),
    )
    (work / "tmp").mkdir(exist_ok=True)
    proc = subprocess.run(
        [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--rank-role",
            role,
            str(out),
            str(work / "checkpoint"),
            "--tables",
            str(args.tables),
            "--rows",
            str(args.rows),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads((out / "rank0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank-role", nargs=3, metavar=("ROLE", "OUT", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_role:
        role, out, ckpt = args.rank_role
        _rank_main(role, Path(out), Path(ckpt), args.tables, args.rows)
        return

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="startup-graph-bench-") as tmp, Progress(transient=True) as progress:
        work = Path(tmp)
        plan = [("setup", "setup")] + [
            (role, f"{role}-{i}") for i in range(args.repeats) for role in ("sequential", "graph")
        ]
        task = progress.add_task("start-up runs", total=len(plan))
        for role, name in plan:
            progress.update(task, description=f"torchrun x2: {name}")
            result = _torchrun(role, work, name, args)
            if role != "setup":
                runs.append(result)
            progress.advance(task)

    console = Console()
    table = Table(
        title=f"Time to first batch, TorchRec job ({args.tables} tables x {args.rows} rows, 2 ranks, gloo), rank 0"
    )
    for column in (
        "run",
        "TTFB (s)",
        "start-up (s)",
        "first step (s)",
        "sum of stages (s)",
        "critical path (s)",
        "start-up / critical path",
    ):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(
            r["role"],
            f"{r['ttfb_s']:.2f}",
            f"{r['graph_s']:.2f}",
            f"{r['first_step_s']:.2f}",
            f"{r['stages_sum_s']:.2f}",
            f"{r['critical_path_s']:.2f}",
            f"{r['graph_s'] / r['critical_path_s']:.2f}x" if r["role"] == "graph" else "-",
        )
    console.print(table)
    seq = [r for r in runs if r["role"] == "sequential"]
    par = [r for r in runs if r["role"] == "graph"]
    summary = {
        "ttfb_sequential_s": min(r["ttfb_s"] for r in seq),
        "ttfb_graph_s": min(r["ttfb_s"] for r in par),
        "graph_over_critical_path": max(r["graph_s"] / r["critical_path_s"] for r in par),
    }
    summary["ttfb_graph_over_sequential"] = summary["ttfb_graph_s"] / summary["ttfb_sequential_s"]
    console.print(
        f"best TTFB: graph {summary['ttfb_graph_s']:.2f} s vs sequential {summary['ttfb_sequential_s']:.2f} s "
        f"({summary['ttfb_graph_over_sequential']:.2f}x); worst graph start-up / critical path "
        f"{summary['graph_over_critical_path']:.2f}x"
    )
    last = par[-1]
    stages = Table(title="Stages of the last graph run (rank 0; seconds from the start of graph.run())")
    for column in ("stage", "where", "start", "end", "seconds"):
        stages.add_column(column, justify="right")
    for name, (begin, end, where) in sorted(last["timings"].items(), key=lambda kv: kv[1][0]):
        stages.add_row(name, where, f"{begin:.2f}", f"{end:.2f}", f"{end - begin:.2f}")
    console.print(stages)
    console.print("critical path: " + " -> ".join(last["critical_path"]))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.platform(),
                    "python": platform.python_version(),
                    "tables": args.tables,
                    "rows": args.rows,
                    "summary": summary,
                    "runs": runs,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
