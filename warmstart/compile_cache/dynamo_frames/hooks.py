"""The hooks on torch's internals that package Dynamo's output, installed by ``torch_hooks``: where
``torch.compile`` is applied, where guards are serialized and loaded, where constants are folded and
compiled graphs recorded, AOTAutograd's cache key, and around each frame's compile."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import types
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache import frame_reads
from warmstart.compile_cache.dynamo_frames.identities import NotPackaged, global_identities
from warmstart.compile_cache.dynamo_frames.install import ReadChanged, installing_at_first_call, packaged_context
from warmstart.compile_cache.dynamo_frames.keys import backend_id, flavor
from warmstart.compile_cache.dynamo_frames.save import save_ready
from warmstart.compile_cache.dynamo_frames.state import STATE, dynamo_compile_lock, enabled
from warmstart.compile_cache.storage import fail_open

log = logging.getLogger("warmstart.cache")


def hook_eval_frame(eval_frame: types.ModuleType) -> None:
    """Compile with a package when ``torch.compile`` is applied to a function that qualifies, and
    install the stored one first."""
    original_optimize = eval_frame._optimize
    original_call = eval_frame._TorchDynamoContext.__call__

    def _optimize(rebuild_ctx, backend="inductor", *args, **kwargs):
        context = original_optimize(rebuild_ctx, backend, *args, **kwargs)
        try:
            packaged_as = backend_id(backend, kwargs)
            if isinstance(context, eval_frame._TorchDynamoContext):
                context._warmstart_flavor = flavor(packaged_as, kwargs) if packaged_as is not None else None
                if packaged_as is not None:
                    context._warmstart_rebuild = (original_optimize, rebuild_ctx, backend, args, kwargs, packaged_as)
        except Exception as exc:
            fail_open("Dynamo frames", exc)
        return context

    def __call__(self, fn):
        # The package is made here, where the function is known: one that does not qualify (or whose
        # package cannot be made) is compiled by the context torch made, without any.
        rebuild = vars(self).pop("_warmstart_rebuild", None)
        if self.callback not in (None, False):  # not torch._dynamo.disable() / run()
            try:
                note_flavor(vars(self).get("_warmstart_flavor") or f"{_describe(self)}, not packaged")
            except Exception as exc:
                fail_open("Dynamo frames", exc)
        if rebuild is not None:
            try:
                packaged = packaged_context(rebuild, fn)
            except Exception as exc:
                fail_open("Dynamo frames", exc)
                packaged = None
            if packaged is not None:
                return __call__(packaged, fn)
        compiled = original_call(self, fn)
        state = vars(self).get("_warmstart_state")
        if state is not None and isinstance(compiled, types.FunctionType):
            # A module's wrapper (torch.compile(module)) calls the context again with the module's
            # __call__: that function is the one its calls go through.
            return installing_at_first_call(compiled, state)
        return compiled

    _optimize.__wrapped__ = original_optimize  # type: ignore[attr-defined]
    __call__.__wrapped__ = original_call  # type: ignore[attr-defined]
    _replace_global(eval_frame, "_optimize", _optimize)
    eval_frame._TorchDynamoContext.__call__ = __call__


def _describe(context: Any) -> str:
    callback = getattr(context, "callback", None)
    backend = getattr(callback, "_torchdynamo_orig_backend", callback)
    return getattr(backend, "__name__", None) or type(backend).__name__


def note_flavor(flavor: str) -> None:
    """Record how one more ``torch.compile`` call compiles; at the second way, install no more frames.

    Dynamo runs a code object's precompiled entries before it looks at which backend is active, so an
    entry installed for one way of compiling would also run under any other: a function compiled with
    ``backend="eager"`` (or other options, or by ``torch._dynamo.export``) would run Inductor's code
    for every frame it reaches that has an entry. A process that compiles in two ways traces instead.
    """
    with STATE.lock:
        if flavor in STATE.flavors:
            return
        STATE.flavors.add(flavor)
        if len(STATE.flavors) < 2:
            return
        if STATE.mixed is None:
            STATE.mixed = " and ".join(sorted(STATE.flavors)[:2])
        installed = list(STATE.installed_codes)
        STATE.installed_codes.clear()
    if installed:
        reset_precompile_entries = torch_internals.require("reset_precompile_entries")
        with dynamo_compile_lock():
            for code in installed:
                with contextlib.suppress(Exception):
                    reset_precompile_entries(code)
    if installed or enabled():  # said only where compiled frames are on
        log.info(
            "warmstart: this process compiles in two ways (%s): compiled frames are not installed; Dynamo traces them",
            STATE.mixed,
        )


def hook_guards(guards: types.ModuleType) -> None:
    """Serialize the guards of warmstart's packages without dropping any (see the package docstring)."""
    manager = guards.CheckFunctionManager
    original = manager.serialize_guards

    def serialize_guards(self, builder, sorted_guards, output_graph):
        state = getattr(STATE.compiling, "state", None)
        if state is None:
            return original(self, builder, sorted_guards, output_graph)
        package = getattr(output_graph, "package", None)
        if package is None:  # torch bypassed this frame already (a graph holding parameters)
            return b""
        try:
            if state.unpackaged is not None:
                raise NotPackaged(state.unpackaged)
            found = global_identities(manager, sorted_guards, builder, package)
            with STATE.lock:
                kept = manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
                manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES = ()  # each one checked above
                try:
                    data = original(self, builder, sorted_guards, output_graph)
                finally:
                    manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES = kept
            state.identities.update(found)
            state.values[hashlib.sha256(data).digest()] = frame_reads.guard_values(builder, sorted_guards, output_graph)
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


def _hook_guard_loading(package_module: types.ModuleType) -> None:
    """While warmstart installs an entry, check each frame's guard values against the producer's before
    torch builds its guards (``frame_reads``)."""
    original = package_module.load_guards_state

    def load_guards_state(guards_state: bytes):
        state = original(guards_state)
        values = getattr(STATE.loading, "values", None)
        if values is not None:
            expected = values.get(hashlib.sha256(guards_state).digest())
            if expected is None:  # not what warmstart stored: damaged, or written by other code
                raise ValueError("a frame's guards have no recorded values")
            changed = frame_reads.changed_value(expected, state)
            if changed is not None:
                raise ReadChanged(changed)
        return state

    load_guards_state.__wrapped__ = original  # type: ignore[attr-defined]
    _replace_global(package_module, "load_guards_state", load_guards_state)


def hook_constant_folds(torch_variables: types.ModuleType) -> None:
    """Record each call Dynamo folds into a constant without a guard (``torch.distributed.get_rank()``
    and the like) in the package whose frame is being compiled."""
    variable = torch_variables.TorchInGraphFunctionVariable
    original = variable.call_function
    check_unspec_or_constant_args = torch_internals.require("check_unspec_or_constant_args")

    needs_guards = torch_variables.constant_fold_functions_need_guards
    pure = frame_reads.pure_folds()

    def call_function(self, tx, args, kwargs):
        state = getattr(STATE.compiling, "state", None)
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
            state = STATE.packages.get(self)
            if state is None:  # torch's own precompile: its behaviour
                raise
            log.debug("warmstart: %s is not packaged (traced on new machines): %s", what % state.label, exc)
        return instead(self, arg)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def hook_precompile_context(precompile_context: types.ModuleType) -> None:
    """Save a package once AOTAutograd has recorded the compiled graphs its frames call (a training
    graph's backward is compiled at the first backward, after the frame compile returned)."""
    context = precompile_context.PrecompileContext
    original = context.record_artifact.__func__

    def record_artifact(cls, artifact) -> None:
        original(cls, artifact)
        if STATE.packages:
            save_ready()

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
    state = STATE.packages.get(package) if package is not None else None
    if state is None:
        yield
        return
    outer = getattr(STATE.compiling, "state", None)
    STATE.compiling.state = state
    start = time.perf_counter()
    try:
        yield
    finally:
        STATE.compiling.state = outer
        state.compile_s += time.perf_counter() - start
        state.dirty = True
    save_ready()


def _replace_global(module: types.ModuleType, name: str, value: Any) -> None:
    # A torch module's global, replaced in its namespace (what assigning the attribute does):
    # ModuleType declares no attributes of its own to assign.
    vars(module)[name] = value
