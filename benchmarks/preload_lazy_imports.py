"""What the preloader's extra work saves a forked rank: a warm compile of the reference job's dense
part (its regions, forward and backward, every graph and kernel from the caches) in a process that
has imported what a preloader imports, with and without part of what the preloader does besides.

Default: without and with the modules torch loads lazily on its first ``torch.compile`` call
(``warmstart.preload.server.COMPILER_MODULES``), plain torch (Inductor's own local caches).
``--warmstart``: with ``WARMSTART=1`` (a local tier the cold compile filled; Inductor's directory
new in every round, as on a new machine), with the compiler modules vs with them and also what the
preloader does next: the store's modules (``STORE_MODULES``) and Inductor's hash of torch's sources
(``torch_key()``).

One cold compile fills the caches first; then the rounds alternate, each a new process, and the
table gives each round's times and the median of the rounds' ratios.

Usage::

    python benchmarks/preload_lazy_imports.py [--rounds 5] [--warmstart] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
if sys.argv[1] in ("with", "all"):
    for name in COMPILER_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
if sys.argv[1] == "all":
    from warmstart.preload.server import STORE_MODULES
    for name in STORE_MODULES:
        importlib.import_module(name)
    from torch._inductor.codecache import torch_key
    torch_key()
before = len(sys.modules)
import torch
if len(sys.argv) > 2:
    import warmstart
    warmstart.enable()
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


def _compile(inductor_dir: Path, variant: str, warmstart_dir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    args = [variant]
    if warmstart_dir is not None:  # enabled in the job, after the preloader's part (not by the .pth hook)
        env.update(WARMSTART_CACHE_DIR=str(warmstart_dir), WARMSTART_PRELOAD="0", HOME=str(warmstart_dir.parent))
        args.append("warmstart")
    proc = subprocess.run(
        [sys.executable, "-c", _JOB, *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the compile ({variant}) failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--warmstart", action="store_true", help="WARMSTART=1 on new machines: the compiler modules vs all of it"
    )
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    base = Path(tempfile.mkdtemp(prefix="ws-bench-lazy-"))
    warmstart_dir = base / "warmstart" if args.warmstart else None
    before, after = ("with", "all") if args.warmstart else ("without", "with")

    def inductor(name: str) -> Path:
        return base / (f"inductor-{name}" if args.warmstart else "inductor")  # new machines, or one warm cache

    out: dict = {"machine": MACHINE, "warmstart": args.warmstart, "variants": [before, after], "rounds": []}
    try:
        with console.status("a cold compile fills the caches") as status:
            out["cold"] = _compile(inductor("cold"), before, warmstart_dir)
            for i in range(args.rounds):
                status.update(f"round {i + 1} of {args.rounds}")
                first = _compile(inductor(f"{i}-{before}"), before, warmstart_dir)
                second = _compile(inductor(f"{i}-{after}"), after, warmstart_dir)
                out["rounds"].append({before: first, after: second, "ratio": second["compile_s"] / first["compile_s"]})
    finally:
        shutil.rmtree(base, ignore_errors=True)

    names = {
        "without": "without compiler modules",
        "with": "with compiler modules",
        "all": "also store modules, torch_key()",
    }
    where = "WARMSTART=1, a new machine each round" if args.warmstart else "Inductor's local caches"
    table = Table(
        title=f"warm compile of the reference dense part in a preloaded process ({where}), seconds",
        title_justify="left",
    )
    for column in ("round", names[before], names[after], "ratio", "modules loaded"):
        table.add_column(column, justify="right")
    for i, r in enumerate(out["rounds"], 1):
        table.add_row(
            str(i),
            f"{r[before]['compile_s']:.3f}",
            f"{r[after]['compile_s']:.3f}",
            f"{r['ratio']:.3f}x",
            f"{r[before]['modules']} / {r[after]['modules']}",
        )
    out["median_ratio"] = statistics.median(r["ratio"] for r in out["rounds"])
    out["median_saved_s"] = statistics.median(r[before]["compile_s"] - r[after]["compile_s"] for r in out["rounds"])
    table.add_row("median", "", "", f"{out['median_ratio']:.3f}x", f"saves {out['median_saved_s']:.3f} s", style="bold")
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
