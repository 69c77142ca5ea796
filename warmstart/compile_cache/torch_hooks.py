"""The only module that touches torch's and Triton's internals. Checked against torch 2.13.0.

What it plugs in, all through the process-wide store (``get_store()``):

* FX graph, AOTAutograd, autotune (per kernel and bundled) and Dynamo PGO entries, through the
  ``backend_override_cls`` hook of the ``Remote*Cache`` classes in ``torch._inductor.remote_cache``
  (the same hook torch's own tests use); the remote-cache flags are switched on by environment
  variables so that Inductor's compile workers see them too;
* Inductor's compiled C++ objects on CPU, by wrapping ``CppBuilder.build``: torch bundles Triton
  kernels into FX entries but never the ``.so`` files g++ builds, so without this a new machine
  still pays every C++ compile; and the outcome of Inductor's vector-ISA load probe (a child
  Python per process) by wrapping ``VecISA._probe_load``;
* Triton kernels, through ``TRITON_CACHE_MANAGER`` (see ``triton_manager.py``);
* a job identity for Dynamo's PGO state (``TORCH_COMPILE_JOB_ID``) when the user set none, and a
  count of recompilations.

Patches are applied when the torch modules are first imported (a post-import hook), so a process
that never compiles never pays for importing Inductor.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from types import ModuleType

log = logging.getLogger("warmstart.cache")

TORCH_VERSIONS_CHECKED = ("2.13.0",)

#: Remote-cache class in ``torch._inductor.remote_cache`` -> artifact kind.
REMOTE_CACHE_CLASSES = {
    "RemoteFxGraphCache": "fx_graph",
    "RemoteAOTAutogradCache": "aot_autograd",
    "RemoteAutotuneCache": "autotune",
    "RemoteBundledAutotuneCache": "autotune",
    "RemoteDynamoPGOCache": "pgo",
}

#: Environment switches, set (unless the user chose otherwise) before torch reads its config.
TORCH_ENV = {
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
    "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
    "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO": "1",
}

#: Switched on only where Triton is installed: autotuning is Triton's, and without it torch's
#: bundled-autotune cache asserts on the missing backend hash (torch 2.13, CPU wheels).
TRITON_ENV = {
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
    "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "1",
    "TRITON_CACHE_MANAGER": "warmstart.compile_cache.triton_manager:WarmstartCacheManager",
}

_TIME_TAKEN_RE = re.compile(rb'"time_taken_ms":\s*(\d+)')


def configure_environment(environ: MutableMapping[str, str], job_id: str | None = None) -> None:
    """Set torch's and Triton's cache switches in ``environ`` (children inherit them).

    Values the user already set win. ``job_id`` becomes torch's PGO job id when none is set.
    """
    import importlib.util

    has_triton = importlib.util.find_spec("triton") is not None
    for name, value in (TORCH_ENV | TRITON_ENV if has_triton else TORCH_ENV).items():
        environ.setdefault(name, value)
    if not (environ.get("TORCH_COMPILE_JOB_ID") or environ.get("TORCH_COMPILE_STICKY_PGO_KEY")):
        environ["TORCH_COMPILE_JOB_ID"] = pgo_job_id(job_id)


def pgo_job_id(job_id: str | None = None) -> str:
    """A stable identity for PGO state: the user's job id, else the entry script or module.

    Restarts and repeats of the same script share it, so dynamic shapes learnt once are reused.
    """
    if job_id:
        return f"warmstart:{job_id}"
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    entry = spec.name if spec is not None else os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python")
    return "warmstart:" + hashlib.sha256(entry.encode()).hexdigest()[:16]


# -- installing patches on import ------------------------------------------------------------

_PATCHES: dict[str, Callable[[ModuleType], None]] = {}
_applied: set[str] = set()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a patch right after a watched module has executed, whoever imports it."""

    def find_spec(self, fullname, path, target=None):  # noqa: D401 - importlib protocol
        if fullname not in _PATCHES or fullname in _applied:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(module.__name__, module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


def _apply(name: str, module: ModuleType) -> None:
    if name in _applied:
        return
    _applied.add(name)
    try:
        _PATCHES[name](module)
    except Exception:  # a torch change must cost caching, never the job
        log.warning("warmstart: could not hook %s (torch %s; checked against %s); compiling uncached",
                    name, getattr(sys.modules.get("torch"), "__version__", "?"), ", ".join(TORCH_VERSIONS_CHECKED),
                    exc_info=log.isEnabledFor(logging.DEBUG))


def install() -> None:
    """Hook every watched torch module: now if already imported, else when it is imported."""
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in list(_PATCHES):
        if name in sys.modules:
            _apply(name, sys.modules[name])
    # Config modules read the environment at import; when torch was imported before
    # warmstart.enable(), switch the flags on directly as well.
    if "torch._inductor.config" in sys.modules:
        _set_torch_flags()


def _set_torch_flags() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for flag, env in (("fx_graph_remote_cache", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"),
                      ("autotune_remote_cache", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"),
                      ("bundled_autotune_remote_cache", "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE")):
        if os.environ.get(env) == "1":
            setattr(inductor_config, flag, True)
    if os.environ.get("TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE") == "1":
        functorch_config.enable_remote_autograd_cache = True
    if "torch._dynamo.config" in sys.modules and os.environ.get("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO") == "1":
        sys.modules["torch._dynamo.config"].automatic_dynamic_remote_pgo = True
    import torch.compiler.config as compiler_config

    if compiler_config.job_id is None and os.environ.get("TORCH_COMPILE_JOB_ID"):
        compiler_config.job_id = os.environ["TORCH_COMPILE_JOB_ID"]


def on_import(module_name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch(module)`` once ``module_name`` is imported (at once if it already is, after
    :func:`install`). Used by other parts of warmstart that hook torch."""
    _PATCHES[module_name] = patch


def _patch(module_name: str) -> Callable[[Callable[[ModuleType], None]], Callable[[ModuleType], None]]:
    def register(fn: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        _PATCHES[module_name] = fn
        return fn

    return register


# -- FX graph, AOTAutograd, autotune, PGO ----------------------------------------------------

@_patch("torch._inductor.remote_cache")
def _hook_remote_caches(remote_cache: ModuleType) -> None:
    backend_base = remote_cache.RemoteCacheBackend

    class StoreBackend(backend_base):  # type: ignore[misc, valid-type]
        """torch's remote-cache backend interface over warmstart's store (bytes in, bytes out)."""

        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

        def _get(self, key: str) -> bytes | None:
            from warmstart.compile_cache import get_store

            store = get_store()
            return store.get(self.kind, key) if store is not None else None

        def _put(self, key: str, data: bytes) -> None:
            from warmstart.compile_cache import get_store

            store = get_store()
            if store is not None:
                match = _TIME_TAKEN_RE.search(data[-200:]) or _TIME_TAKEN_RE.search(data[:200])
                store.put(self.kind, key, data, cost_s=int(match.group(1)) / 1000 if match else 0.0)

    for cls_name, kind in REMOTE_CACHE_CLASSES.items():
        getattr(remote_cache, cls_name).backend_override_cls = functools.partial(StoreBackend, kind)


# -- compiled C++ objects ----------------------------------------------------------------------

@_patch("torch._inductor.cpp_builder")
def _hook_cpp_builder(cpp_builder: ModuleType) -> None:
    original_build = cpp_builder.CppBuilder.build

    def build(self) -> None:
        from warmstart.compile_cache import get_store

        store = get_store()
        key = None
        if store is not None and not getattr(self, "_use_relative_path", False):
            try:
                key = cpp_object_key(self.get_command_line(), self.get_target_file_path())
            except Exception:
                log.debug("no cache key for C++ build", exc_info=True)
        if key is None:
            return original_build(self)
        target = self.get_target_file_path()
        if target.endswith(".gch"):
            # A precompiled header (~150 MB) only speeds up builds that miss; g++ falls back to the
            # plain header next to it when it is absent. Materialise it only when a build needs it.
            with _pch_lock:
                _deferred_pch[target[: -len(".gch")]] = (self, key)
            return None
        data = store.get("cpp_object", key)
        if data is not None and _write_atomic(target, data):
            return None
        _materialize_pch(self.get_command_line(), original_build)
        _build_and_store(self, key, original_build)
        return None

    build.__wrapped__ = original_build  # type: ignore[attr-defined]
    cpp_builder.CppBuilder.build = build


_deferred_pch: dict[str, tuple[object, str]] = {}
_pch_lock = threading.Lock()


def _build_and_store(builder, key: str, original_build: Callable) -> None:
    from warmstart.compile_cache import get_store

    start = time.perf_counter()
    original_build(builder)
    cost = time.perf_counter() - start
    store = get_store()
    try:
        with open(builder.get_target_file_path(), "rb") as f:
            data = f.read()
    except OSError:
        return
    if store is not None:
        store.put("cpp_object", key, data, cost_s=cost)


def _materialize_pch(command_line: str, original_build: Callable) -> None:
    """Fetch or build the deferred precompiled headers that ``command_line`` includes."""
    from warmstart.compile_cache import get_store

    with _pch_lock:
        needed = [(h, _deferred_pch.pop(h)) for h in list(_deferred_pch) if h in command_line]
        for header, (builder, key) in needed:
            target = header + ".gch"
            if os.path.exists(target):
                continue
            store = get_store()
            data = store.get("cpp_object", key) if store is not None else None
            if data is None or not _write_atomic(target, data):
                _build_and_store(builder, key, original_build)


def cpp_object_key(command_line: str, target: str) -> str | None:
    """A machine-independent key for one compiler invocation.

    Inputs that are files (sources, objects) are replaced by the SHA-256 of their contents and the
    output by a placeholder, so two machines with different cache directories agree; every other
    flag (include paths, vector ISA, optimisation, compiler) stays as it is. ``None`` when an input
    cannot be read.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    roots = sorted({os.path.realpath(cache_dir()), cache_dir(), os.path.realpath(default_cache_dir()),
                    default_cache_dir()}, key=len, reverse=True)
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
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.ws{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


# -- the vector-ISA probe ----------------------------------------------------------------------

@_patch("torch._inductor.cpu_vec_isa")
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

        store = get_store()
        try:
            with open(output_path, "rb") as f:
                key = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            key = None
        if store is None or key is None:
            return original_probe(self, output_path)
        if store.get("isa_probe", key) == b"loads":
            return True
        start = time.perf_counter()
        ok = original_probe(self, output_path)
        if ok:
            store.put("isa_probe", key, b"loads", cost_s=time.perf_counter() - start)
        return ok

    _probe_load.__wrapped__ = original_probe  # type: ignore[attr-defined]
    cpu_vec_isa.VecISA._probe_load = _probe_load


# -- recompilations ----------------------------------------------------------------------------

@_patch("torch._dynamo.convert_frame")
def _hook_recompiles(convert_frame: ModuleType) -> None:
    original = convert_frame.get_and_maybe_log_recompilation_reasons

    def counted(*args, **kwargs):
        from warmstart.compile_cache import get_store

        store = get_store()
        if store is not None:
            store.stats.bump("recompiles")
        return original(*args, **kwargs)

    convert_frame.get_and_maybe_log_recompilation_reasons = counted
