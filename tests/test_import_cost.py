"""What importing warmstart's rooms costs a process: a job imports the recorder and the store's
interface at start, and pays for the heavy modules (torch, the tiers' clients, the keys' crypto,
``importlib.metadata``) only when it uses them."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Modules none of the rooms below may load when imported.
_HEAVY = (
    "torch",
    "redis",
    "diskcache",
    "zstandard",
    "blake3",
    "cryptography",
    "rich",
    "importlib.metadata",
)


@pytest.mark.parametrize("module", ["warmstart", "warmstart.compile_cache", "warmstart.metrics", "warmstart.config"])
def test_importing_a_room_loads_none_of_the_heavy_modules(module):
    code = f"import sys; import {module}; print(sorted(n for n in {_HEAVY!r} if n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", (module, out.stdout)
