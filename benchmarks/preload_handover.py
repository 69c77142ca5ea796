"""What a start costs with and without the preloader: ``python -c pass`` and ``python -c "import
torch, torchrec, torch._dynamo"``, each started as a new process the way a launcher starts a rank.

Configurations, interleaved in each round (rotating order), all with ``WARMSTART=1`` except the first:

* ``python``: plain Python, no warmstart (what a program pays for its interpreter alone);
* ``warmstart``: ``WARMSTART_PRELOAD=0``, a new interpreter with warmstart's start-up hook;
* ``preloaded``: handed over to a preloader that serves this environment.

Figures per run: the whole process's wall time as its launcher sees it, and the time until the
program's first line runs (``start``: it prints ``time.time()`` first). Medians over ``--repeats``
rounds; the ratios are of medians measured in the same rounds. The preloader's own start-up (once,
before the rounds) is reported apart. Usage::

    python benchmarks/preload_handover.py [--repeats 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _new_machine import MACHINE, finish

PROGRAMS = {
    "pass": "import time; print(time.time())",
    "import torch, torchrec, torch._dynamo": "import time; print(time.time()); import torch, torchrec, torch._dynamo",
}
CONFIGS = ("python", "warmstart", "preloaded")


def run(code: str, env: dict[str, str]) -> dict:
    launched = time.time()
    start = time.perf_counter()
    # start_new_session: started as a launcher starts ranks, without a controlling terminal (a process
    # started at one is not handed over)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, start_new_session=True
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return {"wall_s": wall, "start_s": float(out.stdout.split()[0]) - launched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from warmstart.preload import control

    work = Path(tempfile.mkdtemp(prefix="ws-bench-preload-"))
    work.chmod(0o700)
    base = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    base["WARMSTART_PRELOAD_SOCKET"] = str(work / "preload.sock")
    envs = {
        "python": base,
        "warmstart": {**base, "WARMSTART": "1", "WARMSTART_PRELOAD": "0"},
        "preloaded": {**base, "WARMSTART": "1"},
    }
    console = Console(width=150)
    t = time.perf_counter()
    info = control.start(environ=base)
    preload_start_s = time.perf_counter() - t
    out: dict = {
        "machine": MACHINE,
        "preload_start_s": preload_start_s,
        "preload_imports_s": info["imports_s"],
        "programs": {},
    }
    try:
        with console.status("") as status:
            for label, code in PROGRAMS.items():
                runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
                repeats = args.repeats if label == "pass" else max(3, args.repeats // 3)
                for r in range(repeats):
                    for name in CONFIGS[r % 3 :] + CONFIGS[: r % 3]:
                        status.update(f"{label}: {name} ({r + 1}/{repeats})")
                        runs[name].append(run(code, envs[name]))
                out["programs"][label] = {
                    "runs": runs,
                    "median": {
                        n: {k: statistics.median(x[k] for x in runs[n]) for k in ("wall_s", "start_s")} for n in CONFIGS
                    },
                }
        served = control.status(base["WARMSTART_PRELOAD_SOCKET"]) or {}
        out["served"], out["refused"] = served.get("served"), served.get("refused")
    finally:
        control.stop(base["WARMSTART_PRELOAD_SOCKET"])
        shutil.rmtree(work, ignore_errors=True)

    table = Table(
        title=f"one process start, ms: medians ({args.repeats} rounds for pass, fewer for the imports)",
        title_justify="left",
    )
    for column in ("program", "figure", *CONFIGS, "preloaded - warmstart", "preloaded / warmstart"):
        table.add_column(column, justify="left" if column in ("program", "figure") else "right")
    for label, result in out["programs"].items():
        m = result["median"]
        for key, name in (("wall_s", "whole process"), ("start_s", "until the program runs")):
            a, b = m["warmstart"][key], m["preloaded"][key]
            table.add_row(
                label, name, *[f"{m[n][key] * 1000:.0f}" for n in CONFIGS], f"{(b - a) * 1000:+.0f}", f"{b / a:.3f}x"
            )
    console.print(
        f"preloader start-up (once, outside the figures): {preload_start_s:.1f} s "
        f"({info['imports_s']:.1f} s of imports); served {out['served']}, refused {out['refused']}"
    )
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
