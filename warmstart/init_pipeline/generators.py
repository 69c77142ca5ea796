"""Keep a helper thread's random draws out of the job's: torch's random generators are global.

The start-up graph compiles the dense part in a thread (:class:`~warmstart.init_pipeline.CompileWarmup`)
while other stages build the model, initialize the embedding tables and load the checkpoint, which
restores the generators' states. Each of those draws from (or sets) the one global CPU generator, and
so may the warm-up: a module built with default initialization, random example inputs, a dropout in
the compiled forward. Interleaved, the warm-up's draws would change the model's initial weights and
the random stream training resumes with, differently from run to run.

:class:`GeneratorGuard` serializes the two sides and undoes the helper's draws: the stages whose draws
count run under :meth:`GeneratorGuard.exclusive`; the helper's draws run under
:meth:`GeneratorGuard.undone`, which puts every generator it could have used back as it was.
:func:`compiled_graphs_undone` does that for every graph Inductor compiled that runs on the calling
thread, so that the warm-up's compile (the long part) still overlaps the other stages and only its
graphs' runs (milliseconds) wait for them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["GeneratorGuard", "compiled_graphs_undone"]


class GeneratorGuard:
    """One start-up's lock on torch's global random generators (the CPU one and ``device``'s)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """For a stage whose draws, or whose setting of the generators, count: no helper draws meanwhile."""
        with self._lock:
            yield

    @contextlib.contextmanager
    def undone(self) -> Iterator[None]:
        """For a helper's draws: the generators are left as they were before the block."""
        with self._lock:
            cpu = torch.get_rng_state()
            device_module, index = self._device_generator()
            state = device_module.get_rng_state(index) if device_module is not None else None
            try:
                yield
            finally:
                torch.set_rng_state(cpu)
                if device_module is not None:
                    device_module.set_rng_state(state, index)

    def _device_generator(self) -> tuple[Any, int]:
        if self.device.type in ("cpu", "meta"):
            return None, 0
        module = torch.get_device_module(self.device.type)
        index = self.device.index if self.device.index is not None else module.current_device()
        return module, index


_thread = threading.local()


@contextlib.contextmanager
def compiled_graphs_undone(guard: GeneratorGuard) -> Iterator[None]:
    """Run every Inductor-compiled graph that the calling thread runs in the block under
    ``guard.undone()``: the draws of a compiled forward or backward (dropout) change nothing else.

    Eager code between graphs (after a graph break) is not covered; neither is a backward that
    autograd runs on a device thread of its own (GPUs), which rarely draws.
    """
    if not _wrap_compiled_graphs():  # a torch without it: the whole block waits and is undone
        with guard.undone():
            yield
        return
    previous = getattr(_thread, "guard", None)
    _thread.guard = guard
    try:
        yield
    finally:
        _thread.guard = previous


_wrap_lock = threading.Lock()
_wrapped: bool | None = None


def _wrap_compiled_graphs() -> bool:
    global _wrapped
    with _wrap_lock:
        if _wrapped is None:
            _wrapped = _wrap()
        return _wrapped


def _wrap() -> bool:
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return False
    original = CompiledFxGraph.__call__

    @functools.wraps(original)
    def __call__(self, inputs):
        guard = getattr(_thread, "guard", None)
        if guard is None:
            return original(self, inputs)
        with guard.undone():
            return original(self, inputs)

    CompiledFxGraph.__call__ = __call__  # type: ignore[method-assign]
    return True
