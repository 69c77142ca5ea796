"""The local tier: a diskcache directory with a size limit, least recently used entries out first.

diskcache is SQLite plus files, safe across processes. Its lock wait is kept short so a busy disk
costs a miss, never a stall.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import diskcache

from warmstart.compile_cache.stats import Stats

log = logging.getLogger("warmstart.cache")


class LocalTier:
    """Artifacts in ``directory`` (diskcache), at most ``size_limit`` bytes."""

    name = "local"

    def __init__(self, directory: Path | str, size_limit: int, stats: Stats | None = None) -> None:
        self.directory = Path(directory)
        self.size_limit = size_limit
        self.stats = stats or Stats()
        self._cache = diskcache.Cache(
            str(self.directory / "store"), size_limit=size_limit, eviction_policy="least-recently-used",
            timeout=2.0, disk_min_file_size=64 * 1024,
        )

    def get(self, kind: str, key: str) -> bytes | None:
        start = time.perf_counter()
        try:
            item = self._cache.get(f"{kind}:{key}", default=None, tag=True)
        except Exception as exc:  # diskcache.Timeout, sqlite errors, a full disk
            self.stats.add(self.name, kind, errors=1, misses=1)
            log.debug("local tier get failed: %s", exc)
            return None
        value, cost = item if item is not None else (None, None)
        if value is None:
            self.stats.add(self.name, kind, misses=1)
            return None
        elapsed = time.perf_counter() - start
        self.stats.add(self.name, kind, hits=1, bytes_read=len(value), read_s=elapsed,
                       saved_s=max(0.0, (cost or 0.0) - elapsed))
        return bytes(value)

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0) -> bool:
        try:
            # The producer's cost rides along as the entry's tag for the "seconds saved" estimate.
            self._cache.set(f"{kind}:{key}", value, tag=round(cost_s, 4))
        except Exception as exc:
            self.stats.add(self.name, kind, errors=1)
            log.debug("local tier put failed: %s", exc)
            return False
        self.stats.add(self.name, kind, writes=1, bytes_written=len(value))
        return True

    def volume(self) -> int:
        """Bytes on disk."""
        return self._cache.volume()

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        return self._cache.clear()

    def close(self) -> None:
        self._cache.close()
