"""One "job" for the compile-cache benchmark and tests: compile a model, run forward and backward,
print one JSON line with the loss, the time to compile and run the first step, and cache counters.

    python benchmarks/compile_job.py --model mlp [--regional] [--kill-redis-pid PID] [--no-preimport]
        [--until-compiled]

Run it with WARMSTART=1 (and WARMSTART_CACHE_URL, WARMSTART_SECRET) to use warmstart; the
environment decides everything else, as it would for a user's job.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import signal
import sys
import threading
import time

T_START = time.perf_counter()

import torch  # noqa: E402 (after T_START: the import is timed)
from torch import nn  # noqa: E402

T_IMPORTED = time.perf_counter()

# torch.compile loads Dynamo, AOTAutograd and Inductor on its first call: about 4 s on 2 cores, the
# same in every configuration and beyond any cache's reach. Load them before the clock starts, as
# ``import torch`` is, so the timed part is what caching can change; reported as compiler_import_s.
# ``--no-preimport`` leaves them to the first call (checked before argparse runs: it decides what
# this module imports).
PREIMPORT = "--no-preimport" not in sys.argv[1:]
if PREIMPORT:
    import torch._dynamo
    import torch._functorch._aot_autograd.autograd_cache
    import torch._inductor.codecache
    import torch._inductor.compile_fx

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
        self.conv = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
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
            Stage(
                dim,
                dim * (4 if edit == "wider" and i == 2 else 2),
                dims[i + 1] if i + 1 < len(dims) else 1,
                nn.SiLU if edit == "act" and i == 2 else nn.ReLU,
            )
            for i, dim in enumerate(dims)
        )

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


class EncoderLayer(nn.Module):
    """A pre-norm residual MLP block, a module with its own forward (Dynamo inlines each one)."""

    def __init__(self, dim: int = 32, hidden: int = 64, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.act = act()
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class Encoder(nn.Module):
    """Many small layers: 12 encoder layers of width 32 and a linear head. Little arithmetic, but
    12 module calls for Dynamo to inline and many small kernels: the costs that grow with depth."""

    def __init__(self, layers: int = 12, dim: int = 32, edit: str | None = None) -> None:
        super().__init__()
        # The edits (see ``Tower``) touch the middle layer, or add one at the end.
        layers += edit == "deeper"
        self.layers = nn.ModuleList(
            EncoderLayer(
                dim, 128 if edit == "wider" and i == 6 else 64, nn.SiLU if edit == "act" and i == 6 else nn.GELU
            )
            for i in range(layers)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class CrossNetwork(nn.Module):
    """A DCN-v2-style ranking model's dense part, from TorchRec's own modules: a low-rank cross
    network (``torchrec.modules.crossnet.LowRankCrossNet``) beside a deep ``torchrec`` MLP over 8
    embedded features of width 16, and a linear head over both. Edits: ``act`` (the MLP's ReLU ->
    SiLU), ``deeper`` (one more cross layer), ``wider`` (the MLP's first layer twice as wide)."""

    def __init__(self, edit: str | None = None) -> None:
        super().__init__()
        from torchrec.modules.crossnet import LowRankCrossNet
        from torchrec.modules.mlp import MLP as TorchRecMLP

        width = 8 * 16
        self.cross = LowRankCrossNet(in_features=width, num_layers=3 + (edit == "deeper"), low_rank=16)
        self.deep = TorchRecMLP(
            width, [256 if edit == "wider" else 128, 64], activation=torch.nn.SiLU if edit == "act" else torch.relu
        )
        self.head = nn.Linear(width + 64, 1)

    def forward(self, x):
        return self.head(torch.cat([self.cross(x), self.deep(x)], dim=1))


class DeepFMNet(nn.Module):
    """The dense part of TorchRec's DeepFM (``torchrec.models.deepfm``): ``torchrec.modules.deepfm``'s
    ``DeepFM`` (a deep MLP over the concatenated embeddings) and ``FactorizationMachine`` over the same
    8 embedded features of width 16 (in two groups, as a model with two embedding collections has
    them), and a linear over-arch. Edits: ``act`` (ReLU -> SiLU), ``deeper`` (one more deep layer),
    ``wider`` (the first deep layer twice as wide)."""

    def __init__(self, edit: str | None = None) -> None:
        super().__init__()
        from torchrec.modules.deepfm import DeepFM, FactorizationMachine
        from torchrec.modules.mlp import MLP as TorchRecMLP

        sizes = [256 if edit == "wider" else 128, 64] + ([32] if edit == "deeper" else [])
        activation = torch.nn.SiLU if edit == "act" else torch.relu
        self.deep = DeepFM(dense_module=TorchRecMLP(8 * 16, sizes, activation=activation))
        self.fm = FactorizationMachine()
        self.over = nn.Linear(sizes[-1] + 1, 1)

    def forward(self, x):
        features = x.view(x.shape[0], 8, 16)
        embeddings = [features[:, :5], features[:, 5:]]
        return self.over(torch.cat([self.deep(embeddings), self.fm(embeddings)], dim=1))


EDITS = ("act", "deeper", "wider")


MODELS = {
    "mlp": (MLP, lambda: torch.randn(32, 64)),
    "conv": (ConvNet, lambda: torch.randn(8, 3, 16, 16)),
    "attention": (Attention, lambda: torch.randn(4, 16, 32)),
    "tiny": (Tiny, lambda: torch.randn(8, 16)),
    "tiny2": (Tiny2, lambda: torch.randn(8, 16)),
    "encoder": (Encoder, lambda: torch.randn(16, 32)),
    "tower": (Tower, lambda: torch.randn(64, 64)),
    "tower-act": (lambda: Tower("act"), lambda: torch.randn(64, 64)),
    "tower-deeper": (lambda: Tower("deeper"), lambda: torch.randn(64, 64)),
    "tower-wider": (lambda: Tower("wider"), lambda: torch.randn(64, 64)),
    "dcn": (CrossNetwork, lambda: torch.randn(64, 128)),
    "deepfm": (DeepFMNet, lambda: torch.randn(64, 128)),
}
# The edited versions of the models the edit benchmark changes (the tower's are above).
for _family, (_cls, _make_input) in {
    "encoder": (Encoder, MODELS["encoder"][1]),
    "dcn": (CrossNetwork, MODELS["dcn"][1]),
    "deepfm": (DeepFMNet, MODELS["deepfm"][1]),
}.items():
    for _edit in EDITS:
        MODELS[f"{_family}-{_edit}"] = (functools.partial(_cls, edit=_edit), _make_input)


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


def run_until_compiled(name: str, max_s: float = 1800.0) -> dict:
    """Train ``name`` (SGD on one batch) until a step has run compiled: with ``WARMSTART_COMPILE=
    background`` the first steps run eagerly while a worker compiles. Seconds from the start to the
    end of the first step and of the first compiled step, and the steps run before it."""
    import importlib

    from warmstart.compile_cache.background import state_of

    # The models as module ``compile_job``'s, not ``__main__``'s: a compile worker imports them.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    models = importlib.import_module("compile_job").MODELS
    torch.manual_seed(0)
    cls, make_input = models[name]
    module = cls()
    x = make_input()
    compiled = torch.compile(module)
    state = state_of(compiled)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    start, first_step_s, steps = time.perf_counter(), None, 0
    while time.perf_counter() - start < max_s:
        phase = state.phase if state is not None else "inline"
        loss = compiled(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if first_step_s is None:
            first_step_s = time.perf_counter() - start
        if phase != "eager":
            break
    return {
        "first_step_s": first_step_s,
        "first_compiled_step_s": time.perf_counter() - start,
        "steps_before_compiled": steps - 1,
        "phase": state.phase if state is not None else "inline",
    }


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children (g++, and compile workers that exited)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _warmstart_threads_cpu_s() -> float:
    """CPU seconds of warmstart's background threads so far (they are named ``ws-...`` where the
    operating system shows threads; Linux only, else 0)."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("ws-"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


class ImportClock:
    """Wall seconds the main thread spends in imports that load new modules, outermost imports only
    (an import inside an import is counted once). Installed only under ``--no-preimport``, to show
    how much of compile_s is the compiler's module loading."""

    def __init__(self) -> None:
        import builtins
        import importlib

        self.seconds = 0.0
        self._depth = 0
        self._main = threading.main_thread()
        self._import, self._import_module = builtins.__import__, importlib.import_module
        builtins.__import__ = self._timed(self._import)
        importlib.import_module = self._timed(self._import_module)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            if self._depth or threading.current_thread() is not self._main:
                return fn(*args, **kwargs)
            self._depth += 1
            before, t = len(sys.modules), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if len(sys.modules) != before:
                    self.seconds += time.perf_counter() - t

        return timed

    def stop(self) -> None:
        import builtins
        import importlib

        builtins.__import__, importlib.import_module = self._import, self._import_module


def torch_phases(compile_s: float, import_s: float | None) -> dict:
    """torch's own breakdown of compile_s, from the timers of ``dynamo_timed`` (seconds, summed
    over every frame and graph of the job).

    * ``dynamo_tracing``: Dynamo's frame compiles (bytecode analysis, FX graph capture) less the
      parts below that run inside them;
    * ``guards``: building the guards of each compiled frame;
    * ``backend``: AOTAutograd and Inductor for the forward graphs and the lazily compiled backward
      ones; on a warm start, their cache lookups and loads;
    * ``precompile_load``: frames loaded from a precompile package (guards and backends), if any;
    * ``first_run_and_rest``: what remains: running forward and backward, module set-up, Python;
    * ``compiler_import``: under ``--no-preimport`` only, loading the compiler's modules: not a phase
      of its own but part of the ones above (imports run inside tracing and the backend).
    """
    from torch._dynamo.utils import compilation_time_metrics

    timers = {key: sum(values) for key, values in compilation_time_metrics.items() if values}
    frames = timers.get("_compile.compile_inner", 0.0)  # "entire_frame_compile"
    guards = timers.get("build_guards", 0.0)
    backend = timers.get("OutputGraph.call_user_compiler", 0.0) + timers.get("backward._backward_impl", 0.0)
    precompile = sum(
        timers.get(k, 0.0) for k in ("precompile_load_guards", "precompile_build_guards", "after_deserialization")
    )
    # Precompile loads run inside an "entire_frame_compile" timer too, so they come off tracing.
    tracing = max(frames - guards - timers.get("OutputGraph.call_user_compiler", 0.0) - precompile, 0.0)
    phases = {"dynamo_tracing": tracing, "guards": guards, "backend": backend, "precompile_load": precompile}
    phases["first_run_and_rest"] = compile_s - sum(phases.values())
    if import_s is not None:
        phases["compiler_import"] = import_s
    phases["timers"] = timers
    return phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", action="append", required=True, choices=sorted(MODELS), help="model(s) to compile, in order"
    )
    parser.add_argument(
        "--regional", action="store_true", help="compile each region of the model on its own (the tower models)"
    )
    parser.add_argument(
        "--until-compiled",
        action="store_true",
        help="train each model until a step ran compiled (first_step_s, first_compiled_step_s): with "
        "WARMSTART_COMPILE=background the first steps run eagerly while a worker compiles",
    )
    parser.add_argument("--mega-save", default=None, help="after compiling, save torch's Mega-Cache here")
    parser.add_argument("--mega-load", default=None, help="before compiling, load torch's Mega-Cache from here")
    parser.add_argument(
        "--kill-redis-pid",
        type=int,
        default=None,
        help="SIGKILL this redis-server after the first model (a server dying mid-job)",
    )
    parser.add_argument(
        "--no-preimport",
        action="store_true",
        help="do not load torch's compiler modules before the clock: compile_s includes them",
    )
    args = parser.parse_args()
    losses: dict = {}
    until_compiled: dict = {}
    mega_load_s = 0.0
    if args.mega_load:
        t = time.perf_counter()
        with open(args.mega_load, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
        mega_load_s = time.perf_counter() - t
    import_clock = None if PREIMPORT else ImportClock()
    modules_before = len(sys.modules)
    t0, cpu0, ws_cpu0 = time.perf_counter(), _cpu_s(), _warmstart_threads_cpu_s()
    for i, name in enumerate(args.model):
        if args.until_compiled:
            until_compiled[name] = run_until_compiled(name)
        else:
            losses[name] = run_model(name, args.regional)
        if i == 0 and args.kill_redis_pid:
            os.kill(args.kill_redis_pid, signal.SIGKILL)
    compile_s, compile_cpu_s = time.perf_counter() - t0, _cpu_s() - cpu0
    warmstart_threads_cpu_s = _warmstart_threads_cpu_s() - ws_cpu0
    modules_after = len(sys.modules)
    if import_clock is not None:
        import_clock.stop()
    if args.mega_save:
        artifacts = torch.compiler.save_cache_artifacts()
        with open(args.mega_save, "wb") as f:
            f.write(artifacts[0] if artifacts else b"")
    from torch._dynamo.utils import counters

    result = {
        "losses": losses,
        "import_s": T_IMPORTED - T_START,
        "compiler_import_s": T_COMPILER_IMPORTED - T_IMPORTED,
        "compile_s": compile_s,
        "until_compiled": until_compiled,
        "compile_cpu_s": compile_cpu_s,
        "warmstart_threads_cpu_s": warmstart_threads_cpu_s,
        "mega_load_s": mega_load_s,
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
        "preimport": PREIMPORT,
        "phases": torch_phases(compile_s, None if import_clock is None else import_clock.seconds),
        "modules_loaded": {
            "before": modules_before,
            "after": modules_after,
            "during_compile": modules_after - modules_before,
        },
    }
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when run with runpy.run_path
    from _new_machine import store_figures

    result.update(store_figures())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
