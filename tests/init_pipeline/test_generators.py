"""The compile warm-up's random draws never reach the job's: a warm-up that draws everywhere it can
(default initialization, ``torch.randn`` inputs, a dropout in the compiled forward) runs in a thread
beside a stage that seeds and draws under the guard, as the start-up graph's stages do. With the guard,
the stage's draws and the generator's state afterwards are a run's without any warm-up; without it,
the warm-up's draws shift them. A real Inductor compile, in a subprocess."""

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
    warmup = CompileWarmup(
        build=lambda device: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1)),
        example_inputs=lambda device: (torch.randn(4, 8),),
    )

    def job(guard):
        seconds = []
        thread = threading.Thread(target=lambda: seconds.append(warmup.run(torch.device("cpu"), generators=guard)))
        thread.start()
        draws = []
        # the stage: seeded, drawing in pieces while the warm-up builds and compiles
        with guard.exclusive() if guard is not None else contextlib.nullcontext():
            torch.manual_seed(0)
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
    print("RESULT " + json.dumps({
        "guarded_same": guarded == reference,
        "unguarded_next_same": unguarded[1] == reference[1],
    }))
"""


def test_the_warmups_draws_never_reach_the_stages_that_hold_the_guard(tmp_path: Path) -> None:
    env = _machine.machine_env(tmp_path / "machine", WARMSTART_PRELOAD="0")
    script = textwrap.dedent(WARMUP_BESIDE_A_STAGE)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert result["guarded_same"], result
    # the control: the same warm-up without the guard moves the generator (its dropout draws at least)
    assert not result["unguarded_next_same"], result
