"""The reference job's trainer: a DLRM-style TorchRec model trained on 2 ranks over gloo.

Read it top to bottom: ``Trainer.__init__`` builds the job one stage at a time (each stage is an
ETT span), ``train`` is one loop (step, checkpoint, maybe the injected failure), ``close`` releases
everything. The two modes differ only where warmstart plugs in, each marked ``# warmstart:``:

* ``baseline`` runs the stages in sequence with plain TorchRec and torch: a plain DataLoader (its
  workers forked first, before any thread starts), ``planner.collective_plan``, a plain
  ``torch.compile`` and synchronous ``torch.distributed.checkpoint.save``.
* ``warmstart`` runs the same stages through the start-up graph (independent stages overlap), serves
  the sharding plan from the plan cache (as ``cached_plan`` does), saves checkpoints asynchronously
  (pre-warmed, the copy overlapped with the next forward pass), hands a snapshot of each step to
  the node's keeper (a restart resumes from the step it failed in), and gets the compile cache from
  the environment alone (``WARMSTART=1``: no code here).

This module owns the training recipe; the model, the data and the configuration live beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from warmstart import torch_internals
from warmstart.bench.config import JobConfig
from warmstart.bench.data import NUM_DENSE, ClickLogDataset, make_loader, make_tables
from warmstart.bench.model import DenseOverArch, DLRMTrain, embedding_configs
from warmstart.checkpoint import Checkpointer, latest_committed
from warmstart.checkpoint.snapshot import StepSnapshots
from warmstart.checkpoint.state import prepare_for_load
from warmstart.init_pipeline import CompileWarmup, TorchRecStartup, torchrec_startup_graph, zero_initialized
from warmstart.metrics import NullRecorder, Recorder

_COMPILE_KWARGS = {"dynamic": False}  # every batch has the same shapes: one static graph, no recompiles
_DCP_CKPT_RE = re.compile(r"^step-(\d+)$")  # the baseline's plain DCP checkpoint folders


def _compile_regions(module: DenseOverArch) -> DenseOverArch:
    """How the job compiles its dense part (what the compile warm-up must do alike)."""
    module.compile_regions(**_COMPILE_KWARGS)
    return module


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
    checkpointer: Checkpointer | None
    """warmstart's asynchronous checkpointer (``None`` in baseline mode: plain synchronous DCP)."""
    snapshots: StepSnapshots | None
    """warmstart's per-step snapshots (``None`` in baseline mode, or with ``--snapshots off``)."""

    # -- training state
    step: int
    """The next step to run (0, or the step after the restored checkpoint)."""

    def __init__(self, cfg: JobConfig, rec: Recorder | NullRecorder) -> None:
        self.cfg, self.rec = cfg, rec
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.tables = make_tables(cfg.tables, rows_min=cfg.rows_min, rows_max=cfg.rows_max, seed=cfg.seed)
        self.checkpointer = None
        self.snapshots = None
        self._loader: DataLoader | None = None
        torch.set_num_threads(1)  # 2 ranks share 2 cores: one thread each, no oversubscription
        self.resumed_from: int | None = None
        self._stage_rows: list[tuple[str, str, str, str, str]] = []
        if cfg.mode == "warmstart":
            self._start_with_startup_graph()
        else:
            self._start_in_sequence()
        self._write_startup_report()

    # -- start-up, baseline: one stage after the other ----------------------------------------------

    def _start_in_sequence(self) -> None:
        cfg, rec = self.cfg, self.rec

        # resume point: the latest checkpoint whose DCP metadata (its commit) exists (a directory listing)
        resume = _latest_dcp_checkpoint(cfg.checkpoint_dir)
        self.resumed_from = None if resume is None else resume[0]
        self.step = 0 if resume is None else resume[0] + 1

        # data loader first: iter() forks the workers, and a fork must come before gloo's and the
        # compiler's threads exist (a thread holding a lock at the fork leaves the worker deadlocked).
        # Plain torch practice, as the start-up graph does it; the first batch proves they are up and
        # is fetched here, in sequence, before the next stage starts.
        with rec.span("data_loader_init"):
            self._loader = make_loader(self._dataset(self.step), num_workers=cfg.loader_workers)
            batches = iter(self._loader)
            self.batches = _prepend(next(batches), batches)

        # process group: gloo, the CPU backend; every collective below runs on it
        with rec.span("process_group_init"):
            dist.init_process_group(backend="gloo", timeout=timedelta(seconds=cfg.collective_timeout_s))

        # the model: tables on the meta device, dense part with real weights
        with rec.span("model_build", bucket="model_transform"):
            module = self._build_module(torch.device("meta"))

        # compile: plain torch.compile, run once on a batch of the real shapes so that the first
        # step finds it compiled (otherwise the compile would hide inside step 0)
        with rec.span("compile"):
            loss, _ = module.dense_over(*self._synthetic_dense_batch())
            loss.backward()
            module.dense_over.zero_grad(set_to_none=True)  # the warm-up must not leak into training

        # sharding plan: rank 0 plans, every rank gets the plan by broadcast
        with rec.span("sharding_plan"):
            plan = self._planner().collective_plan(module, self._sharders(), dist.GroupMember.WORLD)

        # model transform: shard the tables, DDP-wrap the dense part, build the optimizers
        with rec.span("model_transform"):
            env = ShardingEnv(self.world_size, self.rank, dist.GroupMember.WORLD, output_dtensor=True)
            self.model = DistributedModelParallel(
                module, env=env, device=torch.device("cpu"), plan=plan, sharders=self._sharders()
            )
            self.optimizer = self._build_optimizer(self.model)

        # checkpoint load: restore model and optimizer in place
        if resume is not None:
            with rec.span("checkpoint_load"):
                prepare_for_load(self.optimizer)  # Adam's lazy state must exist to load in place
                state = self._app_state()
                dcp.load(state, checkpoint_id=str(resume[1]))
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optim"])
            # what we resume from is durable: this vouches for the commit if the failure cut off its event
            rec.checkpoint_committed(resume[0])

    # -- start-up, warmstart: the same stages as a graph -------------------------------------------

    def _start_with_startup_graph(self) -> None:
        cfg = self.cfg
        # warmstart: the resume point is known before any stage runs (a directory listing), so the
        # data loader can start at the right step while the model is still being built
        latest = latest_committed(cfg.checkpoint_dir)
        self.step = 0 if latest is None else latest.step + 1
        # warmstart: the node's snapshot keeper (started by local rank 0 if none runs), and the newest
        # step every rank can be restored to from it or from the buddy: where the loader starts
        snapshot_plan = self._start_keeper(latest.step if latest is not None else None)
        if snapshot_plan is not None:
            self.step = snapshot_plan[0] + 1

        def build_loader(rank: int, world_size: int) -> DataLoader:
            # warmstart: the graph forks the workers before its threads start, then fetches the
            # first batch while everything else starts up
            self._loader = make_loader(self._dataset(self.step), num_workers=cfg.loader_workers)
            return self._loader

        def load_checkpoint(model: DistributedModelParallel, optimizer: CombinedOptimizer) -> int | None:
            # warmstart: asynchronous checkpoints; their own gloo group, a commit marker, keep-N
            self.checkpointer = Checkpointer(
                cfg.checkpoint_dir,
                mode=cfg.checkpoint_mode,
                keep=cfg.keep_checkpoints,
                recorder=self.rec,
                overlap_staging=True,
            )
            return self.checkpointer.load_latest({"model": model, "optim": optimizer})

        spec = TorchRecStartup(
            build_model=self._build_module,
            batch_size=cfg.batch_size,
            sharders=self._sharders(),
            # warmstart: the plan comes from the cache (a hit is a lookup, a miss plans in a subprocess)
            build_planner=lambda world, local_world, device_type: self._planner(),
            build_loader=build_loader,
            prefetch_batches=1,
            build_optimizer=self._build_optimizer,
            load_checkpoint=load_checkpoint,
            # warmstart: compile on a synthetic batch in a thread while the rest starts up; with
            # WARMSTART=1 Inductor's artifacts come from the shared cache
            compile_warmup=CompileWarmup(
                # warmstart: zero-initialized: no time spent initializing weights the compile does not read
                build=zero_initialized(lambda device: self._build_dense_over(seeded=False)),
                example_inputs=lambda device: self._synthetic_dense_batch(),
                compile_module=_compile_regions,
            ),
            pg_timeout_s=cfg.collective_timeout_s,
            output_dtensor=True,
        )
        result = torchrec_startup_graph(spec, recorder=self.rec).run()
        self.model, self.optimizer = result["model_transform"], result["optimizer_init"]
        self.batches = result["data_loader_init"]
        self.resumed_from = result["checkpoint_load"]
        expected = None if latest is None else latest.step
        if self.resumed_from != expected:  # a checkpoint committed while we started: impossible
            raise RuntimeError(f"resumed from step {self.resumed_from}, expected {expected}")
        self._stage_rows = result.rows()
        self._restore_snapshot(snapshot_plan)
        # warmstart: the first asynchronous save pays one-time costs (staging buffers, DTensor's
        # per-shape caches): pay them in the background while training starts
        assert self.checkpointer is not None  # the graph's checkpoint_load stage made it
        self.checkpointer.prewarm(self._app_state())

    def _start_keeper(self, checkpoint_step: int | None) -> tuple[int, str] | None:
        """Bring up this node's snapshot keeper; the step every rank can be restored to, if any."""
        if not self.cfg.snapshots:
            return None
        from warmstart.checkpoint.keeper import KeeperError, keeper_secret, start_keeper
        from warmstart.checkpoint.snapshot import newest_restorable
        from warmstart.config import Settings

        self._keeper = f"unix:{Path(tempfile.gettempdir()) / 'warmstart-keeper.sock'}"
        self._buddy = self.cfg.snapshot_buddy or None
        self._secret = keeper_secret(Settings.from_env())
        if self.local_rank == 0:
            try:
                # not waited for: a new node's keeper is empty, and the snapshots wait for it themselves
                start_keeper(self._keeper, buddy=self._buddy, secret=self._secret, wait=False)
            except KeeperError as exc:  # the job goes on; its snapshots warn once and stop
                print(f"warmstart: no snapshot keeper on this node ({exc})", file=sys.stderr, flush=True)
        return newest_restorable(
            {"keeper": self._keeper, "buddy": self._buddy},
            job=self._job_id(),
            world=self.world_size,
            checkpoint_step=checkpoint_step,
            secret=self._secret,
        )

    def _restore_snapshot(self, plan: tuple[int, str] | None) -> None:
        """Snapshots from here on; with ``plan``, first restore its step on top of the checkpoint."""
        from warmstart.checkpoint.snapshot import StepSnapshots

        if not self.cfg.snapshots:
            return  # the checkpointer's load recorded what was resumed, as without snapshots
        dense = next(opt for _, opt in self.optimizer.optimizers if isinstance(opt, KeyedOptimizerWrapper))
        self.snapshots = StepSnapshots(
            self.model,
            dense,
            keeper=self._keeper,
            buddy=self._buddy,
            secret=self._secret,
            job=self._job_id(),
            rank=self.rank,
            world=self.world_size,
            overlap=True,  # this loop changes the state only through its optimizers between steps
        )
        restored = self.snapshots.restore(self.resumed_from, step=None if plan is None else plan[0])
        if restored is None and plan is not None:
            # the loader started after the planned step, which could not be restored on every rank:
            # it starts again after the checkpoint, in this process (a fork now, with the process
            # group's threads running, could leave a worker holding one of their locks)
            print(f"warmstart: step {plan[0]} not restored; resuming from the checkpoint", file=sys.stderr, flush=True)
            self.step = 0 if self.resumed_from is None else self.resumed_from + 1
            self._loader = make_loader(self._dataset(self.step), num_workers=0)
            self.batches = iter(self._loader)
        if restored is not None:
            self.resumed_from = restored[0]
            self.rec.resumed(*restored)
        elif self.resumed_from is not None:
            self.rec.resumed(self.resumed_from, "checkpoint")

    def _job_id(self) -> str:
        return getattr(self.rec, "job", None) or os.environ.get("TORCHELASTIC_RUN_ID", "reference-job")

    # -- the job's parts ----------------------------------------------------------------------------

    def _dataset(self, start_step: int) -> ClickLogDataset:
        return ClickLogDataset(
            self.tables, self.cfg.batch_size, rank=self.rank, start_step=start_step, seed=self.cfg.seed
        )

    def _build_dense_over(self, *, seeded: bool = True) -> DenseOverArch:
        cfg = self.cfg
        if seeded:  # same dense weights on every rank and attempt (DDP also syncs them from rank 0)
            torch.manual_seed(cfg.seed)
        return DenseOverArch(cfg.tables, cfg.dim, list(cfg.dense_layers), list(cfg.over_layers))

    def _build_module(self, device: torch.device) -> DLRMTrain:
        """The unsharded model: tables on ``device`` (``meta``: DMP materializes only its shards),
        the dense part compiled lazily, the embedding optimizer fused into the backward pass."""
        cfg = self.cfg
        ebc = EmbeddingBagCollection(tables=embedding_configs(self.tables, cfg.dim), device=device)
        dense_over = self._build_dense_over()
        # regional compilation: the dense and over arches get their own graphs and cache entries, so
        # an edit to one recompiles that one only (docs/compile_cache.md, "Edits")
        dense_over.compile_regions(**_COMPILE_KWARGS)
        # row-wise Adagrad, applied by TorchRec's fused kernels during backward
        torch_internals.require("apply_optimizer_in_backward")(RowWiseAdagrad, ebc.parameters(), {"lr": cfg.lr_sparse})
        return DLRMTrain(ebc, dense_over)

    def _synthetic_dense_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs of ``dense_over`` with the real shapes and dtypes (what compile specializes on)."""
        cfg = self.cfg
        return (
            torch.zeros(cfg.batch_size, NUM_DENSE),
            torch.zeros(cfg.batch_size, cfg.tables * cfg.dim, requires_grad=True),
            torch.zeros(cfg.batch_size),
        )

    def _planner(self) -> EmbeddingShardingPlanner:
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=self.world_size, local_world_size=self.local_world_size),
            kernel_config=KernelConfig(compute_device="cpu"),
        )
        return EmbeddingShardingPlanner(
            topology=topology,
            batch_size=self.cfg.batch_size,
            storage_reservation=FixedPercentageStorageReservation(0.15),
        )

    def _sharders(self) -> list[EmbeddingBagCollectionSharder]:
        return [EmbeddingBagCollectionSharder()]

    def _build_optimizer(self, model: DistributedModelParallel) -> CombinedOptimizer:
        # the fused (in-backward) embedding optimizer plus Adam over the dense parameters
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda params: torch.optim.Adam(params, lr=self.cfg.lr_dense),
        )
        return CombinedOptimizer([model.fused_optimizer, dense])

    def _app_state(self, model: DistributedModelParallel | None = None) -> dict:
        model = model if model is not None else self.model
        if self.cfg.mode == "warmstart":
            return {"model": model, "optim": self.optimizer}  # Stateful objects: the checkpointer calls state_dict()
        return {"model": model.state_dict(), "optim": self.optimizer.state_dict()}

    def _wait_staged(self, grad: torch.Tensor) -> None:
        # Called once, during the backward after a save: training waits here only if the copy is
        # still running, and that wait is blocking time, recorded as such.
        self.model.module.pooled_grad_hook = None
        assert self.checkpointer is not None  # a save was just started with it
        with self.rec.span("checkpoint_save"):
            self.checkpointer.wait_staged()

    def _write_startup_report(self) -> None:
        """What this attempt's start-up did, next to its events: where it resumed, how its compile
        went (torch's own cache counters) and, with the start-up graph, when each stage ran."""
        run_dir = getattr(self.rec, "run_dir", None)
        if run_dir is None:
            return
        counters = torch_internals.require("dynamo_counters")
        compile_counters = {
            key: counters[group][key]
            for group, key in (
                ("inductor", "fxgraph_cache_hit"),
                ("inductor", "fxgraph_cache_miss"),
                ("aot_autograd", "autograd_cache_hit"),
                ("aot_autograd", "autograd_cache_miss"),
            )
        }
        report = {
            "rank": self.rank,
            "attempt": self.attempt,
            "mode": self.cfg.mode,
            "resumed_from_step": self.resumed_from,
            "compile_counters": compile_counters,
            "stages": [
                dict(zip(("stage", "runs_on", "start", "end", "seconds"), row, strict=True)) for row in self._stage_rows
            ],
        }
        path = Path(run_dir) / f"startup-r{self.rank}-a{self.attempt}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))

    def _write_snapshot_report(self) -> None:
        """``snapshots-r<rank>-a<attempt>.json`` next to the events: what the snapshots cost and moved."""
        run_dir = getattr(self.rec, "run_dir", None)
        if run_dir is None or self.snapshots is None:
            return
        stats = dataclasses.asdict(self.snapshots.stats())
        path = Path(run_dir) / f"snapshots-r{self.rank}-a{self.attempt}.json"
        path.write_text(json.dumps({"rank": self.rank, "attempt": self.attempt, **stats}, indent=1))

    def _save_checkpoint(self, step: int) -> None:
        if self.checkpointer is not None:
            # warmstart: returns once the write has started; the copy to CPU memory goes on during
            # the next forward pass and most of the backward, the write and commit in the background
            self.checkpointer.save(step, self._app_state())
            # wait for the copy inside the next backward, right before the tables are written
            self.model.module.pooled_grad_hook = self._wait_staged
            return
        path = self.cfg.checkpoint_dir / f"step-{step}"
        with self.rec.span("checkpoint_save"):
            dcp.save(self._app_state(), checkpoint_id=str(path))
            # DCP writes .metadata last, on the coordinator, before any rank returns: it is the commit
        self.rec.checkpoint_committed(step)
        if self.rank == 0:
            _prune_dcp_checkpoints(self.cfg.checkpoint_dir, self.cfg.keep_checkpoints)

    # -- the loop ---------------------------------------------------------------------------------

    def train(self) -> None:
        """Run from ``self.step`` to ``cfg.steps``, checkpointing every ``cfg.checkpoint_every`` steps."""
        cfg, rec = self.cfg, self.rec
        samples = cfg.batch_size * self.world_size
        self.model.train()
        self._losses = self._open_losses()
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
            if self.snapshots is not None:
                # warmstart: the rows this step changed and the small state, to the node's keeper
                if self.checkpointer is not None:
                    self.snapshots.committed(self.checkpointer.last_committed_step)
                self.snapshots.capture(step)
            if self._losses is not None:
                self._losses.write(f"{step} {loss.item()!r}\n")
            if (step + 1) % cfg.checkpoint_every == 0:
                self._save_checkpoint(step)
            if self.rank == 0 and (step + 1) % cfg.log_every == 0:
                now = time.perf_counter()
                print(
                    f"step {step + 1}/{cfg.steps} loss {loss.item():.4f} "
                    f"{(now - t_log) / cfg.log_every * 1000:.0f} ms/step",
                    flush=True,
                )
                t_log = now
            self.step += 1
        if self._losses is not None:
            self._losses.close()
        rec.train_end()

    def _open_losses(self) -> IO[str] | None:
        """``losses-r<rank>-a<attempt>.txt`` next to the events: each step's loss on this rank, one
        ``<step> <loss>`` line per step (``repr``: every digit), so that runs can be compared step by step
        (``warmstart.bench.cold_vs_warm.losses``)."""
        run_dir = getattr(self.rec, "run_dir", None)
        if run_dir is None:
            return None
        path = Path(run_dir) / f"losses-r{self.rank}-a{self.attempt}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w", buffering=1)  # noqa: SIM115 (open for the loop; closed at its end or exit)

    def _die(self, step: int) -> None:
        """The injected failure: the machine is gone, as if its power were cut.

        Its ranks die together: without the barrier, the first rank's exit lets torchrun stop the
        others wherever they are, some still finishing the step before (their record of this step
        then never written)."""
        print(f"rank {self.rank}: injected failure at step {step} (attempt {self.attempt})", flush=True)
        self.rec.failure(f"injected failure at step {step}", "infra")
        self.rec.flush()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer already gone: die anyway
                dist.barrier()
        if self.snapshots is not None and self.local_rank == 0:
            self._kill_keeper()  # the whole machine is gone: its keeper with it
        os._exit(17)

    def _kill_keeper(self) -> None:
        from warmstart.checkpoint.keeper import KeeperClient, KeeperError

        with contextlib.suppress(KeeperError, OSError):
            pid = KeeperClient(self._keeper, secret=self._secret, timeout_s=2.0).request({"op": "ping"})[0]["pid"]
            os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Wait for the last checkpoint, release the loader workers and the process group; safe on a
        half-built trainer."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.snapshots is not None:
            self._write_snapshot_report()
            self.snapshots.close()
        if self._loader is not None:
            self.batches = iter(())
            self._loader = None
        if dist.is_initialized():
            dist.barrier()
        if self.snapshots is not None and self.local_rank == 0:
            self.snapshots.end_job()  # every rank of the node has sent its last snapshot
        # destroy_process_group() alone leaves gloo's threads running while the model still holds the
        # group; they would run into interpreter exit (a rank can abort there): drop them first.
        self.model = self.optimizer = self.checkpointer = self.snapshots = None
        from warmstart.init_pipeline import release_process_groups

        release_process_groups()


def _dcp_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    found = []
    if checkpoint_dir.is_dir():
        for child in checkpoint_dir.iterdir():
            match = _DCP_CKPT_RE.match(child.name)
            if match and (child / ".metadata").is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def _latest_dcp_checkpoint(checkpoint_dir: Path) -> tuple[int, Path] | None:
    """The newest plain DCP checkpoint whose ``.metadata`` exists (the baseline's commit)."""
    found = _dcp_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def _prune_dcp_checkpoints(checkpoint_dir: Path, keep: int) -> None:
    for _, path in _dcp_checkpoints(checkpoint_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _prepend(first: Batch, rest: Iterator[Batch]) -> Iterator[Batch]:
    yield first
    yield from rest
