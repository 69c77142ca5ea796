"""Per-step snapshots on TorchRec's own models: training step time with and without them, in one run.

TorchRec's ``DLRM`` and ``DLRM_DCN`` (``torchrec.models.dlrm``, in ``DLRMTrain``), 26 tables of
``--rows`` rows x 64, sharded by TorchRec's default planner under ``DistributedModelParallel`` with
a fused row-wise Adagrad, the dense part under DDP with Adam, batches from TorchRec's
``RandomRecDataset``; 2 ranks under torchrun, gloo, CPU. None of it was written for snapshots. Each
configuration is a new torchrun, alternately snapshots off and on (``--rounds`` times each); with
snapshots on, each rank hands its snapshot to the node's keeper, which copies it to a buddy keeper on
TCP (``--no-buddy``: the node keeper only), its copies overlapping the next step (``--no-overlap``:
on the training thread). The step time is the median of rank 0's step times after
the first ``--skip`` steps; the ratio is on / off, medians over the rounds. ``--every K``: a snapshot
after every K steps. Usage::

    python benchmarks/snapshot_overhead_torchrec.py [--models dlrm,dcn] [--steps 120] [--rounds 2] [--every K]
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
from pathlib import Path

TABLES, DIM = 26, 64


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="dlrm,dcn")
    p.add_argument("--rows", type=int, default=20_000, help="rows per table")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip", type=int, default=20, help="first steps left out of the step time")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-buddy", action="store_true", help="snapshots kept by the node's keeper only")
    p.add_argument("--every", type=int, default=1, help="a snapshot after every this many steps")
    p.add_argument("--no-overlap", action="store_true", help="copies on the training thread (overlap=False)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="dlrm", help=argparse.SUPPRESS)
    p.add_argument("--snapshots", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keeper", default="", help=argparse.SUPPRESS)
    p.add_argument("--buddy", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _worker(args: argparse.Namespace) -> None:
    """One rank of one configuration (under torchrun)."""
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.datasets.random import RandomRecDataset
    from torchrec.distributed import DistributedModelParallel
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    keys = [f"f{i}" for i in range(TABLES)]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=args.rows, feature_names=[keys[i]])
        for i in range(TABLES)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dense_arch, over_arch = [256, DIM], [256, 128, 1]
    if args.model == "dcn":
        dlrm = DLRM_DCN(ebc, 13, dense_arch, over_arch, dcn_num_layers=3, dcn_low_rank_dim=32)
    else:
        dlrm = DLRM(ebc, 13, dense_arch, over_arch)
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.02})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.Adam(ps, lr=1e-3)
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    data = iter(
        RandomRecDataset(
            keys,
            batch_size=args.batch_size,
            hash_size=args.rows,
            ids_per_feature=3,
            num_dense=13,
            manual_seed=rank,
            num_generated_batches=20,
        )
    )
    snaps = None
    if args.snapshots:
        from warmstart.checkpoint.keeper import keeper_secret, start_keeper
        from warmstart.checkpoint.snapshot import StepSnapshots
        from warmstart.config import Settings

        secret = keeper_secret(Settings.from_env())
        if int(os.environ["LOCAL_RANK"]) == 0:
            start_keeper(args.keeper, buddy=args.buddy or None, secret=secret)
        dist.barrier()
        snaps = StepSnapshots(
            dmp,
            dense,
            keeper=args.keeper,
            secret=secret,
            job="overhead",
            rank=rank,
            world=world,
            every=args.every,
            overlap=not args.no_overlap,  # this loop changes the state only through its optimizers
        )
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss, _ = dmp(next(data))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if snaps is not None:
            snaps.capture(step)
        times.append(time.perf_counter() - t0)
    report: dict = {"times": times}
    if snaps is not None:
        snaps.flush()
        stats = snaps.stats()
        report.update(
            rows_per_step=stats.rows_per_step,
            bytes_per_step=stats.bytes_per_step,
            capture_ms=1000 * stats.capture_s / args.steps,  # per training step
            skipped=stats.skipped,
            off=snaps.off,
        )
        snaps.close()
        dist.barrier()
        if int(os.environ["LOCAL_RANK"]) == 0:
            snaps.end_job()
    if rank == 0 and args.out is not None:
        args.out.write_text(json.dumps(report))
    dist.destroy_process_group()


def _run(args: argparse.Namespace, work: Path, name: str, snapshots: bool, env: dict[str, str]) -> dict:
    from warmstart.bench.supervise import start_snapshot_buddy

    out = work / f"{name}.json"
    sock_dir = Path(tempfile.mkdtemp(prefix="ws-sot-", dir="/tmp"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "--worker"]
    cmd += ["--model", args.model, "--rows", str(args.rows), "--batch-size", str(args.batch_size)]
    cmd += ["--steps", str(args.steps), "--out", str(out), "--every", str(args.every)]
    cmd += ["--no-overlap"] * args.no_overlap
    buddy_pid = None
    try:
        if snapshots:
            cmd += ["--snapshots", "--keeper", f"unix:{sock_dir / 'keeper.sock'}"]
            if not args.no_buddy:
                buddy, buddy_pid = start_snapshot_buddy(env, work / f"{name}-buddy.log")
                cmd += ["--buddy", buddy]
        with (work / f"{name}.log").open("w") as log:
            done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{name}: exit status {done.returncode} (log: {work / f'{name}.log'})")
    finally:
        if buddy_pid is not None:
            os.kill(buddy_pid, 9)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="warmstart-snapshot-overhead-torchrec-"))
    key = work / "secret"
    key.write_text("snapshot-overhead-benchmark")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHELASTIC"))}
    env.update(WARMSTART_SECRET_FILE=str(key), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    results = []
    try:
        for model in args.models.split(","):
            args.model = model
            off, on, reports = [], [], []
            for r in range(args.rounds):
                for snapshots in (False, True):
                    name = f"{model}-{'on' if snapshots else 'off'}-{r}"
                    report = _run(args, work, name, snapshots, env)
                    step = statistics.median(report["times"][args.skip :])
                    (on if snapshots else off).append(step)
                    if snapshots:
                        reports.append(report)
                    print(f"{name}: {1000 * step:.1f} ms/step", flush=True)
            row = {
                "model": model,
                "step_ms_off": 1000 * statistics.median(off),
                "step_ms_on": 1000 * statistics.median(on),
                "ratio": statistics.median(on) / statistics.median(off),
                **{
                    k: statistics.mean(r[k] for r in reports) for k in ("rows_per_step", "bytes_per_step", "capture_ms")
                },
                "skipped": sum(r["skipped"] for r in reports),
                "off_reason": reports[0]["off"],
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    where = "node keeper only" if args.no_buddy else "node keeper and a buddy keeper on TCP"
    print(f"\nsnapshot overhead on TorchRec's models (2 ranks, {args.steps} steps, {args.rounds} rounds, {where}, ")
    print(f"a snapshot every {args.every} steps)")
    print(f"{'model':>6} {'off ms/step':>12} {'on ms/step':>11} {'on/off':>7} {'rows/step':>10} {'MB/step':>8}")
    for row in results:
        print(
            f"{row['model']:>6} {row['step_ms_off']:>12.1f} {row['step_ms_on']:>11.1f} {row['ratio']:>7.3f} "
            f"{row['rows_per_step']:>10.0f} {row['bytes_per_step'] / 1e6:>8.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"machine": platform.platform(), "buddy": not args.no_buddy, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
