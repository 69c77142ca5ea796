"""Per-step snapshots of a TorchRec rank, handed to the node's keeper without stalling a step.

After each step :meth:`StepSnapshots.capture` copies what the step changed: of every sharded
embedding table only the rows the step looked up (fbgemm's batched kernels, whose fused optimizer
updates exactly those rows), with their optimizer state; everything else that is small — dense
weights and buffers, the dense optimizer's state, the RNGs, the caller's extra ``Stateful`` objects
(a loader position) — whole. A background thread serializes the copy and sends it to the keeper; a
keeper that is slow or gone costs a skipped snapshot and one warning, never a wait. A restarted rank
calls :meth:`StepSnapshots.restore` after loading the checkpoint the snapshots build on: the ranks
agree on the newest step every one of them can restore (from its node's keeper or the buddy's) and
apply the rows and the whole state of that step, bit-identical to the run that failed.

This module owns what a snapshot holds and applying it; ``keeper`` owns holding and moving them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from warmstart.checkpoint.keeper import KeeperClient, KeeperError
from warmstart.checkpoint.state import RNGState, prepare_for_load

log = logging.getLogger("warmstart.checkpoint")

_SMALL_BUFFER = 1 << 16
"""A table kernel's buffers up to this many elements (step counters, learning-rate state) go whole."""
_COMPACT_AFTER = 64
"""Lookups recorded between two snapshots before they are merged into one set of rows."""
CONNECT_WAIT_S = 10.0
"""How long a rank's first snapshot waits (on the sending thread) for the node's keeper to come up."""
_ROW_BUFFERS = ("weights_", "momentum1_", "momentum2_", "lxu_", "prev_iter_", "row_counter_")
"""Prefixes of a table kernel's row-indexed buffers: copied by the rows a step touched."""


@dataclasses.dataclass
class _Kernel:
    """One fbgemm batched-embedding kernel: its tables' row views and the rows touched since the
    last snapshot (global row numbers over its tables, in ``row_start`` order)."""

    name: str
    module: nn.Module
    weights: list[torch.Tensor]
    states: list[list[torch.Tensor]]
    row_start: torch.Tensor
    feature_table: torch.Tensor
    small: dict[str, torch.Tensor]
    touched: list[torch.Tensor] = dataclasses.field(default_factory=list)
    unsupported: str | None = None


@dataclasses.dataclass(frozen=True)
class SnapshotStats:
    """What the snapshots of this rank cost and moved."""

    taken: int
    skipped: int
    rows_per_step: float
    bytes_per_step: float
    capture_s: float
    """Seconds spent in :meth:`StepSnapshots.capture` on the training thread, in total."""


class StepSnapshots:
    """Per-step snapshots of one rank (see the module docstring).

    Args:
        model: the (DistributedModelParallel) model; its fbgemm table kernels are found inside.
        dense_optimizer: the optimizer of everything that is not a fused embedding table.
        keeper: this node's keeper (``unix:/path`` or ``host:port``).
        job: the job's id (a keeper may hold several jobs).
        rank: this process's global rank; world: the number of ranks.
        buddy: the buddy node's keeper, asked when this node's keeper cannot restore.
        secret: the job's key, as the keepers' (:func:`~warmstart.checkpoint.keeper.keeper_secret`).
        extra: more state to snapshot whole (``state_dict`` / ``load_state_dict``), e.g. the loader.
        max_pending: snapshots waiting to be sent before a new one is skipped.
    """

    def __init__(
        self,
        model: nn.Module,
        dense_optimizer: Any,
        *,
        keeper: str,
        job: str,
        rank: int,
        world: int,
        buddy: str | None = None,
        secret: bytes | None = None,
        extra: Mapping[str, Any] | None = None,
        max_pending: int = 2,
    ) -> None:
        self.model, self.dense_optimizer = model, dense_optimizer
        self.keeper, self.buddy, self.secret = keeper, buddy, secret
        self.job, self.rank, self.world = job, rank, world
        self.extra = dict(extra or {})
        self.base = -1
        """The committed checkpoint the snapshots build on (-1: none yet; the first one is full)."""
        self._since: int | None = None  # the step of the last snapshot handed off; None: the next is full
        self._kernels = _find_kernels(model)
        # The model's parameters include views of the kernels' tables (TorchRec's table slices): those
        # are the rows, not dense state. Anything sharing a kernel tensor's memory is left out.
        kernel_memory = {_storage(t) for k in self._kernels for t in _kernel_tensors(k)}
        self._dense = [(n, t) for n, t in _named_tensors(model) if _storage(t) not in kernel_memory]
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._client: KeeperClient | None = None
        self._warned: set[str] = set()
        self._rows = 0
        self._bytes = 0
        self._taken = 0
        self._skipped = 0
        self._capture_s = 0.0
        self.off: str | None = next((k.unsupported for k in self._kernels if k.unsupported), None)
        if self.off:
            self._warn("off", f"warmstart: per-step snapshots off: {self.off}; restarts resume from checkpoints")
        self._hooks = [
            k.module.register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in self._kernels if not self.off
        ]
        self._thread = threading.Thread(target=self._send_loop, name="warmstart-snapshots", daemon=True)
        self._thread.start()

    # -- taking ------------------------------------------------------------------------------------

    def _hook(self, kernel: _Kernel) -> Any:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training:
                return
            indices = kwargs.get("indices", args[0] if args else None)
            offsets = kwargs.get("offsets", args[1] if len(args) > 1 else None)
            if indices is None or offsets is None or kwargs.get("batch_size_per_feature_per_rank") is not None:
                kernel.unsupported = "a table kernel was called with variable batch sizes per feature"
                return
            features = kernel.feature_table.numel()
            if (offsets.numel() - 1) % features:
                kernel.unsupported = "a table kernel's offsets do not split evenly over its features"
                return
            batch = (offsets.numel() - 1) // features
            per_feature = offsets[::batch].diff() if batch else torch.zeros(features, dtype=offsets.dtype)
            tables = torch.repeat_interleave(kernel.feature_table, per_feature)
            kernel.touched.append(kernel.row_start[tables] + indices.to(torch.int64))
            if len(kernel.touched) >= _COMPACT_AFTER:  # steps without a capture: keep it one set of rows
                kernel.touched[:] = [torch.cat(kernel.touched).unique()]

        return record

    def capture(self, step: int) -> None:
        """Hand off the state after ``step`` (call it after the optimizer's step). Never waits: when
        the previous snapshots are still being sent, this one is skipped (the next carries its rows)."""
        if self.off:
            return
        t0 = time.perf_counter()
        unsupported = next((k.unsupported for k in self._kernels if k.unsupported), None)
        if unsupported:
            self._turn_off(unsupported)
            return
        if self._pending.full():
            self._skipped += 1
            self._warn("slow", "warmstart: a per-step snapshot was skipped: the keeper is slower than the steps")
            self._capture_s += time.perf_counter() - t0
            return  # the touched rows stay: the next snapshot carries them
        full = self._since is None and self.base < 0  # no checkpoint under it: every row, once
        rows: dict[str, Any] = {}
        touched_rows = 0
        for index, kernel in enumerate(self._kernels):
            touched = torch.cat(kernel.touched).unique() if kernel.touched else torch.empty(0, dtype=torch.int64)
            kernel.touched.clear()
            # touched is sorted: each table's rows are one slice of it
            bounds = torch.searchsorted(touched, kernel.row_start).tolist()
            for table, weight in enumerate(kernel.weights):
                local: torch.Tensor | None = None
                if not full:
                    if bounds[table] == bounds[table + 1]:
                        continue
                    local = touched[bounds[table] : bounds[table + 1]] - kernel.row_start[table]
                if local is None:
                    values = weight.clone()
                    states = [s.clone() for s in kernel.states[table]]
                    touched_rows += weight.shape[0]
                else:
                    values = weight.index_select(0, local)
                    states = [s.index_select(0, local) for s in kernel.states[table]]
                    touched_rows += local.numel()
                rows[f"{index}/{table}"] = {"rows": local, "weight": values, "states": states}
        whole = {
            "step": step,
            "dense": {name: t.detach().clone() for name, t in self._dense},
            "kernels": {
                f"{index}/{name}": t.detach().clone()
                for index, k in enumerate(self._kernels)
                for name, t in k.small.items()
            },
            "optimizer": _clone(self.dense_optimizer.state_dict()),
            "rng": RNGState().state_dict(),
            "extra": {key: _clone(obj.state_dict()) for key, obj in self.extra.items()},
        }
        header = {"op": "put", "job": self.job, "rank": self.rank, "world": self.world, "step": step}
        header.update(base=self.base, since=self.base if self._since is None else self._since, full=full)
        # (a newer base in the header tells the keeper the checkpoint is durable: no message of its own)
        self._pending.put_nowait((header, rows, whole))
        self._since = step
        self._taken += 1
        self._rows += touched_rows
        self._capture_s += time.perf_counter() - t0

    def committed(self, step: int | None) -> None:
        """A checkpoint of ``step`` is durable: the keepers may drop what it holds (said with the next
        snapshot). ``None`` (no checkpoint yet) changes nothing."""
        if step is not None:
            self.base = max(self.base, step)

    def stats(self) -> SnapshotStats:
        n = max(self._taken, 1)
        return SnapshotStats(self._taken, self._skipped, self._rows / n, self._bytes / n, self._capture_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every snapshot taken so far was sent (or dropped); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pending.unfinished_tasks

    def close(self) -> None:
        """Stop recording and sending, after what is queued (for 10 s at most)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.flush(timeout_s=10.0)
        with contextlib.suppress(queue.Full):
            self._pending.put_nowait(None)
        self._thread.join(timeout=5.0)
        if self._client is not None:
            self._client.close()

    def end_job(self) -> None:
        """The job is over on every rank (call it once per node, after a barrier): the node's keeper
        and the buddy drop its snapshots, and a keeper left with no job exits."""
        if self.off:
            return
        with contextlib.suppress(KeeperError):
            KeeperClient(self.keeper, secret=self.secret, timeout_s=5.0).request({"op": "end", "job": self.job})

    # -- sending -------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                if item[0] == "request":
                    self._request(item[1])
                    continue
                header, rows, whole = item
                payloads = [_dumps(rows), _dumps(whole)]
                self._bytes += sum(map(len, payloads))
                self._request(header, payloads)
            finally:
                self._pending.task_done()

    def _request(self, header: dict[str, Any], payloads: list[bytes] = ()) -> None:  # type: ignore[assignment]
        try:
            if self._client is None:
                self._client = KeeperClient(self.keeper, secret=self.secret, timeout_s=5.0)
                # the node's keeper may still be starting (another local rank starts it): wait for it
                # here, on the sending thread, once; the steps meanwhile are carried by the next snapshot
                deadline = time.monotonic() + CONNECT_WAIT_S
                while True:
                    try:
                        self._client.request({"op": "ping"})
                        break
                    except KeeperError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
            self._client.request(header, payloads)
        except KeeperError as exc:
            # the chain on the keeper is broken from here; it starts again at the next checkpoint
            self._warn("keeper", f"warmstart: per-step snapshots not kept ({exc}); a restart resumes from a checkpoint")

    # -- restoring -----------------------------------------------------------------------------------

    def restore(self, checkpoint_step: int | None, *, step: int | None = None) -> tuple[int, str] | None:
        """After ``checkpoint_step``'s checkpoint was loaded (``None``: none was), restore the newest
        step that every rank can restore (or exactly ``step``, e.g. what :func:`newest_restorable`
        said before the loader started), from this node's keeper or the buddy's. Returns ``(step,
        source)`` with source ``keeper`` or ``buddy``, or ``None``: the checkpoint stands, nothing
        was changed. A collective when a process group is up: every rank must call it.

        The ranks agree twice before anything changes: on the step, and that every rank fetched and
        read its part of it. Only then is it applied (copies in memory, which do not fail).
        """
        base = -1 if checkpoint_step is None else checkpoint_step
        self.base = base
        if self.off:
            return None
        options = self._options(base)
        if step is None:
            step = _agree_min(max((s for s, _, _ in options), default=-1))
        elif _agree_min(step) != -_agree_min(-step):
            return None  # the ranks were told different steps: none is restored anywhere
        chosen = next(((source, address) for s, source, address in options if s == step), None)
        if step <= base or _agree_min(int(chosen is not None)) != 1:
            return None  # some rank cannot restore that step: every rank goes on from the checkpoint
        assert chosen is not None
        try:
            parts = self._fetch(chosen[1], step)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the ranks must agree first
            log.warning("warmstart: snapshot of step %d not read from the %s (%s)", step, chosen[0], exc)
            parts = None
        if _agree_min(int(parts is not None)) != 1:
            return None
        assert parts is not None
        self._apply(*parts)
        self._since = step
        return step, chosen[0]

    def _options(self, base: int) -> list[tuple[int, str, str]]:
        """(step, source, address) of every step this rank can be restored to on top of ``base``."""
        options: list[tuple[int, str, str]] = []
        for source, address in (("keeper", self.keeper), ("buddy", self.buddy)):
            if address is None:
                continue
            try:
                client = KeeperClient(address, secret=self.secret, timeout_s=5.0)
                status, _ = client.request({"op": "status", "job": self.job})
                client.close()
            except KeeperError as exc:
                log.info("warmstart: snapshot %s not asked (%s)", source, exc)
                continue
            mine = status.get("ranks", {}).get(str(self.rank))
            # a chain on an older checkpoint holds every row changed since it: it applies on a newer one too
            if mine and mine["base"] <= base:
                options += [(s, source, address) for s in mine["restorable"] if s > base]
        return options

    def _fetch(self, address: str, step: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """This rank's rows of each snapshot up to ``step`` and its whole state at ``step``, read."""
        client = KeeperClient(address, secret=self.secret, timeout_s=60.0)
        try:
            _, payloads = client.request({"op": "get", "job": self.job, "rank": self.rank, "step": step})
        finally:
            client.close()
        *row_parts, whole_part = payloads
        rows = [_loads(part) for part in row_parts]
        whole = _loads(whole_part)
        if whole["step"] != step:
            raise ValueError(f"the whole state is of step {whole['step']}, not {step}")
        dense = dict(self._dense)
        missing = [name for name in whole["dense"] if name not in dense] + [
            key for key in whole["extra"] if key not in self.extra
        ]
        if missing:
            raise ValueError(f"the snapshot holds state this job does not have: {', '.join(missing[:3])}")
        # TorchRec's dense optimizers refuse to load into the empty state of one that never stepped
        # (no checkpoint was loaded before): make it now, while a failure still changes nothing
        prepare_for_load(self.dense_optimizer)
        return rows, whole

    def _apply(self, rows: list[dict[str, Any]], whole: dict[str, Any]) -> None:
        with torch.no_grad():
            for part in rows:
                for key, entry in part.items():
                    index, table = map(int, key.split("/"))
                    kernel = self._kernels[index]
                    local = entry["rows"]
                    targets = [kernel.weights[table], *kernel.states[table]]
                    for target, value in zip(targets, [entry["weight"], *entry["states"]], strict=True):
                        if local is None:
                            target.copy_(value)
                        else:
                            target.index_copy_(0, local, value)
            dense = dict(self._dense)
            for name, value in whole["dense"].items():
                dense[name].copy_(value)
            for key, value in whole["kernels"].items():
                index, name = key.split("/", 1)
                self._kernels[int(index)].small[name].copy_(value)
        self.dense_optimizer.load_state_dict(whole["optimizer"])  # its lazy state was made in _fetch
        RNGState().load_state_dict(whole["rng"])
        for key, state in whole["extra"].items():
            self.extra[key].load_state_dict(state)
        for kernel in self._kernels:
            kernel.touched.clear()

    # -- helpers -------------------------------------------------------------------------------------

    def _turn_off(self, why: str) -> None:
        self.off = why
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._warn("off", f"warmstart: per-step snapshots off: {why}; restarts resume from checkpoints")

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


def newest_restorable(
    sources: Mapping[str, str | None], *, job: str, world: int, checkpoint_step: int | None, secret: bytes | None
) -> tuple[int, str] | None:
    """The newest step that every one of ``world`` ranks can be restored to on top of
    ``checkpoint_step``'s checkpoint, and the first source (``{"keeper": address, "buddy": address}``)
    that holds it for every rank; ``None`` when no source does. Asks without a process group (for
    a loader that must know where to start before one exists); :meth:`StepSnapshots.restore` still
    agrees with the other ranks before it applies anything."""
    base = -1 if checkpoint_step is None else checkpoint_step
    best: tuple[int, str] | None = None
    for source, address in sources.items():
        if address is None:
            continue
        try:
            client = KeeperClient(address, secret=secret, timeout_s=5.0)
            status, _ = client.request({"op": "status", "job": job})
            client.close()
        except KeeperError:
            continue
        ranks = status.get("ranks", {})
        usable = [
            {s for s in ranks[str(r)]["restorable"] if s > base}
            if ranks.get(str(r), {}).get("base", base + 1) <= base
            else set()
            for r in range(world)
        ]
        common = set.intersection(*usable) if usable else set()
        if common and (best is None or max(common) > best[0]):
            best = (max(common), source)
    return best


def _find_kernels(model: nn.Module) -> list[_Kernel]:
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen as Kernel,
        )
    except ImportError:
        return []
    found = []
    for name, module in _kernel_modules(model, Kernel):
        kernel_module: Any = module  # fbgemm's kernel: its split_* methods are what is read here
        weights = kernel_module.split_embedding_weights()
        try:
            states = kernel_module.split_optimizer_states()
        except NotImplementedError:
            states = [[] for _ in weights]
        rows = [w.shape[0] for w in weights]
        row_start = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int64)
        small = {
            n: b
            for n, b in module.named_buffers(recurse=False)
            if b.numel() <= _SMALL_BUFFER and not n.startswith(_ROW_BUFFERS) and b.is_floating_point() or n == "iter"
        }
        kernel = _Kernel(
            name=name,
            module=module,
            weights=weights,
            states=states,
            row_start=row_start,
            feature_table=torch.tensor(kernel_module.feature_table_map, dtype=torch.int64),
            small=small,
        )
        if any(len(s) and s[0].shape[0] != w.shape[0] for s, w in zip(states, weights, strict=True)):
            kernel.unsupported = f"{name}: optimizer state not indexed by row"
        found.append(kernel)
    return found


def _kernel_modules(model: nn.Module, kernel_type: type) -> list[tuple[str, nn.Module]]:
    """Every fbgemm table kernel in ``model``. TorchRec's sharded modules keep their lookups in a
    plain list (``_lookups``, not a registered submodule), so they are walked as well."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        trees: list[tuple[str, nn.Module]] = [(name, module)]
        lookups = getattr(module, "_lookups", None)
        if isinstance(lookups, (list, tuple)):
            trees += [(f"{name}._lookups[{i}]", m) for i, m in enumerate(lookups) if isinstance(m, nn.Module)]
        for prefix, tree in trees:
            for sub_name, sub in tree.named_modules(prefix=prefix):
                if isinstance(sub, kernel_type) and isinstance(sub, nn.Module) and id(sub) not in seen:
                    seen.add(id(sub))
                    out.append((sub_name, sub))
    return out


def _kernel_tensors(kernel: _Kernel) -> list[torch.Tensor]:
    module = kernel.module
    own = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
    return own + kernel.weights + [s for states in kernel.states for s in states]


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else -id(t)
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: compared by identity
        return -id(t)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(local, torch.Tensor) and id(t) not in seen and local.device.type != "meta":
            seen.add(id(t))
            out.append((name, local))
    return out


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _agree_min(value: int) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
