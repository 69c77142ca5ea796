"""One "job" for the compile-cache benchmark and tests: compile a model, run forward and backward,
print one JSON line with the loss, the time to compile and run the first step, and cache counters.

    python benchmarks/compile_job.py --model mlp [--regional] [--kill-redis-pid PID]

Run it with WARMSTART=1 (and WARMSTART_CACHE_URL, WARMSTART_SECRET) to use warmstart; the
environment decides everything else, as it would for a user's job.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import time

T_START = time.perf_counter()

import torch  # noqa: E402
from torch import nn  # noqa: E402

T_IMPORTED = time.perf_counter()

# torch.compile loads Dynamo, AOTAutograd and Inductor on its first call: about 4 s on 2 cores, the
# same in every configuration and beyond any cache's reach. Load them before the clock starts, as
# ``import torch`` is, so the timed part is what caching can change; reported as compiler_import_s.
import torch._dynamo  # noqa: E402
import torch._functorch._aot_autograd.autograd_cache  # noqa: E402
import torch._inductor.codecache  # noqa: E402
import torch._inductor.compile_fx  # noqa: E402

T_COMPILER_IMPORTED = time.perf_counter()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                                batch_first=True)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(self.block(x).mean(1))


class Tiny(nn.Module):
    """Smallest useful model: what the tests compile."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum(1, keepdim=True)


class Tiny2(Tiny):
    def forward(self, x):
        return torch.tanh(self.lin(x) * 2).mean(1, keepdim=True)


class Stage(nn.Module):
    """A residual MLP block and the projection to the next width: the unit of a dense tower."""

    def __init__(self, dim: int, hidden: int, out: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.act = act()
        self.down = nn.Linear(hidden, dim)
        self.proj = nn.Linear(dim, out)

    def forward(self, x):
        return self.proj(x + self.down(self.act(self.up(self.norm(x)))))


class Tower(nn.Module):
    """A dense tower of stages of different widths (as a ranking model's over-arch is); ``edit``
    makes the versions a researcher's next job would run:

    * ``act``: the activation of one stage changed (ReLU -> SiLU);
    * ``deeper``: one more stage;
    * ``wider``: one stage's hidden layer twice as wide.
    """

    DIMS = (96, 80, 64, 48, 32)

    def __init__(self, edit: str | None = None) -> None:
        super().__init__()
        dims = list(self.DIMS) + ([24] if edit == "deeper" else [])
        self.inp = nn.Linear(64, dims[0])  # runs eagerly under regional compilation: one small matmul
        self.stages = nn.ModuleList(
            Stage(dim, dim * (4 if edit == "wider" and i == 2 else 2), dims[i + 1] if i + 1 < len(dims) else 1,
                  nn.SiLU if edit == "act" and i == 2 else nn.ReLU)
            for i, dim in enumerate(dims))

    def forward(self, x):
        x = self.inp(x)
        for stage in self.stages:
            x = stage(x)
        return x

    def compile_regions(self, **kwargs) -> None:
        """Regional compilation: each stage is compiled on its own, so an edit recompiles only the
        stages it changed. Static shapes: each stage's shapes are its own, not a dynamic dimension."""
        for stage in self.stages:
            stage.compile(dynamic=False, **kwargs)


MODELS = {
    "mlp": (MLP, lambda: torch.randn(32, 64)),
    "conv": (ConvNet, lambda: torch.randn(8, 3, 16, 16)),
    "attention": (Attention, lambda: torch.randn(4, 16, 32)),
    "tiny": (Tiny, lambda: torch.randn(8, 16)),
    "tiny2": (Tiny2, lambda: torch.randn(8, 16)),
    "tower": (Tower, lambda: torch.randn(64, 64)),
    "tower-act": (lambda: Tower("act"), lambda: torch.randn(64, 64)),
    "tower-deeper": (lambda: Tower("deeper"), lambda: torch.randn(64, 64)),
    "tower-wider": (lambda: Tower("wider"), lambda: torch.randn(64, 64)),
}


def run_model(name: str, regional: bool = False) -> float:
    torch.manual_seed(0)
    cls, make_input = MODELS[name]
    model = cls()
    x = make_input()
    if regional:
        model.compile_regions()
    else:
        model = torch.compile(model)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    return float(loss.detach())


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children (g++, and compile workers that exited)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True, choices=sorted(MODELS),
                        help="model(s) to compile, in order")
    parser.add_argument("--regional", action="store_true",
                        help="compile each region of the model on its own (the tower models)")
    parser.add_argument("--mega-save", default=None, help="after compiling, save torch's Mega-Cache here")
    parser.add_argument("--mega-load", default=None, help="before compiling, load torch's Mega-Cache from here")
    parser.add_argument("--kill-redis-pid", type=int, default=None,
                        help="SIGKILL this redis-server after the first model (a server dying mid-job)")
    args = parser.parse_args()
    losses = {}
    mega_load_s = 0.0
    if args.mega_load:
        t = time.perf_counter()
        with open(args.mega_load, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
        mega_load_s = time.perf_counter() - t
    t0, cpu0 = time.perf_counter(), _cpu_s()
    for i, name in enumerate(args.model):
        losses[name] = run_model(name, args.regional)
        if i == 0 and args.kill_redis_pid:
            os.kill(args.kill_redis_pid, signal.SIGKILL)
    compile_s, compile_cpu_s = time.perf_counter() - t0, _cpu_s() - cpu0
    if args.mega_save:
        artifacts = torch.compiler.save_cache_artifacts()
        with open(args.mega_save, "wb") as f:
            f.write(artifacts[0] if artifacts else b"")
    from torch._dynamo.utils import counters

    result = {"losses": losses, "import_s": T_IMPORTED - T_START, "compiler_import_s": T_COMPILER_IMPORTED - T_IMPORTED,
              "compile_s": compile_s, "compile_cpu_s": compile_cpu_s, "mega_load_s": mega_load_s,
              "inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"])}
    from warmstart.config import job_identity

    if job_identity().enabled:  # not Settings: a bad cache setting must not fail the job, only turn the cache off
        from warmstart.compile_cache import get_store

        store = get_store()
        if store is not None:
            store.flush(timeout=30)
            result["store"] = store.stats.to_dict()
            result["counters"] = store.stats.counters_dict()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
