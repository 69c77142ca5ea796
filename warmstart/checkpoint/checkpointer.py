"""The checkpointer: saves training state with torch.distributed.checkpoint (DCP) while training goes
on, commits a checkpoint only once every rank has written it, and resumes from the latest commit.

A save has three phases, each with its own future: *staging* copies the state to CPU memory (the
only part training must wait for before it changes weights), *upload* writes the staged copy to the
checkpoint folder in a thread or a separate process, and *commit* runs on every rank after the
upload: rank 0 writes the commit marker and renames the folder (see ``layout``), then tells every
rank the outcome, and each rank records ``checkpoint_committed``. A save first waits for the
previous one, so at most one is in flight and staging buffers are reused. The blocking part is
recorded as a ``checkpoint_save`` span. Every collective of a save gives up after
``commit_timeout_s``, so a rank that is gone costs a bounded wait and a save reported as not
committed; the commit runs on a daemon thread that interpreter exit waits for only that long. This
module owns the save/commit/load sequence and the error policy; the folder protocol is in
``layout``, the state adapters in ``state``, the interval arithmetic in ``interval``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from concurrent.futures import Future
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from warmstart import torch_internals
from warmstart.checkpoint import layout
from warmstart.checkpoint.interval import AdaptiveInterval
from warmstart.checkpoint.mode import AsyncMode
from warmstart.checkpoint.state import (
    RNG_KEY,
    RankLocal,
    RNGState,
    check_entry,
    is_stateful,
    prepare_for_load,
    rank_key,
)
from warmstart.errors import ConfigError, WarmstartError

log = logging.getLogger(__name__)

OnError = Literal["raise", "continue"]

DEFAULT_COMMIT_TIMEOUT_S = 60.0
"""Default of ``Checkpointer(commit_timeout_s=...)``: how long a collective of a save waits for the
other ranks before the save is given up as not committed."""
_EXIT_JOIN_MARGIN_S = 5.0  # interpreter exit waits for an in-flight commit this much beyond its timeout

_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class CheckpointError(WarmstartError):
    """A checkpoint could not be written or its directory used. One line: the directory and the
    cause; earlier checkpoints are left intact."""


class _FileSystemWriter(FileSystemWriter):
    """DCP's file writer, except that a failed write raises the OSError behind it.

    ``torch.save`` turns a failed ``write()`` (ENOSPC, EFBIG, EIO) into ``RuntimeError: unexpected
    pos``, keeping the OSError only as ``__context__``, which DCP loses when it pickles per-rank
    failures to the coordinator. Raising the OSError itself keeps the cause in the one-line error.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except Exception as e:
            cause = _os_error(e)
            if cause is None or cause is e:
                raise
            raise cause from e


@dataclass
class _Pending:
    step: int
    staging: Future
    commit: Future  # result: (message, cause) of a failure, or None once committed


class Checkpointer:
    """Saves and restores training state; one per job, constructed on every rank at the same point.

    Example:
        >>> ckpt = Checkpointer("/ckpt/run-1", mode=AsyncMode.ASYNC, keep=3)
        >>> state = {"model": dmp, "optim": dmp_optimizer, "loader": RankLocal(loader)}
        >>> start = ckpt.load_latest(state)          # None on a fresh start
        >>> for step in range(0 if start is None else start + 1, steps):
        ...     train_step()
        ...     if step % 100 == 0:
        ...         ckpt.save(step, state)           # returns once the state is staged
        >>> ckpt.close()                             # waits for the last save to commit

    Args:
        directory: the checkpoint folder (shared by all ranks; created by rank 0).
        mode: sync, async-thread or async-process (``AsyncMode`` or its value).
        keep: how many committed checkpoints to keep (older ones are deleted after a commit).
        recorder: where ``checkpoint_save`` / ``checkpoint_load`` spans and ``checkpoint_committed``
            go; default ``warmstart.metrics.get_recorder()``.
        on_error: what a failed save does: ``"raise"`` raises :class:`CheckpointError` (from the save,
            or for an async save from the next ``save``/``wait``/``close``); ``"continue"`` logs the
            cause once and training goes on.
        process_group: a group used only for checkpointing (default: a new gloo group over all ranks;
            DCP's async save needs a CPU backend and must not share a group with training collectives).
        overlap_staging: when True, ``save`` returns before the CPU copy is done; call
            :meth:`wait_staged` before anything changes the saved tensors (before ``optimizer.step()``;
            for TorchRec fused optimizers, before the next backward).
        save_rng: also save and restore each rank's RNG states (Python, NumPy, torch, CUDA).
        interval: an :class:`AdaptiveInterval` for :meth:`maybe_save`.
        commit_timeout_s: how long each collective of a save waits for the other ranks (default
            60 s): the checkpointer's own gloo group is created with this timeout (DCP's exchange of
            plans and write results, the commit broadcast), and the commit broadcast uses it on a
            ``process_group`` you pass too. A rank that is gone (killed, its machine lost) is noticed
            after at most this long, and the save is reported as not committed (no
            ``checkpoint_committed``; ``CheckpointError`` or a warning per ``on_error``) instead of
            waiting out gloo's 30 minutes. Keep it above the largest difference between the ranks'
            write times of one checkpoint: ranks wait in DCP's last collective for the slowest writer.

    Raises:
        ConfigError: a bad ``mode``, ``keep``, ``on_error`` or ``commit_timeout_s``.
        CheckpointError: the directory cannot be created (with ``on_error="raise"``).
    """

    last_committed_step: int | None = None
    """The step of the newest checkpoint known to be committed (``None`` before the first)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        mode: AsyncMode | str = AsyncMode.ASYNC,
        keep: int = 3,
        recorder: Any = None,
        on_error: OnError = "raise",
        process_group: dist.ProcessGroup | None = None,
        overlap_staging: bool = False,
        save_rng: bool = True,
        interval: AdaptiveInterval | None = None,
        commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
    ) -> None:
        self.directory = Path(directory)
        self.mode = AsyncMode.parse(mode)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError("keep", keep, "an integer >= 1")
        if on_error not in ("raise", "continue"):
            raise ConfigError("on_error", on_error, "'raise' or 'continue'")
        if (
            isinstance(commit_timeout_s, bool)
            or not isinstance(commit_timeout_s, (int, float))
            or not 0 < commit_timeout_s < float("inf")
        ):
            raise ConfigError("commit_timeout_s", commit_timeout_s, "a number of seconds > 0")
        self.commit_timeout_s = float(commit_timeout_s)
        self.keep, self.on_error = keep, on_error
        self.overlap_staging, self.save_rng, self.interval = overlap_staging, save_rng, interval
        if recorder is None:
            from warmstart.metrics import get_recorder

            recorder = get_recorder()
        self._recorder = recorder
        self._distributed = dist.is_available() and dist.is_initialized()
        if self.mode is AsyncMode.ASYNC_PROCESS and not self._distributed:
            raise ConfigError("mode", self.mode.value, "sync or async-thread when torch.distributed is not initialized")
        self._owns_pg = self._distributed and process_group is None
        if self._distributed:
            self._pg = (
                process_group
                if process_group is not None
                else dist.new_group(backend="gloo", timeout=timedelta(seconds=self.commit_timeout_s))
            )
            self.rank, self.world_size = dist.get_rank(self._pg), dist.get_world_size(self._pg)
        else:
            self._pg, self.rank, self.world_size = None, 0, 1
        self.failures = 0
        """Number of saves that failed (with ``on_error="continue"``)."""
        self.last_blocking_s: float | None = None
        """How long the last :meth:`save` blocked the caller, seconds."""
        self.last_committed_step = None
        self.last_save_to_commit_s: float | None = None
        """Seconds from the start of the last committed save to its commit."""
        self._stager: AsyncStager | None = None
        self._pending: _Pending | None = None
        self._reported: set[str] = set()
        self._next_due: int | None = None
        self._closed = False
        # The commit runs on a daemon thread (not a ThreadPoolExecutor, whose threads interpreter exit
        # joins without a bound); exit waits for it at most commit_timeout_s + a margin (_at_exit).
        self._commit_thread: threading.Thread | None = None
        _live.add(self)

        failure, latest = None, None
        session = uuid.uuid4().hex[:8]
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                removed = layout.remove_stale(self.directory, session)
                if removed:
                    log.info(
                        "removed %d partial checkpoint folder(s) in %s: %s",
                        len(removed),
                        self.directory,
                        ", ".join(sorted(removed)),
                    )
                found = layout.latest_committed(self.directory)
                latest = found.step if found else None
            except OSError as e:
                cause = _cause(e)
                failure = (f"checkpoint directory {self.directory} is not usable: {cause}", cause)
        # One broadcast: every rank writes into the same session's folders and fails the same way.
        self._session, failure, self.last_committed_step = self._broadcast((session, failure, latest))
        if failure is not None:
            self._report(failure)

    # -- saving --------------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, block: bool = False) -> None:
        """Checkpoints ``state`` as of the end of ``step``; a collective over all ranks.

        Waits for the previous save to commit, captures ``state`` (calls ``state_dict()`` on each
        entry), copies it to CPU memory and starts the write. ``checkpoint_committed(step)`` is
        recorded once the checkpoint is durable on every rank.

        Args:
            step: the last step whose effect is in ``state``; :meth:`load_latest` returns it.
            state: name -> object with ``state_dict``/``load_state_dict`` (modules, TorchRec
                ``KeyedOptimizer``, :class:`OptimizerState`, data loaders), or a dict of tensors;
                wrap per-rank entries in :class:`RankLocal`.
            block: wait until this checkpoint is committed (or failed) before returning.

        Raises:
            CheckpointError: this save (sync mode, ``block=True``) or the previous async save failed,
                with ``on_error="raise"``.
        """
        if self._closed:
            raise RuntimeError("Checkpointer.save() after close()")
        started = time.monotonic()
        with self._recorder.span("checkpoint_save"):
            try:
                self._finish_pending()
                if self.interval is not None:
                    self._plan_next(step, started)
                entries = self._entries(state)
                partial = layout.partial_path(self.directory, step, self._session)
                if self.mode is AsyncMode.SYNC:
                    self._save_now(step, entries, partial, started)
                else:
                    self._start_async(step, entries, partial, started)
                    if block:
                        self._finish_pending()
                    elif not self.overlap_staging:
                        # A staging failure also fails the upload; the commit reports it, on every rank.
                        _wait_futures([self._pending.staging])  # type: ignore[union-attr]
            finally:
                self.last_blocking_s = time.monotonic() - started

    def maybe_save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Saves when the :class:`AdaptiveInterval` says ``step`` is due; returns whether it saved.

        Raises:
            ValueError: the checkpointer has no ``interval``.
        """
        if self.interval is None:
            raise ValueError("maybe_save() needs Checkpointer(..., interval=AdaptiveInterval(...))")
        if self._next_due is None:
            self._next_due = step + self.interval.first_steps
        if step < self._next_due:
            return False
        self.save(step, state)
        return True

    def prewarm(self, state: Mapping[str, Any]) -> Future | None:
        """Pays the first asynchronous save's one-time costs now, in the background: the staging
        buffers, and DTensor's sharding-propagation caches, which are per thread (so only a copy made
        on the stager's own thread warms them: about a second for a TorchRec model with many table
        shapes). Nothing is written. Call it after :meth:`load_latest`; training may go on meanwhile
        (the copy only reads the tensors, and the next save's copy starts after it).

        Returns:
            The future of the throw-away copy, or None when there is nothing to warm (sync mode, or a
            ShardedTensor state whose staging blocks anyway).
        """
        if self.mode is AsyncMode.SYNC or self._closed:
            return None
        entries = self._entries(state)
        stager = self._stager_for(entries)
        if not isinstance(stager, DefaultStager):
            return None
        staged = stager.stage(entries)
        return staged if isinstance(staged, Future) else None

    def wait_staged(self) -> None:
        """Returns once the in-flight save no longer reads the live tensors (see ``overlap_staging``)."""
        if self._pending is not None:
            _wait_futures([self._pending.staging])

    @property
    def in_flight(self) -> bool:
        """Whether a save has started and is not yet committed or failed."""
        return self._pending is not None and not self._pending.commit.done()

    def wait(self) -> None:
        """Waits until the in-flight save, if any, is committed or failed.

        Raises:
            CheckpointError: it failed and ``on_error="raise"``.
        """
        self._finish_pending()

    # -- loading -------------------------------------------------------------------------------------

    def load_latest(self, state: MutableMapping[str, Any]) -> int | None:
        """Loads the latest committed checkpoint into ``state`` in place; a collective.

        Stateful entries are loaded through their ``load_state_dict``; other top-level entries are
        replaced in ``state``. Rank-local entries and RNG states are restored only when the world size
        is the one that saved them (otherwise they are skipped with a warning). Records
        ``checkpoint_committed`` for the loaded step: it vouches for a commit whose own event a failure
        cut off.

        Returns:
            The step the checkpoint was saved at (training resumes at the step after it), or None
            when there is no committed checkpoint.
        """
        if self._closed:
            raise RuntimeError("Checkpointer.load_latest() after close()")
        self._finish_pending()
        with self._recorder.span("checkpoint_load"):
            found, saved_rng = None, False
            if self.rank == 0:
                found = layout.latest_committed(self.directory)
                saved_rng = found is not None and _holds_key(found.path, rank_key(RNG_KEY, 0))
            found, saved_rng = self._broadcast((found, saved_rng))
            if found is None:
                return None
            same_world = found.world_size == self.world_size
            if not same_world:
                log.warning(
                    "checkpoint %s was written by %d ranks, this job has %d: rank-local entries and RNG "
                    "states are not restored",
                    found.path,
                    found.world_size,
                    self.world_size,
                )
            targets: dict[str, Any] = {}
            for key, value in state.items():
                check_entry(key, value)
                if isinstance(value, RankLocal):
                    if same_world:
                        prepare_for_load(value.obj)
                        targets[rank_key(key, self.rank)] = value.obj
                else:
                    prepare_for_load(value)
                    targets[key] = value
            rng_key = rank_key(RNG_KEY, self.rank)
            if self.save_rng and same_world and saved_rng:  # a checkpoint saved with save_rng=False has none
                targets[rng_key] = RNGState().state_dict()
            with _quiet_single_process(self._distributed):
                dcp.load(targets, checkpoint_id=found.path, process_group=self._pg, no_dist=not self._distributed)
            for key, value in state.items():
                if not isinstance(value, RankLocal) and not is_stateful(value):
                    state[key] = targets[key]
            if rng_key in targets:
                # Last, so that nothing in the load itself draws from the restored generators.
                RNGState().load_state_dict(targets[rng_key])
        self.last_committed_step = found.step
        # Durable, and the failure that brought us here may have cut off its commit's event: the
        # calculator counts this one for the attempt before (docs/metrics.md#how-wall-time-is-split).
        self._recorder.checkpoint_committed(found.step)
        return found.step

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the in-flight save to commit (or fail), then releases the staging buffers, the
        commit thread and the checkpointer's own process group (its gloo threads are joined now,
        not during interpreter exit).

        Raises:
            CheckpointError: the last save failed and ``on_error="raise"``.
        """
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._closed = True
            if self._stager is not None:
                self._stager.close()
            if self._join_commit():
                self._release_group()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            # Training is failing: do not wait on a save whose peers may be gone (interpreter exit
            # waits for the commit, bounded by commit_timeout_s, and then releases the group).
            self._closed = True

    def _join_commit(self, timeout: float | None = None) -> bool:
        """Waits for the commit thread (at most ``timeout`` seconds); True once it has ended."""
        thread = self._commit_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return False
        self._commit_thread = None
        return True

    def _release_group(self) -> None:
        """Destroys the gloo group this checkpointer created and lets go of it, so that its worker
        threads end now: left to interpreter exit, a gloo thread freeing the tensors of the last
        commit broadcast takes the GIL while the interpreter finalizes, and CPython's ending of that
        thread aborts the process (SIGABRT, 'terminate called without an active exception')."""
        pg, self._pg = self._pg, None
        if pg is None or not self._owns_pg:
            return
        self._owns_pg = False
        try:
            if dist.is_initialized():
                dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - already destroyed (destroy_process_group() of everything)
            log.debug("checkpoint process group already destroyed", exc_info=True)
        del pg  # the last reference: the group's destructor joins its worker threads here

    def _at_exit(self) -> None:
        pending = self._pending
        if not self._join_commit(self.commit_timeout_s + _EXIT_JOIN_MARGIN_S):
            log.warning(
                "the commit of the checkpoint of step %s did not end within %.0f s of interpreter exit; "
                "exiting without it",
                pending.step if pending else "?",
                self.commit_timeout_s + _EXIT_JOIN_MARGIN_S,
            )
            return
        if pending is not None and pending.commit.done() and self._pending is pending:
            # Nobody will call save/wait/close again to hear how the last save ended: say it once.
            try:
                failure = pending.commit.result()
            except BaseException as e:  # noqa: BLE001
                failure = (f"checkpoint of step {pending.step} was not saved: {_cause(e)}", _cause(e))
            if failure is not None and self.rank == 0:
                log.warning("%s (at exit)", failure[0])
        self._release_group()

    # -- internals -----------------------------------------------------------------------------------

    def _entries(self, state: Mapping[str, Any]) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        for key, value in state.items():
            check_entry(key, value)
            target = key
            if isinstance(value, RankLocal):
                target, value = rank_key(key, self.rank), value.obj
            entries[target] = value.state_dict() if is_stateful(value) else value
        if self.save_rng:
            entries[rank_key(RNG_KEY, self.rank)] = RNGState().state_dict()
        return entries

    def _save_now(self, step: int, entries: dict[str, Any], partial: Path, started: float) -> None:
        error: BaseException | None = None
        try:
            with _quiet_single_process(self._distributed):
                dcp.save(
                    entries,
                    storage_writer=_FileSystemWriter(partial),
                    process_group=self._pg,
                    no_dist=not self._distributed,
                )
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
        failure = self._conclude(step, partial, error, started)
        if failure is not None:
            self._report(failure)

    def _start_async(self, step: int, entries: dict[str, Any], partial: Path, started: float) -> None:
        # dcp.async_save itself runs on the commit thread: starting it costs 5-15 ms of Python (the
        # planner, the stager's submission, DCP's executor) that training need not wait for. The state
        # is already captured (state_dict(), RNG) in ``entries``; the copy only reads its tensors, and
        # ``wait_staged`` / non-overlapped saves wait for that copy as before.
        stager = self._stager_for(entries)
        staging: Future = Future()  # done once the copy no longer reads the live tensors
        commit: Future = Future()
        thread = threading.Thread(
            target=self._run_save,
            args=(commit, staging, stager, step, entries, partial, started),
            name=f"warmstart-ckpt-commit-{step}",
            daemon=True,
        )
        self._pending = _Pending(step, staging, commit)
        self._commit_thread = thread
        thread.start()

    def _run_save(
        self,
        commit: Future,
        staging: Future,
        stager: AsyncStager,
        step: int,
        entries: dict[str, Any],
        partial: Path,
        started: float,
    ) -> None:
        if not commit.set_running_or_notify_cancel():
            staging.cancel()
            return
        # DCP warns from its upload thread, while this one waits for the upload: the scope covers it.
        with _quiet_single_process(self._distributed):
            try:
                kind = (
                    AsyncCheckpointerType.PROCESS
                    if self.mode is AsyncMode.ASYNC_PROCESS
                    else AsyncCheckpointerType.THREAD
                )
                try:
                    response = dcp.async_save(
                        entries,
                        storage_writer=_FileSystemWriter(partial),
                        process_group=self._pg,
                        async_checkpointer_type=kind,
                        async_stager=stager,
                        no_dist=not self._distributed,
                    )
                except (Exception, CheckpointException) as e:  # nothing started: no copy reads the tensors
                    staging.set_result(None)
                    commit.set_result(self._conclude(step, partial, e, started))
                    return
                if isinstance(response, AsyncSaveResponse):
                    _chain(response.staging_completion, staging)
                    upload = response.upload_completion
                else:
                    staging.set_result(None)
                    upload = response
                del entries, response  # the staged copy is DCP's now: do not hold the state's references
                commit.set_result(self._commit_after(step, partial, upload, started))
            except BaseException as e:  # noqa: BLE001 - the caller's next save/wait/close sees it
                if not staging.done():
                    staging.set_result(None)
                commit.set_exception(e)

    def _commit_after(self, step: int, partial: Path, upload: Future, started: float) -> tuple[str, str] | None:
        error: BaseException | None = None
        try:
            upload.result()
        except (Exception, CheckpointException) as e:
            error = e
        return self._conclude(step, partial, error, started)

    def _conclude(
        self, step: int, partial: Path, error: BaseException | None, started: float
    ) -> tuple[str, str] | None:
        """Runs on every rank once its write of ``step`` finished or failed. DCP already reduced the
        write results across ranks (its last collective gathers every rank's result at the
        coordinator and broadcasts the outcome), so all ranks get here with the same error or none."""
        failure = None
        if self.rank == 0:
            if error is None:
                try:
                    layout.commit(partial, step, self.world_size)
                    deleted = layout.prune(self.directory, self.keep)
                    if deleted:
                        log.debug("deleted checkpoints of steps %s in %s", deleted, self.directory)
                except OSError as e:
                    error = e
            if error is not None:
                layout.discard_partial(partial)
                failure = self._not_saved(step, _cause(error))
        try:
            failure = self._broadcast_bounded(failure)
        except Exception as e:  # noqa: BLE001 - a rank is gone or did not answer within commit_timeout_s
            cause = f"no answer from every rank within {self.commit_timeout_s:g} s ({_cause(e)})"
            if self.rank != 0:
                failure = (
                    f"checkpoint of step {step}: the outcome of its commit did not reach rank {self.rank}: {cause}",
                    cause,
                )
            elif failure is None:  # committed on disk (every rank had written its part); only the telling failed
                log.warning(
                    "checkpoint of step %d is committed in %s, but not every rank heard of it: %s",
                    step,
                    self.directory,
                    cause,
                )
        if failure is None:
            self.last_committed_step = step
            self.last_save_to_commit_s = time.monotonic() - started
            self._recorder.checkpoint_committed(step)
        return failure

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            failure = pending.commit.result()
            if failure is not None:
                self._report(failure)

    def _report(self, failure: tuple[str, str]) -> None:
        message, cause = failure
        self.failures += 1
        if self.on_error == "raise":
            raise CheckpointError(message)
        if cause not in self._reported:
            self._reported.add(cause)
            # Every rank holds the same message: one line in the job's log is enough.
            log.log(
                logging.WARNING if self.rank == 0 else logging.DEBUG,
                "%s; training continues (on_error='continue')",
                message,
            )

    def _plan_next(self, step: int, now: float) -> None:
        assert self.interval is not None
        due = self.interval.next_step(step, now, self.last_blocking_s) if self.rank == 0 else None
        self._next_due = self._broadcast(due)

    def _stager_for(self, entries: dict[str, Any]) -> AsyncStager:
        if self._stager is None:
            if _has_sharded_tensor(entries):
                # DefaultStager cannot copy ShardedTensor (StateDictStager calls data_ptr on it).
                log.info(
                    "state holds ShardedTensor: staging blocks for the CPU copy; build TorchRec's "
                    "ShardingEnv with output_dtensor=True for non-blocking staging"
                )
                self._stager = BlockingAsyncStager()
            else:
                cuda = torch.cuda.is_available()
                self._stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=self.mode is AsyncMode.ASYNC_PROCESS,
                        use_async_staging=True,
                        use_non_blocking_copy=cuda,
                    )
                )
        return self._stager

    def _not_saved(self, step: int, cause: str) -> tuple[str, str]:
        latest = layout.latest_committed(self.directory)
        return (
            f"checkpoint of step {step} was not saved in {self.directory}: {cause}; earlier "
            f"checkpoints are intact (latest committed: {f'step {latest.step}' if latest else 'none'})",
            cause,
        )

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._pg, group_src=0)
        return box[0]

    def _broadcast_bounded(self, obj: Any) -> Any:
        """``_broadcast`` whose two collectives each give up after ``commit_timeout_s`` whatever the
        group's own timeout (a ``process_group`` passed in keeps its own, 30 min by default).

        Raises:
            RuntimeError: a rank is gone (its connection closed) or did not join in time.
        """
        if not self._distributed:
            return obj
        assert self._pg is not None
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast_tensor(size)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast_tensor(data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _broadcast_tensor(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = timedelta(seconds=self.commit_timeout_s)
        assert self._pg is not None  # only called when distributed
        self._pg.broadcast([tensor], opts).wait()


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """Silence DCP's warning that torch.distributed is off, for a single-process checkpointer: a
    supported use, not an accident, so the warning is noise. The process's filters are restored
    afterwards (a library never changes them for good); a distributed one changes nothing."""
    if distributed:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


def _chain(source: Future, target: Future) -> None:
    """Completes ``target`` when ``source`` completes; a failed copy fails the upload too, and the
    commit reports it, so ``target`` only says that the copy is over."""

    def complete(_: Future) -> None:
        if not target.done():
            target.set_result(None)

    source.add_done_callback(complete)


def _cause(exc: BaseException) -> str:
    """One line naming the root cause of a failed save, e.g. 'No space left on device (errno 28)'."""
    if isinstance(exc, CheckpointException):
        ranks = sorted(exc.failures)
        failure = exc.failures[ranks[0]]
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"{_cause(inner)} (rank {', '.join(map(str, ranks))})"
    os_error = _os_error(exc)
    if os_error is not None:
        return f"{os.strerror(os_error.errno)} (errno {os_error.errno})"  # type: ignore[arg-type]
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    # gloo prefixes its errors with its source location: '[/…/gloo/transport/tcp/pair.cc:553] Connection
    # closed by peer [127.0.0.1]:8876. This is typically caused by…': keep the sentence that says what happened.
    line = text[0]
    if line.startswith("[") and "] " in line and (".cc:" in line.split("] ", 1)[0] or ".h:" in line.split("] ", 1)[0]):
        line = line.split("] ", 1)[1].split(". ", 1)[0]
    return f"{type(exc).__name__}: {line}"


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _at_exit() -> None:
    """Interpreter exit waits for in-flight commits (each at most ``commit_timeout_s`` + 5 s), then
    frees the checkpointers' own process groups while the interpreter is still whole."""
    for ckpt in list(_live):
        try:
            ckpt._at_exit()
        except Exception:  # noqa: BLE001 - exit goes on whatever a checkpointer does
            log.debug("checkpointer exit hook failed", exc_info=True)


# With threading's exit hooks (as concurrent.futures' executors): they run before the atexit module's,
# so a commit that ends during exit is recorded before the metrics recorder's own exit hook closes it.
try:
    threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python, or imported during shutdown
    atexit.register(_at_exit)


def _os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``'s cause/context chain."""
    chain: BaseException | None = exc
    seen: set[int] = set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno is not None:
            return chain
        chain = chain.__cause__ or chain.__context__
    return None


def _holds_key(path: Path, key: str) -> bool:
    """Whether the checkpoint in ``path`` has an entry ``key`` (DCP flattens nested keys with dots)."""
    from torch.distributed.checkpoint import FileSystemReader

    names = FileSystemReader(path).read_metadata().state_dict_metadata
    return any(name == key or name.startswith(key + ".") for name in names)


def _has_sharded_tensor(obj: Any) -> bool:
    sharded_tensor = torch_internals.resolve("ShardedTensor")
    if sharded_tensor is None:
        return False
    if isinstance(obj, sharded_tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_sharded_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_sharded_tensor(v) for v in obj)
    return False
