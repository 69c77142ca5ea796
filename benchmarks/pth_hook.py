"""Cost of warmstart's ``.pth`` start-up hook with ``WARMSTART`` unset (milliseconds per start-up).

Each sample is a fresh interpreter started without the site module (``-S``) that then processes a
directory holding only ``warmstart.pth`` with ``site.addsitedir`` and times it: exactly the work
the hook adds to every interpreter start-up. A second set of samples times the same for an empty
directory, the floor. Also reports ``WARMSTART=1`` for comparison (hooks installed, nothing imported
from torch).

    python benchmarks/pth_hook.py [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SNIPPET = """
import sys, time
sys.path.insert(0, {root!r})
import site
t = time.perf_counter()
site.addsitedir({dir!r})
print((time.perf_counter() - t) * 1e3)
"""


def sample(directory: Path, env: dict[str, str]) -> float:
    code = _SNIPPET.format(root=str(ROOT), dir=str(directory))
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    empty, hooked = work / "empty", work / "hooked"
    empty.mkdir()
    hooked.mkdir()
    shutil.copy(ROOT / "warmstart.pth", hooked / "warmstart.pth")
    env_off = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    env_on = dict(env_off, WARMSTART="1")
    rows = {
        "empty dir (floor)": [sample(empty, env_off) for _ in range(args.runs)],
        "warmstart.pth, WARMSTART unset": [sample(hooked, env_off) for _ in range(args.runs)],
        "warmstart.pth, WARMSTART=1": [sample(hooked, env_on) for _ in range(max(5, args.runs // 5))],
    }
    floor = statistics.median(rows["empty dir (floor)"])
    print(f"{'case':34} {'median ms':>10} {'p90 ms':>8} {'added ms':>9}")
    for name, values in rows.items():
        med = statistics.median(values)
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"{name:34} {med:10.3f} {p90:8.3f} {med - floor:9.3f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
