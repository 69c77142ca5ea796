"""What the preloader's compiler modules save a forked rank: a warm compile of the reference job's
dense part (its regions, forward and backward, every graph and kernel from the local caches) in a
process that has imported what a preloader imports, with and without the modules torch loads lazily
on its first ``torch.compile`` call (``warmstart.preload.server.COMPILER_MODULES``).

One cold compile fills a fresh Inductor cache first; then the rounds alternate (without, with), each
a new process, and the table gives each round's times and the median of the rounds' ratios.

Usage::

    python benchmarks/preload_lazy_imports.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _new_machine import MACHINE, finish

_JOB = r"""
import contextlib, importlib, json, sys, time
from warmstart.preload.server import COMPILER_MODULES, DEFAULT_MODULES
for name in DEFAULT_MODULES + ("warmstart.bench.trainer",):
    importlib.import_module(name)
if sys.argv[1] == "with":
    for name in COMPILER_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
before = len(sys.modules)
import torch
from warmstart.bench import trainer
from warmstart.bench.config import JobConfig
from warmstart.bench.model import NUM_DENSE, DenseOverArch
cfg = JobConfig()
start = time.perf_counter()
module = DenseOverArch(cfg.tables, cfg.dim, list(cfg.dense_layers), list(cfg.over_layers))
compiled = trainer._compile_regions(module)
out = compiled(
    torch.zeros(cfg.batch_size, NUM_DENSE),
    torch.zeros(cfg.batch_size, cfg.tables * cfg.dim, requires_grad=True),
    torch.zeros(cfg.batch_size),
)
(out[0] if isinstance(out, tuple) else out).float().sum().backward()
print("RESULT " + json.dumps({"compile_s": time.perf_counter() - start, "modules": len(sys.modules) - before}))
"""


def _compile(inductor_dir: Path, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    proc = subprocess.run(
        [sys.executable, "-c", _JOB, variant], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the compile ({variant}) failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    inductor_dir = Path(tempfile.mkdtemp(prefix="ws-bench-lazy-")) / "inductor"
    out: dict = {"machine": MACHINE, "rounds": []}
    with console.status("a cold compile fills the Inductor cache") as status:
        out["cold"] = _compile(inductor_dir, "without")
        for i in range(args.rounds):
            status.update(f"round {i + 1} of {args.rounds}")
            without, with_ = _compile(inductor_dir, "without"), _compile(inductor_dir, "with")
            out["rounds"].append(
                {"without": without, "with": with_, "ratio": with_["compile_s"] / without["compile_s"]}
            )

    table = Table(
        title="warm compile of the reference dense part in a preloaded process, seconds", title_justify="left"
    )
    for column in ("round", "without compiler modules", "with", "with / without", "modules loaded: without / with"):
        table.add_column(column, justify="right")
    for i, r in enumerate(out["rounds"], 1):
        table.add_row(
            str(i),
            f"{r['without']['compile_s']:.3f}",
            f"{r['with']['compile_s']:.3f}",
            f"{r['ratio']:.3f}x",
            f"{r['without']['modules']} / {r['with']['modules']}",
        )
    out["median_ratio"] = statistics.median(r["ratio"] for r in out["rounds"])
    out["median_saved_s"] = statistics.median(r["without"]["compile_s"] - r["with"]["compile_s"] for r in out["rounds"])
    table.add_row("median", "", "", f"{out['median_ratio']:.3f}x", f"saves {out['median_saved_s']:.3f} s", style="bold")
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
