"""The compile warm-up's random draws never reach the job's: a warm-up that draws everywhere it can
(default initialization, ``torch.randn`` inputs, a dropout in the compiled forward, eager code between
two compiled graphs) runs in a thread beside a stage that seeds and draws under the guard, as the
start-up graph's stages do. With the guard, the stage's draws and the generator's state afterwards are
a run's without any warm-up; without it, the warm-up's draws shift them. (Dynamo's putting back of the
generators at the end of each compile would rewind the stage's draws, too.) And the guard is free while
torch compiles: a stage takes it in the middle of the warm-up's forward compile and of its backward
compile. Real compiles, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import _machine

WARMUP_BESIDE_A_STAGE = """
    import contextlib, json, threading, time, torch
    from torch import nn
    from warmstart.init_pipeline import CompileWarmup, GeneratorGuard

    torch.set_num_threads(1)

    @torch._dynamo.disable
    def noise(x):  # eager, between the two graphs of the compiled forward
        return x + torch.rand_like(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1)

        def forward(self, x):
            return self.b(noise(self.drop(self.a(x))))

    warmup = CompileWarmup(build=lambda device: Net(), example_inputs=lambda device: (torch.randn(4, 8),))

    def job(guard):
        seconds = []
        torch.manual_seed(0)  # before the warm-up starts: each of its draws would shift what follows
        thread = threading.Thread(target=lambda: seconds.append(warmup.run(torch.device("cpu"), generators=guard)))
        thread.start()
        draws = []
        # the stage: drawing in pieces while the warm-up builds and compiles
        with guard.exclusive() if guard is not None else contextlib.nullcontext():
            for _ in range(40):
                draws.append(torch.rand(1).item())
                time.sleep(0.002)
        thread.join()
        assert seconds, "the warm-up failed"
        return draws, torch.rand(4).tolist()  # what training would draw next

    torch.manual_seed(0)
    reference = ([torch.rand(1).item() for _ in range(40)], torch.rand(4).tolist())
    guarded = job(GeneratorGuard("cpu"))
    unguarded = job(None)

    # Compiles that cannot finish until a stage holds the guard: they finish only if the guard is
    # free while Dynamo compiles the forward and while AOTAutograd compiles the backward at its first
    # run (else the stage waits for the compile, which gives up after 60 s).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    waited = {}

    def waiting(name):
        compiling, stage_holds = threading.Event(), threading.Event()

        def compiler(gm, example_inputs):
            compiling.set()
            waited[name] = stage_holds.wait(60)
            return make_boxed_func(gm.forward)

        def stage():
            assert compiling.wait(120), f"the {name} compile never started"
            with guard.exclusive():
                stage_holds.set()

        return compiler, stage

    forward_compiler, forward_stage = waiting("forward")
    backward_compiler, backward_stage = waiting("backward")
    slow = CompileWarmup(
        build=lambda device: Net(), example_inputs=lambda device: (torch.randn(4, 8),),
        compile_kwargs={"backend": aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)},
    )
    guard = GeneratorGuard("cpu")
    torch._dynamo.reset()
    thread = threading.Thread(target=slow.run, args=(torch.device("cpu"),), kwargs={"generators": guard})
    thread.start()
    forward_stage()
    backward_stage()
    thread.join()
    print("RESULT " + json.dumps({
        "guarded_same": guarded == reference,
        "unguarded_next_same": unguarded[1] == reference[1],
        "stage_held_the_guard_during_the_compiles": waited,
    }))
"""


def test_the_warmups_draws_never_reach_the_stages_and_its_compiles_run_beside_them(tmp_path: Path) -> None:
    env = _machine.machine_env(tmp_path / "machine", WARMSTART_PRELOAD="0")
    script = textwrap.dedent(WARMUP_BESIDE_A_STAGE)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert result["guarded_same"], result
    # the control: the same warm-up without the guard moves the generator (its dropout draws at least)
    assert not result["unguarded_next_same"], result
    assert result["stage_held_the_guard_during_the_compiles"] == {"forward": True, "backward": True}, result
