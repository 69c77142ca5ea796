"""What a compiled frame read while Dynamo traced it, recorded in its entry and checked on the machine
that installs it.

Dynamo turns what a frame reads into constants of its graph and, for most reads, a guard that checks
the value on every call. Within one process that is enough. Across processes it is not, in three ways,
and each is closed here from what Dynamo itself recorded, not from a list of cases:

* **Guard values rebuilt on the new machine.** torch serializes a guard with the objects it reads
  from, and stores modules, classes and functions by name. On the new machine the guard's expected
  value is read again from that machine's objects: a class attribute, a function's ``__defaults__``, a
  constant of another module, ``sys.argv`` or a ``torch.backends`` flag then "matches" whatever it is
  there. The producer records a description of the value behind every guard (:func:`guard_values`);
  the new machine compares it with the value its own guard is about to expect (:func:`changed_value`)
  and installs nothing on a difference.
* **Calls Dynamo folds into constants without a guard** (``torch.distributed.get_rank()``,
  ``get_world_size()``, ``is_initialized()``, ``torch.get_default_dtype()``...): each fold is recorded
  with its arguments and result (:class:`Folds`) and called again on the new machine before installing.
  Their results also pick which of several stored variants a machine reads (each rank its own, for
  rank-dependent frames), see ``dynamo_frames``.
* **Hooks**: Dynamo does not guard module hooks (``skip_nnmodule_hook_guards``) but records which
  hook dictionaries it found empty. Installed frames get those guards for real
  (:func:`real_hook_guards`), so a hook registered on the new machine makes Dynamo trace.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import pickle
import types
import weakref
from typing import Any

from warmstart import torch_internals
from warmstart.compile_cache.dynamo_identity import global_identity, named

#: Guards that are not about a value a source names (checked by torch itself on every call).
_NOT_VALUES = frozenset(
    {
        "GLOBAL_STATE",
        "TORCH_FUNCTION_STATE",
        "SHAPE_ENV",
        "DEFAULT_DEVICE",
        "GRAD_MODE",
        "DETERMINISTIC_ALGORITHMS",
        "BACKEND_MATCH",
        "EMPTY_NN_MODULE_HOOKS_DICT",
        "AUTOGRAD_SAVED_TENSORS_HOOKS",  # and, by content, in guard_values
    }
)
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, slice, range, enum.Enum)
_MAX_ITEMS = 32
_MAX_REPR = 400
#: Longer descriptions (every key of a large dict) are kept as a digest.
_MAX_SHOWN = 2000
#: Guards that compare a value with ``==``: an object of a user's type is described by its ``repr``.
_BY_VALUE = frozenset({"EQUALS_MATCH", "CONSTANT_MATCH"})


class NotDescribable(Exception):
    """What a guard pins cannot be described exactly, the same in every process: its frame is not
    packaged (traced on every new machine)."""


def describe(value: Any, depth: int = 0, by_value: bool = False) -> str:
    """What a guard can see of ``value``, the same in every process: constants by value, tensors by
    their metadata, dicts by all their keys in order, lists, tuples and sets by their items (by their
    length alone past two levels or 32 items, where the guard does not compare the whole value: the
    items read have guards of their own), classes by their name and what their bodies and their
    bases' bodies hold (:func:`class_content`), other objects with a name (modules, functions) by
    that name, and anything else by its type, or, for a guard that compares values (``by_value``), by
    its own ``repr``.

    Raises:
        NotDescribable: a value compared by its ``repr`` whose ``repr`` is too long to keep whole.
    """
    described = _scalar(value)
    if described is None and isinstance(value, (tuple, list, dict, set, frozenset)):
        described = _container(value, depth, by_value)
    return described if described is not None else _object(value, by_value)


def _scalar(value: Any) -> str | None:
    """A constant, a numpy value or a tensor's metadata; ``None`` for anything else."""
    import numpy
    import torch

    if isinstance(value, numpy.generic):
        return f"{type(value).__qualname__} {value!r}"
    if isinstance(value, numpy.ndarray):
        return f"ndarray {value.dtype} {value.shape}"
    if isinstance(value, (*_CONSTANTS, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(value).__qualname__} {value!r}"
    if isinstance(value, torch.Tensor):
        return (
            f"tensor {value.dtype} {value.device.type} {tuple(value.shape)} {tuple(value.stride())} "
            f"requires_grad={value.requires_grad}"
        )
    return None


def _container(value: Any, depth: int, by_value: bool) -> str:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, dict):
        # Every key, in order (Dynamo's loops over a dict follow it), whatever its type or their number.
        if all(isinstance(k, _CONSTANTS) for k in value):
            return _whole(f"{kind} keys {list(value)!r}")
        return _whole(f"{kind} keys [" + ", ".join(describe(k, depth + 1, by_value) for k in value) + "]")
    # A guard on a container's length checks only that; each item a frame reads has a guard of its
    # own. A guard that compares the whole value sees every item, at any depth.
    ordered = isinstance(value, (tuple, list))
    if not by_value and (len(value) > _MAX_ITEMS or (ordered and depth >= 2)):
        return f"{kind} len {len(value)}"
    items = [describe(v, depth + 1, by_value) for v in value]
    return _whole(f"{kind} [" + ", ".join(items) + "]" if ordered else f"{kind} {sorted(items)}")


def _object(value: Any, by_value: bool) -> str:
    """A module, class or function by its name; another object by its type (and ``repr``)."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    identity = global_identity(value)
    if identity is not None:
        return f"{identity} {class_content(value)}" if isinstance(value, type) else identity
    if not by_value or type(value).__repr__ is object.__repr__:
        return f"object {kind}"
    try:
        text = repr(value)
    except Exception:
        return f"object {kind}"
    if len(text) > _MAX_REPR:
        raise NotDescribable(f"the repr of a {kind} is {len(text)} characters long")
    return f"object {kind} {text}"


def _whole(text: str) -> str:
    """``text``, or where it is too long to show in a message, a digest of all of it."""
    if len(text) <= _MAX_SHOWN:
        return text
    return f"{text[:80]}... sha256 {hashlib.sha256(text.encode()).hexdigest()[:32]}"


def class_content(cls: type) -> str:
    """A digest of what ``cls`` and its bases hold, the same in every process: every name of their
    bodies, with functions (methods, static and class methods, properties' functions) by their code
    and defaults, classes and modules by name, constants and containers as :func:`describe` gives
    them, other objects by their type. Within one process a class's identity pins its body; across
    processes only its name does, and a class of the same name may hold another method, chosen when
    it was imported, or override what a base holds."""
    h = hashlib.sha256()
    for klass in cls.__mro__:
        if klass is object or getattr(klass, "__module__", None) == "builtins":
            continue
        h.update(f"{klass.__module__}.{klass.__qualname__}\0{_body(klass)}\0".encode())
    return h.hexdigest()[:32]


#: class -> (what its body holds, by identity; its digest): a body is hashed again only once it changed.
_BODIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _body(klass: type) -> str:
    members = [(name, member) for name, member in list(vars(klass).items()) if name not in _CLASS_CACHES]
    identity = tuple((name, id(m), id(getattr(m, "__code__", None))) for name, m in members)
    known = _BODIES.get(klass)
    if known is not None and known[0] == identity:
        return known[1]
    h = hashlib.sha256()
    for name, member in members:
        h.update(f"{name}={_member(member)}\0".encode())
    digest = h.hexdigest()
    with contextlib.suppress(TypeError):
        _BODIES[klass] = (identity, digest)
    return digest


#: What is added to a class as it is used, not part of what it holds: copyreg's cache (when an
#: instance is first pickled), and the mark Dynamo leaves on ``nn.Module`` when it wraps its
#: ``__init__`` and ``__setstate__`` at a process's first compile (``torch._dynamo.mutation_guard``).
_CLASS_CACHES = frozenset({"__slotnames__", "___needs_generation_tag_patch"})
#: Where the wrappers come from that Dynamo puts in place of a class's methods as it runs: each is
#: described as the method it wraps (the function its closure holds).
_DYNAMO_WRAPPERS = "torch._dynamo.mutation_guard"


def _member(member: Any) -> str:
    from warmstart.compile_cache.dynamo_identity import code_digest

    if isinstance(member, (staticmethod, classmethod)):
        return f"{type(member).__name__} {_member(member.__func__)}"
    if isinstance(member, property):
        return "property " + " ".join(_member(f) for f in (member.fget, member.fset, member.fdel))
    if isinstance(member, types.FunctionType):
        if member.__module__ == _DYNAMO_WRAPPERS and member.__closure__:
            wrapped = [c.cell_contents for c in member.__closure__ if isinstance(c.cell_contents, types.FunctionType)]
            if len(wrapped) == 1:
                return _member(wrapped[0])
        defaults = _described(member.__defaults__), _described(member.__kwdefaults__)
        return f"function {code_digest(member.__code__)} {defaults}"
    if isinstance(member, type):
        return global_identity(member) or f"class {member.__qualname__}"  # by name: no walk into it
    if isinstance(member, types.ModuleType):
        return f"module {member.__name__}"
    return _described(member)


def _described(value: Any) -> str:
    try:
        return describe(value, depth=1)
    except Exception:
        return f"object {type(value).__module__}.{type(value).__qualname__}"


def _checked(guard: Any) -> bool:
    # Every guard on a value some source names, whatever the source (a local, a global, a closure
    # cell, a mode on torch's stack): one whose value cannot be read on the producer is left to torch.
    return guard.create_fn_name() not in _NOT_VALUES and bool(guard.name)


def guard_values(builder: Any, guards: list, output_graph: Any) -> list[tuple[str, str]]:
    """``(guard, description of the value behind it)`` for the value guards of a frame, as the
    producer's Dynamo saw them (``builder`` is the one that built the guards, ``output_graph`` the
    frame's graph), and the torch function modes it was traced under."""
    found = []
    for guard in guards:
        if not _checked(guard):
            continue
        kind = guard.create_fn_name()
        try:
            found.append((f"{kind} {guard.name}", _guarded(kind, builder.get(guard))))
        except NotDescribable:
            raise
        except Exception:
            continue  # nothing to compare: torch's own guard is all there is
    kinds = {guard.create_fn_name() for guard in guards}
    if "TORCH_FUNCTION_STATE" in kinds:
        # torch checks the modes on its stack by their classes' identity: by content here
        found.append((_MODES, _modes(output_graph.torch_function_mode_stack)))
    if "AUTOGRAD_SAVED_TENSORS_HOOKS" in kinds:
        # torch checks the ids of inlineable saved-tensors hooks, which mean nothing in another process
        hooks = _saved_tensors_hooks()
        if hooks != "none":
            raise NotDescribable("the frame was traced under inlineable saved-tensors hooks")
        found.append((_SAVED_TENSORS_HOOKS, hooks))
    return found


#: The entries of :func:`guard_values` for the torch function modes a frame was traced under and for
#: the saved-tensors hooks around it.
_MODES = "TORCH_FUNCTION_STATE modes"
_SAVED_TENSORS_HOOKS = "AUTOGRAD_SAVED_TENSORS_HOOKS inlineable"


def _saved_tensors_hooks() -> str:
    hooks = torch_internals.require("top_saved_tensors_hooks")()
    inlineable = torch_internals.require("saved_tensors_hooks_are_inlineable")(hooks)
    return "inlineable" if inlineable else "none"


def _modes(stack: list) -> str:
    return "[" + ", ".join(describe(type(mode)) for mode in stack) + "]"


def _guarded(kind: str, value: Any) -> str:
    described = describe(value, by_value=kind in _BY_VALUE)
    if kind == "TYPE_MATCH":  # it pins the value's class too, by identity in its process: by content here
        return f"{described} of {describe(type(value))}"
    return described


def changed_value(expected: list[tuple[str, str]], guards_state: Any) -> str | None:
    """The first guard whose value, as this machine's guards would expect it, is not what the producer
    saw, as a phrase; ``None`` when all are the same."""
    import builtins

    _get_closure_vars = torch_internals.require("get_closure_vars")

    output_graph = guards_state.output_graph
    scope = {"L": output_graph.local_scope, "G": output_graph.global_scope, "__builtins__": builtins.__dict__.copy()}
    by_name = {f"{g.create_fn_name()} {g.name}": g for g in output_graph.guards}
    cache: dict = {}
    for name, was in expected:
        if name in (_MODES, _SAVED_TENSORS_HOOKS):
            now = _modes(output_graph.torch_function_mode_stack) if name == _MODES else _saved_tensors_hooks()
            if now != was:
                what = "the torch function modes" if name == _MODES else "the saved-tensors hooks"
                return f"{what} are {now} here, were {was}"
            continue
        guard = by_name.get(name)
        if guard is None:
            return f"{name.partition(' ')[2]} is not guarded here"
        try:
            now = _guarded(
                guard.create_fn_name(), guard.originating_source.get_value(scope, _get_closure_vars(), cache)
            )
        except Exception as exc:
            now = f"unreadable ({type(exc).__name__})"
        if now != was:
            return f"{guard.name} is {now}, was {was}"
    return None


def pure_folds() -> frozenset:
    """Functions Dynamo folds whose result depends on their arguments alone, the same in every
    process: nothing to record (``math``'s functions are left out by module)."""
    import torch
    import torch.nn._reduction

    return frozenset(
        {torch.is_complex, torch.is_floating_point, torch.promote_types, torch._assert, torch.nn._reduction.get_enum}
    )


class Folds:
    """Calls Dynamo folded into constants without a guard, while compiling one package's frames."""

    def __init__(self) -> None:
        #: (function's name, pickled arguments) -> description of the result
        self.calls: dict[tuple[str, bytes], str] = {}

    def record(self, function: Any, args: tuple, kwargs: dict, result: Any) -> None:
        name = global_identity(function)
        try:
            arguments = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            arguments = None
        if name is None or arguments is None:
            raise UnrecordedFold(f"{getattr(function, '__qualname__', function)!s}(...)")
        self.calls[(name, arguments)] = describe(result)

    def update(self, calls: dict[tuple[str, bytes], str]) -> None:
        self.calls.update(calls)


class UnrecordedFold(Exception):
    """Dynamo folded a call whose function or arguments cannot be named in another process."""


def fold_results(calls: list[tuple[str, bytes]]) -> list[str]:
    """The result of each recorded call, made again in this process."""
    results = []
    for name, arguments in calls:
        try:
            args, kwargs = pickle.loads(arguments)
            results.append(describe(named(name)(*args, **kwargs)))
        except Exception as exc:
            results.append(f"raises {type(exc).__name__}")
    return results


def changed_fold(calls: dict[tuple[str, bytes], str]) -> str | None:
    """The first folded call whose result here is not the producer's, as a phrase."""
    ordered = sorted(calls)
    for (name, arguments), now in zip(ordered, fold_results(ordered), strict=True):
        was = calls[(name, arguments)]
        if now != was:
            return f"{_call_text(name)} is {now} here, was {was}"
    return None


def variant(calls: list[tuple[str, bytes]], results: list[str]) -> str:
    """A digest of what the folded calls give: the variant of an entry a machine reads."""
    h = hashlib.sha256()
    for (name, arguments), result in zip(calls, results, strict=False):
        h.update(name.encode() + b"\0" + arguments + b"\0" + result.encode() + b"\0")
    return h.hexdigest()[:32]


def _call_text(name: str) -> str:
    kind, _, rest = name.partition(" ")
    return rest.split(":")[1] + "()" if ":" in rest else name


@contextlib.contextmanager
def real_hook_guards():
    """While installing frames, the hook guards Dynamo recorded check for real that each hooks
    dictionary it found empty is still empty, on every call (Dynamo itself skips them by default)."""
    GuardBuilder = torch_internals.require("GuardBuilder")
    get_verbose_code_parts = torch_internals.require("get_verbose_code_parts")

    original = GuardBuilder.__dict__["EMPTY_NN_MODULE_HOOKS_DICT"]

    @functools.wraps(original)
    def EMPTY_NN_MODULE_HOOKS_DICT(self, guard):  # noqa: N802 (torch's name: guards are pickled by it)
        # The stored module holds no hooks dictionaries to measure: the expected length is 0.
        code = [f"not {self.arg_ref(guard)}"]
        self._set_guard_export_info(guard, code)
        self.get_guard_manager(guard).add_dict_length_check_guard(
            0, get_verbose_code_parts(code, guard), guard.user_stack
        )

    GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT = EMPTY_NN_MODULE_HOOKS_DICT
    try:
        yield
    finally:
        GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT = original
