"""Dynamo's output through the store: a frame compiled on one machine is neither traced nor guarded
again on the next. Off unless ``WARMSTART_DYNAMO=1``.

A warm start that finds every compiled graph in the cache still runs Dynamo: it traces each frame's
bytecode again and rebuilds its guards, which on a model of many small layers is most of the start.
torch 2.13 can package what Dynamo produced for a compiled function (``torch._dynamo.package``:
each frame's transformed bytecode, its serialized guards, and the compiled graphs it calls, bundled
by AOTAutograd). warmstart stores that package as one entry (kind ``dynamo_frames``), signed and
verified like every other, and installs it at the compiled function's first call.

torch's own switch for this (``TORCH_CACHING_PRECOMPILE=1``) drops the guards it cannot serialize
(identity checks on modules, functions and closures) from the live process as well, and keys entries
by a function's name and first line. warmstart never drops a guard, and checks what a guard cannot:

* A guard torch cannot serialize is kept only when it checks the identity of a *global* object that
  has the same name in every process: a module, a class, a builtin, or a function reachable from its
  module by its qualified name (plus the function's code). The entry records that name, and a
  process installs the entry only if every such global resolves to the same name (and code) there.
  A frame with any other such guard (the identity of a local object, a dict's version, a weak
  reference) is not packaged: a new machine traces it, as without warmstart.
* What the frames read is recorded while Dynamo traces and checked before installing
  (``frame_reads``): the value behind every guard (which torch would otherwise rebuild from the new
  machine's objects), the calls Dynamo folds into constants without a guard (a rank, a world size:
  their results also pick the stored variant a machine reads), and the hook dictionaries Dynamo found
  empty (checked on every call once installed).
* Entries are keyed, at the first call, by the function (module, qualified name, code), the module's
  structure (``repr``) when a module is compiled, the backend's options, ``dynamic`` and
  ``fullgraph``, and torch's Dynamo, AOTAutograd and Inductor configs. torch, Python and the CPU are
  the store's namespace; torch itself checks at load that the source lines of every function it
  inlined are unchanged. Guards on shapes, dtypes, globals and attributes are evaluated on every
  call, as usual.
* Anything that cannot be loaded is traced, with one log line.

Only ``torch.compile`` with the Inductor backend (the default) is packaged, and not with a
``guard_filter_fn`` (which drops guards on purpose) or CUDA graphs from ``mode="reduce-overhead"``
(torch would load the graphs without them). With it on, AOTAutograd bundles the compiled graphs
into its own entries (torch's ``bundled_autograd_cache``), which packages need: the cache then holds
AOTAutograd entries and no separate FX graph entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import pickle
import re
import sys
import threading
import time
import types
import weakref
from typing import Any

from warmstart.compile_cache import frame_reads
from warmstart.compile_cache.dynamo_identity import changed_global, code_digest, global_identity, stable_repr

log = logging.getLogger("warmstart.cache")

KIND = "dynamo_frames"
_FORMAT = 2

#: Guards torch does not serialize that check an object's identity: kept for globals with a name.
_IDENTITY_GUARDS = frozenset({"ID_MATCH", "MODULE_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "CLOSURE_MATCH"})

_NUMBERED_GLOBAL = re.compile(r"__\w*?_(\d+)$")


@dataclasses.dataclass
class _Package:
    """warmstart's record of one ``CompilePackage`` it made."""

    key: str | None = None
    label: str = "?"
    #: (module of the frame, guard source) -> the global's name in every process.
    identities: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    #: digest of a frame's serialized guards -> what its value guards saw (``frame_reads.guard_values``).
    values: dict[bytes, list] = dataclasses.field(default_factory=dict)
    #: calls Dynamo folded into constants without a guard while compiling these frames.
    folds: frame_reads.Folds = dataclasses.field(default_factory=frame_reads.Folds)
    #: why the frame being compiled cannot be packaged, found while tracing it.
    unpackaged: str | None = None
    dirty: bool = False
    compile_s: float = 0.0
    #: what the first call needs to find and install the stored frames (``None`` once it ran).
    pending: tuple | None = None
    #: held by the first call while it installs: a second thread's call waits instead of tracing
    #: into the package being installed.
    first_call: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_packages: "weakref.WeakKeyDictionary[Any, _Package]" = weakref.WeakKeyDictionary()
_lock = threading.RLock()
_compiling = threading.local()  # .state: the _Package of the frame this thread compiles
_enabled: bool | None = None
_installed: set[str] = set()  # keys whose frames this process installed
_refused: set[str] = set()  # keys whose stored frames this process could not use (warned once)
_installed_codes: list = []  # code objects this process put precompiled entries on
_flavors: set[str] = set()  # how this process's torch.compile calls compile (see _note_flavor)
_mixed: str | None = None  # why this process installs no frames (two flavors), once there are two
_stored: dict[str, bytes] = {}  # key -> fingerprint of the frames this process last read or wrote


def enabled() -> bool:
    """Whether this process packages Dynamo's output: warmstart's store is open and
    ``WARMSTART_DYNAMO`` is not ``0``."""
    global _enabled
    from warmstart.compile_cache import get_store

    if get_store() is None:
        return False
    if _enabled is None:
        from warmstart.config import dynamo_frames_setting

        try:
            _enabled = dynamo_frames_setting(os.environ)
        except Exception:  # get_store() already warned about the setting
            _enabled = False
    return _enabled


def reset() -> None:
    """Read ``WARMSTART_DYNAMO`` again on next use (tests, and ``warmstart.enable()``)."""
    global _enabled
    _enabled = None


# -- hooks, installed by torch_hooks -------------------------------------------------------------


def hook_eval_frame(eval_frame: types.ModuleType) -> None:
    """Compile with a package when ``torch.compile`` is applied to a function that qualifies, and
    install the stored one first."""
    original_optimize = eval_frame._optimize
    original_call = eval_frame._TorchDynamoContext.__call__

    def _optimize(rebuild_ctx, backend="inductor", *args, **kwargs):
        context = original_optimize(rebuild_ctx, backend, *args, **kwargs)
        try:
            backend_id = _backend_id(backend, kwargs)
            if isinstance(context, eval_frame._TorchDynamoContext):
                context._warmstart_flavor = _flavor(backend_id, kwargs) if backend_id is not None else None
                if backend_id is not None:
                    context._warmstart_rebuild = (original_optimize, rebuild_ctx, backend, args, kwargs, backend_id)
        except Exception as exc:
            _fail_open("Dynamo frames", exc)
        return context

    def __call__(self, fn):
        # The package is made here, where the function is known: one that does not qualify (or whose
        # package cannot be made) is compiled by the context torch made, without any.
        rebuild = vars(self).pop("_warmstart_rebuild", None)
        if self.callback not in (None, False):  # not torch._dynamo.disable() / run()
            try:
                _note_flavor(vars(self).get("_warmstart_flavor") or f"{_describe(self)}, not packaged")
            except Exception as exc:
                _fail_open("Dynamo frames", exc)
        if rebuild is not None:
            try:
                packaged = _packaged_context(rebuild, fn)
            except Exception as exc:
                _fail_open("Dynamo frames", exc)
                packaged = None
            if packaged is not None:
                return __call__(packaged, fn)
        compiled = original_call(self, fn)
        state = vars(self).get("_warmstart_state")
        if state is not None and isinstance(compiled, types.FunctionType):
            # A module's wrapper (torch.compile(module)) calls the context again with the module's
            # __call__: that function is the one its calls go through.
            return _installing_at_first_call(compiled, state)
        return compiled

    _optimize.__wrapped__ = original_optimize  # type: ignore[attr-defined]
    __call__.__wrapped__ = original_call  # type: ignore[attr-defined]
    eval_frame._optimize = _optimize
    eval_frame._TorchDynamoContext.__call__ = __call__


def _flavor(backend_id: str, kwargs: dict) -> str:
    """How a packaged context compiles: the backend's options (``dynamic`` among them, for
    ``torch.compile``) and ``fullgraph``."""
    return f"{backend_id} fullgraph={bool(kwargs.get('nopython'))}"


def _describe(context: Any) -> str:
    callback = getattr(context, "callback", None)
    backend = getattr(callback, "_torchdynamo_orig_backend", callback)
    return getattr(backend, "__name__", None) or type(backend).__name__


def _note_flavor(flavor: str) -> None:
    """Record how one more ``torch.compile`` call compiles; at the second way, install no more frames.

    Dynamo runs a code object's precompiled entries before it looks at which backend is active, so an
    entry installed for one way of compiling would also run under any other: a function compiled with
    ``backend="eager"`` (or other options, or by ``torch._dynamo.export``) would run Inductor's code
    for every frame it reaches that has an entry. A process that compiles in two ways traces instead.
    """
    global _mixed
    with _lock:
        if flavor in _flavors:
            return
        _flavors.add(flavor)
        if len(_flavors) < 2:
            return
        if _mixed is None:
            _mixed = " and ".join(sorted(_flavors)[:2])
        installed = list(_installed_codes)
        _installed_codes.clear()
    if installed:
        from torch._C._dynamo.eval_frame import _reset_precompile_entries

        with _dynamo_compile_lock():
            for code in installed:
                with contextlib.suppress(Exception):
                    _reset_precompile_entries(code)
    if installed or enabled():  # said only where compiled frames are on
        log.info(
            "warmstart: this process compiles in two ways (%s): compiled frames are not installed; Dynamo traces them",
            _mixed,
        )


def hook_guards(guards: types.ModuleType) -> None:
    """Serialize the guards of warmstart's packages without dropping any (see the module docstring)."""
    manager = guards.CheckFunctionManager
    original = manager.serialize_guards

    def serialize_guards(self, builder, sorted_guards, output_graph):
        state = getattr(_compiling, "state", None)
        if state is None:
            return original(self, builder, sorted_guards, output_graph)
        package = getattr(output_graph, "package", None)
        if package is None:  # torch bypassed this frame already (a graph holding parameters)
            return b""
        try:
            if state.unpackaged is not None:
                raise _NotPackaged(state.unpackaged)
            found = _global_identities(manager, sorted_guards, builder, package)
            with _lock:
                kept = manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
                manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES = ()  # each one checked above
                try:
                    data = original(self, builder, sorted_guards, output_graph)
                finally:
                    manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES = kept
            state.identities.update(found)
            state.values[hashlib.sha256(data).digest()] = frame_reads.guard_values(builder, sorted_guards)
            return data
        except Exception as exc:  # a guard that cannot be kept, or that torch cannot pickle
            state.unpackaged = None
            log.debug("warmstart: a frame of %s is not packaged (traced on new machines): %s", state.label, exc)
        # Not packaged. torch only checks that a guard state exists; a bypassed entry stores none.
        package.bypass_current_entry()
        return b""

    serialize_guards.__wrapped__ = original  # type: ignore[attr-defined]
    manager.serialize_guards = serialize_guards


def hook_package(package_module: types.ModuleType) -> None:
    """Where torch's package raises in the middle of a compile, a warmstart package records the frame
    as not packaged instead (traced on new machines):

    * a function the compiled one calls, which Dynamo compiles as a frame of its own, but that no
      name in its module leads to (a lambda in a dict, a function made by ``exec``);
    * an inlined function whose source cannot be read (code read from standard input).
    """
    package_class = package_module.CompilePackage

    def record_unnamed(package, code):
        import inspect

        module = inspect.getmodule(code)
        package._add_function(code, module.__name__ if module is not None else package._innermost_fn.__module__)
        package._codes[code].bypassed = True

    # torch records the source lines of every function a frame inlined, to check them at load
    for name, what, instead in (
        ("_add_user_function", "a frame %s calls", record_unnamed),
        ("add_inlined_source", "a frame of %s", lambda package, _: package.bypass_current_entry()),
    ):
        setattr(package_class, name, _not_packaged_on_error(getattr(package_class, name), what, instead))
    _hook_guard_loading(package_module)


class _ReadChanged(Exception):
    """Something a stored frame read is not what it was on the machine that compiled it."""


_loading = threading.local()  # .values: the entry's recorded guard values while this thread installs it


def _hook_guard_loading(package_module: types.ModuleType) -> None:
    """While warmstart installs an entry, check each frame's guard values against the producer's before
    torch builds its guards (``frame_reads``)."""
    original = package_module.load_guards_state

    def load_guards_state(guards_state: bytes):
        state = original(guards_state)
        values = getattr(_loading, "values", None)
        if values is not None:
            expected = values.get(hashlib.sha256(guards_state).digest())
            if expected is None:  # not what warmstart stored: damaged, or written by other code
                raise ValueError("a frame's guards have no recorded values")
            changed = frame_reads.changed_value(expected, state)
            if changed is not None:
                raise _ReadChanged(changed)
        return state

    load_guards_state.__wrapped__ = original  # type: ignore[attr-defined]
    package_module.load_guards_state = load_guards_state


def hook_constant_folds(torch_variables: types.ModuleType) -> None:
    """Record each call Dynamo folds into a constant without a guard (``torch.distributed.get_rank()``
    and the like) in the package whose frame is being compiled."""
    variable = torch_variables.TorchInGraphFunctionVariable
    original = variable.call_function
    from torch._dynamo.utils import check_unspec_or_constant_args

    needs_guards = torch_variables.constant_fold_functions_need_guards
    pure = frame_reads.pure_folds()

    def call_function(self, tx, args, kwargs):
        state = getattr(_compiling, "state", None)
        if state is not None and self.value not in needs_guards and self.value not in pure:
            try:
                if (
                    self.can_constant_fold_through()
                    and check_unspec_or_constant_args(args, kwargs)
                    and getattr(self.value, "__module__", None) != "math"
                ):
                    consts = [a.as_python_constant() for a in args]
                    named = {k: v.as_python_constant() for k, v in kwargs.items()}
                    state.folds.record(self.value, tuple(consts), named, self.value(*consts, **named))
            except frame_reads.UnrecordedFold as exc:
                state.unpackaged = f"a call folded into a constant: {exc}"
            except Exception:
                pass  # torch raises the same inside the call below
        return original(self, tx, args, kwargs)

    call_function.__wrapped__ = original  # type: ignore[attr-defined]
    variable.call_function = call_function


def _not_packaged_on_error(original: Any, what: str, instead: Any) -> Any:
    """``original(package, arg)``, or, where it raises for a warmstart package, ``instead(package, arg)``."""

    def wrapper(self, arg):
        try:
            return original(self, arg)
        except Exception as exc:
            state = _packages.get(self)
            if state is None:  # torch's own precompile: its behaviour
                raise
            log.debug("warmstart: %s is not packaged (traced on new machines): %s", what % state.label, exc)
        return instead(self, arg)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _unresolved(code: Any) -> bool:
    """Whether a package's entry for a code object is one :func:`hook_package` recorded: no new
    machine could find that code, so it is not stored."""
    return code.bypassed and code.code_source is None and not code.install_to_global and not code.function_names


def hook_precompile_context(precompile_context: types.ModuleType) -> None:
    """Save a package once AOTAutograd has recorded the compiled graphs its frames call (a training
    graph's backward is compiled at the first backward, after the frame compile returned)."""
    context = precompile_context.PrecompileContext
    original = context.record_artifact.__func__

    def record_artifact(cls, artifact) -> None:
        original(cls, artifact)
        if _packages:
            _save_ready()

    record_artifact.__wrapped__ = original  # type: ignore[attr-defined]
    context.record_artifact = classmethod(record_artifact)


def hook_autograd_cache(autograd_cache: types.ModuleType) -> None:
    """Leave the package's name for a compiled graph out of AOTAutograd's cache key.

    A frame compiled with a package names its graph with a new UUID (``__compiled_fn_1_<uuid>``), and
    torch hashes that name into the AOTAutograd key: a frame that is not packaged (or a machine
    that did not load the package) would never find the AOTAutograd entry another machine stored.
    torch stores the entry without the name and gives it the loader's own on a hit, so the name is
    not part of what the entry is.
    """
    pickler = autograd_cache.AOTAutogradCachePickler
    original = pickler._reduce_aot_config

    def _reduce_aot_config(self, aot_config):
        reduce, fields = original(self, aot_config)
        name = getattr(aot_config, "precompile_backend_id", None)
        if name is not None and fields and fields[-1] == name:
            fields = fields[:-1] + (None,)
        return reduce, fields

    _reduce_aot_config.__wrapped__ = original  # type: ignore[attr-defined]
    pickler._reduce_aot_config = _reduce_aot_config


@contextlib.contextmanager
def frame_compile(package: Any):
    """Around one frame's compile (``convert_frame._compile``): count its cost, save when done."""
    state = _packages.get(package) if package is not None else None
    if state is None:
        yield
        return
    outer = getattr(_compiling, "state", None)
    _compiling.state = state
    start = time.perf_counter()
    try:
        yield
    finally:
        _compiling.state = outer
        state.compile_s += time.perf_counter() - start
        state.dirty = True
    _save_ready()


# -- making and installing packages -----------------------------------------------------------------


def _backend_id(backend: Any, kwargs: dict) -> str | None:
    """Inductor's options as a stable string; ``None`` when this compile is not packaged: another
    backend, a ``guard_filter_fn`` (it drops guards on purpose), torch's own precompile, or off."""
    if kwargs.get("package") is not None or kwargs.get("guard_filter_fn") is not None or not enabled():
        return None
    import torch._dynamo.config as dynamo_config

    if dynamo_config.caching_precompile:
        return None
    if backend == "inductor":
        return "inductor"
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        config = getattr(backend, "config", {})
        if config.get("triton.cudagraphs"):
            return None  # torch loads a packaged graph with the global CUDA-graphs flag, not the mode's
        options = sorted((str(k), stable_repr(v)) for k, v in config.items())
        return f"inductor {options} dynamic={getattr(backend, 'dynamic', None)}"
    return None


def _packaged_context(rebuild: tuple, fn: Any) -> Any:
    """A context like the one torch made, compiling ``fn`` with a package; ``None`` when ``fn`` is not
    a function with code of its own. The stored frames are looked up and installed at the first call
    (:func:`_installing_at_first_call`)."""
    from torch._dynamo.eval_frame import innermost_fn
    from torch._dynamo.package import CompilePackage

    original_optimize, rebuild_ctx, backend, args, kwargs, backend_id = rebuild
    fn_key, module = _compiled_function(fn)
    innermost = innermost_fn(fn_key)
    function = getattr(innermost, "__func__", innermost)
    if not isinstance(function, types.FunctionType):
        return None
    state = _Package(label=function.__qualname__)
    package = CompilePackage(fn=None, dynamo=None, ignore_inlined_sources=False)
    package.initialize(fn_key, None, ignore_inlined_sources=False)
    state.pending = (
        package,
        fn_key,
        function,
        weakref.ref(module) if module is not None else None,
        backend_id,
        kwargs.get("dynamic"),
        bool(kwargs.get("nopython")),
    )
    with _lock:
        _packages[package] = state
    context = original_optimize(rebuild_ctx, backend, *args, **dict(kwargs, package=package))
    context._warmstart_flavor = _flavor(backend_id, kwargs)  # a module's wrapper calls the context again
    context._warmstart_state = state
    return context


def _installing_at_first_call(compiled: Any, state: _Package) -> Any:
    """``compiled``, which first installs the stored frames of ``state``'s function.

    Plain torch traces at the first call, and reads then what the frames depend on: torch's configs,
    hooks, process groups and attributes set after ``torch.compile()``. The key and every check of the
    stored frames are made at that moment too.
    """

    @functools.wraps(compiled)
    def first_call_installs(*args, **kwargs):
        if state.pending is not None:
            with state.first_call:
                _first_call(state)
        return compiled(*args, **kwargs)

    first_call_installs._torchdynamo_wrapper_id = id(first_call_installs)  # type: ignore[attr-defined]
    first_call_installs._torchdynamo_orig_callable = compiled  # type: ignore[attr-defined]
    return first_call_installs


def _first_call(state: _Package) -> None:
    """Key and install ``state``'s stored frames; called with ``state.first_call`` held."""
    pending = state.pending
    if pending is None:  # another thread's first call came first
        return
    package, fn_key, function, module_ref, backend_id, dynamic, fullgraph = pending
    try:
        module = module_ref() if module_ref is not None else None
        state.key = _key(function, module, backend_id, dynamic, fullgraph)
        _load(package, state, fn_key)
    except Exception as exc:
        _fail_open("Dynamo frames read", exc)
    finally:
        state.pending = None  # only now: a call that finds it None runs what was installed


def _compiled_function(fn: Any) -> tuple[Any, Any]:
    """The function whose frames are packaged, and the module instance when a module is compiled."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return fn.forward, fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__func__", None) is torch.nn.Module._call_impl:
        return owner.forward, owner  # Module.compile() compiles _call_impl; Dynamo starts in forward
    return fn, None


def _load(package: Any, state: _Package, fn_key: Any) -> bool:
    """Install the stored frames of ``state.key`` into ``package`` (initialized fresh, and fresh again
    when this fails); ``False`` (one log line where an entry was found but not used) when there is
    none or it cannot be used."""
    from torch._dynamo.package import CompilePackage

    if state.key in _refused or _mixed is not None:  # said once; traced as well
        return False
    try:
        found = _read(state.key)
    except _Unusable as exc:
        log.warning("warmstart: compiled frames of %s not used (%s); Dynamo traces them", state.label, exc)
        _refused.add(state.key)
        return False
    except Exception as exc:
        _fail_open("Dynamo frames read", exc)
        return False
    if found is None:
        return False
    store_key, stored = found
    # Installing builds guards and sets Dynamo's state (entries on code objects, module globals, its
    # name counter), which only Dynamo's compile lock makes safe: the first call may come in one
    # thread while another traces (a compile warm-up beside model building), and torch's guard
    # builders share a dict of helpers that each of them changes for a moment.
    with _dynamo_compile_lock():
        if _mixed is not None:  # a context of another flavor came while the entry was read
            return False
        try:
            entry, identities = stored["entry"], stored["identities"]
            unusable = changed_global(identities, entry)
            if unusable is None:
                unusable = frame_reads.changed_fold(stored["folds"])
                if unusable is not None:
                    raise _ReadChanged(unusable)
            if unusable is None and store_key not in _installed:
                unusable = _taken_name(entry.dynamo)
            if unusable is not None:
                log.warning("warmstart: compiled frames of %s not used: %s; Dynamo traces them", state.label, unusable)
                _refused.add(state.key)
                return False
            CompilePackage.__init__(package, None)
            package.initialize(fn_key, entry.dynamo, ignore_inlined_sources=False)
            if store_key not in _installed:  # another instance of the module installed the same frames
                from torch._dynamo.precompile_context import PrecompileContext

                for artifact in entry.backends.values():  # so that a later save of this key has them
                    PrecompileContext.record_artifact(artifact)
                _loading.values = stored["values"]
                try:
                    with _keep_other_packages(), frame_reads.real_hook_guards():
                        package.install(entry.backends)
                finally:
                    _loading.values = None
                with _lock:
                    _installed_codes.extend(_package_codes(package))
                _skip_installed_names({code.python_module for code in entry.dynamo.codes})
                _installed.add(store_key)
            _stored[store_key] = _fingerprint(entry.dynamo.codes)
            state.identities = dict(identities)
            state.values = dict(stored["values"])
            state.folds.update(stored["folds"])
            return True
        except _ReadChanged as exc:
            log.info(
                "warmstart: compiled frames of %s not used: %s on the machine that compiled them; Dynamo traces them",
                state.label,
                exc,
            )
        except Exception as exc:
            log.warning(
                "warmstart: compiled frames of %s not used (%s: %s); Dynamo traces them",
                state.label,
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )
        _refused.add(state.key)
        _reset(package)
        package.initialize(fn_key, None, ignore_inlined_sources=False)
        return False


class _Unusable(Exception):
    """A stored entry this code cannot read (another format, damaged)."""


def _decoded(data: bytes) -> dict:
    try:
        stored = pickle.loads(data)  # the store verified the entry's signature
    except Exception as exc:
        raise _Unusable(f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    if not isinstance(stored, dict) or stored.get("format") != _FORMAT:
        raise _Unusable("ValueError: an entry of another format")
    return stored


def _read(key: str) -> tuple[str, dict] | None:
    """The stored frames for ``key`` and the key they are stored under: ``key`` itself, or, for frames
    that depend on calls Dynamo folded into constants (a rank, a world size), the variant those calls
    give in this process."""
    from warmstart.compile_cache import get_store

    store = get_store()
    data = store.get(KIND, key).value if store is not None else None
    if data is None:
        return None
    stored = _decoded(data)
    if "variants_by" not in stored:
        return key, stored
    calls = stored["variants_by"]
    key = _variant_key(key, frame_reads.variant(calls, frame_reads.fold_results(calls)))
    data = store.get(KIND, key).value
    if data is None:
        return None
    stored = _decoded(data)
    if "entry" not in stored:
        raise _Unusable("ValueError: an entry of another format")
    return key, stored


def _variant_key(key: str, variant: str) -> str:
    return hashlib.sha256(f"{key}\0{variant}".encode()).hexdigest()


def _taken_name(entry: Any) -> str | None:
    """A global the entry would install that its module holds already as something else, as a phrase.

    Resume functions are named by the producer's counter (``__resume_at_30_1``): a function traced
    in this process, or installed from another producer's entry, may hold the same name in the same
    module, and installing over it would make that function's frames resume in the wrong code.
    """
    from torch._dynamo.package import SerializedCode

    for code in entry.codes:
        if not code.install_to_global:
            continue
        scope = vars(sys.modules[code.python_module])
        taken = [name for name in code.function_names if name in scope]
        python_code = SerializedCode.to_code_object(code.python_code) if taken else None
        for name in taken:
            if not _same_function(scope[name], python_code):
                return f"{name} in {code.python_module} is another function"
    return None


def _same_function(found: Any, code: types.CodeType) -> bool:
    # torch installs a resume function with free variables as a factory holding its code
    if isinstance(found, types.FunctionType):
        return found.__code__ == code or code in (found.__defaults__ or ())
    return False


def _dynamo_compile_lock() -> Any:
    """Dynamo's own lock around frame compiles (reentrant: taken again inside a compile)."""
    from torch._dynamo import convert_frame

    return convert_frame.compile_lock


def _reset(package: Any) -> None:
    """Make ``package`` fresh again after a failed load: the precompiled entries it may have put on
    code objects are removed, so Dynamo traces those frames.

    Not ``package.uninstall()``: it removes the globals the package installed (compiled graphs,
    resume functions) but clears the entries of the function's own code only, so an entry installed
    on another code object (a resume function, a helper) could be left calling a global that is
    gone. Globals left behind are unused names, and Dynamo's name counter moves past them; entries
    of other packages on the same code go too (those frames are traced).
    """
    from torch._C._dynamo.eval_frame import _reset_precompile_entries
    from torch._dynamo.package import CompilePackage

    for target in _package_codes(package):
        with contextlib.suppress(Exception):
            _reset_precompile_entries(target)
    with contextlib.suppress(Exception):
        _skip_installed_names({entry.python_module for entry in getattr(package, "_codes", {}).values()})
    CompilePackage.__init__(package, None)


def _package_codes(package: Any) -> list:
    """The code objects a package installs entries on (a helper's: the one its module holds)."""
    from torch._dynamo.package import _lookup_code

    targets = []
    for code, entry in list(getattr(package, "_codes", {}).items()):
        targets.append(code)
        if entry.code_source:
            with contextlib.suppress(Exception):  # not found: nothing was installed on it
                targets.append(_lookup_code(entry))
    return targets


@contextlib.contextmanager
def _keep_other_packages():
    # install() first clears the precompiled entries of the function's code: with regional
    # compilation several instances of one class share that code, and each installs its own entries
    # (their guards tell them apart). Clearing would throw away the ones installed before.
    from torch._C._dynamo import eval_frame as c_eval_frame

    original = c_eval_frame._reset_precompile_entries
    c_eval_frame._reset_precompile_entries = lambda code: None
    try:
        yield
    finally:
        c_eval_frame._reset_precompile_entries = original


def _skip_installed_names(module_names: set[str]) -> None:
    # Installing puts globals named by the producer's counter (``__builtins_dict___0``) into the
    # frames' modules. Dynamo names the globals of a frame it traces later with this process's
    # counter, starting at 0, and fails on a name that exists: move the counter past them.
    from torch._dynamo import bytecode_transformation

    highest = -1
    for module_name in module_names:
        for name in vars(sys.modules.get(module_name, types.ModuleType("_"))):
            found = _NUMBERED_GLOBAL.match(name)
            if found:
                highest = max(highest, int(found.group(1)))
    counter = bytecode_transformation._unique_id_counter
    bytecode_transformation._unique_id_counter = itertools.count(max(next(counter), highest + 1))


# -- saving ----------------------------------------------------------------------------------------


def _save_ready() -> None:
    """Save every key with new frames whose compiled graphs are all recorded."""
    with _lock:
        keys = {s.key for p, s in list(_packages.items()) if s.dirty and s.key is not None}
    for key in keys:
        try:
            with _dynamo_compile_lock():  # a backward's graphs are recorded outside any frame compile
                _save(key)
        except Exception as exc:
            for state in list(_packages.values()):
                if state.key == key:
                    state.dirty = False
            _fail_open("Dynamo frames write", exc)


def _save(key: str) -> None:
    """Store what this process's packages for ``key`` hold, as one entry.

    Several packages share a key when instances of one module class are compiled one by one
    (regional compilation): each holds the frames it compiled (the first layer's input does not
    require grad, the next ones' does), and the stored entry must hold them all.
    """
    from torch._dynamo.package import PrecompileCacheEntry, SourceInfo, _DynamoCacheEntry
    from torch._dynamo.precompile_context import PrecompileContext

    from warmstart.compile_cache import get_store

    artifacts = PrecompileContext._backend_artifacts_by_key
    merged: dict[tuple, Any] = {}
    seen: set[bytes] = set()
    identities: dict[tuple[str, str], str] = {}
    values: dict[bytes, list] = {}
    folds: dict[tuple[str, bytes], str] = {}
    inlined: set = set()
    compile_s, saved, device_type = 0.0, [], "cpu"
    with _lock:
        parts = [(p, s) for p, s in list(_packages.items()) if s.key == key and p.is_initialized()]
    for package, state in parts:
        if package._current_entry is not None:
            continue  # compiling a frame now: saved when that ends
        entry = package.cache_entry()
        if any(backend not in artifacts for code in entry.codes if not code.bypassed for backend in code.backend_ids):
            continue  # the backward is compiled at the first backward: saved then
        for index, code in enumerate(entry.codes):
            if index == 0 or not _unresolved(code):  # the first is the compiled function's own
                _merge(merged, code, seen)
        inlined |= entry.source_info.inlined_sources
        device_type = entry.device_type
        identities.update(state.identities)
        values.update(state.values)
        folds.update(state.folds.calls)
        compile_s += state.compile_s
        saved.append(state)
    for state in saved:
        state.dirty = False
    # A code object without guarded code is stored as not packaged: torch would mark it as one Dynamo
    # skips, and a new machine must trace it instead.
    codes = [
        code if code.guarded_codes or code.bypassed else dataclasses.replace(code, bypassed=True)
        for code in merged.values()
    ]
    if not saved or not any(not code.bypassed for code in codes):
        return
    store_key = key
    if folds:  # one entry per result of those calls, found through a record of which calls they are
        calls = sorted(folds)
        store_key = _variant_key(key, frame_reads.variant(calls, [folds[c] for c in calls]))
    fingerprint = _fingerprint(codes)
    if _stored.get(store_key) == fingerprint:
        return  # the store holds these frames already
    entry = _DynamoCacheEntry(
        codes=codes,
        source_info=SourceInfo(inlined_sources=inlined),
        device_type=device_type,
        fn_name=codes[0].python_code.co_qualname,
        fn_first_lineno=codes[0].python_code.co_firstlineno,
    )
    full = PrecompileCacheEntry.from_cache_entry(entry, artifacts)
    data = pickle.dumps(
        {"format": _FORMAT, "entry": full, "identities": identities, "values": values, "folds": folds},
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    _stored[store_key] = fingerprint
    store = get_store()
    if store is not None:
        if folds:
            index = pickle.dumps({"format": _FORMAT, "variants_by": sorted(folds)}, protocol=pickle.HIGHEST_PROTOCOL)
            store.put(KIND, key, index, cost_s=compile_s)
        store.put(KIND, store_key, data, cost_s=compile_s)


def _fingerprint(codes: list) -> bytes:
    """What a set of code entries would install: which codes, bypassed or not, with which guarded code."""
    h = hashlib.sha256()
    for code in codes:
        h.update(repr((_code_ident(code), code.bypassed)).encode())
        for digest in sorted(_guarded_digest(g) for g in code.guarded_codes):
            h.update(digest)
    return h.digest()


def _code_ident(code: Any) -> tuple:
    return (
        code.python_module,
        code.code_source,
        code.install_to_global,
        tuple(code.function_names) if code.install_to_global else (),
        code.python_code.co_qualname,
        code.python_code.co_firstlineno,
    )


def _guarded_digest(guarded_code: Any) -> bytes:
    return hashlib.sha256(guarded_code.guards_state + pickle.dumps(guarded_code.dynamo_code)).digest()


def _merge(merged: dict[tuple, Any], code: Any, seen: set[bytes]) -> None:
    """Add one package's entry for a code object to ``merged`` (an entry per code object)."""
    ident = _code_ident(code)
    guarded = []
    for guarded_code in code.guarded_codes:
        digest = _guarded_digest(guarded_code)
        if digest not in seen:
            seen.add(digest)
            guarded.append(guarded_code)
    have = merged.get(ident)
    if have is None:
        merged[ident] = dataclasses.replace(
            code,
            guarded_codes=guarded,
            backend_ids=list(code.backend_ids),
            import_sources=dict(code.import_sources),
            function_names=list(code.function_names),
        )
        return
    if code.bypassed and not have.bypassed:
        return
    if have.bypassed and not code.bypassed:
        merged[ident] = have = dataclasses.replace(have, bypassed=False, guarded_codes=[], backend_ids=[])
    have.guarded_codes.extend(guarded)
    have.backend_ids.extend(b for b in code.backend_ids if b not in have.backend_ids)
    have.import_sources.update(code.import_sources)
    have.function_names.extend(n for n in code.function_names if n not in have.function_names)
    have.has_compile_id = have.has_compile_id or code.has_compile_id


# -- keys ----------------------------------------------------------------------------------------


def _key(function: types.FunctionType, module: Any, backend_id: str, dynamic: Any, fullgraph: bool) -> str:
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    h = hashlib.sha256()
    for part in (
        f"format={_FORMAT}",
        function.__module__,
        function.__qualname__,
        code_digest(function.__code__),
        f"{type(module).__module__}.{type(module).__qualname__}\n{module!r}" if module is not None else "",
        backend_id,
        f"dynamic={dynamic} fullgraph={fullgraph}",
    ):
        h.update(part.encode() + b"\0")
    for config in (torch._dynamo.config, torch._functorch.config, torch._inductor.config):
        # Paths (where torch is installed, where debug output goes: the working directory) are this
        # machine's and change nothing Dynamo or Inductor produce.
        settings = sorted(
            (k, v) for k, v in config.save_config_portable().items() if not (isinstance(v, str) and os.path.isabs(v))
        )
        h.update(stable_repr(settings).encode() + b"\0")
    return h.hexdigest()


# -- identities of globals -------------------------------------------------------------------------


class _NotPackaged(Exception):
    """A guard of the frame cannot be kept in a package."""


def _global_identities(manager: Any, sorted_guards: list, builder: Any, package: Any) -> dict[tuple[str, str], str]:
    """The names of the globals behind the guards torch does not serialize.

    Raises:
        _NotPackaged: one of those guards is not an identity check on a global with a name.
    """
    unsupported = manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    module_name = package._current_entry.python_module
    found: dict[tuple[str, str], str] = {}
    for guard in sorted_guards:
        kind = guard.create_fn_name()
        if kind in ("TYPE_MATCH", "BUILTIN_MATCH"):
            continue  # torch serializes these itself, or refuses (then the frame is not packaged)
        derived = [t for t in (guard.guard_types or ()) if t in unsupported]
        if kind not in unsupported and not derived:
            continue
        if kind not in _IDENTITY_GUARDS or any(t not in _IDENTITY_GUARDS for t in derived):
            raise _NotPackaged(f"{kind} guard on {guard.name}")
        # torch rebuilds the guard at load from the object the source names there: a global of the
        # frame's module, or for a local (``self.activation``) what its pickled value names (pickle
        # stores functions, classes and builtins by name). Either way the object must have a name.
        identity = global_identity(builder.get(guard))
        if identity is None:
            raise _NotPackaged(f"{kind} guard on {guard.name}, which has no name in other processes")
        found[(module_name, guard.name)] = identity
    return found


def _fail_open(where: str, exc: BaseException) -> None:
    from warmstart.compile_cache import torch_hooks

    torch_hooks._fail_open(where, exc)
