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
inline as torch would. Recompiles after the switch (a new shape, a guard failure) are torch's own,
inline.
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
from typing import Any

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

    return compile_mode_setting(os.environ if environ is None else environ)


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
    import torch

    reason = _not_eligible(model, kwargs)
    if isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
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
    the store, then compiled. ``phase`` is ``eager``, ``compiled`` or ``inline`` (compiled by torch
    at its next call, the worker not used)."""

    def __init__(self, name: str, model: Any, kwargs: dict[str, Any], *, eager: Any, compiled: Any) -> None:
        self.name = name
        self.phase = "eager"
        self.eager_calls = 0
        self.worker_pid: int | None = None
        self.switched_after_s: float | None = None
        self._model, self._kwargs = model, kwargs
        self._eager, self._compiled = eager, compiled
        self._started: float | None = None
        self._worker: subprocess.Popen | None = None
        self._key: str | None = None
        self._dir: Path | None = None
        self._next_poll = 0.0
        self._lock = threading.Lock()
        self._args: tuple | None = None  # the first call's inputs, kept until a worker is given them
        self._kwargs_of_call: dict | None = None

    def call_function(self) -> Any:
        def call(*args, **kwargs):
            return self(*args, **kwargs)

        call._warmstart_background = self  # type: ignore[attr-defined]
        return call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.phase != "eager":
            return self._compiled(*args, **kwargs)
        with self._lock:
            if self.phase == "eager":
                try:
                    self._advance(args, kwargs)
                except Exception as exc:
                    self.inline(f"warmstart's part failed ({type(exc).__name__}: {exc})")
        if self.phase != "eager":
            return self._compiled(*args, **kwargs)
        self.eager_calls += 1
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
        if self._worker is not None:
            status = self._worker.poll()
            if status is None:
                return
            self._worker = None
            if status != 0 or not self._done():
                self.inline(f"its compile worker (pid {self.worker_pid}) ended with status {status}")
                return
        elif time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + _POLL_S
        if self._done():
            self._switch()
        elif not self._lock_held_elsewhere():
            self._launch()  # the worker another process started is gone without a result

    def _start(self, args: tuple, kwargs: dict) -> None:
        from warmstart.compile_cache import get_store
        from warmstart.config import Settings

        store = get_store()
        if store is None:
            self.inline("the compile cache is off in this process")
            return
        self._args, self._kwargs_of_call = args, kwargs  # pickled only if this process starts a worker
        self._key = _key(self._model, self._kwargs, args, kwargs)
        self._dir = Settings.from_env().cache_dir / "background"
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._started = time.monotonic()
        if self._done() or store.get("background_compile", self._key).value is not None:
            self._switch()  # compiled before, here or on another machine: the warm path
            return
        if self._lock_held_elsewhere():
            log.info("warmstart: %s runs eagerly while another process's worker compiles it", self.name)
            return
        self._launch()

    def _launch(self) -> None:
        from warmstart.compile_cache.background_worker import start_time

        assert self._dir is not None and self._key is not None
        lock = os.open(self._dir / f"{self._key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another process took it first: its worker's result is awaited
            if self._done():
                self._switch()
                return
            try:
                payload = _payload(self._model, self._kwargs, self._args or (), self._kwargs_of_call or {})
            except ValueError as exc:
                self.inline(str(exc))
                return
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
        finally:
            os.close(lock)  # the worker holds the lock from here on

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

    def _switch(self) -> None:
        self.phase = "compiled"
        self._args = self._kwargs_of_call = None
        self.switched_after_s = time.monotonic() - (self._started or time.monotonic())
        if self.eager_calls:
            _record_switch()
        log.info(
            "warmstart: %s runs compiled from now on (after %d eager calls, %.1f s)",
            self.name,
            self.eager_calls,
            self.switched_after_s,
        )


def _record_switch() -> None:
    # The moment this rank starts running the worker's compile, for the ETT report: a span of no
    # length (the install that follows is the compile spans' time, the eager steps before it training).
    from warmstart.metrics import get_recorder
    from warmstart.metrics.buckets import COMPILE, COMPILE_SWITCH

    rec = get_recorder()
    rec.begin(COMPILE_SWITCH, bucket=COMPILE)
    rec.end(COMPILE_SWITCH, bucket=COMPILE)


def _payload(model: Any, compile_kwargs: dict[str, Any], args: tuple, kwargs: dict) -> bytes:
    """What a worker needs, pickled: the code (the module, a copy of its parameters and buffers, or the
    function by reference), how torch.compile was called, and the inputs' specs.

    Raises:
        ValueError: the worker cannot be given this code (the caller compiles inline).
    """
    import torch
    from torch.utils._pytree import tree_map

    target = getattr(model, "__self__", model)
    if isinstance(target, torch.nn.Module):
        size = sum(t.numel() * t.element_size() for t in (*target.parameters(), *target.buffers()))
        if size > MAX_WORKER_BYTES:
            raise ValueError(f"parameters and buffers of {size / 2**30:.1f} GiB, over the worker's bound")

    def spec(value: Any) -> Any:
        return _spec(value) if isinstance(value, torch.Tensor) else value

    how = "module_compile" if getattr(model, "__name__", "") == "_call_impl" else "torch_compile"
    code = {
        "target": target,
        "how": how,
        "compile_kwargs": compile_kwargs,
        "args": tree_map(spec, args),
        "kwargs": tree_map(spec, kwargs),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
    }
    try:
        pickled = pickle.dumps(code)
    except Exception as exc:
        raise ValueError(f"the worker cannot be given it: {type(exc).__name__}: {exc}") from exc
    # Where to import the code from comes first: the worker can unpickle it only from there.
    return pickle.dumps({"sys_path": list(sys.path), "cwd": os.getcwd(), "code": pickled})


def _spec(tensor: Any) -> _TensorSpec:
    return _TensorSpec(tuple(tensor.shape), tensor.stride(), tensor.dtype, str(tensor.device), tensor.requires_grad)


class _TensorSpec:
    """A tensor's shape, strides, dtype, device and ``requires_grad``, for a worker to make one alike."""

    def __init__(self, shape: tuple, stride: tuple, dtype: Any, device: str, requires_grad: bool) -> None:
        self.shape, self.stride, self.dtype, self.device, self.requires_grad = (
            shape,
            stride,
            dtype,
            device,
            requires_grad,
        )

    def make(self) -> Any:
        import torch

        empty = any(s == 0 for s in self.shape)
        storage = 0 if empty else sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True)) + 1
        if self.dtype.is_floating_point or self.dtype.is_complex:
            flat = torch.randn(storage, dtype=self.dtype, device=self.device)
        else:  # integers index: zeros are in range of anything they index
            flat = torch.zeros(storage, dtype=self.dtype, device=self.device)
        tensor = torch.as_strided(flat, self.shape, self.stride).detach()
        return tensor.requires_grad_(self.requires_grad)

    def __repr__(self) -> str:
        return f"Tensor{self.shape}/{self.stride}/{self.dtype}/{self.device}/{self.requires_grad}"


def _key(model: Any, compile_kwargs: dict[str, Any], args: tuple, kwargs: dict) -> str:
    """One key per code, structure, inputs and way of compiling, the same in every process that runs
    the same code (the parameters' values, which a compile does not read, are not in it)."""
    import torch
    from torch.utils._pytree import tree_map

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
    parts.append(repr(tree_map(lambda v: _spec(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))))
    parts.append(str(torch.is_grad_enabled()))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
