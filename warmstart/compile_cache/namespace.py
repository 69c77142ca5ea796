"""The namespace: everything that makes compiled artifacts incompatible, hashed into one short id.

Torch's own cache keys already cover the graph, the Inductor config and (on GPUs) the device name.
They do *not* cover the CPU's vector ISA on CPU-only hosts, nor the Python ABI of Triton's launcher
``.so`` files, so two machines that differ there must never share entries. warmstart's own format
version and ``WARMSTART_NAMESPACE`` (team, trust domain) are folded in too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import sys
import sysconfig

FORMAT_VERSION = 4

# CPU flags that change which vector code Inductor generates or may run.
_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


def cpu_isa() -> str:
    """The machine architecture plus the vector-ISA flags this CPU has (from /proc/cpuinfo)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return platform.machine() + ":" + ",".join(f for f in _ISA_FLAGS if f in flags)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _gpu_arch() -> str:
    torch = sys.modules.get("torch")
    if torch is None and (os.path.exists("/proc/driver/nvidia/gpus") or os.path.exists("/dev/kfd")):
        import torch  # only on GPU hosts: the arch must be the same in every process of a job
    try:
        if torch is not None and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}/cuda{torch.version.cuda}"
    except Exception:  # a broken driver must not break the cache: it only narrows sharing
        return "gpu-unknown"
    return "cpu"


@functools.cache
def components(user_namespace: str = "") -> dict[str, str]:
    """The parts the namespace is made of (shown by ``warmstart cache doctor``)."""
    return {
        "format": str(FORMAT_VERSION),
        "torch": _version("torch"),
        "triton": _version("triton") if _version("pytorch-triton") == "-" else _version("pytorch-triton"),
        "python_abi": f"{sys.implementation.cache_tag}{sysconfig.get_config_var('EXT_SUFFIX') or ''}",
        "cpu_isa": cpu_isa(),
        "gpu_arch": _gpu_arch(),
        "user": user_namespace,
    }


def namespace(user_namespace: str = "") -> str:
    """A short, stable id for the compatibility domain, e.g. ``v1-team-3fa9c2e1d0b4``."""
    parts = components(user_namespace)
    digest = hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:12]
    prefix = f"v{FORMAT_VERSION}-{user_namespace}-" if user_namespace else f"v{FORMAT_VERSION}-"
    return prefix + digest
