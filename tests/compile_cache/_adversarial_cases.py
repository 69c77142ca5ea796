"""Adversarial cases for compiled frames: each a tiny function or module whose compiled frames read
something that can differ between the machine that filled the cache (condition ``x``) and a new one
(condition ``y``). ``_adversarial_job.py`` compiles every case under one condition and compares it with
eager PyTorch under the same condition; a run under ``x`` on a new machine is each case's control
(its frames must be installed, or the case proves nothing).

A case is a function of the condition that sets the condition up and returns a :class:`Case`. Every
case has functions and classes of its own (each is a key of its own), and undoes what it changed in
the process (``teardown``), so the cases of one run do not see each other's conditions.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import _adversarial_helper as helper
import torch
from torch import nn

CASES: dict[str, tuple[str, Callable[[str], Case]]] = {}


@dataclasses.dataclass
class Case:
    target: Any  # what torch.compile is applied to: a function or a module
    args: tuple
    #: Run a backward too and compare the gradients of the inputs (and of a module's parameters).
    backward: bool = False
    teardown: Callable[[], None] | None = None
    #: Under ``y`` the frames must not be installed at all (what they depend on changed, and no result
    #: would show it on this machine: a compiler setting).
    must_trace: bool = False


def case(name: str, family: str):
    def register(build: Callable[[str], Case]) -> Callable[[str], Case]:
        CASES[name] = (family, build)
        return build

    return register


def _x() -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) / 7.0


def _lin(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


# -- class and function attributes ----------------------------------------------------------------


class ScaledNet(nn.Module):
    K = 2.0

    def forward(self, x):
        return x * self.K + 1.0


@case("class_attribute_in_forward", "attributes")
def _(cond):
    ScaledNet.K = 2.0 if cond == "x" else 3.0
    return Case(ScaledNet(), (_x(),), teardown=lambda: setattr(ScaledNet, "K", 2.0))


class Holder:
    K = 2.0


def reads_class_attribute(x):
    return x * Holder.K - 1.0


@case("class_attribute_in_function", "attributes")
def _(cond):
    Holder.K = 2.0 if cond == "x" else 3.0
    return Case(reads_class_attribute, (_x(),), teardown=lambda: setattr(Holder, "K", 2.0))


def reads_own_attribute(x):
    return x * reads_own_attribute.scale + 0.5


reads_own_attribute.scale = 2.0


@case("function_attribute", "attributes")
def _(cond):
    reads_own_attribute.scale = 2.0 if cond == "x" else 3.0
    return Case(reads_own_attribute, (_x(),), teardown=lambda: setattr(reads_own_attribute, "scale", 2.0))


class TensorHolder:
    W = torch.ones(4)


def adds_class_tensor(x):
    return x + TensorHolder.W


@case("class_tensor_dtype", "attributes")
def _(cond):
    TensorHolder.W = torch.ones(4) if cond == "x" else torch.ones(4, dtype=torch.float64)
    return Case(adds_class_tensor, (_x(),), teardown=lambda: setattr(TensorHolder, "W", torch.ones(4)))


class Inner(nn.Module):
    GAIN = 2.0

    def forward(self, x):
        return x * self.GAIN


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x) + 1.0


@case("submodule_class_attribute", "attributes")
def _(cond):
    Inner.GAIN = 2.0 if cond == "x" else 3.0
    return Case(Outer(), (_x(),), teardown=lambda: setattr(Inner, "GAIN", 2.0))


class Settings:
    def __init__(self):
        self.gain = 2.0


SETTINGS = Settings()


def reads_global_instance(x):
    return x * SETTINGS.gain


@case("global_instance_attribute", "attributes")
def _(cond):
    SETTINGS.gain = 2.0 if cond == "x" else 3.0
    return Case(reads_global_instance, (_x(),), teardown=lambda: setattr(SETTINGS, "gain", 2.0))


class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _lin(1)
        self.double = True

    def forward(self, x):
        y = self.lin(x)
        return y * 2.0 if self.double else y


@case("instance_attribute", "attributes")
def _(cond):
    model = Flagged()
    model.double = cond == "x"
    return Case(model, (_x(),), backward=True)


# -- function defaults ------------------------------------------------------------------------------


def with_default(x, s=2.0):
    return x * s


@case("defaults", "defaults")
def _(cond):
    with_default.__defaults__ = (2.0,) if cond == "x" else (3.0,)
    return Case(with_default, (_x(),), teardown=lambda: setattr(with_default, "__defaults__", (2.0,)))


def with_kwdefault(x, *, s=2.0):
    return x * s + 1.0


@case("kwdefaults", "defaults")
def _(cond):
    with_kwdefault.__kwdefaults__ = {"s": 2.0 if cond == "x" else 3.0}
    return Case(with_kwdefault, (_x(),), teardown=lambda: setattr(with_kwdefault, "__kwdefaults__", {"s": 2.0}))


def callee_with_default(x, s=2.0):
    return x * s


def calls_with_default(x):
    return callee_with_default(x) - 1.0


@case("defaults_of_a_callee", "defaults")
def _(cond):
    callee_with_default.__defaults__ = (2.0,) if cond == "x" else (3.0,)
    return Case(calls_with_default, (_x(),), teardown=lambda: setattr(callee_with_default, "__defaults__", (2.0,)))


# -- constants in other modules ---------------------------------------------------------------------


def calls_helper(x):
    return helper.shifted(x) * 0.5


@case("helper_module_constant", "other modules")
def _(cond):
    helper.SCALE = 2.0 if cond == "x" else 3.0
    return Case(calls_helper, (_x(),), teardown=lambda: setattr(helper, "SCALE", 2.0))


def reads_helper_constant(x):
    return x - helper.OFFSET


@case("other_module_constant", "other modules")
def _(cond):
    helper.OFFSET = 1.0 if cond == "x" else 3.0
    return Case(reads_helper_constant, (_x(),), teardown=lambda: setattr(helper, "OFFSET", 1.0))


def reads_helper_dict(x):
    return x * helper.TABLE["gain"]


@case("other_module_dict", "other modules")
def _(cond):
    helper.TABLE["gain"] = 2.0 if cond == "x" else 3.0
    return Case(reads_helper_dict, (_x(),), teardown=lambda: helper.TABLE.__setitem__("gain", 2.0))


def reads_helper_class(x):
    return x * helper.Config.gain + 2.0


@case("other_module_class_attribute", "other modules")
def _(cond):
    helper.Config.gain = 2.0 if cond == "x" else 3.0
    return Case(reads_helper_class, (_x(),), teardown=lambda: setattr(helper.Config, "gain", 2.0))


# -- process state ------------------------------------------------------------------------------------


def reads_argv_length(x):
    return x * len(sys.argv)


def _argv(cond):
    added = [] if cond == "x" else ["--extra"]
    sys.argv.extend(added)

    def restore():
        for item in added:
            sys.argv.remove(item)

    return restore


@case("argv_length", "process state")
def _(cond):
    return Case(reads_argv_length, (_x(),), teardown=_argv(cond))


def reads_argv_flag(x):
    return x * (3.0 if "--extra" in sys.argv else 2.0)


@case("argv_flag", "process state")
def _(cond):
    return Case(reads_argv_flag, (_x(),), teardown=_argv(cond))


def reads_environ(x):
    return x * float(os.environ.get("ADVERSARIAL_SCALE", "2.0"))


@case("environment_variable", "process state")
def _(cond):
    if cond == "y":
        os.environ["ADVERSARIAL_SCALE"] = "3.0"
    return Case(reads_environ, (_x(),), teardown=lambda: os.environ.pop("ADVERSARIAL_SCALE", None))


# -- torch flags and global state ---------------------------------------------------------------------


def reads_mkldnn_flag(x):
    return x * 2.0 if torch.backends.mkldnn.enabled else x * 3.0


@case("backends_flag", "torch flags")
def _(cond):
    torch.backends.mkldnn.enabled = cond == "x"
    return Case(reads_mkldnn_flag, (_x(),), teardown=lambda: setattr(torch.backends.mkldnn, "enabled", True))


def reads_opt_einsum_flag(x):
    return x + 1.0 if torch.backends.opt_einsum.enabled else x - 1.0


@case("opt_einsum_flag", "torch flags")
def _(cond):
    torch.backends.opt_einsum.enabled = cond == "x"
    return Case(reads_opt_einsum_flag, (_x(),), teardown=lambda: setattr(torch.backends.opt_einsum, "enabled", True))


def plain_add(x):
    return torch.relu(x - 0.3) * 2.0


@case("inductor_config_after_compile", "torch flags")
def _(cond):
    # Set after torch.compile() and before the first call (see the job): read by the compile.
    return Case(plain_add, (_x(),), must_trace=cond == "y")


def makes_ones(x):
    return x + torch.ones(4)


@case("default_dtype", "torch flags")
def _(cond):
    if cond == "y":
        torch.set_default_dtype(torch.float64)
    return Case(makes_ones, (_x(),), teardown=lambda: torch.set_default_dtype(torch.float32))


def grad_mode_dependent(x):
    return x * 2.0 if torch.is_grad_enabled() else x * 3.0


@case("grad_mode", "torch flags")
def _(cond):
    before = torch.is_grad_enabled()
    torch.set_grad_enabled(cond == "x")
    return Case(grad_mode_dependent, (_x(),), teardown=lambda: torch.set_grad_enabled(before))


# -- hooks -----------------------------------------------------------------------------------------------


class Hooked(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(seed)

    def forward(self, x):
        return self.lin(x) * 2.0


class HookedForward(Hooked):
    pass


class HookedPre(Hooked):
    pass


class HookedBackward(Hooked):
    pass


class HookedGlobal(Hooked):
    pass


class HookedOnProducer(Hooked):
    pass


def triple_output(module, inputs, output):
    return output * 3.0


def triple_input(module, inputs):
    return (inputs[0] * 3.0,)


def triple_grad(module, grad_input, grad_output):
    return tuple(g * 3.0 if g is not None else None for g in grad_input)


def _input() -> torch.Tensor:
    return _x().requires_grad_(True)


@case("forward_hook_on_submodule", "hooks")
def _(cond):
    model = HookedForward(2)
    if cond == "y":
        model.lin.register_forward_hook(triple_output)
    return Case(model, (_input(),), backward=True)


@case("forward_pre_hook_on_submodule", "hooks")
def _(cond):
    model = HookedPre(3)
    if cond == "y":
        model.lin.register_forward_pre_hook(triple_input)
    return Case(model, (_input(),), backward=True)


@case("backward_hook_on_submodule", "hooks")
def _(cond):
    model = HookedBackward(4)
    if cond == "y":
        model.lin.register_full_backward_hook(triple_grad)
    return Case(model, (_input(),), backward=True)


def _only_on(module_type):
    def hook(module, inputs, output):
        return output * 3.0 if isinstance(module, module_type) else output

    return hook


@case("global_module_hook", "hooks")
def _(cond):
    model = HookedGlobal(5)
    handle = nn.modules.module.register_module_forward_hook(_only_on(nn.Linear)) if cond == "y" else None
    return Case(model, (_input(),), backward=True, teardown=handle.remove if handle else None)


@case("hook_on_producer_only", "hooks")
def _(cond):
    model = HookedOnProducer(6)
    if cond == "x":
        model.lin.register_forward_hook(triple_output)
    return Case(model, (_input(),), backward=True)


# -- controls that plain guards already cover (must stay right) ---------------------------------------

SCALE = 2.0


def reads_own_global(x):
    return x * SCALE


@case("own_module_global", "globals")
def _(cond):
    global SCALE
    SCALE = 2.0 if cond == "x" else 3.0

    def restore():
        global SCALE
        SCALE = 2.0

    return Case(reads_own_global, (_x(),), teardown=restore)


def shape_dependent(x):
    return x.sum(0) * x.shape[0]


@case("input_shape", "globals")
def _(cond):
    return Case(shape_dependent, (torch.ones(2 if cond == "x" else 3, 4),))


# -- more that a frame can read: closures, partials, arguments, module state ------------------------


def make_scaler(s):
    def scaler(x):
        return x * s + 0.25

    return scaler


@case("closure_value", "closures and partials")
def _(cond):
    return Case(make_scaler(2.0 if cond == "x" else 3.0), (_x(),))


def scale_by(s, x):
    return x * s - 0.25


@case("partial_argument", "closures and partials")
def _(cond):
    import functools

    return Case(functools.partial(scale_by, 2.0 if cond == "x" else 3.0), (_x(),))


class Options:
    def __init__(self, gain):
        self.gain = gain


def reads_argument_attribute(x, options):
    return x * options.gain


@case("argument_attribute", "attributes")
def _(cond):
    return Case(reads_argument_attribute, (_x(), Options(2.0 if cond == "x" else 3.0)))


class ClassAttributeByType(nn.Module):
    K = 2.0

    def forward(self, x):
        return x * type(self).K


@case("class_attribute_through_type", "attributes")
def _(cond):
    ClassAttributeByType.K = 2.0 if cond == "x" else 3.0
    return Case(ClassAttributeByType(), (_x(),), teardown=lambda: setattr(ClassAttributeByType, "K", 2.0))


class ForwardDefault(nn.Module):
    def forward(self, x, scale=2.0):
        return x * scale


@case("forward_defaults", "defaults")
def _(cond):
    ForwardDefault.forward.__defaults__ = (2.0,) if cond == "x" else (3.0,)
    return Case(ForwardDefault(), (_x(),), teardown=lambda: setattr(ForwardDefault.forward, "__defaults__", (2.0,)))


def reads_helper_list(x):
    return x * helper.GAINS[0]


@case("other_module_list", "other modules")
def _(cond):
    helper.GAINS = [2.0 if cond == "x" else 3.0]
    return Case(reads_helper_list, (_x(),), teardown=lambda: setattr(helper, "GAINS", [2.0]))


def uses_gelu(x):
    return torch.nn.functional.gelu(x) * 2.0


def _patched_gelu(x, approximate="none"):
    return x * 0.5


@case("monkeypatched_torch_function", "globals")
def _(cond):
    original = torch.nn.functional.gelu
    if cond == "y":
        torch.nn.functional.gelu = _patched_gelu
    return Case(uses_gelu, (_x(),), teardown=lambda: setattr(torch.nn.functional, "gelu", original))


GLOBAL_WEIGHT = torch.full((4,), 2.0)


def adds_global_tensor(x):
    return x * GLOBAL_WEIGHT


@case("global_tensor_values", "globals")
def _(cond):
    global GLOBAL_WEIGHT
    GLOBAL_WEIGHT = torch.full((4,), 2.0 if cond == "x" else 3.0)
    return Case(adds_global_tensor, (_x(),))


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x))


@case("train_or_eval", "module state")
def _(cond):
    model = Normed()
    if cond == "x":  # frames of a BatchNorm in training mode update buffers: never packaged
        model.eval()
    return Case(model, (_x(),))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _lin(8)

    def forward(self, x):
        return self.lin(x).relu()


@case("frozen_parameter", "module state")
def _(cond):
    model = Frozen()
    if cond == "y":
        model.lin.weight.requires_grad_(False)
    return Case(model, (_input(),), backward=True)


def thread_dependent(x):
    return x * torch.get_num_threads()


@case("num_threads", "torch flags")
def _(cond):
    before = torch.get_num_threads()
    torch.set_num_threads(1 if cond == "x" else 2)
    return Case(thread_dependent, (_x(),), teardown=lambda: torch.set_num_threads(before))


def reads_numpy_scalar(x):
    return x * float(helper.NP_GAIN)


@case("other_module_numpy_scalar", "other modules")
def _(cond):
    import numpy

    helper.NP_GAIN = numpy.float64(2.0 if cond == "x" else 3.0)
    return Case(reads_numpy_scalar, (_x(),), teardown=lambda: setattr(helper, "NP_GAIN", numpy.float64(2.0)))


def follows_dict_order(x):
    for name, value in helper.ORDERED.items():
        x = x * value if name == "double" else x + value
    return x


@case("other_module_dict_order", "other modules")
def _(cond):
    helper.ORDERED = {"double": 2.0, "shift": 1.0} if cond == "x" else {"shift": 1.0, "double": 2.0}
    return Case(follows_dict_order, (_x(),), teardown=lambda: setattr(helper, "ORDERED", {"double": 2.0, "shift": 1.0}))


def reads_frozen_dataclass(x):
    return x * helper.FROZEN.gain


@case("other_module_frozen_dataclass", "other modules")
def _(cond):
    helper.FROZEN = helper.Frozen(2.0 if cond == "x" else 3.0)
    return Case(reads_frozen_dataclass, (_x(),), teardown=lambda: setattr(helper, "FROZEN", helper.Frozen()))


# -- classes by content: what a class holds may differ where its name does not -----------------------


def _doubles(self, x):
    return x * 2.0


def _triples(self, x):
    return x * 3.0


class Op:
    apply = _doubles  # chosen at import: another machine may choose the other


def calls_op(x, op):
    return op.apply(x) + 1.0


@case("class_method_chosen_at_import", "classes")
def _(cond):
    Op.apply = _doubles if cond == "x" else _triples
    return Case(calls_op, (_x(), Op()), teardown=lambda: setattr(Op, "apply", _doubles))


class GlobalOp:
    apply = _doubles


GLOBAL_OP = GlobalOp()


def calls_global_op(x):
    return GLOBAL_OP.apply(x) - 1.0


@case("global_instance_method_chosen_at_import", "classes")
def _(cond):
    GlobalOp.apply = _doubles if cond == "x" else _triples
    return Case(calls_global_op, (_x(),), teardown=lambda: setattr(GlobalOp, "apply", _doubles))


class ChosenForward(nn.Module):
    forward = _doubles


class HoldsChosen(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = ChosenForward()

    def forward(self, x):
        return self.sub(x) + 1.0


@case("submodule_forward_chosen_at_import", "classes")
def _(cond):
    ChosenForward.forward = _doubles if cond == "x" else _triples
    return Case(HoldsChosen(), (_x(),), teardown=lambda: setattr(ChosenForward, "forward", _doubles))


class BaseOffset:
    OFFSET = 1.0


class ChildOffset(BaseOffset):
    pass


def reads_inherited_offset(x):
    return x + ChildOffset.OFFSET


@case("inherited_attribute_overridden", "classes")
def _(cond):
    if cond != "x":
        ChildOffset.OFFSET = 5.0
    return Case(
        reads_inherited_offset,
        (_x(),),
        teardown=lambda: ChildOffset.__dict__.get("OFFSET") and delattr(ChildOffset, "OFFSET"),
    )


def folds_int_table_in_order(x):
    for key, value in helper.INT_TABLE_ORDER.items():
        x = x * value + key
    return x


@case("other_module_int_dict_order", "classes")
def _(cond):
    helper.INT_TABLE_ORDER = {1: 2.0, 2: 3.0} if cond == "x" else {2: 3.0, 1: 2.0}
    return Case(
        folds_int_table_in_order, (_x(),), teardown=lambda: setattr(helper, "INT_TABLE_ORDER", {1: 2.0, 2: 3.0})
    )


def folds_int_table_keys(x):
    for key, value in helper.INT_TABLE_KEYS.items():
        x = x * value + key
    return x


@case("other_module_int_dict_key", "classes")
def _(cond):
    helper.INT_TABLE_KEYS = {1: 2.0, 2: 3.0} if cond == "x" else {1: 2.0, 3: 3.0}
    return Case(folds_int_table_keys, (_x(),), teardown=lambda: setattr(helper, "INT_TABLE_KEYS", {1: 2.0, 2: 3.0}))


# -- containers, folds and settings: what a description could cut short ------------------------------


def folds_nested_table(x):
    for row in helper.NESTED:
        for cell in row:
            for value in cell:
                x = x * value + 1.0
    return x


@case("other_module_nested_list_depth_three", "containers and settings")
def _(cond):
    helper.NESTED = [[[2.0, 1.0]], [[3.0]]] if cond == "x" else [[[2.0, 1.0]], [[4.0]]]
    return Case(folds_nested_table, (_x(),), teardown=lambda: setattr(helper, "NESTED", [[[2.0, 1.0]], [[3.0]]]))


def folds_long_list(x):
    total = 0.0
    for value in helper.LONG:
        total = total + value
    return x * total


@case("other_module_list_of_forty", "containers and settings")
def _(cond):
    helper.LONG = [float(i % 5) for i in range(40)]
    if cond == "y":
        helper.LONG[35] = 9.0
    return Case(folds_long_list, (_x(),), teardown=lambda: setattr(helper, "LONG", [float(i % 5) for i in range(40)]))


def reads_nested_argument(x, table):
    return x * table[1][1][0] + table[0][0]


@case("nested_tuple_argument", "containers and settings")
def _(cond):
    table = ((1.0,), (2.0, (3.0 if cond == "x" else 5.0,)))
    return Case(reads_nested_argument, (_x(), table))


def reads_dict_tuple_value(x):
    gain, shift = helper.VALUED["gain"]
    return x * gain + shift


@case("other_module_dict_of_tuples", "containers and settings")
def _(cond):
    helper.VALUED = {"gain": (2.0, 1.0) if cond == "x" else (2.0, 3.0)}
    return Case(reads_dict_tuple_value, (_x(),), teardown=lambda: setattr(helper, "VALUED", {"gain": (2.0, 1.0)}))


def folds_math_of_global(x):
    import math

    return x * math.cos(helper.ANGLE) + math.floor(helper.ANGLE * 10)


@case("math_of_other_module_constant", "containers and settings")
def _(cond):
    helper.ANGLE = 0.5 if cond == "x" else 0.9
    return Case(folds_math_of_global, (_x(),), teardown=lambda: setattr(helper, "ANGLE", 0.5))


def plain_mul(x):
    return torch.sigmoid(x) * 3.0 - 0.5


@case("inductor_private_setting", "containers and settings")
def _(cond):
    import torch._inductor.config as inductor_config

    was = inductor_config._realize_opcount_threshold_default
    inductor_config._realize_opcount_threshold_default = was if cond == "x" else was + 1
    return Case(
        plain_mul,
        (_x(),),
        must_trace=cond == "y",
        teardown=lambda: setattr(inductor_config, "_realize_opcount_threshold_default", was),
    )


def plain_sub(x):
    return torch.tanh(x) - 0.25


@case("inductor_custom_pass", "containers and settings")
def _(cond):
    import torch._inductor.config as inductor_config

    inductor_config.post_grad_custom_post_pass = None if cond == "x" else helper.NoOpPass()
    return Case(
        plain_sub,
        (_x(),),
        must_trace=cond == "y",
        teardown=lambda: setattr(inductor_config, "post_grad_custom_post_pass", None),
    )


def folds_many_keys_in_order(x):
    for value in helper.MANY_KEYS.values():
        x = x * value + 0.5
    return x


def _many_keys(reverse: bool) -> dict:
    keys = [f"k{i}" for i in range(40)]
    return {key: 1.0 + (int(key[1:]) % 3) / 4 for key in (reversed(keys) if reverse else keys)}


@case("other_module_forty_keys_in_another_order", "containers and settings")
def _(cond):
    helper.MANY_KEYS = _many_keys(reverse=cond != "x")
    return Case(folds_many_keys_in_order, (_x(),), teardown=lambda: setattr(helper, "MANY_KEYS", _many_keys(False)))


# -- torch function modes: a mode on torch's stack whose class holds another body ----------------------


def _mode_doubles(self, func, types, args=(), kwargs=None):
    out = func(*args, **(kwargs or {}))
    return out * 2.0 if func is torch.Tensor.add else out


def _mode_triples(self, func, types, args=(), kwargs=None):
    out = func(*args, **(kwargs or {}))
    return out * 3.0 if func is torch.Tensor.add else out


class ScalingMode(torch.overrides.TorchFunctionMode):
    __torch_function__ = _mode_doubles  # chosen at import: another machine may choose the other


def adds_under_a_mode(x):
    return x.add(1.0) - 0.5


def _entered_mode(cond):
    ScalingMode.__torch_function__ = _mode_doubles if cond == "x" else _mode_triples
    mode = ScalingMode()
    mode.__enter__()

    def leave():
        mode.__exit__(None, None, None)
        ScalingMode.__torch_function__ = _mode_doubles

    return leave


@case("torch_function_mode_chosen_at_import", "classes")
def _(cond):
    return Case(adds_under_a_mode, (_x(),), teardown=_entered_mode(cond))
