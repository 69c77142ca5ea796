"""A small, deterministic TorchRec trainer for the checkpoint tests, run under torchrun (gloo, CPU).

Two embedding tables sharded table-wise over the ranks with a fused Adagrad (updated inside
backward), a dense part under DDP with SGD + momentum and dropout (global torch RNG), labels with
noise from Python's ``random`` and NumPy (their global RNGs), and a per-rank data loader position.
Bit-identical resumption therefore needs the sharded tables, both optimizers, the loader position
and all three RNGs of every rank restored.

Writes ``<out>/report-r<rank>-a<attempt>.json`` (resumed step, folders seen at start) and, at the
end, ``<out>/final-r<rank>.pt`` (local parameters and optimizer state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from warmstart.checkpoint import Checkpointer, RankLocal
from warmstart.init_pipeline import release_process_groups

TABLES, ROWS, DIM, BATCH = 2, 512, 16, 16


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                for i in range(TABLES)
            ],
            device=torch.device("meta"),
        )
        self.mlp = torch.nn.Sequential(torch.nn.Linear(TABLES * DIM + 4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        x = torch.cat([pooled[f"f{i}"] for i in range(TABLES)] + [dense], dim=1)
        x = torch.nn.functional.dropout(x, 0.2, training=True)
        return torch.nn.functional.mse_loss(self.mlp(x).squeeze(1), label)


class Batches:
    """Deterministic per-rank batches; the position is the loader state to checkpoint."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next(self) -> tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * (self.rank + 1) + self.position)
        self.position += 1
        lengths = torch.randint(1, 4, (TABLES * BATCH,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths)
        dense = torch.randn(BATCH, 4, generator=g)
        noise = torch.tensor([random.random() + float(np.random.rand()) for _ in range(BATCH)]) * 0.01
        return kjt, dense, dense.sum(1) + noise

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def build(rank: int, world: int) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    torch.manual_seed(0)  # same initial weights on every run and every rank
    model = Model()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05})
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {f"t{i}": table_wise(rank=i % world) for i in range(TABLES)},
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
        lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def local(value: object) -> object:
    if hasattr(value, "to_local"):
        return value.to_local().clone()  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    return value


class Tripwire:
    """A rank-local checkpoint entry that SIGKILLs its process when DCP serializes it: inside the
    background write of the checkpoint, after this rank's data file is opened and before the rank
    reports its write to the coordinator. Staging copies it without firing (``__deepcopy__``)."""

    def __init__(self, armed: bool = False) -> None:
        self.armed = armed

    def __deepcopy__(self, memo: dict) -> Tripwire:
        return Tripwire(self.armed)

    def __reduce__(self) -> tuple:
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return (Tripwire, (False,))


def slow_down_copies() -> None:
    """Every overlapped copy of a snapshot takes 0.3 s more."""
    import warmstart.checkpoint.snapshot as snapshot_module

    copy_into = snapshot_module.packing.copy_into

    def slow_copy_into(*a, **kw):
        if threading.current_thread().name == "warmstart-snapshot-copies":
            time.sleep(0.3)
        return copy_into(*a, **kw)

    snapshot_module.packing.copy_into = slow_copy_into


def die(args: argparse.Namespace, snaps: Any, secret: bytes | None, rank: int, world: int, step: int) -> None:
    """Attempt 0's ranks all exit (status 17) at the start of ``step``, as the options say."""
    if snaps is not None and not args.slow_copies:
        snaps.flush()
    elif snaps is not None:  # the keeper has the step before last; the last is still being copied
        from warmstart.checkpoint.keeper import KeeperClient

        client, deadline = KeeperClient(args.keeper, secret=secret), time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = client.request({"op": "status", "job": "ckpt-test"})[0]["ranks"].get(str(rank), {})
            if step - 2 in mine.get("restorable", []):
                break
            time.sleep(0.01)
    dist.barrier()
    if args.lose_node and rank == 0:
        from warmstart.checkpoint.keeper import KeeperClient

        if args.buddy:  # the node goes after the buddy got what the keeper got: both ranks' last step
            buddy = KeeperClient(args.buddy, secret=secret)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ranks = buddy.request({"op": "status", "job": "ckpt-test"})[0]["ranks"]
                if all(step - 1 in ranks.get(str(r), {}).get("restorable", []) for r in range(world)):
                    break
                time.sleep(0.01)
        pid = KeeperClient(args.keeper, secret=secret).request({"op": "ping"})[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        os.unlink(args.keeper.removeprefix("unix:"))
    os._exit(17)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--mode", default="async-thread")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--on-error", default="raise")
    p.add_argument("--ballast-kb", type=int, default=0, help="extra rank-local state, KiB per rank")
    p.add_argument(
        "--ballast-kb-after",
        type=int,
        nargs=2,
        default=None,
        metavar=("STEP", "KB"),
        help="from STEP on, the extra state is KB KiB per rank (checkpoints grow)",
    )
    p.add_argument("--keeper", help="node keeper of snapshots (unix:/path, {attempt} filled in), from local rank 0")
    p.add_argument("--lose-node", action="store_true", help="at --die-at, the node's keeper is killed too")
    p.add_argument("--keeper-fault", choices=("kill", "stop"), help="rank 0 kills or stops the keeper ...")
    p.add_argument("--keeper-fault-at", type=int, default=-1, help="... after this step (attempt 0)")
    p.add_argument("--buddy", help="the buddy keeper (host:port) the node keeper copies to")
    p.add_argument("--buddy-restore", default="", help="the buddy keeper a restarted rank may restore from")
    p.add_argument("--snapshot-every", type=int, default=1, help="a snapshot after every this many steps")
    p.add_argument("--overlap", action="store_true", help="snapshots copied while the next step runs")
    p.add_argument(
        "--slow-copies",
        action="store_true",
        help="the overlapped copies take 0.3 s each, and attempt 0 dies once the keeper has the step before last",
    )
    p.add_argument("--die-at", type=int, default=-1, help="attempt 0's ranks all exit at the start of this step")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL --kill-rank while it writes the save of this step")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    seen = sorted(os.listdir(args.dir)) if args.dir.is_dir() else []

    dmp, optimizer = build(rank, world)
    loader = Batches(rank)
    ballast = torch.arange(args.ballast_kb * 256, dtype=torch.float32) + rank
    tripwire = Tripwire()
    state = {
        "model": dmp,
        "optim": optimizer,
        "loader": RankLocal(loader),
        "ballast": RankLocal({"t": ballast}),
        "tripwire": RankLocal({"wire": tripwire}),
    }
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)

    ckpt = Checkpointer(args.dir, mode=args.mode, keep=args.keep, on_error=args.on_error)
    resumed = ckpt.load_latest(state)
    snaps, secret = None, None
    if args.keeper:
        from warmstart.checkpoint.keeper import keeper_secret, start_keeper
        from warmstart.checkpoint.snapshot import StepSnapshots
        from warmstart.config import Settings

        secret = keeper_secret(Settings.from_env())
        args.keeper = args.keeper.replace("{attempt}", str(attempt))
        if args.slow_copies:  # the next step reaches the updates long before a copy is done
            slow_down_copies()
        if int(os.environ["LOCAL_RANK"]) == 0:
            start_keeper(args.keeper, buddy=args.buddy, secret=secret)
        dist.barrier()
        dense_optimizer = optimizer.optimizers[1][1]
        snaps = StepSnapshots(
            dmp,
            dense_optimizer,
            keeper=args.keeper,
            buddy=args.buddy_restore or None,
            secret=secret,
            job="ckpt-test",
            rank=rank,
            world=world,
            extra={"loader": loader},
            every=args.snapshot_every,
            overlap=args.overlap,
        )
        restored = snaps.restore(resumed)
        if restored is not None:
            resumed = restored[0]
        report_snapshot = restored
    report = {
        "rank": rank,
        "attempt": attempt,
        "seen_at_start": seen,
        "resumed": resumed,
        "position": loader.position,
        "saved": [],
        "failures": 0,
        "snapshot": report_snapshot if snaps is not None else None,
        "overlap": snaps.overlap if snaps is not None else None,
    }
    (args.out / f"report-r{rank}-a{attempt}.json").write_text(json.dumps(report))

    for step in range(0 if resumed is None else resumed + 1, args.steps):
        if step == args.die_at and attempt == 0:
            die(args, snaps, secret, rank, world, step)
        kjt, dense, label = loader.next()
        loss = dmp(kjt, dense, label)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if snaps is not None:
            snaps.committed(ckpt.last_committed_step)
            snaps.capture(step)
            if args.keeper_fault and step == args.keeper_fault_at and attempt == 0 and rank == 0:
                from warmstart.checkpoint.keeper import KeeperClient

                pid = KeeperClient(args.keeper, secret=secret).request({"op": "ping"})[0]["pid"]
                os.kill(pid, signal.SIGKILL if args.keeper_fault == "kill" else signal.SIGSTOP)
        if args.ballast_kb_after and step == args.ballast_kb_after[0]:
            state["ballast"] = RankLocal({"t": torch.arange(args.ballast_kb_after[1] * 256, dtype=torch.float32)})
        if (step + 1) % args.save_every == 0:
            tripwire.armed = rank == args.kill_rank and step == args.kill_at and attempt == 0
            ckpt.save(step, state)
            report["saved"].append(step)
            if tripwire.armed:
                time.sleep(60)  # killed by the write in the background long before this ends
    ckpt.close()
    if snaps is not None:
        report["snapshot_stats"] = dataclasses.asdict(snaps.stats())
        snaps.close()
    report.update(failures=ckpt.failures, committed=ckpt.last_committed_step, position=loader.position)
    (args.out / f"report-r{rank}-a{attempt}.json").write_text(json.dumps(report))
    final = {"model": local(dmp.state_dict()), "optim": local(optimizer.state_dict())}
    torch.save(final, args.out / f"final-r{rank}.pt")


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - reported as the interpreter would; then the groups are freed
        sys.excepthook(*sys.exc_info())
        code = 1
    else:
        code = 0
    # With main's frame (the DMP, the checkpointer) gone, the process groups are freed and their gloo
    # threads joined before the interpreter finalizes (see release_process_groups).
    release_process_groups()
    sys.exit(code)
