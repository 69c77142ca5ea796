"""What a preloaded process's imported state depends on, and the name of the socket it serves on.

A process is handed over only when its fingerprint equals the preloader's: the same interpreter and
interpreter flags, the same ``sys.path`` (as the start-up hook sees it, part-way through ``site``),
and the same value (or absence) of every environment variable that the modules the preloader
imports read while they are imported. Everything else in the environment is the program's own and
is set in the child before it runs.

It is imported from the interpreter's start-up hook in every ``WARMSTART=1`` process, before any
other module: it uses built-in modules only.
"""

from __future__ import annotations

import os
import sys

site_fingerprint: dict | None = None
"""In a preloader: its fingerprint as its start-up hook saw it (set there), which requests must match."""

#: Environment variables read while the preloaded modules are imported (exact names). A child whose
#: value differs would run with another configuration than the one its modules were imported with.
IMPORT_TIME_NAMES = (
    "HOME",
    "USER",
    "LOGNAME",  # getpass and the per-user cache directories torch and Triton name at import
    "TMPDIR",
    "TEMP",
    "TMP",  # tempfile.gettempdir(), cached by the first module that asks
    "LANG",
    "LANGUAGE",
    "TZ",  # the interpreter's locale and encodings; time.tzset
    "XDG_CACHE_HOME",  # Triton's and torch's default cache directories
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",  # which shared libraries torch and its extensions loaded
    "PATH",  # a CUDA build's torch.utils.cpp_extension finds CUDA_HOME from nvcc on it, at import
    "CXX",  # torch._inductor.config's C++ compiler, read when it is imported
    "KINETO_LOG_LEVEL",
    "KINETO_USE_DAEMON",  # libkineto, loaded with torch
    # Read by torch's modules when they are imported, outside the prefixes below (torch 2.13; a test
    # scans the modules a preloader imports for reads that none of these names or prefixes cover):
    "AOT_PARTITIONER_DEBUG",
    "CI",
    "FAKE_ALLOW_META",  # torch._functorch.config
    "CUTEDSL_ENABLE_AUTOTUNING",
    "CUTLASS_EPILOGUE_FUSION",
    "DUMP_AOTI_MINIFIER",
    "ENABLE_PERSISTENT_TMA_MATMUL",
    "ENABLE_TEMPLATE_TMA_STORE",
    "ENABLE_TMA_LOAD_FOR_TEMPLATE_EPILOGUE",
    "LOG_AUTOTUNE_RESULTS",
    "LOG_TLPARSE",  # torch._inductor.config
    "PT2_COMPILE_ID_PREFIX",
    "UNSAFE_SKIP_FSDP_MODULE_GUARDS",  # torch._dynamo.config
    "FX_PATCH_GETITEM",  # torch.fx._symbolic_trace
    "KINETO_FORCE_OPTIMIZER_HOOK",  # torch.profiler
    "CONDA_PREFIX",
    "WINDOWS_CUDA_HOME",  # torch.utils.cpp_extension and its helpers
    "IS_FBCODE",  # torch.utils.hipify
    "debug_extract_compiled_graph",  # torch._lazy
    "LOGLEVEL",  # torch.distributed.elastic's logging
    "FX_NET_ACC_SPLITTER_TRACKER_DUMP_PATH",
    "FX_NET_ACC_SPLITTER_TRACKER_MODE",  # torch.fx.passes.splitter_base
    "LNAME",
    "USERNAME",  # getpass, after LOGNAME and USER
    # tensordict (under TorchRec), at import
    "LAZY_LEGACY_OP",
    "CAPTURE_NONTENSOR_STACK",
    "LIST_TO_STACK",
    "DISPATCH_TDNN_MODULES",
    "COMPOSITE_LP_AGGREGATE",
    "EXCLUDE_TD_FROM_PYTREE",
    "SAGE_ROOT",  # mpmath
    "SETUPTOOLS_USE_DISTUTILS",
    "DISTUTILS_DEBUG",  # setuptools, under torch.utils.cpp_extension
    "_NETWORKX_BUILDING_DOCS_",
)

#: Modules that read every variable when they are imported (``os.environ.items()``) and use those
#: with a prefix below: what their scan depends on.
SCANNED_PREFIXES = {"tqdm.utils": "TQDM_", "networkx.utils.backends": "NETWORKX_"}

#: Prefixes of the same (every variable that starts with one).
IMPORT_TIME_PREFIXES = (
    "PYTHON",  # the interpreter: PYTHONPATH, PYTHONHASHSEED, PYTHONIOENCODING, PYTHONWARNINGS...
    "LC_",  # locale categories
    "TORCH",
    "PYTORCH_",  # torch's config modules (torch._inductor.config, torch._dynamo.config,
    # torch.compiler.config, torch._functorch.config) read TORCHINDUCTOR_*, TORCHDYNAMO_*,
    # TORCH_COMPILE_*, TORCH_LOGS..., PYTORCH_* when imported
    "TRITON_",  # triton.knobs, at import
    "CUDA_",
    "NVIDIA_",
    "CUBLAS",
    "CUDNN_",
    "HIP_",
    "ROCM_",  # device libraries loaded with torch
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "ATEN_",  # OpenMP and BLAS, read when libtorch loads
    "FBGEMM_",
    "TORCHREC_",  # fbgemm_gpu and TorchRec, at import
    "AOT_INDUCTOR_",
    "AOTINDUCTOR_",
    "INDUCTOR_",  # torch._inductor.config, besides TORCHINDUCTOR_*
    "PARTITIONER_",  # torch._functorch.config
    "COMPILE_STROBELIGHT_",  # torch._strobelight, imported by Dynamo
    "QUACK_",  # torch._vendor.quack
    "LD_",  # the dynamic loader, when the process starts (LD_BIND_NOW, LD_AUDIT...)
    "GLIBC_",
    "MALLOC_",  # the C library's allocator, when the process starts (GLIBC_TUNABLES, MALLOC_ARENA_MAX...)
    "NUMPY_",
    "NPY_",  # numpy, at import
    "SYMPY_",
    "MPMATH_",  # sympy and mpmath, imported by torch's compiler
    "NETWORKX_",
    "TQDM_",  # networkx and tqdm, which read every variable with their prefix at import
    "_PYTHON_",  # sysconfig
    "TD_",  # tensordict
)


#: Read at import too, but set again in the child from the program's value: torch's intra-op thread
#: count (``torchrun`` sets ``OMP_NUM_THREADS=1`` for its workers) and the variables warmstart itself
#: exports to the processes a ``WARMSTART=1`` process starts (torch's PGO job id, Triton's cache
#: manager, which Triton reads when it first caches).
APPLIED_IN_CHILD = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TORCH_COMPILE_JOB_ID",
    "TORCH_COMPILE_STICKY_PGO_KEY",
    "TRITON_CACHE_MANAGER",
)

#: Matched by the prefixes above but read later, when the program uses them: the launcher's per-rank
#: variables (torch.distributed.elastic, ProcessGroupNCCL) and the device lists that CUDA and ROCm
#: read when a process first uses a device, which a preloader never does.
RUNTIME_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)
RUNTIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")


def applied_in_child(name: str) -> bool:
    """Whether a variable read at import is set again in each child from the program's value, or
    read only later (see the two tables above): a child may differ from its preloader in it."""
    return name in APPLIED_IN_CHILD or name in RUNTIME_NAMES or name.startswith(RUNTIME_PREFIXES)


def import_time_environment(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The variables of ``environ`` that modules read at import time (see the two tables above)."""
    return {
        name: value
        for name, value in environ.items()
        if (name in IMPORT_TIME_NAMES or name.startswith(IMPORT_TIME_PREFIXES)) and not applied_in_child(name)
    }


def fingerprint(environ: dict[str, str] | os._Environ | None = None) -> dict:
    """What must be equal between a process and the preloader that serves it (plain data)."""
    return {
        "executable": sys.executable,
        "version": sys.version,
        "flags": tuple(sys.flags),
        "warnoptions": list(sys.warnoptions),
        "xoptions": sorted((str(k), str(v)) for k, v in sys._xoptions.items()),
        "path": list(sys.path),
        "environment": sorted(import_time_environment(os.environ if environ is None else environ).items()),
    }


def difference(mine: dict, theirs: dict) -> str | None:
    """The first thing in which two fingerprints differ, in words; ``None`` when they are equal."""
    for key in ("executable", "version", "flags", "warnoptions", "xoptions", "path"):
        if mine.get(key) != theirs.get(key):
            return {
                "executable": "another interpreter",
                "version": "another Python version",
                "flags": "other interpreter flags (-O, -E, -I, -X dev...)",
                "warnoptions": "other -W options",
                "xoptions": "other -X options",
                "path": "another sys.path (another venv or PYTHONPATH)",
            }[key]
    a, b = dict(mine.get("environment", ())), dict(theirs.get("environment", ()))
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            state = "unset" if name not in b else "set" if name not in a else "another value"
            return f"{name} ({state} here; it is read when the preloaded modules are imported)"
    return None


def default_socket(environ: dict[str, str] | os._Environ | None = None, fp: dict | None = None) -> str:
    """Where the preloader for this user and fingerprint listens: ``WARMSTART_PRELOAD_SOCKET``, else
    ``/tmp/warmstart-<uid>/preload-<digest>.sock`` (one preloader per interpreter and environment)."""
    environ = os.environ if environ is None else environ
    given = environ.get("WARMSTART_PRELOAD_SOCKET")
    if given:
        return given
    import zlib

    # repr, not marshal: marshal's output depends on how objects are shared in memory.
    digest = zlib.crc32(repr(_hashable(fp if fp is not None else fingerprint(environ))).encode())
    return os.path.join(private_dir(), f"preload-{digest:08x}.sock")


def private_dir() -> str:
    """This user's directory for preloader sockets (``/tmp/warmstart-<uid>``, mode 0700)."""
    return f"/tmp/warmstart-{os.getuid()}"


def _hashable(fp: dict) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(fp.items()))
