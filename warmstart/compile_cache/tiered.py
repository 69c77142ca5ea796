"""The store jobs use: the local tier first, then the remote tier, with backfill and background writes.

Reads go local, then remote; a remote hit is copied into the local tier (in the background, so the
job does not wait on the disk) so the next read on this machine is local. Writes go to the local
tier at once and to the remote tier from a background thread, so compilation never waits on the
network; ``flush`` (also run at exit, for at most ``EXIT_FLUSH_S``) drains them. Queued writes hold
at most ``WRITE_QUEUE_BYTES`` of values: past that a write is dropped (counted), so a slow server
never makes the job's memory grow with the artifacts it compiles.
Read-only mode (``WARMSTART_CACHE_MODE=ro``) writes to no tier at all.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from pathlib import Path

from warmstart import _defaults
from warmstart.compile_cache.local import LocalTier
from warmstart.compile_cache.remote import RemoteTier
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import warn_once

log = logging.getLogger("warmstart.cache")


class TieredStore:
    """Local tier plus optional remote tier, as one store.

    Args:
        local: the local tier (``None`` for none).
        remote: the remote tier (``None`` for local only).
        mode: ``rw`` or ``ro``.
        stats_file: where this process's counts are merged at exit (``None``: not persisted).
        queue_bytes: most bytes of values waiting for background writes; a write past it is dropped.
    """

    exit_flush_s: float = _defaults.EXIT_FLUSH_S
    """How long :meth:`close` (run at exit) waits for background writes."""

    def __init__(self, local: LocalTier | None, remote: RemoteTier | None, *, mode: str = "rw",
                 stats: Stats | None = None, stats_file: Path | None = None,
                 queue_bytes: int = _defaults.WRITE_QUEUE_BYTES) -> None:
        self.local = local
        self.remote = remote
        self.mode = mode
        self.stats = stats or Stats()
        for tier in (local, remote):  # one set of counters for the whole store
            if tier is not None:
                tier.stats = self.stats
        self.stats_file = stats_file
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0
        """Bytes of values queued for background writes now (at most ``queue_bytes``)."""
        self._queued_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._writer_pid = 0
        self._closed = False
        atexit.register(self.close)

    @property
    def tiers(self) -> list:
        return [t for t in (self.local, self.remote) if t is not None]

    def get(self, kind: str, key: str) -> bytes | None:
        """The value from the nearest tier that has it, or ``None``. Never raises."""
        try:
            return self._get(kind, key)
        except Exception as exc:  # tiers never raise; this holds whatever changes under them
            warn_once(f"store-get:{type(exc).__name__}", "warmstart: cache lookup failed (%s: %s); treated as a miss",
                      type(exc).__name__, exc)
            return None

    def _get(self, kind: str, key: str) -> bytes | None:
        if self.local is not None and (value := self.local.get(kind, key)) is not None:
            return value
        if self.remote is None:
            return None
        found = self._fetch_remote(kind, key)
        if found is None:
            return None
        value, cost_s = found
        if self.local is not None and self.mode == "rw":
            self._enqueue(self.local, kind, key, value, cost_s)
        return value

    def _fetch_remote(self, kind: str, key: str) -> tuple[bytes, float] | None:
        # A ``cache_fetch`` span in the job's ETT events: the time spent waiting on the shared cache,
        # in the bucket of the work it stands in for (so the buckets do not change, only the detail).
        # Only on a recorder the process already has: compile workers read the cache too.
        from warmstart.metrics.recorder import existing_recorder

        recorder = existing_recorder()
        if recorder is None:
            return self.remote.fetch(kind, key)
        bucket = "sharding_plan" if kind == "sharding_plan" else "compile"
        recorder.begin("cache_fetch", bucket)
        try:
            return self.remote.fetch(kind, key)
        finally:
            recorder.end("cache_fetch", bucket)

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0, sync: bool = False) -> None:
        """Store ``value`` in every tier (remote in the background unless ``sync``). Never raises."""
        try:
            self._put(kind, key, value, cost_s=cost_s, sync=sync)
        except Exception as exc:
            warn_once(f"store-put:{type(exc).__name__}", "warmstart: cache write failed (%s: %s); not cached",
                      type(exc).__name__, exc)

    def _put(self, kind: str, key: str, value: bytes, *, cost_s: float, sync: bool) -> None:
        if self.mode != "rw":
            return
        if self.local is not None:
            self.local.put(kind, key, value, cost_s=cost_s)
        if self.remote is None:
            return
        if sync:
            self.remote.put(kind, key, value, cost_s=cost_s)
            return
        self._enqueue(self.remote, kind, key, value, cost_s)

    def _enqueue(self, tier, kind: str, key: str, value: bytes, cost_s: float) -> None:
        self._ensure_writer()
        with self._queued_lock:
            if self.queued_bytes + len(value) > self.queue_bytes:
                self.stats.add(tier.name, kind, dropped=1)
                return
            self.queued_bytes += len(value)
        self._queue.put_nowait((tier, kind, key, value, cost_s))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued background writes are done; False if ``timeout`` ran out first."""
        if self._writer is None or self._writer_pid != os.getpid():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _ensure_writer(self) -> None:
        # After a fork the parent's thread does not exist in the child: start a new one there.
        if self._writer is not None and self._writer_pid == os.getpid():
            return
        self._queue = queue.Queue()
        self.queued_bytes = 0  # the parent's queued values are not this process's to write
        self._queued_lock = threading.Lock()
        self._writer_pid = os.getpid()
        self._writer = threading.Thread(target=self._write_loop, name="warmstart-cache-writer", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        q = self._queue
        while True:
            tier, kind, key, value, cost_s = q.get()
            try:
                tier.put(kind, key, value, cost_s=cost_s)
            except Exception:  # put never raises by contract; this guards the thread regardless
                log.debug("background write failed", exc_info=True)
            finally:
                with self._queued_lock:
                    self.queued_bytes -= len(value)
                del value  # not held while waiting for the next item
                q.task_done()

    def _drop_queued(self) -> int:
        """Drop the writes still queued (counted), freeing their memory; the one under way goes on."""
        dropped = 0
        while True:
            try:
                tier, kind, _, value, _ = self._queue.get_nowait()
            except queue.Empty:
                return dropped
            self.stats.add(tier.name, kind, dropped=1)
            with self._queued_lock:
                self.queued_bytes -= len(value)
            self._queue.task_done()
            dropped += 1

    def close(self) -> None:
        """Drain background writes (for at most ``exit_flush_s``) and persist this process's stats."""
        if self._closed:
            return
        self._closed = True
        if not self.flush(timeout=self.exit_flush_s):
            log.warning("warmstart: gave up waiting for remote cache writes at exit; dropped %d",
                        self._drop_queued())
        if self.stats_file is not None:
            try:
                self.stats.take().merge_into(self.stats_file)
            except Exception:
                log.debug("could not write cache stats", exc_info=True)
