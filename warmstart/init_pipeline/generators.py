"""Keep a helper thread's random draws out of the job's: torch's random generators are global.

The start-up graph compiles the dense part in a thread (:class:`~warmstart.init_pipeline.CompileWarmup`)
while other stages build the model, initialize the embedding tables and load the checkpoint, which
restores the generators' states. Each of those draws from (or sets) the one global CPU generator, and
so may the warm-up: a module built with default initialization, random example inputs, a dropout in
the compiled forward, eager code between two compiled graphs. And torch's compiler sets them too:
Dynamo saves the generators' states when it starts compiling a frame and puts them back when it ends,
as Inductor does around its code generation, to undo what tracing drew. Interleaved, either would
change the model's initial weights, or rewind the random stream training resumes with, differently
from run to run.

:class:`GeneratorGuard` serializes the two sides. The stages whose draws count run under
:meth:`GeneratorGuard.exclusive`. The helper runs under :func:`undone_except_compiles`: it holds the
guard and puts every generator back as it was, except while torch compiles (the long part, which draws
nothing): then the job's states are back in place, the guard is free for the stages, and the compile's
own putting back of the generators is skipped on the helper's thread. When the compile ends, the helper
waits for the guard again and goes on with its own states.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from warmstart import torch_internals

__all__ = ["GeneratorGuard", "undone_except_compiles"]

log = logging.getLogger(__name__)


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
            states = self._states()
            try:
                yield
            finally:
                self._set_states(states)

    def _states(self) -> tuple[torch.Tensor, Any]:
        module, index = self._device_generator()
        return torch.get_rng_state(), module.get_rng_state(index) if module is not None else None

    def _set_states(self, states: tuple[torch.Tensor, Any]) -> None:
        torch.set_rng_state(states[0])
        module, index = self._device_generator()
        if module is not None:
            module.set_rng_state(states[1], index)

    def _device_generator(self) -> tuple[Any, int]:
        if self.device.type in ("cpu", "meta"):
            return None, 0
        module = torch.get_device_module(self.device.type)
        index = self.device.index if self.device.index is not None else module.current_device()
        return module, index


class _Hold:
    """A helper's hold on a guard, which it lends while torch compiles: the job's generator states to
    put back and, while lent, the helper's own."""

    def __init__(self, guard: GeneratorGuard) -> None:
        self.guard = guard
        self.lent = False
        self._job: tuple[torch.Tensor, Any] | None = None
        self._helper: tuple[torch.Tensor, Any] | None = None

    def take(self) -> None:
        self.guard._lock.acquire()
        self._job = self.guard._states()

    def give_back(self) -> None:
        """The end of the helper's block: the job's states return and the guard is free."""
        if self.lent:
            self.take_again()
        try:
            assert self._job is not None
            self.guard._set_states(self._job)
        finally:
            self.guard._lock.release()

    def lend(self) -> None:
        """Before a compile: the job's states return and the guard is free until :meth:`take_again`."""
        assert self._job is not None
        helper = self.guard._states()
        self.guard._set_states(self._job)
        self.guard._lock.release()
        if self.guard._lock._is_owned():  # type: ignore[attr-defined]  # held twice on this thread: keep it
            self.guard._lock.acquire()
            self.guard._set_states(helper)
            return
        self._helper, self.lent = helper, True

    def take_again(self) -> None:
        """After a compile: wait for the guard, note where the job's draws got to, resume the helper's."""
        self.guard._lock.acquire()
        helper, self.lent, self._helper = self._helper, False, None
        self._job = self.guard._states()
        assert helper is not None
        self.guard._set_states(helper)


_thread = threading.local()


@contextlib.contextmanager
def undone_except_compiles(guard: GeneratorGuard) -> Iterator[None]:
    """Run a helper's block under ``guard.undone()``, except for what torch compiles in it (a frame
    Dynamo compiles, a backward compiled at its first run), which runs beside the stages that hold
    the guard.

    Everything the block runs eagerly or compiled (building a module and its inputs, the compiled
    graphs, eager code between them after a graph break, a backward on this thread) waits for the
    guard and is undone. Not covered: a compile that draws (autotuning on random inputs), and a
    backward that autograd runs on a device thread (GPUs), whose compile then holds the guard
    (slower, not wrong). On a torch without the hooks this needs, the whole block holds the guard.
    """
    if not _hooked():
        with guard.undone():
            yield
        return
    hold = _Hold(guard)
    previous = getattr(_thread, "hold", None)
    hold.take()
    _thread.hold = hold
    try:
        yield
    finally:
        _thread.hold = previous
        hold.give_back()


def _lent() -> bool:
    hold = getattr(_thread, "hold", None)
    return hold is not None and hold.lent


_hook_lock = threading.Lock()
_hooks_in_place: bool | None = None


def _hooked() -> bool:
    global _hooks_in_place
    with _hook_lock:
        if _hooks_in_place is None:
            try:
                _hook_frame_compiles()
                _hook_backward_compiles()
                _hook_generator_setters()
                _hooks_in_place = True
            except (torch_internals.MissingTorchInternal, AttributeError) as exc:
                # another torch: the helper holds the guard throughout
                log.debug("warmstart: cannot lend the generator guard during compiles: %s", exc)
                _hooks_in_place = False
        return _hooks_in_place


def _hook_frame_compiles() -> None:
    """Lend the guard for each frame Dynamo compiles on a helper's thread.

    It is lent when Dynamo starts converting a frame (``ConvertFrameAssert``, outside whatever wraps
    the compile itself; releasing never blocks) and taken again when Dynamo's frame callback returns,
    after it has let go of its ``compile_lock``: a stage that holds the guard and compiles something
    itself never waits for a helper that waits for the guard.
    """
    callback_cls = torch_internals.require("CatchErrorsWrapper")
    convert_cls = torch_internals.require("ConvertFrameAssert")
    original_call, original_convert = callback_cls.__call__, convert_cls.__call__

    @functools.wraps(original_call)
    def __call__(self, *args, **kwargs):
        hold = getattr(_thread, "hold", None)
        if hold is None:
            return original_call(self, *args, **kwargs)
        _thread.depth = getattr(_thread, "depth", 0) + 1
        try:
            return original_call(self, *args, **kwargs)
        finally:
            _thread.depth -= 1
            if _thread.depth == 0 and hold.lent:
                hold.take_again()

    @functools.wraps(original_convert)
    def convert(self, *args, **kwargs):
        hold = getattr(_thread, "hold", None)
        if hold is not None and not hold.lent and getattr(_thread, "depth", 0) > 0:
            hold.lend()
        return original_convert(self, *args, **kwargs)

    callback_cls.__call__ = __call__
    convert_cls.__call__ = convert


def _hook_backward_compiles() -> None:
    """Lend the guard while AOTAutograd compiles a backward at its first run on a helper's thread."""
    compiler_cls = torch_internals.require("AutogradBackwardCompiler")
    original = compiler_cls.get_or_compile

    @functools.wraps(original)
    def get_or_compile(self, *args, **kwargs):
        hold = getattr(_thread, "hold", None)
        if hold is None or hold.lent or self.compiled_bw is not None:
            return original(self, *args, **kwargs)
        hold.lend()
        try:
            return original(self, *args, **kwargs)
        finally:
            if hold.lent:
                hold.take_again()

    compiler_cls.get_or_compile = get_or_compile


def _hook_generator_setters() -> None:
    """Skip the putting back of the generators that a lent helper's compile does.

    Dynamo (``preserve_global_state``) and Inductor (``preserve_rng_state``) save the generators'
    states when they start and set them back when they end; on a helper's thread that would rewind
    the draws the stages made meanwhile. Only the module attributes they call are replaced
    (``torch.random.set_rng_state``, ``torch.cuda.set_rng_state``, ``torch.xpu.set_rng_state``, not
    ``torch.set_rng_state``), and they are torch's own everywhere but on a lent helper's thread.
    """
    modules = [torch.random] + [getattr(torch, name) for name in ("cuda", "xpu") if hasattr(torch, name)]
    for module in modules:
        original = getattr(module, "set_rng_state", None)
        if original is not None and not getattr(original, "_skipped_by_lent_helpers", False):
            module.set_rng_state = _skipped_while_lent(original)


def _skipped_while_lent(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_rng_state(*args: Any, **kwargs: Any) -> Any:
        if _lent():
            return None
        return original(*args, **kwargs)

    set_rng_state._skipped_by_lent_helpers = True  # type: ignore[attr-defined]
    return set_rng_state
