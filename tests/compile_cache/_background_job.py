"""A training loop for the background-compile tests: SGD on a fixed batch, one JSON line at the end
with each step's loss and phase (eager, compiled, inline: see warmstart/compile_cache/background.py);
a ``step`` event per step in the run directory.

    python _background_job.py --model net|regional|breaking|function|main [--kill-worker] [--compiled-steps N]
        [--new-shape-after N | --new-shape-at STEP] [--eager-only] [--max-s S]

Runs until N steps ran after the phase left ``eager`` (or --max-s, a hang guard), then prints
``RESULT {...}``. With ``--new-shape-after N`` the batch takes another shape after N compiled steps
(a recompile), and the N steps are counted again on it; ``--new-shape-at STEP`` changes it at that
step (the eager reference of such a run).
"""

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _background_model import Breaking, Net, shifted  # noqa: E402

from warmstart.compile_cache.background import state_of  # noqa: E402
from warmstart.metrics import get_recorder  # noqa: E402


class MainNet(nn.Module):  # defined in __main__: a worker cannot import it
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 1)

    def forward(self, x):
        return self.a(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=("net", "regional", "breaking", "function", "main"))
    parser.add_argument("--kill-worker", action="store_true")
    parser.add_argument("--exit-after-first-step", action="store_true")
    parser.add_argument("--compiled-steps", type=int, default=3)
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--steps", type=int, default=0, help="with --eager-only: how many")
    parser.add_argument("--new-shape-after", type=int, default=0)
    parser.add_argument("--new-shape-at", type=int, default=-1)
    parser.add_argument("--max-s", type=float, default=240.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.manual_seed(0)
    batches = [torch.randn(8, 16), torch.randn(4, 16)]  # the second: another shape, a recompile
    if args.model == "function":
        w = torch.randn(16, 4, requires_grad=True)
        params, fn = [w], shifted
        call = fn if args.eager_only else torch.compile(fn)
        step_fn = lambda x: call(x, w)  # noqa: E731
        handle = call
    elif args.model == "regional":  # nn.Module.compile() of one submodule, as regional compilation does
        net = Net()
        params = list(net.parameters())
        if not args.eager_only:
            net.a.compile()
        handle = net.a
        step_fn = lambda x: net(x)  # noqa: E731
    else:
        net = {"net": Net, "breaking": Breaking, "main": MainNet}[args.model]()
        params = list(net.parameters())
        handle = net if args.eager_only else torch.compile(net)
        step_fn = lambda x: handle(x)  # noqa: E731
    opt = torch.optim.SGD(params, lr=0.05)
    losses, phases = [], []
    state = None if args.eager_only else state_of(handle)
    start, after = time.monotonic(), 0
    rec = get_recorder()
    new_at = args.new_shape_at if args.new_shape_at >= 0 else None
    while time.monotonic() - start < args.max_s:
        rec.step(len(losses))
        x = batches[new_at is not None and len(losses) >= new_at]
        loss = step_fn(x).pow(2).mean()
        phases.append(state.last_call if state is not None else "eager")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if args.kill_worker and state is not None and state.worker_pid and len(losses) == 1:
            os.kill(state.worker_pid, signal.SIGKILL)
        if args.exit_after_first_step:  # the job dies while its worker compiles
            print(f"WORKER {getattr(state, 'worker_pid', None)}", flush=True)
            os._exit(0)
        if args.eager_only:
            if len(losses) >= args.steps:
                break
            continue
        after += phases[-1] != "eager"
        if args.new_shape_after and new_at is None and after >= args.new_shape_after:
            new_at, after = len(losses), 0
            continue
        if after >= args.compiled_steps:
            break
        time.sleep(0.02)
    fx, aot = torch._dynamo.utils.counters["inductor"], torch._dynamo.utils.counters["aot_autograd"]
    result = {
        "losses": losses,
        "phases": phases,
        "worker_pid": getattr(state, "worker_pid", None),
        "new_shape_at": new_at,
        "recompiles": getattr(state, "recompiles", 0),
        "fx_graph_hits": fx["fxgraph_cache_hit"],
        "fx_graph_misses": fx["fxgraph_cache_miss"],
        "autograd_hits": aot["autograd_cache_hit"],
        "autograd_misses": aot["autograd_cache_miss"],
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
