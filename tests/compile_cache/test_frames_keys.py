"""The pure parts of compiled frames: the key of a function's entry and of its variants, digests of
code, reprs that are the same in every process, the names of globals, and the process's state (no
compile here; ``test_dynamo_frames.py`` runs them end to end)."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import threading
import types
import weakref

import torch

from warmstart.compile_cache import frame_reads
from warmstart.compile_cache.dynamo_frames import state
from warmstart.compile_cache.dynamo_frames.keys import entry_key, variant_key
from warmstart.compile_cache.dynamo_identity import code_digest, global_identity, named, stable_repr


class Holder:
    pass


def plain(x):
    return x + 1


def _step(body: str, module: str = __name__) -> types.FunctionType:
    """A function ``step`` of ``module`` that returns ``body``, made anew on each call."""
    namespace = {"__name__": module}
    exec(f"def step(x):\n    return {body}\n", namespace)
    return namespace["step"]


def _key(function=None, module=None, backend="inductor", dynamic=None, fullgraph=False) -> str:
    return entry_key(function or _step("x + 1"), module, backend, dynamic, fullgraph)


def test_the_same_function_module_and_options_give_the_same_key():
    torch.manual_seed(0)
    first = torch.nn.Linear(2, 3)
    torch.manual_seed(1)
    second = torch.nn.Linear(2, 3)  # other weights, the same structure
    assert _key(_step("x + 1"), first) == _key(_step("x + 1"), second)
    assert _key(_step("x + 1")) == _key(_step("x + 1"))


def test_what_the_frames_depend_on_changes_the_key():
    base = _key(_step("x + 1"), torch.nn.Linear(2, 3))
    changed = {
        "module repr": _key(_step("x + 1"), torch.nn.Linear(2, 4)),
        "no module": _key(_step("x + 1")),
        "module class": _key(_step("x + 1"), torch.nn.Sequential(torch.nn.Linear(2, 3))),
        "backend options": _key(_step("x + 1"), torch.nn.Linear(2, 3), backend="inductor [('max_autotune', 'True')]"),
        "dynamic": _key(_step("x + 1"), torch.nn.Linear(2, 3), dynamic=True),
        "fullgraph": _key(_step("x + 1"), torch.nn.Linear(2, 3), fullgraph=True),
        "code": _key(_step("x + 2"), torch.nn.Linear(2, 3)),
        "function's module": _key(_step("x + 1", module="elsewhere"), torch.nn.Linear(2, 3)),
    }
    with torch._inductor.config.patch(max_autotune=not torch._inductor.config.max_autotune):
        changed["inductor config"] = _key(_step("x + 1"), torch.nn.Linear(2, 3))
    with torch._dynamo.config.patch(cache_size_limit=torch._dynamo.config.cache_size_limit + 1):
        changed["dynamo config"] = _key(_step("x + 1"), torch.nn.Linear(2, 3))
    with torch._functorch.config.patch(donated_buffer=not torch._functorch.config.donated_buffer):
        changed["functorch config"] = _key(_step("x + 1"), torch.nn.Linear(2, 3))
    assert [what for what, key in changed.items() if key == base] == []
    assert len(set(changed.values())) == len(changed)


class _NamedPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, graph):
        return None

    def uuid(self):
        return self.name


def test_private_settings_and_custom_passes_change_the_key():
    """torch's own portable config leaves out private settings and custom passes; they change what
    Inductor makes all the same."""
    base = _key()
    inductor = torch._inductor.config
    changed = {}
    with inductor.patch(_realize_opcount_threshold_default=inductor._realize_opcount_threshold_default + 1):
        changed["private setting"] = _key()
    with inductor.patch(post_grad_custom_post_pass=_NamedPass("one")):
        changed["a pass"] = _key()
    with inductor.patch(post_grad_custom_post_pass=_NamedPass("two")):
        changed["another pass"] = _key()
    with inductor.patch(post_grad_custom_post_pass=plain):  # a plain function: named by its code
        changed["a function"] = _key()
    assert base not in changed.values() and len(set(changed.values())) == len(changed), changed
    with inductor.patch(post_grad_custom_post_pass=_NamedPass("one")):
        assert _key() == changed["a pass"]


def test_a_setting_nothing_names_in_another_process_leaves_the_frames_unpackaged(caplog):
    with (
        torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None),
        caplog.at_level("DEBUG", logger="warmstart.cache"),
    ):
        assert _key() is None
    assert "post_grad_custom_post_pass" in caplog.text and "not packaged" in caplog.text


def test_what_says_where_or_how_fast_is_not_part_of_the_key():
    base = _key()
    inductor = torch._inductor.config
    with inductor.patch(compile_threads=inductor.compile_threads + 3, **{"trace.enabled": not inductor.trace.enabled}):
        assert _key() == base


def test_where_this_machine_keeps_files_is_not_part_of_the_key():
    base = _key()
    with torch._dynamo.config.patch(debug_dir_root=os.path.join(os.sep, "elsewhere", "debug")):
        assert _key() == base


def test_each_variant_has_a_key_of_its_own():
    calls = [("builtin math:gcd", b"args")]
    rank0, rank1 = frame_reads.variant(calls, ["int 0"]), frame_reads.variant(calls, ["int 1"])
    assert rank0 != rank1
    assert variant_key("k", rank0) == variant_key("k", rank0)
    assert len({variant_key("k", rank0), variant_key("k", rank1), variant_key("other", rank0), "k"}) == 4


def test_code_digest_leaves_the_file_out_and_keeps_the_code():
    source = "def outer(x):\n    def inner(y):\n        return y * 2\n    return inner(x)\n"
    here, there = compile(source, "/a/model.py", "exec"), compile(source, "/b/model.py", "exec")
    assert code_digest(here) == code_digest(there)
    assert code_digest(here) != code_digest(compile(source.replace("y * 2", "y * 3"), "/a/model.py", "exec"))
    assert code_digest(here) != code_digest(compile("\n" + source, "/a/model.py", "exec"))  # its first line
    assert code_digest(_step("x + 1").__code__) == code_digest(_step("x + 1").__code__)
    assert code_digest(_step("x + 1").__code__) != code_digest(_step("x - 1").__code__)


def test_stable_repr_is_the_same_whatever_the_order_or_the_process():
    assert stable_repr({"b", "a"}) == "{'a', 'b'}" == stable_repr(frozenset(["a", "b"]))
    assert stable_repr({"y": {3, 1}, "x": [2]}) == stable_repr({"x": [2], "y": {1, 3}}) == "{'x': (2), 'y': {1, 3}}"
    assert stable_repr({1, 2}) != stable_repr({1, 3})
    program = (
        "from warmstart.compile_cache.dynamo_identity import stable_repr\n"
        "names = {f'name{i}' for i in range(32)}\n"
        "print(repr(names)); print(stable_repr(names))\n"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", program],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        for seed in ("1", "2", "3")
    ]
    assert len({plain_repr for plain_repr, _ in outputs}) > 1  # plain repr follows the hash seed
    assert len({stable for _, stable in outputs}) == 1


def test_globals_are_named_the_same_in_every_process_and_resolve_back():
    for obj, identity in (
        (os, "module os"),
        (Holder, f"class {__name__}:Holder"),
        (len, "builtin builtins:len"),
        (torch.nn.Linear, "class torch.nn.modules.linear:Linear"),
        (plain, f"function {__name__}:plain:{code_digest(plain.__code__)}"),
    ):
        assert global_identity(obj) == identity
        assert named(identity) is obj


def test_objects_without_a_name_in_other_processes_have_no_identity():
    def nested(x):
        return x

    class Local:
        pass

    offset = 1

    def closure(x):
        return x + offset

    impostor = _step("x + 1")
    impostor.__qualname__ = "plain"  # its module's ``plain`` is another function
    for obj in (
        nested,
        lambda x: x,
        Local,
        closure,
        impostor,
        Holder(),
        functools.partial(plain),
        types.ModuleType("not_imported"),
        3,
    ):
        assert global_identity(obj) is None, obj


def test_reset_forgets_the_decisions_and_keeps_what_mirrors_torchs_objects():
    fresh = state.State()
    used = state.State()
    used.packages[Holder()] = state.Package()  # gone once its key is: weak
    kept = Holder()
    used.packages[kept] = state.Package(key="k")
    used.compiling.state = state.Package()
    used.loading.values = {}
    used.enabled = True
    used.installed.add("k")
    used.refused.add("k")
    used.installed_codes.append(plain.__code__)
    used.flavors.update({"inductor", "eager"})
    used.mixed = "eager and inductor"
    used.stored["k"] = b"fingerprint"
    lock = used.lock
    assert _differing(used, fresh) == [f.name for f in dataclasses.fields(used) if f.name != "lock"]
    used.reset()
    assert _differing(used, fresh) == sorted(state.KEPT_ON_RESET - {"lock"}, key=_field_order)
    assert not {"enabled", "refused", "stored"} & state.KEPT_ON_RESET
    assert used.lock is lock  # a thread may hold it
    assert used.packages[kept].key == "k" and "k" in used.installed


def _field_order(name: str) -> int:
    return [f.name for f in dataclasses.fields(state.State)].index(name)


def _differing(one: state.State, other: state.State) -> list[str]:
    return [
        f.name for f in dataclasses.fields(one) if _contents(getattr(one, f.name)) != _contents(getattr(other, f.name))
    ]


def _contents(value):
    if isinstance(value, weakref.WeakKeyDictionary):
        return dict(value)
    if isinstance(value, threading.local):
        return vars(value)
    if hasattr(value, "acquire"):  # a lock: the same in every fresh state
        return "lock"
    return value


def test_without_a_store_nothing_is_packaged_and_nothing_is_decided():
    from warmstart.compile_cache import get_store

    assert get_store() is None  # WARMSTART is not on in the test process
    state.reset()
    assert state.enabled() is False
    assert state.STATE.enabled is None  # decided at the first use with a store
