"""torchrun's restarts without the random delay meant for its first join.

torchrun's c10d and etcd-v2 rendezvous (``DynamicRendezvousHandler``, which ``--standalone`` uses too)
wait a random 0-0.3 s before joining while the rendezvous is in its first round, to spread the
nodes' first joins over the store. A job's first restart is still in that round when it checks (the
round advances only once every node has left it), so the first restart waits as well, while every
later restart rejoins at once. In a torchrun whose environment has ``WARMSTART=1``, a handler that
has joined before rejoins at once on every restart; the first join keeps its delay.
``warmstart`` applies :func:`patch` when torch's ``dynamic_rendezvous`` module is imported.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["patch", "skipped_delays"]

log = logging.getLogger("warmstart.rendezvous")

_rejoining = threading.local()
_skipped = 0


def skipped_delays() -> int:
    """How many rejoins in this process skipped the first-join delay."""
    return _skipped


def patch(module: ModuleType) -> None:
    """Make ``module`` (torch's ``dynamic_rendezvous``) rejoin at once on a restart; once per process,
    and not at all on a torch whose rendezvous lacks what this replaces."""
    handler_cls = getattr(module, "DynamicRendezvousHandler", None)
    delay = getattr(module, "_delay", None)
    if handler_cls is None or not callable(delay):  # another torch: its rendezvous as it is
        log.debug("warmstart: torch's dynamic rendezvous has no _delay to skip on restarts")
        return
    if getattr(handler_cls.next_rendezvous, "_warmstart_rejoins_at_once", False):
        return
    original = handler_cls.next_rendezvous

    @functools.wraps(original)
    def next_rendezvous(self: Any) -> Any:
        _rejoining.active = getattr(self, "_warmstart_joined", False)
        try:
            info = original(self)
        finally:
            _rejoining.active = False
        self._warmstart_joined = True
        return info

    next_rendezvous._warmstart_rejoins_at_once = True  # type: ignore[attr-defined]
    handler_cls.next_rendezvous = next_rendezvous
    module._delay = _skipped_on_rejoin(delay)  # type: ignore[attr-defined]


def _skipped_on_rejoin(delay: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(delay)
    def _delay(*args: Any, **kwargs: Any) -> None:
        # The random form (a range) is the first-join spread; a fixed delay (the one-second poll
        # while other nodes sync) is kept, and so is any call of a form this does not know: torch's.
        seconds = kwargs.get("seconds", args[0] if args else None)
        if isinstance(seconds, tuple) and len(seconds) == 2 and getattr(_rejoining, "active", False):
            global _skipped
            _skipped += 1
            log.info("warmstart: torchrun rejoins its rendezvous at once (no random delay of up to %s s)", seconds[1])
            return
        delay(*args, **kwargs)

    return _delay
