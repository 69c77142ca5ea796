"""Counters per (tier, artifact kind), merged across processes like sccache's server stats.

Counting happens in memory; each process adds its counts to ``stats.json`` in the local cache
directory at exit (under a file lock), which is what ``warmstart cache stats`` reads.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import threading
import weakref
from collections import defaultdict
from pathlib import Path

from warmstart._fileio import write_file

FIELDS = (
    "hits",
    "misses",
    "writes",
    "errors",
    "timeouts",
    "rejected",
    "dropped",
    "bytes_read",
    "bytes_written",
    "read_s",
    "saved_s",
)


@dataclasses.dataclass
class Counts:
    """What one tier did for one artifact kind."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    errors: int = 0
    timeouts: int = 0
    rejected: int = 0
    """Entries whose signature or checksum did not verify: never handed to torch."""
    dropped: int = 0
    """Background writes dropped because the write queue was full or the tier was off."""
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    saved_s: float = 0.0
    """Estimated compile seconds saved by hits (producer's cost minus our read time)."""

    def __add__(self, other: Counts) -> Counts:
        return Counts(**{f: getattr(self, f) + getattr(other, f) for f in FIELDS})

    def to_dict(self) -> dict[str, float | int]:
        return {f: getattr(self, f) for f in FIELDS}


class Stats:
    """Thread-safe counters keyed by ``(tier, kind)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], Counts] = defaultdict(Counts)
        self._taken: dict[tuple[str, str], Counts] = defaultdict(Counts)  # handed to the file so far
        self.counters: dict[str, float] = defaultdict(int)
        """Process-level events that are not per tier, e.g. ``recompiles``, single-flight's
        ``leases``, ``waits``, ``wait_s`` (seconds), ``takeovers``, ``wait_timeouts`` and
        ``leases_lapsed`` (let go before their entry was stored), untrusted lease records ignored
        (``leases_ignored``), host locks of stopped holders taken over (``stale_locks``) and
        slow-server trips (``slow_trips``)."""
        _instances.add(self)

    def _after_fork(self) -> None:
        # A thread of the parent may have held the lock at the fork: the child's copy would never
        # be released.
        self._lock = threading.Lock()

    def bump(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def add(self, tier: str, kind: str, **deltas: float) -> None:
        with self._lock:
            counts = self._counts[(tier, kind)]
            for field, delta in deltas.items():
                setattr(counts, field, getattr(counts, field) + delta)

    def get(self, tier: str, kind: str) -> Counts:
        with self._lock:
            return dataclasses.replace(self._counts.get((tier, kind), Counts()))

    def items(self) -> list[tuple[tuple[str, str], Counts]]:
        with self._lock:
            return [(k, dataclasses.replace(v)) for k, v in sorted(self._counts.items())]

    def totals(self) -> list[tuple[tuple[str, str], Counts]]:
        """Like :meth:`items`, but counting what :meth:`take` handed off too: the counts of the
        process so far, which never go down (what a dashboard's counter shows)."""
        with self._lock:
            keys = sorted(self._counts.keys() | self._taken.keys())
            return [(k, self._taken.get(k, Counts()) + self._counts.get(k, Counts())) for k in keys]

    def to_dict(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """``{tier: {kind: counts}}``."""
        out: dict[str, dict[str, dict[str, float | int]]] = {}
        for (tier, kind), counts in self.items():
            out.setdefault(tier, {})[kind] = counts.to_dict()
        return out

    def counters_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)

    def take(self) -> Stats:
        """Return the counts so far and reset them (for merging into the shared file)."""
        with self._lock:
            taken = Stats()
            taken._counts, self._counts = self._counts, defaultdict(Counts)
            for key, counts in taken._counts.items():
                self._taken[key] = self._taken[key] + counts
            taken.counters, self.counters = self.counters, defaultdict(int)
            return taken

    def merge_into(self, path: Path) -> None:
        """Add these counts to the JSON file at ``path`` (created if missing), under a lock."""
        if not self._counts and not self.counters:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            total = load(path)
            for (tier, kind), counts in self.items():
                total.add(tier, kind, **counts.to_dict())
            for name, n in self.counters_dict().items():
                total.bump(name, n)
            write_file(path, json.dumps({"tiers": total.to_dict(), "counters": total.counters_dict()}, indent=1), 0o644)


#: The kind whose producer's compile time includes this kind's: an AOTAutograd entry's time
#: includes its FX graphs', an FX graph's its C++ objects' and kernels', a C++ object's its header's.
NESTED_IN: dict[str, str] = {
    "aot_autograd": "dynamo_frames",
    "fx_graph": "aot_autograd",
    "autotune": "fx_graph",
    "triton_kernel": "fx_graph",
    "cpp_object": "fx_graph",
    "isa_probe": "fx_graph",
    "header_digest": "cpp_object",
}


def wall_saved_estimate(stats: Stats, tier: str) -> float:
    """Seconds of wall time the hits of ``tier`` saved, estimated: each kind's ``saved_s`` counts
    only when no kind it nests in (:data:`NESTED_IN`) had hits there, so a hit is not counted again
    inside the entry that contains it. Still an estimate: producers' times are their own (threads
    compiling at once each count theirs), and a nested hit may belong to an outer miss."""
    hit_kinds = {kind for (t, kind), c in stats.items() if t == tier and c.hits}

    def contained(kind: str) -> bool:
        outer = NESTED_IN.get(kind)
        while outer is not None:
            if outer in hit_kinds:
                return True
            outer = NESTED_IN.get(outer)
        return False

    return sum(c.saved_s for (t, kind), c in stats.items() if t == tier and not contained(kind))


def load(path: Path) -> Stats:
    """Read a stats file written by :meth:`Stats.merge_into`; missing or unreadable means empty."""
    stats = Stats()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return stats
    for tier, kinds in data.get("tiers", {}).items():
        for kind, counts in kinds.items():
            stats.add(tier, kind, **{f: counts.get(f, 0) for f in FIELDS})
    for name, n in data.get("counters", {}).items():
        if isinstance(n, (int, float)):
            stats.bump(name, n)
    return stats


_instances: weakref.WeakSet[Stats] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for stats in list(_instances):
        stats._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
