"""How a save runs (``AsyncMode``): a module of its own, without torch, so that command lines can offer
the modes without importing the checkpointer."""

from __future__ import annotations

from enum import Enum

from warmstart.errors import ConfigError


class AsyncMode(str, Enum):
    """How a save runs: ``SYNC`` blocks until written; ``ASYNC`` stages to CPU memory and writes in
    a background thread; ``ASYNC_PROCESS`` stages to shared memory and writes in a separate process
    (no GIL contention with training; the process starts on the first save)."""

    SYNC = "sync"
    ASYNC = "async-thread"
    ASYNC_PROCESS = "async-process"

    @classmethod
    def parse(cls, value: AsyncMode | str) -> AsyncMode:
        """The mode named by ``value``.

        Raises:
            ConfigError: ``value`` is not one of the modes.
        """
        try:
            return cls(value)
        except ValueError:
            raise ConfigError("mode", value, "one of " + ", ".join(m.value for m in cls)) from None
