"""warmstart on a GPU, end to end: each model compiled on brand-new "machines" sharing one cache
server, with the time each took and whether each got the same result as a cold compile.

    python benchmarks/gpu_check.py [--models inductor,user-triton,...] [--json FILE] [--device cuda|cpu]

For each model (fixed seeds; forward and backward where the model has a backward), four jobs, each a
separate process (``gpu_job.py``) on a new machine (empty HOME, TMPDIR, TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR, WARMSTART_CACHE_DIR):

* ``cold``: warmstart off, nothing cached;
* ``torch local-warm``: the cold machine again: torch's and Triton's own local caches are warm;
* ``warmstart producer``: a new machine with warmstart on, filling the shared cache (a real
  redis-server, entries signed with an Ed25519 key);
* ``warmstart new machine``: another new machine with warmstart on, the shared cache filled.

Models: ``inductor`` (an MLP and an attention block, default mode: FX graph and AOTAutograd entries
with their Triton kernels bundled), ``user-triton`` (a user ``@triton.jit`` kernel, run eagerly and
inside a compiled function: Triton's kernel cache goes through warmstart's TRITON_CACHE_MANAGER),
``max-autotune`` (mode ``max-autotune-no-cudagraphs`` on matmuls: autotune results),
``cudagraphs`` (mode ``reduce-overhead``), ``dynamo-frames`` (12 small encoder layers: Dynamo's
tracing is much of the compile; run with ``WARMSTART_DYNAMO=1``), and ``matmul`` (one matmul: the cheapest,
not run by default).

Same result: each warm job's outputs and gradients are compared with the cold job's: ``exact`` when
their bytes are identical (SHA-256), ``close`` when every summary figure (loss, and per tensor the
sum of absolute values and of squares, in float64) is within a relative tolerance of 1e-4 (absolute
1e-6): a job that autotunes again may pick other kernel configurations, which sum in another order.
Anything else is a mismatch. The exit status is 1 when a result differs or a job fails.

``--device cpu`` runs the same flow on the CPU for the models that run there. With ``--device cuda``
(the default) on a machine without CUDA it prints one line and exits 0.
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
JOB = ROOT / "benchmarks" / "gpu_job.py"

DEFAULT_MODELS = ("inductor", "user-triton", "max-autotune", "cudagraphs", "dynamo-frames")
ALL_MODELS = DEFAULT_MODELS + ("matmul",)
#: Models that need a GPU, and why (shown in the table when they are skipped on the CPU).
CUDA_ONLY = {
    "user-triton": "skipped on cpu: a user Triton kernel needs a GPU",
    "max-autotune": "skipped on cpu: autotuning picks among Triton (GPU) kernels",
    "cudagraphs": "skipped on cpu: CUDA graphs need a GPU",
}
CONFIGS = ("cold", "torch local-warm", "warmstart producer", "warmstart new machine")
WARM_CONFIGS = CONFIGS[1:]
RTOL, ATOL = 1e-4, 1e-6
NO_CUDA = "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"
JOB_TIMEOUT_S = 1800


# -- what the table is made of (pure) -----------------------------------------------------------


def compare(cold: dict, other: dict) -> str:
    """``exact`` (identical bytes), ``close`` (every summary figure within RTOL/ATOL) or ``differs``."""
    if other["digest"] == cold["digest"]:
        return "exact"
    a, b = cold["values"], other["values"]
    if len(a) == len(b) and all(abs(x - y) <= ATOL + RTOL * abs(x) for x, y in zip(a, b, strict=True)):
        return "close"
    return "differs"


def max_relative_difference(cold: dict, other: dict) -> float:
    """The largest ``|other - cold| / |cold|`` over the summary figures (inf when they do not line up)."""
    a, b = cold["values"], other["values"]
    if len(a) != len(b):
        return float("inf")
    return max(
        (abs(x - y) / abs(x) if x else (0.0 if x == y else float("inf")) for x, y in zip(a, b, strict=False)),
        default=0.0,
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is zero."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def store_stats(result: dict) -> dict:
    """warmstart's ``{tier: {kind: counts}}`` for a job: every process of it (compile workers
    included) when their merged stats file was read, else the job's own process."""
    return result.get("store_all_processes") or result.get("store") or {}


def remote_counts(result: dict, field: str) -> dict[str, int]:
    """``field`` (``hits``, ``misses``) of the shared (remote) tier per artifact kind, the kinds that had any."""
    remote = store_stats(result).get("remote", {})
    return {kind: int(c.get(field, 0)) for kind, c in sorted(remote.items()) if c.get(field, 0)}


def remote_hits(result: dict) -> dict[str, int]:
    """Hits from the shared (remote) tier per artifact kind, the kinds that had any."""
    return remote_counts(result, "hits")


def _notes(model: str, results: dict[str, dict]) -> list[str]:
    notes: list[str] = []
    new = results.get("warmstart new machine")
    if new is not None:
        hits = remote_hits(new)
        if hits:
            notes.append("shared-cache hits: " + ", ".join(f"{kind} {n}" for kind, n in hits.items()))
        else:
            notes.append("NO shared-cache hits")
        misses = remote_counts(new, "misses")
        if misses:  # what the new machine still compiled, and why it was slower than it could be
            notes.append("misses: " + ", ".join(f"{kind} {n}" for kind, n in misses.items()))
        if model == "dynamo-frames" or "dynamo_frames" in hits:
            # torch's stats.unique_graphs: 0 on the new machine means Dynamo's output was reused, not traced
            traced = [
                f"{label} {results[name].get('dynamo', {}).get('unique_graphs')}"
                for name, label in (("cold", "cold"), ("warmstart new machine", "new machine"))
                if name in results
            ]
            notes.append("graphs Dynamo traced: " + ", ".join(traced))
        skips = new.get("inductor", {}).get("cudagraph_skips", 0)
        if skips:
            notes.append(f"cudagraph skips {skips}")
    return notes


def summarize(
    model: str, results: dict[str, dict], errors: dict[str, str] | None = None, skipped: str | None = None
) -> dict:
    """One model's figures: seconds per configuration, the two ratios, how each warm result
    compares with cold's, notes, and whether the model passed (``ok``)."""
    errors = errors or {}
    if skipped:
        return {"model": model, "skipped": skipped, "ok": True, "notes": [skipped]}
    seconds = {name: results[name]["compile_s"] for name in CONFIGS if name in results}
    same: dict[str, str] = {}
    worst = 0.0
    if "cold" in results:
        for name in WARM_CONFIGS:
            if name in results:
                same[name] = compare(results["cold"], results[name])
                if same[name] != "exact":
                    worst = max(worst, max_relative_difference(results["cold"], results[name]))
    notes = [f"{name} FAILED" for name in CONFIGS if name in errors] + _notes(model, results)
    differs = [name for name, how in same.items() if how == "differs"]
    if differs:
        notes.insert(0, "differs from cold: " + ", ".join(differs) + f" (max rel. diff {worst:.2g})")
    ws = seconds.get("warmstart new machine")
    return {
        "model": model,
        "seconds": seconds,
        "ws_over_local_warm": ratio(ws, seconds.get("torch local-warm")),
        "ws_over_cold": ratio(ws, seconds.get("cold")),
        "same": same,
        "max_relative_difference": worst,
        "same_result": not errors and len(same) == len(WARM_CONFIGS) and not differs,
        "ok": not errors and not differs,
        "notes": notes,
        "errors": errors,
    }


def same_cell(summary: dict) -> str:
    """The table's "same result" cell."""
    if summary.get("skipped"):
        return "-"
    same = summary["same"]
    if any(how == "differs" for how in same.values()):
        return "NO"
    if len(same) < len(WARM_CONFIGS):
        return "?"  # a job failed: nothing to compare with
    if all(how == "exact" for how in same.values()):
        return "yes, exact"
    return f"yes, within {RTOL:g}"


def table_row(summary: dict) -> list[str]:
    """``model | cold s | torch local-warm s | warmstart new machine s | ws / local-warm | ws / cold
    | same result | notes`` as strings."""

    def secs(name: str) -> str:
        s = summary.get("seconds", {}).get(name)
        return "-" if s is None else f"{s:.2f}"

    def times(r: float | None, digits: int) -> str:
        return "-" if r is None else f"{r:.{digits}f}x"

    return [
        summary["model"],
        secs("cold"),
        secs("torch local-warm"),
        secs("warmstart new machine"),
        times(summary.get("ws_over_local_warm"), 2),
        times(summary.get("ws_over_cold"), 3),
        same_cell(summary),
        "; ".join(summary.get("notes", [])),
    ]


TABLE_COLUMNS = (
    "model",
    "cold s",
    "torch local-warm s",
    "warmstart new machine s",
    "ws / local-warm",
    "ws / cold",
    "same result",
    "notes",
)


def plan(models: list[str], device: str) -> tuple[list[str], dict[str, str]]:
    """The models to run on ``device``, and those skipped there with the reason."""
    if device == "cuda":
        return list(models), {}
    return [m for m in models if m not in CUDA_ONLY], {m: CUDA_ONLY[m] for m in models if m in CUDA_ONLY}


def machine_line(results: list[dict], device: str) -> str:
    """GPU name, torch and Triton versions (as the jobs saw them), CPU and Python."""
    seen = results[0] if results else {}
    parts = [f"GPU {seen.get('gpu') or 'unknown'}"] if device == "cuda" else ["CPU only (--device cpu)"]
    parts.append(f"torch {seen.get('torch') or 'unknown'}")
    parts.append(f"Triton {seen.get('triton') or 'not installed'}")
    parts.append(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    return ", ".join(parts)


# -- running the jobs ---------------------------------------------------------------------------


def run_job(machine: Path, model: str, device: str, env_extra: dict[str, str], timeout: float) -> dict:
    """Run ``gpu_job.py`` on ``machine``; its RESULT, plus the stats every process of it merged.

    Raises:
        RuntimeError: the job failed, timed out or printed no RESULT line.
    """
    from _new_machine import job_result, machine_env

    env = machine_env(machine, env_extra)
    try:
        proc = subprocess.run(
            [sys.executable, str(JOB), "--model", model, "--device", device],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{model} on {machine.name}: no result within {timeout:.0f} s") from None
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise RuntimeError(f"{model} on {machine.name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = job_result(proc.stdout)
    stats_file = machine / "warmstart" / "stats.json"
    if env_extra.get("WARMSTART") == "1" and stats_file.exists():
        from warmstart.compile_cache.stats import load

        merged = load(stats_file)
        result["store_all_processes"] = merged.to_dict()
        result["counters_all_processes"] = merged.counters_dict()
    return result


def check_model(
    model: str, device: str, work: Path, ws_env: dict[str, str], progress, timeout: float
) -> tuple[dict[str, dict], dict[str, str]]:
    """The four jobs of one model, in order; a job that fails is recorded and the next still runs
    (except those that need it: local-warm needs the cold machine, the new machine the producer)."""
    machines = {
        "cold": (work / f"{model}-cold", {}),
        "torch local-warm": (work / f"{model}-cold", {}),
        "warmstart producer": (work / f"{model}-ws-producer", ws_env),
        "warmstart new machine": (work / f"{model}-ws-new", ws_env),
    }
    needs = {"torch local-warm": "cold", "warmstart new machine": "warmstart producer"}
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for name in CONFIGS:
        if needs.get(name) in errors:
            errors[name] = f"not run: {needs[name]} failed"
            continue
        progress(f"{model}: {name}")
        machine, env_extra = machines[name]
        try:
            results[name] = run_job(machine, model, device, env_extra, timeout)
        except RuntimeError as exc:
            errors[name] = str(exc)
    return results, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(ALL_MODELS)}")
    parser.add_argument("--json", default=None, help="write all figures here (again after each model)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S, help="seconds one job may take")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ALL_MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL_MODELS)}")
    if args.device == "cuda":
        import torch  # only torch: nothing is started on a machine without a GPU

        if not torch.cuda.is_available():
            print(NO_CUDA)
            return 0

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from _redis import RedisNode
    from rich.console import Console
    from rich.table import Table

    from warmstart.compile_cache.signing import generate_key_pair

    to_run, skipped = plan(models, args.device)
    console = Console(width=200)
    work = Path(tempfile.mkdtemp(prefix="ws-gpu-check-"))
    key_file = work / "signing.key"
    generate_key_pair(key_file, work / "verify.pub")
    redis = RedisNode(work / "redis").start()
    ws_env = {"WARMSTART": "1", "WARMSTART_CACHE_URL": redis.url, "WARMSTART_KEY_FILE": str(key_file)}
    out: dict = {"device": args.device, "tolerance": {"rtol": RTOL, "atol": ATOL}, "models": {}}
    try:
        with console.status("") as status:
            for model in to_run:
                # compiled frames are off by default: the model that checks them turns them on
                env = dict(ws_env, WARMSTART_DYNAMO="1") if model == "dynamo-frames" else ws_env
                results, errors = check_model(
                    model, args.device, work, env, lambda msg: status.update(f"compiling {msg}"), args.timeout
                )
                out["models"][model] = {"results": results, "errors": errors}
                if args.json:  # after each model: a run stopped part-way keeps what it measured
                    Path(args.json).write_text(json.dumps(out, indent=1))
                row = table_row(summarize(model, results, errors))
                cells = zip(TABLE_COLUMNS[1:], row[1:], strict=True)
                console.print(f"{model}: " + ", ".join(f"{column} {cell}" for column, cell in cells))
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"compile + first step on new machines ({args.device}), seconds", title_justify="left")
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column in ("model", "same result", "notes") else "right")
    ok = True
    for model in models:
        entry = out["models"].setdefault(model, {"results": {}, "errors": {}})
        entry["summary"] = summarize(model, entry["results"], entry["errors"], skipped.get(model))
        ok = ok and entry["summary"]["ok"]
        table.add_row(*table_row(entry["summary"]))
    console.print(table)
    colds = [e["results"]["cold"] for e in out["models"].values() if "cold" in e["results"]]
    out["machine"] = machine_line(colds, args.device)
    console.print(f"machine: {out['machine']}")
    console.print(
        f"same result: 'exact' = identical bytes; 'within {RTOL:g}' = every summary figure within "
        f"relative {RTOL:g} (absolute {ATOL:g}) of cold's"
    )
    for model, entry in out["models"].items():
        for name, error in entry["errors"].items():
            console.print(f"{model}, {name}: {error}", markup=False, highlight=False)
    out["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
