"""Installing: a compiled function gets a package of its own, and at its first call the stored frames
for its key are read, checked (globals, folded calls, names taken) and installed into it, or, where
anything is amiss, left out with one log line and the package made fresh again."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import pickle
import re
import sys
import types
import weakref
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache import frame_reads
from warmstart.compile_cache.dynamo_frames.identities import taken_name
from warmstart.compile_cache.dynamo_frames.keys import FORMAT, KIND, entry_key, fingerprint, flavor, variant_key
from warmstart.compile_cache.dynamo_frames.state import STATE, Package, dynamo_compile_lock
from warmstart.compile_cache.dynamo_identity import changed_global
from warmstart.compile_cache.storage import fail_open

log = logging.getLogger("warmstart.cache")

_NUMBERED_GLOBAL = re.compile(r"__\w*?_(\d+)$")


class ReadChanged(Exception):
    """Something a stored frame read is not what it was on the machine that compiled it."""


class _Unusable(Exception):
    """A stored entry this code cannot read (another format, damaged)."""


def packaged_context(rebuild: tuple, fn: Any) -> Any:
    """A context like the one torch made, compiling ``fn`` with a package; ``None`` when ``fn`` is not
    a function with code of its own. The stored frames are looked up and installed at the first call
    (:func:`installing_at_first_call`)."""
    innermost_fn = torch_internals.require("innermost_fn")
    compile_package = torch_internals.require("CompilePackage")

    original_optimize, rebuild_ctx, backend, args, kwargs, backend_id = rebuild
    fn_key, module = _compiled_function(fn)
    innermost = innermost_fn(fn_key)
    function = getattr(innermost, "__func__", innermost)
    if not isinstance(function, types.FunctionType):
        return None
    state = Package(label=function.__qualname__)
    package = compile_package(fn=None, dynamo=None, ignore_inlined_sources=False)
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
    with STATE.lock:
        STATE.packages[package] = state
    context = original_optimize(rebuild_ctx, backend, *args, **dict(kwargs, package=package))
    context._warmstart_flavor = flavor(backend_id, kwargs)  # a module's wrapper calls the context again
    context._warmstart_state = state
    return context


def installing_at_first_call(compiled: Any, state: Package) -> Any:
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


def _first_call(state: Package) -> None:
    """Key and install ``state``'s stored frames; called with ``state.first_call`` held."""
    pending = state.pending
    if pending is None:  # another thread's first call came first
        return
    package, fn_key, function, module_ref, backend_id, dynamic, fullgraph = pending
    try:
        module = module_ref() if module_ref is not None else None
        key = state.key = entry_key(function, module, backend_id, dynamic, fullgraph)
        if key is not None:
            _load(package, state, fn_key, key)
    except Exception as exc:
        fail_open("Dynamo frames read", exc)
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


def _load(package: Any, state: Package, fn_key: Any, key: str) -> bool:
    """Install the stored frames of ``key`` (``state.key``) into ``package`` (initialized fresh, and
    fresh again when this fails); ``False`` (one log line where an entry was found but not used) when
    there is none or it cannot be used."""
    compile_package = torch_internals.require("CompilePackage")

    if key in STATE.refused or STATE.mixed is not None:  # said once; traced as well
        return False
    try:
        found = _read(key)
    except _Unusable as exc:
        log.warning("warmstart: compiled frames of %s not used (%s); Dynamo traces them", state.label, exc)
        STATE.refused.add(key)
        return False
    except Exception as exc:
        fail_open("Dynamo frames read", exc)
        return False
    if found is None:
        return False
    store_key, stored = found
    # Installing builds guards and sets Dynamo's state (entries on code objects, module globals, its
    # name counter), which only Dynamo's compile lock makes safe: the first call may come in one
    # thread while another traces (a compile warm-up beside model building), and torch's guard
    # builders share a dict of helpers that each of them changes for a moment.
    with dynamo_compile_lock():
        if STATE.mixed is not None:  # a context of another flavor came while the entry was read
            return False
        try:
            entry, identities = stored["entry"], stored["identities"]
            unusable = changed_global(identities, entry)
            if unusable is None:
                unusable = frame_reads.changed_fold(stored["folds"])
                if unusable is not None:
                    raise ReadChanged(unusable)
            if unusable is None and store_key not in STATE.installed:
                unusable = taken_name(entry.dynamo)
            if unusable is not None:
                log.warning("warmstart: compiled frames of %s not used: %s; Dynamo traces them", state.label, unusable)
                STATE.refused.add(key)
                return False
            compile_package.__init__(package, None)
            package.initialize(fn_key, entry.dynamo, ignore_inlined_sources=False)
            if store_key not in STATE.installed:  # another instance of the module installed the same frames
                precompile_context = torch_internals.require("PrecompileContext")
                for artifact in entry.backends.values():  # so that a later save of this key has them
                    precompile_context.record_artifact(artifact)
                STATE.loading.values = stored["values"]
                try:
                    with _keep_other_packages(), frame_reads.real_hook_guards():
                        package.install(entry.backends)
                finally:
                    STATE.loading.values = None
                with STATE.lock:
                    STATE.installed_codes.extend(_package_codes(package))
                _skip_installed_names({code.python_module for code in entry.dynamo.codes})
                STATE.installed.add(store_key)
            STATE.stored[store_key] = fingerprint(entry.dynamo.codes)
            state.identities = dict(identities)
            state.values = dict(stored["values"])
            state.folds.update(stored["folds"])
            return True
        except ReadChanged as exc:
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
        STATE.refused.add(key)
        _reset(package)
        package.initialize(fn_key, None, ignore_inlined_sources=False)
        return False


def _decoded(data: bytes) -> dict:
    try:
        stored = pickle.loads(data)  # the store verified the entry's signature
    except Exception as exc:
        raise _Unusable(f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    if not isinstance(stored, dict) or stored.get("format") != FORMAT:
        raise _Unusable("ValueError: an entry of another format")
    return stored


def _read(key: str) -> tuple[str, dict] | None:
    """The stored frames for ``key`` and the key they are stored under: ``key`` itself, or, for frames
    that depend on calls Dynamo folded into constants (a rank, a world size), the variant those calls
    give in this process."""
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is None:
        return None
    data = store.get(KIND, key).value
    if data is None:
        return None
    stored = _decoded(data)
    if "variants_by" not in stored:
        return key, stored
    calls = stored["variants_by"]
    key = variant_key(key, frame_reads.variant(calls, frame_reads.fold_results(calls)))
    data = store.get(KIND, key).value
    if data is None:
        return None
    stored = _decoded(data)
    if "entry" not in stored:
        raise _Unusable("ValueError: an entry of another format")
    return key, stored


def _reset(package: Any) -> None:
    """Make ``package`` fresh again after a failed load: the precompiled entries it may have put on
    code objects are removed, so Dynamo traces those frames.

    Not ``package.uninstall()``: it removes the globals the package installed (compiled graphs,
    resume functions) but clears the entries of the function's own code only, so an entry installed
    on another code object (a resume function, a helper) could be left calling a global that is
    gone. Globals left behind are unused names, and Dynamo's name counter moves past them; entries
    of other packages on the same code go too (those frames are traced).
    """
    reset_precompile_entries = torch_internals.require("reset_precompile_entries")
    compile_package = torch_internals.require("CompilePackage")

    for target in _package_codes(package):
        with contextlib.suppress(Exception):
            reset_precompile_entries(target)
    with contextlib.suppress(Exception):
        _skip_installed_names({entry.python_module for entry in getattr(package, "_codes", {}).values()})
    compile_package.__init__(package, None)


def _package_codes(package: Any) -> list:
    """The code objects a package installs entries on (a helper's: the one its module holds)."""
    lookup_code = torch_internals.require("lookup_code")

    targets = []
    for code, entry in list(getattr(package, "_codes", {}).items()):
        targets.append(code)
        if entry.code_source:
            with contextlib.suppress(Exception):  # not found: nothing was installed on it
                targets.append(lookup_code(entry))
    return targets


@contextlib.contextmanager
def _keep_other_packages():
    # install() first clears the precompiled entries of the function's code: with regional
    # compilation several instances of one class share that code, and each installs its own entries
    # (their guards tell them apart). Clearing would throw away the ones installed before.
    c_eval_frame = torch_internals.require("c_eval_frame")

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
    bytecode_transformation = torch_internals.require("bytecode_transformation")

    highest = -1
    for module_name in module_names:
        for name in vars(sys.modules.get(module_name, types.ModuleType("_"))):
            found = _NUMBERED_GLOBAL.match(name)
            if found:
                highest = max(highest, int(found.group(1)))
    counter = bytecode_transformation._unique_id_counter
    bytecode_transformation._unique_id_counter = itertools.count(max(next(counter), highest + 1))
