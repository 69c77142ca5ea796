"""Edits: how much of a cold compile a new machine pays after a small code change, when the shared
cache holds the previous version of the model.

The model is a dense tower of five stages of different widths (``Tower`` in ``compile_job.py``), and
each edit is one a researcher's next job makes: ``act`` (one stage's activation), ``deeper`` (one more
stage), ``wider`` (one stage's hidden layer twice as wide). For each edit and each way of compiling
(``whole``: ``torch.compile(model)``; ``regional``: each stage compiled on its own), on brand-new
machines:

* ``cold``: the edited model, nothing cached;
* ``after edit``: the edited model, warmstart's shared cache filled by another new machine that
  compiled the previous version.

Usage::

    python benchmarks/compile_edits.py [--edits act,deeper,wider] [--json FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _new_machine import JOB, MACHINE, finish, job_result, machine_env

STRUCTURES = {"whole": [], "regional": ["--regional"]}


def run(machine: Path, model: str, structure: str, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, str(JOB), "--model", model, *STRUCTURES[structure]],
        env=machine_env(machine, env),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{model} ({structure}) on {machine.name} failed:\n{proc.stderr[-3000:]}")
    return job_result(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edits", default="act,deeper,wider")
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from _redis import RedisNode

    console = Console(width=160)
    edits = args.edits.split(",")
    work = Path(tempfile.mkdtemp(prefix="ws-bench-edits-"))
    out: dict = {"machine": MACHINE, "results": {}}
    with console.status("") as status:
        for structure in STRUCTURES:
            node = RedisNode(work / f"redis-{structure}").start()
            ws = {"WARMSTART": "1", "WARMSTART_CACHE_URL": node.url, "WARMSTART_SECRET": "bench"}
            try:
                status.update(f"{structure}: the previous version fills the shared cache")
                previous = run(work / f"{structure}-previous", "tower", structure, ws)
                for edit in edits:
                    model = f"tower-{edit}"
                    status.update(f"{structure}, {edit}: cold")
                    cold = run(work / f"{structure}-{edit}-cold", model, structure, {})
                    status.update(f"{structure}, {edit}: after the edit, on a new machine")
                    warm = run(work / f"{structure}-{edit}-after", model, structure, ws)
                    out["results"][f"{structure}/{edit}"] = {
                        "previous": previous,
                        "cold": cold,
                        "after_edit": warm,
                        "ratio": warm["compile_s"] / cold["compile_s"],
                        "same_loss": warm["losses"] == cold["losses"],
                    }
            finally:
                node.stop()

    table = Table(title="compile + first step of an edited tower on a new machine, seconds", title_justify="left")
    for column in (
        "edit",
        "compiled",
        "cold",
        "after edit",
        "after edit / cold",
        "vs whole cold",
        "graphs hit/missed",
        "frames read",
        "same loss",
    ):
        table.add_column(column, justify="left" if column in ("edit", "compiled") else "right")
    for edit in edits:
        whole_cold = out["results"][f"whole/{edit}"]["cold"]["compile_s"]
        for structure in STRUCTURES:
            r = out["results"][f"{structure}/{edit}"]
            hits, misses = _graphs(r["after_edit"])
            r["vs_whole_cold"] = r["after_edit"]["compile_s"] / whole_cold
            table.add_row(
                edit,
                structure,
                f"{r['cold']['compile_s']:.1f}",
                f"{r['after_edit']['compile_s']:.1f}",
                f"{r['ratio']:.2f}x",
                f"{r['vs_whole_cold']:.2f}x",
                f"{hits}/{misses}",
                str(
                    sum(
                        tier.get("dynamo_frames", {}).get("hits", 0)
                        for tier in r["after_edit"].get("store", {}).values()
                    )
                ),
                "yes" if r["same_loss"] else "NO",
            )
    finish(console, [table], out, args.json)


def _graphs(result: dict) -> tuple[int, int]:
    """Compiled graphs found / compiled again, as AOTAutograd's entries (a forward and its backward each)."""
    aot = result.get("aot_autograd", {})
    return aot.get("autograd_cache_hit", 0), aot.get("autograd_cache_miss", 0)


if __name__ == "__main__":
    main()
