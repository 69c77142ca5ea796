"""The start-up graph's compile warm-up, on two new "machines" that share one warmstart cache: the
first compiles the forward and, by running it, the backward; the second loads both with each
AOTAutograd entry and skips the backward pass, which would only compute. The training step after
it runs compiled, with eager's gradients. Real Inductor compiles, in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import _machine

WARMUP_THEN_STEP = """
    import json, torch
    from torch import nn
    from torch._dynamo.utils import counters
    from warmstart.init_pipeline import CompileWarmup

    def build(device):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    built = []
    warmup = CompileWarmup(build=lambda d: built.append(build(d)) or built[-1],
                           example_inputs=lambda d: (torch.randn(4, 8),))
    warmup.run(torch.device("cpu"))
    warmup_backward = built[0][0].weight.grad is not None
    hits = counters["aot_autograd"]["autograd_cache_hit"]

    # the training step: another instance of the same class and shapes, compiled the same way
    model, reference = build(None), build(None)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.compile(model)(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    same = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), reference.parameters()))
    print("RESULT " + json.dumps({
        "warmup_backward": warmup_backward, "hits": hits, "same_grads": same,
        "recompiled": counters["aot_autograd"]["total"] - counters["aot_autograd"]["autograd_cache_hit"],
    }))
"""


def run_machine(machine: Path, store: Path) -> dict:
    """Run the warm-up and the step on a new "machine" whose local warmstart tier is ``store``."""
    env = _machine.machine_env(
        machine, WARMSTART_CACHE_DIR=str(store), WARMSTART_PRELOAD="0", TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0"
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WARMUP_THEN_STEP)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])


def test_a_warm_warmup_skips_the_backward_it_loaded_and_the_step_runs_compiled(tmp_path):
    store = tmp_path / "store"
    cold = run_machine(tmp_path / "a", store)
    assert cold == {"warmup_backward": True, "hits": 0, "same_grads": True, "recompiled": 1}, cold
    warm = run_machine(tmp_path / "b", store)
    # the step's compile is the warm-up's (same guards): no second AOTAutograd lookup or compile
    assert warm == {"warmup_backward": False, "hits": 1, "same_grads": True, "recompiled": 0}, warm


def test_zero_initialized_draws_nothing_from_the_global_generator_and_leaves_no_garbage():
    import torch
    from torch import nn

    from warmstart.init_pipeline import zero_initialized

    class WithIndices(nn.Module):
        def __init__(self, device: torch.device | None = None) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 4, device=device)  # default init draws from the generator
            self.register_buffer("index", torch.triu_indices(5, 5, offset=1, device=device)[0])

    for build in (WithIndices, lambda device: WithIndices()):  # a constructor that ignores the device
        torch.manual_seed(0)
        before = torch.get_rng_state()
        module = zero_initialized(build)(torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), before)
        assert all(t.device.type == "cpu" and not t.any() for t in (*module.parameters(), *module.buffers()))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    WithIndices(torch.device("cpu"))
    assert not torch.equal(torch.get_rng_state(), before)  # what the wrapper keeps from happening
