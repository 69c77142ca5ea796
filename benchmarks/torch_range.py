"""The compile check on the torch this venv has: plain torch, then warmstart filling a shared cache on
one new machine and a second new machine using it, compiled frames off and on.

For each model (forward and backward, ``compile_job.py``), each job on a brand-new "machine" (empty
HOME, TMPDIR, Inductor, Triton and warmstart directories):

* ``plain``: warmstart off;
* ``fill``: warmstart on, an empty shared cache (its own namespace per frames setting);
* ``new machine``: warmstart on, a fresh local directory, the shared cache the fill left (read with
  the public key only).

It counts failed jobs, compares every loss with plain torch's, and reports compile plus first step
(the compiler's modules loaded before the clock, as in ``compile_cache.py``). Usage::

    python benchmarks/torch_range.py [--models conv,attention] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _new_machine import JOB, MACHINE, machine_env  # noqa: E402


def run(machine: Path, model: str, extra: dict[str, str]) -> dict:
    """One job; ``{"failed": stderr tail}`` where it exits non-zero."""
    env = machine_env(machine, extra)
    proc = subprocess.run(
        [sys.executable, str(JOB), "--model", model], env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        return {"failed": proc.stderr[-2000:]}
    result = json.loads(next(t for t in proc.stdout.splitlines() if t.startswith("RESULT "))[len("RESULT ") :])
    result["warnings"] = [line for line in proc.stderr.splitlines() if line.startswith("warmstart:")]
    return result


def bench_model(model: str, work: Path, url: str, signing: Path, verify: Path) -> dict:
    results = {"plain": run(work / f"{model}-plain", model, {"WARMSTART": "0"})}
    for frames in ("0", "1"):
        ws = {"WARMSTART": "1", "WARMSTART_CACHE_URL": url, "WARMSTART_DYNAMO": frames}
        ws["WARMSTART_NAMESPACE"] = f"frames-{frames}"  # a fill that starts cold in each setting
        results[f"fill frames={frames}"] = run(
            work / f"{model}-fill{frames}", model, {**ws, "WARMSTART_KEY_FILE": str(signing)}
        )
        results[f"new machine frames={frames}"] = run(
            work / f"{model}-new{frames}", model, {**ws, "WARMSTART_KEY_FILE": str(verify)}
        )
    return results


def main() -> None:
    import torch
    from _redis import RedisNode

    from warmstart.compile_cache.signing import generate_key_pair

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="conv,attention")
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    started = time.perf_counter()
    figures: dict = {"torch": torch.__version__, "machine": MACHINE, "models": {}}
    with tempfile.TemporaryDirectory(prefix="ws-range-") as tmp:
        work = Path(tmp)
        generate_key_pair(work / "signing.key", work / "verify.pub")
        server = RedisNode(work / "redis").start()
        try:
            for model in args.models.split(","):
                print(f"{model} ...", file=sys.stderr, flush=True)
                figures["models"][model] = bench_model(
                    model, work, server.url, work / "signing.key", work / "verify.pub"
                )
        finally:
            server.stop()
    figures["wall_s"] = time.perf_counter() - started
    print(report(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def report(figures: dict) -> str:
    """A Markdown table: seconds to compile and run the first step, losses against plain torch's."""
    configs = ("plain", "fill frames=0", "new machine frames=0", "fill frames=1", "new machine frames=1")
    lines = [
        f"torch {figures['torch']}, {figures['machine']}",
        "",
        "| model | " + " | ".join(configs) + " | new / plain (frames off, on) | failed jobs | same losses as plain |",
        "|---|" + "---:|" * len(configs) + "---:|---:|---|",
    ]
    for model, results in figures["models"].items():
        failed = [name for name in configs if "failed" in results[name]]
        cells = ["failed" if name in failed else f"{results[name]['compile_s']:.2f}" for name in configs]
        plain = results["plain"]
        same = not failed and all(results[name]["losses"] == plain["losses"] for name in configs)
        ratios = (
            "-"
            if failed
            else ", ".join(f"{results[f'new machine frames={f}']['compile_s'] / plain['compile_s']:.3f}x" for f in "01")
        )
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {ratios} | {len(failed)} | {'yes' if same else 'no'} |")
    warnings = sorted({w for r in figures["models"].values() for res in r.values() for w in res.get("warnings", [])})
    lines += ["", f"warmstart warnings: {warnings or 'none'}; wall time {figures['wall_s']:.0f} s"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
