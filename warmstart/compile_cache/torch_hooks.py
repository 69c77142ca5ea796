"""The hooks warmstart puts into torch's and Triton's internals. Checked against the torch releases in
``torch_support.TORCH_VERSIONS_CHECKED``; on any other, compiled frames stay off and each hook goes in
only where the torch internals it wraps have the signature it expects (``torch_internals.PATCHED``).
Every private torch name used here, or anywhere in warmstart, is listed in ``torch_internals.py``.

What it plugs in, all through the process-wide store (``get_store()``):

* FX graph, AOTAutograd, autotune (per kernel and bundled) and Dynamo PGO entries, through the
  ``backend_override_cls`` hook of the ``Remote*Cache`` classes in ``torch._inductor.remote_cache``
  (the same hook torch's own tests use). The remote-cache switches are set in the process's own torch
  config (``torch._inductor.config``, ``torch._functorch.config``, ``torch._dynamo.config``) when those
  modules are imported, and never exported: a child process that does not run warmstart (``WARMSTART=0``,
  another environment, a start-up that failed) would otherwise inherit them and send its entries to
  torch's own Redis backend, which is unauthenticated and unpickles whatever it reads. Inductor's compile
  workers are new Python processes that inherit ``WARMSTART=1`` and so switch the caches on themselves
  (or fork from one that did);
* Inductor's compiled C++ objects on CPU, by wrapping ``CppBuilder.build``: torch bundles Triton
  kernels into FX entries but never the ``.so`` files g++ builds, so without this a new machine
  still pays every C++ compile; the digest that names a precompiled header, by wrapping
  ``codecache._precompile_header``; the outcome of Inductor's vector-ISA load probe (a child Python
  per process) by wrapping ``VecISA._probe_load``; and the start of each C++ kernel's build or
  fetch, moved from when Inductor loads the whole graph's module to when it generates the kernel
  (``PythonWrapperCodegen.define_kernel``), with the precompiled header's fetch started then too
  and the GIL's switch interval shortened while Inductor generates code (``GraphLowering.codegen``);
* Triton kernels, through ``TRITON_CACHE_MANAGER`` (see ``triton_manager.py``);
* Dynamo's output (each compiled frame's bytecode and guards), through ``dynamo_frames``, whose
  functions are installed here on ``torch._dynamo.eval_frame``, ``torch._dynamo.guards`` and
  ``torch._dynamo.precompile_context``, AOTAutograd's cache key and around each frame's compile;
* a job identity for Dynamo's PGO state (``TORCH_COMPILE_JOB_ID``) when the user set none, a
  count of recompilations, and Dynamo's guard-latency figure timed without evicting the CPU caches.

Patches are applied when the torch modules are first imported (see ``import_hooks.py``), so a process
that never compiles never pays for importing Inductor. Every patch fails open: if warmstart's part of
a hooked call raises (a key, the store), torch's own behaviour runs instead (a cache miss, a plain
build) after one warning per process, and torch's own errors pass through unchanged. A switch that
warmstart turned on in torch and that makes torch itself raise (the autotune caches) is turned off
again, after one warning, and the call is made as torch makes it without the switch.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import logging
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from warmstart import torch_internals, torch_support
from warmstart.compile_cache import dynamo_frames, import_hooks
from warmstart.compile_cache.entry_point import entry_point
from warmstart.compile_cache.storage import fail_open
from warmstart.config import torch_compile_job_id, torch_pgo_key_given, torch_variable_set
from warmstart.torch_internals import (
    FRAME_HOOKS,
    FRAMES_MODULES,
    REMOTE_CACHE_CLASSES,
    check_internals,
)

if TYPE_CHECKING:
    from torch.utils._config_module import ConfigModule

log = logging.getLogger("warmstart.cache")

TORCH_VERSIONS_CHECKED = torch_support.TORCH_VERSIONS_CHECKED

#: torch's remote-cache switches: (config module, attribute, the environment variable torch reads it
#: from). Set in this process's config when the module is imported, unless the user chose a value
#: (the variable, or code that ran before); never exported.
TORCH_FLAGS = (
    ("torch._inductor.config", "fx_graph_remote_cache", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"),
    ("torch._functorch.config", "enable_remote_autograd_cache", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"),
    ("torch._dynamo.config", "automatic_dynamic_remote_pgo", "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO"),
)

#: Switched on only where torch can use them (:func:`autotune_caches_usable`): Triton importable, a
#: device it compiles for, and a backend hash torch can compute. Without them torch's autotune caches
#: assert on the missing backend hash (a CUDA torch with Triton on a machine with no GPU, for one).
#: Decided at the first compile, when torch is whole (see ``_hook_compile_fx``).
TRITON_FLAGS = (
    ("torch._inductor.config", "autotune_remote_cache", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"),
    ("torch._inductor.config", "bundled_autotune_remote_cache", "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE"),
)

#: Exported (unless the user set it) where Triton is installed. Triton reads it in Inductor's compile
#: workers, forked or not. It names warmstart's own manager, which verifies what it fetches and, in a
#: process where warmstart is off, has no store and behaves as Triton's local file cache: inheriting it
#: can never reach an unauthenticated backend. Unlike the autotune switches it needs no GPU: Triton
#: compiles for a named target without one, and uses the manager then.
TRITON_ENV = {
    "TRITON_CACHE_MANAGER": "warmstart.compile_cache.triton_manager:WarmstartCacheManager",
}

_TIME_TAKEN_RE = re.compile(rb'"time_taken_ms":\s*(\d+)')


def configure_environment(environ: MutableMapping[str, str], job_id: str | None = None) -> None:
    """Prepare this process's torch switches and export what children may inherit to ``environ``.

    The remote-cache switches are not exported (see the module docstring): they are set in torch's
    config modules when those are imported. Exported, unless the user set them: the Triton cache
    manager (where Triton is installed) and ``job_id`` as torch's PGO job id (default: derived from the
    entry script or module, see :func:`pgo_job_id`), so that the processes of one job share it.
    """
    import importlib.util

    global _bundle_autograd
    has_triton = importlib.util.find_spec("triton") is not None
    for module_name in {module for module, _, _ in TORCH_FLAGS}:
        _PATCHES.setdefault(module_name, _switch_on_flags)
    _PATCHES.setdefault("torch.compiler.config", _set_job_id)
    _bundle_autograd = _dynamo_frames_on(environ)
    if _bundle_autograd:
        _PATCHES.setdefault("torch._functorch.config", _switch_on_flags)
    if has_triton:
        for name, value in TRITON_ENV.items():
            environ.setdefault(name, value)
    if not torch_pgo_key_given(environ):
        environ["TORCH_COMPILE_JOB_ID"] = pgo_job_id(job_id)


def _dynamo_frames_on(environ: MutableMapping[str, str]) -> bool:
    from warmstart.config import dynamo_frames_setting

    try:
        return dynamo_frames_setting(environ)
    except Exception:  # the store reports a bad setting, and is off
        return False


def pgo_job_id(job_id: str | None = None) -> str:
    """A stable identity for PGO state: the user's job id, else the entry script or module.

    Restarts and repeats of the same script share it, so dynamic shapes learnt once are reused. The
    entry is read from the command line the interpreter was started with (``sys.orig_argv``): this
    runs at start-up, before ``runpy`` has set ``sys.argv[0]`` and ``__main__`` for ``python -m``.
    """
    if job_id:
        return f"warmstart:{job_id}"
    return "warmstart:" + hashlib.sha256(entry_point().encode()).hexdigest()[:16]


# -- installing patches on import ------------------------------------------------------------

#: torch module -> its patch, handed to ``import_hooks`` by :func:`install`.
_PATCHES: dict[str, Callable[[ModuleType], None]] = {}
#: torch module -> what warmstart does without its patch, said when the patch cannot go in.
_WITHOUT: dict[str, str] = {}
FRAMES_OFF = "compiled frames (WARMSTART_DYNAMO) are off"


def install() -> None:
    """Hook every watched torch module: now if already imported, else when it is imported.

    When torch was imported before ``warmstart.enable()``, its config modules are switched on in place.
    """
    for name, patch in _PATCHES.items():
        import_hooks.on_import(name, functools.partial(_apply, name, patch))
    import_hooks.install()


def _apply(name: str, patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    checked = torch_support.checked_here()  # the first call on an unchecked torch warns, once
    if name in FRAMES_ONLY_MODULES and not torch_support.frames_checked_here():
        # Compiled frames rest on Dynamo's internals: off, said by the version's warning, or here
        # where they are asked for (nothing of theirs runs later to say it).
        torch_internals.record_hooked(name, False)
        if checked and _bundle_autograd:
            torch_support.warn_frames_off()
        return
    try:
        check_internals(name, module)
        patch(module)
    except Exception:  # a torch change must cost caching, never the job
        torch_internals.record_hooked(name, False)
        # On a torch nobody checked, the one warning already said that such hooks are left out.
        log.log(
            logging.WARNING if checked else logging.DEBUG,
            "warmstart: could not hook %s (torch %s; checked against %s): %s",
            name,
            torch_support.torch_version() or "?",
            ", ".join(torch_support.TORCH_VERSIONS_CHECKED),
            _WITHOUT.get(name, "compiling uncached"),
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
    else:
        torch_internals.record_hooked(name, True)


# -- torch's switches, in this process's config ------------------------------------------------

#: AOTAutograd bundles compiled graphs into its entries, which Dynamo's packages need (dynamo_frames).
_bundle_autograd = False
#: (config module, attribute) that warmstart switched on, to switch off again if the remote-cache
#: hook cannot be installed: a switch without warmstart's backend would reach torch's Redis backend.
_switched: list[tuple[ModuleType, str]] = []
_remote_hook_failed = False


def _switch_on_flags(config: ModuleType) -> None:
    """Turn torch's remote caches on in one of its config modules, where nobody chose otherwise.

    A value of ``None`` is torch's "not set" (its tristate default when the environment variable is
    unset); ``True`` or ``False`` came from the user's environment or code and is kept.
    """
    if _remote_hook_failed:
        return
    for module_name, attr, _env in TORCH_FLAGS:
        if module_name == config.__name__:
            _switch_on(config, attr)
    # Bundling serves compiled frames only, which are off on a torch nobody checked.
    if _bundle_autograd and config.__name__ == "torch._functorch.config" and torch_support.frames_checked_here():
        _set_default(config, "bundled_autograd_cache", True)  # a value the user set in code still wins


def _switch_on(config: ModuleType, attr: str) -> None:
    if getattr(config, attr) is None:
        _set_default(config, attr, True)
        _switched.append((config, attr))


def _set_default(config: ModuleType, attr: str, value: bool | None) -> None:
    # torch's config modules keep a value set with setattr in a ContextVar: it would hold only in the
    # thread that imported the module (a compile warm-up thread, say), and every other thread would
    # compile uncached. The default is what the environment variable would have set: process-wide.
    entry = getattr(config, "_config", {}).get(attr)
    if entry is None or not hasattr(entry, "default"):
        setattr(config, attr, value)
        return
    entry.default = value
    if hasattr(config, "_mark_get_dict_dirty"):  # torch caches the config's dict and hash
        config._mark_get_dict_dirty(attr)
    if hasattr(config, "_hash_dirty_var"):
        config._hash_dirty_var.set(True)


def _switch_off_flags() -> None:
    global _remote_hook_failed
    _remote_hook_failed = True
    while _switched:
        config, attr = _switched.pop()
        _set_default(config, attr, None)


def forget_preloader_settings() -> None:
    """In a preloader's child, before warmstart is turned on for its program: undo what the
    preloader's own environment chose where the program's may choose otherwise (torch's PGO job id,
    which warmstart derives from the entry point; AOTAutograd's bundling, which follows
    ``WARMSTART_DYNAMO``), so that turning warmstart on decides them again."""
    compiler_config = cast("ConfigModule | None", sys.modules.get("torch.compiler.config"))
    if compiler_config is not None:
        compiler_config.job_id = None  # set again from the program's TORCH_COMPILE_JOB_ID (_set_job_id)
    functorch_config = sys.modules.get("torch._functorch.config")
    if functorch_config is not None and _bundle_autograd:
        _set_default(functorch_config, "bundled_autograd_cache", False)
    import_hooks.forget(("torch.compiler.config", "torch._functorch.config"))
    torch_support.reset()  # the program's process says its own warning on an unchecked torch, once


def _set_job_id(module: ModuleType) -> None:
    # torch reads TORCH_COMPILE_JOB_ID when torch.compiler.config is imported; when that happened
    # before warmstart.enable() exported it, set it here.
    compiler_config = cast("ConfigModule", module)  # whose attributes are its settings
    job_id = torch_compile_job_id()
    if compiler_config.job_id is None and job_id:
        compiler_config.job_id = job_id


def _patch(module_name: str, without: str) -> Callable[[Callable[[ModuleType], None]], Callable[[ModuleType], None]]:
    """Register the decorated function as ``module_name``'s patch; ``without`` says what warmstart
    does where it cannot be installed."""

    def register(fn: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        _PATCHES[module_name] = fn
        _WITHOUT[module_name] = without
        return fn

    return register


@_patch("torch", "WARMSTART_COMPILE=background is off: torch.compile compiles inline")
def _hook_torch_compile(torch_module: ModuleType) -> None:
    from warmstart.compile_cache import background

    background.hook_torch_compile(torch_module)


# -- FX graph, AOTAutograd, autotune, PGO ----------------------------------------------------


@_patch("torch._inductor.remote_cache", "compiling uncached: nothing is fetched from or written to the store")
def _hook_remote_caches(remote_cache: ModuleType) -> None:
    try:
        _install_store_backend(remote_cache)
    except Exception:
        _switch_off_flags()  # without warmstart's backend, a switch would reach torch's Redis backend
        raise


def _install_store_backend(remote_cache: ModuleType) -> None:
    if "backend_override_cls" not in vars(remote_cache.RemoteCache):
        raise AttributeError("RemoteCache.backend_override_cls is gone")
    classes = {cls_name: getattr(remote_cache, cls_name) for cls_name in REMOTE_CACHE_CLASSES}
    backend_base = remote_cache.RemoteCacheBackend

    class StoreBackend(backend_base):  # type: ignore[misc, valid-type]
        """torch's remote-cache backend interface over warmstart's store (bytes in, bytes out).

        Fails open: an error of warmstart's (the store, the key) is a miss, or a put not made."""

        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

        def _get(self, key: str) -> bytes | None:
            try:
                from warmstart.compile_cache import get_store

                store = get_store()
                return store.get(self.kind, key).value if store is not None else None
            except Exception as exc:
                fail_open(f"{self.kind} cache read", exc)
                return None

        def _put(self, key: str, data: bytes) -> None:
            try:
                from warmstart.compile_cache import get_store

                store = get_store()
                if store is not None:
                    match = _TIME_TAKEN_RE.search(data[-200:]) or _TIME_TAKEN_RE.search(data[:200])
                    store.put(self.kind, key, data, cost_s=int(match.group(1)) / 1000 if match else 0.0)
            except Exception as exc:
                fail_open(f"{self.kind} cache write", exc)

    for cls_name, kind in REMOTE_CACHE_CLASSES.items():
        classes[cls_name].backend_override_cls = functools.partial(StoreBackend, kind)


# -- torch's autotune caches: only where torch can use them ------------------------------------


def autotune_caches_usable() -> tuple[bool, str]:
    """Whether torch can use its autotune caches in this process, and why not.

    Torch keys them by a hash of Triton and its device backend, which it computes only where Triton
    has a device to compile for (``torch.utils._triton.has_triton``) and Triton's backend answers; its
    caches assert on the missing hash elsewhere (a CUDA torch with Triton on a machine with no GPU).
    The same two calls as torch's, made once, at the first compile (see :func:`_hook_compile_fx`).
    """
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    _triton = torch_internals.resolve("torch_triton")
    if _triton is None:
        return False, "this torch has no Triton helpers (torch.utils._triton)"
    if not _triton.has_triton():
        return False, "Triton has no device to compile for on this machine"
    try:
        _triton.triton_hash_with_backend()
    except Exception as exc:
        return False, f"torch cannot hash Triton's backend ({type(exc).__name__}: {exc})"
    return True, "Triton and a device it compiles for"


_autotune_lock = threading.Lock()
#: Whether this process decided on the autotune switches (the first compile does; an Inductor compile
#: worker, which compiles no graph, never does and takes the switches from its parent's meta).
_autotune_decided = False


def _switch_on_autotune_caches() -> None:
    """Turn torch's autotune remote caches on, once per process, where torch can use them."""
    global _autotune_decided
    with _autotune_lock:
        if _autotune_decided:
            return
        _autotune_decided = True
        if _remote_hook_failed:
            return
        try:
            usable, why = autotune_caches_usable()
        except Exception as exc:  # torch moved what the check asks: leave the caches off
            fail_open("autotune cache check", exc)
            return
        log.debug("warmstart: torch's autotune caches %s: %s", "on" if usable else "off", why)
        if usable:
            for module_name, attr, _env in TRITON_FLAGS:
                _switch_on(importlib.import_module(module_name), attr)


@_patch("torch._inductor.compile_fx", "torch's autotune caches stay off (Triton kernels autotune on every machine)")
def _hook_compile_fx(compile_fx: ModuleType) -> None:
    """Decide on the autotune caches at the first compile: torch is whole then, and its devices known
    (deciding when its config module is imported would import Dynamo in the middle of torch's own
    imports). torch looks ``compile_fx`` up in this module at each compile."""
    original = compile_fx.compile_fx

    @functools.wraps(original)
    def compile_fx_(*args, **kwargs):
        _switch_on_autotune_caches()
        return original(*args, **kwargs)

    vars(compile_fx)["compile_fx"] = compile_fx_


@_patch(
    "torch._inductor.runtime.autotune_cache",
    "an autotune cache that warmstart switched on and torch cannot use fails the compile",
)
def _hook_autotune_failures(autotune_cache: ModuleType) -> None:
    """Where torch raises in its autotune caches with a switch that warmstart turned on, turn the switch
    off again in this process (one warning) and make the call as torch makes it without the switch.

    The check before switching them on (:func:`autotune_caches_usable`) is torch's own; this covers a
    torch whose caches fail for another reason. torch's errors with the user's own switches pass."""
    bundler = autotune_cache.AutotuneCacheBundler
    original_begin = bundler.begin_compile.__func__  # a classmethod

    def begin_compile(cls, inductor_meta, *args, **kwargs):
        try:
            return original_begin(cls, inductor_meta, *args, **kwargs)
        except Exception as exc:
            plain = _meta_without_our_switches(inductor_meta, "bundled autotune cache", exc)
            if plain is None:
                raise
            return original_begin(cls, plain, *args, **kwargs)

    begin_compile.__wrapped__ = original_begin  # type: ignore[attr-defined]
    bundler.begin_compile = classmethod(begin_compile)

    cache = autotune_cache.AutotuneCache
    original_create = cache.create  # a staticmethod

    def create(inductor_meta, filename, configs_hash):
        try:
            return original_create(inductor_meta, filename, configs_hash)
        except Exception as exc:
            plain = _meta_without_our_switches(inductor_meta, "autotune cache", exc)
            if plain is None:
                raise
            return original_create(plain, filename, configs_hash)

    create.__wrapped__ = original_create  # type: ignore[attr-defined]
    cache.create = staticmethod(create)


def _meta_without_our_switches(inductor_meta: Any, where: str, exc: Exception) -> dict | None:
    """``inductor_meta`` with the autotune switches warmstart turned on unset again (and those switched
    off in this process, one warning), or ``None`` where none of them is on in it: the error is
    torch's own and passes through."""
    ours = {attr for _config, attr in _switched if any(attr == a for _m, a, _e in TRITON_FLAGS)}
    if not _autotune_decided:
        # An Inductor compile worker: its parent decided and handed the switches over in the meta;
        # one the environment did not set was warmstart's.
        ours |= {attr for _m, attr, env in TRITON_FLAGS if not torch_variable_set(env)}
    if not isinstance(inductor_meta, dict) or not any(inductor_meta.get(attr) for attr in ours):
        return None
    fail_open(f"torch's {where}, switched on by warmstart", exc)
    _switch_off_autotune_caches()
    return {**inductor_meta, **{attr: None for attr in ours}}  # None: torch's own "not set"


def _switch_off_autotune_caches() -> None:
    attrs = {attr for _m, attr, _e in TRITON_FLAGS}
    for config, attr in [entry for entry in _switched if entry[1] in attrs]:
        _set_default(config, attr, None)
        _switched.remove((config, attr))


# -- compiled C++ objects ----------------------------------------------------------------------


@_patch("torch._inductor.cpp_builder", "C++ kernels are built with g++ on every machine, not shared")
def _hook_cpp_builder(cpp_builder: ModuleType) -> None:
    original_build = cpp_builder.CppBuilder.build

    def build(self) -> None:
        # warmstart's part (key, store) fails open to the plain build; g++'s errors are torch's and
        # pass through unchanged. A lease the lookup takes (single-flight) ends with this build at
        # the latest, also when g++ fails.
        with _lease_scope():
            try:
                key = _cpp_lookup(self)
            except Exception as exc:
                fail_open("C++ object cache", exc)
                return original_build(self)
            if key is None:
                return original_build(self)
            if key is _DONE:
                return None
            _materialize_pch(self.get_command_line(), original_build)
            _build_and_store(self, key, original_build)
            return None

    build.__wrapped__ = original_build  # type: ignore[attr-defined]
    cpp_builder.CppBuilder.build = build


_DONE: Any = object()  # _cpp_lookup: the output is in place


def _cpp_lookup(builder) -> Any:
    """The store key of ``builder``'s output, ``None`` to build uncached, or ``_DONE`` when the output
    was fetched (or its building deferred)."""
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is None or getattr(builder, "_use_relative_path", False):
        return None
    target = builder.get_target_file_path()
    key = cpp_object_key(builder.get_command_line(), target)
    if key is None:
        return None
    if target.endswith(".gch"):
        # A precompiled header (~150 MB) only speeds up builds that miss; g++ falls back to the
        # plain header next to it when it is absent. Materialise it only when a build needs it.
        with _pch_lock:
            _deferred_pch[target[: -len(".gch")]] = (builder, key)
        return _DONE
    data = store.get("cpp_object", key).value
    if data is not None and _write_atomic(target, data):
        return _DONE
    return key


_deferred_pch: dict[str, tuple[object, str]] = {}  # header -> (its builder, its store key)
_pch_lock = threading.Lock()  # guards _deferred_pch, _header_locks, _prefetched_pch
_header_locks: dict[str, threading.Lock] = {}  # one per header: its fetch, build or prefetch at a time
_prefetched_pch: set[str] = set()
_looked_up_pch: set[str] = set()  # asked of the store (under the header's lock), once per process


def _reset_pch_locks_in_child() -> None:
    # A child forked while a prefetch thread held a lock would wait for it forever: the thread is
    # not in the child.
    global _pch_lock
    _pch_lock = threading.Lock()
    _header_locks.clear()
    _prefetched_pch.clear()
    _looked_up_pch.clear()


os.register_at_fork(after_in_child=_reset_pch_locks_in_child)


def _build_and_store(builder, key: str, original_build: Callable) -> None:
    from warmstart.compile_cache import get_store

    start = time.perf_counter()
    original_build(builder)
    cost = time.perf_counter() - start
    try:
        store = get_store()
        try:
            with open(builder.get_target_file_path(), "rb") as f:
                data = f.read()
        except OSError:
            return
        if store is not None:
            store.put("cpp_object", key, data, cost_s=cost)
    except Exception as exc:  # the object is built; only sharing it failed
        fail_open("C++ object cache", exc)


def _materialize_pch(command_line: str, original_build: Callable) -> None:
    """Fetch or build the deferred precompiled headers that ``command_line`` includes."""
    with _pch_lock:
        needed = [h for h in _deferred_pch if h in command_line]
    for header in needed:
        _place_pch(header, original_build)


def _place_pch(header: str, original_build: Callable | None) -> None:
    """Put ``header``'s deferred precompiled version in place: fetched from the store, else built
    (``original_build`` given) or left deferred (``None``: a prefetch)."""
    lock_timeout = torch_internals.require("codecache_lock_timeout")
    file_lock = torch_internals.require("file_lock")

    with _pch_lock:
        header_lock = _header_locks.setdefault(header, threading.Lock())
    with header_lock:
        with _pch_lock:
            entry = _deferred_pch.get(header)
        if entry is None:  # placed by another thread of this process
            return
        builder, key = entry
        target = header + ".gch"
        # g++ writes the header straight to its place: under torch's lock for it, as torch builds
        # it, no process of this machine compiles against one half written (g++ reading a
        # truncated header has used 22 GB of memory).
        lock_path = pch_lock_path(header)
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        with file_lock(lock_path, timeout=lock_timeout):
            placed = os.path.exists(target) or _fetch_pch(header, key, target)
            if not placed and original_build is None:
                return  # a prefetch that found nothing: the first build that needs the header builds it
            try:
                if not placed and original_build is not None:
                    _build_and_store(builder, key, original_build)
            finally:
                # No longer deferred once placed, and also once its build failed: g++'s error goes to
                # the kernel that needed it, as torch's would, and is not repeated for every kernel.
                with _pch_lock:
                    _deferred_pch.pop(header, None)


def _fetch_pch(header: str, key: str, target: str) -> bool:
    """Write ``header``'s precompiled version to ``target`` from the store; the store is asked once
    per process (a prefetch that found nothing spares the build a second lookup, and a second miss)."""
    from warmstart.compile_cache import get_store

    if header in _looked_up_pch:
        return False
    _looked_up_pch.add(header)
    try:
        store = get_store()
        # No waiting on a peer's lease: building it here costs seconds, a wait could cost a whole
        # compile of the peer's (it uploads the header once that compile is over). Not copied into
        # the local tier: the file in place is this machine's copy.
        value = store.get("cpp_object", key, wait=False, copy_local=False).value if store is not None else None
        return value is not None and _write_atomic(target, value)
    except Exception as exc:
        fail_open("C++ object cache", exc)
        return False


def _prefetch_pch() -> None:
    """Start fetching each deferred precompiled header not yet asked for, in a thread of its own.

    Called as Inductor generates a graph's kernels: the cache missed that graph, so some of its
    kernels may be new, and the first one g++ has to build would otherwise wait for the header's
    fetch (~150 MB: 0.6-0.9 s) after its lookup missed, at the end of code generation.
    """
    with _pch_lock:
        headers = [h for h in _deferred_pch if h not in _prefetched_pch]
        _prefetched_pch.update(headers)
    for header in headers:
        threading.Thread(target=_prefetch_one, args=(header,), name="warmstart-pch-prefetch", daemon=True).start()


def _prefetch_one(header: str) -> None:
    try:
        _place_pch(header, None)
    except Exception as exc:
        fail_open("precompiled header prefetch", exc)


def pch_lock_path(header: str) -> str:
    """The lock torch's ``_precompile_header`` builds ``header``'s precompiled version under (its
    ``locks`` folder next to the headers)."""
    name = os.path.splitext(os.path.basename(header))[0]
    return os.path.join(os.path.dirname(header), "locks", f"{name}.lock")


def cpp_object_key(command_line: str, target: str) -> str | None:
    """A machine-independent key for one compiler invocation.

    Inputs that are files (sources, objects) are replaced by the SHA-256 of their contents and the
    output by a placeholder, so two machines with different cache directories agree; every other
    flag (include paths, vector ISA, optimisation, compiler) stays as it is. ``None`` when an input
    cannot be read.
    """
    cache_dir = torch_internals.resolve("cache_dir")
    default_cache_dir = torch_internals.resolve("default_cache_dir")
    if cache_dir is None or default_cache_dir is None:
        return None
    roots = sorted(
        {os.path.realpath(cache_dir()), cache_dir(), os.path.realpath(default_cache_dir()), default_cache_dir()},
        key=len,
        reverse=True,
    )
    parts: list[str] = []
    for token in shlex.split(command_line):
        if token == target:
            parts.append("<TARGET>")
        elif os.path.isabs(token) and os.path.isfile(token):
            try:
                with open(token, "rb") as f:
                    parts.append("<FILE:" + hashlib.sha256(f.read()).hexdigest() + ">")
            except OSError:
                return None
        else:
            for root in roots:
                token = token.replace(root, "<CACHE>")
            parts.append(token)
    parts.append("suffix=" + os.path.splitext(target)[1])
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _write_atomic(path: str, data: bytes) -> bool:
    try:
        from pathlib import Path

        from warmstart._fileio import write_file

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_file(Path(path), data, 0o755)
        return True
    except OSError:
        return False


# -- precompiled headers' names ---------------------------------------------------------------

_HEX_SHA512 = re.compile(r"[0-9a-f]{128}")


@_patch("torch._inductor.codecache", "every process preprocesses the precompiled header itself (1-2 s)")
def _hook_precompile_header(codecache: ModuleType) -> None:
    """Name each precompiled header from a stored digest of its preprocessed source.

    Before it builds or looks up a C++ kernel, every process names the precompiled header that the
    kernel's command line includes (``_precompile_header``): torch runs the header through the
    preprocessor (``g++ -E``: 5 MB of output, 1-2 s) and hashes the output (``openssl sha512``), so
    that any change in a header it includes renames it. The digest depends only on the header and
    the preprocessor's command line and inputs, so warmstart stores the digest (``header_digest``,
    keyed by the header's name and the key a C++ object of that command has) rather than the
    preprocessed source; what torch then does with the digest is torch's code, step for step.
    """
    original = codecache._precompile_header
    uncached = getattr(original, "__wrapped__", original)

    @functools.cache
    def _precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        command = dict(compile_command)
        command.pop("extra_flags", None)  # as torch: preprocessing and precompiling do not link
        with _lease_scope():
            try:
                digest = _preprocessed_digest(codecache, header, command)
            except Exception as exc:
                fail_open("precompiled header name", exc)
                digest = None
            if digest is None:
                return uncached(header, hashable_cmd_line, **compile_command)
        # torch's _precompile_header from here, with the digest it would have computed
        options = codecache.CppTorchDeviceOptions(**command, precompiling=True)
        header_hash, header_path = codecache.write(
            content=f"#include <{header}>\n",
            extension="h",
            extra=hashable_cmd_line + digest + codecache.get_compiler_version_info(options.get_compiler()),
            specified_dir=codecache._HEADER_DIR,
        )
        builder = codecache.CppBuilder(name=header_path, sources=header_path, BuildOption=options)
        os.makedirs(codecache._HEADER_LOCK_DIR, exist_ok=True)
        codecache._worker_compile_cpp(os.path.join(codecache._HEADER_LOCK_DIR, f"{header_hash}.lock"), (builder,))
        return header_path

    _precompile_header.__wrapped__ = original
    vars(codecache)["_precompile_header"] = _precompile_header


def _preprocessed_digest(codecache: ModuleType, header: str, command: dict[str, Any]) -> str | None:
    """SHA-512 (hex) of ``header`` preprocessed with ``command``, from the store or from ``g++ -E``;
    ``None`` where warmstart has no store or no key for it (torch then computes it)."""
    import tempfile

    from warmstart.compile_cache import get_store

    store = get_store()
    if store is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "header.hpp")
        with open(source, "w") as f:
            f.write(f"#include <{header}>\n")
        options = codecache.CppTorchDeviceOptions(**command, preprocessing=True)
        preprocessor = codecache.CppBuilder(name=source[: -len(".hpp")], sources=source, BuildOption=options)
        if getattr(preprocessor, "_use_relative_path", False):  # its inputs are not named by content
            return None
        target = preprocessor.get_target_file_path()
        command_key = cpp_object_key(preprocessor.get_command_line(), target)
        if command_key is None:
            return None
        key = hashlib.sha256(f"{header}\0{command_key}".encode()).hexdigest()
        stored = store.get("header_digest", key).value
        if stored is not None:
            digest = stored.decode("ascii", "replace")
            if _HEX_SHA512.fullmatch(digest):
                return digest
        start = time.perf_counter()
        build = type(preprocessor).build
        getattr(build, "__wrapped__", build)(preprocessor)  # g++ -E itself: the output is not stored
        with open(target, "rb") as f:
            digest = hashlib.sha512(f.read()).hexdigest()
        store.put("header_digest", key, digest.encode("ascii"), cost_s=time.perf_counter() - start)
        return digest


# -- C++ kernels built as soon as they are generated ------------------------------------------


_PYBINDING_CALL = "async_compile.cpp_pybinding("


@_patch(
    "torch._inductor.codegen.wrapper",
    "a C++ kernel is built (or fetched) when Inductor loads the compiled graph, not when it is generated",
)
def _hook_early_cpp_builds(wrapper: ModuleType) -> None:
    """Start each C++ kernel's build, or its fetch from the store, as soon as Inductor has generated
    its source, while Inductor goes on generating the rest of the graph.

    Inductor submits a C++ kernel to its compile threads only when it loads the module it generated
    for the whole graph, so every kernel's g++ build or fetch waits for the last line of code
    generation (seconds, on a large graph); it already starts Triton kernels early in the same way.
    The call made here is the one the module makes when it loads (same source, same command line):
    Inductor's kernel cache keeps the started build under its key, and the module's call finds it
    there. A kernel whose source or flags differed would have another key and be built anew, never
    shared.
    """
    codegen = wrapper.PythonWrapperCodegen
    original = codegen.define_kernel

    @functools.wraps(original)
    def define_kernel(self, kernel_name, kernel_body, *args, **kwargs):
        result = original(self, kernel_name, kernel_body, *args, **kwargs)
        gpu = kwargs.get("gpu", args[1] if len(args) > 1 else True)
        if not gpu and isinstance(kernel_body, str) and kernel_body.startswith(_PYBINDING_CALL):
            try:
                _start_cpp_build(kernel_body)
            except Exception as exc:
                fail_open("early C++ kernel build", exc)
        return result

    codegen.define_kernel = define_kernel


def _start_cpp_build(kernel_body: str) -> None:
    async_compile = torch_internals.require("async_compile")
    codecache = torch_internals.require("codecache")

    # One compile thread: Inductor builds each kernel in line as the module loads, nothing to start.
    # (With cpp_wrapper, a kernel's body is its C++ alone, without this call: never started here.)
    if async_compile.get_compile_threads() <= 1:
        return
    call = ast.parse(kernel_body, mode="eval").body
    if not isinstance(call, ast.Call) or len(call.args) != 2 or call.keywords:
        return
    argtypes, source = (ast.literal_eval(arg) for arg in call.args)
    codecache.CppPythonBindingsCodeCache.load_pybinding_async(
        argtypes, source, submit_fn=async_compile.AsyncCompile.submit
    )
    _prefetch_pch()


# -- the GIL while Inductor generates code ---------------------------------------------------


_CODEGEN_SWITCH_INTERVAL_S = 0.001


@_patch(
    "torch._inductor.graph",
    "the compile threads' cache lookups and fetches wait up to 5 ms for the GIL after each read while "
    "Inductor generates code",
)
def _hook_codegen_switch_interval(graph: ModuleType) -> None:
    """Hand the GIL to Inductor's compile threads within 1 ms, not 5, while it generates a graph's code.

    Code generation is pure Python and holds the GIL; the compile threads meanwhile look each
    generated kernel up in the store, fetch it or start g++ (see ``_hook_early_cpp_builds``), each
    a chain of short reads and writes. Python makes a thread that wants the GIL wait one switch
    interval (5 ms by default) after every one of them, so a lookup that costs a few milliseconds
    alone took 0.1-0.5 s, and a kernel that has to be built started that much later. The interval
    is Python's alone (no result depends on it) and comes back as it was when code generation ends.
    """
    lowering = graph.GraphLowering
    original = lowering.codegen

    @functools.wraps(original)
    def codegen(self, *args, **kwargs):
        with _short_switch_interval():
            return original(self, *args, **kwargs)

    lowering.codegen = codegen


_switch_lock = threading.Lock()
_switch_depth = 0
_switch_saved = 0.0


@contextlib.contextmanager
def _short_switch_interval():
    global _switch_depth, _switch_saved
    async_compile = torch_internals.resolve("async_compile")
    # no compile threads: nothing waits for the GIL
    if async_compile is None or async_compile.get_compile_threads() <= 1:
        yield
        return
    with _switch_lock:
        if _switch_depth == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, _CODEGEN_SWITCH_INTERVAL_S))
        _switch_depth += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_depth -= 1
            if _switch_depth == 0:
                sys.setswitchinterval(_switch_saved)


# -- the vector-ISA probe ----------------------------------------------------------------------


@_patch("torch._inductor.cpu_vec_isa", "every process probes the CPU's vector instructions itself (0.5-0.8 s)")
def _hook_vec_isa_probe(cpu_vec_isa: ModuleType) -> None:
    """Remember that a vector-ISA test library loads.

    Before its first C++ compile, every process builds a small test library per candidate ISA and
    starts a child Python that ``dlopen``s it (with libtorch): 0.5-0.8 s on every process start,
    cache hit or not. The outcome depends only on that library's bytes and on the CPU, torch and
    Python, which the namespace already pins, so a success is stored under the library's SHA-256.
    Failures are never stored (a probe can also fail by timing out on a busy machine).
    """
    original_probe = cpu_vec_isa.VecISA._probe_load

    def _probe_load(self, output_path: str) -> bool:
        from warmstart.compile_cache import get_store

        try:
            store = get_store()
            try:
                with open(output_path, "rb") as f:
                    key = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                key = None
            if store is not None and key is not None and store.get("isa_probe", key).value == b"loads":
                return True
        except Exception as exc:
            fail_open("vector-ISA probe cache", exc)
            return original_probe(self, output_path)
        if store is None or key is None:
            return original_probe(self, output_path)
        start = time.perf_counter()
        ok = original_probe(self, output_path)
        if ok:
            try:
                store.put("isa_probe", key, b"loads", cost_s=time.perf_counter() - start)
            except Exception as exc:
                fail_open("vector-ISA probe cache", exc)
        return ok

    _probe_load.__wrapped__ = original_probe  # type: ignore[attr-defined]
    cpu_vec_isa.VecISA._probe_load = _probe_load

    original_env = getattr(cpu_vec_isa.VecISA, "_build_probe_env", None)
    if original_env is not None:

        def _build_probe_env() -> dict[str, str]:
            # The probe's child Python only dlopens the test library: warmstart's start-up hook there
            # (and a handover to a preloader) would add ~70 ms to each of a process's probes.
            env = original_env()
            env.pop("WARMSTART", None)
            return env

        _build_probe_env.__wrapped__ = original_env  # type: ignore[attr-defined]
        cpu_vec_isa.VecISA._build_probe_env = staticmethod(_build_probe_env)


def _lease_scope():
    """Leases taken in the body (single-flight) and not yet released by a ``put`` are released when
    it ends: a compile that raised, or that torch chose not to cache, must not keep others waiting."""
    try:
        flight = _single_flight()
        return flight.scope() if flight is not None else contextlib.nullcontext()
    except Exception as exc:
        fail_open("single-flight scope", exc)
        return contextlib.nullcontext()


def _single_flight():
    from warmstart.compile_cache import get_store

    return getattr(get_store(), "single_flight", None)  # a store need not have leases


@_patch(
    "torch._functorch._aot_autograd.runtime_wrappers",
    "a missed backward's lease may lapse before the backward is lowered: ranks waiting for it may lower it themselves",
)
def _hook_lazy_backward(runtime_wrappers: ModuleType) -> None:
    """AOTAutograd's backward, lowered at the first backward pass, is the end of the compile that
    missed its entry: that entry's lease lasts until torch saves it then (see
    :meth:`~warmstart.compile_cache.single_flight.SingleFlight.deferred_compile`)."""
    compiler = runtime_wrappers._AutogradBackwardCompiler
    original = compiler.get_or_compile

    @functools.wraps(original)
    def get_or_compile(self, *args, **kwargs):
        if self.compiled_bw is not None:
            return original(self, *args, **kwargs)
        with _deferred_compile_scope(self.aot_config):
            return original(self, *args, **kwargs)

    compiler.get_or_compile = get_or_compile


def _deferred_compile_scope(aot_config):
    try:
        flight = _single_flight()
        if flight is None:
            return contextlib.nullcontext()
        cache_info = getattr(aot_config, "cache_info", None)
        cache_key = getattr(cache_info, "cache_key", None)
        if not cache_key:  # AOTAutograd's cache is off for this graph: no entry, no lease
            return flight.scope()
        # torch's remote key for the entry: "pt2:autograd-experimental::<cache key>:c<version>"
        needle = f"::{cache_key}:"
        return flight.deferred_compile("aot_autograd", lambda key: needle in key)
    except Exception as exc:
        fail_open("single-flight scope", exc)
        return contextlib.nullcontext()


# -- a frame's compile, and recompilations -----------------------------------------------------


@_patch(
    "torch._dynamo.convert_frame",
    f"frame compiles take no single-flight lease, and {FRAMES_OFF}",
)
def _hook_convert_frame(convert_frame: ModuleType) -> None:
    _hook_frame_compile(convert_frame)
    _hook_recompiles(convert_frame)


def _hook_frame_compile(convert_frame: ModuleType) -> None:
    """Each frame's compile (Dynamo, AOTAutograd, Inductor) is a lease scope (see :func:`_lease_scope`)."""
    original = convert_frame._compile

    @functools.wraps(original)
    def _compile(*args, **kwargs):
        with _lease_scope(), _frames_scope(kwargs.get("package")):
            return original(*args, **kwargs)

    # Replaced in the module's namespace, as assigning the attribute would: ModuleType declares no
    # attributes of its own to assign.
    vars(convert_frame)["_compile"] = _compile


def _frames_scope(package):
    if package is None:
        return contextlib.nullcontext()
    try:
        return dynamo_frames.frame_compile(package)
    except Exception as exc:
        fail_open("Dynamo frames", exc)
        return contextlib.nullcontext()


# -- Dynamo's output (see dynamo_frames) ------------------------------------------------------------


def _frames_hook(hook: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        getattr(dynamo_frames, hook)(module)

    return patch


for _module_name, _hook in FRAME_HOOKS.items():
    _patch(_module_name, FRAMES_OFF)(_frames_hook(_hook))

#: Modules whose patch serves compiled frames alone: left unpatched on a torch compiled frames were
#: not checked on, where they are off. ``convert_frame``'s also serves single-flight leases, and the
#: guards' also times each frame's guards: they go in, without their frames' part (``_hook_guards``).
FRAMES_ONLY_MODULES = frozenset(FRAMES_MODULES) - {"torch._dynamo.convert_frame", "torch._dynamo.guards"}


@_patch(
    "torch._dynamo.guards",
    f"{FRAMES_OFF}, and Dynamo times each new frame's guards after evicting the CPU caches (20-30 ms a frame)",
)
def _hook_guards(guards: ModuleType) -> None:
    _hook_guard_latency(guards)
    if torch_support.frames_checked_here():  # elsewhere compiled frames are off: their part stays out
        dynamo_frames.hook_guards(guards)


def _hook_guard_latency(guards: ModuleType) -> None:
    """Time a new frame's guards without evicting the CPU caches first.

    For its compile metrics (``guard_latency_us``, and a debug line of the ``guards`` log), Dynamo
    times one check of every frame's new guards right after evicting the CPU caches by writing a
    large buffer: 20-30 ms a frame, the same again in misses for every thread of the process, and a
    tenth of a warm start's work on a small model. The figure becomes the time of one check with
    warm caches (microseconds, as torch's); the guards themselves are built and checked as before.
    """
    original = guards.profile_guard_manager

    def profile_guard_manager(root, f_locals, n_iters) -> float:
        n = max(int(n_iters), 1)
        start = time.perf_counter_ns()
        for _ in range(n):
            root.check(f_locals)
        return (time.perf_counter_ns() - start) / n / 1000

    profile_guard_manager.__wrapped__ = original  # type: ignore[attr-defined]
    vars(guards)["profile_guard_manager"] = profile_guard_manager


def _hook_recompiles(convert_frame: ModuleType) -> None:
    original = convert_frame.get_and_maybe_log_recompilation_reasons

    def counted(*args, **kwargs):
        from warmstart.compile_cache import background, get_store

        frame = args[1] if len(args) > 1 else kwargs.get("frame")
        stop = background.recompile_probe(getattr(frame, "f_code", None))
        if stop is not None:
            raise stop  # before any tracing, as torch's own error_on_recompile does

        try:
            store = get_store()
            if store is not None:
                store.stats.bump("recompiles")
        except Exception as exc:
            fail_open("recompilation count", exc)
        return original(*args, **kwargs)

    vars(convert_frame)["get_and_maybe_log_recompilation_reasons"] = counted
