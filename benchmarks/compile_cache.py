"""Compile-cache benchmark: each configuration on a brand-new "machine", in one run.

For each model architecture (forward and backward), time to compile and run the first step (the
job loads torch's compiler modules before its clock starts, as it imports torch: that takes the
same seconds in every configuration; a second table adds them back):

* ``cold``: nothing cached;
* ``torch local-warm``: the same machine again (torch's own local caches are warm);
* ``torch redis``: a new machine with torch's own Redis remote cache, filled by the cold run;
* ``mega-cache``: a new machine that loads the Mega-Cache saved by the cold run
  (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``), load time included;
* ``warmstart``: a new machine whose remote tier was filled by another new machine.

A new machine has empty HOME, TMPDIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
WARMSTART_CACHE_DIR. Usage::

    python benchmarks/compile_cache.py [--models mlp,conv,attention] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "compile_job.py"
sys.path.insert(0, str(ROOT / "tests"))

CONFIGS = ("cold", "torch local-warm", "torch redis", "mega-cache", "warmstart")


def run(machine: Path, model: str, *, env_extra: dict[str, str], args: list[str] = ()) -> dict:
    machine.mkdir(parents=True, exist_ok=True)
    (machine / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    env.update(
        HOME=str(machine / "home"),
        TMPDIR=str(machine / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(machine / "inductor"),
        TRITON_CACHE_DIR=str(machine / "triton"),
        WARMSTART_CACHE_DIR=str(machine / "warmstart"),
        WARMSTART_RUN_DIR=str(machine / "runs"),
        **env_extra,
    )
    proc = subprocess.run(
        [sys.executable, str(JOB), "--model", model, *args], env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{model} on {machine.name} failed:\n{proc.stderr[-2000:]}")
    line = next(text for text in proc.stdout.splitlines() if text.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def bench_model(
    model: str, work: Path, torch_redis_port: int, ws_url: str, key_file: Path, progress, repeats: int
) -> dict:
    mega = work / f"{model}.mega"
    native = {
        "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_REDIS_HOST": "127.0.0.1",
        "TORCHINDUCTOR_REDIS_PORT": str(torch_redis_port),
    }
    ws = {"WARMSTART": "1", "WARMSTART_CACHE_URL": ws_url, "WARMSTART_KEY_FILE": str(key_file)}  # Ed25519
    results: dict = {}
    progress(f"{model}: cold")
    results["cold"] = [run(work / f"{model}-cold", model, env_extra=native, args=["--mega-save", str(mega)])]
    progress(f"{model}: warmstart producer (another new machine)")
    results["warmstart producer"] = [run(work / f"{model}-ws-producer", model, env_extra=ws)]
    # Warm configurations are cheap: repeat them, interleaved, and report medians (the machine is noisy).
    warm = {
        # Same machine and same settings as the cold run (torch's config is part of its keys).
        "torch local-warm": lambda r: run(work / f"{model}-cold", model, env_extra=native),
        "torch redis": lambda r: run(work / f"{model}-native{r}", model, env_extra=native),
        "mega-cache": lambda r: run(work / f"{model}-mega{r}", model, env_extra={}, args=["--mega-load", str(mega)]),
        "warmstart": lambda r: run(work / f"{model}-ws{r}", model, env_extra=ws),
    }
    for r in range(repeats):
        for name, step in warm.items():
            progress(f"{model}: {name} ({r + 1}/{repeats})")
            results.setdefault(name, []).append(step(r))
    return results


def _seconds(result: dict) -> float:
    return result["compile_s"] + result.get("mega_load_s", 0.0)


def _seconds_with_imports(result: dict) -> float:
    return _seconds(result) + result.get("compiler_import_s", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,conv,attention")
    parser.add_argument("--json", default=None, help="write all figures here")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each warm configuration (median reported)")
    args = parser.parse_args()
    from _new_machine import finish
    from _redis import RedisNode
    from rich.console import Console
    from rich.table import Table

    from warmstart.compile_cache.signing import generate_key_pair

    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="ws-bench-compile-"))
    key_file = work / "signing.key"
    generate_key_pair(key_file, work / "verify.pub")
    torch_redis = RedisNode(work / "torch-redis").start()
    ws_redis = RedisNode(work / "ws-redis").start()
    out: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "models": {},
    }
    try:
        with console.status("") as status:
            for model in args.models.split(","):
                out["models"][model] = bench_model(
                    model,
                    work,
                    torch_redis.port,
                    ws_redis.url,
                    key_file,
                    lambda msg: status.update(f"compiling {msg}"),
                    args.repeats,
                )
    finally:
        torch_redis.stop()
        ws_redis.stop()
        shutil.rmtree(work, ignore_errors=True)

    import statistics

    tables = []
    for title, seconds, field in (
        ("compile + first step (forward and backward)", _seconds, "summary"),
        (
            "the same, plus loading torch's compiler modules (equal in every configuration)",
            _seconds_with_imports,
            "summary_with_compiler_imports",
        ),
    ):
        table = Table(title=f"{title}, seconds; warm configurations: median of {args.repeats}", title_justify="left")
        table.add_column("model")
        for name in CONFIGS:
            table.add_column(name, justify="right")
        table.add_column("ws / local-warm", justify="right")
        table.add_column("ws / cold", justify="right")
        table.add_column("same loss", justify="center")
        for model, r in out["models"].items():
            t = {name: statistics.median(seconds(x) for x in r[name]) for name in CONFIGS}
            ratios = {
                "ws_over_local_warm": t["warmstart"] / t["torch local-warm"],
                "ws_over_cold": t["warmstart"] / t["cold"],
            }
            same = all(x["losses"] == r["cold"][0]["losses"] for x in r["warmstart"])
            r[field] = {"seconds": t, **ratios, "same_loss": same}
            table.add_row(
                model,
                *[f"{t[n]:.2f}" for n in CONFIGS],
                f"{ratios['ws_over_local_warm']:.2f}x",
                f"{ratios['ws_over_cold']:.3f}x",
                "yes" if same else "NO",
            )
        tables.append(table)
    finish(console, tables, out, args.json)


if __name__ == "__main__":
    main()
