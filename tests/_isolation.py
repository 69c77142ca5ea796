"""The suite never writes outside its own temporary directories: one short root per run
(``/tmp/ws-XXXXXXXX``, made by the first pytest process and inherited by xdist's workers and every
subprocess), holding the HOME, XDG, TMPDIR, Inductor, Triton and warmstart cache directories that
anything run without a test's own settings falls back to.

Short by construction: AF_UNIX socket paths (DataLoader workers', the preloader's) are limited to 107
bytes, and a directory derived from the user name or pytest's base directory can pass that for a
user with a long name."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ROOT_VARIABLE = "WS_TESTS_ROOT"
"""Names the run's root; set by the pytest process that made it, inherited by the others."""

BASETEMP_VARIABLE = "WS_TESTS_BASETEMP"
"""pytest's base directory when the run chose it (no ``--basetemp`` given)."""

_owned = False

# Each variable and its directory under the root. XDG_RUNTIME_DIR is left alone: it must be the
# user's (mode 0700, owned), and nothing of warmstart's writes there.
DIRECTORIES = {
    "HOME": "home",
    "XDG_CACHE_HOME": "home/.cache",
    "XDG_CONFIG_HOME": "home/.config",
    "XDG_DATA_HOME": "home/.local/share",
    "TMPDIR": "tmp",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
}


def run_root() -> Path:
    return Path(os.environ[ROOT_VARIABLE])


def owns_root() -> bool:
    """Whether this process made the root (and so removes it at the end)."""
    return _owned


def isolate_session() -> Path:
    """Point HOME, the XDG directories, TMPDIR and the Inductor and Triton caches of this process
    (and so of its children) into the run's root, made here unless a parent pytest made it."""
    global _owned
    if not os.environ.get(ROOT_VARIABLE):
        os.environ[ROOT_VARIABLE] = tempfile.mkdtemp(prefix="ws-", dir="/tmp")
        _owned = True
    root = run_root()
    for variable, sub in DIRECTORIES.items():
        path = root / sub
        path.mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(path)
    for variable in ("TEMP", "TMP"):
        os.environ.pop(variable, None)
    tempfile.tempdir = None  # gettempdir() caches its first answer
    return root


def short_tmpdir() -> Path:
    """A new, empty TMPDIR for one test's "machine": about 30 bytes whatever pytest's base directory
    or the user's name, so that sockets made under it fit."""
    return Path(tempfile.mkdtemp(prefix="t", dir=run_root() / "tmp"))
