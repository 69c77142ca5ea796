"""The storage interface every tier implements, and the artifact kinds warmstart caches.

Read this first. A tier maps ``(kind, key)`` to bytes. ``get`` answers a :class:`Hit` or a
:class:`Miss` that says why (one of :data:`MISS_REASONS`) and never raises: any failure is a miss,
counted in the tier's stats. Read-only is a wrapper (:class:`ReadOnly`); the tiered store is built
from and typed against :class:`Storage`, and reports what it did to :class:`StoreObserver` s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import ClassVar, Protocol, Union, runtime_checkable

log = logging.getLogger("warmstart.cache")

#: Artifact kinds, as shown in ``warmstart cache stats``.
KINDS: dict[str, str] = {
    "fx_graph": "fx graph",
    "aot_autograd": "aot autograd",
    "autotune": "autotune",
    "pgo": "pgo",
    "triton_kernel": "triton kernel",
    "cpp_object": "compiled C++ object",
    "isa_probe": "vector ISA probe",
    "dynamo_frames": "dynamo frames",
    "sharding_plan": "sharding plan",
}

#: Kinds whose entry under a key grows (Dynamo's frames for a function, as more are compiled): a
#: write replaces the entry. For every other kind the key names the content, and the first writer wins.
REPLACED_KINDS = frozenset({"dynamo_frames"})


ABSENT = "absent"
"""No entry under this key in this tier."""
EVICTED = "evicted"
"""The entry's record is there but its blob was evicted (the server ran out of memory)."""
OTHER_KEY_ID = "other_key_id"
"""The entry exists, signed with another key (another secret or key pair): this job cannot use it."""
REJECTED = "rejected"
"""The entry failed verification (bad signature or checksum, damaged chunks): never handed to torch."""
OTHER_NAMESPACE = "other_namespace"
"""The entry exists for another namespace (torch version, CPU ISA, Python ABI, GPU arch, user namespace)."""
SKIPPED = "skipped"
"""The tier was not asked: its circuit breaker is open, it is off, or the lookup failed (timeout, error)."""

MISS_REASONS = (ABSENT, EVICTED, OTHER_KEY_ID, REJECTED, OTHER_NAMESPACE, SKIPPED)
"""Why a lookup missed, from the most to the least common in a healthy fleet."""


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    """A value found in ``tier``; ``cost_s`` is what producing it cost (for "seconds saved")."""

    value: bytes
    tier: str
    cost_s: float = 0.0

    reason: ClassVar[None] = None

    def __bool__(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Miss:
    """No usable value: ``reason`` is one of :data:`MISS_REASONS`, ``detail`` says more in words
    (e.g. ``breaker open``, ``signed with key 3fa9c2e1``)."""

    reason: str
    tier: str
    detail: str = ""

    value: ClassVar[None] = None

    def __bool__(self) -> bool:
        return False


Lookup = Union[Hit, Miss]
"""What :meth:`Storage.get` answers."""


@runtime_checkable
class Storage(Protocol):
    """A byte store keyed by artifact kind and key: each tier, a read-only view of one, and the
    tiered store built from them."""

    name: str
    """Short name used in stats: ``local``, ``remote`` (a tiered store: ``store``)."""

    def get(self, kind: str, key: str) -> Lookup:
        """A :class:`Hit`, or a :class:`Miss` that says why. Never raises: an error is a miss
        (``skipped``), counted in the stats."""
        ...

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0) -> bool:
        """Store ``value``; ``cost_s`` is what producing it cost (for "seconds saved").

        Returns:
            True if stored (or already present), False if the tier refused or failed (counted).
        """
        ...


class ReadOnly:
    """``storage`` that never writes: ``put`` is refused (counted as ``dropped``), ``get`` passes
    through. What ``WARMSTART_CACHE_MODE=ro`` and a verify-only key make of a tier."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.name = storage.name

    def get(self, kind: str, key: str) -> Lookup:
        return self.storage.get(kind, key)

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0) -> bool:
        stats = getattr(self.storage, "stats", None)
        if stats is not None:
            stats.add(self.name, kind, dropped=1)
        return False

    @property
    def stats(self):  # the wrapped tier's counters, so a store can share one set across tiers
        return self.storage.stats

    @stats.setter
    def stats(self, stats) -> None:
        self.storage.stats = stats

    def __getattr__(self, name: str):  # stats, close, directory, ... of the wrapped tier
        return getattr(self.storage, name)


class StoreObserver(Protocol):
    """What a store tells the rest of warmstart about its work (the metrics package attaches one
    that turns waits on the shared tier into ETT spans). Implementations must be cheap and must
    not raise."""

    def waiting(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """Wraps the time a lookup waits on a shared (remote) tier."""
        ...

    def looked_up(self, kind: str, key: str, result: Lookup) -> None:
        """Called once per store lookup with its outcome."""
        ...

    # Optional: ``waiting_on_peer(kind)``, a context manager wrapping the time a lookup waits for
    # another process that is compiling the entry (single-flight); observers without it are skipped.


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time ``cause`` comes up in this process, at debug level
    after that. A cache fault never fails a job, and costs its log one line, not one per lookup."""
    with _warned_lock:
        first = cause not in _warned
        _warned.add(cause)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args)
