"""The sharding-plan cache key: everything a TorchRec planner reads, hashed.

:func:`plan_key` is a SHA-256 over canonical JSON (:func:`plan_key_inputs`) of library versions; the
planner's class and settings (topology with every capacity and bandwidth, batch size, constraints,
enumerator, storage reservation, proposers, partitioner, performance model, timeout); per sharded
module its path and type and each table's shape, dtype and config (features, pooling, data type); the
module's total parameter size (storage reservation reads it); and each sharder's type and options
(fused params, comm codecs). It is computed without enumerating sharding options, in milliseconds.
A plan must never be served for inputs other than the ones it was computed for: when in doubt, the
key includes more.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and TorchRec are imported where used: importing warmstart stays cheap
    from torch import nn
    from torchrec.distributed.types import ModuleSharder

FORMAT = 1
"""Mixed into every key: bump it when the key inputs or the stored entry change meaning (entries
written before are then never looked up again)."""

_MAX_DEPTH = 64  # a guard against pathological nesting only: deeper settings must not be cut off

# Attributes planners and their parts set while planning (search state, results, caches): not settings.
_STATE_ATTRS = frozenset(
    {
        "_stats",
        "_debug",
        "_num_proposals",
        "_num_plans",
        "_best_plan",
        "_search_space",
        "_sharder_map",
        "_sharder_data_map",
        "_last_stored_search_space",
        "_last_stored_module",
        "_last_stored_sharders",
        "_last_reserved_topology",
        "_dense_storage",
        "_kjt_storage",
        "_proposal_index",
        "_proposals",
        "_sharding_options_by_fqn",
        "_current_proposal",
        "_best_perf_rating",
        "_num_inferior_perf",
        "_grouped_sharding_options",
        "_proposal_cache",
        "_created_by_factory",
    }
)


def plan_key(planner: Any, module: nn.Module, sharders: list[ModuleSharder[nn.Module]], *, salt: str = "") -> str:
    """SHA-256 (hex) of :func:`plan_key_inputs`. Costs milliseconds; enumerates nothing."""
    text = json.dumps(
        plan_key_inputs(planner, module, sharders, salt=salt), sort_keys=True, separators=(",", ":"), allow_nan=False
    )
    return hashlib.sha256(text.encode()).hexdigest()


def plan_key_inputs(
    planner: Any, module: nn.Module, sharders: list[ModuleSharder[nn.Module]], *, salt: str = ""
) -> dict[str, Any]:
    """Everything the plan depends on, as JSON-ready data (what :func:`plan_key` hashes)."""
    return {
        "format": FORMAT,
        "versions": _versions(),
        "planner": _canonical(planner),
        "model": _model_inputs(module, sharders),
        "sharders": [_sharder_inputs(s) for s in sharders],
        "salt": salt,
    }


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str | None]:
    import torch

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    return {
        "torch": torch.__version__,
        "torchrec": version("torchrec", "torchrec-nightly"),
        "fbgemm": version("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu"),
    }


def claimed_modules(module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> dict[str, tuple[Any, Any]]:
    """Module path to ``(module, sharder)`` for every module a sharder claims, found as the planner does.

    Mirrors ``EmbeddingEnumerator.enumerate``: walk the children, stop at a module whose type a
    sharder handles.
    """
    from torchrec.distributed.planner.utils import sharder_name

    by_type = {sharder_name(s.module_type): s for s in sharders}
    found: dict[str, tuple[Any, Any]] = {}
    queue: list[tuple[str, Any]] = [("", module)]
    while queue:
        path, child = queue.pop(0)
        sharder = by_type.get(sharder_name(type(child)))
        if sharder is not None:
            found[path] = (child, sharder)
            continue
        queue.extend((f"{path}.{name}" if path else name, grandchild) for name, grandchild in child.named_children())
    return found


def _model_inputs(module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> dict[str, Any]:
    modules = []
    for path, (child, sharder) in sorted(claimed_modules(module, sharders).items()):
        configs = _table_configs(child)
        tables = []
        for name, param in sorted(sharder.shardable_parameters(child).items()):
            tables.append(
                {
                    "name": name,
                    "shape": [int(d) for d in param.shape],
                    "dtype": str(param.dtype),
                    "config": _canonical(configs.get(name)),
                }
            )
        is_weighted = getattr(child, "is_weighted", None)
        modules.append(
            {
                "path": path,
                "type": _qualname(type(child)),
                "sharder": _qualname(type(sharder)),
                "is_weighted": bool(is_weighted()) if callable(is_weighted) else None,
                "tables": tables,
            }
        )
    # Storage reservation subtracts the dense part (parameters and buffers) from every device.
    total_bytes = sum(t.numel() * t.element_size() for t in module.parameters())
    total_bytes += sum(t.numel() * t.element_size() for t in module.buffers())
    return {"type": _qualname(type(module)), "modules": modules, "total_bytes": total_bytes}


def _table_configs(module: Any) -> dict[str, Any]:
    for accessor in ("embedding_bag_configs", "embedding_configs", "tables"):
        fn = getattr(module, accessor, None)
        if callable(fn):
            try:
                # Tables are looked up by parameter name: a config without one cannot match.
                return {c.name: c for c in fn() if isinstance(getattr(c, "name", None), str)}
            except Exception:  # noqa: BLE001 - some modules expose the accessor but not for this case
                continue
    return {}


def _sharder_inputs(sharder: Any) -> dict[str, Any]:
    return {
        "type": _qualname(type(sharder)),
        "module_type": _qualname(sharder.module_type),
        "settings": _canonical(sharder),
    }


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _canonical(obj: Any, depth: int = 0, memo: dict[int, Any] | None = None) -> Any:
    """JSON-ready, process-independent form of a settings object (no ids, no reprs with addresses).

    Each step answers for the values it knows, or :data:`_UNHANDLED` for the next one to try; the
    order of the steps is part of the key (an enum that is also an ``int`` is named, not counted).
    """
    kind: type = type(obj)
    if kind in _PLAIN:  # the common case first: this runs tens of thousands of times per key
        return obj
    if kind is float:
        return obj if obj == obj and obj not in (_INF, -_INF) else repr(obj)
    if kind is list or kind is tuple:
        return [_canonical(v, depth + 1, memo) for v in obj]
    if kind is dict:
        return {str(k): _canonical(obj[k], depth + 1, memo) for k in sorted(obj, key=str)}
    out = _canonical_named(obj, kind, depth, memo)
    if out is not _UNHANDLED:
        return out
    if depth > _MAX_DEPTH:
        return _qualname(kind)
    out = _canonical_collection(obj, depth, memo)
    if out is _UNHANDLED:
        out = _canonical_torch(obj, kind)
    if out is _UNHANDLED:
        out = _canonical_fields(obj, kind, depth, memo)
    return out


def _canonical_named(obj: Any, kind: type, depth: int, memo: dict[int, Any] | None) -> Any:
    """Values known by their name or value at any depth: enum members, subclasses of the plain
    types, partials, and classes and functions (by qualified name)."""
    if isinstance(obj, enum.Enum):
        return f"{kind.__qualname__}.{obj.name}"
    if isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return _canonical(float(obj))
    if isinstance(obj, functools.partial):
        return {
            "partial": _canonical(obj.func, depth + 1, memo),
            "args": _canonical(obj.args, depth + 1, memo),
            "keywords": _canonical(obj.keywords, depth + 1, memo),
        }
    if isinstance(obj, (type, *_FUNCTION_TYPES)) or callable(obj) and not hasattr(obj, "__dict__"):
        return _qualname(obj)
    return _UNHANDLED


def _canonical_collection(obj: Any, depth: int, memo: dict[int, Any] | None) -> Any:
    """Mappings, sequences and sets other than the built-in ones, by their items (a set's sorted)."""
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v, depth + 1, memo) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, depth + 1, memo) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_canonical(v, depth + 1, memo) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    return _UNHANDLED


def _canonical_torch(obj: Any, kind: type) -> Any:
    """A tensor by its shape and dtype (never its values), a dtype or device by its name."""
    module = kind.__module__
    if module.startswith("torch") and hasattr(obj, "shape") and hasattr(obj, "dtype"):  # a tensor
        return {"tensor": [int(d) for d in obj.shape], "dtype": str(obj.dtype)}
    if module == "torch" or kind.__name__ in ("dtype", "device"):
        return str(obj)
    return _UNHANDLED


def _canonical_fields(obj: Any, kind: type, depth: int, memo: dict[int, Any] | None) -> Any:
    """Any other object by its fields (a dataclass's, else its ``__dict__`` or ``__slots__``) and
    its type; one without fields by its type alone."""
    # One topology is shared by the planner, its enumerator, estimators and perf model: walk it once.
    if memo is None:
        memo = {}
    seen = memo.get(id(obj))
    if seen is not None:
        return {"__cycle__": _qualname(kind)} if seen is _IN_PROGRESS else seen
    memo[id(obj)] = _IN_PROGRESS
    names = _field_names(kind)
    if names is not None:
        fields = {name: getattr(obj, name) for name in names}
    elif hasattr(obj, "__dict__"):
        fields = vars(obj)
    elif hasattr(obj, "__slots__"):
        fields = {k: getattr(obj, k) for k in obj.__slots__ if hasattr(obj, k)}
    else:
        memo[id(obj)] = _qualname(kind)
        return memo[id(obj)]
    out = {k: _canonical(fields[k], depth + 1, memo) for k in sorted(fields) if k not in _STATE_ATTRS}
    out["__type__"] = _qualname(kind)
    memo[id(obj)] = out
    return out


_PLAIN = frozenset({type(None), bool, int, str})
_IN_PROGRESS = object()
_UNHANDLED = object()  # a step of _canonical that does not know the value: the next step tries
_INF = float("inf")
_FUNCTION_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)


@functools.cache
def _field_names(kind: type) -> tuple[str, ...] | None:
    return tuple(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else None
