"""Edits: how much of a cold compile a new machine pays after a small code change, when the shared
cache holds the previous version of the model.

The models (in ``compile_job.py``): a dense tower of five stages of different widths (``Tower``),
written region by region; and three models as most users compile them, whole: a 12-layer encoder
(``Encoder``), a DCN-style cross network and TorchRec's DeepFM (``CrossNetwork``, ``DeepFMNet``, from
``torchrec.modules``). Each edit is one a researcher's next job makes: ``act`` (an activation),
``deeper`` (one more layer or stage), ``wider`` (one hidden layer twice as wide). For each model, edit
and way of compiling (``whole``: ``torch.compile(model)``; ``regional``: each of the tower's stages
compiled on its own), on brand-new machines:

* ``cold``: the edited model, nothing cached;
* ``after edit``: the edited model, warmstart's shared cache filled by another new machine that
  compiled the previous version.

Usage::

    python benchmarks/compile_edits.py [--models tower,encoder,dcn,deepfm] [--edits act,deeper,wider] [--json FILE]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _new_machine import JOB, MACHINE, finish, job_result, machine_env

STRUCTURES = {"whole": [], "regional": ["--regional"]}
# Each model and the ways it is compiled: the tower is written region by region, the others are
# models as most users compile them, whole (an encoder, TorchRec's cross network and DeepFM).
FAMILIES = {
    "tower": ("whole", "regional"),
    "encoder": ("whole",),
    "dcn": ("whole",),
    "deepfm": ("whole",),
}


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
    parser.add_argument("--models", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    parser.add_argument("--edits", default="act,deeper,wider")
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from _redis import RedisNode
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    families, edits = args.models.split(","), args.edits.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}: use {', '.join(FAMILIES)}")
    work = Path(tempfile.mkdtemp(prefix="ws-bench-edits-"))
    out: dict = {"machine": MACHINE, "results": {}}
    try:
        with console.status("") as status:
            for structure in STRUCTURES:
                node = RedisNode(work / f"redis-{structure}").start()
                ws = {"WARMSTART": "1", "WARMSTART_CACHE_URL": node.url, "WARMSTART_SECRET": "bench"}
                try:
                    for family in families:
                        if structure not in FAMILIES[family]:
                            continue
                        where = f"{family}-{structure}"
                        status.update(f"{family}, {structure}: the previous version fills the shared cache")
                        previous = run(work / f"{where}-previous", family, structure, ws)
                        for edit in edits:
                            model = f"{family}-{edit}"
                            status.update(f"{family}, {structure}, {edit}: cold")
                            cold = run(work / f"{where}-{edit}-cold", model, structure, {})
                            status.update(f"{family}, {structure}, {edit}: after the edit, on a new machine")
                            warm = run(work / f"{where}-{edit}-after", model, structure, ws)
                            out["results"][f"{family}/{structure}/{edit}"] = {
                                "previous": previous,
                                "cold": cold,
                                "after_edit": warm,
                                "ratio": warm["compile_s"] / cold["compile_s"],
                                "same_loss": warm["losses"] == cold["losses"],
                            }
                finally:
                    node.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title="compile + first step of an edited model on a new machine, seconds", title_justify="left")
    for column in (
        "model",
        "edit",
        "compiled",
        "cold",
        "after edit",
        "after edit / cold",
        "vs whole cold",
        "graphs hit/missed",
        "C++ objects hit/built",
        "frames read",
        "same loss",
    ):
        table.add_column(column, justify="left" if column in ("model", "edit", "compiled") else "right")
    for family in families:
        for edit in edits:
            whole_cold = out["results"][f"{family}/whole/{edit}"]["cold"]["compile_s"]
            for structure in FAMILIES[family]:
                r = out["results"][f"{family}/{structure}/{edit}"]
                hits, misses = _graphs(r["after_edit"])
                objects_hit, objects_built = _cpp_objects(r["after_edit"])
                r["vs_whole_cold"] = r["after_edit"]["compile_s"] / whole_cold
                table.add_row(
                    family,
                    edit,
                    structure,
                    f"{r['cold']['compile_s']:.1f}",
                    f"{r['after_edit']['compile_s']:.1f}",
                    f"{r['ratio']:.2f}x",
                    f"{r['vs_whole_cold']:.2f}x",
                    f"{hits}/{misses}",
                    f"{objects_hit}/{objects_built}",
                    str(
                        sum(
                            tier.get("dynamo_frames", {}).get("hits", 0)
                            for tier in r["after_edit"].get("store", {}).values()
                        )
                    ),
                    "yes" if r["same_loss"] else "NO",
                )
    finish(console, [table], out, args.json)


def _cpp_objects(result: dict) -> tuple[int, int]:
    """Compiled C++ objects (kernels, and the precompiled header when one was needed) the job found in
    the shared cache / had to build."""
    remote = result.get("store", {}).get("remote", {}).get("cpp_object", {})
    return remote.get("hits", 0), remote.get("misses", 0)


def _graphs(result: dict) -> tuple[int, int]:
    """Compiled graphs found / compiled again, as AOTAutograd's entries (a forward and its backward each)."""
    aot = result.get("aot_autograd", {})
    return aot.get("autograd_cache_hit", 0), aot.get("autograd_cache_miss", 0)


if __name__ == "__main__":
    main()
