"""Names that mean the same object in every process: the globals a stored frame's guards check by
identity (modules, classes, builtins, functions with their code), and digests of code that leave out
where a file lives."""

from __future__ import annotations

import builtins
import hashlib
import importlib
import re
import sys
import types
from typing import Any

_SOURCE_ROOT = re.compile(r"G\['([^']+)'\]")
_SOURCE_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']+)'\]")


def code_digest(code: types.CodeType) -> str:
    """A digest of what a code object does, the same in every process (its file's path left out)."""
    h = hashlib.sha256()
    for value in (
        code_qualname(code),
        code.co_firstlineno,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
    ):
        h.update(repr(value).encode() + b"\0")
    h.update(code.co_code)
    for const in code.co_consts:
        h.update((code_digest(const) if isinstance(const, types.CodeType) else stable_repr(const)).encode() + b"\0")
    return h.hexdigest()


def code_qualname(code: types.CodeType) -> str:
    """The qualified name of a code object's function (Python 3.10 has only the plain name)."""
    return getattr(code, "co_qualname", code.co_name)


def stable_repr(value: Any) -> str:
    """``repr`` that is the same in every process (sets in sorted order)."""
    # Sets of strings print in hash order, which differs between processes.
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(stable_repr(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(stable_repr(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in value.items())) + "}"
    return repr(value)


def global_identity(obj: Any) -> str | None:
    """What ``obj`` is called in every process: ``module NAME``, ``class M:Q``, ``builtin M:Q`` or
    ``function M:Q:<code digest>``; ``None`` when it has no such name (a local or nested function,
    a closure, an instance, an object its name does not lead back to)."""
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}" if sys.modules.get(obj.__name__) is obj else None
    if isinstance(obj, type):
        kind = "class"
    elif isinstance(obj, types.FunctionType):
        if obj.__closure__:
            return None
        kind = "function"
    elif isinstance(obj, types.BuiltinFunctionType):
        kind = "builtin"
    else:
        return None
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    if found is not obj:
        return None
    if kind == "function":
        return f"function {module_name}:{qualname}:{code_digest(obj.__code__)}"
    return f"{kind} {module_name}:{qualname}"


def changed_global(identities: dict[tuple[str, str], str], entry: Any) -> str | None:
    """The first recorded global that is not what it was when the entry was made, as a phrase."""
    aliases = {alias: name for code in entry.dynamo.codes for alias, name in code.import_sources.items()}
    for (module_name, source), expected in identities.items():
        module = sys.modules.get(module_name)
        if module is None:
            return f"module {module_name} is not imported"
        try:
            if source.startswith("G["):
                found = global_identity(resolve(source, vars(module), aliases))
            else:
                found = global_identity(named(expected))
        except Exception:
            found = None
        if found != expected:
            return f"{source} in {module_name} is {found or 'something else'}, was {expected}"
    return None


def named(identity: str) -> Any:
    """The object an identity (see :func:`global_identity`) names in this process."""
    kind, _, rest = identity.partition(" ")
    if kind == "module":
        return importlib.import_module(rest)
    module_name, qualname = rest.split(":")[:2]
    found: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def resolve(source: str, scope: dict, aliases: dict[str, str]) -> Any:
    """The object a guard's global source (``G['torch'].nn.functional``) names in ``scope``."""
    root = _SOURCE_ROOT.match(source)
    if root is None:
        raise ValueError(f"not a global source: {source}")
    name = root.group(1)
    if name in scope:
        obj = scope[name]
    elif name in aliases:  # Dynamo's import aliases, installed with the package
        obj = importlib.import_module(aliases[name])
    elif name.startswith("__builtins_dict__"):
        obj = builtins.__dict__
    else:
        raise KeyError(name)
    rest = source[root.end() :]
    while rest:
        step = _SOURCE_STEP.match(rest)
        if step is None:
            raise ValueError(f"cannot follow {rest!r}")
        obj = getattr(obj, step.group(1)) if step.group(1) else obj[step.group(2)]
        rest = rest[step.end() :]
    return obj
