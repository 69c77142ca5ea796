"""The reference job's trainer: a DLRM-style TorchRec model trained on 2 ranks over gloo.

Read it top to bottom: ``Trainer.__init__`` builds the job one stage at a time (each stage is an
ETT span), ``train`` is one loop (step, checkpoint, maybe the injected failure), ``close`` releases
everything. The two modes differ only where warmstart plugs in, each marked ``# warmstart:``:

* ``baseline`` runs the stages in sequence with plain TorchRec and torch: ``planner.collective_plan``,
  a plain DataLoader, a plain ``torch.compile`` and synchronous ``torch.distributed.checkpoint.save``.
* ``warmstart`` runs the same stages through the start-up graph (independent stages overlap), serves
  the sharding plan from the cache (``cached_plan``), saves checkpoints asynchronously, and gets the
  compile cache from the environment alone (``WARMSTART=1``: no code here).

This module owns the training recipe; the model, the data and the configuration live beside it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from warmstart.bench.config import JobConfig
from warmstart.bench.data import NUM_DENSE, ClickLogDataset, make_loader, make_tables
from warmstart.bench.model import DLRMTrain, build_model
from warmstart.metrics import Recorder, NullRecorder

_CKPT_RE = re.compile(r"^step-(\d+)$")


class Trainer:
    """Builds and trains the reference job on this rank."""

    # -- core config
    cfg: JobConfig
    rec: Recorder | NullRecorder
    rank: int
    world_size: int
    attempt: int

    # -- training components
    model: DistributedModelParallel
    optimizer: CombinedOptimizer
    batches: Iterator[Batch]

    # -- training state
    step: int
    """The next step to run (0, or the step after the restored checkpoint)."""

    def __init__(self, cfg: JobConfig, rec: Recorder | NullRecorder) -> None:
        self.cfg, self.rec = cfg, rec
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.tables = make_tables(cfg.tables, rows_min=cfg.rows_min, rows_max=cfg.rows_max, seed=cfg.seed)
        self._loader = None
        torch.set_num_threads(1)  # 2 ranks share 2 cores: one thread each, no oversubscription

        # process group: gloo, the CPU backend; every collective below runs on it
        with rec.span("process_group_init"):
            dist.init_process_group(backend="gloo")

        # resume point: the latest checkpoint whose commit marker exists (never a partial one)
        self.resume_from = latest_committed(cfg.checkpoint_dir)
        self.step = 0 if self.resume_from is None else self.resume_from[0] + 1

        # data loader: workers start at iter(); the first batch proves they are up
        with rec.span("data_loader_init"):
            self.batches = self._build_loader(self.step)

        # model on the meta device (free), dense part with real weights, embedding optimizer fused
        # into the backward pass (row-wise Adagrad, applied by TorchRec's fused kernels)
        with rec.span("model_build", bucket="model_transform"):
            module = self._build_module()

        # compile warm-up: compile the dense part on a synthetic batch of the real shapes, so the
        # first real step finds it compiled
        with rec.span("compile"):
            self._compile_warmup(module)

        # sharding plan: rank 0 plans, every rank gets the plan by broadcast
        with rec.span("sharding_plan"):
            plan = self._plan(module)

        # model transform: shard the tables, DDP-wrap the dense part, build the optimizers
        with rec.span("model_transform"):
            self.model, self.optimizer = self._shard(module, plan)

        # checkpoint load: restore model and optimizer in place
        if self.resume_from is not None:
            with rec.span("checkpoint_load"):
                self._load_checkpoint(self.resume_from[1])

    # -- stages -----------------------------------------------------------------------------------

    def _build_loader(self, start_step: int) -> Iterator[Batch]:
        dataset = ClickLogDataset(self.tables, self.cfg.batch_size, rank=self.rank, start_step=start_step,
                                  seed=self.cfg.seed)
        self._loader = make_loader(dataset, num_workers=self.cfg.loader_workers)
        batches = iter(self._loader)
        first = next(batches)
        return _prepend(first, batches)

    def _build_module(self) -> DLRMTrain:
        cfg = self.cfg
        module = build_model(self.tables, dim=cfg.dim, dense_layers=list(cfg.dense_layers),
                             over_layers=list(cfg.over_layers), seed=cfg.seed)
        apply_optimizer_in_backward(RowWiseAdagrad, module.sparse_arch.parameters(), {"lr": cfg.lr_sparse})
        return module

    def _compile_warmup(self, module: DLRMTrain) -> None:
        cfg = self.cfg
        # dynamic=False: every batch has the same shapes, so one static graph (no recompiles)
        module.dense_over.compile(dynamic=False)
        dense = torch.zeros(cfg.batch_size, NUM_DENSE)
        pooled = torch.zeros(cfg.batch_size, cfg.tables * cfg.dim, requires_grad=True)
        labels = torch.zeros(cfg.batch_size)
        loss, _ = module.dense_over(dense, pooled, labels)
        loss.backward()  # compiles the backward graph too
        for p in module.dense_over.parameters():
            p.grad = None  # the warm-up must not leak into training

    def _plan(self, module: DLRMTrain) -> ShardingPlan:
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=self.world_size,
                          local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))),
            kernel_config=KernelConfig(compute_device="cpu"),
        )
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=self.cfg.batch_size,
                                           storage_reservation=FixedPercentageStorageReservation(0.15))
        return planner.collective_plan(module, self._sharders(), dist.GroupMember.WORLD)

    def _sharders(self) -> list:
        return [EmbeddingBagCollectionSharder()]

    def _shard(self, module: DLRMTrain, plan: ShardingPlan) -> tuple[DistributedModelParallel, CombinedOptimizer]:
        # output_dtensor=True: state dicts hold DTensors, which DCP's async staging can copy
        env = ShardingEnv(self.world_size, self.rank, dist.GroupMember.WORLD, output_dtensor=True)
        model = DistributedModelParallel(module, env=env, device=torch.device("cpu"), plan=plan,
                                         sharders=self._sharders())
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=self.cfg.lr_dense))
        self._dense_optimizer = dense
        return model, CombinedOptimizer([model.fused_optimizer, dense])

    def _app_state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load_checkpoint(self, path: Path) -> None:
        self._dense_optimizer.init_state()  # Adam's state is lazy: create it so it can be loaded in place
        state = self._app_state()
        dcp.load(state, checkpoint_id=str(path))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def _save_checkpoint(self, step: int) -> None:
        path = self.cfg.checkpoint_dir / f"step-{step}"
        with self.rec.span("checkpoint_save"):
            dcp.save(self._app_state(), checkpoint_id=str(path))
            # DCP writes .metadata last, on the coordinator, before any rank returns: it is the commit
        self.rec.checkpoint_committed(step)
        if self.rank == 0:
            _prune(self.cfg.checkpoint_dir, self.cfg.keep_checkpoints)

    # -- the loop ---------------------------------------------------------------------------------

    def train(self) -> None:
        """Run from ``self.step`` to ``cfg.steps``, checkpointing every ``cfg.checkpoint_every`` steps."""
        cfg, rec = self.cfg, self.rec
        samples = cfg.batch_size * self.world_size
        self.model.train()
        t_log = time.perf_counter()
        while self.step < cfg.steps:
            step = self.step
            rec.step(step, samples=samples)
            if step == cfg.fail_at_step and self.attempt == 0:
                self._die(step)
            batch = next(self.batches)
            loss, _ = self.model(batch)
            loss.backward()  # the embedding tables are updated here (fused optimizer)
            self.optimizer.step()
            self.optimizer.zero_grad()
            if (step + 1) % cfg.checkpoint_every == 0:
                self._save_checkpoint(step)
            if self.rank == 0 and (step + 1) % cfg.log_every == 0:
                now = time.perf_counter()
                print(f"step {step + 1}/{cfg.steps} loss {loss.item():.4f} "
                      f"{(now - t_log) / cfg.log_every * 1000:.0f} ms/step", flush=True)
                t_log = now
            self.step += 1
        rec.train_end()

    def _die(self, step: int) -> None:
        """The injected failure: the machine is gone, as if its power were cut."""
        print(f"rank {self.rank}: injected failure at step {step} (attempt {self.attempt})", flush=True)
        self.rec.failure(f"injected failure at step {step}", "infra")
        self.rec.flush()
        os._exit(17)

    def close(self) -> None:
        """Release the loader workers and the process group; safe on a half-built trainer."""
        if self._loader is not None:
            self.batches = iter(())
            self._loader = None
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def latest_committed(checkpoint_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint under ``checkpoint_dir`` whose ``.metadata`` (DCP's commit) exists."""
    found = []
    if checkpoint_dir.is_dir():
        for child in checkpoint_dir.iterdir():
            match = _CKPT_RE.match(child.name)
            if match and (child / ".metadata").is_file():
                found.append((int(match.group(1)), child))
    return max(found) if found else None


def _prune(checkpoint_dir: Path, keep: int) -> None:
    committed = []
    for child in checkpoint_dir.iterdir():
        match = _CKPT_RE.match(child.name)
        if match and (child / ".metadata").is_file():
            committed.append((int(match.group(1)), child))
    for _, path in sorted(committed)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _prepend(first: Batch, rest: Iterator[Batch]) -> Iterator[Batch]:
    yield first
    yield from rest
