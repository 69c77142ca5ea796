"""The recompile probe of background compiles, in this process with Dynamo's ``eager`` backend (no
Inductor, no worker): a recompile at the start of a call is stopped before any of the call runs, and
one further into a call (after a graph break) is left to torch, so no part of a call ever runs twice."""

from __future__ import annotations

import torch
import torch._dynamo.convert_frame

from warmstart import compile_cache
from warmstart.compile_cache import torch_hooks
from warmstart.compile_cache.background import Background, recompile_probe

CALLS = torch.zeros(())  # counted in place: Dynamo guards on its shape, not on its value
SCALE = 1.0
WIDTH = 4


def halves(x):
    CALLS.add_(1)  # once per call, in the first half's frame
    h = x * 2
    torch._dynamo.graph_break()
    return h * SCALE  # the second half's frame guards on SCALE; the first's does not


def _compiled_state(monkeypatch) -> Background:
    # warmstart off in this process: a stopped recompile compiles inline (no store, no worker)
    monkeypatch.setenv("WARMSTART", "0")
    compile_cache.reset_store()
    convert_frame = torch._dynamo.convert_frame
    monkeypatch.setitem(
        vars(convert_frame),
        "get_and_maybe_log_recompilation_reasons",
        convert_frame.get_and_maybe_log_recompilation_reasons,
    )
    torch_hooks._hook_recompiles(convert_frame)  # what warmstart installs at start-up
    torch._dynamo.reset()
    CALLS.zero_()
    state = Background("halves", halves, {}, eager=halves, compiled=torch.compile(halves, backend="eager"))
    state.phase = "compiled"  # as after the switch
    return state


def test_a_recompile_at_the_start_of_a_call_is_stopped_before_the_call_runs(monkeypatch):
    state = _compiled_state(monkeypatch)
    assert torch.equal(state(torch.ones(4)), torch.full((4,), 2.0))
    # A new shape: the first frame would recompile. The probe stops it; with no store in this
    # process the call then compiles inline, and the function ran once for each call.
    out = state(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert CALLS.item() == 2
    assert state.last_call == "compiled" and state.phase == "compiled" and state.recompiles == 0
    assert state._code is None  # it was stopped: the cache off, recompiles are torch's from now on
    compile_cache.reset_store()


def test_a_recompile_further_into_a_call_is_left_to_torch(monkeypatch):
    global SCALE
    state = _compiled_state(monkeypatch)
    state(torch.ones(4))
    SCALE = 3.0
    try:
        # The first frame's guards hold; the second's fail after the first half ran: not stopped.
        out = state(torch.ones(4))
    finally:
        SCALE = 1.0
    assert torch.equal(out, torch.full((4,), 6.0))
    assert CALLS.item() == 2
    assert state.last_call == "compiled" and state._code is not None  # still following recompiles
    compile_cache.reset_store()


def nested(x, n):
    CALLS.add_(1)
    h = x * 2
    torch._dynamo.graph_break()
    if n:
        return nested(h[:WIDTH], n - 1)  # the same code again, inside the call
    return h


def test_a_recompile_of_the_same_code_inside_the_call_is_left_to_torch(monkeypatch):
    global WIDTH
    state = _compiled_state(monkeypatch)
    state = Background("nested", nested, {}, eager=nested, compiled=torch.compile(nested, backend="eager"))
    state.phase = "compiled"
    state(torch.ones(4), 1)
    WIDTH = 2
    try:
        out = state(torch.ones(4), 1)  # the inner call gets a new shape, after the outer one's first half ran
    finally:
        WIDTH = 4
    assert torch.equal(out, torch.full((2,), 4.0))
    assert CALLS.item() == 4 and state._code is not None


def test_the_probe_stops_only_the_code_it_was_set_for():
    assert recompile_probe(None) is None
    assert recompile_probe(halves.__code__) is None  # no call is probing on this thread
