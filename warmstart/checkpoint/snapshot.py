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
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from warmstart.checkpoint import packing
from warmstart.checkpoint.keeper import KeeperClient, KeeperError, SharedPayload, shared_memory
from warmstart.checkpoint.state import RNGState, prepare_for_load

log = logging.getLogger("warmstart.checkpoint")

_SMALL_BUFFER = 1 << 16
"""A table kernel's buffers up to this many elements (step counters, learning-rate state) go whole."""
_COMPACT_AFTER = 64
"""Lookups recorded between two snapshots before they are merged into one set of rows."""
CONNECT_WAIT_S = 30.0
"""How long a rank's first snapshot waits (on the sending thread) for the node's keeper to come up."""
_COPY_WAIT_S = 60.0
"""Longest a guard waits for an overlapped copy (memory to memory) before snapshots turn off."""
_KEEP_BUFFER = 256 << 20
"""A snapshot buffer larger than this (a full snapshot of large tables) is freed once sent."""
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
    joined: list[torch.Tensor] | None = None
    """The weights and each optimizer state of all its tables as one tensor indexed by global row,
    when the tables lie back to back in memory (fbgemm's layout): one gather a step, not one a table."""


@dataclasses.dataclass(frozen=True)
class SnapshotStats:
    """What the snapshots of this rank cost and moved."""

    taken: int
    skipped: int
    rows_per_step: float
    bytes_per_step: float
    capture_s: float
    """Seconds spent in :meth:`StepSnapshots.capture` on the training thread, in total."""
    wait_s: float = 0.0
    """Seconds the training thread waited for overlapped copies (``overlap=True``), in total."""


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
        overlap: copy the bulk of a snapshot (the touched rows, this rank's share of the replicated
            state) on a thread of its own, while the next step runs: the training thread then waits
            for it only if the next step reaches the fused update of the tables or the dense
            optimizer's step first. Only for loops that change that state through those two alone
            between ``capture`` and the next step's update (no in-place edits of the parameters or
            the optimizer state in between); without hooks to wait on, copies stay on the step.
        every: take a snapshot after every this many steps (the same on every rank); the steps in
            between only record the rows they touch, which the next snapshot carries. A failure
            then loses up to ``every`` steps, and a step costs about 1/``every`` of a snapshot.
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
        every: int = 1,
        overlap: bool = False,
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every={every!r}: expected a whole number of steps, 1 or more")
        self.every = every
        self.model, self.dense_optimizer = model, dense_optimizer
        self._owner = threading.get_ident()
        self.keeper, self.buddy, self.secret = keeper, buddy, secret
        self.job, self.rank, self.world = job, rank, world
        self.extra = dict(extra or {})
        self.base = -1
        """The committed checkpoint the snapshots build on (-1: none yet; the first one is full)."""
        self._since: int | None = None  # the step of the last snapshot handed off; None: the next is full
        self._lost = False  # a snapshot did not reach the keeper: its chain has a gap from there
        self._kernels = _find_kernels(model)
        # The model's parameters include views of the kernels' tables (TorchRec's table slices): those
        # are the rows, not dense state. Anything sharing a kernel tensor's memory is left out.
        kernel_memory = {_storage(t) for k in self._kernels for t in _kernel_tensors(k)}
        self._dense = [(n, t) for n, t in _named_tensors(model) if _storage(t) not in kernel_memory]
        # DDP keeps these equal on every rank, with their optimizer state: each rank sends a 1/world
        # share of them, and a restore gathers the shares (see _shared_tensors)
        self._replicated = _replicated_params(model, kernel_memory, world)
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        # buffers the state is copied into, reused step after step (fresh memory every step would
        # cost page faults on the step thread): one per snapshot queued or being sent, rows and whole
        self._buffers: list[list[torch.Tensor | None]] = [[None, None] for _ in range(max_pending + 1)]
        self._buffers_lock = threading.Lock()
        # on the node's Unix socket, the buffers are memory files the keeper copies out of: no bytes
        # through the socket (their descriptors, by the buffer's address)
        self._files: dict[int, int] = {}
        self._use_files = keeper.startswith("unix:")
        self._client: KeeperClient | None = None
        self._warned: set[str] = set()
        self._rows = 0
        self._bytes = 0
        self._taken = 0
        self._skipped = 0
        self._capture_s = 0.0
        self._wait_s = 0.0
        self.off: str | None = next((k.unsupported for k in self._kernels if k.unsupported), None)
        if self.off:
            self._warn("off", f"warmstart: per-step snapshots off: {self.off}; restarts resume from checkpoints")
        self._hooks = [
            k.module.register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in self._kernels if not self.off
        ]
        self._thread = threading.Thread(target=self._send_loop, name="warmstart-snapshots", daemon=True)
        self._thread.start()
        # overlap: the deferred part of each copy, on its own thread; the guards wait for it before
        # anything can change what it reads (the tables' fused update, the dense optimizer's step)
        self._copied = threading.Event()
        self._copied.set()
        self._copies: queue.Queue = queue.Queue()
        optimizers = _hookable_optimizers(dense_optimizer) if overlap and not self.off else []
        self.overlap = bool(optimizers)
        if self.overlap:
            self._hooks += [o.register_step_pre_hook(lambda *_: self._wait_copied()) for o in optimizers]
            self._hooks += [k.module.register_forward_hook(self._guard_update) for k in self._kernels]
            threading.Thread(target=self._copy_loop, name="warmstart-snapshot-copies", daemon=True).start()

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
        if self.off or (step + 1) % self.every:  # the steps in between: their rows wait for the next
            if self.off and self._hooks:  # turned off on another thread
                self._remove_hooks()
            return
        t0 = time.perf_counter()
        unsupported = next((k.unsupported for k in self._kernels if k.unsupported), None)
        if unsupported:
            self._turn_off(unsupported)
            return
        self._wait_copied()  # (the copying thread has one snapshot at a time)
        with self._buffers_lock:
            buffers = self._buffers.pop() if self._buffers and not self._pending.full() else None
        if buffers is None:
            self._skipped += 1
            self._warn("slow", "warmstart: a per-step snapshot was skipped: the keeper is slower than the steps")
            self._capture_s += time.perf_counter() - t0
            return  # the touched rows stay: the next snapshot carries them
        # no checkpoint under it: every row, once; and again after a snapshot was lost, as nothing else
        # closes that gap (with a checkpoint under it, the next checkpoint does)
        full = self.base < 0 and (self._since is None or self._lost)
        self._lost = False
        rows: dict[str, Any] = {}
        touched_rows = 0
        for index, kernel in enumerate(self._kernels):
            touched = _unique_rows(kernel.touched, int(kernel.row_start[-1]))
            kernel.touched.clear()
            if kernel.joined is not None:
                if full:  # copied into the buffer below
                    rows[str(index)] = {"rows": None, "weight": kernel.joined[0], "states": kernel.joined[1:]}
                    touched_rows += kernel.joined[0].shape[0]
                elif touched.numel():
                    picked = [packing.Rows(t, touched) for t in kernel.joined]  # gathered into the buffer
                    rows[str(index)] = {"rows": touched, "weight": picked[0], "states": picked[1:]}
                    touched_rows += touched.numel()
                continue
            # touched is sorted: each table's rows are one slice of it
            bounds = torch.searchsorted(touched, kernel.row_start).tolist()
            for table, weight in enumerate(kernel.weights):
                local: torch.Tensor | None = None
                values: torch.Tensor | packing.Rows
                states: list[torch.Tensor] | list[packing.Rows]
                if not full:
                    if bounds[table] == bounds[table + 1]:
                        continue
                    local = touched[bounds[table] : bounds[table + 1]] - kernel.row_start[table]
                if local is None:
                    values, states = weight, list(kernel.states[table])  # copied into the buffer below
                    touched_rows += weight.shape[0]
                else:
                    values = packing.Rows(weight, local)
                    states = [packing.Rows(s, local) for s in kernel.states[table]]
                    touched_rows += local.numel()
                rows[f"{index}/{table}"] = {"rows": local, "weight": values, "states": states}
        shared = self._shared_tensors()
        whole = {
            "step": step,
            "share": _share_of(shared, self.rank, self.world),
            "dense": dict(self._dense),
            "kernels": {f"{index}/{name}": t for index, k in enumerate(self._kernels) for name, t in k.small.items()},
            "optimizer": self.dense_optimizer.state_dict(),
            "rng": RNGState().state_dict(),
            "extra": {key: obj.state_dict() for key, obj in self.extra.items()},
        }
        # the only copy of the state: straight into buffers kept from earlier steps (with overlap, of
        # what only the guarded updates change, on the copying thread)
        deferred = {id(p) for p in whole["share"]["pieces"]} if self.overlap else set()
        try:
            plans = [packing.layout(rows), packing.layout(whole, {id(t): j for j, t in enumerate(shared)})]
            for i, plan in enumerate(plans):
                old, buffer = buffers[i], packing.buffer_for(plan, buffers[i], self._new_buffer)
                if old is not None and buffer is not old:
                    self._release(old)
                buffers[i] = buffer
                packing.copy_into(plan, buffer, select=_now(deferred, self.overlap))
        except Exception as exc:  # noqa: BLE001 - a state that cannot be packed ends the snapshots, not the job
            self._turn_off(f"the state could not be packed ({type(exc).__name__}: {exc})")
            return
        header = {"op": "put", "job": self.job, "rank": self.rank, "world": self.world, "step": step}
        header.update(base=self.base, since=self.base if self._since is None else self._since, full=full)
        # (a newer base in the header tells the keeper the checkpoint is durable: no message of its own)
        if self.overlap:
            self._copied.clear()
            self._copies.put((header, plans, buffers, deferred))
        else:
            self._pending.put_nowait((header, plans, buffers))
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
        return SnapshotStats(self._taken, self._skipped, self._rows / n, self._bytes / n, self._capture_s, self._wait_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every snapshot taken so far was sent (or dropped); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while (self._copies.unfinished_tasks or self._pending.unfinished_tasks) and time.monotonic() < deadline:
            time.sleep(0.005)
        return not (self._copies.unfinished_tasks or self._pending.unfinished_tasks)

    def close(self) -> None:
        """Stop recording and sending, after what is queued (for 10 s at most)."""
        self._remove_hooks()
        self.flush(timeout_s=10.0)
        self._copies.put(None)
        with contextlib.suppress(queue.Full):
            self._pending.put_nowait(None)
        self._thread.join(timeout=5.0)
        if self._client is not None:
            self._client.close()
        with self._buffers_lock:
            for buffers in self._buffers:
                for buffer in buffers:
                    if buffer is not None:
                        self._release(buffer)

    def end_job(self) -> None:
        """The job is over on every rank (call it once per node, after a barrier): the node's keeper
        and the buddy drop its snapshots, and a keeper left with no job exits."""
        if self.off:
            return
        with contextlib.suppress(KeeperError):
            KeeperClient(self.keeper, secret=self.secret, timeout_s=5.0).request({"op": "end", "job": self.job})

    # -- overlapped copies ---------------------------------------------------------------------------

    def _copy_loop(self) -> None:
        while True:
            item = self._copies.get()
            try:
                if item is None:
                    return
                header, plans, buffers, deferred = item
                try:
                    for plan, buffer in zip(plans, buffers, strict=True):
                        packing.copy_into(plan, buffer, select=_later(deferred))
                except Exception as exc:  # noqa: BLE001 - as on the training thread: snapshots off, job on
                    self._turn_off(f"the state could not be packed ({type(exc).__name__}: {exc})")
                    with self._buffers_lock:
                        self._buffers.append(buffers)
                    continue
                finally:
                    self._copied.set()
                self._pending.put((header, plans, buffers))  # (the buffers bound what is in flight)
            finally:
                self._copies.task_done()

    def _wait_copied(self) -> None:
        if self._copied.is_set():
            return
        t0 = time.perf_counter()
        copied = self._copied.wait(_COPY_WAIT_S)
        self._wait_s += time.perf_counter() - t0
        if not copied:  # a memory copy: this is a broken thread, not a slow one
            self._turn_off(f"a snapshot's copy did not finish within {_COPY_WAIT_S:g} s")
            self._copied.set()  # once: no later guard waits for it again

    def _guard_update(self, module: nn.Module, args: Any, output: Any) -> None:
        """A table kernel's output: its gradient reaches the kernel's backward, which applies the fused
        update to the rows, only after the pending copy read them."""
        if self.overlap and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._wait_copied())

    # -- sending -------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                header, plans, buffers = item
                try:
                    self._send(header, plans, buffers)
                finally:
                    for b in buffers:
                        if b is not None and b.numel() > _KEEP_BUFFER:
                            self._release(b)
                    with self._buffers_lock:
                        # a full snapshot's buffer (every row) is not kept for the small ones after it
                        self._buffers.append([b if b.numel() <= _KEEP_BUFFER else None for b in buffers])
            finally:
                self._pending.task_done()

    def _send(self, header: dict[str, Any], plans: list[packing.Layout], buffers: list[torch.Tensor]) -> None:
        try:
            payloads: list[Any] = [packing.seal(plan, buffer) for plan, buffer in zip(plans, buffers, strict=True)]
        except Exception as exc:  # noqa: BLE001 - a state that cannot be packed ends the snapshots, not the job
            self._turn_off(f"the state could not be packed ({type(exc).__name__}: {exc})")
            return
        if self._files:  # handed over as memory files where they are (not a copy of the skeleton's)
            for i, (payload, buffer) in enumerate(zip(payloads, buffers, strict=True)):
                fd = self._files.get(buffer.data_ptr())
                if fd is not None and not isinstance(payload.obj, bytes):
                    payloads[i] = SharedPayload(fd, len(payload))
        self._bytes += sum(map(len, payloads))
        self._request(header, payloads)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self._use_files:
            try:
                fd, memory = shared_memory(nbytes)
            except OSError:
                self._use_files = False  # (no memory files here: the bytes go through the socket)
            else:
                buffer = torch.frombuffer(memory, dtype=torch.uint8)
                self._files[buffer.data_ptr()] = fd
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def _release(self, buffer: torch.Tensor) -> None:
        """A buffer is dropped: its memory file's descriptor goes (its map with the last view of it)."""
        fd = self._files.pop(buffer.data_ptr(), None)
        if fd is not None:
            os.close(fd)

    def _request(self, header: dict[str, Any], payloads: list[Any] = ()) -> None:  # type: ignore[assignment]
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
            # the chain on the keeper is broken from here; it starts again at the next checkpoint (or,
            # with none yet, at the next snapshot, which then holds every row)
            if header.get("op") == "put":
                self._lost = not header.get("full")  # a full one lost: no second try, a checkpoint mends it
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
        rows, whole = parts
        shared = self._gather_share(whole.pop("share"))
        if shared is None:
            return None
        self._apply(rows, packing.resolve(whole, shared))
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
        rows = [packing.unpack(part, copy=False) for part in row_parts]  # copied into the tables only
        whole = packing.unpack(whole_part)
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
                    index, _, table = key.partition("/")
                    kernel = self._kernels[int(index)]
                    local = entry["rows"]
                    if table:
                        targets = [kernel.weights[int(table)], *kernel.states[int(table)]]
                    else:
                        assert kernel.joined is not None  # the same job's kernels: joined as when taken
                        targets = list(kernel.joined)
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

    def _shared_tensors(self) -> list[torch.Tensor]:
        """The replicated parameters, then each one's optimizer state of its own shape (Adam's
        moments, a momentum buffer): equal on every rank when the optimizer is (a sharded optimizer's
        state differs between ranks, and a restore then refuses the snapshot: see _gather_share)."""
        state = getattr(self.dense_optimizer, "state", None)
        out = list(self._replicated)
        if not isinstance(state, Mapping):
            return out
        for param in self._replicated:
            per_param = state.get(param)
            if not isinstance(per_param, Mapping):
                continue
            for key in sorted(per_param, key=str):
                t = per_param[key]
                if (
                    type(t) is torch.Tensor
                    and t.shape == param.shape
                    and t.is_contiguous()
                    and t.device == param.device
                ):
                    out.append(t)
        return out

    def _gather_share(self, share: dict[str, Any]) -> list[torch.Tensor] | None:
        """The replicated tensors of the restored step, from every rank's share of them (a
        collective); ``None`` on every rank when the ranks' snapshots do not split the same tensors."""
        import torch.distributed as dist

        specs = [(str(dtype), tuple(shape)) for dtype, shape in share["specs"]]
        signature = _signature(specs, int(share["world"]))
        grouped = dist.is_available() and dist.is_initialized()
        if share["world"] != self.world or (specs and self.world > 1 and not grouped):
            signature = -1
        if _agree_min(signature) != -_agree_min(-signature) or signature < 0:
            log.warning("warmstart: the ranks' snapshots do not share the same replicated state; not restored")
            return None
        if not specs:
            return []
        total = sum(_nbytes(dtype, shape) for dtype, shape in specs)
        chunk = _chunk(total, self.world)
        mine = torch.zeros(chunk, dtype=torch.uint8)
        pieces = [p.reshape(-1) for p in share["pieces"]]
        if pieces:
            data = torch.cat(pieces)
            mine[: data.numel()] = data
        if self.world > 1:
            gathered = [torch.empty(chunk, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(gathered, mine)
            flat = torch.cat(gathered)
        else:
            flat = mine
        out, offset = [], 0
        for dtype, shape in specs:
            n = _nbytes(dtype, shape)
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            t.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + n])
            out.append(t)
            offset += n
        return out

    # -- helpers -------------------------------------------------------------------------------------

    def _turn_off(self, why: str) -> None:
        self.off = why
        if threading.get_ident() == self._owner:  # (the hooks are the training thread's to remove)
            self._remove_hooks()
        self._warn("off", f"warmstart: per-step snapshots off: {why}; restarts resume from checkpoints")

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

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


def _replicated_params(model: nn.Module, kernel_memory: set[int], world: int) -> list[torch.Tensor]:
    """The trainable parameters of ``model``'s DistributedDataParallel modules whose process group
    spans all ``world`` ranks (DDP averages their gradients: every rank holds the same values), in
    the model's order; none without a process group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if world <= 1 or not (dist.is_available() and dist.is_initialized()):
        return []
    seen: set[int] = set()
    out = []
    for module in model.modules():
        group = getattr(module, "process_group", None)
        if not isinstance(module, DistributedDataParallel) or group is None or group.size() != world:
            continue
        for param in module.module.parameters():
            if (
                param.requires_grad
                and type(param) in (torch.Tensor, nn.Parameter)
                and param.is_contiguous()
                and _storage(param) not in kernel_memory
                and id(param) not in seen
            ):
                seen.add(id(param))
                out.append(param)
    return out


def _share_of(shared: list[torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """This rank's share of ``shared`` laid end to end as bytes: the pieces of the byte range
    ``[rank * chunk, (rank + 1) * chunk)``, and what a restore needs to put them together."""
    specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in shared]
    total = sum(_nbytes(dtype, shape) for dtype, shape in specs)
    chunk = _chunk(total, world)
    lo, hi = rank * chunk, min(total, (rank + 1) * chunk)
    pieces, start = [], 0
    for t in shared:
        end = start + t.numel() * t.element_size()
        if end > lo and start < hi:
            raw = t.detach().reshape(-1).view(torch.uint8)
            pieces.append(raw[max(lo - start, 0) : min(hi, end) - start])
        start = end
    return {"specs": specs, "world": world, "pieces": pieces}


def _chunk(total: int, world: int) -> int:
    return -(-total // max(world, 1))


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    for d in shape:
        n *= d
    return n


def _signature(specs: list[tuple[str, tuple[int, ...]]], world: int) -> int:
    import hashlib

    digest = hashlib.blake2b(repr((world, specs)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # non-negative, and its negation fits an int64


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
        elif weights and len({len(s) for s in states}) == 1:
            joined = [_joined(weights), *(_joined([s[i] for s in states]) for i in range(len(states[0])))]
            kernel.joined = None if any(j is None for j in joined) else joined  # type: ignore[assignment]
        found.append(kernel)
    return found


def _hookable_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers whose ``step`` runs step pre-hooks, inside ``optimizer`` (itself, a
    TorchRec wrapper's ``_optimizer``, a combined optimizer's parts); none when any part has none."""
    if isinstance(optimizer, torch.optim.Optimizer) and getattr(type(optimizer).step, "hooked", False):
        return [optimizer]
    inner = getattr(optimizer, "_optimizer", None)
    if inner is not None:
        return _hookable_optimizers(inner)
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, (list, tuple)) and parts:
        found = [_hookable_optimizers(p[1] if isinstance(p, tuple) else p) for p in parts]
        return [o for f in found for o in f] if all(found) else []
    return []


def _now(deferred: set[int], overlap: bool) -> Any:
    """Which sources the training thread copies: all, or (overlap) all but the rows and the share."""
    if not overlap:
        return None
    return lambda source: not isinstance(source, packing.Rows) and id(source) not in deferred


def _later(deferred: set[int]) -> Any:
    return lambda source: isinstance(source, packing.Rows) or id(source) in deferred


def _unique_rows(lookups: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The distinct row numbers of ``lookups``, sorted (a mask over the rows: faster than a sort)."""
    if not lookups:
        return torch.empty(0, dtype=torch.int64)
    if rows > max(1 << 23, 16 * sum(i.numel() for i in lookups)):  # a mask larger than worth zeroing
        return torch.cat(lookups).unique()
    mask = torch.zeros(rows, dtype=torch.bool)
    for index in lookups:
        mask[index] = True
    return mask.nonzero().squeeze(1)


def _joined(tables: list[torch.Tensor]) -> torch.Tensor | None:
    """``tables`` as one tensor (rows of the first, then of the next, ...) when they are contiguous
    views lying back to back in one storage, with the same row shape and dtype; else ``None``."""
    first = tables[0]
    offset = first.storage_offset()
    for t in tables:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.shape[1:] != first.shape[1:]
            or _storage(t) != _storage(first)
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tables)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


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


def _agree_min(value: int) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
