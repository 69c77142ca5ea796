"""Synthetic but realistic ETT run directories for the metrics benchmarks (written fast, as raw lines)."""

from __future__ import annotations

import random
from pathlib import Path

from warmstart.metrics.event_files import file_name

T0 = 1_700_000_000.0


def write_run(
    run_dir: Path,
    job: str,
    steps: int,
    *,
    ranks: int = 1,
    attempts: int = 2,
    devices: int = 8,
    seed: int = 0,
    step_s: float = 0.1,
) -> int:
    """Write a job of ``attempts`` attempts (all but the last fail), ``steps`` steps per rank in total,
    start-up spans, a checkpoint every 100 steps and an eval every 1000. Returns the number of events."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    per_attempt = max(1, steps // attempts)
    for rank in range(ranks):
        t = T0
        step = 0
        for attempt in range(attempts):
            head = f'"job":"{job}","attempt":{attempt},"rank":{rank},"event":'
            lines = [f'{{"ts":{t!r},{head}"attempt_start","devices":{devices}}}']
            for name, seconds in (("process_group_init", 3.0), ("data_loader_init", 5.0), ("compile", 40.0)):
                lines.append(f'{{"ts":{t!r},{head}"begin","span":"{name}"}}')
                t += seconds * rng.uniform(0.8, 1.2)
                lines.append(f'{{"ts":{t!r},{head}"end","span":"{name}"}}')
            committed = step - step % 100
            step = committed
            for _ in range(per_attempt):
                lines.append(f'{{"ts":{t!r},{head}"step","step":{step},"samples":512}}')
                t += step_s * rng.uniform(0.9, 1.1)
                if step % 100 == 99:
                    lines.append(f'{{"ts":{t!r},{head}"begin","span":"checkpoint_save"}}')
                    t += 0.5
                    lines.append(f'{{"ts":{t!r},{head}"end","span":"checkpoint_save"}}')
                    lines.append(f'{{"ts":{t!r},{head}"checkpoint_committed","step":{step}}}')
                if step % 1000 == 999:
                    lines.append(f'{{"ts":{t!r},{head}"begin","span":"eval"}}')
                    t += 2.0
                    lines.append(f'{{"ts":{t!r},{head}"end","span":"eval"}}')
                step += 1
            if attempt < attempts - 1:
                lines.append(f'{{"ts":{t!r},{head}"failure","reason":"NCCL timeout","category":"infra"}}')
                t += 30.0
            else:
                lines.append(f'{{"ts":{t!r},{head}"train_end"}}')
                t += 60.0
            lines.append(f'{{"ts":{t!r},{head}"attempt_end"}}')
            t += 60.0
            (run_dir / file_name(rank, attempt)).write_text("\n".join(lines) + "\n")
            total += len(lines)
    return total
