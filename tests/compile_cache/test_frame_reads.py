"""The pure parts of what compiled frames record and check: value descriptions, folded calls and their
variants, and the names of globals (no compile here; ``test_frames_adversarial.py`` runs them end to
end)."""

from __future__ import annotations

import functools
import math
import os
import pickle

import pytest
import torch

from warmstart.compile_cache import frame_reads
from warmstart.compile_cache.dynamo_identity import code_digest, global_identity, named, resolve, stable_repr


class Holder:
    K = 2.0


def plain(x):
    return x + 1


def test_constants_are_described_by_type_and_value():
    assert frame_reads.describe(2.0) == "float 2.0"
    assert frame_reads.describe(2) == "int 2" != frame_reads.describe(2.0)
    assert frame_reads.describe(True) != frame_reads.describe(1)
    assert frame_reads.describe(None) == "NoneType None"
    assert frame_reads.describe(torch.float32) != frame_reads.describe(torch.float64)


def test_tensors_are_described_by_their_metadata_not_their_values():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert frame_reads.describe(a) == frame_reads.describe(b)
    assert frame_reads.describe(a) != frame_reads.describe(a.double())
    assert frame_reads.describe(a) != frame_reads.describe(a.t())  # strides
    assert frame_reads.describe(a) != frame_reads.describe(a.clone().requires_grad_())
    assert frame_reads.describe(a) != frame_reads.describe(torch.zeros(3, 2))


def test_containers_show_their_length_and_constant_items():
    assert frame_reads.describe(["a.py"]) != frame_reads.describe(["a.py", "--extra"])
    assert frame_reads.describe((2.0,)) != frame_reads.describe((3.0,))
    assert frame_reads.describe({"gain": 1}) == frame_reads.describe({"gain": 2})  # values have guards of their own
    assert frame_reads.describe({"gain": 1}) != frame_reads.describe({"gain": 1, "bias": 0})
    assert frame_reads.describe({}) != frame_reads.describe({7: plain})  # a hooks dict that gained a hook
    assert frame_reads.describe({1: 2.0, 2: 3.0}) != frame_reads.describe({2: 3.0, 1: 2.0})  # keys in order
    assert frame_reads.describe({1: 2.0, 2: 3.0}) != frame_reads.describe({1: 2.0, 3: 3.0})
    long = list(range(100))
    assert frame_reads.describe(long) == frame_reads.describe(list(range(100, 200)))  # only the length
    # ... unless the guard compares the whole value: then every item, at any depth
    assert frame_reads.describe(long, by_value=True) != frame_reads.describe(list(range(100, 200)), by_value=True)
    nested = [[[1.0]], [[2.0]]]
    assert frame_reads.describe(nested, by_value=True) != frame_reads.describe([[[1.0]], [[3.0]]], by_value=True)


def test_every_key_of_a_dict_is_described_in_order_whatever_their_number_or_type():
    many = {f"k{i}": i for i in range(40)}
    assert frame_reads.describe(many) != frame_reads.describe(dict(reversed(many.items())))
    assert frame_reads.describe(many) != frame_reads.describe({**many, "k39": 0, "k40": 0})
    assert len(frame_reads.describe({f"k{i}": i for i in range(5000)})) < 200  # kept as a digest
    by_class = {Holder: 1, int: 2}
    assert frame_reads.describe(by_class) != frame_reads.describe({int: 2, Holder: 1})
    assert frame_reads.describe(by_class) == frame_reads.describe({Holder: 3, int: 4})


def test_objects_are_described_by_name_or_type_never_by_address():
    assert frame_reads.describe(os) == "module os"
    assert frame_reads.describe(Holder) == f"class {__name__}:Holder {frame_reads.class_content(Holder)}"
    assert frame_reads.describe(plain).startswith(f"function {__name__}:plain:")
    assert frame_reads.describe(Holder()) == frame_reads.describe(Holder()) == f"object {__name__}.Holder"


def test_a_class_is_described_by_what_its_body_and_its_bases_hold_the_same_in_every_process():
    import subprocess
    import sys
    import textwrap

    program = textwrap.dedent(
        """
        import sys
        from warmstart.compile_cache import frame_reads
        def double(self, x): return x * 2
        def triple(self, x): return x * 3
        class Base:
            OFFSET = 1.0
        class Op(Base):
            apply = double if sys.argv[1] == "double" else triple
        if sys.argv[2] == "override":
            Op.OFFSET = 5.0
        print(frame_reads.describe(Op))
        """
    )

    def described(*args: str) -> str:
        out = subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    same = described("double", "inherit")
    assert same == described("double", "inherit")  # the same in another process: nothing of an address
    assert same.startswith("class __main__:Op ")
    assert described("triple", "inherit") != same  # a method chosen at import
    assert described("double", "override") != same  # an attribute of the base overridden


def test_functions_are_named_with_their_code():
    assert global_identity(plain) == f"function {__name__}:plain:{code_digest(plain.__code__)}"
    assert global_identity(math.sqrt) == "builtin math:sqrt"
    assert global_identity(lambda x: x) is None  # no name leads to it
    assert global_identity(functools.partial(plain)) is None
    assert named(global_identity(plain)) is plain and named("module os") is os


def test_code_digest_changes_with_the_code_and_not_with_the_file():
    def one(x):
        return x * 2

    def two(x):
        return x * 3

    moved = one.__code__.replace(co_filename="/elsewhere/model.py")
    assert code_digest(one.__code__) == code_digest(moved)
    assert code_digest(one.__code__) != code_digest(two.__code__.replace(co_name="one", co_qualname=one.__qualname__))


def test_stable_repr_sorts_sets():
    assert stable_repr({"b", "a", "c"}) == "{'a', 'b', 'c'}" == stable_repr({"c", "a", "b"})


def test_resolve_follows_a_global_source():
    scope = {"Holder": Holder, "os": os}
    assert resolve("G['Holder'].K", scope, {}) == 2.0
    assert resolve("G['os'].path", scope, {}) is os.path
    with pytest.raises(KeyError):
        resolve("G['missing']", scope, {})


def test_folded_calls_are_made_again_and_pick_a_variant():
    folds = frame_reads.Folds()
    folds.record(torch.get_default_dtype, (), {}, torch.get_default_dtype())
    folds.record(math.gcd, (12, 8), {}, 4)
    calls = sorted(folds.calls)
    assert frame_reads.fold_results(calls) == [folds.calls[c] for c in calls]
    assert frame_reads.changed_fold(folds.calls) is None
    here = frame_reads.variant(calls, frame_reads.fold_results(calls))
    assert here == frame_reads.variant(calls, [folds.calls[c] for c in calls])
    torch.set_default_dtype(torch.float64)
    try:
        changed = frame_reads.changed_fold(folds.calls)
        assert changed == "get_default_dtype() is dtype torch.float64 here, was dtype torch.float32"
        assert frame_reads.variant(calls, frame_reads.fold_results(calls)) != here
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_fold_that_raises_here_is_a_difference():
    folds = frame_reads.Folds()
    folds.calls[(global_identity(math.sqrt), pickle.dumps(((-1.0,), {})))] = "float 1.0"
    assert frame_reads.changed_fold(folds.calls) == "sqrt() is raises ValueError here, was float 1.0"


def test_a_fold_without_a_name_cannot_be_recorded():
    with pytest.raises(frame_reads.UnrecordedFold):
        frame_reads.Folds().record(lambda: 1, (), {}, 1)


def test_every_fold_dynamo_makes_is_recorded_by_name_or_known_to_be_pure():
    """A fold that can be neither recorded nor skipped would leave its frames unpackaged."""
    from torch._dynamo.variables.torch import constant_fold_functions, constant_fold_functions_need_guards

    unnamed = [
        f
        for f in constant_fold_functions
        if f not in constant_fold_functions_need_guards
        and f not in frame_reads.pure_folds()
        and global_identity(f) is None
    ]
    assert unnamed == []
