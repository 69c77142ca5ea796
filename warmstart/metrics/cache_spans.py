"""ETT spans for the compile cache: a store observer that records its waits on the shared tier.

The compile cache reports what it does to observers (``warmstart.compile_cache.storage.StoreObserver``)
and imports nothing from the metrics; this is the one the metrics package attaches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from warmstart.metrics.buckets import CACHE_FETCH, CACHE_WAIT, COMPILE, SHARDING_PLAN
from warmstart.metrics.recorder import existing_recorder

if TYPE_CHECKING:
    from warmstart.compile_cache.storage import Lookup


class CacheSpans:
    """Turns each wait on the shared (remote) cache tier into a ``cache_fetch`` span, in the bucket of
    the work the fetch stands in for (``sharding_plan`` for plans, else ``compile``): the buckets stay
    what they are, and the timeline shows how much of a compile was waiting on the cache.

    Spans go to the process's recorder only if it already has one: Inductor's compile workers read the
    cache too, and must not start recording (their exit would then speak for the job's attempt).

    Example:
        >>> from warmstart.compile_cache import add_observer
        >>> add_observer(CacheSpans())
    """

    def waiting(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """Record a ``cache_fetch`` span around the body (nothing without a recorder)."""
        return _span(CACHE_FETCH, SHARDING_PLAN if kind == SHARDING_PLAN else COMPILE)

    def waiting_on_peer(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """Record a ``cache_wait`` span, in the ``compile`` bucket, around a wait for another process
        that is compiling the entry this one missed."""
        return _span(CACHE_WAIT, SHARDING_PLAN if kind == SHARDING_PLAN else COMPILE)

    def looked_up(self, kind: str, key: str, result: Lookup) -> None:
        """Nothing: a lookup's outcome is the cache's own statistics, not an ETT event."""


@contextlib.contextmanager
def _span(name: str, bucket: str) -> Iterator[None]:
    recorder = existing_recorder()
    if recorder is None:
        yield
        return
    recorder.begin(name, bucket)
    try:
        yield
    finally:
        recorder.end(name, bucket)
