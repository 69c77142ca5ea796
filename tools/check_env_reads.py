"""Fail when a module other than ``warmstart/config.py`` reads a ``WARMSTART*`` variable (run by ``make lint``).

warmstart's own settings are parsed, checked and defaulted in one place (``warmstart/config.py``),
so that a variable means the same everywhere and a bad value is one ``ConfigError``. A read is
``environ.get(NAME)``, ``environ[NAME]``, ``environ.pop(NAME)``, ``os.getenv(NAME)`` or
``NAME in environ`` on any mapping, with ``NAME`` a string starting with ``WARMSTART``; setting a
child's variable is not a read. The interpreter's start-up hook is exempt (:data:`START_UP_HOOK`): it
runs in every ``WARMSTART=1`` process and imports built-in modules only, which ``config.py`` is not.

Usage: ``python tools/check_env_reads.py`` from the repository root.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path("warmstart")

#: The one module that reads warmstart's settings.
CONFIG = PACKAGE / "config.py"

#: Modules the interpreter's start-up hook runs before anything is imported: they read the few
#: variables that decide whether to hand the process over, without importing ``config.py``.
START_UP_HOOK = {
    PACKAGE / "_bootstrap.py": "the start-up hook itself",
    PACKAGE / "preload" / "client.py": "the hand-over to a preloader, the hook's first step",
    PACKAGE / "preload" / "environment.py": "the preloader's socket name, asked by the hand-over",
}

_READ_METHODS = {"get", "pop", "getenv", "setdefault"}


def _is_setting(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("WARMSTART")


def reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, variable)`` of each read of a ``WARMSTART*`` variable in ``tree``."""
    # ``env.pop(NAME, None)`` as a statement removes a variable from a child's environment: no read.
    discarded = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and id(node) not in discarded
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _READ_METHODS
            and node.args
            and _is_setting(node.args[0])
        ):
            found.append((node.lineno, node.args[0].value))  # type: ignore[attr-defined]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_setting(node.slice):
            found.append((node.lineno, node.slice.value))  # type: ignore[attr-defined]
        elif (
            isinstance(node, ast.Compare)
            and _is_setting(node.left)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        ):
            found.append((node.lineno, node.left.value))  # type: ignore[attr-defined]
    return sorted(found)


def main() -> int:
    failures = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == CONFIG or path in START_UP_HOOK:
            continue
        for line, variable in reads(ast.parse(path.read_text(), str(path))):
            failures.append(f"{path}:{line}: reads {variable}: add a typed accessor to {CONFIG} and call it")
    print("\n".join(failures) or "", end="\n" if failures else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
