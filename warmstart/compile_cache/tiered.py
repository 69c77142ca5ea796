"""The store jobs use: the local tier first, then the remote tier, with backfill and background writes.

Reads go local, then remote; a remote hit is copied into the local tier (in the background, so the
job does not wait on the disk) so the next read on this machine is local, unless its reader keeps it
on this machine itself (``get(..., copy_local=False)``). Writes go to the local
tier at once (values of ``LOCAL_BACKGROUND_BYTES`` and more from the background thread too) and to
the remote tier from a background thread, at a lower CPU priority, so compilation never waits on
the network; ``flush`` (also run at exit, for at most ``EXIT_FLUSH_S``) drains them. Queued writes hold
at most ``WRITE_QUEUE_BYTES`` of values: past that a write is dropped (counted), so a slow server
never makes the job's memory grow with the artifacts it compiles.
Tiers that are not ``writable`` (a :class:`~warmstart.compile_cache.storage.ReadOnly` view:
``WARMSTART_CACHE_MODE=ro``, a verify-only key) are never queued for. Each lookup's outcome, and
each wait on the remote tier, goes to the store's observers (the metrics package attaches one that
records ETT spans).

With ``single_flight``, a miss of an entry another process is compiling right now waits for that
process's result instead (see ``single_flight.py``); the lease this process takes on a miss is
released once its ``put`` is readable in every tier (after the background write).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from warmstart import _defaults
from warmstart._threads import start_daemon
from warmstart.compile_cache.fetch_ahead import FetchAhead
from warmstart.compile_cache.single_flight import SingleFlight
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import (
    ABSENT,
    ERROR,
    TIMEOUT,
    Hit,
    Lookup,
    Miss,
    Storage,
    StoreObserver,
    warn_once,
)
from warmstart.compile_cache.wait_budget import WaitBudget

log = logging.getLogger("warmstart.cache")

#: One queued background write: the tiers, kind, key, value, the producer's cost, and whether a lease
#: on the entry is released once it is written.
_Write = tuple[tuple[Storage, ...], str, str, bytes, float, bool]


class TieredStore:
    """Local tier plus optional remote tier, as one :class:`Storage`.

    Args:
        local: the local tier (``None`` for none).
        remote: the remote tier (``None`` for local only).
        stats: the counters the tiers share (the store's ``stats``).
        stats_file: where this process's counts are merged at exit (``None``: not persisted).
        queue_bytes: most bytes of values waiting for background writes; a write past it is dropped.
        observers: told of every lookup and every wait on the remote tier (see :meth:`add_observer`).
        single_flight: leases for misses, so that concurrent compiles of one entry happen once.
        budget: the process's time for waiting on the cache (``wait_budget.py``): tier operations on
            the caller's thread and the exit flush are charged to it; once it is spent the remote
            tier is left out. A budget of its own (``MAX_WAIT_S``) when omitted.
        ahead: the remote tier's fetch ahead (``fetch_ahead.py``): told of every lookup, and asked
            to store its manifest at :meth:`close`, after the background writes.
    """

    name = "store"

    exit_flush_s: float = _defaults.EXIT_FLUSH_S
    """How long :meth:`close` (run at exit) waits for background writes."""

    def __init__(
        self,
        local: Storage | None,
        remote: Storage | None,
        *,
        stats: Stats | None = None,
        stats_file: Path | None = None,
        queue_bytes: int = _defaults.WRITE_QUEUE_BYTES,
        observers: Iterable[StoreObserver] = (),
        single_flight: SingleFlight | None = None,
        budget: WaitBudget | None = None,
        ahead: FetchAhead | None = None,
    ) -> None:
        self.local = local
        self.ahead = ahead
        self.budget = budget or WaitBudget(_defaults.MAX_WAIT_S)
        self.remote = remote
        self.stats = stats or Stats()
        self.observers: list[StoreObserver] = list(observers)
        self.single_flight = single_flight
        self.stats_file = stats_file
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0
        """Bytes of values queued for background writes now (at most ``queue_bytes``)."""
        self._queued_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._flushing = 0  # callers of flush() waiting now: writes set aside go at once
        self._writer: threading.Thread | None = None
        self._writer_pid = 0
        self._closed = False
        atexit.register(self.close)

    @property
    def stats(self) -> Stats:
        """The counters of the store, which its tiers count in too (set on them with it)."""
        return self._stats

    @stats.setter
    def stats(self, stats: Stats) -> None:
        self._stats = stats
        for tier in (self.local, self.remote):  # one set of counters for the whole store
            if tier is not None:
                tier.stats = stats

    def add_observer(self, observer: StoreObserver) -> None:
        """Tell ``observer`` of every lookup from now on."""
        self.observers.append(observer)

    def get(self, kind: str, key: str, *, wait: bool = True, copy_local: bool = True) -> Lookup:
        """A hit from the nearest tier that has it, or the miss of the farthest tier asked (the
        remote tier's reason says more than the local one's); after :meth:`close`, a miss
        (``error``). ``wait=False``: a miss neither waits for another process's compile nor takes a
        lease (for values cheaper to make again than to wait for). ``copy_local=False``: a hit from
        the remote tier is not copied into the local one (for a value the caller keeps on this
        machine's disk itself). Never raises."""
        if self._closed:
            self.stats.add(self.name, kind, misses=1)
            return Miss(ERROR, self.name, "the store is closed")
        if self.ahead is not None and wait:  # a value cheaper to make again than to wait for: not fetched ahead
            self.ahead.looked_up(kind, key)
        try:
            result = self._get(kind, key, copy_local)
            if not result and wait and self.single_flight is not None:
                result = self.single_flight.resolve(
                    kind,
                    key,
                    result,
                    lambda: self._get(kind, key, copy_local),
                    lambda: self._observed("waiting_on_peer", kind),
                )
        except Exception as exc:  # tiers never raise; this holds whatever changes under them
            warn_once(
                f"store-get:{type(exc).__name__}",
                "warmstart: cache lookup failed (%s: %s); treated as a miss",
                type(exc).__name__,
                exc,
            )
            result = Miss(ERROR, self.name, f"{type(exc).__name__}: {exc}")
        for observer in self.observers:
            try:
                observer.looked_up(kind, key, result)
            except Exception:  # an observer must never cost a lookup
                log.debug("store observer failed", exc_info=True)
        return result

    def _get(self, kind: str, key: str, copy_local: bool = True) -> Lookup:
        result: Lookup = Miss(ABSENT, self.name, "no tier")
        if self.local is not None:
            with self.budget.waiting("the local tier"):
                result = self.local.get(kind, key)
            if result:
                return result
        if self.remote is None:
            return result
        if self.budget.exhausted:
            return Miss(TIMEOUT, self.remote.name, "the process's time for waiting on the cache is spent")
        with self._observed("waiting", kind), self.budget.waiting("the remote tier"):
            result = self.remote.get(kind, key)
        if isinstance(result, Hit) and copy_local and self.local is not None and self.local.writable:
            self._enqueue((self.local,), kind, key, result.value, result.cost_s)
        return result

    @contextlib.contextmanager
    def _observed(self, method: str, kind: str):
        # Each observer's span around a wait (on the shared tier, or on another process's compile);
        # one that fails, or does not know the method, is left out.
        with contextlib.ExitStack() as stack:
            for observer in self.observers:
                try:
                    stack.enter_context(getattr(observer, method)(kind))
                except Exception:
                    log.debug("store observer failed", exc_info=True)
            yield

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0, sync: bool = False) -> bool:
        """Store ``value`` in every writable tier (remote in the background unless ``sync``); after
        :meth:`close`, refused (counted as ``dropped``).

        Returns:
            True if some tier took it (or queued it). Never raises.
        """
        if self._closed:
            self.stats.add(self.name, kind, dropped=1)
            return False
        try:
            return self._put(kind, key, value, cost_s=cost_s, sync=sync)
        except Exception as exc:
            warn_once(
                f"store-put:{type(exc).__name__}",
                "warmstart: cache write failed (%s: %s); not cached",
                type(exc).__name__,
                exc,
            )
            return False

    def _put(self, kind: str, key: str, value: bytes, *, cost_s: float, sync: bool) -> bool:
        stored = queued_release = False
        later: list[Storage] = []  # tiers written from the background thread
        try:
            if self.local is not None:  # a read-only tier refuses at once, and counts it
                if not sync and len(value) >= _defaults.LOCAL_BACKGROUND_BYTES and self.local.writable:
                    later.append(self.local)  # a large value (a precompiled header): not on the compile's path
                else:
                    stored = self.local.put(kind, key, value, cost_s=cost_s)
            if self.remote is not None:
                if sync or not self.remote.writable:
                    if not self.budget.exhausted:
                        with self.budget.waiting("the remote tier"):
                            stored = self.remote.put(kind, key, value, cost_s=cost_s) or stored
                else:
                    later.append(self.remote)
            if not later:
                return stored
            flight = self.single_flight
            queued_release = flight is not None and flight.holds(kind, key)
            if flight is not None and queued_release:
                flight.saving(kind, key)  # released by the writer once readable
            if self._enqueue(tuple(later), kind, key, value, cost_s, release=queued_release, writes_local=True):
                return True  # a lease on the entry goes once the background writes are done
            queued_release = False
            if self.local in later:  # the queue is full: the local tier still takes it, now
                stored = self.local.put(kind, key, value, cost_s=cost_s) or stored
            return stored
        finally:
            if self.single_flight is not None and not queued_release:
                self.single_flight.finished(kind, key)

    @property
    def writable(self) -> bool:
        """Whether any tier takes writes (``WARMSTART_CACHE_MODE=ro`` makes none)."""
        return any(t is not None and t.writable for t in (self.local, self.remote))

    def _enqueue(
        self,
        tiers: tuple[Storage, ...],
        kind: str,
        key: str,
        value: bytes,
        cost_s: float,
        release: bool = False,
        writes_local: bool = False,
    ) -> bool:
        """Queue ``value`` for ``tiers``; False (each tier's write counted as dropped) when the queue
        is full. ``writes_local``: the caller writes the local tier itself then, so it is not dropped."""
        self._ensure_writer()
        with self._queued_lock:
            if self.queued_bytes + len(value) > self.queue_bytes:
                for tier in tiers:
                    if not (writes_local and tier is self.local):
                        self.stats.add(tier.name, kind, dropped=1)
                return False
            self.queued_bytes += len(value)
        self._queue.put_nowait((tiers, kind, key, value, cost_s, release))
        return True

    def _written(self, kind: str, key: str, release: bool) -> None:
        if release and self.single_flight is not None:
            self.single_flight.finished(kind, key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued background writes are done, those set aside while this process compiles
        included (they are written now); False if ``timeout`` ran out first."""
        if self._writer is None or self._writer_pid != os.getpid():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queued_lock:
            self._flushing += 1
        try:
            while self._queue.unfinished_tasks:
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
            return True
        finally:
            with self._queued_lock:
                self._flushing -= 1

    def _ensure_writer(self) -> None:
        # After a fork the parent's thread does not exist in the child: start a new one there.
        if self._writer is not None and self._writer_pid == os.getpid():
            return
        self._queue = queue.Queue()
        self.queued_bytes = 0  # the parent's queued values are not this process's to write
        self._queued_lock = threading.Lock()
        self._flushing = 0
        self._writer_pid = os.getpid()
        self._writer = start_daemon(self._write_loop, "warmstart-cache-writer")

    def _write_loop(self) -> None:
        # Below the compile in priority: compressing and uploading share the cores with g++ and the
        # job's own threads, and nothing waits on them before the first step (Linux: per thread).
        with contextlib.suppress(Exception):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _defaults.WRITER_NICE)
        q = self._queue
        # Large values no process waits for (a precompiled header: it serves only kernels that miss,
        # and costs less to build again than to wait for) are not needed before this process's compile
        # ends, and on a busy machine their compression and writes would come out of that compile: they
        # are set aside while it compiles and LARGE_WRITE_QUIET_S after (within LARGE_WRITE_DEFER_S,
        # never past a flush() or close()), and the writes behind them go on.
        held: list[_Write] = []
        held_until = 0.0
        while True:
            try:
                item = q.get(timeout=0.05 if held else None)
            except queue.Empty:
                item = None
            if item is not None:
                if self._holds_back(item):
                    if not held:
                        held_until = time.monotonic() + _defaults.LARGE_WRITE_DEFER_S
                    held.append(item)
                    continue
                self._write(item)
            if held and (self._flushing or self._closed or not self._compiling() or time.monotonic() > held_until):
                for write in held:
                    self._write(write)
                held.clear()

    def _holds_back(self, item: _Write) -> bool:
        _, _, _, value, _, release = item
        return not release and len(value) >= _defaults.LOCAL_BACKGROUND_BYTES and self._compiling()

    def _compiling(self) -> bool:
        # A compile comes in parts with short gaps between them (Dynamo's frames, a backward lowered
        # at the first backward pass): a held write waits for a quiet moment, not the first gap.
        flight = self.single_flight
        return flight is not None and flight.compiled_within(_defaults.LARGE_WRITE_QUIET_S)

    def _write(self, item: _Write) -> None:
        tiers, kind, key, value, cost_s, release = item
        try:
            for tier in tiers:
                tier.put(kind, key, value, cost_s=cost_s)
        except Exception:  # put never raises by contract; this guards the thread regardless
            log.debug("background write failed", exc_info=True)
        finally:
            self._written(kind, key, release)
            with self._queued_lock:
                self.queued_bytes -= len(value)
            self._queue.task_done()

    def _drop_queued(self) -> int:
        """Drop the writes still queued (counted), freeing their memory; the one under way goes on."""
        dropped = 0
        while True:
            try:
                tiers, kind, key, value, _, release = self._queue.get_nowait()
            except queue.Empty:
                return dropped
            self._written(kind, key, release)
            for tier in tiers:
                self.stats.add(tier.name, kind, dropped=1)
            with self._queued_lock:
                self.queued_bytes -= len(value)
            self._queue.task_done()
            dropped += 1

    def close(self) -> None:
        """Drain background writes (for at most ``exit_flush_s``) and persist this process's stats;
        later lookups miss and writes are refused. Idempotent. The tiers stay open: whoever built
        them owns them (a read-only view or another store may share one)."""
        if self._closed:
            return
        self._closed = True
        with self.budget.waiting("writes at exit"):
            flushed = self.flush(timeout=min(self.exit_flush_s, self.budget.remaining()))
        if not flushed:
            log.warning("warmstart: gave up waiting for remote cache writes at exit; dropped %d", self._drop_queued())
        elif self.ahead is not None and not self.budget.exhausted:
            with self.budget.waiting("the fetch-ahead manifest"):
                self.ahead.save()
        if self.single_flight is not None:
            self.single_flight.release_all()
        if self.stats_file is not None:
            try:
                self.stats.take().merge_into(self.stats_file)
            except Exception:
                log.debug("could not write cache stats", exc_info=True)
