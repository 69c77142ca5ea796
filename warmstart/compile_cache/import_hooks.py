"""Post-import hooks: run a callback right after a module has executed, whoever imports it.

warmstart patches torch this way so that a process that never compiles never pays for importing
Inductor. A hook that raises never breaks the import: it is logged and the module is used unpatched.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable
from types import ModuleType

log = logging.getLogger("warmstart.cache")

Hook = Callable[[ModuleType], None]

_hooks: dict[str, Hook] = {}
_applied: set[str] = set()


def on_import(module_name: str, hook: Hook) -> None:
    """Run ``hook(module)`` once, right after ``module_name`` is imported (by :func:`install` when it
    already is). One hook per module: registering again replaces a hook that has not run yet."""
    _hooks[module_name] = hook


def install() -> None:
    """Watch imports (one finder per process) and run the hooks of modules already imported."""
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in list(_hooks):
        if name in sys.modules:
            _run(name, sys.modules[name])


def forget(module_names) -> None:
    """Let the hooks of ``module_names`` run again at the next :func:`install` (in a preloader's
    child, whose settings may differ from those the hooks saw)."""
    _applied.difference_update(module_names)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a watched module so that its hook runs once the module has executed."""

    def find_spec(self, fullname, path, target=None):  # noqa: D401 - importlib protocol
        if fullname not in _hooks or fullname in _applied:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _HookingLoader(spec.loader)
                return spec
        return None


class _HookingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run(module.__name__, module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


def _run(name: str, module: ModuleType) -> None:
    if name in _applied:
        return
    _applied.add(name)
    try:
        _hooks[name](module)
    except Exception as exc:  # a hook must cost what it patches, never the import
        log.warning(
            "warmstart: could not hook %s (%s: %s); it runs unpatched",
            name,
            type(exc).__name__,
            exc,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
