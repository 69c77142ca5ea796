"""Which torch releases warmstart was checked against, and what it leaves off on any other.

warmstart reaches into torch's internals (each name listed in ``torch_internals.py``; the hooks are
``compile_cache/torch_hooks.py``), which change between releases without notice. On a release in
:data:`TORCH_VERSIONS_CHECKED` every hook goes in. On any other the job still runs, degraded and
never failed: one warning per process names the version and what is off (compiled frames, whose
safety rests on Dynamo's internals; any hook whose torch internals do not have the signature
warmstart expects), and ``warmstart cache doctor`` says the same. This module only compares
versions: it imports no torch internals, and reads torch's version from ``torch.version`` (a plain
generated module) or, where torch is not imported, from its installed metadata.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading

log = logging.getLogger("warmstart.cache")

#: torch releases the test suite ran against, each with every hook in place (the local part of a
#: version, ``+cpu`` or ``+cu132``, is not compared: the hooks are the same Python code in each build).
TORCH_VERSIONS_CHECKED: tuple[str, ...] = ("2.13.0", "2.15.0")
#: Those of them on which compiled frames (``WARMSTART_DYNAMO=1``) were checked: they hook deeper into
#: Dynamo than anything else (its packages, guards and precompile context), and torch 2.15 removed one
#: of the calls they make (``CompilePackage.bypass_current_entry``). Off on any other release.
FRAMES_VERSIONS_CHECKED: tuple[str, ...] = ("2.13.0",)

#: What warmstart leaves off on a torch release it was not checked against.
OFF_WHEN_UNCHECKED = (
    "compiled frames (WARMSTART_DYNAMO) are off, and a hook whose torch internals differ from what "
    "warmstart expects is left out (compiling uncached there)"
)


def public_version(version: str) -> str:
    """``version`` without its local part: ``2.15.0+cu132`` -> ``2.15.0``."""
    return version.split("+", 1)[0].strip()


def is_checked(version: str, checked: tuple[str, ...] | None = None) -> bool:
    """Whether torch ``version`` is one of ``checked`` (default :data:`TORCH_VERSIONS_CHECKED`)."""
    return public_version(version) in (TORCH_VERSIONS_CHECKED if checked is None else checked)


def frames_checked(version: str) -> bool:
    """Whether compiled frames were checked on torch ``version`` (:data:`FRAMES_VERSIONS_CHECKED`)."""
    return is_checked(version) and is_checked(version, FRAMES_VERSIONS_CHECKED)


def frames_off_warning(version: str) -> str:
    """The line said where compiled frames are asked for on a checked torch they were not checked on."""
    return (
        f"warmstart: compiled frames (WARMSTART_DYNAMO) are off: torch {version} is not among the versions "
        f"they were checked against ({', '.join(FRAMES_VERSIONS_CHECKED)}); torch compiles every frame itself"
    )


def unchecked_warning(version: str) -> str:
    """The one line said on a torch release warmstart was not checked against."""
    return (
        f"warmstart: torch {version} is not among the versions warmstart was checked against "
        f"({', '.join(TORCH_VERSIONS_CHECKED)}): {OFF_WHEN_UNCHECKED}; the job runs as with plain torch there"
    )


def torch_version() -> str | None:
    """This process's torch version: from ``torch.version`` when torch is (being) imported, else from
    the installed package's metadata; ``None`` where neither exists."""
    if "torch" in sys.modules:
        try:
            return str(importlib.import_module("torch.version").__version__)
        except Exception:  # a torch without its version module: fall back to the metadata
            pass
    from importlib import metadata  # 20 ms, on this path only: the recorder imports this module in every job

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


_lock = threading.Lock()
_checked: bool | None = None


def checked_here() -> bool:
    """Whether this process's torch is a checked release; the first call on any other warns, once per
    process. Hooks call it as torch's modules are imported, so it is answered from then on."""
    global _checked
    with _lock:
        if _checked is None:
            version = torch_version()
            _checked = version is None or is_checked(version)
            if not _checked:
                log.warning(unchecked_warning(str(version)))
        return _checked


def frames_checked_here() -> bool:
    """Whether compiled frames may run with this process's torch (no warning of its own: the caller,
    which knows whether they were asked for, says so)."""
    version = torch_version()
    return checked_here() and (version is None or frames_checked(version))


_frames_warned = False


def warn_frames_off() -> None:
    """Say, once per process, that compiled frames were asked for and are off on this torch."""
    global _frames_warned
    with _lock:
        if not _frames_warned:
            _frames_warned = True
            log.warning(frames_off_warning(str(torch_version())))


def reset() -> None:
    """Ask again at the next :func:`checked_here`, and warn again (a preloader's child, tests)."""
    global _checked, _frames_warned
    with _lock:
        _checked = None
        _frames_warned = False
