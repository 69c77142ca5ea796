"""The globals a package names: those behind the identity guards torch cannot serialize (kept only
when they have the same name in every process, ``dynamo_identity``), and those installing an entry
would put into a module."""

from __future__ import annotations

import sys
import types
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache.dynamo_identity import global_identity

#: Guards torch does not serialize that check an object's identity: kept for globals with a name.
IDENTITY_GUARDS = frozenset({"ID_MATCH", "MODULE_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "CLOSURE_MATCH"})


class NotPackaged(Exception):
    """A guard of the frame cannot be kept in a package."""


def global_identities(manager: Any, sorted_guards: list, builder: Any, package: Any) -> dict[tuple[str, str], str]:
    """The names of the globals behind the guards torch does not serialize.

    Raises:
        NotPackaged: one of those guards is not an identity check on a global with a name.
    """
    unsupported = manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    module_name = package._current_entry.python_module
    found: dict[tuple[str, str], str] = {}
    for guard in sorted_guards:
        kind = guard.create_fn_name()
        if kind in ("TYPE_MATCH", "BUILTIN_MATCH"):
            continue  # torch serializes these itself, or refuses (then the frame is not packaged)
        derived = [t for t in (guard.guard_types or ()) if t in unsupported]
        if kind not in unsupported and not derived:
            continue
        if kind not in IDENTITY_GUARDS or any(t not in IDENTITY_GUARDS for t in derived):
            raise NotPackaged(f"{kind} guard on {guard.name}")
        # torch rebuilds the guard at load from the object the source names there: a global of the
        # frame's module, or for a local (``self.activation``) what its pickled value names (pickle
        # stores functions, classes and builtins by name). Either way the object must have a name.
        identity = global_identity(builder.get(guard))
        if identity is None:
            raise NotPackaged(f"{kind} guard on {guard.name}, which has no name in other processes")
        found[(module_name, guard.name)] = identity
    return found


def taken_name(entry: Any) -> str | None:
    """A global the entry would install that its module holds already as something else, as a phrase.

    Resume functions are named by the producer's counter (``__resume_at_30_1``): a function traced
    in this process, or installed from another producer's entry, may hold the same name in the same
    module, and installing over it would make that function's frames resume in the wrong code.
    """
    SerializedCode = torch_internals.require("SerializedCode")

    for code in entry.codes:
        if not code.install_to_global:
            continue
        scope = vars(sys.modules[code.python_module])
        taken = [name for name in code.function_names if name in scope]
        if not taken:
            continue
        python_code = SerializedCode.to_code_object(code.python_code)
        for name in taken:
            if not _same_function(scope[name], python_code):
                return f"{name} in {code.python_module} is another function"
    return None


def _same_function(found: Any, code: types.CodeType) -> bool:
    # torch installs a resume function with free variables as a factory holding its code
    if isinstance(found, types.FunctionType):
        return found.__code__ == code or code in (found.__defaults__ or ())
    return False
