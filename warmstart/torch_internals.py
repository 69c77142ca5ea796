"""Every private torch name warmstart uses, what is lost without it, and the one way to reach it.

torch's private modules (``torch._dynamo``, ``torch._inductor``, ``torch._functorch``,
``torch.utils._*``) change between releases without notice. Each name warmstart reads from them is
an entry of :data:`INTERNALS`, with the releases it was checked on (``torch_support``); code reaches
it through :func:`resolve` (``None`` where it is gone) or :func:`require` (a
:class:`MissingTorchInternal` where the caller already fails open), never by importing it, so that a
torch that moved one name costs the feature that needs it, after one warning, and never the job. The
functions ``torch_hooks`` wraps are checked here too (:data:`PATCHED`, before a patch goes in), with
which of those patches went in (:func:`unhooked`). This module imports no torch: a name's module is
imported when the name is first asked for, where the caller would have imported it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from warmstart import torch_support

log = logging.getLogger("warmstart.cache")


@dataclasses.dataclass(frozen=True, slots=True)
class Internal:
    """One private torch name."""

    module: str
    """The module that holds it (imported on first use)."""
    attribute: str | None
    """Its dotted path inside :attr:`module`; ``None`` where the module itself is what is used."""
    without: str
    """What warmstart does without it, said in the warning."""
    frames: bool = False
    """Used by compiled frames only: checked on ``FRAMES_VERSIONS_CHECKED`` rather than every checked torch."""

    @property
    def checked(self) -> tuple[str, ...]:
        """The torch releases it was checked on."""
        return torch_support.FRAMES_VERSIONS_CHECKED if self.frames else torch_support.TORCH_VERSIONS_CHECKED

    @property
    def dotted(self) -> str:
        return self.module if self.attribute is None else f"{self.module}.{self.attribute}"


_UNCACHED = "compiling uncached"
_FRAMES_OFF = "compiled frames (WARMSTART_DYNAMO) are off"


def _frames(module: str, attribute: str | None) -> Internal:
    # Compiled frames are off where any of their names is missing (``dynamo_frames.state``).
    return Internal(module, attribute, _FRAMES_OFF, frames=True)


#: Remote-cache class in ``torch._inductor.remote_cache`` -> the artifact kind ``torch_hooks`` stores
#: through it.
REMOTE_CACHE_CLASSES = {
    "RemoteFxGraphCache": "fx_graph",
    "RemoteAOTAutogradCache": "aot_autograd",
    "RemoteAutotuneCache": "autotune",
    "RemoteBundledAutotuneCache": "autotune",
    "RemoteDynamoPGOCache": "pgo",
}

#: name -> the private torch name it stands for.
INTERNALS: dict[str, Internal] = {
    # -- the ETT metrics' compile spans (metrics/auto.py)
    "callback_handler": Internal(
        "torch._dynamo.callback", "callback_handler", "no compile spans are recorded in the ETT metrics"
    ),
    # -- torch's own counters, read for reports (init_pipeline/stages.py, bench/trainer.py)
    "dynamo_counters": Internal(
        "torch._dynamo.utils", "counters", "where compiled graphs came from is not reported; AOTAutograd counts as 0"
    ),
    # -- the cache hooks (torch_hooks.py), beyond the functions they wrap (PATCHED)
    "codecache": Internal("torch._inductor.codecache", None, _UNCACHED),
    "codecache_lock_timeout": Internal(
        "torch._inductor.codecache", "LOCK_TIMEOUT", "the precompiled header is built here, not fetched"
    ),
    "file_lock": Internal("torch.utils._filelock", "FileLock", "the precompiled header is built here, not fetched"),
    "cache_dir": Internal(
        "torch._inductor.runtime.cache_dir_utils", "cache_dir", "C++ objects are built with g++, not shared"
    ),
    "default_cache_dir": Internal(
        "torch._inductor.runtime.cache_dir_utils", "default_cache_dir", "C++ objects are built with g++, not shared"
    ),
    "async_compile": Internal(
        "torch._inductor.async_compile", None, "C++ kernels are built when Inductor loads the graph, as torch does"
    ),
    "torch_triton": Internal("torch.utils._triton", None, "torch's autotune caches stay off"),
    # -- background compiles (background.py, background_worker.py)
    "OptimizedModule": Internal(
        "torch._dynamo.eval_frame", "OptimizedModule", "compiled modules are not compiled in the background"
    ),
    "RecompileError": Internal(
        "torch._dynamo.exc", "RecompileError", "a recompile runs in the job, not in a background worker"
    ),
    "tree_map": Internal("torch.utils._pytree", "tree_map", "no compile runs in the background"),
    "tree_leaves": Internal("torch.utils._pytree", "tree_leaves", "a background compile runs no backward"),
    # -- the start-up graph's generator guard (init_pipeline/generators.py)
    "CatchErrorsWrapper": Internal(
        "torch._dynamo.convert_frame", "CatchErrorsWrapper", "a helper holds the generator guard through its compiles"
    ),
    "ConvertFrameAssert": Internal(
        "torch._dynamo.convert_frame", "ConvertFrameAssert", "a helper holds the generator guard through its compiles"
    ),
    "AutogradBackwardCompiler": Internal(
        "torch._functorch._aot_autograd.runtime_wrappers",
        "_AutogradBackwardCompiler",
        "a helper holds the generator guard through its compiles",
    ),
    # -- checkpoints (checkpoint/checkpointer.py)
    "ShardedTensor": Internal(
        "torch.distributed._shard.sharded_tensor", "ShardedTensor", "a state holding a ShardedTensor is not detected"
    ),
    # -- the reference job (bench/trainer.py): TorchRec's sparse optimizer runs in the backward
    "apply_optimizer_in_backward": Internal(
        "torch.distributed.optim", "_apply_optimizer_in_backward", "the reference job cannot fuse its sparse optimizer"
    ),
    # -- the preloader (preload/server.py)
    "funcname_cache": Internal("torch._dynamo.funcname_cache", None, "each forked child builds Dynamo's tables"),
    "get_overridable_functions": Internal(
        "torch.overrides", "_get_overridable_functions", "each forked child builds torch's overridable functions"
    ),
    # -- compiled frames (dynamo_frames/, frame_reads.py)
    "innermost_fn": _frames("torch._dynamo.eval_frame", "innermost_fn"),
    "CompilePackage": _frames("torch._dynamo.package", "CompilePackage"),
    "SerializedCode": _frames("torch._dynamo.package", "SerializedCode"),
    "SourceInfo": _frames("torch._dynamo.package", "SourceInfo"),
    "PrecompileCacheEntry": _frames("torch._dynamo.package", "PrecompileCacheEntry"),
    "DynamoCacheEntry": _frames("torch._dynamo.package", "_DynamoCacheEntry"),
    "lookup_code": _frames("torch._dynamo.package", "_lookup_code"),
    "PrecompileContext": _frames("torch._dynamo.precompile_context", "PrecompileContext"),
    "c_eval_frame": _frames("torch._C._dynamo.eval_frame", None),
    "reset_precompile_entries": _frames("torch._C._dynamo.eval_frame", "_reset_precompile_entries"),
    "bytecode_transformation": _frames("torch._dynamo.bytecode_transformation", None),
    "unique_id_counter": _frames("torch._dynamo.bytecode_transformation", "_unique_id_counter"),
    "check_unspec_or_constant_args": _frames("torch._dynamo.utils", "check_unspec_or_constant_args"),
    "dynamo_config": _frames("torch._dynamo.config", None),
    "functorch_config": _frames("torch._functorch.config", None),
    "inductor_config": _frames("torch._inductor.config", None),
    "compile_lock": _frames("torch._dynamo.convert_frame", "compile_lock"),
    "get_closure_vars": _frames("torch._dynamo.guards", "_get_closure_vars"),
    "GuardBuilder": _frames("torch._dynamo.guards", "GuardBuilder"),
    "get_verbose_code_parts": _frames("torch._dynamo.guards", "get_verbose_code_parts"),
    "top_saved_tensors_hooks": _frames("torch._functorch._aot_autograd.utils", "top_saved_tensors_hooks"),
    "saved_tensors_hooks_are_inlineable": _frames(
        "torch._functorch._aot_autograd.utils", "saved_tensors_hooks_are_inlineable"
    ),
}

#: Names the compiled frames need; with one missing they are off (``dynamo_frames.state``).
FRAMES_INTERNALS = tuple(name for name, internal in INTERNALS.items() if internal.frames)

#: What torch imports on a job's first ``torch.compile`` call, and what a job or preloader imports
#: ahead of it (``bench/reference_job.py``, ``DEFAULT_MODULES`` in ``preload/server.py``): Dynamo,
#: Inductor's code cache and compiler, AOTAutograd's cache.
COMPILE_ENTRY_MODULES = (
    "torch._dynamo",
    "torch._inductor.codecache",
    "torch._inductor.compile_fx",
    "torch._functorch._aot_autograd.autograd_cache",
)

#: What torch loads lazily on a job's first ``torch.compile`` call (torch 2.13 on CPU; a name this torch
#: lacks is skipped): Dynamo's backends, Inductor's per-device code generators, pattern passes and cache
#: layers, ``torch.export``'s tracer and ``torch.utils.cpp_extension`` (which brings setuptools). A
#: preloader imports them so that a forked rank does not import them in its first compile, on its
#: critical path (about 0.1 s on a warm start). Only a name list: without one, that rank imports it.
COMPILER_MODULES = (
    "torch._appdirs",
    "torch._dynamo.backends.cudagraphs",
    "torch._dynamo.backends.distributed",
    "torch._dynamo.backends.inductor",
    "torch._dynamo.backends.onnxrt",
    "torch._dynamo.backends.tensorrt",
    "torch._dynamo.backends.torchxla",
    "torch._dynamo.backends.tvm",
    "torch._dynamo.dce_extra_outputs",
    "torch._dynamo.repro.after_dynamo",
    "torch._export.db.logging",
    "torch._export.passes._node_metadata_hook",
    "torch._export.passes.add_runtime_assertions_for_constraints_pass",
    "torch._export.passes.collect_tracepoints_pass",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch._higher_order_ops.passes.inline_invoke_subgraph",
    "torch._inductor.bounds",
    "torch._inductor.choices",
    "torch._inductor.codegen.cpp_wrapper_cpu_array_ref",
    "torch._inductor.codegen.cpp_wrapper_gpu",
    "torch._inductor.codegen.cpp_wrapper_mps",
    "torch._inductor.codegen.cpu_device_op_overrides",
    "torch._inductor.codegen.cuda.device_op_overrides",
    "torch._inductor.codegen.cuda_combined_scheduling",
    "torch._inductor.codegen.cutedsl.cutedsl_scheduling",
    "torch._inductor.codegen.cutlass.scheduling",
    "torch._inductor.codegen.halide",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.codegen.mps",
    "torch._inductor.codegen.mps_device_op_overrides",
    "torch._inductor.codegen.mtia.device_op_overrides",
    "torch._inductor.codegen.nv_universal_gemm.nv_universal_gemm_scheduling",
    "torch._inductor.codegen.nv_universal_gemm.nv_universal_gemm_utils",
    "torch._inductor.codegen.pallas",
    "torch._inductor.codegen.python_wrapper_mtia",
    "torch._inductor.codegen.rocm.rocm_cpp_scheduling",
    "torch._inductor.codegen.segmented_tree",
    "torch._inductor.codegen.wrapper_fxir",
    "torch._inductor.codegen.xpu.device_op_overrides",
    "torch._inductor.codegen.xpu.xpu_combined_scheduling",
    "torch._inductor.compiler_bisector",
    "torch._inductor.extern_node_serializer",
    "torch._inductor.fx_passes.apply_gumbel_max_trick",
    "torch._inductor.fx_passes.efficient_conv_bn_eval",
    "torch._inductor.fx_passes.freezing_patterns",
    "torch._inductor.fx_passes.fuse_attention",
    "torch._inductor.fx_passes.mkldnn_fusion",
    "torch._inductor.fx_passes.pad_mm",
    "torch._inductor.fx_passes.quantization",
    "torch._inductor.fx_passes.serialized_patterns.addmm_pattern",
    "torch._inductor.fx_passes.serialized_patterns.bmm_pattern",
    "torch._inductor.fx_passes.serialized_patterns.mm_pattern",
    "torch._inductor.hooks",
    "torch._inductor.kernel_template_choice",
    "torch._inductor.runtime.caching.implementations",
    "torch._inductor.runtime.caching.memoizers",
    "torch._subclasses.schema_check_mode",
    "torch.export._leakage_detection_utils",
    "torch.export._trace",
    "torch.export._unlift",
    "torch.fx.experimental.validator",
    "torch.utils._cpp_embed_headers",
    "torch.utils.cpp_extension",
)


class MissingTorchInternal(LookupError):
    """A private torch name this torch does not have (its one warning has been said)."""


_lock = threading.Lock()
_warned: set[str] = set()


def resolve(name: str) -> Any | None:
    """The object :data:`INTERNALS` ``[name]`` stands for, importing its module; ``None`` where this
    torch lacks it, after one warning per name and process (none of its own on a torch warmstart was
    not checked against: that torch's one warning said hooks may be left out)."""
    internal = INTERNALS[name]
    try:
        obj: Any = importlib.import_module(internal.module)
        for part in internal.attribute.split(".") if internal.attribute else ():
            obj = getattr(obj, part)
    except Exception as exc:  # a torch that moved it: the feature goes, never the job
        _warn_missing(name, internal, exc)
        return None
    return obj


def require(name: str) -> Any:
    """:func:`resolve` for code that already fails open around it.

    Raises:
        MissingTorchInternal: this torch lacks it (the warning has been said).
    """
    obj = resolve(name)
    if obj is None:
        raise MissingTorchInternal(f"torch {torch_support.torch_version()} has no {INTERNALS[name].dotted}")
    return obj


def missing(names: Iterable[str]) -> list[str]:
    """Those of ``names`` this torch lacks (importing their modules), each warned about once."""
    return [name for name in names if resolve(name) is None]


def _warn_missing(name: str, internal: Internal, exc: Exception) -> None:
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    checked = torch_support.checked_here()
    log.log(
        logging.WARNING if checked else logging.DEBUG,
        "warmstart: torch %s has no %s (%s: %s; checked against %s): %s",
        torch_support.torch_version() or "?",
        internal.dotted,
        type(exc).__name__,
        exc,
        ", ".join(internal.checked),
        internal.without,
    )


def reset() -> None:
    """Warn again about a missing name (tests)."""
    with _lock:
        _warned.clear()


# -- the functions torch_hooks wraps ------------------------------------------------------------

#: torch module -> the internals its patch (``torch_hooks``) relies on: (dotted attribute, the names
#: its leading parameters must have, or ``None`` where only its presence matters). Checked before the
#: patch goes in, on every torch version, so that a torch whose internals moved loses that hook
#: (compiling uncached there) rather than having a wrapper call its functions with the wrong arguments.
PATCHED: dict[str, tuple[tuple[str, tuple[str, ...] | None], ...]] = {
    "torch._inductor.remote_cache": (
        ("RemoteCache", None),
        ("RemoteCacheBackend", None),
        *((cls_name, None) for cls_name in REMOTE_CACHE_CLASSES),
    ),
    "torch._inductor.cpp_builder": (
        ("CppBuilder.build", ("self",)),
        ("CppBuilder.get_command_line", ("self",)),
        ("CppBuilder.get_target_file_path", ("self",)),
    ),
    "torch._inductor.codecache": (
        ("_precompile_header", ("header", "hashable_cmd_line")),
        ("_HEADER_DIR", None),
        ("_HEADER_LOCK_DIR", None),
        ("write", None),
        ("CppTorchDeviceOptions", None),
        ("CppBuilder", None),
        ("_worker_compile_cpp", None),
        ("get_compiler_version_info", None),
        ("CppPythonBindingsCodeCache.load_pybinding_async", ("argtypes", "main_code")),
    ),
    "torch._inductor.codegen.wrapper": (
        ("PythonWrapperCodegen.define_kernel", ("self", "kernel_name", "kernel_body", "metadata", "gpu")),
    ),
    "torch._inductor.graph": (("GraphLowering.codegen", ("self",)),),
    "torch._inductor.cpu_vec_isa": (("VecISA._probe_load", ("self", "output_path")),),
    "torch._inductor.compile_fx": (("compile_fx", ("model_", "example_inputs_")),),
    "torch._inductor.runtime.autotune_cache": (
        ("AutotuneCacheBundler.begin_compile", ("inductor_meta",)),
        ("AutotuneCache.create", ("inductor_meta", "filename", "configs_hash")),
    ),
    "torch._functorch._aot_autograd.runtime_wrappers": (("_AutogradBackwardCompiler.get_or_compile", ("self",)),),
    "torch._dynamo.convert_frame": (
        ("_compile", ("code", "globals", "locals")),
        ("get_and_maybe_log_recompilation_reasons", ("cache_entries", "frame")),
    ),
    "torch._dynamo.guards": (("profile_guard_manager", None),),
}

#: torch module -> the function of ``dynamo_frames`` that hooks it (installed by ``torch_hooks``).
FRAME_HOOKS = {
    "torch._dynamo.eval_frame": "hook_eval_frame",
    "torch._dynamo.package": "hook_package",
    "torch._dynamo.variables.torch": "hook_constant_folds",
    "torch._dynamo.precompile_context": "hook_precompile_context",
    "torch._functorch._aot_autograd.autograd_cache": "hook_autograd_cache",
}
#: Every module whose patch compiled frames rely on: with one of them unhooked, they are off.
FRAMES_MODULES = (*FRAME_HOOKS, "torch._dynamo.guards", "torch._dynamo.convert_frame")


def check_internals(name: str, module: ModuleType) -> None:
    """Check that ``module`` has the internals its patch relies on (:data:`PATCHED`).

    Raises:
        AttributeError: one of them is missing.
        TypeError: a function's leading parameters are not named as expected.
    """
    for dotted, params in PATCHED.get(name, ()):
        obj: Any = module
        for part in dotted.split("."):
            if part not in dir(obj):  # dir(): a class attribute set only in __init__ would be missed
                raise AttributeError(f"{name}.{dotted} is gone")
            obj = getattr(obj, part)
        if params is None:
            continue
        try:
            signature = inspect.signature(inspect.unwrap(obj))
        except (TypeError, ValueError):  # a builtin without a signature: its presence is all we know
            continue
        # Read from the class: a plain method's first parameter is ``self``; a classmethod's ``cls``
        # is bound already, and a staticmethod has none.
        if tuple(signature.parameters)[: len(params)] != params:
            found = ", ".join(signature.parameters)
            raise TypeError(f"{name}.{dotted} takes ({found}), expected ({', '.join(params)}, ...)")


#: torch module -> whether its patch went in (False: it raised); absent until the module is imported.
_hooked: dict[str, bool] = {}


def record_hooked(module_name: str, hooked: bool) -> None:
    """Note whether the patch of ``module_name`` went in (``torch_hooks``, as the module is imported)."""
    _hooked[module_name] = hooked


def unhooked(module_names: Iterable[str]) -> list[str]:
    """Those of ``module_names`` whose patch is not in place. A module not imported yet is imported
    first, so that its patch has run; one that cannot be imported counts as not hooked."""
    not_hooked = []
    for name in module_names:
        if name not in _hooked:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        if not _hooked.get(name, False):
            not_hooked.append(name)
    return not_hooked
