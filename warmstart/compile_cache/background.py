"""Background compiles (``WARMSTART_COMPILE=background``): train eagerly while a worker compiles.

With the mode on, a function or module given to ``torch.compile`` (``nn.Module.compile()`` included)
runs eagerly from its first call, and a compile worker, another process (handed to the preloader
where one serves this environment, like any ``python`` start), compiles the same code on inputs of
the first call's shapes, dtypes, strides, devices and ``requires_grad``, with the same backend and
options, forward and backward, writing everything through the shared store. When the worker has
finished, the next call runs the compiled code: the warm path, every graph and kernel read from the
store (with compiled frames on, Dynamo's frames too, so nothing is traced).

Of the processes on one host that call the same code with the same inputs, one starts the worker:
it holds a lock file (``flock``) in the local cache directory, handed to the worker, so that the
lock lasts as long as the worker; the others see the lock taken and switch when the worker's
``.done`` file appears, or start a worker themselves if the lock is free again without one (its
worker died). Processes on other hosts start their own, whose compiles are single-flight through the
store.

Never worse than inline: when the worker cannot be built for the code (a backend given as an object,
a module or function pickle cannot carry, a class defined in ``__main__``, lazy modules, parameters
over ``MAX_WORKER_BYTES``), or when it fails or is killed, one info line, and the next call compiles
inline as torch would.

Recompiles after the switch (a new shape, a guard that fails) follow the same path: a call whose
start Dynamo would compile anew is stopped there, before any of it runs (``recompile_probe``), runs
eagerly, and a worker replays the calls that compiled so far and then this one; a recompile further
into a call is torch's, inline, so that no part of a call runs twice.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache.background_job import TensorSpec, start_time

log = logging.getLogger("warmstart.cache")

#: The largest module (parameters and buffers) a worker is given a copy of; above it the code
#: compiles inline. The worker holds one copy of them in memory while it compiles.
MAX_WORKER_BYTES = 2 << 30

#: How often a process that did not start the worker looks for its ``.done`` file.
_POLL_S = 0.25

#: The environment variable that tells a worker it is one (no ETT events of its own, no background;
#: read in ``warmstart.config``).
WORKER_ENV = "WARMSTART_COMPILE_WORKER"


def mode(environ: Mapping[str, str] | None = None) -> str:
    """``WARMSTART_COMPILE`` of ``environ`` (default this process's): ``inline`` or ``background``.

    Raises:
        ConfigError: another value.
    """
    from warmstart.config import compile_mode_setting

    return compile_mode_setting(environ)


def hook_torch_compile(torch_module: Any) -> None:
    """Wrap ``torch.compile`` so that, in background mode, what it returns runs eagerly until a worker
    has compiled it (see the module's docstring). In inline mode the wrapper only calls torch's."""
    original = torch_module.compile

    @functools.wraps(original)
    def compile(model=None, **kwargs):  # noqa: A001 (torch's own name)
        if model is None:  # the decorator form: torch.compile(mode=...)(fn)
            return lambda fn: compile(fn, **kwargs)
        compiled = original(model, **kwargs)
        try:
            if mode() == "background":
                return _wrap(model, compiled, kwargs)
        except Exception as exc:
            from warmstart.compile_cache.storage import fail_open

            fail_open("background compile", exc)
        return compiled

    compile.__wrapped__ = original
    torch_module.compile = compile


def state_of(compiled: Any) -> Background | None:
    """The :class:`Background` behind what ``torch.compile`` returned in background mode, else ``None``."""
    forward = getattr(compiled, "forward", None)
    for candidate in (compiled, forward, getattr(compiled, "_compiled_call_impl", None)):
        found = getattr(candidate, "_warmstart_background", None)
        if found is not None:
            return found
    return None


def _wrap(model: Any, compiled: Any, kwargs: dict[str, Any]) -> Any:
    reason = _not_eligible(model, kwargs)
    optimized_module = torch_internals.resolve("OptimizedModule")
    if optimized_module is not None and isinstance(compiled, optimized_module):
        if reason is None and hasattr(model, "_initialize_hook"):  # torch's own test for lazy modules
            reason = "a module with lazy parameters"
        state = Background(_describe(model), model, kwargs, eager=model.__call__, compiled=compiled.forward)
        if reason is not None:
            state.inline(reason)
        compiled.forward = state.call_function()
        return compiled
    eager = model
    state = Background(_describe(model), model, kwargs, eager=eager, compiled=compiled)
    if reason is not None:
        state.inline(reason)
    return functools.wraps(compiled)(state.call_function())


def _not_eligible(model: Any, kwargs: dict[str, Any]) -> str | None:
    import torch

    backend = kwargs.get("backend", "inductor")
    if not isinstance(backend, str):
        return "a backend given as an object (a worker compiles with backends named by a string)"
    if kwargs.get("disable"):
        return "torch.compile(disable=True)"
    target = getattr(model, "__self__", model)  # nn.Module.compile() compiles its bound _call_impl
    if not isinstance(target, torch.nn.Module) and not hasattr(target, "__code__"):
        return f"a {type(target).__name__}, which is neither a module nor a function"
    cls = type(target) if isinstance(target, torch.nn.Module) else target
    if getattr(cls, "__module__", None) == "__main__":
        return "defined in __main__ (a worker cannot import it)"
    if getattr(cls, "__qualname__", "").count("<locals>"):
        return "defined inside a function (a worker cannot import it)"
    return None


def _describe(model: Any) -> str:
    target = getattr(model, "__self__", model)
    cls = type(target) if not hasattr(target, "__code__") else target
    return getattr(cls, "__qualname__", type(target).__name__)


class Background:
    """One compiled function or module in background mode: eager until its worker's entries are in
    the store, then compiled. ``phase`` is ``eager``, ``compiled``, ``recompiling`` (compiled, but the
    calls that would make Dynamo compile anew run eagerly while a worker compiles them) or ``inline``
    (compiled by torch at its next call, the worker not used); ``last_call`` says how the last call
    ran: ``eager``, ``compiled`` or ``inline``."""

    def __init__(self, name: str, model: Any, kwargs: dict[str, Any], *, eager: Any, compiled: Any) -> None:
        self.name = name
        self.phase = "eager"
        self.last_call = "eager"
        self.eager_calls = 0
        self.recompiles = 0
        """Recompiles (a new shape, a guard failure) that a worker compiled before this process ran them."""
        self.worker_pid: int | None = None
        self._noted_other_worker = False
        self.switched_after_s: float | None = None
        self._model, self._kwargs = model, kwargs
        self._eager, self._compiled = eager, compiled
        self._started: float | None = None
        self._worker: subprocess.Popen | None = None
        self._key: str | None = None
        self._dir: Path | None = None
        self._next_poll = 0.0
        self._lock = threading.Lock()
        #: The input specs of each call that made Dynamo compile, in order, the pending one last: a
        #: worker replays them all, so that its Dynamo decides as the job's did (shapes it marks dynamic).
        self._calls: list[Any] = []
        self._pending: Any = None
        self._pending_repr: str | None = None
        #: The code object Dynamo intercepts first at each call (the function's, or the module's
        #: ``forward``): a recompile of it at the start of a call is followed (see ``_call_compiled``).
        self._code = _entry_code(model)

    def call_function(self) -> Any:
        def call(*args, **kwargs):
            return self(*args, **kwargs)

        call._warmstart_background = self  # type: ignore[attr-defined]
        return call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.phase in ("compiled", "recompiling"):
            return self._call_compiled(args, kwargs)
        if self.phase == "inline":
            self.last_call = "inline"
            return self._compiled(*args, **kwargs)
        with self._lock:
            if self.phase == "eager":
                try:
                    self._advance(args, kwargs)
                except Exception as exc:
                    self.inline(f"warmstart's part failed ({type(exc).__name__}: {exc})")
        if self.phase != "eager":
            self.last_call = "inline" if self.phase == "inline" else "compiled"
            return self._compiled(*args, **kwargs)
        self.eager_calls += 1
        self.last_call = "eager"
        return self._eager(*args, **kwargs)

    def inline(self, reason: str) -> None:
        """Compile at the next call, as torch would; one info line says why."""
        self.phase = "inline"
        log.info("warmstart: %s compiles inline: %s", self.name, reason)

    # -- the first calls -----------------------------------------------------------------------

    def _advance(self, args: tuple, kwargs: dict) -> None:
        if self._key is None:
            self._start(args, kwargs)
            return
        outcome = self._progress()
        if outcome == "done":
            self._switch()
        elif outcome is not None:
            self.inline(outcome)

    def _start(self, args: tuple, kwargs: dict) -> None:
        from warmstart.compile_cache import get_store
        from warmstart.config import Settings

        store = get_store()
        if store is None:
            self.inline("the compile cache is off in this process")
            return
        self._calls = [_specs(args, kwargs)]
        self._key = _key(self._model, self._kwargs, self._calls)
        self._dir = Settings.from_env().cache_dir / "background"
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._started = time.monotonic()
        if self._done() or store.get("background_compile", self._key).value is not None:
            self._switch()  # compiled before, here or on another machine: the warm path
            return
        if self._lock_held_elsewhere():
            self._note_other_worker()
            return
        outcome = self._launch()
        if outcome == "done":
            self._switch()
        elif outcome is not None:
            self.inline(outcome)

    def _switch(self) -> None:
        self.phase = "compiled"
        self.switched_after_s = time.monotonic() - (self._started or time.monotonic())
        if self.eager_calls:
            _record_switch()
        log.info(
            "warmstart: %s runs compiled from now on (after %d eager calls, %.1f s)",
            self.name,
            self.eager_calls,
            self.switched_after_s,
        )

    # -- recompiles ------------------------------------------------------------------------------

    def _call_compiled(self, args: tuple, kwargs: dict) -> Any:
        """A call after the switch. It runs compiled with a probe on: if Dynamo would compile anew at
        the call's start (a new shape, a guard that fails), the probe stops it there, before any of
        the call has run, and the call runs eagerly while a worker compiles those inputs; once the
        worker is done, the next such call compiles from the store. Anything else runs as torch runs
        it: a recompile further into a call (after a graph break) is compiled inline."""
        code = self._code if _no_module_hooks(self._model) else None
        if code is not None:
            pending = self._pending_repr
            spec = _specs(args, kwargs) if pending is not None else None
            # The inputs a worker compiles now run eagerly without asking Dynamo again: each stopped
            # recompile counts toward its limit on compiles of a function (256), after which it would
            # run that function eagerly for good.
            if spec is None or repr(spec) != pending:
                outer = getattr(_probe, "code", None)
                _probe.code = code
                try:
                    result = self._compiled(*args, **kwargs)
                except Exception as exc:
                    if not getattr(exc, "_warmstart_probe", False):
                        raise
                else:
                    self.last_call = "compiled"
                    return result
                finally:
                    _probe.code = outer
            with self._lock:
                try:
                    ready = self._recompile(spec if spec is not None else _specs(args, kwargs))
                except Exception as exc:
                    self._recompile_inline(f"warmstart's part failed ({type(exc).__name__}: {exc})")
                    ready = True
            if not ready:
                self.eager_calls += 1
                self.last_call = "eager"
                return self._eager(*args, **kwargs)
        self.last_call = "compiled"
        return self._compiled(*args, **kwargs)

    def _recompile(self, spec: Any) -> bool:
        """Where the compile of a call whose inputs ``spec`` would make Dynamo compile anew stands:
        ``True`` when the call may compile now (a worker stored it, or it is to compile inline)."""
        if self._code is None:
            return True
        outcome: str | None
        if self._pending is not None and self._pending_repr != repr(spec):
            # Other inputs than those a worker compiles: once it is done, they are compiled (the
            # job's next call with them finds them in the store); until then these run eagerly too.
            outcome = self._progress()
            if outcome is None:
                return False
            if outcome != "done":
                self._recompile_inline(outcome)
                return True
            self._calls.append(self._pending)
            self._pending = self._pending_repr = None
        if self._pending is None:
            self._pending, self._pending_repr = spec, repr(spec)
            self._key = _key(self._model, self._kwargs, [*self._calls, spec])
            self._worker, self._next_poll, self._noted_other_worker = None, 0.0, False
            from warmstart.compile_cache import get_store

            store = get_store()
            if store is None:
                self._recompile_inline("the compile cache is off in this process")
                return True
            if self._done() or store.get("background_compile", self._key).value is not None:
                outcome = "done"
            elif self._lock_held_elsewhere():
                self._note_other_worker()
                outcome = None
            else:
                outcome = self._launch()
        else:
            outcome = self._progress()
        if outcome is None:
            self.phase = "recompiling"
            return False
        if outcome != "done":
            self._recompile_inline(outcome)
            return True
        self._calls.append(spec)
        self._pending = self._pending_repr = None
        self.phase = "compiled"
        self.recompiles += 1
        _record_switch()
        log.info("warmstart: %s recompiles from what its worker stored (recompile %d)", self.name, self.recompiles)
        return True

    def _recompile_inline(self, reason: str) -> None:
        self._code, self._pending, self._pending_repr, self.phase = None, None, None, "compiled"
        log.info("warmstart: %s recompiles inline from now on: %s", self.name, reason)

    # -- the worker ------------------------------------------------------------------------------

    def _progress(self) -> str | None:
        """Where the compile of ``self._key`` stands: ``"done"``, ``None`` while it runs, else why it
        failed (for an info line)."""
        if self._worker is not None:
            status = self._worker.poll()
            if status is None:
                return None
            self._worker = None
            if status != 0 or not self._done():
                return f"its compile worker (pid {self.worker_pid}) ended with status {status}"
            return "done"
        if time.monotonic() < self._next_poll:
            return None
        self._next_poll = time.monotonic() + _POLL_S
        if self._done():
            return "done"
        if not self._lock_held_elsewhere():
            return self._launch()  # the worker another process started is gone without a result
        return None

    def _launch(self) -> str | None:
        """Start a worker for ``self._calls`` (with the pending call): ``None`` when one runs now (this
        process's, or another's that took the lock first), ``"done"`` when the result is there, else
        why no worker can compile the code."""
        assert self._dir is not None and self._key is not None
        lock = os.open(self._dir / f"{self._key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # Another process took it between this one's look at the lock and now: its worker's
                # result is awaited, as when the look had found it taken.
                self._note_other_worker()
                return None
            if self._done():
                return "done"
            calls = [*self._calls, self._pending] if self._pending is not None else self._calls
            try:
                payload = _payload(self._model, self._kwargs, calls)
            except ValueError as exc:
                return str(exc)
            fd, payload_path = tempfile.mkstemp(prefix=f"{self._key}-", suffix=".job", dir=self._dir)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            env = {
                **os.environ,
                WORKER_ENV: "1",
                "WARMSTART_COMPILE": "inline",
                "WARMSTART_COMPILE_WORKER_JOB": f"{os.getpid()}:{start_time(os.getpid())}",
            }
            self._worker = subprocess.Popen(
                [sys.executable, "-m", "warmstart.compile_cache.background_worker", payload_path],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # its errors, on stderr, are the job's to see
                pass_fds=(lock,),
                close_fds=True,
            )
            self.worker_pid = self._worker.pid
            log.info(
                "warmstart: %s runs eagerly while a compile worker (pid %d) compiles it",
                self.name,
                self.worker_pid,
            )
            return None
        finally:
            os.close(lock)  # the worker holds the lock from here on

    def _note_other_worker(self) -> None:
        if not self._noted_other_worker:
            self._noted_other_worker = True
            log.info("warmstart: %s runs eagerly while another process's worker compiles it", self.name)

    def _done(self) -> bool:
        assert self._dir is not None
        return (self._dir / f"{self._key}.done").exists()

    def _lock_held_elsewhere(self) -> bool:
        assert self._dir is not None
        path = self._dir / f"{self._key}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False


#: The code object whose recompile this thread's current call stops (``Background._call_compiled``).
_probe = threading.local()


def recompile_probe(code: CodeType | None) -> BaseException | None:
    """Called by Dynamo's recompile path (hooked in ``torch_hooks``) before it compiles ``code`` anew:
    the exception that stops it, when the calling thread's background-compiled call probes ``code``
    and nothing of that call has run yet (no frame but torch's and warmstart's between the call and
    Dynamo), else ``None``."""
    if code is None or getattr(_probe, "code", None) is not code:
        return None
    torch_dir, stdlib_dir, here = _internal_dirs()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not _CALL_COMPILED_CODE:
        filename = frame.f_code.co_filename
        internal = filename.startswith((torch_dir, here)) or (
            filename.startswith(stdlib_dir) and "-packages" not in filename
        )
        if not internal:
            return None  # a recompile further into the call: part of it ran, so it must finish as torch runs it
        frame = frame.f_back
    if frame is None:
        return None
    recompile_error = torch_internals.resolve("RecompileError")
    if recompile_error is None:
        return None
    name = getattr(code, "co_name", "?")
    stop = recompile_error(f"warmstart: {name} would recompile; a background worker compiles it")
    stop._warmstart_probe = True
    return stop


def _entry_code(model: Any) -> Any:
    target = getattr(model, "__self__", model)
    forward = getattr(type(target), "forward", None) if hasattr(target, "_modules") else None
    function = forward if forward is not None else target
    return getattr(function, "__code__", None)


def _no_module_hooks(model: Any) -> bool:
    # Module hooks run before Dynamo sees ``forward``: a call stopped there, then run eagerly, would
    # run them twice.
    target = getattr(model, "__self__", model)
    if not hasattr(target, "_forward_pre_hooks"):
        return True
    from torch.nn.modules import module as nn_module

    return not (
        target._forward_pre_hooks
        or target._forward_hooks
        or target._backward_pre_hooks
        or target._backward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_backward_pre_hooks
        or nn_module._global_backward_hooks
    )


def _record_switch() -> None:
    # The moment this rank starts running the worker's compile, for the ETT report: a span of no
    # length (the install that follows is the compile spans' time, the eager steps before it training).
    from warmstart.metrics import get_recorder
    from warmstart.metrics.buckets import COMPILE, COMPILE_SWITCH

    rec = get_recorder()
    rec.begin(COMPILE_SWITCH, bucket=COMPILE)
    rec.end(COMPILE_SWITCH, bucket=COMPILE)


def _payload(model: Any, compile_kwargs: dict[str, Any], calls: list[Any]) -> bytes:
    """What a worker needs, pickled: the code (the module, a copy of its parameters and buffers, or the
    function by reference), how torch.compile was called, and the input specs of each call to replay.

    Raises:
        ValueError: the worker cannot be given this code (the caller compiles inline).
    """
    import torch

    target = getattr(model, "__self__", model)
    if isinstance(target, torch.nn.Module):
        size = sum(t.numel() * t.element_size() for t in (*target.parameters(), *target.buffers()))
        if size > MAX_WORKER_BYTES:
            raise ValueError(f"parameters and buffers of {size / 2**30:.1f} GiB, over the worker's bound")
    how = "module_compile" if getattr(model, "__name__", "") == "_call_impl" else "torch_compile"
    code = {
        "target": target,
        "how": how,
        "compile_kwargs": compile_kwargs,
        "calls": calls,
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
    }
    try:
        pickled = pickle.dumps(code)
    except Exception as exc:
        raise ValueError(f"the worker cannot be given it: {type(exc).__name__}: {exc}") from exc
    # Where to import the code from comes first: the worker can unpickle it only from there.
    return pickle.dumps({"sys_path": list(sys.path), "cwd": os.getcwd(), "code": pickled})


def _specs(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """A call's inputs with each tensor replaced by its :class:`TensorSpec` (other values as they are)."""
    import torch

    tree_map = torch_internals.require("tree_map")

    def spec(value: Any) -> Any:
        return _spec(value) if isinstance(value, torch.Tensor) else value

    return tree_map(spec, args), tree_map(spec, kwargs)


def _spec(tensor: Any) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), tensor.stride(), tensor.dtype, str(tensor.device), tensor.requires_grad)


def _key(model: Any, compile_kwargs: dict[str, Any], calls: list[Any]) -> str:
    """One key per code, structure, sequence of input specs and way of compiling, the same in every
    process that runs the same code (the parameters' values, which a compile does not read, are not
    in it)."""
    import torch

    target = getattr(model, "__self__", model)
    parts: list[str] = [torch.__version__, repr(sorted(compile_kwargs.items(), key=lambda kv: kv[0]))]
    if isinstance(target, torch.nn.Module):
        cls = type(target)
        parts += [cls.__module__, cls.__qualname__, repr(target), getattr(model, "__name__", "")]
        for module in target.modules():
            code = getattr(type(module).forward, "__code__", None)
            if code is not None:
                parts.append(hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest())
        parts += [
            f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
            for name, t in (*target.named_parameters(), *target.named_buffers())
        ]
    else:
        code = target.__code__
        parts += [target.__module__, target.__qualname__, hashlib.sha256(code.co_code).hexdigest()]
    parts += [repr(call) for call in calls]
    parts.append(str(torch.is_grad_enabled()))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


_CALL_COMPILED_CODE = Background._call_compiled.__code__


@functools.cache
def _internal_dirs() -> tuple[str, str, str]:
    """Where the frames between a probed call and Dynamo's recompile path come from: torch, the
    standard library (without its site-packages) and warmstart's compile cache, none of which runs
    the call's own code."""
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir, stdlib_dir = (os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep for m in (torch, os))
    return torch_dir, stdlib_dir, here + os.sep
