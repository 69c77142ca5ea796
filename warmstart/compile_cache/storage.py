"""The storage interface every tier implements, and the artifact kinds warmstart caches.

Read this first. A tier maps ``(kind, key)`` to bytes. ``get`` never raises: any failure is a miss
that is counted in the tier's stats with its reason. Only the tiered store decides about read-only
mode and background writes; tiers just store.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol, runtime_checkable

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
    "sharding_plan": "sharding plan",
}


@runtime_checkable
class Storage(Protocol):
    """A byte store keyed by artifact kind and key."""

    name: str
    """Short tier name used in stats: ``local`` or ``remote``."""

    def get(self, kind: str, key: str) -> bytes | None:
        """Return the value, or ``None`` on a miss or any error (counted, never raised)."""
        ...

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0) -> bool:
        """Store ``value``; ``cost_s`` is what producing it cost (for "seconds saved").

        Returns:
            True if stored (or already present), False if the tier refused or failed (counted).
        """
        ...


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time ``cause`` comes up in this process, at debug level
    after that. A cache fault never fails a job, and costs its log one line, not one per lookup."""
    with _warned_lock:
        first = cause not in _warned
        _warned.add(cause)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args)
