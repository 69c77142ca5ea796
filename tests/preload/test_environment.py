"""The fingerprint's import-time variables against the installed torch and TorchRec: every variable a
module the preloader imports reads while it is imported must be one a handover compares (or one the
child sets again), or a child would run with the preloader's value of it."""

from __future__ import annotations

import ast
import contextlib
import importlib
import sys
from pathlib import Path

from warmstart.preload.environment import APPLIED_IN_CHILD, import_time_environment

_ENVIRON = ("os.environ", "environ")
_GETTERS = ("os.environ.get", "environ.get", "os.getenv", "getenv")


def _import_time_reads(source: str) -> set[str]:
    """Names of the environment variables read outside any function: at import, in the module's or a
    class's body (config classes), including torch's ``Config(env_name_default=..., env_name_force=...)``."""
    names: set[str] = set()

    def text(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return  # read when called, in the child: the program's own value
        if isinstance(node, ast.Call):
            if ast.unparse(node.func) in _GETTERS and node.args and text(node.args[0]):
                names.add(text(node.args[0]))
            for keyword in node.keywords:
                if keyword.arg in ("env_name_default", "env_name_force"):
                    values = keyword.value.elts if isinstance(keyword.value, (ast.List, ast.Tuple)) else [keyword.value]
                    names.update(name for name in map(text, values) if name)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in _ENVIRON and text(node.slice):
            names.add(text(node.slice))
        elif (
            isinstance(node, ast.Compare)
            and text(node.left)
            and any(ast.unparse(c) in _ENVIRON for c in node.comparators)
        ):
            names.add(text(node.left))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


def test_the_scan_finds_reads_at_import_and_skips_reads_in_functions():
    source = (
        "import os\n"
        "A = os.environ.get('AT_IMPORT')\n"
        "class cpp:\n    cxx = os.environ.get('IN_A_CLASS_BODY', 'g++')\n"
        "B = Config(env_name_force=['FORCED'], env_name_default='DEFAULTED')\n"
        "C = 'FLAG' in os.environ\n"
        "def later():\n    return os.getenv('WHEN_CALLED')\n"
    )
    assert _import_time_reads(source) == {"AT_IMPORT", "IN_A_CLASS_BODY", "FORCED", "DEFAULTED", "FLAG"}


def test_every_variable_the_preloaded_modules_read_at_import_is_compared():
    from warmstart.preload.server import COMPILER_MODULES, DEFAULT_MODULES, STORE_MODULES

    for name in DEFAULT_MODULES + COMPILER_MODULES + STORE_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    roots = ("torch", "torchrec", "fbgemm_gpu", "triton")
    files = {
        module.__file__
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in roots and isinstance(getattr(module, "__file__", None), str)
    }
    assert len(files) > 500
    uncovered: dict[str, str] = {}
    for path in sorted(files):
        if not path.endswith(".py") or not Path(path).is_file():  # torch._classes names no real file
            continue
        source = Path(path).read_text(encoding="utf-8", errors="replace")
        if "environ" not in source and "getenv" not in source and "env_name_" not in source:
            continue
        for name in _import_time_reads(source):
            if name not in APPLIED_IN_CHILD and not import_time_environment({name: "x"}):
                uncovered.setdefault(name, path)
    assert uncovered == {}, "read at import but not part of the fingerprint (environment.py)"


def test_every_variable_the_preloaders_imports_read_is_compared_by_the_fingerprint(tmp_path):
    # What a preloader's imports read, recorded as they run (the child compares these with the
    # program's anyway); each must be in the fingerprint's table too, so that `preload start` passes
    # it on to the preloader and a process whose value differs is sent to another preloader.
    import json
    import os
    import subprocess

    probe = (
        "import contextlib, importlib, json, os\n"
        "os.chdir(os.environ['PROBE_DIR'])\n"
        "from warmstart.preload.recording import recording\n"
        "from warmstart.preload.server import COMPILER_MODULES, DEFAULT_MODULES, STORE_MODULES\n"
        "with recording() as r:\n"
        "    for m in DEFAULT_MODULES + COMPILER_MODULES + STORE_MODULES:\n"
        "        with contextlib.suppress(Exception):\n"
        "            importlib.import_module(m)\n"
        "print(json.dumps({'names': sorted(r.environ), 'scans': sorted(r.environ_scans)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "PROBE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    reads = json.loads(out.stdout.splitlines()[-1])
    assert len(reads["names"]) > 100  # the recording works
    from warmstart.preload.environment import SCANNED_PREFIXES, applied_in_child

    uncovered = [n for n in reads["names"] if not import_time_environment({n: "x"}) and not applied_in_child(n)]
    assert uncovered == []
    assert [m for m in reads["scans"] if m not in SCANNED_PREFIXES] == []
    assert all(import_time_environment({prefix + "X": "x"}) for prefix in SCANNED_PREFIXES.values())
